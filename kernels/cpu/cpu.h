/* cpu.h - internals of the CPU backend shared by its one-op-per-file sources.
 * Not a public header: call sites use kernels/backend.h.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"
#include "cpu-features.h"
#include "vexp.h"

extern const struct backend_ops backend_cpu_ops;

/* ---- threads.c: a small persistent pool ----
 * cpu_pool_for() (below) is what the ops use.  cpu_pool_run() runs fn(arg, ith, nth) once
 * on each of nth threads (the caller is ith 0) and returns when all are done;
 * cpu_pool_barrier() may be called by all nth threads inside one run.  Idle workers sleep
 * on a futex after a short bounded spin, so a busy neighbour core never turns a wait into
 * a spin storm. */
struct cpu_pool;
typedef void (*cpu_task_fn)(void *arg, int ith, int nth);
int cpu_pool_new(int n_threads, struct cpu_pool **ret);
void cpu_pool_free(struct cpu_pool *pool);
int cpu_pool_size(const struct cpu_pool *pool);
void cpu_pool_run(struct cpu_pool *pool, cpu_task_fn fn, void *arg);
/* Same with at most n threads (n <= 1: inline on the caller, no wake-up); small ops use
 * it so that a tiny matmul does not pay a futex round trip. */
void cpu_pool_run_n(struct cpu_pool *pool, cpu_task_fn fn, void *arg, int n);

void cpu_pool_barrier(struct cpu_pool *pool);
/* Idle workers spin (pause, then sched_yield) for LINGER_NS after their last unit and
 * then sleep on a futex (threads.c).  Busy mode (nests): between begin and end they spin
 * for up to BUSY_IDLE_NS between runs, and begin wakes sleeping ones at once.  The
 * backend's graph_begin/graph_end bracket one forward step with it, so none of its ~60
 * small ops pays a wake-up. */
void cpu_pool_busy_begin(struct cpu_pool *pool);
void cpu_pool_busy_end(struct cpu_pool *pool);
bool cpu_pool_busy(const struct cpu_pool *pool);
/* Some worker sleeps (idle for a millisecond or more): the next run pays its wake-up. */
bool cpu_pool_asleep(struct cpu_pool *pool);
/* Run fn(arg, unit, n_units, ith) for every unit in [0, n_units); returns when all units
 * are done (not when all threads have checked in: see threads.c).  max_threads threads
 * are woken (1 = inline on the caller); a worker still draining an earlier run may join
 * too, so per-thread scratch indexed by ith must cover the whole pool.  Thread t of nth
 * first runs units [n*t/nth, n*(t+1)/nth) in increasing order, then steals others' units
 * from their ends; callers make units coarse contiguous ranges (CPU_UNITS_PER_THREAD per
 * thread) so each thread streams one long region, the same one in every op of its kind.
 * Results must not depend on which thread ran a unit. */
typedef void (*cpu_unit_fn)(void *arg, int unit, int n_units, int ith);
void cpu_pool_for(struct cpu_pool *pool, cpu_unit_fn fn, void *arg, int n_units, int max_threads);
/* Units per thread for cpu_pool_for: enough slack for a slow core to shed work. */
#define CPU_UNITS_PER_THREAD 8

/* Backend context (be->ctx). */
struct cpu_ctx {
    struct cpu_pool *pool;
    int n_threads;
    bool mxfp4_exact;       /* cfg: exact W4A32 path */
    bool have_avx2;         /* the CPU has AVX2+FMA (kernels use target attributes) */
    double min_work;        /* multiply-adds per extra thread (STEPD_CPU_MIN_WORK; 0 = always split) */
    double min_work_busy;   /* the same inside graph_begin/end, where a split costs no wake-up */
    double alone_work;      /* multiply-adds run on the caller alone while a worker slept */
    /* scratch grown on demand; one caller at a time per backend */
    void *scratch;
    size_t scratch_size;
    /* split_run: one single-threaded backend per pool thread (made on first use) */
    struct backend **sub;
};

