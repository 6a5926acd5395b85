// mma.cuh - the PTX the tensor-core kernels are written with (sm_80 and later):
// mma.sync m16n8k16 BF16 with FP32 accumulation, ldmatrix, cp.async, 16-byte loads.
#pragma once

#include <stdint.h>

#include "common.cuh"

// c += A·B: A = 16x16 BF16 (row), B = 16x8 BF16 (col), fragments as PTX defines them.
static __device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t) __cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

static __device__ __forceinline__ void ldsm_x2(uint32_t r[2], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// 16 bytes global -> shared, asynchronously; src_bytes < 16 fills the rest with zeros
// (src_bytes 0: a zero chunk, the source is not read).
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

static __device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;\n" ::);
}

template <int N> static __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// 16-byte read-only load (LDG.E.128): weights are streamed once per step.
static __device__ __forceinline__ uint4 ldg16(const void *p)
{
    return __ldg((const uint4 *) p);
}

static __device__ __forceinline__ uint32_t ldg4(const void *p)
{
    return __ldg((const uint32_t *) p);
}

// BF16 pair multiply (exact for the MXFP4 scales: powers of two)
static __device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b)
{
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162 *>(&a);
    __nv_bfloat162 y = *reinterpret_cast<__nv_bfloat162 *>(&b);
    __nv_bfloat162 z = __hmul2(x, y);
    return *reinterpret_cast<uint32_t *>(&z);
}

static __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 z = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&z);
}

// 8 FP32 values at src rounded to BF16 (RNE) into dst, 16 bytes; zeros when !valid
// (the FP32-input staging of mx4_gemm and fp8_gemm)
static __device__ __forceinline__ void stage8_f32_bf16(void *dst, const float *src, bool valid)
{
    uint4 v = make_uint4(0, 0, 0, 0);
    if (valid) {
        const float4 a = *(const float4 *) src, b = *(const float4 *) (src + 4);
        v.x = pack_bf16x2(a.x, a.y);
        v.y = pack_bf16x2(a.z, a.w);
        v.z = pack_bf16x2(b.x, b.y);
        v.w = pack_bf16x2(b.z, b.w);
    }
    *(uint4 *) dst = v;
}
