#!/bin/sh
# link.sh OUTPUT COMMAND [ARGS...] - run COMMAND ARGS... -o OUTPUT.tmp.PID, then rename that
# file onto OUTPUT.  The linker writes its output in place (GNU ld unlinks it, then writes
# it piece by piece), so a test that loads the plugin while another build relinks it (two
# "meson test" runs at once in one build dir) found it absent or cut short: dlopen failed,
# the test skipped (issue 38).  rename() replaces OUTPUT in one step: a reader sees the old
# file or the new one, whole.
out=$1
shift
tmp=$out.tmp.$$
trap 'rm -f "$tmp"' EXIT
trap 'exit 1' HUP INT TERM
"$@" -o "$tmp" || exit 1
mv -f "$tmp" "$out"