/* Waking a sleeping worker costs the caller ~15-45 us in a VM: while a worker sleeps,
 * ops run on the caller alone until one of at least this many multiply-adds comes, or
 * as many have run alone since it fell asleep (then the split wakes it; it spins for a
 * millisecond after its last unit, so the ops that follow find it awake). */
#define CPU_WAKE_WORK 524288.0

/* Threads worth using for `work` multiply-adds: one per c->min_work (c->min_work_busy in
 * busy mode, where the workers are spinning), at most the pool; see CPU_WAKE_WORK. */
static inline int cpu_threads_for(struct cpu_ctx *c, double work)
{
    int n = cpu_pool_size(c->pool);
    double per, mw = cpu_pool_busy(c->pool) ? c->min_work_busy : c->min_work;

    if (mw <= 0)
        return n;
    per = work / mw;
    if (per < 2.0 || n == 1)
        return 1;
    if (!cpu_pool_asleep(c->pool)) {
        c->alone_work = 0;
    } else if (work < CPU_WAKE_WORK && (c->alone_work += work) < CPU_WAKE_WORK) {
        return 1;
    } else {
        c->alone_work = 0;
    }
    return per < n ? (int)per : n;
}

static inline struct cpu_ctx *cpu_ctx(struct backend *be)
{
    return (struct cpu_ctx *)be->ctx;
}

/* Scratch of at least n bytes, 64-byte aligned, valid until the next call. */
void *cpu_scratch(struct cpu_ctx *c, size_t n);

/* Split [0, n) into nth contiguous ranges whose bounds are multiples of align. */
static inline void cpu_split(int64_t n, int64_t align, int ith, int nth, int64_t *r0, int64_t *r1)
{
    int64_t units = (n + align - 1) / align;
    int64_t a = units * ith / nth, b = units * (ith + 1) / nth;

    *r0 = a * align < n ? a * align : n;
    *r1 = b * align < n ? b * align : n;
}

/* ---- numerics helpers ---- */
static inline float cpu_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;

    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN. */
