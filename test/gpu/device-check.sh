#!/usr/bin/env bash
# device-check.sh - everything an H200 check of the GPU path needs, in one run of at most
# 8 minutes, on the GPU machine's image (nvcc, a C compiler, no meson dependencies):
#   1. build the plugin and the GPU tests (test/gpu/build-gpu.sh; jansson and pcre2 from
#      .gpu-carry/prefix, laid out by test/gpu/prepare-carry.sh on the build machine);
#   2. test-cuda-host, then every CUDA op against the CPU backend on odd shapes with fresh
#      random inputs and poisoned outputs, on both CUDA paths (test-cuda-ops);
#   3. the tiny model: logits of prefill and graph decode steps against the CPU, and greedy
#      tokens equal to the CPU exact path's for 48 tokens with K = 0 and K = 3;
#   4. a synthetic full-width checkpoint (stepd-mkmodel: hidden 4096, 288 experts of 1280,
#      top-8, real heads, 3 layers), its logits against the CPU within the test's stated
#      tolerances;
#   5. the table (bench-cuda): copy ceiling, MXFP4 MoE GB/s at 1/4/16/64 tokens and TFLOP/s
#      at 2048, cuBLASLt projection at batch 1, attention decode at 4k and 32k, the
#      synthetic model's decode step at batch 1, 8, 64 with and without graphs.
# Logs go to $OUT (when set) and the table is printed last.  Each stage has a deadline;
# a failed stage is reported and the next ones still run.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
W=${GPU_CHECK_DIR:-/tmp/gpu-check}
LOG=${OUT:-$W}
mkdir -p "$W" "$LOG"
t0=$(date +%s)
status=()
stage() {   # stage NAME SECONDS COMMAND...
    local name=$1 secs=$2; shift 2
    local a=$(date +%s)
    echo "=== $name (deadline ${secs}s, at $(( a - t0 ))s)"
    timeout "$secs" "$@" > "$LOG/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$LOG/$name.log"
    status+=("$name: rc $rc in $(( $(date +%s) - a ))s")
    return $rc
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
    > "$LOG/gpu.txt" 2>&1; cat "$LOG/gpu.txt"
prefix=.gpu-carry/prefix
[ -d "$prefix" ] || prefix=""
B=$W/build
stage build 300 bash test/gpu/build-gpu.sh "$B" $prefix || { printf '%s\n' "${status[@]}"; exit 1; }
stage host 60 "$B/test-cuda-host"
stage ops 120 "$B/test-cuda-ops"
stage tiny-logits 90 sh -c "'$B/test-cuda-logits' models/tiny-step fast --steps 6 --seqs 3 &&
    STEPD_CUDA_NO_GRAPHS=1 '$B/test-cuda-logits' models/tiny-step fast --steps 3 &&
    '$B/test-cuda-logits' models/tiny-step exact --steps 3"
stage tiny-greedy 150 sh test/gpu/run-greedy.sh "$B/test-cuda-logits" models/tiny-step
syn=$W/syn3
if [ -x "$B/stepd-mkmodel" ]; then
    [ -f "$syn/config.json" ] || stage mkmodel 120 "$B/stepd-mkmodel" --out "$syn" --preset full \
        --layers 3 --mtp 0 --threads "$(nproc)" --force
    stage syn-logits 150 "$B/test-cuda-logits" "$syn" fast --steps 3 --prompt 10 --seqs 2
    stage bench 240 "$B/bench-cuda" --model "$syn"
else
    echo "=== no tools/mkmodel.c in this tree: the synthetic checkpoint and the model rows are skipped"
    stage bench 180 "$B/bench-cuda"
fi
echo "=== stages"
printf '%s\n' "${status[@]}"
echo "=== table ($(( $(date +%s) - t0 ))s in all)"
grep -h '^|' "$LOG/bench.log" || true
grep -h 'batch-1 step over' "$LOG/bench.log" || true
