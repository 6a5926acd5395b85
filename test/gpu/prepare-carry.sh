#!/usr/bin/env bash
# prepare-carry.sh - lay out, inside the checkout, what the GPU check needs and the GPU
# machine's image lacks: the headers and shared libraries of jansson and pcre2-8 (the
# checkpoint loader's), copied from this machine's installed Debian packages into
# .gpu-carry/prefix/{include,lib}.  .git/info/exclude gets /.gpu-carry/ so git ignores it.
# Run it here, then run the check with carry [".gpu-carry"]:
#   bash test/gpu/prepare-carry.sh && <device run> bash test/gpu/device-check.sh
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
du -sh "$dest"
echo "prepare-carry: $dest ready; carry .gpu-carry"
