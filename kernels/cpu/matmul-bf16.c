/* matmul-bf16.c - y = x · Wᵀ for BF16 (converted on the fly, bits << 16) and F32 weights.
 *
 * Weights stay where the loader put them (no repack).  AVX2: a register-blocked
 * micro-kernel of 3 weight rows x 4 tokens (12 ymm accumulators), so each weight vector is
 * decoded once per 4 tokens and each activation vector loaded once per 3 rows; one token
 * runs 8-row tiles with the same per-row arithmetic, so a row's sum never depends on n
 * (batch invariance).  AVX-512F (runtime-detected): the same with 4 rows x 6 tokens in
 * zmm registers.  Tokens are blocked so their activations (2 MiB) stay in L2/L3 while a
 * thread's rows stream by, and the tiles prefetch the weight rows two tiles ahead.
 * Accumulation is fp32 in 8/16-wide lanes (SIMD) or plain order (scalar): tests compare
 * against an fp64 reference with a relative bound.  On CPUs with AMX-BF16, BF16 weights
 * with cols % 32 == 0 and rows >= 16 run on tiles instead (matmul-amx.c).  These are the
 * exact path's kernels; the BF16 fast path (cpu_bf16_fast) rounds the activations to BF16
 * on AMX (one-part tiles) and on AVX-512 BF16 (matmul-bf16dp.c) where the CPU has them.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

/* multi-token tiles prefetch the weight rows this many tiles ahead */
#define Z_PF_TILES 2

/* Tokens per block: their FP32 activations within BF16_TOKEN_BLOCK_BYTES.  Every block
 * streams the thread's weight rows once more, from DRAM at the real shapes, so the block is
 * sized for the last-level cache rather than L2 (a tile reads its tokens' rows from L2 or
 * L3 at one vector per 4 FMAs).  256 KiB gave 16 tokens at 4096 columns and 4 at the
 * 11264 of a dense MLP's down projection or the 12288 of a sliding layer's o projection:
 * 4 and 16 passes over those weights at 64 tokens, and tiles of 4 tokens instead of 6.
 * On the Zen 4 host of PERFORMANCE.md §8.3, 1 thread, 64 tokens, per CPU-second: 4096 x
 * 4096 77 -> 95 GFLOP/s, 4096 x 11264 37 -> 84 GFLOP/s.  Blocking never changes a
 * result (each output is one tile lane's sum). */
#define BF16_TOKEN_BLOCK_BYTES (2 * 1024 * 1024)

static int64_t token_block(int64_t cols)
{
    int64_t tb = BF16_TOKEN_BLOCK_BYTES / (cols * 4);

    return tb < 4 ? 4 : (tb > 256 ? 256 : tb / 4 * 4);
}

static pthread_once_t tbuf_once = PTHREAD_ONCE_INIT;
static pthread_key_t tbuf_key;
static bool tbuf_ok;

static void tbuf_init(void)
{
    tbuf_ok = pthread_key_create(&tbuf_key, free) == 0;
}

void *cpu_thread_buf(size_t n)
{
    size_t *have;
    void *buf;

    pthread_once(&tbuf_once, tbuf_init);
    if (!tbuf_ok)
        return NULL;
    buf = pthread_getspecific(tbuf_key);
    have = buf;
    if (!buf || *have < n) {
        /* a header of 64 bytes holds the capacity */
        void *nb = aligned_alloc(64, (n + 64 + 63) & ~(size_t)63);

        if (!nb)
            return NULL;
        if (pthread_setspecific(tbuf_key, nb) != 0) {
            free(nb);
            return NULL;
        }
        free(buf);
        buf = nb;
        have = buf;
        *have = n;
    }
    return (uint8_t *)buf + 64;
}

