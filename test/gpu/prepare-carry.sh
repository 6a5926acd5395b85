#!/usr/bin/env bash
# prepare-carry.sh - lay out, inside the checkout, what the GPU check needs and the GPU
# machine's image lacks, so that the device's time goes to the GPU and not to a build:
#   .gpu-carry/prefix/{include,lib}: the headers and shared libraries of jansson and
#     pcre2-8 (the checkpoint loader's), copied from this machine's Debian packages;
#   .gpu-carry/bin: the plugin and the GPU test programs built here by build-gpu.sh with
#     CARRY=1 ($ORIGIN-relative run paths), without their host debug sections, and
#     BUILT_WITH (toolkit, source hash) that device-check.sh compares before it trusts
#     them (else it builds there).
# .git/info/exclude gets /.gpu-carry/ so git ignores it.  Run it here, then the two calls
# of test/gpu/device-check.sh with carry [".gpu-carry"] (docs/GPU.md §device check).
#   prepare-carry.sh [--no-build]     (--no-build: the prefix only)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest="$root/.gpu-carry/prefix"
rm -rf "$dest"
mkdir -p "$dest/include" "$dest/lib"
exclude="$(git -C "$root" rev-parse --git-path info/exclude)"
case "$exclude" in /*) ;; *) exclude="$root/$exclude" ;; esac
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu-carry/' "$exclude" 2>/dev/null || echo '/.gpu-carry/' >> "$exclude"
for pkg in libjansson-dev libjansson4 libpcre2-dev libpcre2-8-0; do
    dpkg -L "$pkg" >/dev/null 2>&1 || { echo "prepare-carry: package $pkg is not installed" >&2; exit 1; }
    dpkg -L "$pkg" | while read -r f; do
        [ -f "$f" ] || [ -L "$f" ] || continue
        case "$f" in
            /usr/include/*.h) cp -P "$f" "$dest/include/" ;;
            */libjansson.so*|*/libpcre2-8.so*) cp -P "$f" "$dest/lib/" ;;
        esac
    done
done
if [ "${1:-}" != --no-build ]; then
    bin="$root/.gpu-carry/bin"
    rm -rf "$bin"
    a=$(date +%s)
    CARRY=1 bash "$root/test/gpu/build-gpu.sh" "$bin" "$dest"
    rm -rf "$bin/obj" "$bin/libstepd-gpucheck.a"
    # the device takes 64 MiB with the tree (which holds the tiny model): the host code's
    # debug sections are 8 of the 24 MiB (symbols stay for backtraces; the kernels keep
    # their -lineinfo for ncu)
    find "$bin" -type f -perm -u+x -exec strip --strip-debug {} +
    bash "$root/test/gpu/device-check.sh" --fingerprint > "$bin/BUILT_WITH"
    echo "prepare-carry: built in $(( $(date +%s) - a ))s"
fi
du -sh "$root/.gpu-carry"/*
echo "prepare-carry: $root/.gpu-carry ready; carry .gpu-carry"
