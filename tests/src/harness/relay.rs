//! The real `outbox relay` as a child process: start, pause, signals, memory and CPU, and
//! where its log goes.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use txoutbox_postgres::testing::{database_url, sessions_holding_a_claim, url_named};
use txoutbox_postgres::OutboxTable;
use uuid::Uuid;

use super::sink::Sink;

/// The `outbox` binary built next to the tests.
pub fn outbox_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("outbox");
    assert!(
        path.exists(),
        "the outbox binary is not built at {}: run `cargo test --workspace`",
        path.display()
    );
    path
}

/// A relay process.
pub struct RelayProcess {
    pub child: Child,
    /// The `application_name` of its database sessions (`pg_stat_activity` tells them apart).
    pub tag: String,
}

impl RelayProcess {
    /// Starts `outbox relay` over `table`, publishing to `sink`, with `extra` settings; its log
    /// (stderr) goes to a file of its own under [`relay_log_dir`].
    pub fn start(table: &OutboxTable, sink: &Sink, extra: &[(&str, &str)]) -> RelayProcess {
        Self::start_at(&database_url(), table, sink, extra)
    }

    /// As [`RelayProcess::start`], its `database.url` being `url` (the test database through a
    /// pooler).
    pub fn start_at(
        url: &str,
        table: &OutboxTable,
        sink: &Sink,
        extra: &[(&str, &str)],
    ) -> RelayProcess {
        Self::spawn(
            Self::command_at(url, table),
            sink,
            extra,
            Self::log_file(table),
        )
    }

    /// As [`RelayProcess::start`], the relay's log (stderr) going to `log`.
    pub fn start_logging_to(
        table: &OutboxTable,
        sink: &Sink,
        extra: &[(&str, &str)],
        log: impl Into<Stdio>,
    ) -> RelayProcess {
        Self::spawn(Self::command(table), sink, extra, log)
    }

    fn spawn(
        (mut c, tag): (Command, String),
        sink: &Sink,
        extra: &[(&str, &str)],
        log: impl Into<Stdio>,
    ) -> RelayProcess {
        sink.configure(&mut c);
        c.envs(extra.iter().copied());
        let child = c.stdout(Stdio::null()).stderr(log.into()).spawn().unwrap();
        RelayProcess { child, tag }
    }

