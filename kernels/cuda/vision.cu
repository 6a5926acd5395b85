// vision.cu - the vision encoder's ops on the device (kernels/vision-dev.h; issue 40):
// layernorm with bias, bias add (+ quick-GELU), the LayerScale residual, 2-D RoPE,
// patchify + normalise, the bilinear position-table resize, im2col of the stride-2 3x3
// downsamplers, and the bidirectional attention of one view (GEMM, softmax rows, GEMM per
// head through kcu_gemm: cuBLASLt in FP32).  Each op computes what its vops_ namesake of
// kernels/cpu/vision-ops.c computes; test/gpu/test-cuda-vision.c checks them (on the host
// emulator in the suite) and the whole tower against the CPU encoder.
#include <math.h>

#include "common.cuh"
#include "cuda.h"
#include "kcu.cuh"
#include "vision-dev.h"

#define VIS_THREADS 256

// ---- layernorm: one block per row, two passes (mean, then the variance about it) ----

static __global__ void vis_layernorm_kernel(const float *x, const float *g, const float *b, int dim,
                                            float eps, float *y)
{
    __shared__ float red[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        s += xr[i];
    const float mu = block_sum(s, red) / dim;
    float v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        v += (xr[i] - mu) * (xr[i] - mu);
    const float inv = rsqrtf(block_sum(v, red) / dim + eps);
    // every thread has read its elements of x above: y may alias x
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        y[row * dim + i] = (xr[i] - mu) * inv * g[i] + b[i];
}

static int vis_layernorm(struct backend *be, const float *x, const float *g, const float *b, int64_t rows,
                         int dim, float eps, float *y)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (rows <= 0)
        return rows < 0 ? -EINVAL : 0;
    if (rows > INT32_MAX)
        return -EINVAL;
    vis_layernorm_kernel<<<(unsigned) rows, VIS_THREADS, 0, c->stream>>>(x, g, b, dim, eps, y);
    return CUDA_LAUNCH_CHECK();
}

// ---- bias (+ quick-GELU), LayerScale residual ----

static __global__ void vis_bias_act_kernel(float *y, const float *b, int64_t n, int dim, int gelu)
{
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float v = y[i] + b[i % dim];
    if (gelu)
        v = v / (1.0f + expf(-1.702f * v));
    y[i] = v;
}

static int vis_bias_act(struct backend *be, float *y, const float *b, int64_t rows, int dim, int gelu)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t n = rows * dim;
    if (n <= 0)
        return n < 0 ? -EINVAL : 0;
    vis_bias_act_kernel<<<cuda_blocks((size_t) n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(y, b, n, dim, gelu);
    return CUDA_LAUNCH_CHECK();
}

static __global__ void vis_scale_add_kernel(float *h, const float *gamma, const float *y, const float *b,
                                            int64_t n, int dim)
{
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    const int j = (int) (i % dim);
    h[i] += gamma[j] * (b ? y[i] + b[j] : y[i]);
}

static int vis_scale_add(struct backend *be, float *h, const float *gamma, const float *y, const float *b,
                         int64_t rows, int dim)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t n = rows * dim;
    if (n <= 0)
        return n < 0 ? -EINVAL : 0;
    vis_scale_add_kernel<<<cuda_blocks((size_t) n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(h, gamma, y, b,
                                                                                              n, dim);
    return CUDA_LAUNCH_CHECK();
}

// ---- 2-D RoPE: one thread per (token, pair j); the first head_dim/4 pairs turn with the
// column, the next head_dim/4 with the row; the angle in FP64 as the host's ----

static __global__ void vis_rope2d_kernel(float *x, int g, int64_t ld, int heads, int head_dim, double theta)
{
    const int half = head_dim / 2, q = head_dim / 4;
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t) g * g * half)
        return;
    const int t = (int) (i / half), j = (int) (i % half);
    const int row = t / g, col = t % g;
    const double a = j < q ? col * pow(theta, -4.0 * j / head_dim) : row * pow(theta, -4.0 * (j - q) / head_dim);
    const float cs = (float) cos(a), sn = (float) sin(a);
    float *xt = x + (int64_t) t * ld;
    for (int h = 0; h < heads; h++) {
        float *p = xt + (int64_t) h * head_dim + 2 * j;
        const float x0 = p[0], x1 = p[1];
        p[0] = x0 * cs - x1 * sn;
        p[1] = x1 * cs + x0 * sn;
    }
}

