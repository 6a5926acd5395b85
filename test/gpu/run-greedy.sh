#!/bin/sh
# The tiny model's greedy tokens on the CUDA backend against the CPU exact path's, 48 tokens,
# with K = 0 and K = 3 MTP drafts: the FP32 op path (exact) token for token; the fast path
# (fused halves, BF16 activations, graphs) and the same without graphs token for token up
# to a near-tie within their logit tolerance (test-cuda-logits.c: margin-aware).  Exit 77
# without a GPU.
# Usage: run-greedy.sh TEST_CUDA_LOGITS MODEL_DIR
set -u
bin="$1"; dir="$2"
fail=0
for k in 0 3; do
    for mode in fast fast-nographs exact; do
        case $mode in
            exact) out=$("$bin" "$dir" exact --greedy 48 --mtp $k 2>&1) ;;
            fast-nographs) out=$(STEPD_CUDA_NO_GRAPHS=1 "$bin" "$dir" fast --greedy 48 --mtp $k 2>&1) ;;
            *) out=$("$bin" "$dir" fast --greedy 48 --mtp $k 2>&1) ;;
        esac
        rc=$?
        [ $rc -eq 77 ] && { echo "$out"; exit 77; }
        if [ $rc -ne 0 ]; then
            echo "FAIL: cuda $mode K=$k"; echo "$out"; fail=1
        else
            echo "ok: cuda $mode K=$k"
        fi
    done
done
[ $fail -eq 0 ] || exit 1
echo "greedy tokens on CUDA match the CPU exact path for 48 tokens, K = 0 and 3"
