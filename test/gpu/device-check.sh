#!/usr/bin/env bash
# device-check.sh - the GPU check of the CUDA path in two device calls that fit a lease of
# 15 minutes (start-up included), each under a hard cap (docs/GPU.md §device check):
#
#   device-check.sh 1     correctness, cap 285 s (run it with timeout_s 300):
#     probe (driver, nvcc, toolkit libraries, NCCL, memory, profilers) -> binaries (those
#     built here by prepare-carry.sh when their fingerprint matches and the plugin loads,
#     else a build there) -> host checks -> every op against the CPU backend -> the NCCL
#     communicator on the compute stream, graph-captured -> the tiny model's logits ->
#     greedy tokens (exact path token for token, fast path margin-aware) -> the vision
#     encoder's ops and the tiny tower against the CPU encoder;
#   device-check.sh 2     figures, cap 405 s (timeout_s 420): probe -> binaries -> a
#     synthetic full-width checkpoint (3 layers + 1 MTP layer) -> bench-cuda (MoE decode
#     with realistic routing at batch 1/8/32/64 over 288 experts in MXFP4, FP8 and NVFP4
#     side by side, attention at 4k/32k, the
#     model step with graphs and eagerly, one MTP depth, per-layer time and the 45-layer
#     batch-1 extrapolation, each as % of HBM bandwidth) -> ncu Speed-of-Light of the MoE
#     (mx4_gemm) and attention (flash_kernel) kernels -> compute-sanitizer on the ops if
#     time remains;
#   device-check.sh --dry-run 1|2 [MESON_BUILD_DIR]     the plan, run nowhere: the probe
#     and the binaries' check run for real; every other stage is prepared (the programs it
#     runs are ones build-gpu.sh builds, and carried where a carry is used; the files and
#     scripts it names exist and parse) and placed on a schedule where each stage takes its
#     whole deadline; exit 1 when a stage is broken or the schedule with carried binaries
#     does not fit the cap (the one with a build there may drop stages from the end).  With
#     MESON_BUILD_DIR, build-gpu.sh --check compares its programs' sources with meson's.
#     The suite runs it (tests 'device-check-dry-1' and '-2', suite 'kernels');
#   device-check.sh --fingerprint     what prepare-carry.sh records beside the binaries.
#
# Before the calls, here: bash test/gpu/prepare-carry.sh (then carry [".gpu-carry"]);
# test/gpu/rehearse.sh runs both calls here as the device would, without a GPU.
# Each stage's deadline is the smaller of its own and what is left of the call's cap, and
# the whole call runs under `timeout` at the cap.  Output goes to $OUT as it goes, in at
# most four files (the device returns eight): callN.log (every stage's output), callN-
# summary.txt (one line per stage: rc, seconds, deadline; appended as each ends), probe.txt
# and, in call 2, figures.txt and ncu.txt.  Without a GPU (a rehearsal) the GPU programs
# exit 77 and their stages read "skip (no GPU)"; a program that exits 77 where the probe
# saw a GPU, or whose plugin does not load, fails its stage.  The call exits 1 when a
# stage failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1

# The toolkit release and a hash of the sources the binaries are built from: the files that
# travel to the device (in a git checkout the tracked and the untracked-not-ignored ones;
# elsewhere, as on the device, every file), so that ignored files here do not make the
# carry look stale there.
fingerprint() {
    local nv=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    local dirs="common kernels worker/model worker/comm test/gpu test/comm tools"
    echo "toolkit $("$nv" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    # shellcheck disable=SC2086
    echo "sources $( { if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
            git ls-files -co --exclude-standard -- $dirs; else find $dirs -type f; fi; } 2>/dev/null |
        grep -E '\.(c|h|cu|cuh)$' | while read -r f; do [ -f "$f" ] && echo "$f"; done |
        LC_ALL=C sort | xargs cat | sha256sum | cut -c1-16)"
}

DRY=""
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
call=${1:-}
# CAP: the call's hard cap; TIMEOUT_S: the device call's timeout_s (the cap, the kill's 5 s
# and a margin).  Both calls and one machine start (START) must fit the lease.
LEASE=900 START=120 TIMEOUT_1=300 TIMEOUT_2=420
case "$call" in
    1) CAP=285; TIMEOUT_S=$TIMEOUT_1 ;;
    2) CAP=405; TIMEOUT_S=$TIMEOUT_2 ;;
    --fingerprint) [ -z "$DRY" ] && { fingerprint; exit 0; } ;&
    *) echo "usage: device-check.sh [--dry-run] 1|2 [MESON_BUILD_DIR] | --fingerprint" >&2; exit 2 ;;
