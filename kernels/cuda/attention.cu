// attention.cu - paged attention on tensor cores (docs/GPU.md §Attention) and the fused
// preparation of q, k and v after the QKV projection.
//
// flash_kernel: a thread block per (tile, KV head, split).  A tile is up to ATTN_QT query
// tokens of one sequence; its rows are (token, query head of the KV head's group), 16
// per warp, so GQA reads each K/V tile once for all the heads that share it.  K and V
// tiles of 64 keys are gathered from the paged cache (BF16 or FP32) into shared memory
// with cp.async (double-buffered); S = QKᵀ and O += PV run on mma.sync m16n8k16 BF16
// with FP32 accumulation and an online softmax in the log2 domain (flash.h).  Decode has
// few tiles: the context is split across blocks (flash-decoding, flash.h picks the split
// count from the SM count) and flash_merge combines the partial softmaxes.  Causal and
// sliding-window masks per row; the head-wise sigmoid gate is applied on output.
//
// qkv_prep_kernel: one warp per (token, head) of the fused projection [q | k | v | g]:
// per-head RMSNorm of q and k (Gemma 1 + w), NeoX RoPE on the first rotary dims, k and v
// written to their cache slots, q to the attention input; the q warps also zero the
// attention output's row of their head (no memset node before the attention).
#include <math.h>

#include "common.cuh"
#include "cuda.h"
#include "flash.h"
#include "kcu.cuh"
#include "mma.cuh"

struct flash_args {
    const void *q;
    void *out;
    const bf16 *gate;
    int gate_ld;
    int n_heads, n_kv_heads, window, block_size, n_splits, rows_cap;
    float sl2;                      // scale * log2(e)
    const void *kc, *vc;
    const int32_t *seq_start, *pos0, *tables, *boff, *tiles, *n_tiles_real, *table_shift;
    float *part;                    // n_splits > 1: [tile][kvh][split][rows_cap][hd] and m, l
    float *ml;
    int32_t *split_done;            // or NULL: per (tile, KV head), splits done (0 between
                                    // launches); the last one merges (no flash_merge node)
};

template <typename T> static __device__ __forceinline__ uint32_t load_pair(const T *p);
template <> __device__ __forceinline__ uint32_t load_pair<bf16>(const bf16 *p)
{
    return *(const uint32_t *) p;
}
template <> __device__ __forceinline__ uint32_t load_pair<float>(const float *p)
{
    const float2 v = *(const float2 *) p;
    return pack_bf16x2(v.x, v.y);
}

template <typename T> static __device__ __forceinline__ void store_pair(T *p, float a, float b);
template <> __device__ __forceinline__ void store_pair<bf16>(bf16 *p, float a, float b)
{
    *(uint32_t *) p = pack_bf16x2(a, b);
}
template <> __device__ __forceinline__ void store_pair<float>(float *p, float a, float b)
{
    *(float2 *) p = make_float2(a, b);
}

template <typename KVT>
static __device__ __forceinline__ void kv_chunk(bf16 *dst, const KVT *src, bool valid);
template <> __device__ __forceinline__ void kv_chunk<bf16>(bf16 *dst, const bf16 *src, bool valid)
{
    cp_async16(dst, src, valid ? 16 : 0);
}
template <> __device__ __forceinline__ void kv_chunk<float>(bf16 *dst, const float *src, bool valid)
{
    uint4 v = make_uint4(0, 0, 0, 0);
    if (valid) {
        const float4 a = *(const float4 *) src, b = *(const float4 *) (src + 4);
        v = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                       pack_bf16x2(b.z, b.w));
    }
    *(uint4 *) dst = v;
}

// Row `base` of the partials of (tile, KV head) merged over the splits into out (query
// token tok, head h), elements d0, d0 + dstep, ...: coefficients as flash_merge_coef,
// computed by each thread; times the head's gate.
template <int HDIM, typename OT>
static __device__ void flash_merge_row(const struct flash_args &a, int64_t base, int tok, int h,
                                       int d0, int dstep)
{
    const float *m = a.ml + base * 2, *l = m + 1;
    const int64_t st = 2 * (int64_t) a.rows_cap;
    float mx = -INFINITY, sum = 0.0f;
    for (int i = 0; i < a.n_splits; i++)
        mx = m[i * st] > mx ? m[i * st] : mx;
    for (int i = 0; i < a.n_splits; i++)
        sum += flash_rescale(m[i * st], mx) * l[i * st];
    const float g = a.gate ? sigmoidf_(__bfloat162float(a.gate[(int64_t) tok * a.gate_ld + h])) : 1.0f;
    for (int d = d0; d < HDIM; d += dstep) {
        float v = 0.0f;
        for (int i = 0; i < a.n_splits; i++) {
            const float c = sum > 0.0f ? flash_rescale(m[i * st], mx) / sum : 0.0f;
            v += c * a.part[(base + (int64_t) i * a.rows_cap) * HDIM + d];
        }
        ((OT *) a.out)[((int64_t) tok * a.n_heads + h) * HDIM + d] = from_f32<OT>(v * g);
    }
}