static int vis_rope2d(struct backend *be, float *x, int g, int64_t ld, int heads, int head_dim, double theta)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t n = (size_t) g * g * (head_dim / 2);
    if (g < 0 || head_dim % 4 || heads <= 0)
        return -EINVAL;
    if (n == 0)
        return 0;
    vis_rope2d_kernel<<<cuda_blocks(n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(x, g, ld, heads, head_dim,
                                                                                  theta);
    return CUDA_LAUNCH_CHECK();
}

// ---- patchify + normalise: one thread per output element ----

struct vis_norm3 {
    float mean[3], std[3];
};

static __global__ void vis_patchify_kernel(const uint8_t *rgb, int size, int P, struct vis_norm3 nm, float *out)
{
    const int g = size / P;
    const int64_t K = 3 * (int64_t) P * P;
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t) g * g * K)
        return;
    const int64_t patch = i / K;
    const int k = (int) (i % K);
    const int ch = k / (P * P), py = k / P % P, px = k % P;
    const int gy = (int) (patch / g), gx = (int) (patch % g);
    const uint8_t v = rgb[(((int64_t) gy * P + py) * size + (int64_t) gx * P + px) * 3 + ch];
    out[i] = ((float) v / 255.0f - nm.mean[ch]) / nm.std[ch];
}

static int vis_patchify(struct backend *be, const uint8_t *rgb, int size, int P, const float mean[3],
                        const float std[3], float *out)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    struct vis_norm3 nm;
    if (P <= 0 || size < 0 || size % P)
        return -EINVAL;
    const size_t n = (size_t) (size / P) * (size / P) * 3 * P * P;
    if (n == 0)
        return 0;
    for (int i = 0; i < 3; i++) {
        nm.mean[i] = mean[i];
        nm.std[i] = std[i];
    }
    vis_patchify_kernel<<<cuda_blocks(n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(rgb, size, P, nm, out);
    return CUDA_LAUNCH_CHECK();
}

// ---- bilinear resize of the position table (PyTorch align_corners=False, as vops_) ----

static __device__ void vis_bl_axis(int o, int n_in, int n_out, int *i0, int *i1, float *l)
{
    double s = (o + 0.5) * ((double) n_in / n_out) - 0.5;
    if (s < 0)
        s = 0;
    *i0 = (int) s;
    *i1 = *i0 + 1 < n_in ? *i0 + 1 : n_in - 1;
    *l = (float) (s - *i0);
}

static __global__ void vis_bilinear_kernel(const float *src, int g0, int g, int C, float *dst, int add)
{
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t) g * g * C)
        return;
    const int c = (int) (i % C);
    const int t = (int) (i / C), y = t / g, x = t % g;
    float v;
    if (g == g0) {
        v = src[i];
    } else {
        int y0, y1, x0, x1;
        float ly, lx;
        vis_bl_axis(y, g0, g, &y0, &y1, &ly);
        vis_bl_axis(x, g0, g, &x0, &x1, &lx);
        const float p00 = src[((int64_t) y0 * g0 + x0) * C + c], p01 = src[((int64_t) y0 * g0 + x1) * C + c];
        const float p10 = src[((int64_t) y1 * g0 + x0) * C + c], p11 = src[((int64_t) y1 * g0 + x1) * C + c];
        const float top = p00 * (1 - lx) + p01 * lx, bot = p10 * (1 - lx) + p11 * lx;
        v = top * (1 - ly) + bot * ly;
    }
    dst[i] = add ? dst[i] + v : v;
}

static int vis_bilinear(struct backend *be, const float *src, int g0, int g, int C, float *dst, int add)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t n = (size_t) g * g * C;
    if (g0 <= 0 || g < 0 || C < 0)
        return -EINVAL;
    if (n == 0)
        return 0;
    vis_bilinear_kernel<<<cuda_blocks(n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(src, g0, g, C, dst, add);
    return CUDA_LAUNCH_CHECK();
}

// ---- im2col of a stride-2 3x3 convolution with padding 1: cols[s2(g)^2, C*9], column
// c*9 + ky*3 + kx (the [out, in, kh, kw] weight flattened) ----

