#!/usr/bin/env bash
# build-gpu.sh - build the CUDA plugin and the GPU tests without meson's full dependency set,
# for a machine that has nvcc and a C compiler but not the daemon's libraries (gRPC, libuv,
# protobuf-c, UCX): the image of the GPU check (test/gpu/device-check.sh).
#
#   build-gpu.sh OUT_DIR [PREFIX]
#   build-gpu.sh --list                 the programs it builds and their own sources
#   build-gpu.sh --check MESON_BUILD    exit 1 when meson builds one of those programs from a
#                                       source that is not in that list (nor in the C sources
#                                       every program links), i.e. the build there would fail
#                                       or differ; device-check.sh --dry-run runs both
#
# PREFIX holds include/ and lib/ of the few libraries the tests need (jansson, pcre2-8: the
# checkpoint loader), as test/gpu/prepare-carry.sh lays them out; default: the system's.
# CARRY=1 (prepare-carry.sh): binaries that move with their folder: the programs find
# PREFIX/lib through $ORIGIN/../prefix/lib (OUT_DIR and PREFIX side by side), the plugin
# looks in $ORIGIN, then in this toolkit's lib64 (the device's toolkit comes first through
# LD_LIBRARY_PATH, which device-check.sh sets from its probe).
# Builds in OUT_DIR: libstepd-cuda.so (sm_90a + sm_80, as meson does), test-cuda-host,
# test-cuda-guard, test-cuda-ops, test-cuda-logits, test-cuda-vision, bench-cuda, test-comm-nccl when nccl.h
# is found, and stepd-mkmodel when tools/mkmodel.c is in the tree.  Sources are taken by
# directory (common/, kernels/, worker/model/), so the list follows the tree; objects
# compile in parallel (nproc jobs).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CC=${CC:-cc}
cuda_root=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
nccl_inc=${NCCL_INC:-$cuda_root/include}

# the C sources every program links (libstepd-gpucheck.a): common, kernels (the CPU
# oracle), the model
lib_dirs="common kernels kernels/cpu worker/model"
# the programs, NAME SOURCES... (from the root): test-cuda-guard links nothing else;
# test-comm-nccl is built where nccl.h is found (libnccl is opened with dlopen at run
# time); stepd-mkmodel where tools/mkmodel.c is in the tree
programs() {
    echo "test-cuda-host test/gpu/test-cuda-host.c"
    echo "test-cuda-guard test/gpu/test-cuda-guard.c"
    echo "test-cuda-ops test/gpu/test-cuda-ops.c"
    echo "test-cuda-logits test/gpu/test-cuda-logits.c"
    echo "test-cuda-vision test/gpu/test-cuda-vision.c"
    echo "bench-cuda test/gpu/bench-cuda.c"
    echo "test-comm-nccl test/comm/test-comm-nccl.c worker/comm/comm-nccl.c worker/comm/comm.c worker/comm/plan-wire.c"
    [ -f "$root/tools/mkmodel.c" ] && echo "stepd-mkmodel tools/mkmodel.c tools/convert.c tools/ckptw.c"
    return 0
}
case "${1:-}" in
    --list)
        echo "libstepd-cuda.so $(cd "$root" && echo kernels/cuda/*.cu)"
        programs
        exit 0 ;;
    --check)
        build=${2:?usage: build-gpu.sh --check MESON_BUILD_DIR}
        programs | python3 -c '
import json, os, sys
build, lib_dirs = os.path.abspath(sys.argv[1]), sys.argv[2].split()
progs = {l.split()[0]: set(l.split()[1:]) for l in sys.stdin if l.strip()}
progs.pop("libstepd-cuda.so", None)     # built by a custom target: its .cu are globbed
try:
    targets = json.load(open(os.path.join(build, "meson-info", "intro-targets.json")))
    info = json.load(open(os.path.join(build, "meson-info", "meson-info.json")))
except (OSError, ValueError) as e:
    sys.exit("build-gpu: %s is not a configured meson build: %s" % (build, e))
src_root = info["directories"]["source"]    # paths relative to the tree meson built
bad, seen = 0, []
for t in targets:
    own = progs.get(t["name"])
    if own is None or t["type"] != "executable":
        continue
    seen.append(t["name"])
    for ts in t.get("target_sources", []):
        for src in ts.get("sources", []):
            src = os.path.abspath(src)
            if src.startswith(build + "/") or not src.endswith((".c", ".cu", ".cc", ".cpp")):
                continue    # generated, or a header
            rel = os.path.relpath(src, src_root)
            if rel not in own and os.path.dirname(rel) not in lib_dirs:
                print("build-gpu: meson builds %s from %s too, build-gpu.sh does not"
                      % (t["name"], rel))
                bad = 1
for name, own in sorted(progs.items()):
    for rel in sorted(own):
        if not os.path.exists(os.path.join(src_root, rel)):
            print("build-gpu: %s: %s is not in the tree" % (name, rel))
            bad = 1
    if name not in seen and name != "test-comm-nccl":     # that one only where CUDA is
        print("build-gpu: %s is no meson target" % name)
        bad = 1