template <int HDIM, typename KVT, typename QT, typename OT>
static __global__ void __launch_bounds__(256, 1) flash_kernel(const struct flash_args a)
{
    PDL_WAIT();
    constexpr int LDK = HDIM + 8;
    constexpr int KT = FLASH_KEY_TILE;
    extern __shared__ __align__(16) unsigned char fsm[];
    bf16 *ks = (bf16 *) fsm;         // [2][KT][LDK]
    bf16 *vs = ks + 2 * KT * LDK;           // [2][KT][LDK]

    const int tile = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    if (a.n_tiles_real && tile >= *a.n_tiles_real)
        return;
    const int4 td = ((const int4 *) a.tiles)[tile];
    const int s = td.x, t0 = td.y, nq = td.z - td.y;
    if (nq <= 0)
        return;
    const int G = a.n_heads / a.n_kv_heads;
    const int rows = nq * G;
    const int64_t p_first = (int64_t) a.pos0[s] + (t0 - a.seq_start[s]);
    int64_t klo, khi, lo, hi;
    flash_key_range(p_first, p_first + nq - 1, a.window, &klo, &khi);
    flash_split_range(klo, khi, a.n_splits, split, &lo, &hi);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool busy = warp * 16 < rows;     // else the warp only helps to load K and V
    const int ra = warp * 16 + lane / 4, rb = ra + 8;
    const bool va = ra < rows, vb = rb < rows;
    const int64_t ta = p_first + ra / G, tb = p_first + rb / G;
    const int ha = kvh * G + ra % G, hb = kvh * G + rb % G;
    const int64_t qa = ((int64_t) (t0 + ra / G) * a.n_heads + ha) * HDIM;
    const int64_t qb = ((int64_t) (t0 + rb / G) * a.n_heads + hb) * HDIM;

    // Q as A fragments: k-step kk, cols kk*16 + 2(lane%4) (+1), and +8
    uint32_t qf[HDIM / 16][4];
    const QT *q = (const QT *) a.q;
#pragma unroll
    for (int kk = 0; kk < HDIM / 16; kk++) {
        const int col = kk * 16 + 2 * (lane % 4);
        qf[kk][0] = va ? load_pair<QT>(q + qa + col) : 0u;
        qf[kk][1] = vb ? load_pair<QT>(q + qb + col) : 0u;
        qf[kk][2] = va ? load_pair<QT>(q + qa + col + 8) : 0u;
        qf[kk][3] = vb ? load_pair<QT>(q + qb + col + 8) : 0u;
    }

    const int32_t *table = a.tables + (a.table_shift ? *a.table_shift : 0) + a.boff[s];
    const KVT *kc = (const KVT *) a.kc, *vc = (const KVT *) a.vc;
    // element offset of each key of a tile in the cache (-1: past the range), computed once
    // per 64-key tile (one block-table load and division per key, not per 16 bytes);
    // double-buffered like the tiles, so the loop's barrier separates a buffer's reads
    // from its next writes
    __shared__ int64_t koff[2 * KT];
    auto load_tile = [&](int kt, int buf) {
        const int64_t k0 = lo + (int64_t) kt * KT;
        constexpr int CPR = HDIM / 8;         // 16-byte chunks per row
        int64_t *off = koff + buf * KT;
        for (int key = threadIdx.x; key < KT; key += blockDim.x) {
            const int64_t tau = k0 + key;
            int64_t o = -1;
            if (tau < hi) {
                const int64_t slot = (int64_t) table[tau / a.block_size] * a.block_size +
                                     tau % a.block_size;
                o = (slot * a.n_kv_heads + kvh) * HDIM;
            }
            off[key] = o;
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < 2 * KT * CPR; idx += blockDim.x) {
            const int which = idx / (KT * CPR), rem = idx % (KT * CPR);
            const int key = rem / CPR, c8 = rem % CPR;
            const int64_t o = off[key];
            const bool valid = o >= 0;
            const KVT *src = (which ? vc : kc) + (valid ? o : 0) + c8 * 8;
            bf16 *dst = (which ? vs : ks) + (buf * KT + key) * LDK + c8 * 8;
            kv_chunk<KVT>(dst, src, valid);
        }
    };

    float o[HDIM / 8][4];
#pragma unroll
    for (int n = 0; n < HDIM / 8; n++)
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = -INFINITY, mb = -INFINITY, la = 0.0f, lb = 0.0f;

    const int n_kt = hi > lo ? (int) ((hi - lo + KT - 1) / KT) : 0;
    if (n_kt > 0) {
        load_tile(0, 0);
        cp_async_commit();
    }
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {
            load_tile(kt + 1, (kt + 1) & 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (!busy) {
            __syncthreads();
            continue;
        }
        const bf16 *kb = ks + (kt & 1) * KT * LDK, *vb_ = vs + (kt & 1) * KT * LDK;

        float sc[KT / 8][4];
#pragma unroll
        for (int kn = 0; kn < KT / 8; kn++) {
            sc[kn][0] = sc[kn][1] = sc[kn][2] = sc[kn][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HDIM / 16; kk += 2) {
                uint32_t b[4];
                ldsm_x4(b, kb + (kn * 8 + (lane & 7)) * LDK + kk * 16 + (lane >> 3) * 8);
                mma_bf16(sc[kn], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[0], b[1]);
                mma_bf16(sc[kn], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3],
                         b[2], b[3]);
            }
        }
        // scale, mask, running max
        const int64_t key0 = lo + (int64_t) kt * KT;
        float mta = ma, mtb = mb;
#pragma unroll
        for (int kn = 0; kn < KT / 8; kn++) {
#pragma unroll
            for (int cc = 0; cc < 2; cc++) {
                const int64_t tau = key0 + kn * 8 + 2 * (lane % 4) + cc;
                const bool in = tau < hi;
                const float s0 = va && in && flash_key_ok(tau, ta, a.window) ? sc[kn][cc] * a.sl2
                                                                              : -INFINITY;
                const float s1 = vb && in && flash_key_ok(tau, tb, a.window)
                                     ? sc[kn][2 + cc] * a.sl2 : -INFINITY;
                sc[kn][cc] = s0;
                sc[kn][2 + cc] = s1;
                mta = fmaxf(mta, s0);
                mtb = fmaxf(mtb, s1);
            }
        }
        mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 1));
        mta = fmaxf(mta, __shfl_xor_sync(0xffffffffu, mta, 2));
        mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 1));
        mtb = fmaxf(mtb, __shfl_xor_sync(0xffffffffu, mtb, 2));
        const float alpha_a = flash_rescale(ma, mta), alpha_b = flash_rescale(mb, mtb);
        la *= alpha_a;
        lb *= alpha_b;
