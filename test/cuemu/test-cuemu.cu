// test-cuemu.cu - the emulator's own semantics and checks, on small kernels written here
// (compiled like kernels/cuda: rewrite.py, clang++, the shim headers).
//  - mma.sync.m16n8k16: D = A·B + C against a scalar product, the fragments placed by the
//    PTX ISA's tables written out here a second time;
//  - ldmatrix .x1/.x2/.x4 and .trans against direct reads of the rows;
//  - shfl idx/up/down/xor against their definitions;
//  - each check stops a run that breaks it, with its diagnosis (a child process each):
//    a barrier race and the same kernel with its barrier passing, a deadlock, an ldmatrix
//    past shared memory, a misaligned ldmatrix, a divergent warp collective; a launch
//    above the dynamic shared memory limit is refused with an error;
//  - programmatic dependent launch (common.cuh's cuda_launch with programmatic stream
//    serialization): a kernel that waits first runs clean; one that stores to device
//    memory, reaches __syncthreads, issues an atomic before its wait, or never waits, is
//    stopped naming the kernel; the same store-first kernel without the attribute runs.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "common.cuh"
#include "mma.cuh"

static int failures;

#define CHECK(cond, ...)                     \
    do {                                     \
        if (!(cond)) {                       \
            printf("FAIL: " __VA_ARGS__);    \
            printf("\n");                    \
            failures++;                      \
        }                                    \
    } while (0)

static float bfr(float f)
{
    return __bfloat162float(__float2bfloat16_rn(f));
}

static uint16_t bfb(float f)
{
    return __float2bfloat16_rn(f).__x;
}

// ---- mma ----

static __global__ void mma_kernel(const uint16_t *A, const uint16_t *B, const float *C, float *D)
{
    const int l = threadIdx.x, g = l / 4, t = l % 4;
    // PTX ISA, mma.m16n8k16 .bf16: a_i holds A[row][col], A[row][col+1]
    auto pa = [&](int row, int col) { return (uint32_t) A[row * 16 + col] | (uint32_t) A[row * 16 + col + 1] << 16; };
    auto pb = [&](int k, int n) { return (uint32_t) B[k * 8 + n] | (uint32_t) B[(k + 1) * 8 + n] << 16; };
    float c[4] = { C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1] };
    mma_bf16(c, pa(g, 2 * t), pa(g + 8, 2 * t), pa(g, 2 * t + 8), pa(g + 8, 2 * t + 8), pb(2 * t, g),
             pb(2 * t + 8, g));
    D[g * 8 + 2 * t] = c[0];
    D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2];
    D[(g + 8) * 8 + 2 * t + 1] = c[3];
}

static void test_mma()
{
    uint16_t *A, *B;
    float *C, *D, a[256], b[128], c[128];
    cudaMalloc(&A, 512);
    cudaMalloc(&B, 256);
    cudaMalloc(&C, 512);
    cudaMalloc(&D, 512);
    for (int i = 0; i < 256; i++) {
        a[i] = bfr((float) ((i * 37) % 23) / 7.0f - 1.5f);
        A[i] = bfb(a[i]);
    }
    for (int i = 0; i < 128; i++) {
        b[i] = bfr((float) ((i * 11) % 19) / 5.0f - 2.0f);
        B[i] = bfb(b[i]);
        c[i] = C[i] = (float) (i % 9) - 4.0f;
    }
    mma_kernel<<<1, 32>>>(A, B, C, D);
    double worst = 0;
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 8; n++) {
            double s = c[m * 8 + n];
            for (int k = 0; k < 16; k++)
                s += (double) a[m * 16 + k] * b[k * 8 + n];
            double d = fabs(s - D[m * 8 + n]);
            worst = d > worst ? d : worst;
        }
    printf("mma m16n8k16 bf16: max error %g\n", worst);
    CHECK(worst < 1e-5, "mma differs from A·B + C by %g", worst);
    cudaFree(A);
    cudaFree(B);
    cudaFree(C);
    cudaFree(D);
}

// ---- ldmatrix ----

// 4 matrices of 8x8 b16 in shared memory, rows padded to 24 elements; out[variant][lane][reg]
static __global__ void ldsm_kernel(const uint16_t *src, uint32_t *out)
{
    __shared__ __align__(16) uint16_t m[32][24];
    const int l = threadIdx.x;
    for (int i = l; i < 32 * 24; i += 32)
        m[i / 24][i % 24] = src[i];
    __syncthreads();
    uint32_t r[4];
    ldsm_x4(r, &m[l][0]);
    for (int i = 0; i < 4; i++)
        out[(0 * 32 + l) * 4 + i] = r[i];
    ldsm_x2(r, &m[l & 15][0]);
    for (int i = 0; i < 2; i++)
        out[(1 * 32 + l) * 4 + i] = r[i];
    ldsm_x4_trans(r, &m[l][0]);
    for (int i = 0; i < 4; i++)
        out[(2 * 32 + l) * 4 + i] = r[i];
}

