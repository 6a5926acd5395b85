// argmax.cu - the largest k (<= 64) values of each logits row and their indices, on the
// device (backend.h, backend_argmax): greedy sampling and greedy MTP verification read
// one id per row, sampled rows k (value, id) pairs (and backend_row_expsum's softmax mass,
// below), instead of copying the whole FP32 row.
//
// One block per row.  Place j is the best element after place j-1 in the order "larger
// value first, then lower index" (-0.0 == +0.0: equal values, the index decides); NaN is
// never a candidate, -inf is.  A place is one pass over the row: each thread keeps its
// best candidate of a strided slice, then warps and the block reduce under the same
// order, so every place equals kernels/cpu/argmax.c's (the oracle) whatever the reduction
// tree.  k passes cost k reads of the row (k = 1 for greedy).
#include "common.cuh"
#include "cuda.h"

#define ARGMAX_THREADS 256

// (v, i) before (bv, bi) in the order; bi < 0 is "none"
static inline __device__ bool am_before(float v, int i, float bv, int bi)
{
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// lane 0 gets the warp's best (bv, bi)
static inline __device__ void am_warp_best(float &bv, int &bi)
{
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, bv, o);
        const int oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (am_before(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

static __global__ void argmax_kernel(const float *x, int n, int k, int32_t *ids, float *vals)
{
    PDL_WAIT();
    PDL_TRIGGER();
    __shared__ float sv[32];
    __shared__ int si[32];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * n;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nw = (blockDim.x + 31) >> 5;
    float pv = 0.0f;
    int pi = -1;        // the previous place (none before place 0)
    bool done = false;  // no candidate left

    for (int j = 0; j < k; j++) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = threadIdx.x; i < n && !done; i += blockDim.x) {
            const float v = xr[i];
            if (v != v)
                continue;               // NaN
            if (pi >= 0 && (v > pv || (v == pv && i <= pi)))
                continue;               // at or before the previous place
            if (am_before(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        am_warp_best(bv, bi);
        if (lane == 0) {
            sv[warp] = bv;
            si[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            bv = lane < nw ? sv[lane] : 0.0f;
            bi = lane < nw ? si[lane] : -1;
            am_warp_best(bv, bi);
            if (lane == 0) {
                sv[0] = bv;
                si[0] = bi;
                // an all-NaN row's place 0 is id 0, as sampler_argmax answers
                ids[row * k + j] = bi < 0 && j == 0 ? 0 : bi;
                vals[row * k + j] = bi < 0 ? __int_as_float(0x7fc00000) : bv;
            }
        }
        __syncthreads();
        pv = sv[0];
        pi = si[0];
        done = pi < 0;
        __syncthreads();        // sv/si are written again by the next place
    }
}

int kcuda_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
                 float *vals)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t each = (size_t) rows * k;
    if (rows == 0)
        return 0;
    if (c->capturing)
        return -EBUSY;          // the results go to the host now: never inside a graph
    int r = cuda_ws_ensure(c, 2 * (each * 4 + 256));
    if (r < 0)
        return r;
    cuda_ws_reset(c);
    int32_t *d_ids = (int32_t *) cuda_ws_take(c, each * 4);
    float *d_vals = (float *) cuda_ws_take(c, each * 4);
    if (!d_ids || !d_vals)
        return -ENOMEM;
    cuda_launch(c, argmax_kernel, rows, ARGMAX_THREADS, 0, x, n, k, d_ids, d_vals);
    r = CUDA_LAUNCH_CHECK();
    if (r < 0)
        return r;
    CU_TRY(cudaMemcpyAsync(ids, d_ids, each * 4, cudaMemcpyDeviceToHost, c->stream));
    if (vals)
        CU_TRY(cudaMemcpyAsync(vals, d_vals, each * 4, cudaMemcpyDeviceToHost, c->stream));
    return err_from_cuda(cudaStreamSynchronize(c->stream));
}

// backend_row_expsum: one block per row, each thread adds its strided slice's
// expf((x - mx) / t) in double, then a tree in shared memory (the sampler adds the same
// terms in index order: equal within the terms' FP32 rounding, backend.h).
static __global__ void row_expsum_kernel(const float *x, int n, const float *mx,
                                         const float *temps, double *sums)
{
    PDL_WAIT();
    PDL_TRIGGER();
    __shared__ double sd[ARGMAX_THREADS];
    const int64_t row = blockIdx.x;
    const float *xr = x + row * n;
    const float m = mx[row], t = temps[row];
    double s = 0.0;

    for (int i = threadIdx.x; t > 0.0f && i < n; i += blockDim.x)
        s += (double)expf((xr[i] - m) / t);
    sd[threadIdx.x] = s;
    __syncthreads();
    for (int h = blockDim.x / 2; h > 0; h >>= 1) {
        if ((int)threadIdx.x < h)
            sd[threadIdx.x] += sd[threadIdx.x + h];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        sums[row] = sd[0];
}

int kcuda_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                     const float *temps, double *sums)
{
    struct cuda_ctx *c = cuda_ctx_of(be);
    const size_t fl = (size_t)rows * 4, db = (size_t)rows * 8;
    if (rows == 0)
        return 0;
    if (c->capturing)
        return -EBUSY;          // the sums go to the host now: never inside a graph
    int r = cuda_ws_ensure(c, 2 * fl + db + 3 * 256);
    if (r < 0)
        return r;
    cuda_ws_reset(c);
    float *d_mx = (float *)cuda_ws_take(c, fl);
    float *d_t = (float *)cuda_ws_take(c, fl);
    double *d_s = (double *)cuda_ws_take(c, db);
    if (!d_mx || !d_t || !d_s)
        return -ENOMEM;
    CU_TRY(cudaMemcpyAsync(d_mx, mx, fl, cudaMemcpyHostToDevice, c->stream));
    CU_TRY(cudaMemcpyAsync(d_t, temps, fl, cudaMemcpyHostToDevice, c->stream));
    cuda_launch(c, row_expsum_kernel, rows, ARGMAX_THREADS, 0, x, n, d_mx, d_t, d_s);
    r = CUDA_LAUNCH_CHECK();
    if (r < 0)
        return r;
    CU_TRY(cudaMemcpyAsync(sums, d_s, db, cudaMemcpyDeviceToHost, c->stream));
    return err_from_cuda(cudaStreamSynchronize(c->stream));
}
