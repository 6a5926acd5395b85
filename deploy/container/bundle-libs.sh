#!/bin/sh
# bundle-libs.sh DEST BINARY... - copy the shared libraries the given programs need (as ldd
# resolves them on this system) into DEST, less those the runtime base already has (the
# `case` list below, which deploy-lint checks): the C library and its loader,
# libstdc++/libgcc, the CUDA driver (the NVIDIA container runtime mounts it) and what
# NVIDIA's CUDA runtime image installs - the CUDA runtime, cuBLAS and cuBLASLt (517 of the
# 577 MB this copied before), NCCL, NVRTC/nvJitLink.  The runtime image then needs no
# package manager and carries only what the programs link.  UCX opens its transports as
# modules from <libucs dir>/ucx/ at run time (ldd cannot see them): that directory is copied
# beside libucs, with the libraries its modules link.
set -eu
dest=$1
shift
mkdir -p "$dest"
deps() {
  for bin in "$@"; do
    ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
  done
}
copy() {
  sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*|ld-linux*|libresolv.so.*|\
      libstdc++.so.*|libgcc_s.so.*|libcuda.so.*|libcudart.so.*|libnccl.so.*|libnvidia-*|\
      libcublas.so.*|libcublasLt.so.*|libnvrtc*.so.*|libnvJitLink.so.*)
        continue ;;
    esac
    cp -L "$lib" "$dest/"
  done
}
deps "$@" | copy
ucs=$(deps "$@" | grep '/libucs\.so' | head -n 1 || true)
if [ -n "$ucs" ] && [ -d "$(dirname "$ucs")/ucx" ]; then
  mkdir -p "$dest/ucx"
  cp -L "$(dirname "$ucs")"/ucx/*.so* "$dest/ucx/"
  # a module whose libraries are missing is skipped by UCX; bundle them all the same
  deps "$(dirname "$ucs")"/ucx/*.so* 2>/dev/null | copy
fi
ls "$dest"