static inline uint16_t cpu_f32_to_bf16(float f)
{
    uint32_t u;

    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* Element j of a weight row of any format as fp32 (slow; embed and references). */
float cpu_weight_get(const struct bweight *w, int64_t row, int64_t col);
/* Row r of w as fp32 into out[cols] (exactly the stored value). */
void cpu_weight_row(const struct bweight *w, int64_t row, float *out);

/* ---- matmul (matmul-bf16.c, matmul-mxfp4.c) ----
 * MXFP4 repacked layout (priv of a prepared weight), built by cpu_mxfp4_prepare():
 * rows grouped in tiles of MXFP4_TILE_ROWS; columns in pairs of two 32-blocks.
 * For tile t and pair p: qs holds TILE_ROWS x 32 bytes (row-major within the tile,
 * the 16+16 on-disk bytes of the pair's two blocks), sc holds the 2 x TILE_ROWS E8M0
 * bytes ordered [r0b0 r1b0 r2b0 r3b0 r0b1 r1b1 r2b1 r3b1].  Padding rows/blocks are
 * zero codes with scale 0. */
#define MXFP4_TILE_ROWS 4
struct cpu_mxfp4 {
    int64_t rows, cols;
    int64_t nblk;           /* cols / 32 */
    int64_t npair;          /* ceil(nblk / 2) */
    int64_t ntile;          /* ceil(rows / TILE_ROWS) */
    uint8_t *qs;
    uint8_t *sc;
    struct cpu_wchunk *qs_mem, *sc_mem;     /* wmem.c */
};

/* ---- wmem.c: weight memory on transparent huge pages ----
 * cpu_wmem_alloc returns n bytes, 64-byte aligned, from 2 MiB-aligned chunks advised
 * MADV_HUGEPAGE, and the chunk to hand back to cpu_wmem_free (NULL: out of memory). */
struct cpu_wchunk;
void *cpu_wmem_alloc(size_t n, struct cpu_wchunk **ret_chunk);
void cpu_wmem_free(struct cpu_wchunk *chunk);
/* Chunks mapped now and their bytes (tests: all freed -> 0). */
void cpu_wmem_stats(size_t *ret_chunks, size_t *ret_bytes);

extern const float cpu_e2m1[16];

int cpu_mxfp4_prepare(struct bweight *w);
void cpu_mxfp4_release(struct bweight *w);

/* Activations quantised for the int8 MXFP4 path, one row per token: q is the row's
 * int8 values (q = round(x / d), d = amax / 127 per 32-block) in pair order (for pair p,
 * 64 bytes: [even cols of b0 | even of b1 | odd of b0 | odd of b1]); d8 and corr8 hold
 * per pair [d(b0) x4 | d(b1) x4] and [12*sum q(b0) x4 | 12*sum q(b1) x4], the lane
 * layout of the kernel's reduced dot products. */
struct cpu_qact {
    int64_t nblk, npair;
    int8_t *q;              /* [n, npair * 64] */
    float *d8;              /* [n, npair * 8] */
    int32_t *corr8;         /* [n, npair * 8] */
};
size_t cpu_qact_bytes(int64_t n, int64_t cols);
void cpu_qact_init(struct cpu_qact *qa, void *mem, int64_t n, int64_t cols);
/* Quantise blocks [b0, b1) of token row i from x[cols]. */
void cpu_qact_quantize(struct cpu_qact *qa, int64_t i, const float *x, int64_t b0, int64_t b1);
/* The portable scalar quantiser (the oracle the AVX-512 one must equal bit for bit). */
void cpu_qact_quantize_scalar(struct cpu_qact *qa, int64_t i, const float *x, int64_t b0,
                              int64_t b1);

/* Row-range kernels, run on the calling thread.  Token i of the activations is row
 * xidx ? xidx[i] : i; output y[i * ldy + (r - r0_out)] for rows r in [r0, r1). */
void cpu_matmul_f32_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                         float *y, int64_t ldy, int64_t r0, int64_t r1, bool avx2);
/* fast: the BF16 fast path (cpu_bf16_fast) where the CPU has one, else the FP32 kernels */
void cpu_matmul_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n,
                          float *y, int64_t ldy, int64_t r0, int64_t r1, bool avx2, bool fast);
/* A buffer of at least n bytes, 64-byte aligned, owned by the calling thread (freed at its
 * exit), valid until its next call; NULL when it cannot be allocated. */
void *cpu_thread_buf(size_t n);
/* BF16 fast path (docs/PERFORMANCE.md §8.4): the activations rounded once to BF16 (RNE),
 * |err| <= 2^-8 · Σ|w·x| plus fp32 accumulation, batch-invariant.  In use where the MXFP4
 * int8 and the FP8/NVFP4 fast paths are (not cpu_lowp_exact: backend_cfg.mxfp4_exact off
 * and AVX2), and cpu_bf16_fast_off is 0 (benchmarks: the exact kernels, bit for bit),
 * and the weight (NULL: any) is not marked bweight.exact (the MoE routers): every BF16 caller
 * (cpu_matmul_rows, the MoE rows) asks with its weight.
 * AMX hosts: one-part tiles (matmul-amx.c); AVX-512 BF16 hosts without AMX (level vnni):
 * vdpbf16ps (matmul-bf16dp.c) where cpu_bf16_dp_fits(w) (cols % 32 == 0), activations
 * packed by cpu_bf16_act_pack into cpu_bf16_act_bytes; elsewhere the FP32 kernels. */
extern int cpu_bf16_fast_off;
bool cpu_bf16_fast(const struct cpu_ctx *c, const struct bweight *w);
bool cpu_bf16_dp_fits(const struct bweight *w);
size_t cpu_bf16_act_bytes(int n, int64_t cols);
void cpu_bf16_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols);
void cpu_matmul_bf16_dp_rows(const struct bweight *w, const void *xb, int n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1);
/* FP8 (matmul-fp8.c) and NVFP4 (matmul-nvfp4.c): rows decoded on the fly into rowbuf
 * (CPU_LOWP_BUF(cols) floats per thread) and multiplied on the exact path (one row in fp64,
 * the 16-lane fp64 order below, one rounding) or the fast one (CPU_LOWP_TILE rows in fp32,
 * the F32 kernel).  cpu_lowp_exact: the exact path is in use (backend_cfg.mxfp4_exact, or
 * no AVX2). */
