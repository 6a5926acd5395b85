#!/bin/sh
# run-narrow8.sh STEPD_MKMODEL TEST_MODEL: worker/model.c against the oracle (test-model, fast
# path) on a narrow8 checkpoint of stepd-mkmodel with 2 MTP layers and a 64-token window.
set -eu
mk=$1
tm=$2
dir=$(mktemp -d "${TMPDIR:-/tmp}/model-narrow8-XXXXXX")
trap 'rm -rf "$dir"' EXIT
"$mk" --out "$dir" --force --preset narrow8 --mtp 2 --window 64 --seed 5
"$tm" "$dir" fast
