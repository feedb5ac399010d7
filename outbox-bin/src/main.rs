//! The `outbox` command.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = outbox_bin::cli::Cli::parse();
    outbox_bin::cli::run(cli, std::env::vars().collect())
}
