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
    // Git's answer only for this workspace's own checkout (sources vendored inside another
    // repository would report that repository's commit).
    let workspace = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let own_checkout = git(&["rev-parse", "--show-toplevel"])
        .and_then(|top| std::fs::canonicalize(top).ok())
        .zip(std::fs::canonicalize(&workspace).ok())
        .is_some_and(|(top, ws)| top == ws);
    let commit = std::env::var("OUTBOX_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(|| {
            own_checkout
                .then(|| git(&["rev-parse", "--short=12", "HEAD"]))
                .flatten()
        })
        .unwrap_or_else(|| "unknown".into());
    // Built again when HEAD moves: HEAD itself (per worktree), and the branches, loose or packed
    // (shared by the worktrees). A missing path would rebuild every time: only those that exist.
    if own_checkout {
        let mut watched = Vec::new();
        if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
            watched.push(format!("{dir}/HEAD"));
        }
        if let Some(common) = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]) {
            watched.push(format!("{common}/packed-refs"));
            watched.push(format!("{common}/refs/heads"));
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
