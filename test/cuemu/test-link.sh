#!/bin/sh
# test-link.sh LINK - LINK (link.sh) replaces its output in one step: while the linker is
# halfway through writing, the output path still holds the old file, whole; after, the new
# one; a linker that fails leaves the old file and no temporary.  A fake linker writes half
# its output, then waits on a FIFO, so the check runs at that moment on every run.
link=$1
dir=$(mktemp -d) || exit 1
trap 'rm -rf "$dir"' EXIT
fail() {
    echo "test-link.sh: $*"
    exit 1
}
mkfifo "$dir/half" "$dir/go" || exit 1
cat > "$dir/ld.sh" <<'LD'
# fake linker: ARGS... -o OUT; writes "new ", signals, waits, writes "plugin"
for a; do out=$a; done
dir=${0%/ld.sh}
[ "$1" = fail ] && exit 1
printf 'new ' > "$out"
echo > "$dir/half"
read x < "$dir/go"
printf 'plugin\n' >> "$out"
LD
printf 'old plugin\n' > "$dir/out.so"
sh "$link" "$dir/out.so" sh "$dir/ld.sh" a.o b.o &
pid=$!
read x < "$dir/half"
seen=$(cat "$dir/out.so" 2>&1)
echo > "$dir/go"
wait $pid || fail "link.sh failed (exit $?)"
[ "$seen" = "old plugin" ] || fail "while the linker wrote, out.so held '$seen', not the old file"
[ "$(cat "$dir/out.so")" = "new plugin" ] || fail "after the link, out.so holds '$(cat "$dir/out.so")'"
sh "$link" "$dir/out.so" sh "$dir/ld.sh" fail && fail "a failing linker: link.sh exited 0"
[ "$(cat "$dir/out.so")" = "new plugin" ] || fail "a failing linker changed out.so"
left=$(ls "$dir" | grep '^out\.so\.')
[ -z "$left" ] && exit 0
fail "temporaries left: $left"