#pragma unroll
        for (int n = 0; n < HDIM / 8; n++) {
            o[n][0] *= alpha_a;
            o[n][1] *= alpha_a;
            o[n][2] *= alpha_b;
            o[n][3] *= alpha_b;
        }
#pragma unroll
        for (int kn = 0; kn < KT / 8; kn++) {
            sc[kn][0] = flash_p(sc[kn][0], mta);
            sc[kn][1] = flash_p(sc[kn][1], mta);
            sc[kn][2] = flash_p(sc[kn][2], mtb);
            sc[kn][3] = flash_p(sc[kn][3], mtb);
            la += sc[kn][0] + sc[kn][1];
            lb += sc[kn][2] + sc[kn][3];
        }
        ma = mta;
        mb = mtb;
        // O += P V: P of key n8 tiles 2kk, 2kk+1 is the A fragment of k-step kk
#pragma unroll
        for (int kk = 0; kk < KT / 16; kk++) {
            const uint32_t a0 = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
            const uint32_t a1 = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
            const uint32_t a2 = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            const uint32_t a3 = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int n2 = 0; n2 < HDIM / 16; n2++) {
                uint32_t b[4];
                ldsm_x4_trans(b, vb_ + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDK +
                                     n2 * 16 + (lane >> 4) * 8);
                mma_bf16(o[2 * n2], a0, a1, a2, a3, b[0], b[1]);
                mma_bf16(o[2 * n2 + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
        __syncthreads();
    }
    PDL_TRIGGER();
    if (!busy && !a.split_done)
        return;
    if (busy) {
        la += __shfl_xor_sync(0xffffffffu, la, 1);
        la += __shfl_xor_sync(0xffffffffu, la, 2);
        lb += __shfl_xor_sync(0xffffffffu, lb, 1);
        lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    }

    if (a.n_splits == 1) {
        OT *out = (OT *) a.out;
        const float ga = va && a.gate ? sigmoidf_(__bfloat162float(a.gate[(int64_t) (t0 + ra / G) *
                                                                          a.gate_ld + ha])) : 1.0f;
        const float gb = vb && a.gate ? sigmoidf_(__bfloat162float(a.gate[(int64_t) (t0 + rb / G) *
                                                                          a.gate_ld + hb])) : 1.0f;
        const float fa = la > 0.0f ? ga / la : 0.0f, fb = lb > 0.0f ? gb / lb : 0.0f;
#pragma unroll
        for (int n = 0; n < HDIM / 8; n++) {
            const int col = n * 8 + 2 * (lane % 4);
            if (va)
                store_pair<OT>(out + qa + col, o[n][0] * fa, o[n][1] * fa);
            if (vb)
                store_pair<OT>(out + qb + col, o[n][2] * fb, o[n][3] * fb);
        }
        return;
    }
    const int64_t base0 = ((int64_t) tile * a.n_kv_heads + kvh) * a.n_splits * a.rows_cap;
    const int64_t base = base0 + (int64_t) split * a.rows_cap;
    if (busy) {
#pragma unroll
        for (int n = 0; n < HDIM / 8; n++) {
            const int col = n * 8 + 2 * (lane % 4);
            if (va)
                *(float2 *) (a.part + (base + ra) * HDIM + col) = make_float2(o[n][0], o[n][1]);
            if (vb)
                *(float2 *) (a.part + (base + rb) * HDIM + col) = make_float2(o[n][2], o[n][3]);
        }
        if (lane % 4 == 0) {
            if (va)
                *(float2 *) (a.ml + (base + ra) * 2) = make_float2(ma, la);
            if (vb)
                *(float2 *) (a.ml + (base + rb) * 2) = make_float2(mb, lb);
        }
    }
    if (!a.split_done)
        return;
    // this split's partials are written: the last split of (tile, KV head) to finish (all
    // partials visible) merges them, and sets the counter back to 0 for the next launch
    __shared__ int merge_last[1];
    int32_t *done = a.split_done + (int64_t) tile * a.n_kv_heads + kvh;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        merge_last[0] = atomicAdd(done, 1) == a.n_splits - 1;
    }
    __syncthreads();
    if (!merge_last[0])
        return;
    __threadfence();
    for (int r = warp; r < rows; r += blockDim.x >> 5)
        flash_merge_row<HDIM, OT>(a, base0 + r, t0 + r / G, kvh * G + r % G, lane, 32);
    if (threadIdx.x == 0)
        *done = 0;
}