#define CPU_LOWP_TILE 8
/* + 16: room for the 64-byte alignment of 16 tokens' int8 activations (matmul-nvfp4-vnni.c) */
#define CPU_LOWP_BUF(cols) ((int64_t)(cols) * CPU_LOWP_TILE + 16)
extern float cpu_e4m3[256];
typedef void (*cpu_row_decode_fn)(const struct bweight *w, int64_t r, double *out64, float *out32);
void cpu_matmul_decoded_rows(const struct bweight *w, cpu_row_decode_fn decode, const float *x,
                             const int32_t *xidx, int n, float *y, int64_t ldy, int64_t r0, int64_t r1,
                             bool exact, void *rowbuf);
void cpu_matmul_fp8_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                         int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf);
void cpu_matmul_nvfp4_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                           int64_t ldy, int64_t r0, int64_t r1, bool exact, void *rowbuf);
float cpu_fp8_get(const struct bweight *w, int64_t row, int64_t col);
float cpu_nvfp4_get(const struct bweight *w, int64_t row, int64_t col);
bool cpu_lowp_exact(const struct cpu_ctx *c);
/* NVFP4's fast path with AVX2 where its int8 path does not fit (columns not a multiple of
 * 64) fuses the decode into the dot at every token count, so that a token's outputs do not
 * depend on the call's other tokens (FP8's has a form of its own, matmul-fp8.c): one row's
 * values in registers against up to CPU_FUSED_NT tokens at a time.  With
 * cpu_lowp_fused_off nonzero: the decode-to-buffer form (bench-kernels "old"), whose F32
 * kernel blocks rows x tokens, is faster from 4 tokens on but sums in another order
 * (docs/PERFORMANCE.md). */
#define CPU_FUSED_NT 4
extern int cpu_lowp_fused_off;
typedef void (*cpu_row_fused_fn)(const struct bweight *w, int64_t r, const float *const *xt, int nt, float *out);
void cpu_matmul_fused_rows(const struct bweight *w, cpu_row_fused_fn row, const float *x, const int32_t *xidx,
                           int n, float *y, int64_t ldy, int64_t r0, int64_t r1);
/* AVX-512 (matmul-lowp512.c): the FP8 / NVFP4 fast path at every token count, the decode
 * fused into a 4-row x 5-token register-blocked GEMM; a (row, token) sum does not depend on
 * the token count.  x86-64 with CPU_ISA_AVX512 only. */
void cpu_matmul_lowp512_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1);
/* Levels vnni and avx2 (matmul-nvfp4-vnni.c): NVFP4 through MXFP4's int8 path (activations
 * quantised as cpu_qact_quantize does, into rowbuf, CPU_LOWP_BUF(cols) floats), where
 * cols % 64 == 0 and the weight was repacked at prepare (cpu_nvfp4_prepare); the avx2 kernel's
 * outputs are the vnni one's bit for bit.  Not at level avx512 (the AVX-512 tiles above);
 * cpu_lowp_vnni_off nonzero (benchmarks) keeps the AVX-512 tiles or the AVX2 fused path. */
extern int cpu_lowp_vnni_off;
bool cpu_nvfp4_int8_fits(const struct bweight *w);
/* NVFP4 repacked layout (priv of a prepared weight where the active level is vnni or up, or
 * avx2, and cols % 64 == 0): one stream in the order the kernel reads it, a vector lane per row.
 * Rows in groups of NVFP4_GROUP_ROWS; group g is npair units of NVFP4_PAIR_BYTES, one per
 * 64-column pair p: 8 x 64 bytes, the h-th holding at 4r the nibble bytes 4h..4h+3 of row
 * r's 32 on-disk bytes of the pair, then 4 x 16 bytes, the k-th holding at r row r's E4M3
 * scale of the pair's 16-column group k.  A last group's missing rows are zero. */
