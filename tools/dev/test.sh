#!/usr/bin/env bash
# The whole test suite: configure (if needed), build, run every suite except benchmarks,
# and end with one line "N passed, N failed" (N skipped when GPU tests skip).
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
export PATH="$PWD/.venv/bin:$PATH"

if [ ! -f "$BUILD/build.ninja" ]; then
  meson setup "$BUILD" || { echo "0 passed, 1 failed"; exit 1; }
fi
ninja -C "$BUILD" || { echo "0 passed, 1 failed"; exit 1; }

log=$(mktemp)
meson test -C "$BUILD" --no-suite bench --print-errorlogs --num-processes 2 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
ok=$(sed -n 's/^Ok: *\([0-9]*\).*/\1/p' "$log" | tail -1)
fail=$(sed -n 's/^Fail: *\([0-9]*\).*/\1/p' "$log" | tail -1)
xfail=$(sed -n 's/^Unexpected Pass: *\([0-9]*\).*/\1/p' "$log" | tail -1)
tout=$(sed -n 's/^Timeout: *\([0-9]*\).*/\1/p' "$log" | tail -1)
skip=$(sed -n 's/^Skipped: *\([0-9]*\).*/\1/p' "$log" | tail -1)
rm -f "$log"
failed=$(( ${fail:-0} + ${xfail:-0} + ${tout:-0} ))
if [ "$rc" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "${ok:-0} passed, ${failed} failed, ${skip:-0} skipped"
[ "$failed" -eq 0 ]
