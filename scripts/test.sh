#!/usr/bin/env bash
# The whole test suite: starts what the tests need (scripts/test-env.sh), then runs every test of the
# workspace against the real servers, and ends with one summary line. CI runs exactly this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/test-env.sh
log=$(mktemp)
# The fault scenarios append their summary lines here; they are printed before the summary.
export FAULT_SCENARIO_REPORT
FAULT_SCENARIO_REPORT=$(mktemp)
trap 'rm -f "$log" "$FAULT_SCENARIO_REPORT"' EXIT
status=0
# The binary with each adapter alone, and with none: its feature gates stay honest (warnings fail too).
for features in amqp kafka sqs ""; do
  if cargo check -p txoutbox --no-default-features --features "$features" --locked 2>&1 \
      | grep -E '^(warning|error)'; then
    echo "txoutbox does not build cleanly with only the features [$features]"
    status=1
  fi
done
# Every published crate, the binary included, packages for crates.io (metadata, license files,
# README; what the tarball holds).
if ! cargo package --workspace --exclude txoutbox-tests --no-verify --locked \
    --allow-dirty >/dev/null 2>"$log"; then
  cat "$log"
  echo "a crate does not package (cargo package)"
  status=1
fi
# Each broker adapter alone, with only its own features (the publisher contract of the shared suite
# runs in its tests); then the rest of the workspace, every feature on. Every test binary runs
# whatever failed before it (--no-fail-fast); the exit status is non-zero if any test failed.
adapters=(txoutbox-amqp txoutbox-kafka txoutbox-sqs)
: > "$log"
for crate in "${adapters[@]}"; do
  cargo test -p "$crate" --locked --no-fail-fast -- --test-threads="${TEST_THREADS:-4}" 2>&1 | tee -a "$log" || status=$?
done
cargo test --workspace --all-features --locked --no-fail-fast "${adapters[@]/#/--exclude=}" \
  -- --test-threads="${TEST_THREADS:-4}" 2>&1 | tee -a "$log" || status=$?
# The README's install command works from this checkout (a debug build in the suite's target
# directory, so it reuses what the tests built), and the installed binary runs.
install_root=$(mktemp -d)
if cargo install --locked --debug --path outbox-bin --root "$install_root" --target-dir target \
    >"$install_root/log" 2>&1 \
    && "$install_root/bin/outbox" --version | grep -q 'adapters amqp,kafka,sqs' \
    && (cd "$install_root" && env -i "$install_root/bin/outbox" config >/dev/null); then
  echo "cargo install --path outbox-bin: installed and runs"
else
  cat "$install_root/log"
  echo "cargo install --path outbox-bin failed, or the installed binary does not run"
  status=1
fi
rm -rf "$install_root"
echo "fault scenarios:"
sort "$FAULT_SCENARIO_REPORT" | sed 's/^/  /'
passed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) passed.*/\1/' | awk '{s+=$1} END {print s+0}')
failed=$(grep -E '^test result:' "$log" | sed -E 's/.* ([0-9]+) failed.*/\1/' | awk '{s+=$1} END {print s+0}')
if grep -qE '^test .+ \.\.\. FAILED$' "$log"; then
  echo "failed tests:"
  grep -E '^test .+ \.\.\. FAILED$' "$log" | sed -E 's/^test (.+) \.\.\. FAILED$/  \1/'
fi
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "summary: $passed passed, $failed failed"
exit "$status"
