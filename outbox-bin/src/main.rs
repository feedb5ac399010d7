//! The `outbox` command.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    release_large_blocks();
    let cli = txoutbox::cli::Cli::parse();
    txoutbox::cli::run(cli, std::env::vars().collect())
}

/// Gives payload-sized memory back to the system as soon as it is freed.
///
/// The relay's payloads come and go a batch at a time. glibc's allocator raises its mmap threshold
/// to the largest block freed so far (up to 32 MiB): after the first large event, payload buffers are
/// carved from the heap instead, and the heap stays resident, fragmented, long after they are freed,
/// so the process grows well past what `relay.max_batch_bytes` bounds. A fixed threshold of 1 MiB
/// maps every larger block on its own and unmaps it when freed (the large-payload scenario in
/// `tests/tests/fault_large.rs` checks the resulting bound). An explicit `MALLOC_MMAP_THRESHOLD_` in
/// the environment wins.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_large_blocks() {
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some() {
        return;
    }
    #[allow(unsafe_code)]
    // SAFETY: `mallopt` only sets an allocator parameter; it is called first thing in `main`, before
    // any other thread exists, with a valid parameter and value.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_large_blocks() {}
