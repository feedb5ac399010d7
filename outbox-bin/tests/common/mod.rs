//! Helpers shared by the CLI tests: run the real `outbox` binary against the test servers.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use txoutbox_postgres::testing::{database_url, pool};
use txoutbox_postgres::OutboxTable;

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_outbox")
}

pub fn workdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("outbox-cli-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("config")
        .join(name)
}

#[allow(unused_imports)]
pub use txoutbox_postgres::testing::unmigrated_table;

#[allow(unused_imports)]
pub use txoutbox_core::testkit::free_port;

/// A command with a clean environment: the test database, this table, no stray OUTBOX_* variables.
pub fn outbox(table: &OutboxTable, args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.args(args).current_dir(workdir());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_") {
            c.env_remove(k);
        }
    }
    c.env("DATABASE_URL", database_url())
        .env("OUTBOX_DATABASE__SCHEMA", table.schema())
        .env("OUTBOX_HTTP__ENABLED", "false")
        .env("OUTBOX_LOG__FORMAT", "json")
        .env_remove("RUST_LOG");
    c
}

pub fn run(mut c: Command) -> Output {
    c.output().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn http_get(port: u16, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let status = body
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body)
}

pub fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0)
}

pub async fn insert_plain(table: &OutboxTable, aggregate: &str, n: usize) {
    let pool = pool(2).await;
    let sql = format!(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', $1, 'order.created', $2)",
        table.qualified()
    );
    let mut tx = pool.begin().await.unwrap();
    for i in 0..n {
        sqlx::query(&sql)
            .bind(aggregate)
            .bind(serde_json::json!({ "n": i }))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
}

/// A running `outbox relay` whose stdout lines are collected.
pub struct Running {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    pub logs: Arc<Mutex<Vec<String>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Running {
    pub fn start(mut c: Command) -> Running {
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let out = child.stdout.take().unwrap();
        let sink = lines.clone();
        let stdout_reader = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let err = child.stderr.take().unwrap();
        let logs: Arc<Mutex<Vec<String>>> = Arc::default();
        let log_sink = logs.clone();
        let stderr_reader = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[relay] {line}");
                log_sink.lock().unwrap().push(line);
            }
        });
        Running {
            child,
            lines,
            logs,
            readers: vec![stdout_reader, stderr_reader],
        }
    }

    /// Waits until everything the exited process wrote has been read.
    pub fn join_output(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_some(),
            "join_output: the process is still running"
        );
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
    }

    pub fn wait_lines(&self, n: usize, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.lines.lock().unwrap().clone();
            if got.len() >= n || Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until a line of standard output contains `needle`.
    pub fn wait_output(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self
            .lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
        {
            assert!(
                Instant::now() < deadline,
                "no output line with {needle:?}: {:?}",
                self.logs.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until a log line contains `needle`.
    pub fn wait_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.logs.lock().unwrap().iter().any(|l| l.contains(needle)) {
            assert!(Instant::now() < deadline, "no log line with {needle:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for the process to exit (at most `timeout`, then kills it and fails).
    pub fn wait_exit(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the relay did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (at most `within`) until at least `count` sessions named `name` hold a claim while their
/// batch is published (`txoutbox_postgres::testing::sessions_holding_a_claim`); panics with `what`.
pub async fn wait_for_held_claims(
    pg: &sqlx::PgPool,
    name: &str,
    count: i64,
    within: Duration,
    what: &str,
) {
    let deadline = Instant::now() + within;
    loop {
        let n = txoutbox_postgres::testing::sessions_holding_a_claim(pg, name).await;
        if n >= count {
            return;
        }
        assert!(Instant::now() < deadline, "{what} ({n} held)");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (up to 30 s) until process `pid` has installed its SIGTERM handler (`SigCgt` in /proc):
/// before that, a SIGTERM kills it like SIGKILL.
pub fn wait_handles_sigterm(pid: u32) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let handled = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|status| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix("SigCgt:"))
                    .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            })
            .is_some_and(|mask| mask & (1 << (15 - 1)) != 0);
        if handled {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} never installed its SIGTERM handler"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The deployment kit, `outbox-bin/deploy/`.
pub fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// A YAML file of the kit, parsed.
pub fn yaml(path: &std::path::Path) -> serde_yaml::Value {
    serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A checker installed by `scripts/test-env.sh` into `.tools/bin` (or named by `env_var`).
pub fn tool(name: &str, env_var: &str) -> PathBuf {
    if let Ok(path) = std::env::var(env_var) {
        return PathBuf::from(path);
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../.tools/bin")
        .join(name);
    assert!(
        path.exists(),
        "{name} is not installed: run `bash scripts/test-env.sh` (it installs {name} into .tools/bin), or set {env_var}"
    );
    path
}

/// Runs `c` and returns its standard output and error, failing the test (with both) when it fails.
pub fn check(mut c: Command, what: &str) -> String {
    let out = c.output().unwrap();
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{what} failed:\n{all}");
    all
}