static void test_ldmatrix()
{
    uint16_t *src, h[32 * 24];
    uint32_t *out;
    cudaMalloc(&src, sizeof(h));
    cudaMalloc(&out, 3 * 32 * 4 * 4);
    for (int i = 0; i < 32 * 24; i++)
        h[i] = (uint16_t) (i * 7 + 1);
    cudaMemcpy(src, h, sizeof(h), cudaMemcpyHostToDevice);
    ldsm_kernel<<<1, 32>>>(src, out);
    int bad = 0;
    for (int l = 0; l < 32; l++) {
        const int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; i++) {
            // matrix i = rows 8i..8i+7 of m; lane l: row g, columns 2t, 2t+1
            uint32_t want = h[(8 * i + g) * 24 + 2 * t] | (uint32_t) h[(8 * i + g) * 24 + 2 * t + 1] << 16;
            bad += out[(0 * 32 + l) * 4 + i] != want;
            if (i < 2)
                bad += out[(1 * 32 + l) * 4 + i] != want;
            // .trans: rows 2t, 2t+1 of column g
            uint32_t wt = h[(8 * i + 2 * t) * 24 + g] | (uint32_t) h[(8 * i + 2 * t + 1) * 24 + g] << 16;
            bad += out[(2 * 32 + l) * 4 + i] != wt;
        }
    }
    printf("ldmatrix x4, x2, x4.trans: %d wrong registers\n", bad);
    CHECK(bad == 0, "ldmatrix: %d registers differ from the PTX layout", bad);
    cudaFree(src);
    cudaFree(out);
}

// ---- shfl ----

static __global__ void shfl_kernel(int *out)
{
    const int l = threadIdx.x;
    out[0 * 32 + l] = __shfl_sync(0xffffffffu, l * 3, (l * 5) & 31);
    out[1 * 32 + l] = __shfl_up_sync(0xffffffffu, l * 3, 3);
    out[2 * 32 + l] = __shfl_down_sync(0xffffffffu, l * 3, 5);
    out[3 * 32 + l] = __shfl_xor_sync(0xffffffffu, l * 3, 9);
}

static void test_shfl()
{
    int *out, bad = 0;
    cudaMalloc(&out, 4 * 32 * sizeof(int));
    shfl_kernel<<<1, 32>>>(out);
    for (int l = 0; l < 32; l++) {
        bad += out[l] != ((l * 5) & 31) * 3;
        bad += out[32 + l] != (l >= 3 ? l - 3 : l) * 3;
        bad += out[64 + l] != (l + 5 < 32 ? l + 5 : l) * 3;
        bad += out[96 + l] != (l ^ 9) * 3;
    }
    printf("shfl idx/up/down/xor: %d wrong lanes\n", bad);
    CHECK(bad == 0, "shfl: %d lanes differ", bad);
    cudaFree(out);
}

// ---- the checks: each kernel run in a child, its diagnosis expected ----

static __global__ void race_kernel(float *out, int with_barrier)
{
    __shared__ float s[64];
    s[threadIdx.x] = (float) threadIdx.x;
    if (with_barrier)
        __syncthreads();
    out[threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

// lanes 0-15 wait at a shuffle for lanes 16-31, which wait at the barrier for them
static __global__ void deadlock_kernel(int *out)
{
    int v = 0;
    if (threadIdx.x < 16)
        v = __shfl_xor_sync(0xffffffffu, 1, 1);
    else
        __syncthreads();
    out[threadIdx.x] = v;
}

static __global__ void ldsm_oob_kernel(uint32_t *out)
{
    __shared__ __align__(16) uint16_t m[31][8];
    uint32_t r[4];
    if (threadIdx.x < 31)
        for (int i = 0; i < 8; i++)
            m[threadIdx.x][i] = 0;
    __syncthreads();
    ldsm_x4(r, &m[threadIdx.x][0]);     // row 31 of 31
    out[threadIdx.x] = r[0];
}

static __global__ void ldsm_misaligned_kernel(uint32_t *out)
{
    __shared__ __align__(16) uint16_t m[32][16];
    uint32_t r[4];
    for (int i = 0; i < 16; i++)
        m[threadIdx.x][i] = 0;
    __syncthreads();
    ldsm_x4(r, &m[threadIdx.x][4]);     // 8-byte aligned rows
    out[threadIdx.x] = r[0];
}

static __global__ void divergent_kernel(int *out)
{
    int v = threadIdx.x & 1 ? __shfl_xor_sync(0xffffffffu, 1, 1) : __shfl_down_sync(0xffffffffu, 1, 1);
    out[threadIdx.x] = v;
}

static __global__ void big_smem_kernel(int *out)
{
    extern __shared__ int dyn[];
    dyn[threadIdx.x] = 1;
    out[threadIdx.x] = dyn[threadIdx.x];
}

// PDL: mode 0 waits, then stores; 1 stores first; 2 meets __syncthreads first; 3 an atomic
// first; 4 never waits (and touches no memory)
static __global__ void pdl_kernel(float *out, int mode)
{
    if (mode == 1)
        out[threadIdx.x] = 1.0f;
    if (mode == 2)
        __syncthreads();
    if (mode == 3)
        atomicAdd(out, 1.0f);
    if (mode == 4)
        return;
    cudaGridDependencySynchronize();
    cudaTriggerProgrammaticLaunchCompletion();
    out[threadIdx.x] = 2.0f;
}

// Run fn in a child; its stderr must hold `want` (or, want NULL, the child must succeed).
static void expect(const char *what, void (*fn)(), const char *want)
{
    int p[2];
    if (pipe(p))
        abort();
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 2);
        close(p[0]);
        fn();
        _exit(0);
    }
    close(p[1]);
    char buf[8192];
    size_t n = 0;
    ssize_t r;
    while (n < sizeof(buf) - 1 && (r = read(p[0], buf + n, sizeof(buf) - 1 - n)) > 0)
        n += (size_t) r;
    buf[n] = 0;
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    const bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
    const char *nl = strstr(buf, want ? want : "cuemu:");
    char line[300] = "";
    if (nl) {
        const char *start = nl;
        while (start > buf && start[-1] != '\n')
            start--;
        snprintf(line, sizeof(line), "%.*s", (int) strcspn(start, "\n"), start);
    }
    if (want) {
        printf("%-28s stopped: %s\n", what, line[0] ? line : "(no diagnosis)");
        CHECK(!ok && nl, "%s: want a failure with '%s', got exit status 0x%x and: %s", what, want, st, buf);
    } else {
        printf("%-28s ran clean\n", what);
        CHECK(ok && !nl, "%s: want a clean run, got exit status 0x%x and: %s", what, st, buf);
    }
}

