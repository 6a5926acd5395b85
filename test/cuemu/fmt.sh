#!/bin/sh
# fmt.sh MKMODEL MODEL_DIR FORMAT PLUGIN TEST [ARGS...] - MODEL_DIR converted to FORMAT
# (stepd-mkmodel --from, as test reference-formats writes it: fp8, nvfp4, bf16, mxfp4),
# then TEST run on the converted model under the host emulator (run.sh PLUGIN pass TEST
# MODEL' ARGS): the CUDA backend's op sequence on that format against the CPU backend.
mkmodel=$1 model=$2 format=$3 plugin=$4 prog=$5
shift 5
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
"$mkmodel" --from "$model" --out "$dir/model" --format "$format" >"$dir/mkmodel.log" 2>&1 || {
  cat "$dir/mkmodel.log"
  echo "fmt.sh: stepd-mkmodel --format $format failed"
  exit 1
}
sh "$(dirname "$0")/run.sh" "$plugin" pass "$prog" "$dir/model" "$@"
