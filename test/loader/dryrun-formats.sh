#!/bin/sh
# dryrun-formats.sh - the full-scale dry run of every release format (issue 43):
# stepd-mkmodel --format bf16|fp8|nvfp4|mxfp4 writes Step-3.7-Flash's full tensor list
# (45 layers + 3 MTP, 288 experts) over sparse data; stepd-inspect plans it at N=1 and at
# N=8 (every rank, with the per-rank memory plan on 141 GB devices).  Checked: every rank
# plans, the formats' totals differ from BF16's by exactly what their expert encodings
# weigh (docs/MODEL.md §5), and BF16 / FP8 store the experts stacked as those releases do.
#
#   dryrun-formats.sh STEPD_MKMODEL STEPD_INSPECT
set -eu
mk=$1
inspect=$2
tmp=$(mktemp -d "${TMPDIR:-/tmp}/stepd-dryrun-formats.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

fail() { echo "FAIL: $*" >&2; exit 1; }

n=$((1280 * 4096))                     # elements of one expert projection
projs=$((42 * 288 * 3))                # MoE layers 3..44 x experts x gate/up/down
for f in bf16 fp8 nvfp4 mxfp4; do
    d=$tmp/$f
    "$mk" --out "$d" --layers 45 --mtp 3 --sparse all --format "$f" --threads 1 >"$tmp/mk.log" 2>&1 ||
        { cat "$tmp/mk.log"; fail "$f: stepd-mkmodel failed"; }
    "$inspect" "$d" --world-size 1 --mtp 3 >"$tmp/n1.log" 2>&1 || { cat "$tmp/n1.log"; fail "$f: N=1 does not plan"; }
    bytes=$(sed -n 's/^rank 0\/1: ok: [0-9]* tensors, \([0-9]*\) bytes.*/\1/p' "$tmp/n1.log")
    [ -n "$bytes" ] || { cat "$tmp/n1.log"; fail "$f: no N=1 plan line"; }
    echo "$f N=1: $(sed -n 's/^rank 0\/1: //p' "$tmp/n1.log")"
    "$inspect" "$d" --world-size 8 --mtp 3 --device-memory 141G --max-model-len 262144 --max-num-seqs 8 \
        >"$tmp/n8.log" 2>&1 || { cat "$tmp/n8.log"; fail "$f: N=8 does not plan"; }
    [ "$(grep -c '^rank [0-7]/8: ok: ' "$tmp/n8.log")" = 8 ] || { cat "$tmp/n8.log"; fail "$f: not every rank of 8 plans"; }
    grep -q '^loadable' "$tmp/n8.log" || fail "$f: N=8 not loadable"
    sed -n 's/^\(rank [01]\/8: ok: .*\) planned in.*/'"$f"' N=8 \1/p; s/^  memory: /'"$f"'   memory: /p' "$tmp/n8.log" | head -4
    stacked=$(grep -c '"model.layers.3.moe.gate_proj.weight"' "$d/model.safetensors.index.json" || true)
    case $f in
    bf16) base=$bytes; [ "$stacked" = 1 ] || fail "bf16: experts not stacked" ;;
    fp8) [ "$stacked" = 1 ] || fail "fp8: experts not stacked"
         want=$((base - projs * (2 * n - n - 4 * (n / 16384)))) ;;
    nvfp4) [ "$stacked" = 0 ] || fail "nvfp4: experts stacked"
           want=$((base - projs * (2 * n - n / 2 - n / 16 - 4))) ;;
    mxfp4) want=$((base - projs * (2 * n - n / 2 - n / 32))) ;;
    esac
    if [ "$f" != bf16 ] && [ "$bytes" != "$want" ]; then
        fail "$f: N=1 plans $bytes bytes, expected $want (BF16's $base less the expert encodings' difference)"
    fi
done
echo "dryrun-formats: all passed"
