#!/bin/sh
# stepd-run takes the worker's --kv-cache-dtype: with fp32 its greedy output is the worker's
# (stepd-worker --generate --kv-cache-dtype fp32, the same engine-free exact path end to end),
# it says which KV it stored, and a dtype stepd lacks is refused naming the flag.
# Usage: run-kv-dtype.sh STEPD_RUN STEPD_WORKER MODEL_DIR
set -eu
run="$1"; worker="$2"; dir="$3"
ids=0,11,523,97,1024,77,5,900,31,2047,12,400,401,402,88,19,3000
for dt in fp32 bf16; do
    out=$("$run" "$dir" --prompt-ids "$ids" -n 24 --threads 1 --exact --kv-cache-dtype "$dt")
    echo "$out" | grep -q "KV cache $(echo $dt | tr a-z A-Z)" || { echo "FAIL: $dt not reported:"; echo "$out"; exit 1; }
    got=$(echo "$out" | sed -n 's/^generated (24 tokens): //p' | tr ' ' ',')
    echo "$ids" > prompts-kv.txt
    "$worker" --rendezvous-dir . --group kvdt --world-size 1 --model "$dir" --threads 1 --exact \
        --kv-cache-dtype "$dt" --generate prompts-kv.txt --max-tokens 24 --output out-kv.txt --insecure-control \
        2>worker-kv.log || { cat worker-kv.log; exit 1; }
    want=$(sed -n 's/^0 .* ids=//p' out-kv.txt)
    if [ "$got" != "$want" ]; then
        echo "FAIL: --kv-cache-dtype $dt: stepd-run $got, stepd-worker $want"; exit 1
    fi
    echo "ok: --kv-cache-dtype $dt: stepd-run = stepd-worker ($got)"
done
if "$run" "$dir" --prompt-ids 1 -n 2 --kv-cache-dtype fp8 2>err.txt; then echo "accepted --kv-cache-dtype fp8"; exit 1; fi
grep -q -- "--kv-cache-dtype 'fp8'" err.txt || { cat err.txt; exit 1; }
rm -f err.txt prompts-kv.txt out-kv.txt worker-kv.log
echo "stepd-run --kv-cache-dtype: as stepd-worker"