// One block per (tile, KV head, row): out = sum over splits of coef * o, times the gate.
template <int HDIM, typename OT>
static __global__ void flash_merge_kernel(const struct flash_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    const int tile = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z;
    if (a.n_tiles_real && tile >= *a.n_tiles_real)
        return;
    const int4 td = ((const int4 *) a.tiles)[tile];
    const int nq = td.z - td.y, G = a.n_heads / a.n_kv_heads;
    if (r >= nq * G)
        return;
    const int64_t base = ((int64_t) tile * a.n_kv_heads + kvh) * a.n_splits * a.rows_cap + r;
    flash_merge_row<HDIM, OT>(a, base, td.y + r / G, kvh * G + r % G, threadIdx.x, blockDim.x);
}

bool kcu_attention_ok(int n_heads, int n_kv_heads, int head_dim)
{
    const int G = n_heads / n_kv_heads;
    // a block's rows (ATTN_QT tokens x the group) fit the kernel's 8 warps of 16 rows
    return (head_dim == 32 || head_dim == 64 || head_dim == 128) && G * ATTN_QT <= 128 &&
           n_heads % n_kv_heads == 0;
}

#define FLASH_MIN_WARPS 4

static size_t flash_smem(int hd)
{
    return (size_t) 4 * FLASH_KEY_TILE * (hd + 8) * sizeof(bf16);
}

