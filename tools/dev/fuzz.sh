#!/usr/bin/env bash
# Every libFuzzer target of the tree for SECONDS each (default 20): a CC=clang -Dfuzz=true
# build of just the fuzz targets (build directory build-fuzz, or $FUZZ_BUILD), then meson's
# suite 'fuzz' (one bounded run per target, test/fuzz/run-fuzz.sh), then one line per target
# with the executions and the coverage it reached (two targets at a time, one core each).  Any
# crash or sanitizer report fails.
#   bash tools/dev/fuzz.sh          # CI (.ci/run): 20 s each
#   bash tools/dev/fuzz.sh 600      # by hand: ten minutes each
set -uo pipefail
cd "$(dirname "$0")/../.."
SECS=${1:-20}
BUILD=${FUZZ_BUILD:-build-fuzz}
export PATH="$PWD/.venv/bin:$PATH"

if [ ! -f "$BUILD/build.ninja" ]; then
  CC=clang CXX=clang++ meson setup "$BUILD" -Dfuzz=true -Dcuda=disabled >/dev/null ||
    { echo "== meson setup $BUILD (clang, -Dfuzz=true) failed"; exit 1; }
fi
targets=$(meson introspect "$BUILD" --tests |
  /usr/bin/python3 -c 'import json, sys; print(" ".join(sorted({t["cmd"][1] for t in json.load(sys.stdin)
                                                                if any(s.endswith(":fuzz") for s in t["suite"])})))')
[ -n "$targets" ] || { echo "== no fuzz targets in $BUILD"; exit 1; }
ninja -C "$BUILD" $targets >/dev/null ||
  { echo "== building the fuzz targets failed"; exit 1; }
echo "== fuzz targets, ${SECS} s each: $(for t in $targets; do basename "$t"; done | tr '\n' ' ')"
FUZZ_SECONDS=$SECS meson test -C "$BUILD" --no-rebuild --suite fuzz --print-errorlogs --num-processes 2 \
  -t $(( (SECS + 60) / 120 + 1 )) >/dev/null
rc=$?
/usr/bin/python3 - "$BUILD/meson-logs/testlog.json" <<'PY'
import json, re, sys

for line in open(sys.argv[1]):
    t = json.loads(line)
    out = t.get("stdout", "")
    m = re.search(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)", out)
    if m:
        print("%-22s %-4s %10s execs  cov %5s  ft %6s  corpus %s inputs (%s)" %
              (t["name"], t["result"], m.group(1), m.group(2), m.group(3), m.group(4), m.group(5)))
    else:
        print("%-22s %-4s (no libFuzzer stats)\n%s" % (t["name"], t["result"], out[-2000:]))
PY
exit $rc