static void f32_rows_scalar(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                            float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t cols = w->cols, tb = token_block(cols);

    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        int64_t i1 = i0 + tb < n ? i0 + tb : n;

        for (int64_t r = r0; r < r1; r++) {
            const float *wr = (const float *)w->data + r * cols;

            for (int64_t i = i0; i < i1; i++) {
                const float *xi = x + (xidx ? xidx[i] : i) * cols;
                float acc[8] = { 0 };
                int64_t j = 0;

                for (; j + 8 <= cols; j += 8)
                    for (int l = 0; l < 8; l++)
                        acc[l] += wr[j + l] * xi[j + l];
                for (; j < cols; j++)
                    acc[0] += wr[j] * xi[j];
                y[i * ldy + (r - r0)] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                                        ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            }
        }
    }
}

static void bf16_rows_scalar(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                             float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t cols = w->cols;

    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + r * cols * 2;

        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + (xidx ? xidx[i] : i) * cols;
            float acc = 0.0f;

            for (int64_t j = 0; j < cols; j++) {
                uint16_t h;

                memcpy(&h, wr + 2 * j, 2);
                acc += cpu_bf16_to_f32(h) * xi[j];
            }
            y[i * ldy + (r - r0)] = acc;
        }
    }
}

#if defined(__x86_64__)
#define AVX2_FN CPU_FN_AVX2
#define AVX2_INLINE __attribute__((target(CPU_TARGET_AVX2), always_inline)) static inline

AVX2_INLINE __m256 bf16x8(const uint8_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);

    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 8 weights of a row at column j: BF16 (2 bytes each) or F32 */
AVX2_INLINE __m256 wload8(const uint8_t *wr, int64_t j, const bool f32)
{
    return f32 ? _mm256_loadu_ps((const float *)wr + j) : bf16x8(wr + 2 * j);
}

AVX2_INLINE float wget(const uint8_t *wr, int64_t j, const bool f32)
{
    uint16_t h;

    if (f32)
        return ((const float *)wr)[j];
    memcpy(&h, wr + 2 * j, 2);
    return cpu_bf16_to_f32(h);
}

/* Lane sums of 4 vectors at once: [hsum(a), hsum(b), hsum(c), hsum(d)]. */
AVX2_INLINE __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));

    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Register tile: R (1..3) weight rows x T (1..4) tokens, 8 columns per step.  Each weight
 * vector is converted once and used for T tokens, each activation vector is loaded once
 * and used for R rows: 3 x 4 = 12 accumulators + 3 weights + 1 activation = the 16 ymm
 * registers, 7 loads per 12 FMAs (FMA-bound instead of load-bound).  R and T are
 * compile-time constants at every call site (always_inline), so the loops unroll fully.
 * out[r * 4 + t] = row r . token t. */
