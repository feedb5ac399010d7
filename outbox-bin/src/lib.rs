//! The `outbox` command, as a library: configuration loading, the adapters' wiring and the
//! subcommands (the relay's metrics and operations endpoint are `txoutbox_postgres::ops`). `main.rs` only parses the arguments and calls [`cli::run`].
#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod adapters;
pub mod bench;
pub mod build_info;
pub mod cli;
pub mod config;
pub mod http;
pub mod target;
