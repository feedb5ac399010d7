//! Restarting and crashing the local PostgreSQL cluster.

use std::process::Command;

/// The PostgreSQL cluster's version directory under /etc/postgresql, for `pg_ctlcluster`.
pub fn pg_version() -> String {
    let mut versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
        .expect("restarting PostgreSQL needs a local cluster (/etc/postgresql)")
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("no PostgreSQL cluster under /etc/postgresql")
}

/// Restarts the local PostgreSQL cluster (every connection is cut).
pub fn restart_postgres() {
    pg_ctlcluster_restart(&[]);
}

/// Crashes the local PostgreSQL server and starts it again (`pg_ctlcluster ... restart -m
/// immediate`): no shutdown checkpoint, so the server recovers from its WAL, as after a power cut.
pub fn crash_postgres() {
    pg_ctlcluster_restart(&["-m", "immediate"]);
}

fn pg_ctlcluster_restart(options: &[&str]) {
    let status = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &pg_version(),
            "main",
            "restart",
        ])
        .args(options)
        .status()
        .expect("pg_ctlcluster is required to restart PostgreSQL");
    assert!(status.success(), "pg_ctlcluster restart {options:?} failed");
}