esac
MESON_BUILD=${2:-}
if [ -z "$DRY" ] && [ -z "${DEVCHECK_UNDER_CAP:-}" ]; then
    export DEVCHECK_UNDER_CAP=1
    exec timeout -k 5 "$CAP" bash "$root/test/gpu/device-check.sh" "$@"
fi

if [ -n "$DRY" ]; then
    W=$(mktemp -d "${TMPDIR:-/tmp}/device-check-dry.XXXXXX") || exit 1
    trap 'rm -rf "$W"' EXIT
    OUT=$W/out
else
    W=${GPU_CHECK_DIR:-/tmp/gpu-check}
    OUT=${OUT:-$W/out}
fi
mkdir -p "$W" "$OUT"
LOG=$OUT/call$call.log
SUM=$OUT/call$call-summary.txt
: > "$LOG"
: > "$SUM"
t0=$(date +%s)
FAILED=0
echo "call $call: cap ${CAP}s${DRY:+ (dry run)}, started $(date -u +%FT%TZ)" | tee -a "$SUM"

# what is left of the cap (a dry run: of its schedule), less 5 s for the summary
sim_t=0
left() {
    if [ -n "$DRY" ]; then
        echo $(( CAP - sim_t - 5 ))
    else
        echo $(( CAP - ($(date +%s) - t0) - 5 ))
    fi
}
# run_stage NAME SECONDS COMMAND...: run under min(SECONDS, what is left), output to the
# log; rc 77 is a skip only where the probe saw no GPU and the plugin loaded
run_stage() {
    local name=$1 secs=$2; shift 2
    local a rc l pos what
    a=$(date +%s)
    l=$(left)
    [ "$secs" -gt "$l" ] && secs=$l
    if [ "$secs" -lt 3 ]; then
        printf '%-14s not run: %ss of the cap left\n' "$name" "$l" | tee -a "$SUM"
        return 124
    fi
    echo "=== $name (deadline ${secs}s, at $(( a - t0 ))s)" | tee -a "$LOG"
    pos=$(stat -c %s "$LOG")
    timeout -k 3 "$secs" "$@" >> "$LOG" 2>&1
    rc=$?
    what="rc $rc"
    if [ $rc -eq 77 ]; then
        if tail -c +$(( pos + 1 )) "$LOG" |
                grep -qE 'plugin of .* does not load|has no symbol stepd_backend|incomplete ops table'; then
            what="FAIL: plugin does not load"; rc=1
        elif [ -n "${GPU_NAME:-}" ]; then
            what="FAIL: skip with a GPU"; rc=1
        else
            what="skip (no GPU)"
        fi
    fi
    [ $rc -eq 124 ] && what="TIMEOUT"
    [ $rc -ne 0 ] && [ $rc -ne 77 ] && FAILED=$(( FAILED + 1 ))
    printf '%-14s %-14s %4ss of %4ss  (at %ss)\n' "$name" "$what" "$(( $(date +%s) - a ))" \
        "$secs" "$(( $(date +%s) - t0 ))" | tee -a "$SUM"
    return $rc
}

# ---- the dry run: a schedule on which every stage takes its whole deadline ----
dry_bad() { echo "dry-run: FAIL: $*" | tee -a "$SUM"; DRY_BAD=1; }
# plan_stage NAME SECONDS [COMMAND...]: place it on the schedule, then prepare it
plan_stage() {
    local name=$1 secs=$2 l
    shift 2
    l=$(left)
    if [ "$l" -lt 3 ]; then
        printf '  %-14s not run: %ss of the cap left\n' "$name" "$l"
        CUT="$CUT $name"
        return 0
    fi
    if [ "$secs" -gt "$l" ]; then
        CUT="$CUT $name (${l}s of its ${secs}s)"
        secs=$l
    fi
    printf '  %-14s %4ss  %4ss -> %4ss\n' "$name" "$secs" "$sim_t" "$(( sim_t + secs ))"
    sim_t=$(( sim_t + secs ))
    [ $# -gt 0 ] && prepare "$name" "$*"
    return 0
}
# prepare NAME COMMAND-TEXT: the programs it runs are ones build-gpu.sh builds (and are
# carried, where the carry is used), the tree's files it names exist, its scripts parse
prepare() {
    local name=$1 cmd=${2//"$B"\//@B@} p
    for p in $(grep -oE '@B@[A-Za-z0-9_.+-]+' <<< "$cmd" | sort -u); do
        p=${p#@B@}
        grep -qx -- "$p" <<< "$BUILDS" ||
            dry_bad "stage $name runs $p, which build-gpu.sh does not build"
        if [ "$PLAN" = carried ] && [ -n "$CARRIED" ] && [ ! -x "$B/$p" ]; then
            dry_bad "stage $name runs $p, which is not in the carry"
        fi
    done
    for p in $(grep -oE "(^|[ '\"])(models|test|tools)/[A-Za-z0-9_./-]+" <<< "$cmd" |
               tr -d " '\"" | sort -u); do
        [ -e "$p" ] || { dry_bad "stage $name names $p, which is not in the tree"; continue; }
        case "$p" in
            *.sh) if head -1 "$p" | grep -q bash; then bash -n "$p"; else sh -n "$p"; fi ||
                      dry_bad "stage $name: $p does not parse" ;;
        esac
    done
    p=${cmd%% *}
    case "$p" in
        @B@*|sh|bash|env) ;;
        *) command -v "$p" >/dev/null ||
               echo "  ($name runs $p, which is not here: there it runs only if present)" ;;
    esac
}
stage() {
    if [ -n "$DRY" ]; then
        plan_stage "$@"
    else
        run_stage "$@"
    fi
}