#define NVFP4_GROUP_ROWS 16
#define NVFP4_PAIR_BYTES (NVFP4_GROUP_ROWS * 36)
struct cpu_nvfp4 {
    int64_t npair;          /* cols / 64 */
    int64_t group_bytes;    /* npair * NVFP4_PAIR_BYTES */
    uint8_t *pk;
    struct cpu_wchunk *mem; /* wmem.c */
};
/* weight_prepare: cpu_lowp_check, then the repack where the VNNI kernel can use it */
int cpu_nvfp4_prepare(struct bweight *w);
void cpu_nvfp4_release(struct bweight *w);
void cpu_matmul_nvfp4_int8_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                                int64_t ldy, int64_t r0, int64_t r1, void *rowbuf);
/* Level vnni on CPUs with AVX-512 BF16 (matmul-fp8-bf16.c): FP8 by vdpbf16ps, the block
 * scale on the activations (rounded to BF16 in rowbuf), where cols and the scale blocks'
 * width are multiples of 32; cpu_lowp_vnni_off nonzero keeps the AVX-512 tiles. */
bool cpu_fp8_bf16_fits(const struct bweight *w);
void cpu_matmul_fp8_bf16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                              int64_t ldy, int64_t r0, int64_t r1, void *rowbuf);
/* Level vnni on CPUs with AVX512-FP16 (matmul-fp8-fp16.c; cpu_avx512fp16): FP8 by FP16
 * FMAs over up to 128-column chunks, the block scale and a per-token power-of-two prescale
 * in FP32, where cols and the scale blocks' width are multiples of 32; taken before the
 * vdpbf16ps form (after the AMX tiles when cpu_fp8_amx_on).  cpu_fp8_fp16_off nonzero
 * (tests, benchmarks) or cpu_lowp_vnni_off keeps the forms below.  rowbuf: CPU_LOWP_BUF. */
extern int cpu_fp8_fp16_off;
bool cpu_fp8_fp16_fits(const struct bweight *w);
void cpu_matmul_fp8_fp16_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                              int64_t ldy, int64_t r0, int64_t r1, void *rowbuf);
/* Level amx (matmul-fp8-bf16.c): the same BF16 products on AMX-BF16 tiles, where the 64-column
 * form fits (AVX-512 VBMI, cols and the scale blocks' width multiples of 64); any row range.
 * Off unless cpu_fp8_amx_on (STEPD_CPU_FP8_AMX=1 at start; tests and benchmarks set it): 2-3x
 * faster from 4 tokens a call, slower at the one token a routed expert mostly gets when its
 * 16 row streams come from memory (docs/PERFORMANCE.md §4.3a).  A process keeps one setting:
 * a weight's outputs do not depend on the token count either way. */
extern int cpu_fp8_amx_on;
bool cpu_fp8_amx_fits(const struct bweight *w);
void cpu_matmul_fp8_amx_rows(const struct bweight *w, const float *x, const int32_t *xidx, int n, float *y,
                             int64_t ldy, int64_t r0, int64_t r1, void *rowbuf);
/* the sum of 8 floats in lane order (the fused paths' accumulator, stored) */
float cpu_lowp_hsum8(const float *f);
/* weight_prepare of both: shapes the kernels need, and no E4M3 NaN code (-EINVAL) */
int cpu_lowp_check(const struct bweight *w);

/* Exact W4A32: every product exact in fp64, fixed 16-lane fp64 accumulation order
 * (lane = col % 16; lanes folded l += l+8, +4, +2, +1), one rounding to fp32. */
#define MXFP4_EXACT_LANES 16
/* the exact paths' fold of their 16 fp64 lanes into one fp32 */
static inline float cpu_exact_fold(double *acc)
{
    for (int s = MXFP4_EXACT_LANES / 2; s > 0; s /= 2)
        for (int l = 0; l < s; l++)
            acc[l] += acc[l + s];
    return (float)acc[0];
}
void cpu_matmul_mxfp4_exact_rows(const struct bweight *w, const float *x, const int32_t *xidx,
                                 int n, float *y, int64_t ldy, int64_t r0, int64_t r1,
                                 float *rowbuf);
