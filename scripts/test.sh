#!/usr/bin/env bash
# The whole test suite: starts what the tests need (scripts/test-env.sh), then runs every test of the
# workspace against the real servers, and ends with one summary line (its wall time and the five
# slowest test binaries before it). CI runs exactly this (.ci/run).
#
# The tests run under cargo-nextest, in three phases (.config/nextest.toml says which test goes
# where and why): the tests that leave the servers as they found them, side by side; then those that
# disturb RabbitMQ or Kafka, the two kinds side by side; then, one at a time, those that restart
# PostgreSQL or hold up every replication slot. TEST_THREADS (default 4) sets the first phase's width.
# The feature checks and the packaging run beside the phases, at the lowest priority.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
# Each step's wall time, printed at the end (where the suite's time goes).
steps=()
step_started=$started
step() {
  local now
  now=$(date +%s)
  steps+=("$(printf '%5d s  %s' $((now - step_started)) "$1")")
  step_started=$now
}
bash scripts/test-env.sh
step "set-up (scripts/test-env.sh)"
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "cargo-nextest is missing: cargo install --locked cargo-nextest"
  exit 1
fi
log=$(mktemp)
results=$(mktemp -d)
# The fault scenarios append their summary lines here; they are printed before the summary.
export FAULT_SCENARIO_REPORT
FAULT_SCENARIO_REPORT=$(mktemp)
trap 'rm -rf "$log" "$results" "$FAULT_SCENARIO_REPORT" "${background_log:-}"' EXIT
status=0
# Every test target, built once for the three phases.
cargo nextest run --workspace --all-features --locked --profile suite --no-run 2>&1 | tail -n 3 \
  || status=1
step "build"
# Beside the tests, at the lowest CPU priority and in a target directory of their own (so that the
# phases' cargo calls never wait for its lock): the feature gates and the packaging.
# They print their findings to $background_log and fail the suite when one fails.
# - Feature gates, by `cargo check` (a build under each feature set would prove nothing more): the
#   binary with each adapter alone and with none, and each adapter crate alone with its tests. A
#   check that fails, or that warns, fails the suite (its output shown).
# - Every published crate, the binary included, packages for crates.io (metadata, license files,
#   README; what the tarball holds).
# - What the README's install command builds (`cargo install --locked --path outbox-bin`: the
#   binary with its default features, from the lock file) checks cleanly; the binary the phases
#   built runs with an empty environment. (A second debug build of every dependency, for the
#   install itself, took the two cores from the tests for about four minutes and proved nothing
#   these do not.)
background_log=$(mktemp)
background() {
  export CARGO_TARGET_DIR=target/background
  local failed=0 out
  check_clean() {
    local what=$1
    shift
    if ! out=$(cargo check "$@" --locked 2>&1) || grep -qE '^(warning|error)' <<<"$out"; then
      grep -E '^(warning|error)' -A 12 <<<"$out" || tail -n 30 <<<"$out"
      echo "$what does not build cleanly"
      failed=1
    fi
  }
  for features in amqp kafka sqs ""; do
    check_clean "txoutbox with only the features [$features]" -p txoutbox --no-default-features --features "$features"
  done
  for crate in txoutbox-amqp txoutbox-kafka txoutbox-sqs; do
    check_clean "$crate alone" -p "$crate" --all-targets
  done
  if ! out=$(cargo package --workspace --exclude txoutbox-tests --no-verify --locked \
      --allow-dirty 2>&1 >/dev/null); then
    echo "$out"
    echo "a crate does not package (cargo package)"
    failed=1
  fi
  check_clean "the binary as cargo install builds it (default features)" -p txoutbox --bins
  return "$failed"
}
background >"$background_log" 2>&1 &
background_pid=$!
renice -n 19 -p "$background_pid" >/dev/null
: > "$log"
# The documentation's examples (nextest does not run doctests).
cargo test --workspace --all-features --locked --doc 2>&1 | tee -a "$log" || status=$?
step "doctests"
# The three phases; each leaves its JUnit report in $results.
quiet=(binary_id\(txoutbox-tests::fault_postgres\) binary_id\(txoutbox-tests::fault_slot\)
  binary_id\(txoutbox-tests::fault_large_transaction\))
loud=(binary_id\(txoutbox-tests::fault_connections\) binary_id\(txoutbox-amqp::faults\)
  binary_id\(txoutbox-amqp::broker_size_limit\) "(binary_id(txoutbox-tests::fault_broker) & test(/rabbitmq/))"
  binary_id\(txoutbox-tests::fault_resets\))
join() { local IFS='|'; echo "$*"; }
phase() {
  local name=$1
  shift
  # A report left by an earlier phase or run must not be read as this phase's.
  rm -f target/nextest/suite/junit.xml
  cargo nextest run --workspace --all-features --locked --profile suite --no-fail-fast \
    --hide-progress-bar "$@" 2>&1 | tee -a "$log" || status=1
  if [ -f target/nextest/suite/junit.xml ]; then
    cp target/nextest/suite/junit.xml "$results/$name.xml"
  else
    echo "phase $name wrote no test report (it did not run its tests)"
    status=1
  fi
  step "tests, phase $name"
}
phase calm -j "${TEST_THREADS:-4}" -E "not ($(join "${quiet[@]}" "${loud[@]}"))"
phase brokers -j 2 -E "$(join "${loud[@]}")"
phase postgres -j 1 -E "$(join "${quiet[@]}")"
# What ran beside the tests.
if ! wait "$background_pid"; then
  status=1
fi
cat "$background_log"
# The binary the phases built, as a user's shell starts it with nothing set.
if target/debug/outbox --version | grep -q 'adapters amqp,kafka,sqs' \
    && (cd "$results" && env -i "$OLDPWD/target/debug/outbox" config >/dev/null); then
  echo "the outbox binary runs with an empty environment"
else
  echo "the outbox binary does not run with an empty environment (env -i target/debug/outbox config)"
  status=1
fi
step "waiting for the feature checks and packaging (beside the tests)"
echo "fault scenarios:"
sort "$FAULT_SCENARIO_REPORT" | sed 's/^/  /'
# Counts: the doctests' result lines, and each phase's JUnit report (a test retried by nothing: one
# testcase each).
doc_passed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
doc_failed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
counts=$(python3 scripts/junit-summary.py counts "$results"/*.xml 2>/dev/null) || counts=""
if ! [[ "$counts" =~ ^[0-9]+\ [0-9]+$ ]]; then
  echo "the test reports could not be read"
  counts="0 0"
  status=1
fi
read -r passed failed <<<"$counts"
passed=$((passed + doc_passed))
failed=$((failed + doc_failed))
if grep -qE '^test .+ \.\.\. FAILED$' "$log" || [ "$failed" -gt 0 ]; then
  echo "failed tests:"
  grep -E '^test .+ \.\.\. FAILED$' "$log" | sed -E 's/^test (.+) \.\.\. FAILED$/  \1/' || true
  python3 scripts/junit-summary.py failures "$results"/*.xml | sed 's/^/  /'
fi
echo "slowest test binaries (seconds of their tests, added up):"
python3 scripts/junit-summary.py slowest "$results"/*.xml | sed 's/^/  /'
echo "where the time went:"
printf '  %s\n' "${steps[@]}"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "wall time: $(( $(date +%s) - started )) s"
echo "summary: $passed passed, $failed failed"
exit "$status"