AVX2_INLINE void tile_rt(const uint8_t *w0, int64_t wstride, const float *const *xs,
                         int64_t cols, float *out, const int R, const int T, const bool f32)
{
    __m256 acc[3][4];
    int64_t j = 0;

    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm256_setzero_ps();
    for (; j + 8 <= cols; j += 8) {
        __m256 wv[3];
        /* prefetch the row region Z_PF_TILES tiles ahead (see tile_rt_z) */
        const uint8_t *pf = w0 + (Z_PF_TILES * R) * wstride + j * R * (f32 ? 4 : 2);

        for (int o = 0; o < R * 8 * (f32 ? 4 : 2); o += 64)
            _mm_prefetch((const char *)pf + o, _MM_HINT_T0);

        for (int r = 0; r < R; r++)
            wv[r] = wload8(w0 + r * wstride, j, f32);
        for (int t = 0; t < T; t++) {
            __m256 xv = _mm256_loadu_ps(xs[t] + j);

            for (int r = 0; r < R; r++)
                acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 z = _mm256_setzero_ps();
        __m128 s = hsum8x4(acc[r][0], T > 1 ? acc[r][1] : z, T > 2 ? acc[r][2] : z,
                           T > 3 ? acc[r][3] : z);

        _mm_storeu_ps(out + r * 4, s);
        for (int64_t jj = j; jj < cols; jj++) {
            float wv = wget(w0 + r * wstride, jj, f32);

            for (int t = 0; t < T; t++)
                out[r * 4 + t] += wv * xs[t][jj];
        }
    }
}

/* One token x 8 rows: per row exactly the arithmetic of tile_rt (one 8-lane accumulator
 * over j, the hsum8x4 fold, then the column tail in order), so a row's value is the same
 * as in any multi-token tile; 8 independent chains keep the FMA units busy where tile_rt
 * with T = 1 would have 3.  out[r] = row r . x. */
AVX2_INLINE void tile_r8t1(const uint8_t *w0, int64_t wstride, const float *x, int64_t cols,
                           float *out, const bool f32)
{
    __m256 acc[8];
    int64_t j = 0;

    for (int r = 0; r < 8; r++)
        acc[r] = _mm256_setzero_ps();
    for (; j + 8 <= cols; j += 8) {
        const uint8_t *pf = w0 + (Z_PF_TILES * 8) * wstride + j * 8 * (f32 ? 4 : 2);
        __m256 xv = _mm256_loadu_ps(x + j);

        for (int o = 0; o < 8 * 8 * (f32 ? 4 : 2); o += 64)
            _mm_prefetch((const char *)pf + o, _MM_HINT_T0);
        for (int r = 0; r < 8; r++)
            acc[r] = _mm256_fmadd_ps(wload8(w0 + r * wstride, j, f32), xv, acc[r]);
    }
    for (int r = 0; r < 8; r++) {
        __m256 z = _mm256_setzero_ps();
        float s = _mm_cvtss_f32(hsum8x4(acc[r], z, z, z));

        for (int64_t jj = j; jj < cols; jj++)
            s += wget(w0 + r * wstride, jj, f32) * x[jj];
        out[r] = s;
    }
}

/* Tokens [i0, i1) x rows [r0, r1) with tiles of 3 rows x 4 tokens (8 x 1 for one token). */
AVX2_INLINE void rows_avx2(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                           float *y, int64_t ldy, int64_t r0, int64_t r1, const bool f32)
{
    const int64_t cols = w->cols, tb = token_block(cols), wstride = cols * (f32 ? 4 : 2);
    const uint8_t *wd = (const uint8_t *)w->data;

    /* a row's sum must not depend on the token count (batch invariance, see test-matmul):
     * one token runs tile_r8t1, whose per-row arithmetic is tile_rt's */
    if (n == 1) {
        const float *x0 = x + (xidx ? xidx[0] : 0) * cols;
        int64_t r = r0;

        for (; r + 8 <= r1; r += 8)
            tile_r8t1(wd + r * wstride, wstride, x0, cols, y + (r - r0), f32);
        if (r == r1)
            return;
        y += r - r0;        /* the last rows (< 8) go through the tiles below */
        r0 = r;
    }
    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        int64_t i1 = i0 + tb < n ? i0 + tb : n;

        for (int64_t r = r0; r < r1; r += 3) {
            const uint8_t *wr = wd + r * wstride;
            int nr = r1 - r < 3 ? (int)(r1 - r) : 3;

            for (int64_t i = i0; i < i1; i += 4) {
                int nt = i1 - i < 4 ? (int)(i1 - i) : 4;
                const float *xs[4];
                float out[12];

                for (int k = 0; k < nt; k++)
                    xs[k] = x + (xidx ? xidx[i + k] : i + k) * cols;
#define TILE_CASE(R_, T_)                                                           \
    case (R_) * 4 + (T_): tile_rt(wr, wstride, xs, cols, out, R_, T_, f32); break
                switch (nr * 4 + nt) {
                TILE_CASE(1, 1); TILE_CASE(1, 2); TILE_CASE(1, 3); TILE_CASE(1, 4);
                TILE_CASE(2, 1); TILE_CASE(2, 2); TILE_CASE(2, 3); TILE_CASE(2, 4);
                TILE_CASE(3, 1); TILE_CASE(3, 2); TILE_CASE(3, 3); TILE_CASE(3, 4);
                }
#undef TILE_CASE
                for (int rr = 0; rr < nr; rr++)
                    for (int k = 0; k < nt; k++)
                        y[(i + k) * ldy + (r + rr - r0)] = out[rr * 4 + k];
            }
        }
    }
}

