#!/usr/bin/env bash
# The whole test suite: starts what the tests need (scripts/test-env.sh), then runs every test of the
# workspace against the real servers. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-env.sh
cargo test --workspace --all-features --locked -- --test-threads="${TEST_THREADS:-4}"
