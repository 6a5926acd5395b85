#!/usr/bin/env bash
# The coordinator's robustness tests (test/daemon/test_robust.py, meson test coord-robust) and its
# HTTP API tests (test/daemon/test_http.py, coord-http)
# against an ASan/UBSan build of stepd and the worker (build directory build-asan): engine
# refusals, capacity, bursts of 1-20 ms deadlines and of resets 0-10 ms after sending, and
# the many-streams run, at the sizes below (a sanitizer build is 3-10x slower).  Any
# sanitizer report fails the run: ASan and UBSan abort the process, LeakSanitizer fails
# its exit status.  CI runs this (.ci/run); so can anyone: bash tools/dev/test-asan.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${ASAN_BUILD:-build-asan}
export PATH="$PWD/.venv/bin:$PATH"
export ROBUST_BURST=${ROBUST_BURST:-3000} ROBUST_STREAMS=${ROBUST_STREAMS:-500}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}

if [ ! -f "$BUILD/build.ninja" ]; then
  meson setup "$BUILD" -Db_sanitize=address,undefined -Dcuda=disabled >/dev/null ||
    { echo "== meson setup $BUILD (ASan/UBSan) failed"; exit 1; }
fi
ninja -C "$BUILD" daemon/stepd worker/stepd-worker test/daemon/mock-engine test/daemon/loadgen \
  test/daemon/slow-client tools/stepctl >/dev/null || { echo "== the ASan/UBSan build failed"; exit 1; }
echo "== coord-robust and coord-http (the HTTP API) against the ASan/UBSan build ($BUILD): bursts of $ROBUST_BURST calls, $ROBUST_STREAMS streams"
meson test -C "$BUILD" --no-rebuild --print-errorlogs coord-robust coord-http
