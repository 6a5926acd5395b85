/* matmul-bf16.c - y = x · Wᵀ for BF16 (converted on the fly, bits << 16) and F32 weights.
 *
 * Weights stay where the loader put them (no repack).  One weight row is streamed at a
 * time, against up to 4 activation rows at once, so a multi-token call decodes each
 * weight once per group of 4 tokens; tokens are blocked so their activations stay in
 * L2 while a thread's rows stream by.  Accumulation is fp32 in 8-wide lanes (AVX2) or
 * plain order (scalar): tests compare against an fp64 reference with a relative bound.
 */
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu.h"

/* software prefetch distance of the 1-token AVX2 loop in bytes (0 = off; benchmarks) */
int cpu_bf16_pf_bytes = 2048;

static int64_t token_block(int64_t cols)
{
    int64_t tb = (256 * 1024) / (cols * 4);

    return tb < 4 ? 4 : (tb > 256 ? 256 : tb / 4 * 4);
}

void cpu_matmul_f32_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
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
#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN static inline __m256 bf16x8(const uint8_t *p)
{
    __m128i h = _mm_loadu_si128((const __m128i *)p);

    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

AVX2_FN static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));

    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One weight row against nt (1..4) activation rows; 32 columns per step. */
AVX2_FN static inline void bf16_row_dot(const uint8_t *wr, int64_t cols, const float *const *xs,
                                        int nt, float *out)
{
    __m256 acc[4][2];
    int64_t j = 0;

    for (int k = 0; k < nt; k++)
        acc[k][0] = acc[k][1] = _mm256_setzero_ps();
    if (nt == 1) {
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();

        for (; j + 32 <= cols; j += 32) {
            if (cpu_bf16_pf_bytes)
                _mm_prefetch((const char *)(wr + 2 * j) + cpu_bf16_pf_bytes, _MM_HINT_T0);
            acc[0][0] = _mm256_fmadd_ps(bf16x8(wr + 2 * j), _mm256_loadu_ps(xs[0] + j), acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(bf16x8(wr + 2 * j + 16), _mm256_loadu_ps(xs[0] + j + 8), acc[0][1]);
            a2 = _mm256_fmadd_ps(bf16x8(wr + 2 * j + 32), _mm256_loadu_ps(xs[0] + j + 16), a2);
            a3 = _mm256_fmadd_ps(bf16x8(wr + 2 * j + 48), _mm256_loadu_ps(xs[0] + j + 24), a3);
        }
        acc[0][0] = _mm256_add_ps(acc[0][0], a2);
        acc[0][1] = _mm256_add_ps(acc[0][1], a3);
    }
    for (; j + 16 <= cols; j += 16) {
        __m256 w0 = bf16x8(wr + 2 * j), w1 = bf16x8(wr + 2 * j + 16);

        for (int k = 0; k < nt; k++) {
            acc[k][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[k] + j), acc[k][0]);
            acc[k][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[k] + j + 8), acc[k][1]);
        }
    }
    for (int k = 0; k < nt; k++) {
        float s = hsum8(_mm256_add_ps(acc[k][0], acc[k][1]));

        for (int64_t jj = j; jj < cols; jj++) {
            uint16_t h;

            memcpy(&h, wr + 2 * jj, 2);
            s += cpu_bf16_to_f32(h) * xs[k][jj];
        }
        out[k] = s;
    }
}

AVX2_FN static void bf16_rows_avx2(const struct bweight *w, const float *x, const int32_t *xidx,
                                   int n, float *y, int64_t ldy, int64_t r0, int64_t r1)
{
    const int64_t cols = w->cols, tb = token_block(cols);

    for (int64_t i0 = 0; i0 < n; i0 += tb) {
        int64_t i1 = i0 + tb < n ? i0 + tb : n;

        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *wr = (const uint8_t *)w->data + r * cols * 2;

            for (int64_t i = i0; i < i1; i += 4) {
                int nt = i1 - i < 4 ? (int)(i1 - i) : 4;
                const float *xs[4];
                float out[4];

                for (int k = 0; k < nt; k++)
                    xs[k] = x + (xidx ? xidx[i + k] : i + k) * cols;
                switch (nt) {
                case 1: bf16_row_dot(wr, cols, xs, 1, out); break;
                case 2: bf16_row_dot(wr, cols, xs, 2, out); break;
                case 3: bf16_row_dot(wr, cols, xs, 3, out); break;
                default: bf16_row_dot(wr, cols, xs, 4, out); break;
                }
                for (int k = 0; k < nt; k++)
                    y[(i + k) * ldy + (r - r0)] = out[k];
            }
        }
    }
}
#endif

void cpu_matmul_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                          float *y, int64_t ldy, int64_t r0, int64_t r1, bool avx2)
{
#if defined(__x86_64__)
    if (avx2) {
        bf16_rows_avx2(w, x, xidx, n, y, ldy, r0, r1);
        return;
    }
#endif
    bf16_rows_scalar(w, x, xidx, n, y, ldy, r0, r1);
}
