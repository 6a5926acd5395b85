#!/bin/sh
# test-load-error.sh RUN PLUGIN TEST - a plugin that does not load (here PLUGIN cut to its
# ELF header, as a reader could see it while a build rewrote it in place, issue 38) fails
# RUN (run.sh) with the loader's own reason in its output, not a bare skip.  (Cut further
# in, past its program headers, glibc's dlopen maps segments beyond the end of the file and
# the process dies of SIGBUS: that too fails the test, with a stack through dlopen.)
run=$1 plugin=$2
shift 2
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
head -c 64 "$plugin" > "$dir/cut.so" || exit 1
sh "$run" "$dir/cut.so" pass "$@" > "$dir/out" 2>&1
rc=$?
cat "$dir/out"
if [ "$rc" = 0 ]; then
    echo "test-load-error.sh: run.sh passed a plugin cut to its ELF header"
    exit 1
fi
if ! grep -q "backend: the plugin of \$STEPD_PLUGIN_DIR does not load: .*libstepd-cuda.so" "$dir/out"; then
    echo "test-load-error.sh: run.sh's output lacks the loader's reason"
    exit 1
fi
grep -q "run.sh: .*did not load" "$dir/out" || { echo "test-load-error.sh: no run.sh verdict"; exit 1; }
exit 0