# ---- probe: what this machine has, before anything is built or run ----
probe() {
    local nv cuda_root dirs d lt nccl
    echo "== GPU"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version,clocks.max.sm,clocks.max.mem \
            --format=csv 2>&1
    else
        echo "nvidia-smi: none (no driver)"
    fi
    echo "driver CUDA: $(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p')"
    echo "== toolkit"
    nv=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
    echo "nvcc: ${nv:-none} $( [ -n "$nv" ] && "$nv" --version | tail -1)"
    cuda_root=$( [ -n "$nv" ] && dirname "$(dirname "$(readlink -f "$nv")")")
    case "$cuda_root" in *site-packages*) echo "note: nvcc is a pip toolkit ($cuda_root)" ;; esac
    dirs="$cuda_root/lib64 $cuda_root/lib /usr/local/cuda/lib64"
    for d in $(python3 -c 'import nvidia, os; [print(os.path.join(p, n, "lib")) for p in nvidia.__path__ for n in os.listdir(p)]' 2>/dev/null); do
        dirs="$dirs $d"
    done
    lt=""; nccl=""
    for d in $dirs; do
        [ -z "$lt" ] && ls "$d"/libcublasLt.so* >/dev/null 2>&1 && lt=$d
        [ -z "$nccl" ] && [ -e "$d/libnccl.so.2" ] && nccl=$d/libnccl.so.2
    done
    [ -z "$nccl" ] && nccl=$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 /{print $NF; exit}')
    echo "libcublasLt: ${lt:-NOT FOUND}"
    echo "libcudart_static: $(ls "$cuda_root"/lib64/libcudart_static.a 2>/dev/null || echo 'NOT FOUND (a build there cannot link)')"
    echo "libnccl.so.2: ${nccl:-NOT FOUND (the NCCL test skips)}"
    echo "ncu: $(command -v ncu || echo none)  compute-sanitizer: $(command -v compute-sanitizer || echo none)"
    echo "== host"
    echo "cores $(nproc), memory $(free -g 2>/dev/null | awk '/Mem:/{print $2 " GiB, " $7 " GiB available"}'), /tmp $(df -h /tmp | awk 'NR==2{print $4}') free"
    echo "== carried binaries"
    if [ -f .gpu-carry/bin/BUILT_WITH ]; then
        echo "built with: $(tr '\n' ' ' < .gpu-carry/bin/BUILT_WITH)"
    else
        echo "none (.gpu-carry/bin/BUILT_WITH missing): a build there"
    fi
    {
        echo "NVCC=${nv}"
        echo "CUDA_ROOT=${cuda_root}"
        echo "LT_DIR=${lt}"
        echo "NCCL_LIB=${nccl}"
        echo "DRIVER_CUDA=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p')"
        echo "GPU_NAME='$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)'"
    } > "$W/probe.env"
}

# plugin_loads DIR: DIR/libstepd-cuda.so opens with dlopen(RTLD_NOW) (every library and
# symbol it needs resolves) and its entry point returns its ops table: all the plugin does
# before it asks for a device
plugin_loads() {
    local so=$1/libstepd-cuda.so
    ldd "$so" | grep -E 'cublas|cudart|not found'
    command -v python3 >/dev/null ||
        { echo "python3: none; the first GPU program tells whether the plugin loads"; return 0; }
    python3 - "$so" <<'PY'
import ctypes, sys
try:
    entry = ctypes.CDLL(sys.argv[1]).stepd_backend_cuda_ops
except (OSError, AttributeError) as e:
    sys.exit("the plugin does not load: %s" % e)
entry.restype = ctypes.c_void_p
if not entry():
    sys.exit("the plugin's stepd_backend_cuda_ops() returned NULL")
print("the plugin loads: %s" % sys.argv[1])
PY
}