static __global__ void vis_im2col_kernel(const float *x, int g, int C, float *cols)
{
    const int go = (g - 1) / 2 + 1;
    const int64_t K = 9 * (int64_t) C;
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t) go * go * K)
        return;
    const int o = (int) (i / K), k = (int) (i % K);
    const int c = k / 9, ky = k % 9 / 3, kx = k % 3;
    const int iy = 2 * (o / go) + ky - 1, ix = 2 * (o % go) + kx - 1;
    cols[i] = iy >= 0 && iy < g && ix >= 0 && ix < g ? x[((int64_t) iy * g + ix) * C + c] : 0.0f;
}

static int vis_im2col_s2(struct backend *be, const float *x, int g, int C, float *cols)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    if (g < 0 || C < 0)
        return -EINVAL;
    const int go = g ? (g - 1) / 2 + 1 : 0;
    const size_t n = (size_t) go * go * 9 * C;
    if (n == 0)
        return 0;
    vis_im2col_kernel<<<cuda_blocks(n, VIS_THREADS), VIS_THREADS, 0, c->stream>>>(x, g, C, cols);
    return CUDA_LAUNCH_CHECK();
}

// ---- attention of one view: Q, K of every head gathered contiguous [heads, n, D] and V
// transposed [heads, D, n] (the GEMMs' "weights" need row stride = k), each head's slab
// 256-byte aligned (cuBLASLt's heuristic assumes it of every pointer); per head S = Q Kᵀ
// (row stride padded to 16 bytes), softmax rows, O = P V; then O of every head into o's
// columns ----

static __global__ void vis_qkv_split_kernel(const float *qkv, int64_t n, int heads, int D, int64_t slab,
                                            float *qh, float *kh, float *vt)
{
    const int64_t C = (int64_t) heads * D;
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * C)
        return;
    const int64_t t = i / C;
    const int hd = (int) (i % C), h = hd / D, d = hd % D;
    qh[h * slab + t * D + d] = qkv[t * 3 * C + hd];
    kh[h * slab + t * D + d] = qkv[t * 3 * C + C + hd];
    vt[h * slab + (int64_t) d * n + t] = qkv[t * 3 * C + 2 * C + hd];
}

static __global__ void vis_o_merge_kernel(const float *oh, int64_t n, int heads, int D, int64_t slab, float *o)
{
    const int64_t C = (int64_t) heads * D;
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * C)
        return;
    const int64_t t = i / C;
    const int hd = (int) (i % C), h = hd / D, d = hd % D;
    o[i] = oh[h * slab + t * D + d];
}

// one block per row of s (row stride ld): s = exp((s - max) * scale) / sum over the first
// cols, as vops_softmax_rows
static __global__ void vis_softmax_kernel(float *s, int64_t cols, int64_t ld, float scale)
{
    __shared__ float red[32];
    float *sr = s + (int64_t) blockIdx.x * ld;
    float mx = -INFINITY;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        mx = fmaxf(mx, sr[i]);
    mx = block_max(mx, red);
    float sum = 0.0f;
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x) {
        const float e = expf((sr[i] - mx) * scale);
        sr[i] = e;
        sum += e;
    }
    const float inv = 1.0f / block_sum(sum, red);
    for (int64_t i = threadIdx.x; i < cols; i += blockDim.x)
        sr[i] *= inv;
}

// the workspace of one view's attention: Q, K, Vᵀ, O of every head and S of one head
static size_t vis_attention_ws(int64_t n, int heads, int head_dim)
{
    const int64_t slab = (n * head_dim + 63) & ~(int64_t) 63, ld = (n + 3) & ~(int64_t) 3;
    return 4 * (size_t) (heads * slab) * sizeof(float) + (size_t) (n * ld) * sizeof(float) + 5 * 256;
}

