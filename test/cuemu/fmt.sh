#!/bin/sh
# fmt.sh MKMODEL MODEL_DIR FORMAT PLUGIN TEST [ARGS...] - MODEL_DIR converted to FORMAT
# (stepd-mkmodel --from, as test reference-formats writes it: fp8, nvfp4, bf16, mxfp4),
# then TEST run on the converted model under the host emulator (run.sh PLUGIN pass TEST
# MODEL' ARGS): the CUDA backend on that format against the CPU backend.
# FMT_GRAPH_NODES=N set: the run must capture a graph, and none of more than N nodes
# (CUEMU_GRAPH_NODES_MAX): the format's layers take the fused halves and the decode graph.
# FMT_KERNEL=NAME: a kernel of that name must have run (the emulator's list of kernels run
# at exit); FMT_NO_KERNEL=PREFIX: none whose name starts with it.
mkmodel=$1 model=$2 format=$3 plugin=$4 prog=$5
shift 5
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
"$mkmodel" --from "$model" --out "$dir/model" --format "$format" >"$dir/mkmodel.log" 2>&1 || {
  cat "$dir/mkmodel.log"
  echo "fmt.sh: stepd-mkmodel --format $format failed"
  exit 1
}
if [ -z "$FMT_GRAPH_NODES" ]; then
  exec sh "$(dirname "$0")/run.sh" "$plugin" pass "$prog" "$dir/model" "$@"
fi
CUEMU_GRAPH_NODES_MAX=$FMT_GRAPH_NODES sh "$(dirname "$0")/run.sh" "$plugin" pass "$prog" \
  "$dir/model" "$@" >"$dir/run.log" 2>&1
rc=$?
cat "$dir/run.log"
[ "$rc" = 0 ] || exit "$rc"
if ! grep -q '^cuemu: graph captured: ' "$dir/run.log"; then
  echo "fmt.sh: $format: no graph was captured (FMT_GRAPH_NODES=$FMT_GRAPH_NODES asks for the decode graph)"
  exit 1
fi
if [ -n "$FMT_KERNEL" ] && ! grep -Eq "^cuemu:   $FMT_KERNEL " "$dir/run.log"; then
  echo "fmt.sh: $format: kernel $FMT_KERNEL did not run"
  exit 1
fi
if [ -n "$FMT_NO_KERNEL" ] && grep -Eq "^cuemu:   $FMT_NO_KERNEL" "$dir/run.log"; then
  echo "fmt.sh: $format: a kernel $FMT_NO_KERNEL* ran"
  exit 1
fi