template <int HDIM, typename KVT, typename QT, typename OT>
static int flash_launch(struct cuda_ctx *c, const struct flash_args &fa, int n_tiles, int warps)
{
    static bool attr_set;
    if (!attr_set) {
        CU_TRY(cudaFuncSetAttribute(flash_kernel<HDIM, KVT, QT, OT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int) flash_smem(HDIM)));
        attr_set = true;
    }
    dim3 grid(n_tiles, fa.n_kv_heads, fa.n_splits);
    cuda_launch(c, flash_kernel<HDIM, KVT, QT, OT>, grid, warps * 32, flash_smem(HDIM), fa);
    int r = CUDA_LAUNCH_CHECK();
    if (r < 0 || fa.n_splits == 1 || fa.split_done)
        return r;
    dim3 mgrid(n_tiles, fa.n_kv_heads, fa.rows_cap);
    cuda_launch(c, flash_merge_kernel<HDIM, OT>, mgrid, HDIM, 0, fa);
    return CUDA_LAUNCH_CHECK();
}

template <int HDIM, typename QT, typename OT>
static int flash_by_kv(struct cuda_ctx *c, const struct flash_args &fa, int n_tiles, int warps,
                       bool kv_f32)
{
    return kv_f32 ? flash_launch<HDIM, float, QT, OT>(c, fa, n_tiles, warps)
                  : flash_launch<HDIM, bf16, QT, OT>(c, fa, n_tiles, warps);
}

template <typename QT, typename OT>
static int flash_by_hd(struct cuda_ctx *c, const struct flash_args &fa, int hd, int n_tiles,
                       int warps, bool kv_f32)
{
    switch (hd) {
    case 32: return flash_by_kv<32, QT, OT>(c, fa, n_tiles, warps, kv_f32);
    case 64: return flash_by_kv<64, QT, OT>(c, fa, n_tiles, warps, kv_f32);
    case 128: return flash_by_kv<128, QT, OT>(c, fa, n_tiles, warps, kv_f32);
    default: return -ENOTSUP;
    }
}

static int flash_splits_for(const struct cuda_ctx *c, int n_tiles, int n_kv_heads)
{
    return flash_n_splits(n_tiles * n_kv_heads, c->sms);
}

size_t kcu_attention_ws(const struct cuda_ctx *c, int n_tiles, int n_heads, int head_dim)
{
    // partials exist only with more than one split, i.e. for few tiles (decode)
    const int sp = flash_splits_for(c, n_tiles, 1);
    if (sp <= 1)
        return 0;
    const size_t rows = (size_t) n_tiles * sp * (n_heads * ATTN_QT);
    return rows * (head_dim + 2) * sizeof(float) + 512;
}

int kcu_attention(struct cuda_ctx *c, const struct kcu_attn_args *a)
{
    const int G = a->n_heads / a->n_kv_heads;
    int max_q = ATTN_QT;
    struct flash_args fa = {};

    if (!kcu_attention_ok(a->n_heads, a->n_kv_heads, a->head_dim))
        return -ENOTSUP;
    if (a->n_tiles == 0)
        return 0;
    if (c->map.valid && c->map.qclass == 0 && a->tiles == c->sd.tiles)
        max_q = 1;                  // decode step: one token per tile
    fa.rows_cap = max_q * G;
    // at least FLASH_MIN_WARPS warps a block: at decode (one token: 8 or 12 rows, one warp
    // of them) the others share the loads of the K and V tiles
    int warps = (fa.rows_cap + 15) / 16;
    if (warps < FLASH_MIN_WARPS)
        warps = FLASH_MIN_WARPS;
    fa.q = a->q;
    fa.out = a->out;
    fa.gate = a->gate;
    fa.gate_ld = a->gate_ld;
    fa.n_heads = a->n_heads;
    fa.n_kv_heads = a->n_kv_heads;
    fa.window = a->window;
    fa.block_size = a->kv->block_size;
    fa.sl2 = a->scale * FLASH_LOG2E;
    fa.kc = a->kv->k;
    fa.vc = a->kv->v;
    fa.seq_start = a->seq_start;
    fa.pos0 = a->pos0;
    fa.tables = a->tables;
    fa.boff = a->boff;
    fa.table_shift = a->table_shift;
    fa.tiles = a->tiles;
    fa.n_tiles_real = a->n_tiles_real;
    fa.n_splits = flash_splits_for(c, a->n_tiles, a->n_kv_heads);
    if (fa.n_splits > 1) {
        const size_t rows = (size_t) a->n_tiles * a->n_kv_heads * fa.n_splits * fa.rows_cap;
        fa.part = (float *) cuda_ws_take(c, rows * a->head_dim * sizeof(float));
        fa.ml = (float *) cuda_ws_take(c, rows * 2 * sizeof(float));
        if (!fa.part || !fa.ml)
            return -ENOMEM;
        // the merge in the kernel's last split (flash_merge_kernel past the counters)
        if ((int64_t) a->n_tiles * a->n_kv_heads <= KCU_SPLIT_DONE_CAP)
            fa.split_done = c->d_split_done;
    }
    if (a->qt == KDT_BF16 && a->ot == KDT_BF16)
        return flash_by_hd<bf16, bf16>(c, fa, a->head_dim, a->n_tiles, warps, a->kv->dtype_f32);
    if (a->qt == KDT_F32 && a->ot == KDT_F32)
        return flash_by_hd<float, float>(c, fa, a->head_dim, a->n_tiles, warps, a->kv->dtype_f32);
    return -ENOTSUP;
}

