#!/usr/bin/env bash
# The whole test suite: install what it needs (tools/dev/install-deps.sh, idempotent),
# configure (or reconfigure a build whose Python lacks the test tools), build, run every
# suite except benchmarks, and end with one line "N passed, N failed, N skipped".
# BUILD names the build directory (default build); SETUP_ARGS are meson options for it (e.g.
# -Dcuda=disabled, .ci/run's stage without the CUDA toolkit); arguments go to meson test (test
# names, --suite).  Test names alone build only what those tests need; no arguments, or any
# option among them, build the whole tree.
#
# Only tests of hardware this host does not have may skip: suite 'gpu' (no GPU) and suite
# 'isa' (a CPU dispatch level above this host's).  Any other skip - a missing test tool,
# program or file - is counted as failed and named, with the reason the test printed.
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
read -r -a SETUP <<< "${SETUP_ARGS:-}"
export PATH="$PWD/.venv/bin:$PATH"
fail() { echo "$1"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }

bash tools/dev/install-deps.sh || fail "== installing the test dependencies failed"
tools_py='import grpc, grpc_tools, grpc_health, jinja2, tokenizers, yaml, numpy, kubernetes_validate, openai'
if [ -f "$BUILD/build.ninja" ]; then
  py=$(cat "$BUILD/test/test-python.txt" 2>/dev/null || true)
  if [ -z "$py" ] || ! "$py" -c "$tools_py" 2>/dev/null; then
    echo "== $BUILD runs its tests with Python '${py:-unknown}', which lacks the test tools: reconfiguring"
    meson setup --reconfigure "$BUILD" "${SETUP[@]}" || fail "== meson setup --reconfigure $BUILD failed"
  fi
else
  meson setup "$BUILD" "${SETUP[@]}" || fail "== meson setup $BUILD failed"
fi
# named tests (no options among the arguments: .ci/run's stage without the CUDA toolkit):
# only the programs they need (tools/dev/test-targets.py); otherwise the whole tree
targets=()
if [ $# -gt 0 ] && ! printf '%s\n' "$@" | grep -q '^-'; then
  ninja -C "$BUILD" build.ninja >/dev/null || fail "== regenerating $BUILD/build.ninja failed"
  t=$(/usr/bin/python3 tools/dev/test-targets.py "$BUILD" "$@") ||
    fail "== tools/dev/test-targets.py $BUILD $* failed"
  [ -n "$t" ] || fail "== no programs to build for the tests $*"
  mapfile -t targets <<< "$t"
fi
ninja -C "$BUILD" "${targets[@]}" || fail "== the build failed"

log=$(mktemp)
meson test -C "$BUILD" --no-suite bench --print-errorlogs --num-processes 2 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
rm -f "$log"
# the failed tests' output once more at the end, where the tail CI keeps shows it
[ "$rc" = 0 ] || /usr/bin/python3 tools/dev/failed-logs.py "$BUILD/meson-logs/testlog.json" 30
# Count from meson's own record of this run: one JSON object per test.
/usr/bin/python3 - "$BUILD/meson-logs/testlog.json" "$rc" <<'PY'
import json, sys

ok = failed = skipped = 0
bad_skips = []
for line in open(sys.argv[1]):
    t = json.loads(line)
    suites = t["name"].split(" / ")[0].split(":", 1)[-1].split("+")
    res = t["result"]
    if res == "OK" or res == "EXPECTEDFAIL":
        ok += 1
    elif res == "SKIP":
        if "gpu" in suites or "isa" in suites:
            skipped += 1
        else:
            why = [l for l in (t.get("stdout") or "").splitlines() if l.strip()]
            bad_skips.append((t["name"], why[-1] if why else "(no reason printed)"))
    else:
        failed += 1
for name, why in bad_skips:
    print("FAILED (skipped, but only GPU and CPU-level tests may skip here): %s: %s" % (name, why))
failed += len(bad_skips)
if int(sys.argv[2]) != 0 and failed == 0:
    failed = 1
print("%d passed, %d failed, %d skipped" % (ok, failed, skipped))
sys.exit(1 if failed else 0)
PY
