#!/bin/sh
# run.sh PLUGIN EXPECT TEST [ARGS...] - run a test of test/gpu against the host emulator's
# build of the CUDA plugin (test/cuemu/meson.build), under AddressSanitizer.
# EXPECT 'pass': the test must pass.  EXPECT a fault of faults.txt: the plugin was built
# with that fault injected; the test must fail, and its log must hold the fault's
# diagnosis (faults.txt, last column).
plugin=$1 expect=$2
shift 2
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
ln -s "$plugin" "$dir/libstepd-cuda.so"
# a fresh fiber order each run; the runtime prints the seed at exit (CUEMU_SEED replays it)
CUEMU_SEED=${CUEMU_SEED:-$(od -An -N8 -tu8 /dev/urandom | tr -d ' ')}
export CUEMU_SEED
STEPD_TEST_EMULATED=1 STEPD_PLUGIN_DIR=$dir LD_PRELOAD=$CUEMU_ASAN_RT \
  ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0 "$@" >"$dir/log" 2>&1
rc=$?
cat "$dir/log"
if [ "$rc" = 77 ]; then
  # the loader's reason (kernels/backend.c warns when $STEPD_PLUGIN_DIR's plugin does not load)
  why=$(sed -n 's/.*backend: the plugin of \$STEPD_PLUGIN_DIR does not load: //p' "$dir/log" | head -n 1)
  echo "run.sh: the test skipped: the emulator's plugin $plugin did not load${why:+: $why}"
  exit 1
fi
if [ "$expect" = pass ]; then
  exit "$rc"
fi
pat=$(awk -F '\t' -v f="$expect" '$1 == f { print $5 }' "$CUEMU_FAULTS")
if [ -z "$pat" ]; then
  echo "run.sh: no fault '$expect' in $CUEMU_FAULTS"
  exit 1
fi
if [ "$rc" = 0 ]; then
  echo "run.sh: fault '$expect' injected, yet the test passed"
  exit 1
fi
if ! grep -Eq "$pat" "$dir/log"; then
  echo "run.sh: fault '$expect': the test failed (exit $rc) without the diagnosis /$pat/"
  exit 1
fi
echo "run.sh: fault '$expect' detected (exit $rc, /$pat/)"
exit 0