/* Fast int8 path on prepared weights; r0 a multiple of MXFP4_TILE_ROWS, r1 one or rows.
 * Where the CPU has AVX-512 F/BW/VL + VNNI (and none of STEPD_CPU_NO_VNNI,
 * STEPD_CPU_NO_AVX512, STEPD_CPU_NO_AVX2 is set) the 16-row groups wholly inside [r0, r1)
 * run a kernel that covers 16 rows per vector (matmul-mxfp4.c), bit-identical to the
 * 4-row one; callers split rows in multiples of cpu_mxfp4_row_align() (16 then, else
 * MXFP4_TILE_ROWS) so that no group is cut.  cpu_mxfp4_t16_off (nonzero: 4-row kernel only) and
 * cpu_mxfp4_t16_min_n (fewer tokens: 4-row kernel) are for tests and benchmarks. */
void cpu_matmul_mxfp4_fast_rows(const struct bweight *w, const struct cpu_qact *qa,
                                const int32_t *xidx, int n, float *y, int64_t ldy, int64_t r0,
                                int64_t r1);
int64_t cpu_mxfp4_row_align(const struct bweight *w);
extern int cpu_mxfp4_t16_off;
/* attention.c: nonzero = one KV head per work item (no head groups; benchmarks) */
extern int cpu_attn_no_groups;
/* attention.c: nonzero = the AVX2 and AVX-512 paths convert BF16 K/V rows into fp32 buffers
 * first instead of reading them in their kernels (tests: the two agree bit for bit) */
extern int cpu_attn_no_fused;
/* attention.c: split-K.  Every row's keys are cut into segments at absolute multiples of
 * cpu_attn_split_keys (default 2048; a multiple of 64, else attention fails with -EINVAL),
 * each with its own softmax state, folded in key order; long decodes with few work items
 * run the segments as items of their own.  cpu_attn_split: 0 = where it pays
 * (cpu_attn_use_split), > 0 = wherever a sequence has two segments, < 0 = never.  The
 * output bits depend on the segment size only, never on cpu_attn_split or the thread count
 * (tests, benchmarks). */
extern int cpu_attn_split_keys;
extern int cpu_attn_split;
/* attention.c: where the fused BF16 kernels prefetch the next key chunk's K and V rows in
 * work items of several KV heads (contexts >= 4096 keys; a head per item: always L2):
 * cpu_attn_pf_l1 > 0 into L1 (prefetcht0), 0 into L2 only (prefetcht2), < 0 (default) L1
 * on Intel CPUs and L2 elsewhere (measured: docs/PERFORMANCE.md §8.2, §8.6).  Only the
 * prefetches differ: the output bits are the same (tests, benchmarks). */
extern int cpu_attn_pf_l1;
bool cpu_attn_pf_l1_on(void);
extern int cpu_mxfp4_t16_min_n;
/* An AMX tile configuration, LDTILECFG's 64-byte operand (palette 1: colsb and rows of
 * tiles 0-7).  cpu_tile_loadconfig / cpu_tile_storeconfig name all 64 bytes as their memory
 * operand: GCC 12's _tile_loadconfig names only the first 8, so its dead-store elimination
 * may drop the stores of colsb and rows before it (a configuration built in a function of
 * its own then loads zero-sized tiles, and every tile instruction faults). */
