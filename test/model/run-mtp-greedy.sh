#!/bin/sh
# stepd-run greedy output is the same with MTP speculation (K = 1, 3) and chunked prefill
# as plain one-shot greedy decoding (K = 0).  Usage: run-mtp-greedy.sh STEPD_RUN MODEL_DIR
set -eu
run="$1"; dir="$2"
ids=0,11,523,97,1024,77,5,900,31,2047,12,400,401,402,88,19,3000
base=$("$run" "$dir" --prompt-ids "$ids" -n 40 --threads 2 --exact --ids-only)
[ -n "$base" ] || { echo "empty output"; exit 1; }
for args in "--mtp 1" "--mtp 3" "--mtp 3 --chunk 5" "--chunk 4" "--mtp 3 --draft-quant mxfp4"; do
    out=$("$run" "$dir" --prompt-ids "$ids" -n 40 --threads 2 --exact --ids-only $args)
    if [ "$out" != "$base" ]; then
        echo "FAIL: $args"; echo " base: $base"; echo " got:  $out"; exit 1
    fi
    echo "ok: $args"
done
# --prompt TEXT goes through the tokenizer (BOS first)
out=$("$run" "$dir" --prompt "In the beginning" -n 4 --threads 1 --ids-only)
[ "$(echo "$out" | tr ',' '\n' | wc -l)" -eq 4 ] || { echo "--prompt: got '$out'"; exit 1; }
echo "ok: --prompt"
# bad input is refused with a message naming it
if "$run" "$dir" --prompt-ids 1,2,999999 -n 2 2>err.txt; then echo "accepted a bad id"; exit 1; fi
grep -q "item 3" err.txt || { cat err.txt; exit 1; }
if "$run" "$dir" --prompt-ids 1 --mtp 9 -n 2 2>err.txt; then echo "accepted --mtp 9"; exit 1; fi
grep -qi "mtp" err.txt || { cat err.txt; exit 1; }
if "$run" "$dir" --prompt-ids 1 --mtp 1 --draft-quant fp8 -n 2 2>err.txt; then echo "accepted --draft-quant fp8"; exit 1; fi
grep -q "draft-quant" err.txt || { cat err.txt; exit 1; }
rm -f err.txt
echo "greedy output identical for K = 0, 1, 3 (checkpoint and MXFP4 drafts) and chunked prefill"
