#!/bin/sh
# run-narrow8.sh STEPD_MKMODEL TEST_MODEL STEPD_RUN TOKENIZER_DIR: a narrow8 checkpoint of
# stepd-mkmodel (2 MTP layers, 64-token window, the tiny model's tokenizer) through
#   1. worker/model/ against the oracle (test-model, fast path);
#   2. stepd-run at world size 1: a text prompt, 8 greedy tokens, with and without MTP
#      drafts (speculative greedy output must equal plain greedy).
set -eu
mk=$1
tm=$2
run=$3
tok=$4
dir=$(mktemp -d "${TMPDIR:-/tmp}/model-narrow8-XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$mk" --out "$dir" --force --preset narrow8 --mtp 2 --window 64 --seed 5 --tokenizer "$tok"
"$tm" "$dir" fast
a=$("$run" "$dir" --prompt "In the beginning God created the heaven and the earth" -n 8 --ids-only)
b=$("$run" "$dir" --prompt "In the beginning God created the heaven and the earth" -n 8 --ids-only --mtp 2)
echo "stepd-run: $a; with --mtp 2: $b"
[ "$(echo "$a" | tr , " " | wc -w)" -eq 8 ] || { echo "FAIL: expected 8 generated ids, got '$a'"; exit 1; }
[ "$a" = "$b" ] || { echo "FAIL: --mtp 2 changed the greedy output"; exit 1; }