int kcu_attention_tiles(const int32_t *seq_start, int n_seqs, int32_t *t)
{
    int n = 0;
    for (int s = 0; s < n_seqs; s++)
        for (int32_t t0 = seq_start[s]; t0 < seq_start[s + 1]; t0 += ATTN_QT) {
            const int32_t t1 = t0 + ATTN_QT < seq_start[s + 1] ? t0 + ATTN_QT : seq_start[s + 1];
            t[4 * n] = s;
            t[4 * n + 1] = t0;
            t[4 * n + 2] = t1;
            t[4 * n + 3] = 0;
            n++;
        }
    return n;
}

// ---- q / k / v after the fused projection ----

static inline __device__ float normw(const void *w, int f32, int i)
{
    return f32 ? ((const float *) w)[i] : bf16_to_f32(((const uint16_t *) w)[i]);
}

// one warp per (token, head slot): slots [0, n_heads) are q heads, [n_heads, n_heads +
// n_kv_heads) k heads (their v heads go along)
static __global__ void qkv_prep_kernel(const struct kcu_qkv_args a)
{
    PDL_WAIT();
    PDL_TRIGGER();
    extern __shared__ float qkv_sh[];       // [warps][head_dim]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int64_t item = (int64_t) blockIdx.x * (blockDim.x / 32) + warp;
    const int slots = a.n_heads + a.n_kv_heads;
    if (item >= (int64_t) a.n_rows * slots)
        return;
    const int t = (int) (item / slots), hs = (int) (item % slots);
    const bool is_q = hs < a.n_heads;
    const int kvh = hs - a.n_heads;
    const int hd = a.head_dim;
    const int q_dim = a.n_heads * hd, kv_dim = a.n_kv_heads * hd;
    const bf16 *src = a.qkvg + (int64_t) t * a.ld + (is_q ? hs * hd : q_dim + kvh * hd);
    float *v = qkv_sh + warp * hd;
    const void *nw = is_q ? a.q_norm : a.k_norm;
    float ss = 0.0f;

    for (int i = lane; i < hd; i += 32) {
        const float x = __bfloat162float(src[i]);
        v[i] = x;
        ss += x * x;
    }
    if (nw) {
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / hd + a.eps);
        for (int i = lane; i < hd; i += 32)
            v[i] = v[i] * r * (1.0f + normw(nw, a.norm_f32, i));
    }
    __syncwarp();
    const int half = a.rotary / 2;
    float y[8];                             // head_dim <= 256: element lane + 32 j
    const float p = (float) a.pos[t];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int i = lane + 32 * j;
        float val = i < hd ? v[i] : 0.0f;
        if (i < half) {
            float sn, cs;
            sincosf(p * a.inv_freq[i], &sn, &cs);
            val = v[i] * cs - v[i + half] * sn;
        } else if (i < a.rotary) {
            float sn, cs;
            sincosf(p * a.inv_freq[i - half], &sn, &cs);
            val = v[i] * cs + v[i - half] * sn;
        }
        y[j] = val;
    }
    if (is_q) {
        bf16 *dst = a.q16 + (int64_t) t * q_dim + hs * hd;
        bf16 *z = a.att ? a.att + (int64_t) t * q_dim + hs * hd : NULL;
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (lane + 32 * j < hd) {
                dst[lane + 32 * j] = __float2bfloat16_rn(y[j]);
                if (z)
                    z[lane + 32 * j] = __float2bfloat16_rn(0.0f);
            }
        return;
    }
    const int32_t slot = a.slots[t];
    if (slot < 0)
        return;
    const int64_t off = ((int64_t) slot * a.n_kv_heads + kvh) * hd;
    const bf16 *vsrc = a.qkvg + (int64_t) t * a.ld + q_dim + kv_dim + kvh * hd;
    if (a.kv->dtype_f32) {
        float *kd = (float *) a.kv->k + off, *vd = (float *) a.kv->v + off;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int i = lane + 32 * j;
            if (i < hd) {
                kd[i] = y[j];
                vd[i] = __bfloat162float(vsrc[i]);
            }
        }
    } else {
        bf16 *kd = (bf16 *) a.kv->k + off, *vd = (bf16 *) a.kv->v + off;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int i = lane + 32 * j;
            if (i < hd) {
                kd[i] = __float2bfloat16_rn(y[j]);
                vd[i] = vsrc[i];
            }
        }
    }
}

