/* vision-ops.c - the vision encoder's host kernels (kernels/vision-ops.h). */
#include <math.h>
#include <string.h>

#include "vision-ops.h"

void vops_layernorm(const float *x, const float *g, const float *b, int64_t rows, int dim, float eps,
                    float *y)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *yr = y + r * dim;
        double mu = 0, var = 0;
        float inv;

        for (int i = 0; i < dim; i++)
            mu += xr[i];
        mu /= dim;
        for (int i = 0; i < dim; i++)
            var += ((double) xr[i] - mu) * ((double) xr[i] - mu);
        inv = (float) (1.0 / sqrt(var / dim + eps));
        for (int i = 0; i < dim; i++)
            yr[i] = ((float) (xr[i] - mu)) * inv * g[i] + b[i];
    }
}

void vops_quick_gelu(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = x[i] / (1.0f + expf(-1.702f * x[i]));
}

void vops_bias_add(float *y, const float *b, int64_t rows, int dim)
{
    for (int64_t r = 0; r < rows; r++)
        for (int i = 0; i < dim; i++)
            y[r * dim + i] += b[i];
}

void vops_scale_add(float *h, const float *gamma, const float *y, int64_t rows, int dim)
{
    for (int64_t r = 0; r < rows; r++)
        for (int i = 0; i < dim; i++)
            h[r * dim + i] += gamma[i] * y[r * dim + i];
}

int vops_s2_side(int g)
{
    return (g - 1) / 2 + 1;
}

void vops_im2col_s2(const float *x, int g, int C, float *cols)
{
    int go = vops_s2_side(g);

    for (int oy = 0; oy < go; oy++)
        for (int ox = 0; ox < go; ox++) {
            float *row = cols + ((int64_t) oy * go + ox) * C * 9;
            for (int ky = 0; ky < 3; ky++)
                for (int kx = 0; kx < 3; kx++) {
                    int iy = 2 * oy + ky - 1, ix = 2 * ox + kx - 1;
                    const float *src = iy >= 0 && iy < g && ix >= 0 && ix < g ? x + ((int64_t) iy * g + ix) * C : NULL;
                    for (int c = 0; c < C; c++)
                        row[c * 9 + ky * 3 + kx] = src ? src[c] : 0.0f;
                }
        }
}

void vops_rope2d(float *x, int g, int64_t ld, int heads, int head_dim, double theta)
{
    int q = head_dim / 4;
    double inv[512];

    for (int i = 0; i < q && i < 512; i++)
        inv[i] = pow(theta, -4.0 * i / head_dim);
    for (int t = 0; t < g * g; t++) {
        int row = t / g, col = t % g;
        float *xt = x + (int64_t) t * ld;
        for (int j = 0; j < head_dim / 2; j++) {
            double a = j < q ? col * inv[j] : row * inv[j - q];
            float c = (float) cos(a), s = (float) sin(a);
            for (int h = 0; h < heads; h++) {
                float *p = xt + (int64_t) h * head_dim + 2 * j;
                float x0 = p[0], x1 = p[1];
                p[0] = x0 * c - x1 * s;
                p[1] = x1 * c + x0 * s;
            }
        }
    }
}

void vops_softmax_rows(float *s, int64_t rows, int64_t cols, float scale)
{
    for (int64_t r = 0; r < rows; r++) {
        float *sr = s + r * cols, mx = -INFINITY, sum = 0;
        for (int64_t i = 0; i < cols; i++)
            mx = sr[i] > mx ? sr[i] : mx;
        for (int64_t i = 0; i < cols; i++) {
            sr[i] = expf((sr[i] - mx) * scale);
            sum += sr[i];
        }
        for (int64_t i = 0; i < cols; i++)
            sr[i] /= sum;
    }
}

void vops_patchify(const uint8_t *rgb, int size, int P, const float mean[3], const float std[3],
                   float *out)
{
    int g = size / P;
    int64_t K = 3 * (int64_t) P * P;

    for (int gy = 0; gy < g; gy++)
        for (int gx = 0; gx < g; gx++) {
            float *row = out + ((int64_t) gy * g + gx) * K;
            for (int c = 0; c < 3; c++)
                for (int py = 0; py < P; py++)
                    for (int px = 0; px < P; px++) {
                        uint8_t v = rgb[(((int64_t) gy * P + py) * size + (int64_t) gx * P + px) * 3 + c];
                        row[((int64_t) c * P + py) * P + px] = ((float) v / 255.0f - mean[c]) / std[c];
                    }
        }
}

/* PyTorch's source index for align_corners=False: (dst + 0.5) * in / out - 0.5, >= 0 */
static void bl_axis(int o, int n_in, int n_out, int *i0, int *i1, float *l)
{
    double s = (o + 0.5) * ((double) n_in / n_out) - 0.5;

    if (s < 0)
        s = 0;
    *i0 = (int) s;
    *i1 = *i0 + 1 < n_in ? *i0 + 1 : n_in - 1;
    *l = (float) (s - *i0);
}

void vops_bilinear(const float *src, int g0, int g, int C, float *dst)
{
    if (g == g0) {
        memcpy(dst, src, (size_t) g * g * C * sizeof(float));
        return;
    }
    for (int y = 0; y < g; y++) {
        int y0, y1;
        float ly;
        bl_axis(y, g0, g, &y0, &y1, &ly);
        for (int x = 0; x < g; x++) {
            int x0, x1;
            float lx;
            float *d = dst + ((int64_t) y * g + x) * C;
            const float *p00, *p01, *p10, *p11;

            bl_axis(x, g0, g, &x0, &x1, &lx);
            p00 = src + ((int64_t) y0 * g0 + x0) * C;
            p01 = src + ((int64_t) y0 * g0 + x1) * C;
            p10 = src + ((int64_t) y1 * g0 + x0) * C;
            p11 = src + ((int64_t) y1 * g0 + x1) * C;
            for (int c = 0; c < C; c++) {
                float top = p00[c] * (1 - lx) + p01[c] * lx, bot = p10[c] * (1 - lx) + p11[c] * lx;
                d[c] = top * (1 - ly) + bot * ly;
            }
        }
    }
}
