#!/usr/bin/env bash
# build-gpu.sh - build the CUDA plugin and the GPU tests without meson's full dependency set,
# for a machine that has nvcc and a C compiler but not the daemon's libraries (gRPC, libuv,
# protobuf-c, UCX): the image of the GPU check (test/gpu/device-check.sh).
#
#   build-gpu.sh OUT_DIR [PREFIX]
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
out=${1:?usage: build-gpu.sh OUT_DIR [PREFIX]}
prefix=${2:-}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out/obj"
out=$(cd "$out" && pwd)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
CC=${CC:-cc}
cuda_root=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
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
srcs=("$root"/common/*.c "$root"/kernels/*.c "$root"/kernels/cpu/*.c "$root"/worker/model/*.c)
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
prog test-cuda-host "$root/test/gpu/test-cuda-host.c"
$CC "${cflags[@]}" -I"$root/test" -I"$root/kernels/cuda" -I"$root/worker/comm" \
    -o "$out/test-cuda-guard" "$root/test/gpu/test-cuda-guard.c" -lpthread
prog test-cuda-ops "$root/test/gpu/test-cuda-ops.c"
prog test-cuda-logits "$root/test/gpu/test-cuda-logits.c"
prog test-cuda-vision "$root/test/gpu/test-cuda-vision.c"
prog bench-cuda "$root/test/gpu/bench-cuda.c"
# the NCCL communicator's GPU test (libnccl is opened with dlopen at run time: only nccl.h,
# from the toolkit or $NCCL_INC, is needed here)
nccl_inc=${NCCL_INC:-$cuda_root/include}
if [ -f "$nccl_inc/nccl.h" ]; then
    $CC "${cflags[@]}" "${inc[@]}" -I"$root/worker/comm" -I"$cuda_root/include" -I"$nccl_inc" \
        -o "$out/test-comm-nccl" "$root/test/comm/test-comm-nccl.c" "$root/worker/comm/comm-nccl.c" \
        "$root/worker/comm/comm.c" "$root/worker/comm/plan-wire.c" "$out/libstepd-gpucheck.a" \
        -L"$cuda_root/lib64" -lcudart_static -lrt "${libs[@]}"
fi
if [ -f "$root/tools/mkmodel.c" ]; then
    prog stepd-mkmodel "$root/tools/mkmodel.c" "$root/tools/convert.c" "$root/tools/ckptw.c"
fi
echo "build-gpu: built in $out"
