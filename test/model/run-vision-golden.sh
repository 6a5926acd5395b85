#!/bin/sh
# The vision encoder against the numpy reference: vision_ref.py writes the 4 images' views
# and per-stage activations of the tiny model's tower, test-vision compares.
#   run-vision-golden.sh PYTHON VISION_REF TEST_VISION MODEL_DIR
set -eu
PY=$1 REF=$2 TEST=$3 MODEL=$4
DIR=$(mktemp -d "${TMPDIR:-/tmp}/vision-golden.XXXXXX")
trap 'rm -rf "$DIR"' EXIT
"$PY" "$REF" goldens "$MODEL" "$DIR"
"$TEST" golden "$MODEL" "$DIR"
