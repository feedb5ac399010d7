//! Build facts for `outbox --version`, the start-up log line and the `outbox_build_info` gauge:
//! the commit (`OUTBOX_COMMIT` when set, as an image build passes it; else git's, when building
//! from a checkout; else `unknown`) and the adapters compiled in.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=OUTBOX_COMMIT");
    let commit = std::env::var("OUTBOX_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]))
        .unwrap_or_else(|| "unknown".into());
    // Built again when HEAD moves, in a checkout (the files that exist: a missing one would
    // rebuild every time).
    if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
        let mut watched = vec![format!("{dir}/HEAD"), format!("{dir}/packed-refs")];
        if let Ok(head) = std::fs::read_to_string(format!("{dir}/HEAD")) {
            if let Some(r) = head.strip_prefix("ref: ") {
                watched.push(format!("{dir}/{}", r.trim()));
            }
        }
        for path in watched {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    }
    let adapters: Vec<&str> = [
        ("amqp", "CARGO_FEATURE_AMQP"),
        ("kafka", "CARGO_FEATURE_KAFKA"),
        ("sqs", "CARGO_FEATURE_SQS"),
    ]
    .iter()
    .filter(|(_, var)| std::env::var_os(var).is_some())
    .map(|(name, _)| *name)
    .collect();
    let adapters = if adapters.is_empty() {
        "none".to_string()
    } else {
        adapters.join(",")
    };
    println!("cargo:rustc-env=OUTBOX_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=OUTBOX_BUILD_ADAPTERS={adapters}");
}