print("build-gpu: the sources of %d programs agree with meson (%s)" % (len(seen), " ".join(sorted(seen)))
      if not bad else "build-gpu: the programs above would not link (or differ) on the device")
sys.exit(bad)
' "$build" "$lib_dirs"
        exit ;;
esac
out=${1:?usage: build-gpu.sh OUT_DIR [PREFIX] | --list | --check MESON_BUILD_DIR}
prefix=${2:-}
mkdir -p "$out/obj"
out=$(cd "$out" && pwd)
jobs=$(nproc 2>/dev/null || echo 4)

# run the command lines of file $1, $jobs at a time; fail if any failed
run_jobs() {
    xargs -P "$jobs" -d '\n' -I{} bash -c '{}' < "$1"
}

cat > "$out/stepd-config.h" <<EOF
#pragma once
#define HAVE_UCX 0
#define HAVE_CUDA 1
#define STEPD_VERSION "gpu-check"
EOF

inc=(-I"$out" -I"$root/common" -I"$root/kernels" -I"$root/kernels/cpu" -I"$root/kernels/cuda"
     -I"$root/worker" -I"$root/worker/model" -I"$root/test" -I"$root/test/model" -I"$root/tools")
libs=(-lm -ldl -lpthread)
if [ -n "$prefix" ]; then
    prefix=$(cd "$prefix" && pwd)
    inc+=(-I"$prefix/include")
    if [ "${CARRY:-0}" = 1 ]; then
        libs=(-L"$prefix/lib" -Wl,-rpath,'$ORIGIN/../prefix/lib' "${libs[@]}")
    else
        libs=(-L"$prefix/lib" -Wl,-rpath,"$prefix/lib" "${libs[@]}")
    fi
fi
libs=(-ljansson -lpcre2-8 "${libs[@]}")
cflags=(-std=gnu17 -O2 -g -D_GNU_SOURCE -fno-strict-aliasing -pthread -Wno-unused-parameter
        -DSTEPD_PLUGIN_BUILD_DIR="\"$out\"" -DSTEPD_PLUGIN_LIBDIR="\"\"")

# C objects (parallel): common, kernels (the CPU oracle), the model
srcs=()
for d in $lib_dirs; do
    srcs+=("$root/$d"/*.c)
done
objs=()
for s in "${srcs[@]}"; do
    o="$out/obj/$(echo "${s#$root/}" | tr / _).o"
    objs+=("$o")
    printf '%q ' "$CC" "${cflags[@]}" "${inc[@]}" -c "$s" -o "$o"; echo
done > "$out/obj/c.jobs"
run_jobs "$out/obj/c.jobs"

# the plugin: every .cu for sm_90a and sm_80
nvflags=(-O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -Xcompiler -fPIC
         -Xcompiler -fvisibility=hidden
         -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80
         -I"$root/kernels/cuda" -I"$root/kernels" -I"$root/common" -I"$out")
cuobjs=()
for s in "$root"/kernels/cuda/*.cu; do
    o="$out/obj/$(basename "$s").o"
    cuobjs+=("$o")
    printf '%q ' "$NVCC" "${nvflags[@]}" -c "$s" -o "$o"; echo
done > "$out/obj/cu.jobs"
run_jobs "$out/obj/cu.jobs"
plugin_rpath="$cuda_root/lib64"
[ "${CARRY:-0}" = 1 ] && plugin_rpath='$ORIGIN:'"$plugin_rpath"
g++ -shared -o "$out/libstepd-cuda.so" "${cuobjs[@]}" -L"$cuda_root/lib64" \
    -Wl,-rpath,"$plugin_rpath" -Wl,--no-undefined -lcudart_static -lcublasLt -lrt -ldl \
    -lpthread -lm

ar rcs "$out/libstepd-gpucheck.a" "${objs[@]}"
prog() {    # prog NAME SOURCES...
    local name=$1; shift
    $CC "${cflags[@]}" "${inc[@]}" -o "$out/$name" "$@" "$out/libstepd-gpucheck.a" "${libs[@]}"
}
programs | while read -r name files; do
    set -- $files
    set -- "${@/#/$root/}"
    case "$name" in
        test-cuda-guard)
            $CC "${cflags[@]}" -I"$root/test" -I"$root/kernels/cuda" -I"$root/worker/comm" \
                -o "$out/$name" "$@" -lpthread ;;
        test-comm-nccl)
            [ -f "$nccl_inc/nccl.h" ] || { echo "build-gpu: no nccl.h in $nccl_inc: no $name"; continue; }
            $CC "${cflags[@]}" "${inc[@]}" -I"$root/worker/comm" -I"$cuda_root/include" -I"$nccl_inc" \
                -o "$out/$name" "$@" "$out/libstepd-gpucheck.a" \
                -L"$cuda_root/lib64" -lcudart_static -lrt "${libs[@]}" ;;
        *)
            prog "$name" "$@" ;;
    esac
done
echo "build-gpu: built in $out"