struct cpu_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));
#if defined(__x86_64__)
static inline void cpu_tile_loadconfig(const struct cpu_tilecfg *c)
{
    __asm__ volatile("ldtilecfg %0" : : "m"(*c));
}
static inline void cpu_tile_storeconfig(struct cpu_tilecfg *c)
{
    __asm__ volatile("sttilecfg %0" : "=m"(*c));
}
/* palette 1 with tiles 0-7 of 16 rows each, tile i colsb[i] bytes wide, loaded */
static inline void cpu_tile_config16(const uint16_t colsb[8])
{
    struct cpu_tilecfg cfg;

    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = colsb[i];
        cfg.rows[i] = 16;
    }
    cpu_tile_loadconfig(&cfg);
}
/* TILELOADD of tile t from base (stride bytes a row) that tells the compiler it reads
 * memory: GCC 12's _tile_loadd names no memory at all, so stores to a buffer a tile is then
 * loaded from (decoded weights, packed activations) may be moved past the load or dropped
 * (an unrolled loop refilling one buffer before each load kept only the last fill) */
#define CPU_TILE_LOADD(t, base, stride)                                                         \
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm" #t "|tileloadd\t%%tmm" #t ", [%0+%1*1]}"   \
                     : : "r"((const void *)(base)), "r"((long)(stride)) : "memory")
#endif
/* AMX-BF16 path for BF16 weights (matmul-amx.c).  cpu_amx_bf16_ok(): the CPU has
 * AMX-BF16 + AVX-512BW + AVX512-BF16 (the activation pack), the kernel granted the tile
 * state, and none of STEPD_CPU_NO_AMX, STEPD_CPU_NO_AVX512, STEPD_CPU_NO_AVX2 is set
 * (detected once per process).
 * cpu_bf16_use_amx(w): w runs on AMX - decided from the weight (BF16, cols % 32 == 0,
 * rows >= 16) and the CPU only, never from the token count, so a row's result is
 * bit-identical whatever n, the other tokens and the thread split (batch invariance).
 * The activations are packed once per call (cpu_amx_act_pack into cpu_amx_act_bytes) and
 * shared read-only by the threads running cpu_matmul_bf16_amx_rows (any r0 <= r1 <= rows;
 * output y[i * ldy + (r - r0)]).  cpu_matmul_bf16_amx_self packs into a per-thread
 * buffer first (callers without a packed copy); false only when that buffer cannot be
 * allocated.  fast: the BF16 fast path's one-part tiles (cpu_bf16_fast), else the exact
 * three-part ones; the pack and the kernel of one call must agree. */
bool cpu_amx_bf16_ok(void);
bool cpu_bf16_use_amx(const struct bweight *w);
size_t cpu_amx_act_bytes(int n, int64_t cols, bool fast);
void cpu_amx_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols,
                      bool fast);
/* The pack as cpu_amx_act_blocks(n, fast) independent items (token blocks of the tiles'
 * columns), of which cpu_amx_act_pack_blocks writes [i0, i1): threads packing disjoint
 * ranges of one buffer leave the bytes cpu_amx_act_pack writes. */
int cpu_amx_act_blocks(int n, bool fast);
void cpu_amx_act_pack_blocks(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols,
                             bool fast, int i0, int i1);
void cpu_matmul_bf16_amx_rows(const struct bweight *w, const void *xb, int n, float *y,
                              int64_t ldy, int64_t r0, int64_t r1, bool fast);
bool cpu_matmul_bf16_amx_self(const struct bweight *w, const float *x, const int32_t *xidx,
                              int n, float *y, int64_t ldy, int64_t r0, int64_t r1, bool fast);
/* Benchmarks and tests: nonzero switches the AMX path off (the AVX-512 / AVX2 kernels run);
 * cpu_amx_pf_steps = weight prefetch distance in k-steps of 32 columns (0 = off). */
extern int cpu_amx_off;
extern int cpu_amx_pf_steps;
/* Software prefetch distance of the fast MXFP4 kernel in bytes (0 = off; benchmarks). */
extern int cpu_mxfp4_pf_bytes;
/* True when matmul of w runs the fast int8 path under this context. */
bool cpu_mxfp4_use_fast(const struct cpu_ctx *c, const struct bweight *w);