AVX2_FN static void bf16_rows_avx2(const struct bweight *w, const float *x, const int32_t *xidx,
                                   int n, float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    rows_avx2(w, x, xidx, n, y, ldy, r0, r1, false);
}

AVX2_FN static void f32_rows_avx2(const struct bweight *w, const float *x, const int32_t *xidx,
                                  int n, float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    rows_avx2(w, x, xidx, n, y, ldy, r0, r1, true);
}

/* ---- AVX-512F (where the CPU has it): 16-wide, 32 zmm registers ----
 * Tile of 4 weight rows x 6 tokens: 24 accumulators + 4 weights + 1 activation. */
#define AVX512_FN CPU_FN_AVX512
#define AVX512_INLINE __attribute__((target(CPU_TARGET_AVX512), always_inline)) static inline
#define Z_ROWS 4
#define Z_TOKS 6

AVX512_INLINE __m512 wload16(const uint8_t *wr, int64_t j, const bool f32)
{
    if (f32)
        return _mm512_loadu_ps((const float *)wr + j);
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr + 2 * j))), 16));
}

AVX512_INLINE void tile_rt_z(const uint8_t *w0, int64_t wstride, const float *const *xs,
                             int64_t cols, float *out, const int R, const int T, const bool f32)
{
    __m512 acc[Z_ROWS][Z_TOKS];
    int64_t j = 0;

    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++)
            acc[r][t] = _mm512_setzero_ps();
    for (; j + 16 <= cols; j += 16) {
        __m512 wv[Z_ROWS];
        /* the tile's rows are one contiguous region, as are the next tiles': pull the
         * region Z_PF_TILES tiles ahead into cache at the rate this one is consumed (rows
         * of a small model are too short for the hardware prefetcher to ramp up) */
        const uint8_t *pf = w0 + (Z_PF_TILES * R) * wstride + j * R * (f32 ? 4 : 2);

        for (int o = 0; o < R * 16 * (f32 ? 4 : 2); o += 64)
            _mm_prefetch((const char *)pf + o, _MM_HINT_T0);

        for (int r = 0; r < R; r++)
            wv[r] = wload16(w0 + r * wstride, j, f32);
        for (int t = 0; t < T; t++) {
            __m512 xv = _mm512_loadu_ps(xs[t] + j);

            for (int r = 0; r < R; r++)
                acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < R; r++) {
        /* fold 16 lanes to 8, then 4 tokens' lane sums at once */
        __m256 h[Z_TOKS];
        __m128 s;

        for (int t = 0; t < Z_TOKS; t++)
            h[t] = t < T ? _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                             _mm512_castps_pd(acc[r][t]), 1)))
                         : _mm256_setzero_ps();
        s = hsum8x4(h[0], h[1], h[2], h[3]);
        _mm_storeu_ps(out + r * Z_TOKS, s);
        if (T > 4) {
            s = hsum8x4(h[4], h[5], _mm256_setzero_ps(), _mm256_setzero_ps());
            _mm_storel_pi((__m64 *)(out + r * Z_TOKS + 4), s);
        }
        for (int t = 0; t < T; t++)
            for (int64_t jj = j; jj < cols; jj++)
                out[r * Z_TOKS + t] += wget(w0 + r * wstride, jj, f32) * xs[t][jj];
    }
}