static int vis_attention(struct backend *be, const float *qkv, int64_t n, int heads, int head_dim, float *o)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const int64_t C = (int64_t) heads * head_dim, slab = (n * head_dim + 63) & ~(int64_t) 63;
    const int64_t ld = (n + 3) & ~(int64_t) 3;
    const size_t h_bytes = (size_t) (heads * slab) * sizeof(float), s_bytes = (size_t) (n * ld) * sizeof(float);
    const float scale = 1.0f / sqrtf((float) head_dim);
    int r;

    if (n < 0 || heads <= 0 || head_dim <= 0 || ld > INT32_MAX || 3 * C > INT32_MAX)
        return -EINVAL;
    if (n == 0)
        return 0;
    r = cuda_ws_ensure(c, vis_attention_ws(n, heads, head_dim));
    if (r < 0)
        return r;
    cuda_ws_reset(c);
    float *qh = (float *) cuda_ws_take(c, h_bytes), *kh = (float *) cuda_ws_take(c, h_bytes);
    float *vt = (float *) cuda_ws_take(c, h_bytes), *oh = (float *) cuda_ws_take(c, h_bytes);
    float *s = (float *) cuda_ws_take(c, s_bytes);
    if (!qh || !kh || !vt || !oh || !s)
        return -ENOMEM;
    const unsigned blocks = cuda_blocks((size_t) (n * C), VIS_THREADS);
    vis_qkv_split_kernel<<<blocks, VIS_THREADS, 0, c->stream>>>(qkv, n, heads, head_dim, slab, qh, kh, vt);
    r = CUDA_LAUNCH_CHECK();
    for (int h = 0; h < heads && r == 0; h++) {
        r = kcu_gemm(c, (int) n, (int) n, head_dim, kh + h * slab, KDT_F32, qh + h * slab, head_dim, s, KDT_F32,
                     (int) ld, false);
        if (r == 0) {
            vis_softmax_kernel<<<(unsigned) n, VIS_THREADS, 0, c->stream>>>(s, n, ld, scale);
            r = CUDA_LAUNCH_CHECK();
        }
        if (r == 0)
            r = kcu_gemm(c, (int) n, head_dim, (int) n, vt + h * slab, KDT_F32, s, (int) ld, oh + h * slab,
                         KDT_F32, head_dim, false);
    }
    if (r == 0) {
        vis_o_merge_kernel<<<blocks, VIS_THREADS, 0, c->stream>>>(oh, n, heads, head_dim, slab, o);
        r = CUDA_LAUNCH_CHECK();
    }
    return r;
}

// ---- the encoder's share of the memory plan: the larger of a GEMM's BF16 input
// (kcuda_matmul's workspace; none on the FP32 op path) and a view's attention, as
// cuda_ws_ensure counts it; reserve() keeps it ----

static size_t vis_ws_need(struct backend *be, int64_t gemm_elems, int64_t n_max, int heads, int head_dim)
{
    const struct cuda_ctx *c = cuda_ctx_of(be);
    size_t need = 0;

    if (gemm_elems < 0 || n_max < 0 || heads <= 0 || head_dim <= 0)
        return 0;
    if (!c->exact)
        need = (size_t) gemm_elems * sizeof(bf16);
    if (n_max > 0 && vis_attention_ws(n_max, heads, head_dim) > need)
        need = vis_attention_ws(n_max, heads, head_dim);
    return need + 4096;     // cuda_ws_ensure's alignment margin
}

static int vis_reserve(struct backend *be, int64_t gemm_elems, int64_t n_max, int heads, int head_dim,
                       size_t *ws_bytes)
{
    *ws_bytes = 0;
    if (gemm_elems < 0 || n_max < 0 || heads <= 0 || head_dim <= 0)
        return -EINVAL;
    *ws_bytes = vis_ws_need(be, gemm_elems, n_max, heads, head_dim);
    // only grows: the text plan's workspace may be larger; refused, it keeps its size
    return cuda_ws_plan(cuda_ctx_of(be), *ws_bytes);
}

static const struct vision_dev_ops vision_cuda_ops = {
    .layernorm = vis_layernorm,
    .bias_act = vis_bias_act,
    .scale_add = vis_scale_add,
    .rope2d = vis_rope2d,
    .patchify = vis_patchify,
    .bilinear = vis_bilinear,
    .im2col_s2 = vis_im2col_s2,
    .attention = vis_attention,
    .reserve = vis_reserve,
    .ws_need = vis_ws_need,
};

extern "C" const struct vision_dev_ops *kcuda_vision_ops(void)
{
    return &vision_cuda_ops;
}