/* Attention's AVX-512 path: 0 = off (level below avx512), 1 = on. */
int cpu_attn_avx512_level(void);
/* Attention's KV head groups per work item's (sequence, block of query tokens): n_kv_heads
 * (a head per item) below 4096 keys or with cpu_attn_no_groups, else the fewest (a power
 * of two) that give each of nth > 1 threads one of the blocks x groups items and keep a
 * group's per-head state (4 x rows_floats floats a head: the rows of the longest block x
 * head_dim) within 256 KiB; one group = an item reads its slots' K/V rows whole. */
int cpu_attn_groups(int n_kv_heads, double keys, int64_t blocks, int64_t rows_floats, int nth);
/* Attention runs each key segment as an item of its own (cpu_attn_split 0): more than one
 * thread, a context of two segments or more (seg_keys keys each), fewer than 2 items a
 * thread without (items: blocks x the head groups the stack budget alone asks) and the
 * segments' states (bytes of scratch) within 64 MiB. */
bool cpu_attn_use_split(int64_t items, double keys, int64_t seg_keys, size_t bytes, int nth);

/* ---- backend ops (one file each) ---- */
int cpu_embed(struct backend *be, const struct bweight *table, const int32_t *ids, int n, float *out);
int cpu_rmsnorm(struct backend *be, const float *x, const struct bweight *w, int rows, int dim,
                float eps, float *y);
int cpu_matmul(struct backend *be, const struct bweight *w, const float *x, int n, float *y);
int cpu_matmul_rows(struct backend *be, const struct bweight *w, const float *x, int n, float *y,
                    int64_t ldy, int64_t r0, int64_t r1);
int cpu_rope(struct backend *be, float *x, int n_tok, int n_heads, int head_dim,
             const int32_t *pos, const struct rope_freqs *f);
int cpu_kv_store(struct backend *be, struct kv_layer *kv, const float *k, const float *v,
                 int n_tok, const int32_t *slots);
int cpu_attention(struct backend *be, const struct attn_args *a);
int cpu_head_gate(struct backend *be, float *o, const float *g, int n_tok, int n_heads, int head_dim);
int cpu_swiglu(struct backend *be, const float *gate, const float *up, int n, int dim,
               float limit, float *out);
int cpu_router(struct backend *be, const float *logits, const float *bias, int n_tok, int n_exp,
               int top_k, bool renorm, float scale, int32_t *ids, float *weights);
int cpu_moe(struct backend *be, const struct moe_args *a);
int cpu_add(struct backend *be, float *y, const float *x, size_t n);
int cpu_argmax(struct backend *be, const float *x, int rows, int n, int k, int32_t *ids,
               float *vals);
int cpu_row_expsum(struct backend *be, const float *x, int rows, int n, const float *mx,
                   const float *temps, double *sums);

/* exp(x) for the SwiGLU sigmoid: vexp1 (vexp.h) with x clamped to [-87.3, 88] first; the
 * AVX-512 form in swiglu.c takes vexp16 on the same clamps, so an element's result never
 * depends on whether it landed in a vector or in a tail. */
static inline float cpu_expf_poly(float x)
{
    x = x < VEXP_MIN ? VEXP_MIN : x;
    x = x > VEXP_MAX ? VEXP_MAX : x;
    return vexp1(x);
}

/* SwiGLU of one element, docs/MODEL.md §2.4 (silu first, then upper clamp; up clamped both
 * ways).  A NaN gate gives the limit (or NaN without one), a NaN up stays NaN. */
static inline float cpu_swiglu1(float u, float w, float limit)
{
    float s = u / (1.0f + cpu_expf_poly(-u));

    if (limit > 0.0f) {
        s = s < limit ? s : limit;
        w = w < -limit ? -limit : (w > limit ? limit : w);
    }
    return s * w;
}

/* out[i] = cpu_swiglu1(gate[i], up[i], limit) for i in [0, n), AVX-512 where the CPU has it
 * (bit-identical); out may alias gate or up.  cpu_swiglu_rows_scalar: the plain loop. */
void cpu_swiglu_rows(const float *gate, const float *up, float *out, int64_t n, float limit);
void cpu_swiglu_rows_scalar(const float *gate, const float *up, float *out, int64_t n,
                            float limit);
