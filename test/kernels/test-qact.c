/* test-qact.c - the int8 activation quantiser of the fast MXFP4 path: the dispatched
 * AVX-512 cpu_qact_quantize (this test skips without AVX-512) equals the scalar oracle bit for bit -
 * int8 values, block scales and correction sums - on random rows, odd block counts
 * (the pad block), zeros, denormals, huge values, infinities and NaNs; and a block's
 * values dequantise to within half a step of the input. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "harness.h"
#include "kisa.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

static float rnd(void)
{
    return ((float)(next() >> 8) / 16777216.0f) * 2.0f - 1.0f;
}

static void fill(float *x, int64_t n, int kind)
{
    for (int64_t j = 0; j < n; j++) {
        float v = rnd() * (float)(1 << (next() % 12));

        switch (kind) {
        case 1: v = 0.0f; break;                                /* all zero */
        case 2: v *= 1e-39f; break;                             /* denormals */
        case 3: v *= 1e30f; break;                              /* huge */
        case 4: if (next() % 7 == 0) v = INFINITY; break;
        case 5: if (next() % 5 == 0) v = NAN; break;
        case 6: if (next() % 3 == 0) v = -0.0f; break;
        case 7: v = (float)(int)(v * 127.0f) / 127.0f; break;   /* exact halves and ties */
        default: break;
        }
        x[j] = v;
    }
}

static void check(int64_t n, int64_t cols, int kind)
{
    size_t bytes = cpu_qact_bytes(n, cols);
    void *ma = calloc(1, bytes), *mb = calloc(1, bytes);
    float *x = malloc((size_t)(n * cols) * sizeof(float));
    struct cpu_qact a, b;

    ASSERT_TRUE(ma && mb && x);
    fill(x, n * cols, kind);
    cpu_qact_init(&a, ma, n, cols);
    cpu_qact_init(&b, mb, n, cols);
    for (int64_t i = 0; i < n; i++) {
        cpu_qact_quantize(&a, i, x + i * cols, 0, cols / 32);
        cpu_qact_quantize_scalar(&b, i, x + i * cols, 0, cols / 32);
    }
    ASSERT_TRUE(memcmp(a.q, b.q, (size_t)(n * a.npair * 64)) == 0);
    ASSERT_TRUE(memcmp(a.d8, b.d8, (size_t)(n * a.npair * 8) * sizeof(float)) == 0);
    ASSERT_TRUE(memcmp(a.corr8, b.corr8, (size_t)(n * a.npair * 8) * sizeof(int32_t)) == 0);
    if (kind == 0 || kind == 7) {
        /* value j of block blk: even j at qe[j/2], odd at qo[j/2]; |x - q d| <= d/2 */
        for (int64_t i = 0; i < n; i++)
            for (int64_t blk = 0; blk < cols / 32; blk++) {
                int64_t pp = i * a.npair + blk / 2, half = blk % 2;
                const int8_t *qe = a.q + pp * 64 + half * 16, *qo = qe + 32;
                float d = a.d8[pp * 8 + half * 4];

                for (int j = 0; j < 32; j++) {
                    float xv = x[i * cols + blk * 32 + j];
                    int q = j % 2 ? qo[j / 2] : qe[j / 2];

                    ASSERT_TRUE(fabsf(xv - (float)q * d) <= 0.5f * d * 1.0001f + 1e-30f);
                }
            }
    }
    free(ma);
    free(mb);
    free(x);
}

int main(void)
{
    static const int64_t cols[] = { 32, 96, 256, 384, 768, 4096 };

    kt_isa_require("qact", CPU_ISA_AVX512);    /* the AVX-512 quantiser against the scalar one */
    for (int kind = 0; kind <= 7; kind++)
        for (size_t c = 0; c < sizeof(cols) / sizeof(cols[0]); c++)
            check(kind == 0 ? 7 : 3, cols[c], kind);
    printf("qact: ok\n");
    return 0;
}