AVX512_INLINE void rows_avx512(const struct bweight *w, const float *x, const int32_t *xidx,
                               int n, float *y, int64_t ldy, int64_t r0, int64_t r1,
                               const bool f32)
{
    const int64_t cols = w->cols, tb = token_block(cols), wstride = cols * (f32 ? 4 : 2);
    const uint8_t *wd = (const uint8_t *)w->data;

    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        int64_t i1 = i0 + tb < n ? i0 + tb : n;

        for (int64_t r = r0; r < r1; r += Z_ROWS) {
            const uint8_t *wr = wd + r * wstride;
            int nr = r1 - r < Z_ROWS ? (int)(r1 - r) : Z_ROWS;

            for (int64_t i = i0; i < i1; i += Z_TOKS) {
                int nt = i1 - i < Z_TOKS ? (int)(i1 - i) : Z_TOKS;
                const float *xs[Z_TOKS];
                float out[Z_ROWS * Z_TOKS];

                for (int k = 0; k < nt; k++)
                    xs[k] = x + (xidx ? xidx[i + k] : i + k) * cols;
#define ZT(R_, T_) \
    case (R_) * 8 + (T_): tile_rt_z(wr, wstride, xs, cols, out, R_, T_, f32); break
#define ZR(R_) ZT(R_, 1); ZT(R_, 2); ZT(R_, 3); ZT(R_, 4); ZT(R_, 5); ZT(R_, 6)
                switch (nr * 8 + nt) {
                ZR(1); ZR(2); ZR(3); ZR(4);
                }
#undef ZR
#undef ZT
                for (int rr = 0; rr < nr; rr++)
                    for (int k = 0; k < nt; k++)
                        y[(i + k) * ldy + (r + rr - r0)] = out[rr * Z_TOKS + k];
            }
        }
    }
}

AVX512_FN static void bf16_rows_avx512(const struct bweight *w, const float *x,
                                       const int32_t *xidx, int n, float *y, int64_t ldy,
                                       int64_t r0, int64_t r1)
{
    rows_avx512(w, x, xidx, n, y, ldy, r0, r1, false);
}

AVX512_FN static void f32_rows_avx512(const struct bweight *w, const float *x,
                                      const int32_t *xidx, int n, float *y, int64_t ldy,
                                      int64_t r0, int64_t r1)
{
    rows_avx512(w, x, xidx, n, y, ldy, r0, r1, true);
}

/* The AVX-512 tiles where the CPU has AVX-512F, for every n (one path for every n keeps
 * the results batch-invariant); STEPD_CPU_NO_AVX512 forces the AVX2 kernels (tests run
 * both: cpu_has_avx512f). */
#endif

void cpu_matmul_f32_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                         float *y, int64_t ldy, int64_t r0, int64_t r1, bool avx2)
{
#if defined(__x86_64__)
    if (avx2 && cpu_isa_has(CPU_ISA_AVX512)) {
        f32_rows_avx512(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
    if (avx2) {
        f32_rows_avx2(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
#endif
    f32_rows_scalar(w, x, xidx, n, y, ldy, r0, r1);
}

void cpu_matmul_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                          float *y, int64_t ldy, int64_t r0, int64_t r1, bool avx2, bool fast)
{
#if defined(__x86_64__)
    /* AMX where the weight qualifies (matmul-amx.c; the matmul op packs once per call and
     * calls the AMX kernel itself, other callers such as moe.c come here) */
    if (avx2 && cpu_bf16_use_amx(w) &&
        cpu_matmul_bf16_amx_self(w, x, xidx, n, y, ldy, r0, r1, fast))
        return;
    /* the fast path's vdpbf16ps kernel (matmul-bf16dp.c), packed per thread here */
    if (avx2 && fast && cpu_bf16_dp_fits(w)) {
        void *xb = cpu_thread_buf(cpu_bf16_act_bytes(n, w->cols));

        if (xb) {
            cpu_bf16_act_pack(xb, x, xidx, n, w->cols);
            cpu_matmul_bf16_dp_rows(w, xb, n, y, ldy, r0, r1);
            return;
        }
    }
    if (avx2 && cpu_isa_has(CPU_ISA_AVX512)) {
        bf16_rows_avx512(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
    if (avx2) {
        bf16_rows_avx2(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
#endif
    bf16_rows_scalar(w, x, xidx, n, y, ldy, r0, r1);
}
