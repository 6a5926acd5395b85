#!/usr/bin/env bash
# The unit and integration suites against an ASan/UBSan build of what they run (build
# directory build-asan, no CUDA), in two parts:
#   1. coord-robust at the sizes below (a sanitizer build is 3-10x slower): engine refusals,
#      capacity, bursts of 1-20 ms deadlines and of resets 0-10 ms after sending, the
#      many-streams run;
#   2. every other test of the suites 'unit' and 'integration' except those ASAN_SKIP names:
#      the numeric model, kernel, group-equivalence and checkpoint-generator runs (10-30x
#      slower here, whole minutes each - group-equivalence-n8 290 s - and their code is the
#      kernels' and the comm layer's, which the kernel, comm and group-fault tests cover at
#      small sizes), and the tests whose judgement is a timing or an RSS bound, which a sanitizer
#      build's quarantine and slowness make meaningless (load, key timing, floods, hygiene;
#      chaos-report repeats tests run here), the checks of the source tree itself (docs,
#      call graph, layers, commit subjects: Python reading files, nothing of the build's memory
#      to check; the README's suite runs them), the vision tower's goldens (numeric, like the
#      model runs; the image tests here run the tower) and the benchmarks' smoke runs (bench-*).  The HTTP API's tests (coord-http) are among them.
#   3. a 5-minute soak (test/chaos/report --profile soak --duration $ASAN_SOAK_S, default 300):
#      mixed traffic on both doors while ranks and the coordinator are killed and restarted;
#      it fails on a lost or duplicated terminal status and on any sanitizer line in a
#      process's log (ASAN_SOAK_S=0 skips it).
# Any sanitizer report fails the run: ASan and UBSan abort the process, LeakSanitizer fails
# its exit status (tools/dev/lsan.supp: third-party allocations only).  CI runs this
# (.ci/run); so can anyone: bash tools/dev/test-asan.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
BUILD=${ASAN_BUILD:-build-asan}
export PATH="$PWD/.venv/bin:$PATH"
export ROBUST_BURST=${ROBUST_BURST:-3000} ROBUST_STREAMS=${ROBUST_STREAMS:-500}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tools/dev/lsan.supp:print_suppressions=0}
ASAN_SKIP=${ASAN_SKIP:-'model-.*|group-equivalence.*|mkmodel.*|mtp-repair-.*|test-engine-prefix|test-engine-model.*|dryrun-.*|stepd-run-.*|kernels-.*|deploy-lint|coord-load-.*|coord-overload-busy-.*|rel-e3-.*|rel-c7-.*|rel-d4-.*|chaos-report-.*|docs.*|callgraph.*|layers.*|commits|vision-tiny-golden|bench-.*'}

if [ ! -f "$BUILD/build.ninja" ]; then
  meson setup "$BUILD" -Db_sanitize=address,undefined -Dcuda=disabled >/dev/null ||
    { echo "== meson setup $BUILD (ASan/UBSan) failed"; exit 1; }
fi
ninja -C "$BUILD" build.ninja >/dev/null || { echo "== regenerating $BUILD/build.ninja failed"; exit 1; }
tests=$(meson test -C "$BUILD" --no-rebuild --list --suite unit --suite integration 2>/dev/null |
  sed 's/.* \/ //' | grep -vxE "coord-robust|$ASAN_SKIP" | sort -u)
# only what the tests below and the soak (chaos-soak-20s's programs) run: not the skipped
# tests' programs (kernels, models, benchmarks) - the README's suite builds the whole tree
targets=$(/usr/bin/python3 tools/dev/test-targets.py "$BUILD" coord-robust $tests chaos-soak-20s) ||
  { echo "== tools/dev/test-targets.py $BUILD failed"; exit 1; }
ninja -C "$BUILD" $targets >/dev/null || { echo "== the ASan/UBSan build failed"; exit 1; }
echo "== coord-robust against the ASan/UBSan build ($BUILD): bursts of $ROBUST_BURST calls, $ROBUST_STREAMS streams"
meson test -C "$BUILD" --no-rebuild --print-errorlogs coord-robust || exit 1
echo "== $(echo "$tests" | wc -l) tests of 'unit' and 'integration' against $BUILD (skipped: $ASAN_SKIP)"
meson test -C "$BUILD" --no-rebuild --print-errorlogs --num-processes 2 $tests
rc=$?
# the failed tests' output again after the soak, where the tail CI keeps shows it
[ "$rc" = 0 ] || cp "$BUILD/meson-logs/testlog.json" "$BUILD/meson-logs/testlog-suite.json"
soak_s=${ASAN_SOAK_S:-300}
if [ "$soak_s" != 0 ]; then
  echo "== a ${soak_s}-second soak against $BUILD (test/chaos/report --profile soak)"
  BUILD="$BUILD" test/chaos/report --profile soak --duration "$soak_s" || rc=1
fi
[ "$rc" = 0 ] || /usr/bin/python3 tools/dev/failed-logs.py "$BUILD/meson-logs/testlog-suite.json" ||
  true
exit $rc
