//! The `outbox` command (not implemented yet: see README.md).

fn main() {
    eprintln!(
        "outbox: the command-line relay is not built yet. Use the library crates, e.g. \
         `cargo run -p outbox-postgres --example orders_to_stdout`."
    );
    std::process::exit(2);
}
