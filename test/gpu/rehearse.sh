#!/usr/bin/env bash
# rehearse.sh - both calls of test/gpu/device-check.sh run here as the device would run
# them, without a GPU (docs/GPU.md §device check):
#   1. prepare-carry.sh (unless --no-prepare: a .gpu-carry made before is used);
#   2. what the device tool sends (the tracked files, the untracked ones git does not
#      ignore, and .gpu-carry) is copied into SCRATCH/tree, outside any git checkout, and
#      must fit the 64 MiB the tool takes;
#   3. in a private mount namespace (unshare -m; root) every file of Debian's gRPC, libuv,
#      protobuf-c, UCX and jansson packages (and pcre2's headers) is covered with /dev/null,
#      as the device's image lacks them: a carried program that still needed one would not
#      load, a build there that needed one would not compile;
#   4. device-check.sh 1, then 2, with OUT=SCRATCH/outN, each under timeout_s as the device
#      call would be (300 s, 420 s);
#   5. with --build-there, the fallback of a stale or missing carry: device-check.sh's own
#      build_there (build-gpu.sh with the carried prefix, then the plugin's dlopen) into
#      SCRATCH/build-there, uncapped (this host's 2 cores take 4-6 min, not the 170 s the
#      device's 16 have).  Debian 12's ld itself needs libjansson (binutils 2.40), so the
#      build gets the carry's through LD_LIBRARY_PATH; the programs it links are then
#      checked with ldd without it.
# The GPU stages read "skip (no GPU)"; everything before them runs for real (the carry's
# fingerprint, its libraries through $ORIGIN, the plugin opened with dlopen, the caps).
# Exit 1 when a call failed.
#   rehearse.sh [--no-prepare] [--build-there] [SCRATCH]   (default SCRATCH: /tmp/gpu-rehearsal)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
prepare=1
build_there=""
while [ $# -gt 0 ]; do
    case "$1" in
        --no-prepare) prepare="" ;;
        --build-there) build_there=1 ;;
        *) break ;;
    esac
    shift
done
scratch=${1:-/tmp/gpu-rehearsal}
[ "$(id -u)" = 0 ] || { echo "rehearse: needs root (a mount namespace hides the packages)" >&2; exit 1; }

cd "$root"
[ -n "$prepare" ] && bash test/gpu/prepare-carry.sh
[ -f .gpu-carry/bin/BUILT_WITH ] ||
    { echo "rehearse: no .gpu-carry/bin/BUILT_WITH: run test/gpu/prepare-carry.sh" >&2; exit 1; }

rm -rf "$scratch"
mkdir -p "$scratch/tree"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -C "$scratch/tree" -xf -
cp -a .gpu-carry "$scratch/tree/"
kib=$(du -sk "$scratch/tree" | cut -f1)
echo "rehearse: $(( kib / 1024 )) MiB would travel (the device takes 64 MiB)"
[ "$kib" -le $(( 64 * 1024 )) ] || { echo "rehearse: the tree and the carry exceed 64 MiB" >&2; exit 1; }

# the files to hide: those of the packages the device's image lacks
hide=$(dpkg-query -W -f '${Package}\n' |
       grep -E '^(libgrpc|libuv1|libprotobuf-c|protobuf-c-|libucx|ucx-|libjansson|libpcre2-dev)' |
       xargs -r dpkg -L 2>/dev/null | while read -r f; do
           [ -f "$f" ] && [ ! -L "$f" ] && echo "$f"
       done | sort -u)
echo "rehearse: $(wc -l <<< "$hide") files of $(dpkg-query -W -f '${Package}\n' |
    grep -cE '^(libgrpc|libuv1|libprotobuf-c|protobuf-c-|libucx|ucx-|libjansson|libpcre2-dev)') packages hidden"

rc=0
BUILD_THERE=$build_there HIDE=$hide unshare -m --propagation private bash -c '
    set -u
    while read -r f; do
        [ -n "$f" ] && mount --bind /dev/null "$f"
    done <<< "$HIDE"
    # the proof that they are hidden: the dynamic loader no longer finds jansson
    if printf "%s\n" /usr/lib/*/libjansson.so.* | xargs -r cat | head -c 4 | grep -q ELF; then
        echo "rehearse: jansson is still visible" >&2; exit 1
    fi
    cd "$0/tree"
    rc=0
    OUT=$0/out1 GPU_CHECK_DIR=$0/w timeout 300 bash test/gpu/device-check.sh 1 || rc=1
    OUT=$0/out2 GPU_CHECK_DIR=$0/w timeout 420 bash test/gpu/device-check.sh 2 || rc=1
    if [ -n "$BUILD_THERE" ]; then
        source <(sed -n "/^plugin_loads()/,/^}/p;/^build_there()/,/^}/p" test/gpu/device-check.sh)
        declare -F build_there plugin_loads >/dev/null || { echo "rehearse: no build_there" >&2; exit 1; }
        a=$(date +%s)
        LD_LIBRARY_PATH=$PWD/.gpu-carry/prefix/lib build_there "$0/build-there" || rc=1
        echo "rehearse: the build there took $(( $(date +%s) - a ))s here"
        for f in "$0"/build-there/*; do
            [ -f "$f" ] && [ -x "$f" ] || continue
            ! ldd "$f" | grep "not found" || { echo "rehearse: $f misses a library"; rc=1; }
        done
    fi
    exit $rc
' "$scratch" || rc=1
echo "rehearse: logs in $scratch/out1 and $scratch/out2; $([ $rc = 0 ] && echo ok || echo FAILED)"
exit $rc
