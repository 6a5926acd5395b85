/* matmul-nvfp4.c - NVFP4 weights (WFMT_NVFP4: E2M1 nibbles packed as MXFP4's, one E4M3
 * scale per 16 in-features, one F32 global scale; docs/MODEL.md §5.7) through the
 * decoded-row driver of matmul-fp8.c: the exact path decodes to fp64 (e2m1 x e4m3 x the
 * F32 global scale is exact there: 3 + 4 + 24 bits), the fast path to fp32. */
#include "cpu.h"
#include "tensor.h"

static void nvfp4_weight_row(const struct bweight *w, int64_t r, double *out64, float *out32)
{
    const uint8_t *q = (const uint8_t *)w->data + r * (w->cols / 2);
    const uint8_t *sc = w->scale + r * (w->cols / NVFP4_GROUP);

    for (int64_t g = 0; g < w->cols / NVFP4_GROUP; g++) {
        double s64 = (double)cpu_e4m3[sc[g]] * (double)w->gscale;
        float s32 = cpu_e4m3[sc[g]] * w->gscale;
        for (int j = 0; j < NVFP4_GROUP; j++) {
            int64_t c = g * NVFP4_GROUP + j;
            float v = cpu_e2m1[(q[c / 2] >> (4 * (c % 2))) & 15];
            if (out64)
                out64[c] = (double)v * s64;
            else
                out32[c] = v * s32;
        }
    }
}

float cpu_nvfp4_get(const struct bweight *w, int64_t row, int64_t col)
{
    uint8_t b = ((const uint8_t *)w->data)[row * (w->cols / 2) + col / 2];
    return cpu_e2m1[(b >> (4 * (col % 2))) & 15] * cpu_e4m3[w->scale[row * (w->cols / NVFP4_GROUP) + col / NVFP4_GROUP]] *
           w->gscale;
}

void cpu_matmul_nvfp4_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf)
{
    cpu_matmul_decoded_rows(w, nvfp4_weight_row, x, xidx, n, y, ldy, r0, r1, exact, rowbuf);
}