# ---- binaries: carried when their fingerprint matches and they load, else built here ----
bins_carried() {
    local want have tk f
    [ -f .gpu-carry/bin/BUILT_WITH ] || { echo "no carried binaries"; return 1; }
    want=$(NVCC=$NVCC fingerprint | grep '^sources')
    have=$(grep '^sources' .gpu-carry/bin/BUILT_WITH)
    [ "$want" = "$have" ] || { echo "carried binaries are of other sources ($have, tree $want)"; return 1; }
    tk=$(sed -n 's/^toolkit //p' .gpu-carry/bin/BUILT_WITH)
    if [ -n "$DRIVER_CUDA" ] && [ "$(printf '%s\n%s\n' "$tk" "$DRIVER_CUDA" | sort -V | head -1)" != "$tk" ]; then
        echo "carried binaries need CUDA $tk, the driver has $DRIVER_CUDA"
        return 1
    fi
    for f in .gpu-carry/bin/*; do
        [ -f "$f" ] && [ -x "$f" ] || continue
        if ldd "$f" | grep 'not found'; then
            echo "carried binaries miss a library: $f"
            return 1
        fi
    done
    echo "the carried programs' own libraries (test-cuda-logits):"
    ldd .gpu-carry/bin/test-cuda-logits | grep -E 'jansson|pcre2'
    plugin_loads .gpu-carry/bin || return 1
    echo "carried binaries: $(tr '\n' ' ' < .gpu-carry/bin/BUILT_WITH)"
}

# build_there DIR: the fallback build, then the same check of its plugin
build_there() {
    local prefix=.gpu-carry/prefix
    [ -d "$prefix" ] || prefix=""
    env ${NVCC:+NVCC=$NVCC} bash test/gpu/build-gpu.sh "$1" $prefix && plugin_loads "$1"
}

export -f probe bins_carried fingerprint plugin_loads build_there
export W
run_stage probe 20 bash -c probe
cat "$LOG" > "$OUT/probe.txt"
# shellcheck disable=SC1091
. "$W/probe.env" 2>/dev/null || true
export NVCC CUDA_ROOT LT_DIR NCCL_LIB DRIVER_CUDA
export LD_LIBRARY_PATH="${LT_DIR:+$LT_DIR:}${LD_LIBRARY_PATH:-}"
[ -n "${NCCL_LIB:-}" ] && export STEPD_NCCL_LIB=$NCCL_LIB
CARRIED=1
# no usable carry is no failure: a build follows
run_stage bins 15 bash -c bins_carried || { CARRIED=""; FAILED=$(( FAILED - 1 )); }

# the stages after the binaries, which are in $B
call_stages() {
    if [ "$call" = 1 ]; then
        stage host 10 sh -c "'$B/test-cuda-guard' && '$B/test-cuda-host'"
        stage ops 60 "$B/test-cuda-ops"
        if [ -x "$B/test-comm-nccl" ] || [ -n "$DRY" ]; then
            stage nccl 30 "$B/test-comm-nccl"
        fi
        stage tiny-logits 45 sh -c "'$B/test-cuda-logits' models/tiny-step fast --steps 6 --seqs 3 &&
            STEPD_CUDA_NO_GRAPHS=1 '$B/test-cuda-logits' models/tiny-step fast --steps 3 &&
            '$B/test-cuda-logits' models/tiny-step exact --steps 3"
        stage tiny-greedy 70 sh test/gpu/run-greedy.sh "$B/test-cuda-logits" models/tiny-step
        # the vision encoder's device ops and the tiny tower on CUDA against the CPU encoder
        stage vision 25 sh -c "'$B/test-cuda-vision' ops && '$B/test-cuda-vision' tower models/tiny-step 728 504 140"
        return
    fi
    local syn=$W/syn3
    if [ -z "${GPU_NAME:-}" ] && [ -z "$DRY" ]; then
        # a rehearsal: the same checkpoint without its 9.4 GB of data (holes; under a second)
        # for a bench that skips
        syn=$W/syn3-sparse
        stage mkmodel 100 "$B/stepd-mkmodel" --out "$syn" \
            --preset full --layers 3 --mtp 1 --threads "$(nproc)" --force --sparse all
        stage bench 150 "$B/bench-cuda" --model "$syn" --mtp
    elif [ -x "$B/stepd-mkmodel" ] || [ -n "$DRY" ]; then
        [ -f "$syn/config.json" ] || stage mkmodel 100 "$B/stepd-mkmodel" --out "$syn" \
            --preset full --layers 3 --mtp 1 --threads "$(nproc)" --force
        stage bench 150 "$B/bench-cuda" --model "$syn" --mtp
    else
        stage bench 150 "$B/bench-cuda"
    fi
    [ -z "$DRY" ] && { grep -h -e '^|' -e 'byte floor' -e '45-layer' "$LOG" > "$OUT/figures.txt" || true; }
    if { command -v ncu >/dev/null && [ -n "${GPU_NAME:-}" ]; } || [ -n "$DRY" ]; then
        # the MoE decode kernels (gate+up, down) and decode attention, after warm-up launches
        stage ncu-moe 40 ncu --section SpeedOfLight --clock-control none -k regex:mx4_gemm \
            --launch-skip 8 --launch-count 4 "$B/bench-cuda" --quick
        stage ncu-attn 40 ncu --section SpeedOfLight --clock-control none -k regex:flash_kernel \
            --launch-skip 4 --launch-count 2 "$B/bench-cuda" --quick
        [ -z "$DRY" ] && sed -n '/=== ncu-moe/,$p' "$LOG" > "$OUT/ncu.txt"
    fi
    if { command -v compute-sanitizer >/dev/null && [ -n "${GPU_NAME:-}" ]; } || [ -n "$DRY" ]; then
        if [ "$(left)" -gt 40 ]; then
            stage sanitizer $(( $(left) - 5 )) compute-sanitizer --error-exitcode 9 "$B/test-cuda-ops"
        elif [ -n "$DRY" ]; then
            echo "  sanitizer      not run: $(left)s left (it runs with more than 40 s)"
        fi
    fi
}

if [ -n "$DRY" ]; then
    DRY_BAD=""
    BUILDS=$(bash test/gpu/build-gpu.sh --list | awk '{print $1}') ||
        dry_bad "build-gpu.sh --list failed"
    if [ -n "$MESON_BUILD" ]; then
        bash test/gpu/build-gpu.sh --check "$MESON_BUILD" ||
            dry_bad "build-gpu.sh builds a program from other sources than meson does"
    fi
    for PLAN in carried build; do
        sim_t=0
        CUT=""
        if [ "$PLAN" = carried ]; then
            echo "plan with carried binaries:"
        else
            echo "plan with a build there:"
        fi
        plan_stage probe 20
        plan_stage bins 15
        if [ "$PLAN" = carried ]; then
            B=$root/.gpu-carry/bin
            [ -n "$CARRIED" ] ||
                echo "  (no usable carry here: its programs are checked against build-gpu.sh --list)"
        else
            B=$W/build
            plan_stage build 170 bash test/gpu/build-gpu.sh "$B" .gpu-carry/prefix
        fi
        call_stages
        echo "  ends at ${sim_t}s of the ${CAP}s cap (5 s kept for the summary)${CUT:+; cut short or not run:$CUT}"
        if [ "$PLAN" = carried ] && { [ -n "$CUT" ] || [ $(( sim_t + 5 )) -gt "$CAP" ]; }; then
            dry_bad "with carried binaries the stages' deadlines exceed the ${CAP}s cap"
        fi
    done
    [ $(( CAP + 5 )) -lt "$TIMEOUT_S" ] ||
        dry_bad "the cap ${CAP}s and the kill's 5 s do not fit timeout_s ${TIMEOUT_S}"
    echo "lease: timeout_s $TIMEOUT_1 + $TIMEOUT_2 and ${START}s for one machine start =" \
        "$(( TIMEOUT_1 + TIMEOUT_2 + START ))s of ${LEASE}s"
    [ $(( TIMEOUT_1 + TIMEOUT_2 + START )) -le "$LEASE" ] || dry_bad "the two calls do not fit the lease"
    if [ -n "$DRY_BAD" ]; then
        echo "call $call: dry run FAILED"
        exit 1
    fi
    echo "call $call: dry run ok"
    exit 0
fi

B=$root/.gpu-carry/bin
if [ -z "$CARRIED" ]; then
    B=$W/build
    run_stage build 170 bash -c 'build_there "$0"' "$B" ||
        { echo "no binaries: stopping" | tee -a "$SUM"; exit 1; }
fi
export STEPD_PLUGIN_DIR=$B
call_stages
echo "call $call: done in $(( $(date +%s) - t0 ))s of ${CAP}s, $FAILED stage(s) failed" | tee -a "$SUM"
[ "$FAILED" -eq 0 ]
