//! The `outbox` command, as a library: configuration loading, Prometheus metrics, the operations
//! endpoint and the subcommands. `main.rs` only parses the arguments and calls [`cli::run`].
#![forbid(unsafe_code)]
#![doc = include_str!("../README.md")]

pub mod adapters;
pub mod bench;
pub mod build_info;
pub mod cleanup;
pub mod cli;
pub mod config;
pub mod health;
pub mod http;
pub mod metrics;
pub mod target;