static float *g_out;

static void run_race()
{
    race_kernel<<<1, 64>>>(g_out, 0);
}

static void run_race_ok()
{
    race_kernel<<<1, 64>>>(g_out, 1);
}

static void run_deadlock()
{
    deadlock_kernel<<<1, 32>>>((int *) g_out);
}

static void run_ldsm_oob()
{
    ldsm_oob_kernel<<<1, 32>>>((uint32_t *) g_out);
}

static void run_ldsm_misaligned()
{
    ldsm_misaligned_kernel<<<1, 32>>>((uint32_t *) g_out);
}

static void run_divergent()
{
    divergent_kernel<<<1, 32>>>((int *) g_out);
}

// through the backend's launch helper (common.cuh cuda_launch), the attribute set by c.pdl
static void pdl_launch(int mode, bool attr)
{
    struct cuda_ctx c = {};
    c.pdl = attr;
    if (cuda_launch(&c, pdl_kernel, 2, 64, 0, g_out, mode) != cudaSuccess)
        abort();
}

static void run_pdl_ok() { pdl_launch(0, true); }
static void run_pdl_store() { pdl_launch(1, true); }
static void run_pdl_barrier() { pdl_launch(2, true); }
static void run_pdl_atomic() { pdl_launch(3, true); }
static void run_pdl_never() { pdl_launch(4, true); }
static void run_pdl_store_plain() { pdl_launch(1, false); }

int main()
{
    test_mma();
    test_ldmatrix();
    test_shfl();
    cudaMalloc(&g_out, 1024 * sizeof(float));
    expect("race without __syncthreads", run_race, "barrier race: ");
    expect("race with __syncthreads", run_race_ok, nullptr);
    expect("divergent barrier", run_deadlock, "deadlock in block 0,0,0");
    expect("ldmatrix past shared", run_ldsm_oob, "ldmatrix: shared address");
    expect("ldmatrix misaligned", run_ldsm_misaligned, "not aligned to 16 bytes");
    expect("divergent collectives", run_divergent, "divergent warp collectives");
    expect("PDL: wait first", run_pdl_ok, nullptr);
    expect("PDL: store before the wait", run_pdl_store,
           "cuemu: pdl_kernel: launched with programmatic stream serialization, a thread writes device memory");
    expect("PDL: barrier before the wait", run_pdl_barrier,
           "cuemu: pdl_kernel: launched with programmatic stream serialization, a thread reaches __syncthreads");
    expect("PDL: atomic before the wait", run_pdl_atomic,
           "cuemu: pdl_kernel: launched with programmatic stream serialization, a thread issues an atomic");
    expect("PDL: no wait", run_pdl_never,
           "cuemu: pdl_kernel: launched with programmatic stream serialization, a thread exits");
    expect("store first, no attribute", run_pdl_store_plain, nullptr);
    (void) cudaGetLastError();
    big_smem_kernel<<<1, 32, 64 * 1024>>>((int *) g_out);
    cudaError_t e = cudaGetLastError();
    printf("64 KiB dynamic shared memory without the attribute: %s\n", cudaGetErrorString(e));
    CHECK(e == cudaErrorInvalidConfiguration, "launch above 48 KiB of dynamic shared memory not refused");
    cudaFuncSetAttribute(big_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024);
    big_smem_kernel<<<1, 32, 64 * 1024>>>((int *) g_out);
    e = cudaGetLastError();
    CHECK(e == cudaSuccess, "launch with the attribute refused: %s", cudaGetErrorString(e));
    cudaFree(g_out);
    if (failures)
        printf("%d checks failed\n", failures);
    else
        printf("the emulator's PTX and checks behave as specified\n");
    return failures ? 1 : 0;
}