    /// As [`RelayProcess::start`], publishing to its standard output (`publisher.type = stdout`,
    /// a JSON line per event): a thread reads it and appends each line's event id to `received`,
    /// in order (a scenario whose volume a broker fixture would hold in memory whole).
    pub fn start_to_stdout(
        table: &OutboxTable,
        extra: &[(&str, &str)],
        received: std::sync::Arc<std::sync::Mutex<Vec<Uuid>>>,
    ) -> RelayProcess {
        let log = Self::log_file(table);
        let (mut c, tag) = Self::command(table);
        c.env("OUTBOX_PUBLISHER__TYPE", "stdout");
        for (k, v) in extra {
            c.env(k, v);
        }
        let mut child = c.stdout(Stdio::piped()).stderr(log).spawn().unwrap();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            #[derive(serde::Deserialize)]
            struct Line {
                id: Uuid,
            }
            use std::io::BufRead;
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                let line: Line = serde_json::from_str(&line).unwrap();
                received.lock().unwrap().push(line.id);
            }
        });
        RelayProcess { child, tag }
    }

    /// A log file of its own under [`relay_log_dir`].
    fn log_file(table: &OutboxTable) -> std::fs::File {
        let dir = relay_log_dir(table);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::File::create(dir.join(format!(
            "relay-{}.log",
            &Uuid::new_v4().simple().to_string()[..12]
        )))
        .unwrap()
    }

    /// The relay's command with the harness's settings, and its sessions' `application_name`.
    fn command(table: &OutboxTable) -> (Command, String) {
        Self::command_at(&database_url(), table)
    }

    /// As [`RelayProcess::command`], its `database.url` being `url`.
    fn command_at(url: &str, table: &OutboxTable) -> (Command, String) {
        let mut c = Command::new(outbox_bin());
        c.arg("relay").current_dir(std::env::temp_dir());
        for (k, _) in std::env::vars() {
            if k.starts_with("OUTBOX_") {
                c.env_remove(k);
            }
        }
        let (tag, url) = url_named(url, "outbox-test-relay");
        c.env("DATABASE_URL", url)
            .env("OUTBOX_DATABASE__SCHEMA", table.schema())
            .env("OUTBOX_HTTP__ENABLED", "false")
            .env("OUTBOX_RELAY__BATCH_SIZE", "100")
            .env("OUTBOX_RELAY__RETRY__INITIAL_BACKOFF", "200ms")
            .env("OUTBOX_RELAY__RETRY__MAX_BACKOFF", "2s")
            .env("OUTBOX_RELAY__RETRY__MAX_ATTEMPTS", "1000")
            .env("OUTBOX_LOG__LEVEL", "warn")
            .env_remove("RUST_LOG");
        (c, tag)
    }

    /// Whether the process has installed its SIGTERM handler (`SigCgt` in /proc): before that, a
    /// SIGTERM kills it like SIGKILL.
    pub fn handles_sigterm(&self) -> bool {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
        else {
            return false;
        };
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & (1 << (15 - 1)) != 0)
    }

    /// Whether one of its database sessions holds a claim while its batch is published
    /// ([`sessions_holding_a_claim`]).
    pub async fn in_transaction(&self, pg: &sqlx::PgPool) -> bool {
        sessions_holding_a_claim(pg, &self.tag).await > 0
    }

    /// Waits (at most `within`) until the relay holds a claim while publishing
    /// ([`RelayProcess::in_transaction`]); whether it did.
    pub async fn wait_in_transaction(&self, pg: &sqlx::PgPool, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if self.in_transaction(pg).await {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {} failed", self.child.id());
    }

    /// SIGSTOP: the process stands still (its connections stay open) until [`RelayProcess::resume`].
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The process's peak resident memory so far (`VmHWM` in /proc), in bytes.
    pub fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmHWM in /proc/<pid>/status")
            * 1024
    }

    /// CPU time the process has used so far (user + system), from /proc.
    pub fn cpu_time(&self) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        // Fields after the command name (which may hold spaces): state is the first, utime the 12th.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .unwrap()
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // The kernel's USER_HZ is 100 on Linux.
        Duration::from_millis(ticks * 10)
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, once the process handles it, then waits for the exit (at most `timeout`); returns
    /// the exit code.
    pub fn terminate(mut self, timeout: Duration) -> Option<i32> {
        // A process spawned a moment ago may not have installed its handler yet (SIGTERM would kill).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !self.handles_sigterm() && self.child.try_wait().unwrap().is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the relay did not install its SIGTERM handler within 60 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl RelayProcess {
    /// Waits (up to 60 s) for the relay to exit by itself (a refusal at start); its exit code.
    ///
    /// # Panics
    /// When it is still running after 60 s.
    pub fn exit_code(mut self) -> Option<i32> {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the relay did not exit"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Runs the `outbox` CLI with `args` and `env` (no other `OUTBOX_*` variable, warnings only);
/// its exit code and output (standard output, then standard error).
pub fn outbox_cli(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut c = Command::new(outbox_bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_") {
            c.env_remove(k);
        }
    }
    c.args(args)
        .current_dir(std::env::temp_dir())
        .env("OUTBOX_LOG__LEVEL", "warn")
        .envs(env.iter().copied());
    let out = c.output().unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where the relays of the scenario over `table` write their logs (one file each).
pub fn relay_log_dir(table: &OutboxTable) -> PathBuf {
    std::env::temp_dir().join(format!("outbox-test-relays-{}", table.schema()))
}

/// The lines of the logs of the relays over `table` that contain `text`.
pub fn logged(table: &OutboxTable, text: &str) -> usize {
    logged_where(table, |l| l.contains(text))
}

fn logged_where(table: &OutboxTable, matches: impl Fn(&str) -> bool) -> usize {
    let Ok(files) = std::fs::read_dir(relay_log_dir(table)) else {
        return 0;
    };
    files
        .filter_map(|f| std::fs::read_to_string(f.ok()?.path()).ok())
        .map(|log| log.lines().filter(|l| matches(l)).count())
        .sum()
}

/// The documented causes of a duplicate without a crash that the relays over `table` reported in
/// their logs (README, guarantee 3): a publish that timed out (the broker may have taken the events
/// anyway) and batches a shutdown deadline cut off.
pub fn duplicate_causes_logged(table: &OutboxTable) -> usize {
    logged_where(table, |l| {
        l.contains("timeout") || l.contains("timed out") || l.contains("shutdown deadline")
    })
}