int kcu_qkv_prep(struct cuda_ctx *c, const struct kcu_qkv_args *a)
{
    const int warps = 4;
    const size_t items = (size_t) a->n_rows * (a->n_heads + a->n_kv_heads);
    if (a->head_dim > 256)
        return -ENOTSUP;
    if (items == 0)
        return 0;
    cuda_launch(c, qkv_prep_kernel, cuda_blocks(items, warps), warps * 32,
                warps * a->head_dim * sizeof(float), *a);
    return CUDA_LAUNCH_CHECK();
}

// ---- the op (FP32 interface) ----

int kcuda_attention(struct backend *be, const struct attn_args *a)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 || a->head_dim > 256)
        return -EINVAL;
    if (a->n_tok == 0)
        return 0;
    int max_tab = 0;
    // a needed block released or outside the pool: an error here, not an illegal address
    if (sg_blocks_check(a->block_tables, a->block_table_off, a->seq_tok_start, a->seq_pos0,
                        a->n_seqs, a->window, a->kv->block_size, a->kv->n_blocks, &max_tab,
                        NULL) < 0)
        return -EINVAL;
    int r = cuda_ws_ensure(c, kcu_attention_ws(c, a->n_tok + a->n_seqs, a->n_heads, a->head_dim));
    if (r < 0)
        return r;
    cuda_stage_reset(c);
    cuda_ws_reset(c);
    const int32_t *dstart = cuda_index(c, a->seq_tok_start, (size_t) a->n_seqs + 1);
    const int32_t *dpos0 = cuda_index(c, a->seq_pos0, (size_t) a->n_seqs);
    const int32_t *dtab = cuda_index(c, a->block_tables, (size_t) max_tab);
    const int32_t *doff = cuda_index(c, a->block_table_off, (size_t) a->n_seqs);
    if (!dstart || !dpos0 || !dtab || !doff)
        return -ENOMEM;
    if (c->exact || !kcu_attention_ok(a->n_heads, a->n_kv_heads, a->head_dim))
        return kcuda_attention_exact(be, a, dstart, dpos0, dtab, doff);
    int32_t *tiles = (int32_t *) malloc(sizeof(int32_t) * 4 * (size_t) (a->n_tok + a->n_seqs));
    if (!tiles)
        return -ENOMEM;
    const int n_tiles = kcu_attention_tiles(a->seq_tok_start, a->n_seqs, tiles);
    const int32_t *dtiles = (const int32_t *) cuda_stage(c, tiles, sizeof(int32_t) * 4 * n_tiles);
    free(tiles);
    if (!dtiles)
        return -ENOMEM;
    struct kcu_attn_args ka = {};
    ka.q = a->q;
    ka.qt = KDT_F32;
    ka.out = a->out;
    ka.ot = KDT_F32;
    ka.n_heads = a->n_heads;
    ka.n_kv_heads = a->n_kv_heads;
    ka.head_dim = a->head_dim;
    ka.window = a->window;
    ka.scale = a->scale;
    ka.kv = a->kv;
    ka.seq_start = dstart;
    ka.pos0 = dpos0;
    ka.tables = dtab;
    ka.boff = doff;
    ka.tiles = dtiles;
    ka.n_tiles = n_tiles;
    ka.n_tok = a->n_tok;
    return kcu_attention(c, &ka);
}
