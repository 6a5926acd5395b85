/* bench-shapes.c - decode at Step-3.7-Flash's real shapes on the CPU backend, every piece
 * beside its byte floor (suite bench, not in the default run).
 *
 *   bench-shapes --mkmodel PATH | --model DIR   [--threads 1,2] [--batches 1,4,16,64]
 *                [--contexts 1024,8192,32768] [--reps N] [--keep] [--ab-attn] [--kv-fp32]
 *                [--draft-vocab N] [--bf16-exact] [--cpu-min-ms MS]
 *   bench-shapes --attn-only [--threads 1,2] [--batches 1,16] [--contexts 8192,32768] [--reps N]
 *                [--kv-fp32]
 *   bench-shapes --formats mxfp4,fp8,nvfp4,bf16 (--mkmodel PATH | --model DIR) [--threads 1,2]
 *                [--batches 1,16] [--reps N] [--keep]
 *   bench-shapes --prefill 1024,8192 (--mkmodel PATH | --model DIR) [--prefill-chunk N]
 *                [--prefill-split-max N] [--threads 1,2] [--reps N] [--keep]
 *   bench-shapes --measure-routing MODEL_DIR FILE...
 *   STEPD_BENCH_MB: the bandwidth probe's arena (default 1024 MiB, >> the last-level cache)
 *
 * The model: stepd-mkmodel's full-width checkpoint (hidden 4096, 288 experts x 1280 top-8,
 * 64/96 query heads and 8 KV heads of 128, window 512, vocab 128896) with 4 trunk layers -
 * the real layers 0 (dense, full attention), 1 (dense, sliding), 3 (MoE, sliding) and 4
 * (MoE, full) - and 1 MTP layer, made at run time in a temporary directory (9.9 GB; about a
 * minute) unless --model names one.  No tensor is written sparse: every one is read by a
 * measured path (the embedding by the real decode step, whose routing needs real inputs;
 * the MTP layer's BF16 weights once, to make its MXFP4 draft copies).
 *
 * For each thread count (one model after the other on a CPU backend of that many threads,
 * set up as stepd-worker sets it up: int8 MXFP4 path, MXFP4 drafts, per-core split steps and
 * MTP halves on 2 threads) and each of REPS rounds: the read-bandwidth probe (bw-probe.h),
 * then, for every batch size B (B sequences decoding one token each, all at the same
 * context), one sweep of:
 *   - each trunk layer at context 1024 (the layer script on the whole backend); a MoE layer
 *     twice (the order swapping by round, the caches flushed before each), then its routed
 *     experts and its router alone (moe_pieces): its inputs routed realistically (routing_layer_inputs: each token to a chosen
 *     set of experts, the sets reaching the distinct-expert count a trained router gives at
 *     that batch, routing_target) and, ", uniform routing", on fresh unit-variance rows that
 *     the random router spreads uniformly over the experts;
 *   - attention alone of a full (64 heads) and a sliding (96 heads) layer at each context;
 *   - the lm_head (final norm + 128896 x 4096 BF16);
 *   - the real decode step of the model (model_step: embedding, the 4 layers, head); on 2
 *     threads at B >= 4 both as per-core parts and whole (at these shapes the model runs
 *     steps whole, model-split.c: the model is built with split_any_size to show both);
 *   - one MTP depth after it (model_mtp_step 0: the layer, its draft head), and the draft
 *     head alone; then (after another step) the MTP depth over the draft vocabulary
 *     (--draft-vocab N ids, default 32768; 0: not measured), whose floor counts the
 *     gathered head rows only.
 * --bf16-exact runs the BF16 GEMMs on the exact path's kernels (cpu_bf16_fast_off: AMX
 * three-part tiles or FP32 FMAs on widened BF16), the figures before the BF16 fast path
 * (docs/PERFORMANCE.md §8.5); the MXFP4 experts stay on their fast path.
 * --ab-attn adds each attention row with one KV head per work item (attention.c before
 * its head groups), on sequences of their own (the sets swap from round to round; sliding
 * rows share their window's blocks, so only the full-attention pair compares).
 * --attn-only measures the full-attention row alone, on caches of its own and no model
 * (bench_attn_only): a quick check of the attention kernel against its byte floor; "cpu"
 * is the process's CPU time over wall x threads, how much of the cores the run got, and
 * "% per cpu-s" the floor over the time with both the probe's and the kernel's time
 * counted in CPU seconds (what a loaded shared host leaves comparable).
 * The sweep streams > 1.5 GB between two readings of the same weights, so every piece reads
 * its weights from DRAM, as in serving.  The KV caches are filled with values up front
 * (as a long prefill would leave them); every sequence has blocks of its own, except at
 * B x context beyond the reserved pool (16 x 32768: 4.3 GB per full layer), where the
 * sequences share their history but for the last block ("shared history").
 *
 * Floor of a piece = the bytes it must read (each weight matrix once; MoE: the distinct
 * experts its tokens were routed to; attention: the keys and values in its window) / the
 * probe's rate of the same round, or, where larger, its FLOPs (2 per weight and row; the
 * routed experts' rows once per token routed to them; attention 4 per key, head and dim) /
 * the GEMM peak measured after the probe (gemm_peak); "% of bw" or "% of peak" says which
 * ("% of bw|peak": the rounds differ).  Beside it, per piece of 10 ms or more (CPU_MIN_S;
 * --cpu-min-ms MS sets the least; not the attention rows) "cpu", the process's CPU seconds over wall x threads, and "% per
 * cpu-s", the floor at the probe's
 * (or the peak's) rate per CPU-second over the piece's CPU seconds: what a loaded shared host
 * leaves comparable; the 1-minute load average at each round's start is printed.
 * "% of" = floor / time, median over the rounds of the per-round ratio.  The real step routes
 * as the random model's router does (its bytes count the uniform rows' distinct experts).
 * --formats runs the MoE layer per release format (issue 43): for each format listed,
 * stepd-mkmodel --real-layers 3 --mtp 0 --format F --sparse embed,heads (one full-width MoE
 * layer, its routed experts in F: MXFP4 / NVFP4 per expert, FP8 / BF16 stacked; no row reads
 * the embedding or the heads) in a temporary directory (--model DIR: DIR/F), all built side
 * by side (the CPU backend computes each format natively and keeps FP8, NVFP4 and BF16 in the
 * mapped checkpoint); per thread count and round, format after format (so that the host's
 * load falls on all alike): the probe, then the layer at each batch (default 1,16; its
 * experts' pages touched before, so that none comes from the disk) as layer_rows runs it (the whole layer and its routed experts,
 * realistic and uniform routing; bytes: the distinct experts in that format).  The table
 * gives per format the median time, bytes, % of that probe and, per round, that % over the
 * first format's (list mxfp4 first to compare with it).
 * --prefill N,... runs one sequence's prompt of N tokens through the trunk as the server
 * runs it (the model made with --mtp 0; the split rule of stepd-worker's model): chunks of
 * --prefill-chunk tokens (default the engine's, KVPLAN_DEFAULT_MAX_BATCHED_TOKENS = 256),
 * each a model_step of one sequence (STEP_SEQ_NEW first, the head on the prompt's last row
 * only), the real layers with the model's own router.  Per thread count and round: the
 * probe, the expert GEMM peak (gemm_peak), the BF16 GEMM peak (bf16_peak: backend_matmul on
 * the first layer's k projection at a chunk's tokens - the kernel of the projections, dense
 * MLPs, shared experts and lm_head at this host's level: AMX tiles, or FMA on widened BF16),
 * then each N: the prefill through model_step (ms, tok/s, cpu = process CPU time over wall
 * x threads; "per cpu-s": % of peak over it), then the same chunks layer by layer (the
 * halves model_step runs, whole, never as per-core parts; prompts of at most
 * --prefill-split-max tokens, default all) with the attention kernel and the routed experts
 * each run again on the same inputs and timed apart: the split attention / routed experts /
 * dense (the rest: projections, dense MLPs, shared experts, router, norms, rope; the pass's
 * time less the others, so noise can take it below 0 on a small model) / lm_head.  FLOPs
 * (prefill_flops): 2 per weight and row for the dense and attention projections, router,
 * dense MLPs and shared experts; the routed experts' 2 per weight once per token routed to
 * them (N x top_k rows); attention 4 per key, head and dim with query p reading
 * min(p + 1, window) keys (causal: half the square at full attention); the lm_head 1 row.
 * Floor = the routed experts' FLOPs / the expert peak + the rest / the BF16 peak (attention's
 * FP32 FMAs on widened BF16 keys held to the BF16 GEMM's rate); "% of peak" = floor / time,
 * median over the rounds, and beside it all FLOPs / the expert peak alone (the host's
 * highest); each piece the same against its own peak.  The 1-minute load average is read
 * at each round's start.  Test `bench-shapes-prefill` (the tiny model, short prompts).
 * --measure-routing runs a model's own router (the tiny model's) over real text and prints
 * the distinct experts per MoE layer at batch 1/4/16/64 (routing_ratio holds its figures),
 * then checks routing_layer_inputs through that model's MoE layers.
 * The whole-model figures extrapolate to Step-3.7-Flash's 45 layers (1 dense/full, 2
 * dense/sliding, 11 MoE/full, 31 MoE/sliding) + head: each layer kind's time at context
 * 1024 with its attention at 1024 replaced by the attention at the context, per round; with
 * the MoE layers' realistic rows, and again with the uniform ones.  Figures only, no
 * thresholds (targets on CPU: the MoE layer at
 * batch 1 >= 80 % of the read bandwidth, the whole decode step >= 70 %).
 */
#include <errno.h>
#include <math.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "cpu.h"
#include "bw-probe.h"
#include "cpu-features.h"
#include "file.h"
#include "kvplan.h"
#include "loader.h"
#include "model-int.h"
#include "tok/tokenizer.h"

extern char **environ;

#define MAX_REPS 15
#define MAX_CELLS 256
#define MAX_B 64
#define MAX_LIST 4
#define BS 16                       /* KV block size */
#define CTX_LAYERS 1024             /* context of the layer rows and the real step */
#define REAL_LAYERS 45
/* shortest piece given a cpu share (default; --cpu-min-ms): the process's CPU clock takes
 * other threads' time at scheduler ticks (4 ms at 250 Hz), so a shorter piece's share can
 * read 2-7 at 1 thread */
#define CPU_MIN_S 0.01
#define MAX_FMT 4

/* --prefill: one prompt of N tokens, per round */
struct pf_cell {
    int N;
    double t[MAX_REPS];             /* model_step over the chunks, s */
    double cpu[MAX_REPS];           /* its process CPU time / (wall x threads) */
    double split[MAX_REPS];         /* the layer-by-layer pass without its re-runs, s */
    double attn[MAX_REPS], moe[MAX_REPS], head[MAX_REPS];  /* its pieces, s */
    double floor[MAX_REPS];         /* s: each kernel's FLOPs over its peak */
    double flops[4];                /* enum pf_kind */
};

enum pf_kind { PF_DENSE, PF_EXPERTS, PF_ATTN, PF_HEAD };

struct cell {
    char name[96];
    int B, ctx;
    double t[MAX_REPS], floor[MAX_REPS], bytes[MAX_REPS];
    double cpu[MAX_REPS];           /* --attn-only: process CPU time / (wall x threads) */
    double cpu_ratio[MAX_REPS];     /* --attn-only: floor / time, both per CPU-second */
    bool compute[MAX_REPS];         /* the floor is FLOPs / the GEMM peak, not bytes / bw */
    int n;
};

struct bench {
    /* options */
    const char *mkmodel, *model_dir;
    int threads[MAX_LIST], n_threads, batches[MAX_LIST], n_batches, ctxs[MAX_LIST], n_ctxs;
    int reps;
    bool keep, ab_attn, kv_f32, attn_only;
    int dv;                         /* --draft-vocab: ids of the draft vocabulary (0: none) */
    const char *formats[MAX_FMT];   /* --formats: the release formats, in order */
    int n_formats;
    const char *tag;                /* --formats: the format recorded next (cell name suffix) */
    /* probe */
    uint8_t *arena;
    size_t arena_bytes;
    /* this thread count */
    int T;
    struct model *m;
    struct backend *be;
    struct cpu_pool *pool;
    double bw[MAX_REPS];
    double bw_cpu[MAX_REPS];        /* the probe's cpu share (decode sweep, --attn-only) */
    double peak_cpu[MAX_REPS];      /* the GEMM peak's best run's cpu share */
    double c0;                      /* process CPU time at the last tick(), 0: none */
    struct cell cells[MAX_CELLS];
    int n_cells;
    int nbf, nbs;                   /* KV blocks per FULL / SLIDING layer */
    int sps;                        /* sliding blocks per sequence */
    double fbw[MAX_FMT][MAX_REPS];  /* --formats: the probe before each format, per round */
    uint64_t rng;
    int rep;
    double cpu_min_s;               /* the shortest piece given a cpu share (CPU_MIN_S) */
    double cpu_share;               /* of the piece recorded next (--attn-only), else 0; the
                                     * decode sweep's pieces timed from tick() get theirs there */
    /* a batch: B seqs at context ctx */
    int32_t ids[MAX_B], pos[MAX_B], slots[_KV_GROUP_MAX][MAX_B], start[MAX_B + 1], pos0[MAX_B];
    int32_t boff[_KV_GROUP_MAX][MAX_B];
    int32_t *tables[_KV_GROUP_MAX];
    bool shared;                    /* the batch's FULL tables share a history */
    int nb;                         /* logical blocks per seq */
    struct step_seq pseqs[MAX_B];
    int32_t n_valid[MAX_B], tok_in[MAX_B];
    float *logits;                  /* [MAX_B, vocab] */
    double experts_seen;            /* distinct experts of the last MoE layer run */
    double moe_distinct[MAX_B + 1]; /* per B: distinct experts per MoE layer, this round */
    int moe_runs[MAX_B + 1];
    /* realistic routing (routing_layer_inputs) beside the random model's own */
    float *rrows[64];               /* per trunk layer: the router's unit rows, or NULL */
    double real_distinct[MAX_B + 1][MAX_REPS]; /* per B and round: mean over MoE layers */
    double uni_distinct[MAX_B + 1][MAX_REPS];  /* the same on uniform routing */
    double step_distinct[MAX_B + 1][MAX_REPS]; /* the real step's own routing (last MoE layer) */
    double peak[MAX_REPS];          /* GEMM peak of the round, FLOP/s (gemm_peak) */
    int peak_rows;                  /* rows of its weight */
    const char *peak_fmt;           /* its format and kernel */
    double flops_next;              /* FLOPs of the piece recorded next (0: bytes only) */
    /* --prefill */
    int pf[MAX_LIST], n_pf;         /* prompt lengths */
    int chunk;                      /* --prefill-chunk: tokens per step */
    int split_max;                  /* --prefill-split-max: longest prompt split in pieces */
    double bpeak[MAX_REPS];         /* BF16 GEMM peak of the round, FLOP/s (bf16_peak) */
    int bpeak_rows;
    double load[MAX_REPS];          /* 1-minute load average at the round's start */
    struct pf_cell pfc[MAX_LIST];
    int32_t *pf_ids;                /* [chunk] */
};

static double now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU time of the whole process (all its threads), seconds */
static double cpu_now(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The 1-minute load average (/proc/loadavg), or -1. */
static double load_avg(void)
{
    FILE *f = fopen("/proc/loadavg", "r");
    double v = -1;

    if (f) {
        if (fscanf(f, "%lf", &v) != 1)
            v = -1;
        fclose(f);
    }
    return v;
}

/* Start of a timed piece of the decode sweep: the wall clock, and the CPU time kept for
 * record() (the piece's cpu share = CPU seconds over wall x threads). */
static double tick(struct bench *b)
{
    b->c0 = cpu_now();
    return now();
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;

    return x < y ? -1 : x > y;
}

static double median(const double *v, int n)
{
    double s[MAX_REPS];

    if (n <= 0)
        return 0.0;
    memcpy(s, v, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_d);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

static uint64_t rnd(struct bench *b)
{
    b->rng = b->rng * 6364136223846793005ull + 1442695040888963407ull;
    return b->rng >> 33;
}

/* uniform on [-sqrt 3, sqrt 3): unit variance */
static float rnd_unit(struct bench *b)
{
    return (float)(((double)rnd(b) / 2147483648.0 - 1.0) * 1.7320508);
}

/* ---------------------------------------------------------------- bytes -- */

static double wbytes(const struct bweight *w)
{
    if (!w->rows || !w->cols || (!w->data && !w->priv))
        return 0.0;
    switch (w->fmt) {
    case WFMT_BF16: return (double)w->rows * (double)w->cols * 2.0;
    case WFMT_F32: return (double)w->rows * (double)w->cols * 4.0;
    case WFMT_MXFP4: return (double)w->rows * (double)w->cols * (0.5 + 1.0 / 32.0);
    case WFMT_FP8:      /* E4M3 codes + an F32 scale per blk_rows x blk_cols block */
        return (double)w->rows * (double)w->cols +
               4.0 * (double)((w->rows + w->blk_rows - 1) / w->blk_rows) *
                   (double)((w->cols + w->blk_cols - 1) / w->blk_cols);
    case WFMT_NVFP4: return (double)w->rows * (double)w->cols * (0.5 + 1.0 / 16.0);
    default: return 0.0;
    }
}

/* weights of the attention half and the FFN half of L (MoE: without routed experts) */
static double attn_wbytes(const struct mlayer *L)
{
    return wbytes(&L->in_norm) + wbytes(&L->q_norm) + wbytes(&L->k_norm) + wbytes(&L->wq) +
           wbytes(&L->wk) + wbytes(&L->wv) + wbytes(&L->wg) + wbytes(&L->wo);
}

static double ffn_wbytes(const struct mlayer *L)
{
    double s = wbytes(&L->post_norm) + wbytes(&L->router);

    if (L->has_ffn_dense)
        s += wbytes(&L->gate) + wbytes(&L->up) + wbytes(&L->down);
    return s;
}

static double expert_bytes(const struct mlayer *L)
{
    if (!L->is_moe || L->n_local == 0)
        return 0.0;
    return wbytes(&L->experts[0].gate) + wbytes(&L->experts[0].up) + wbytes(&L->experts[0].down);
}

/* FLOPs of w applied to n rows */
static double wflops(const struct bweight *w, int n)
{
    return wbytes(w) > 0 ? 2.0 * (double)w->rows * (double)w->cols * n : 0.0;
}

/* FLOPs of attention alone for B decode queries at context ctx in L (QK and PV) */
static double attn_flops(const struct mlayer *L, int B, int ctx)
{
    int n = L->window > 0 && L->window < ctx ? L->window : ctx;

    return 4.0 * B * (double)n * L->n_heads * L->head_dim;
}

/* FLOPs of layer L for B decode tokens at context ctx (routed experts: B x top_k rows) */
static double layer_flops(const struct model *m, const struct mlayer *L, int B, int ctx)
{
    double f = wflops(&L->wq, B) + wflops(&L->wk, B) + wflops(&L->wv, B) + wflops(&L->wg, B) +
               wflops(&L->wo, B) + wflops(&L->router, B) + attn_flops(L, B, ctx);

    if (L->has_ffn_dense)
        f += wflops(&L->gate, B) + wflops(&L->up, B) + wflops(&L->down, B);
    if (L->is_moe && L->n_local > 0) {
        const struct moe_expert *x = &L->experts[0];
        int n = B * m->cfg->top_k;

        f += wflops(&x->gate, n) + wflops(&x->up, n) + wflops(&x->down, n);
    }
    return f;
}

/* keys and values one decode query at context ctx reads in L */
static double kv_bytes(const struct model *m, const struct mlayer *L, int ctx)
{
    int n = L->window > 0 && L->window < ctx ? L->window : ctx;

    return (double)n * L->n_kv_heads * L->head_dim * 2.0 * (m->o.kv_f32 ? 4.0 : 2.0);
}

/* ---------------------------------------------------------------- cells -- */

static struct cell *cell_get(struct bench *b, const char *name, int B, int ctx)
{
    for (int i = 0; i < b->n_cells; i++)
        if (b->cells[i].B == B && b->cells[i].ctx == ctx && strcmp(b->cells[i].name, name) == 0)
            return &b->cells[i];
    if (b->n_cells == MAX_CELLS) {
        fprintf(stderr, "bench-shapes: too many cells\n");
        exit(1);
    }
    struct cell *c = &b->cells[b->n_cells++];
    memset(c, 0, sizeof(*c));
    snprintf(c->name, sizeof(c->name), "%s", name);
    c->B = B;
    c->ctx = ctx;
    return c;
}

static void record(struct bench *b, const char *name, int B, int ctx, double t, double bytes)
{
    char tagged[96];
    struct cell *c;

    if (b->tag) {
        snprintf(tagged, sizeof(tagged), "%s [%s]", name, b->tag);
        name = tagged;
    }
    c = cell_get(b, name, B, ctx);

    c->t[c->n] = t;
    c->bytes[c->n] = bytes;
    c->floor[c->n] = bytes / (b->bw[b->rep] * 1e9);
    if (b->flops_next > 0 && b->peak[b->rep] > 0 &&
        b->flops_next / b->peak[b->rep] > c->floor[c->n]) {
        c->floor[c->n] = b->flops_next / b->peak[b->rep];
        c->compute[c->n] = true;
    }
    b->flops_next = 0;
    if (b->c0 > 0 && b->cpu_share == 0 && t >= b->cpu_min_s) {
        /* per CPU-second: the floor at the probe's (or the peak's) rate per CPU-second
         * over the piece's CPU seconds */
        double fc = c->compute[c->n] ? b->peak_cpu[b->rep] : b->bw_cpu[b->rep];

        c->cpu[c->n] = (cpu_now() - b->c0) / (t * b->T);
        c->cpu_ratio[c->n] = fc > 0 && c->cpu[c->n] > 0 ?
                                 c->floor[c->n] * fc / (t * c->cpu[c->n]) : 0;
    } else {
        c->cpu[c->n] = b->cpu_share;
        c->cpu_ratio[c->n] = b->cpu_share > 0 ?
                                 c->floor[c->n] * b->bw_cpu[b->rep] / (t * b->cpu_share) : 0;
    }
    b->c0 = 0;
    c->n++;
}

/* -------------------------------------------------------------- batches -- */

/* B sequences decoding one token each at context ctx (position ctx - 1); their FULL blocks
 * start after those of `skip` sequences (a second, distinct set for A/B passes). */
static void batch_make_at(struct bench *b, int B, int ctx, int skip, struct batch *bt)
{
    struct model *m = b->m;
    const int nb = (ctx + BS - 1) / BS, window = m->cfg->sliding_window;
    const int first = window > 0 && ctx - window > 0 ? (ctx - window) / BS : 0;

    b->nb = nb;
    b->shared = (int64_t)(B + skip) * nb > b->nbf;
    for (int s = 0; s < B; s++) {
        int32_t *tf = b->tables[KV_GROUP_FULL] + (size_t)s * nb;
        int32_t *ts = b->tables[KV_GROUP_SLIDING] + (size_t)s * nb;

        for (int j = 0; j < nb; j++) {
            tf[j] = b->shared ? (j < nb - 1 ? j : nb - 1 + s) : (s + skip) * nb + j;
            ts[j] = j < first ? -1 : s * b->sps + j % b->sps;
        }
        b->ids[s] = (int32_t)(rnd(b) % (uint64_t)m->vocab);
        b->pos[s] = b->pos0[s] = ctx - 1;
        b->start[s] = s;
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            const int32_t *t = b->tables[g] + (size_t)s * nb;

            b->boff[g][s] = s * nb;
            b->slots[g][s] = t[nb - 1] * BS + (ctx - 1) % BS;
        }
        b->pseqs[s] = (struct step_seq){
            .slot = s, .pos0 = ctx - 1, .n_tokens = 1, .n_logits = 1, .tok_off = s,
            .n_blocks = nb, .block_off = { s * nb, s * nb }, .mtp_depth = 1,
        };
        b->n_valid[s] = 1;
        b->tok_in[s] = (int32_t)(rnd(b) % (uint64_t)m->vocab);
    }
    b->start[B] = B;
    *bt = (struct batch){ .n_tok = B, .n_seqs = B, .ids = b->ids, .pos = b->pos,
                          .seq_start = b->start, .seq_pos0 = b->pos0 };
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        bt->slots[g] = b->slots[g];
        bt->boff[g] = b->boff[g];
        bt->tables[g] = b->tables[g];
    }
}

static void batch_make(struct bench *b, int B, int ctx, struct batch *bt)
{
    batch_make_at(b, B, ctx, 0, bt);
}

static void plan_make(struct bench *b, int B, struct step_plan *p)
{
    static uint64_t step_id;

    *p = (struct step_plan){ .step_id = ++step_id, .n_seqs = B, .n_tokens = B, .seqs = b->pseqs,
                             .tokens = b->ids };
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        p->n_block_ids[g] = B * b->nb;
        p->blocks[g] = b->tables[g];
    }
}

static void fill_rows(struct bench *b, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = rnd_unit(b);
}

/* distinct experts among the B x top_k routing ids of the last MoE layer run */
static int distinct_experts(const struct model *m, int B)
{
    uint64_t seen[16] = { 0 };
    int n = 0;

    for (int i = 0; i < B * m->cfg->top_k; i++) {
        int e = m->rids[i];

        if (e >= 0 && e < 1024 && !(seen[e / 64] >> (e % 64) & 1)) {
            seen[e / 64] |= 1ull << (e % 64);
            n++;
        }
    }
    return n;
}

/* ---------------------------------------------------------------- sweep -- */

static void die(const char *what, int r, const struct model *m)
{
    fprintf(stderr, "bench-shapes: %s failed: %s%s%s\n", what, err_str(r), m ? ": " : "",
            m ? model_last_error(m) : "");
    exit(1);
}

static const char *kind_name(const struct mlayer *L)
{
    return L->is_moe ? (L->window > 0 ? "MoE/sliding" : "MoE/full")
                     : (L->window > 0 ? "dense/sliding" : "dense/full");
}

/* -------------------------------------------------------------- routing -- */

/* Distinct experts a trained router reaches, relative to uniform routing: the tiny model's
 * router (models/tiny-step, 16 experts top-4) over 256 segments of 128 tokens of the
 * repository's README and docs, one position from each of B different segments, 400 draws
 * (bench-shapes --measure-routing models/tiny-step README.md docs/...; PERFORMANCE §8.3):
 * 4.00 / 9.58 / 14.51 at batch 1 / 4 / 16 against the uniform 4.00 / 10.94 / 15.84.  At
 * batch 64 the tiny model is saturated (15.94 of 16), so batch > 16 keeps the ratio at 16.
 * --measure-routing fails when its figures leave these by more than 0.03. */
static const struct { int B; double ratio; } routing_ratio[] = {
    { 1, 1.0 }, { 4, 9.58 / 10.94 }, { 16, 14.51 / 15.84 },
};

/* expected distinct experts of B tokens each routed to k of N experts uniformly */
static double routing_uniform(int N, int k, int B)
{
    return N * (1.0 - pow(1.0 - (double)k / N, B));
}

/* the realistic count: the uniform one times the measured ratio (interpolated in log B) */
static double routing_target(int N, int k, int B)
{
    const int n = sizeof(routing_ratio) / sizeof(routing_ratio[0]);
    double ratio = routing_ratio[n - 1].ratio, d;

    for (int i = 0; i + 1 < n; i++)
        if (B >= routing_ratio[i].B && B <= routing_ratio[i + 1].B) {
            double f = log((double)B / routing_ratio[i].B) /
                       log((double)routing_ratio[i + 1].B / routing_ratio[i].B);
            ratio = routing_ratio[i].ratio + f * (routing_ratio[i + 1].ratio - routing_ratio[i].ratio);
            break;
        }
    d = routing_uniform(N, k, B) * ratio;
    d = d < k ? k : d;
    return d > (double)B * k ? (double)B * k : d > N ? N : d;
}

/* The expert sets of B tokens reaching d distinct experts the way a router spreads them:
 * d experts drawn at random, each given to one token so that all d are used, the tokens'
 * other slots filled by popularity (weight 1/(rank+1)^0.8: a few experts are shared by
 * many tokens, most by one or two).  sets[B * k]; needs k <= d <= min(N, B * k). */
static void routing_sets(struct bench *b, int N, int k, int B, int d, int32_t *sets)
{
    int32_t perm[1024];
    double w[1024], wsum = 0;
    int fill[MAX_B] = { 0 };

    for (int i = 0; i < N; i++)
        perm[i] = i;
    for (int i = 0; i < d; i++) {
        int j = i + (int)(rnd(b) % (uint64_t)(N - i)), t = perm[i];

        perm[i] = perm[j];
        perm[j] = t;
        w[i] = pow(i + 1.0, -0.8);
        wsum += w[i];
    }
    for (int i = 0; i < d; i++) {
        int t = i % B;

        sets[t * k + fill[t]++] = perm[i];
    }
    for (int t = 0; t < B; t++)
        while (fill[t] < k) {
            double u = (double)rnd(b) / 2147483648.0 * wsum;
            int i = 0;
            bool dup = false;

            while (i < d - 1 && (u -= w[i]) > 0)
                i++;
            for (int j = 0; j < fill[t] && !dup; j++)
                dup = sets[t * k + j] == perm[i];
            if (!dup)
                sets[t * k + fill[t]++] = perm[i];
        }
}

/* The router of L as unit rows in the space of the layer's input (post_norm's weight,
 * 1 + the stored one, folded in): rows[e] . x is expert e's logit up to the norm's positive factor. */
static float *routing_rows(const struct mlayer *L, int N, int H)
{
    float *rows = malloc(sizeof(float) * (size_t)N * H), *g = malloc(sizeof(float) * H);

    if (!rows || !g)
        die("router rows", -ENOMEM, NULL);
    cpu_weight_row(&L->post_norm, 0, g);
    for (int e = 0; e < N; e++) {
        float *r = rows + (size_t)e * H;
        double s = 0;

        cpu_weight_row(&L->router, e, r);
        for (int j = 0; j < H; j++) {
            r[j] *= 1.0f + g[j];      /* the norm's weight is stored less 1 (rmsnorm.c) */
            s += (double)r[j] * r[j];
        }
        for (int j = 0; j < H; j++)
            r[j] = s > 0 ? (float)(r[j] / sqrt(s)) : 0.0f;
    }
    free(g);
    return rows;
}

/* x[H], a layer input whose router logits put exactly the k experts of set first, by a
 * margin: the sum of their rows, corrected (perceptron steps) until every one of them is
 * above every other expert; scaled to rms 1000 so that the attention half's residual does
 * not move it.  Returns the final margin over the mean logit of the set (> 0.2). */
static double routing_input(const float *rows, int N, int H, const int32_t *set, int k, float *x)
{
    double z[1024], margin = 0, ss = 0;
    bool in[1024] = { false };

    memset(x, 0, sizeof(float) * H);
    for (int j = 0; j < k; j++) {
        in[set[j]] = true;
        for (int h = 0; h < H; h++)
            x[h] += rows[(size_t)set[j] * H + h];
    }
    for (int it = 0; it < 64; it++) {
        double lo = INFINITY, hi = -INFINITY, mean = 0;

        for (int e = 0; e < N; e++) {
            const float *r = rows + (size_t)e * H;
            double s = 0;

            for (int h = 0; h < H; h++)
                s += (double)r[h] * x[h];
            z[e] = s;
            if (in[e]) {
                lo = s < lo ? s : lo;
                mean += s / k;
            } else {
                hi = s > hi ? s : hi;
            }
        }
        margin = (lo - hi) / fabs(mean);
        if (margin > 0.2)
            break;
        for (int e = 0; e < N; e++) {
            double step = in[e] && z[e] < hi + 0.3 * fabs(mean) ? 0.25 :
                          !in[e] && z[e] > lo - 0.3 * fabs(mean) ? -0.25 : 0.0;

            for (int h = 0; step != 0 && h < H; h++)
                x[h] += (float)step * rows[(size_t)e * H + h];
        }
    }
    for (int h = 0; h < H; h++)
        ss += (double)x[h] * x[h];
    for (int h = 0; h < H; h++)
        x[h] = (float)(x[h] * 1000.0 / sqrt(ss / H));
    return margin;
}

/* The inputs of MoE layer L (trunk layer li) for B tokens routed realistically: a count
 * drawn around routing_target (its fraction by chance), the sets (sets[B x top_k]) and a
 * row per token in x; returns the count.  The router's bias is the caller's to set aside
 * (it would move the choice off the sets). */
static int routing_layer_inputs(struct bench *b, const struct mlayer *L, int li, int B, float *x,
                                int32_t *sets)
{
    const int N = b->m->cfg->n_experts, k = b->m->cfg->top_k, H = b->m->hidden;
    double want = routing_target(N, k, B);
    int d = (int)want + ((double)rnd(b) / 2147483648.0 < want - floor(want));

    if (!b->rrows[li])
        b->rrows[li] = routing_rows(L, N, H);
    d = d > B * k ? B * k : d > N ? N : d;
    routing_sets(b, N, k, B, d, sets);
    for (int t = 0; t < B; t++)
        if (routing_input(b->rrows[li], N, H, sets + t * k, k, x + (size_t)t * H) <= 0.2) {
            fprintf(stderr, "bench-shapes: no input of layer %d routes to the chosen experts\n",
                    L->idx);
            exit(1);
        }
    return d;
}

/* Reads the probe's arena (>> the last-level cache) so that the next piece reads its
 * weights from DRAM, as in serving: a MoE layer runs twice in a row and its experts again. */
static void evict(struct bench *b)
{
    volatile uint64_t sink = 0;
    uint64_t s = 0;

    for (size_t i = 0; i < b->arena_bytes; i += 64)
        s += b->arena[i];
    sink = s;
    (void)sink;
}

/* The MoE layer L just run, in two pieces: its routed experts again on the routing it chose
 * (backend_moe; bytes: the distinct experts, from DRAM after evict)
 * and its router (the logits matmul and the top-k; real: without the bias, as that run). */
static void moe_pieces(struct bench *b, struct mlayer *L, int B, bool real, const char *suffix)
{
    struct model *m = b->m;
    const struct model_config *cfg = m->cfg;
    const struct moe_expert *x = &L->experts[0];
    int d = distinct_experts(m, B), r;
    char name[96];
    double t0, t;
    struct moe_args ma = {
        .x = m->a, .out = m->tmp, .n_tok = B, .hidden = m->hidden,
        .inter = cfg->moe_intermediate_size, .top_k = cfg->top_k, .ids = m->rids,
        .weights = m->rweights, .experts = L->experts, .expert_first = L->expert_first,
        .n_local = L->n_local, .limit = L->limit_routed,
    };

    evict(b);
    t0 = tick(b);
    r = backend_moe(m->be, &ma);
    t = now() - t0;
    if (r < 0)
        die("routed experts", r, NULL);
    snprintf(name, sizeof(name), "  routed experts of layer %d%s", L->idx, suffix);
    b->flops_next = wflops(&x->gate, B * cfg->top_k) + wflops(&x->up, B * cfg->top_k) +
                    wflops(&x->down, B * cfg->top_k);
    record(b, name, B, CTX_LAYERS, t, d * expert_bytes(L));
    t0 = tick(b);
    r = backend_matmul(m->be, &L->router, m->a, B, m->rlogits);
    r = r ? r : backend_router(m->be, m->rlogits, real ? NULL : L->router_bias, B,
                               cfg->n_experts, cfg->top_k, cfg->norm_expert_weight,
                               cfg->router_scaling_factor, m->rids, m->rweights);
    t = now() - t0;
    if (r < 0)
        die("router", r, NULL);
    snprintf(name, sizeof(name), "  router of layer %d (%d x %d, top-%d)%s", L->idx,
             cfg->n_experts, m->hidden, cfg->top_k, suffix);
    b->flops_next = wflops(&L->router, B);
    record(b, name, B, CTX_LAYERS, t, wbytes(&L->router));
}

/* Trunk layer l at context CTX_LAYERS on the batch bt: a MoE layer twice, its inputs
 * routed realistically (routing_layer_inputs; the plain name) and on fresh unit-variance rows
 * that the random router spreads uniformly (", uniform routing"); the bytes count each
 * distinct expert the tokens reached once. */
static void layer_rows(struct bench *b, int l, int B, const struct batch *bt)
{
    struct model *m = b->m;
    struct mlayer *L = &m->layers[l];
    int32_t sets[MAX_B * 64];
    char name[96];

    for (int i = 0; i < (L->is_moe ? 2 : 1); i++) {
        const int uniform = L->is_moe && (i + b->rep) % 2;     /* the order swaps by round */
        float *bias = L->router_bias;
        bool real = L->is_moe && !uniform;
        double t0, t, bytes;
        int r;

        if (real) {
            routing_layer_inputs(b, L, l, B, m->hid, sets);
            L->router_bias = NULL;
        } else {
            fill_rows(b, m->hid, (size_t)B * m->hidden);
        }
        if (L->is_moe)
            evict(b);
        t0 = tick(b);
        r = model__layer_forward(m, L, m->hid, bt);
        t = now() - t0;
        L->router_bias = bias;
        if (r < 0)
            die("layer", r, NULL);
        bytes = attn_wbytes(L) + ffn_wbytes(L) + B * kv_bytes(m, L, CTX_LAYERS);
        if (L->is_moe) {
            int d = distinct_experts(m, B);

            bytes += d * expert_bytes(L);
            if (real) {
                b->real_distinct[B][b->rep] += d;
            } else {
                b->moe_distinct[B] += d;
                b->moe_runs[B]++;
            }
        }
        snprintf(name, sizeof(name), "layer %d %s (%d heads)%s", L->idx, kind_name(L), L->n_heads,
                 L->is_moe && uniform ? ", uniform routing" : "");
        b->flops_next = layer_flops(m, L, B, CTX_LAYERS);
        record(b, name, B, CTX_LAYERS, t, bytes);
        if (L->is_moe)
            moe_pieces(b, L, B, real, uniform ? ", uniform routing" : "");
    }
}

static void sweep(struct bench *b, int B)
{
    struct model *m = b->m;
    const struct model_config *cfg = m->cfg;
    const int H = m->hidden;
    struct batch bt;
    struct step_plan p;
    char name[96];
    double t0, t;
    int r;

    /* trunk layers at context CTX_LAYERS, whole backend */
    batch_make(b, B, CTX_LAYERS, &bt);
    b->moe_distinct[B] = 0;
    b->moe_runs[B] = 0;
    b->real_distinct[B][b->rep] = 0;
    for (int l = 0; l < m->n_layers; l++)
        layer_rows(b, l, B, &bt);
    if (b->moe_runs[B] > 0) {
        b->real_distinct[B][b->rep] /= b->moe_runs[B];
        b->uni_distinct[B][b->rep] = b->moe_distinct[B] / b->moe_runs[B];
    }
    /* attention alone: a full and a sliding layer at every context */
    for (int want_sliding = 0; want_sliding < 2; want_sliding++) {
        struct mlayer *L = NULL;

        for (int l = 0; l < m->n_layers && !L; l++)
            if ((m->layers[l].window > 0) == want_sliding)
                L = &m->layers[l];
        if (!L)
            continue;
        for (int ci = 0; ci < b->n_ctxs * (b->ab_attn ? 2 : 1); ci++) {
            int ctx = b->ctxs[ci % b->n_ctxs], off = ci >= b->n_ctxs;
            int g = L->group;

            /* --ab-attn: the same attention with one KV head per work item (attention.c
             * before head groups), on a set of sequences of its own; the two sets swap from
             * round to round */
            bool ab = b->ab_attn && (int64_t)2 * B * ((ctx + BS - 1) / BS) <= b->nbf;

            if (off && !ab)
                continue;
            batch_make_at(b, B, ctx, ab && off != (b->rep % 2) ? B : 0, &bt);
            cpu_attn_no_groups = off;
            fill_rows(b, m->q, (size_t)B * L->n_heads * L->head_dim);
            struct attn_args aa = {
                .q = m->q, .out = m->att, .n_tok = B, .n_heads = L->n_heads,
                .n_kv_heads = L->n_kv_heads, .head_dim = L->head_dim,
                .scale = 1.0f / sqrtf((float)L->head_dim), .window = L->window, .kv = &L->kv,
                .n_seqs = B, .seq_tok_start = bt.seq_start, .seq_pos0 = bt.seq_pos0,
                .block_tables = bt.tables[g], .block_table_off = bt.boff[g],
            };
            t0 = now();
            r = backend_attention(m->be, &aa);
            t = now() - t0;
            if (r < 0)
                die("attention", r, NULL);
            cpu_attn_no_groups = 0;
            snprintf(name, sizeof(name), "attention %s (%d heads)%s%s",
                     L->window > 0 ? "sliding" : "full", L->n_heads,
                     b->shared && !want_sliding ? " shared history" : "",
                     off ? ", a head per item" : "");
            b->flops_next = attn_flops(L, B, ctx);
            record(b, name, B, ctx, t, B * kv_bytes(m, L, ctx));
        }
    }
    /* lm_head */
    fill_rows(b, m->rows_h, (size_t)B * H);
    t0 = tick(b);
    r = backend_rmsnorm(m->be, m->rows_h, &m->final_norm, B, H, cfg->rms_norm_eps, m->rows_h);
    r = r ? r : backend_matmul(m->be, &m->lm_head, m->rows_h, B, m->rows_logits);
    t = now() - t0;
    if (r < 0)
        die("lm_head", r, NULL);
    snprintf(name, sizeof(name), "lm_head (final norm + %d x %d)", m->vocab, H);
    b->flops_next = wflops(&m->lm_head, B);
    record(b, name, B, 0, t, wbytes(&m->lm_head));

    /* the real decode step, then one MTP depth.  Its bytes count the distinct experts its
     * own routing reaches (the tokens' hidden states through the random router), taken from
     * the last MoE layer's routing ids the timed step leaves, for every MoE layer.  The
     * uniform rows' count (moe_distinct) is far lower at batch >= 4 (32-37 against 88-96 at
     * batch 16 on the full-width model): counted so, the floor left out ~1 GB of expert reads
     * at batch 16 (docs/PERFORMANCE.md §8.6). */
    for (int whole = 0; whole < (b->T == 2 && B >= 4 ? 2 : 1); whole++) {
        double step_bytes = wbytes(&m->lm_head) + wbytes(&m->final_norm) + B * H * 2.0;
        int parts = m->split_parts, d;

        batch_make(b, B, CTX_LAYERS, &bt);
        plan_make(b, B, &p);
        if (whole)
            m->split_parts = 1;
        t0 = tick(b);
        r = model_step(m, &p, b->logits);
        t = now() - t0;
        m->split_parts = parts;
        if (r < 0)
            die("model_step", r, m);
        d = distinct_experts(m, B);
        b->step_distinct[B][b->rep] = d;
        for (int l = 0; l < m->n_layers; l++) {
            const struct mlayer *L = &m->layers[l];
            step_bytes += attn_wbytes(L) + ffn_wbytes(L) + d * expert_bytes(L) +
                          B * kv_bytes(m, L, CTX_LAYERS);
        }
        snprintf(name, sizeof(name), "real step: embed, %d layers, head%s", m->n_layers,
                 b->T == 2 && B >= 4 ? (whole ? " (whole, the default)" : " (per-core parts)")
                                     : "");
        b->flops_next = wflops(&m->lm_head, B);
        for (int l = 0; l < m->n_layers; l++)
            b->flops_next += layer_flops(m, &m->layers[l], B, CTX_LAYERS);
        record(b, name, B, CTX_LAYERS, t, step_bytes);
    }
    if (m->n_mtp > 0) {
        const struct mlayer *L = &m->layers[m->n_layers];
        double lb = attn_wbytes(L) + ffn_wbytes(L) + wbytes(&L->enorm) + wbytes(&L->hnorm) +
                    wbytes(&L->eh_e) + wbytes(&L->eh_h) + B * kv_bytes(m, L, CTX_LAYERS);
        double hb = wbytes(&L->head_norm) + wbytes(&L->head);

        t0 = tick(b);
        r = model_mtp_step(m, 0, &p, b->n_valid, b->tok_in, b->logits);
        t = now() - t0;
        if (r < 0)
            die("model_mtp_step", r, m);
        snprintf(name, sizeof(name), "MTP depth (layer + draft head, %s)",
                 L->head.fmt == WFMT_MXFP4 ? "MXFP4 drafts" : "BF16 drafts");
        record(b, name, B, CTX_LAYERS, t, lb + hb);
        fill_rows(b, m->rows_h, (size_t)B * H);
        t0 = tick(b);
        r = backend_rmsnorm(m->be, m->rows_h, &L->head_norm, B, H, cfg->rms_norm_eps, m->rows_h);
        r = r ? r : backend_matmul(m->be, &L->head, m->rows_h, B, m->mtp_logits);
        t = now() - t0;
        if (r < 0)
            die("draft head", r, NULL);
        record(b, "MTP draft head alone", B, 0, t, hb);
        if (b->dv > 0) {
            /* the same depth over the draft vocabulary (a new step first: depth 0 follows a
             * step) */
            r = model_step(m, &p, b->logits);
            if (r < 0)
                die("model_step", r, m);
            p.draft_sub = true;
            t0 = tick(b);
            r = model_mtp_step(m, 0, &p, b->n_valid, b->tok_in, b->logits);
            t = now() - t0;
            p.draft_sub = false;
            if (r < 0)
                die("model_mtp_step (draft vocabulary)", r, m);
            snprintf(name, sizeof(name), "MTP depth, draft vocabulary of %d ids", b->dv);
            record(b, name, B, CTX_LAYERS, t, lb + hb * b->dv / m->vocab);
        }
    }
}

/* ------------------------------------------------------------- reporting -- */

static const struct cell *find(const struct bench *b, const char *prefix, int B, int ctx)
{
    for (int i = 0; i < b->n_cells; i++)
        if (b->cells[i].B == B && b->cells[i].ctx == ctx &&
            strncmp(b->cells[i].name, prefix, strlen(prefix)) == 0)
            return &b->cells[i];
    return NULL;
}

/* Step-3.7-Flash's 45 layers + head at batch B and context ctx, per round: time and floor;
 * uniform: the MoE layers' rows on uniform routing, else the realistic ones */
static void extrapolate(const struct bench *b, int B, int ctx, bool uniform, double *ret_t,
                        double *ret_ratio, double *ret_floor)
{
    /* real layer counts per generated kind: dense/full 1 (layer 0), dense/sliding 2 (1, 2),
     * MoE/full 11 (4, 8, .., 44), MoE/sliding 31 */
    static const struct { const char *kind; int count; } kinds[] = {
        { "dense/full", 1 }, { "dense/sliding", 2 }, { "MoE/full", 11 }, { "MoE/sliding", 31 },
    };
    const struct cell *head = find(b, "lm_head", B, 0);
    double t[MAX_REPS], fl[MAX_REPS], ratio[MAX_REPS];
    int n = head ? head->n : 0;

    for (int r = 0; r < n; r++) {
        t[r] = head->t[r];
        fl[r] = head->floor[r];
    }
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        const struct cell *layer = NULL, *a1k, *ac;
        char pre[64];
        bool sliding = strstr(kinds[k].kind, "sliding") != NULL;

        for (int i = 0; i < b->n_cells && !layer; i++)
            if (b->cells[i].B == B && strncmp(b->cells[i].name, "layer ", 6) == 0 &&
                strstr(b->cells[i].name, kinds[k].kind) &&
                (strncmp(kinds[k].kind, "MoE", 3) != 0 ||
                 !strstr(b->cells[i].name, "uniform routing") == !uniform))
                layer = &b->cells[i];
        snprintf(pre, sizeof(pre), "attention %s", sliding ? "sliding" : "full");
        a1k = find(b, pre, B, CTX_LAYERS);
        ac = find(b, pre, B, ctx);
        if (!layer || !a1k || !ac) {
            *ret_t = *ret_ratio = *ret_floor = 0;
            return;
        }
        for (int r = 0; r < n; r++) {
            t[r] += kinds[k].count * (layer->t[r] - a1k->t[r] + ac->t[r]);
            fl[r] += kinds[k].count * (layer->floor[r] - a1k->floor[r] + ac->floor[r]);
        }
    }
    for (int r = 0; r < n; r++)
        ratio[r] = fl[r] / t[r];
    *ret_t = median(t, n);
    *ret_floor = median(fl, n);
    *ret_ratio = median(ratio, n);
}

static void report(const struct bench *b)
{
    double lo = b->bw[0], hi = b->bw[0];

    for (int r = 1; r < b->reps; r++) {
        lo = b->bw[r] < lo ? b->bw[r] : lo;
        hi = b->bw[r] > hi ? b->bw[r] : hi;
    }
    printf("\nthreads %d: read bandwidth %.2f GB/s (median of %d probes, %.2f .. %.2f; one before "
           "each round)\n", b->T, median(b->bw, b->reps), b->reps, lo, hi);
    for (int bi = 0; bi < b->n_batches; bi++) {
        int B = b->batches[bi];

        printf(" batch %d (medians of %d rounds; context in tokens)\n", B, b->reps);
        for (int i = 0; i < b->n_cells; i++) {
            const struct cell *c = &b->cells[i];
            char ctx[16] = "";
            double ratio[MAX_REPS];

            if (c->B != B)
                continue;
            if (c->ctx)
                snprintf(ctx, sizeof(ctx), "%dk", c->ctx / 1024);
            for (int k = 0; k < c->n; k++)
                ratio[k] = c->floor[k] / c->t[k];
            int nc = 0;

            for (int k = 0; k < c->n; k++)
                nc += c->compute[k];
            printf("  %-66s %4s %9.2f ms %9.1f MB  floor %8.2f ms  %5.1f %% of %s", c->name,
                   ctx, 1e3 * median(c->t, c->n), median(c->bytes, c->n) / 1e6,
                   1e3 * median(c->floor, c->n), 100.0 * median(ratio, c->n),
                   nc == 0 ? "bw" : nc == c->n ? "peak" : "bw|peak");
            if (c->cpu[0] > 0)
                printf("  cpu %.2f, %5.1f %% per cpu-s", median(c->cpu, c->n),
                       100.0 * median(c->cpu_ratio, c->n));
            printf("\n");
        }
        if (b->moe_runs[B] > 0) {
            const struct model_config *cfg = b->m->cfg;

            printf("  routing: distinct experts per MoE layer %.1f realistic (target %.1f = "
                   "uniform %.1f x %.3f, the measured ratio), %.1f uniform (random router), "
                   "%.1f in the real step (its own routing)\n",
                   median(b->real_distinct[B], b->reps), routing_target(cfg->n_experts,
                   cfg->top_k, B), routing_uniform(cfg->n_experts, cfg->top_k, B),
                   routing_target(cfg->n_experts, cfg->top_k, B) /
                       routing_uniform(cfg->n_experts, cfg->top_k, B),
                   median(b->uni_distinct[B], b->reps), median(b->step_distinct[B], b->reps));
        }
        for (int u = 0; u < 2; u++)
            for (int ci = 0; ci < b->n_ctxs; ci++) {
                double t, ratio, fl;

                extrapolate(b, B, b->ctxs[ci], u, &t, &ratio, &fl);
                if (t > 0)
                    printf("  Step-3.7-Flash decode step, 45 layers + head, context %2dk%s: %8.1f "
                           "ms = %6.2f tok/s (floor %7.1f ms = %6.2f tok/s)  %5.1f %% of floor\n",
                           b->ctxs[ci] / 1024, u ? ", uniform routing" : "", 1e3 * t, B / t,
                           1e3 * fl, B / fl, 100.0 * ratio);
            }
    }
    {
        const struct cell *moe = NULL;
        double t, ratio, fl, rr[MAX_REPS];

        for (int i = 0; i < b->n_cells && !moe; i++)
            if (b->cells[i].B == 1 && strncmp(b->cells[i].name, "layer ", 6) == 0 &&
                strstr(b->cells[i].name, "MoE/sliding"))
                moe = &b->cells[i];
        extrapolate(b, 1, CTX_LAYERS, false, &t, &ratio, &fl);
        if (moe) {
            for (int k = 0; k < moe->n; k++)
                rr[k] = moe->floor[k] / moe->t[k];
            printf(" targets, %d threads: MoE layer at batch 1 %.1f %% of the read bandwidth "
                   "(target >= 80 %%); whole decode step at batch 1, context 1k %.1f %% (target "
                   ">= 70 %%)\n", b->T, 100.0 * median(rr, moe->n), 100.0 * ratio);
        }
    }
}

/* ---------------------------------------------------------------- setup -- */

static long mem_available_mb(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    long kb = -1;

    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %ld kB", &kb) == 1)
            break;
    fclose(f);
    return kb < 0 ? -1 : kb / 1024;
}

static void kv_fill(struct bench *b, const struct kv_layer *kv)
{
    size_t n;
    float *pat;
    const size_t chunk = 1 << 18;      /* floats */

    if (!kv->k)
        return;
    n = (size_t)kv->n_blocks * kv->block_size * kv->n_kv_heads * kv->head_dim;
    pat = malloc(chunk * sizeof(float));
    if (!pat) {
        fprintf(stderr, "bench-shapes: out of memory\n");
        exit(1);
    }
    fill_rows(b, pat, chunk);
    if (!kv->dtype_f32)         /* BF16 storage (the default): the pattern's halves */
        for (size_t i = 0; i < chunk; i++)
            ((uint16_t *)pat)[i] = cpu_f32_to_bf16(pat[i]);
    for (int h = 0; h < 2; h++) {
        char *dst = h ? kv->v : kv->k;
        size_t es = kv->dtype_f32 ? sizeof(float) : sizeof(uint16_t);

        for (size_t i = 0; i < n; i += chunk)
            memcpy(dst + i * es, pat, es * (n - i < chunk ? n - i : chunk));
    }
    free(pat);
}

static int run_model(const char *cmd0, char *const argv[])
{
    pid_t pid;
    int st;

    if (posix_spawn(&pid, cmd0, NULL, NULL, argv, environ) != 0)
        return -errno;
    if (waitpid(pid, &st, 0) < 0)
        return -errno;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -EIO;
}

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;

    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);

        if (end == s || v <= 0)
            return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return -1;
    }
    return n;
}

/* The compute peak of the round: the int8 MXFP4 GEMM (backend_matmul, the kernel the
 * routed experts run) on the first MoE layer's expert 0 gate (1280 x 4096) at MAX_B tokens,
 * its weights in the cache after a first call; the best of 5 calls, FLOP/s.  0 without a
 * MoE layer (the floors are then bytes only). */
static double gemm_peak(struct bench *b)
{
    struct model *m = b->m;
    const struct bweight *w = NULL;
    double best = 0;

    for (int l = 0; l < m->n_layers && !w; l++)
        if (m->layers[l].is_moe && m->layers[l].n_local > 0)
            w = &m->layers[l].experts[0].gate;
    if (!w || w->rows > m->hidden || w->cols != m->hidden)
        return 0;
    b->peak_rows = (int)w->rows;
    b->peak_fmt = w->fmt == WFMT_MXFP4 ? (cpu_mxfp4_use_fast(cpu_ctx(m->be), w) ? "MXFP4, int8 "
                  "activations" : "MXFP4, exact") : w->fmt == WFMT_BF16 ? "BF16" : "other format";
    fill_rows(b, m->a, (size_t)MAX_B * m->hidden);
    for (int i = 0; i < 6; i++) {
        double c0 = cpu_now(), t0 = now(), t;
        int r = backend_matmul(m->be, w, m->a, MAX_B, m->tmp);

        t = now() - t0;
        if (r < 0)
            die("GEMM peak", r, NULL);
        if (i > 0 && (best == 0 || t < best)) {
            best = t;
            b->peak_cpu[b->rep] = (cpu_now() - c0) / (t * b->T);
        }
    }
    return wflops(w, MAX_B) / best;
}

/* The per-thread-count state beside the models: the probe's pool, the block tables, the
 * logits and the KV pools' sizes (cfg: any of the models, they share their shapes). */
static void threads_begin(struct bench *b, const struct model_config *cfg)
{
    int max_ctx = CTX_LAYERS, r;

    for (int i = 0; i < b->n_ctxs; i++)
        max_ctx = b->ctxs[i] > max_ctx ? b->ctxs[i] : max_ctx;
    r = cpu_pool_new(b->T, &b->pool);
    if (r < 0)
        die("probe pool", r, NULL);
    /* FULL blocks: every batch x context of distinct histories that fits ~2 GB for the
     * trunk's full layers; the sliding pool: a window (+ 3 blocks) per sequence */
    {
        int n_full = 0;
        double per_block = (double)BS * cfg->n_kv_heads * cfg->head_dim * 2 * 4;
        int want = 0;

        for (int i = 0; i < cfg->n_layers; i++)
            n_full += cfg->layers[i].kind == LAYER_KIND_FULL;
        for (int bi = 0; bi < b->n_batches; bi++)
            for (int ci = 0; ci < b->n_ctxs; ci++) {
                int64_t need = (int64_t)b->batches[bi] * ((b->ctxs[ci] + BS - 1) / BS) + MAX_B;
                if (need * per_block * (n_full ? n_full : 1) <= 2.2e9 && need > want)
                    want = (int)need;
            }
        b->nbf = want > (max_ctx + BS - 1) / BS + MAX_B ? want : (max_ctx + BS - 1) / BS + MAX_B;
        b->sps = cfg->sliding_window / BS + 3;
        b->nbs = MAX_B * b->sps;
    }
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        b->tables[g] = calloc((size_t)MAX_B * ((max_ctx + BS - 1) / BS + 1), sizeof(int32_t));
        if (!b->tables[g])
            die("block tables", -ENOMEM, NULL);
    }
    b->logits = malloc(sizeof(float) * MAX_B * (size_t)cfg->vocab_size);
    if (!b->logits)
        die("logits", -ENOMEM, NULL);
}

static void threads_end(struct bench *b)
{
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        free(b->tables[g]);
    free(b->logits);
    cpu_pool_free(b->pool);
}

/* b->m on a CPU backend b->be of b->T threads, set up as stepd-worker sets it up, its KV
 * caches filled */
static void model_build(struct bench *b, struct ckpt *ck)
{
    struct backend_cfg bc = { .n_threads = b->T };
    struct err_buf e = { { 0 } };
    int max_ctx = CTX_LAYERS, r;
    double t0;

    for (int i = 0; i < b->n_ctxs; i++)
        max_ctx = b->ctxs[i] > max_ctx ? b->ctxs[i] : max_ctx;
    r = backend_new("cpu", &bc, &b->be);
    if (r < 0)
        die("cpu backend", r, NULL);
    struct model_opts mo = {
        .max_tokens_per_step = b->chunk > MAX_B ? b->chunk : MAX_B, .max_seqs = MAX_B,
        .max_logit_rows = MAX_B,
        .block_size = BS, .n_blocks = { b->nbf, b->nbs }, .max_seq_len = max_ctx + BS,
        .draft_quant = MODEL_DRAFT_MXFP4,   /* the CPU default ("auto") */
        .split_any_size = true,             /* parts beside whole steps (below) */
        .kv_f32 = b->kv_f32,                /* BF16 KV unless --kv-fp32, as the worker */
    };
    t0 = now();
    r = model_new(ck, b->be, NULL, &mo, &b->m, &e);
    if (r < 0) {
        fprintf(stderr, "bench-shapes: model: %s\n", e.msg);
        exit(1);
    }
    if (b->dv > 0 && b->m->n_mtp > 0) {
        /* the cost of a draft does not depend on which ids: the first dv */
        int32_t *ids = malloc(sizeof(*ids) * (size_t)b->dv);
        if (!ids)
            die("draft vocabulary", -ENOMEM, NULL);
        for (int i = 0; i < b->dv; i++)
            ids[i] = i;
        r = model_set_draft_vocab(b->m, ids, b->dv, &e);
        free(ids);
        if (r < 0) {
            fprintf(stderr, "bench-shapes: %s\n", e.msg);
            exit(1);
        }
    }
    if (b->m->n_layers > 64 || b->m->cfg->n_experts > 1024 || b->m->cfg->top_k > 64) {
        fprintf(stderr, "bench-shapes: realistic routing takes at most 64 layers, 1024 experts "
                "and top-64\n");
        exit(1);
    }
    for (int i = 0; i < b->m->n_layers + b->m->n_mtp; i++)
        kv_fill(b, &b->m->layers[i].kv);
    for (int i = 0; b->m->mtp_tp && i < 2 * b->m->n_mtp; i++)
        kv_fill(b, &b->m->tp_half[i].kv);
    printf("\nthreads %d%s%s: model built in %.1f s (KV: %d full blocks, %d sliding, %s; split "
           "steps %s, MTP halves %s); MemAvailable %ld MiB\n", b->T, b->tag ? ", " : "",
           b->tag ? b->tag : "", now() - t0, b->nbf, b->nbs, mo.kv_f32 ? "FP32" : "BF16",
           b->m->split_parts > 1 ? "on" : "off", b->m->mtp_tp ? "on" : "off", mem_available_mb());
}

static void model_end(struct bench *b)
{
    for (int l = 0; l < 64; l++) {
        free(b->rrows[l]);
        b->rrows[l] = NULL;
    }
    model_free(b->m);
    b->m = NULL;
    backend_free(b->be);
    b->be = NULL;
}

static void bench_threads(struct bench *b, struct ckpt *ck)
{
    threads_begin(b, ckpt_config(ck));
    model_build(b, ck);
    b->n_cells = 0;
    for (b->rep = 0; b->rep < b->reps; b->rep++) {
        const double pc0 = cpu_now(), pt0 = now();

        b->load[b->rep] = load_avg();
        b->bw[b->rep] = bw_probe_once(b->pool, b->arena, b->arena_bytes);
        b->bw_cpu[b->rep] = (cpu_now() - pc0) / ((now() - pt0) * b->T);
        b->peak[b->rep] = gemm_peak(b);
        for (int bi = 0; bi < b->n_batches; bi++)
            sweep(b, b->batches[bi]);
    }
    if (b->peak[0] > 0)
        printf("\nthreads %d: GEMM peak %.1f GFLOP/s (median of %d rounds; int8 MXFP4 "
               "backend_matmul, expert gate %d x %d at %d tokens, weights in cache, best of 5; "
               "cpu %.2f)\n", b->T, median(b->peak, b->reps) / 1e9, b->reps, b->peak_rows,
               b->m->hidden, MAX_B, median(b->peak_cpu, b->reps));
    printf("threads %d: load average at the rounds' starts:", b->T);
    for (int r = 0; r < b->reps; r++)
        printf(" %.2f", b->load[r]);
    printf("; the probe's cpu %.2f (cpu: process CPU seconds over wall x threads; \"per cpu-s\": "
           "the floor at the probe's or the peak's rate per CPU-second over the piece's CPU "
           "seconds)\n", median(b->bw_cpu, b->reps));
    report(b);
    model_end(b);
    threads_end(b);
}

/* Touches every page of L's routed experts (data and scales, where the loader maps them)
 * so that the rounds read them from memory, not from the disk the checkpoint is on. */
static void experts_fault(const struct mlayer *L)
{
    volatile uint8_t sink = 0;
    uint8_t s = 0;

    for (int x = 0; x < L->n_local; x++)
        for (int j = 0; j < 3; j++) {
            const struct bweight *w = j == 0 ? &L->experts[x].gate :
                                      j == 1 ? &L->experts[x].up : &L->experts[x].down;
            size_t n = (size_t)wbytes(w);

            for (size_t i = 0; w->data && i < n; i += 4096)
                s ^= ((const uint8_t *)w->data)[i < n ? i : n - 1];
        }
    sink = s;
    (void)sink;
}

/* -------------------------------------------------------------- prefill -- */

/* The weight bf16_peak times: the first trunk layer's k projection (BF16 at Step-3.7-Flash's
 * shapes: 1024 x 4096), or NULL where it is not BF16 or has more rows than m->tmp holds. */
static const struct bweight *bf16_peak_weight(const struct model *m)
{
    const struct bweight *w = m->n_layers > 0 ? &m->layers[0].wk : NULL;

    return w && w->fmt == WFMT_BF16 && w->rows <= m->hidden && w->cols == m->hidden ? w : NULL;
}

/* The BF16 compute peak of the round: backend_matmul (the kernel the prefill's projections,
 * dense MLPs, shared experts and lm_head run: AMX tiles or FMA on widened BF16, whatever
 * this host's level picks) on the first 128 rows of bf16_peak_weight (1 MB: in the L2) at
 * a chunk's tokens; the best of 10 calls after a first, FLOP/s.  Calls of ~2 ms, so that
 * on a loaded host some run without being preempted.  0 without such a weight. */
static double bf16_peak(struct bench *b)
{
    struct model *m = b->m;
    const struct bweight *w = bf16_peak_weight(m);
    struct bweight v;
    double best = 0;

    if (!w || model__row_view(w, 0, w->rows < 128 ? w->rows : 128, &v) < 0)
        return 0;
    b->bpeak_rows = (int)v.rows;
    fill_rows(b, m->a, (size_t)b->chunk * m->hidden);
    for (int i = 0; i < 11; i++) {
        double t0 = now(), t;
        int r = backend_matmul(m->be, &v, m->a, b->chunk, m->tmp);

        t = now() - t0;
        if (r < 0)
            die("BF16 GEMM peak", r, NULL);
        if (i > 0 && (best == 0 || t < best))
            best = t;
    }
    return wflops(&v, b->chunk) / best;
}

/* FLOPs of a prompt of N tokens through the trunk and the head of its last row, by kind:
 * the dense and attention projections, the router and the dense MLPs / shared experts
 * (2 per weight and row), the routed experts (2 per weight and row, each row once per
 * token routed to it: N x top_k), attention (4 per key, head and dim; causal: query p
 * reads min(p + 1, window) keys, half the square at full attention), the lm_head (1 row). */
static void prefill_flops(const struct model *m, int N, double f[4])
{
    f[PF_DENSE] = f[PF_EXPERTS] = f[PF_ATTN] = 0;
    for (int l = 0; l < m->n_layers; l++) {
        const struct mlayer *L = &m->layers[l];
        double keys = 0;

        f[PF_DENSE] += wflops(&L->wq, N) + wflops(&L->wk, N) + wflops(&L->wv, N) +
                       wflops(&L->wg, N) + wflops(&L->wo, N) + wflops(&L->router, N);
        if (L->has_ffn_dense)
            f[PF_DENSE] += wflops(&L->gate, N) + wflops(&L->up, N) + wflops(&L->down, N);
        if (L->is_moe && L->n_local > 0) {
            const struct moe_expert *x = &L->experts[0];
            int n = N * m->cfg->top_k;

            f[PF_EXPERTS] += wflops(&x->gate, n) + wflops(&x->up, n) + wflops(&x->down, n);
        }
        for (int p = 0; p < N; p++)
            keys += L->window > 0 && L->window < p + 1 ? L->window : p + 1;
        f[PF_ATTN] += 4.0 * keys * L->n_heads * L->head_dim;
    }
    f[PF_HEAD] = wflops(&m->lm_head, 1);
}

/* The compute floor of cell c in round rep: the routed experts' FLOPs over the expert
 * kernel's peak (gemm_peak), the rest over the BF16 peak (bf16_peak; attention's FP32 FMAs
 * on widened BF16 keys are held to it too); 0 where a peak is missing. */
static double prefill_floor(const struct bench *b, const struct pf_cell *c, int rep)
{
    if (b->peak[rep] <= 0 || b->bpeak[rep] <= 0)
        return 0;
    return c->flops[PF_EXPERTS] / b->peak[rep] +
           (c->flops[PF_DENSE] + c->flops[PF_ATTN] + c->flops[PF_HEAD]) / b->bpeak[rep];
}

/* The plan of one prefill chunk: sequence 0 (slot 0), tokens c0 .. c0 + n - 1 of an
 * N-token prompt as the engine schedules it (STEP_SEQ_NEW on the first chunk, the head on
 * the prompt's last row only); FULL blocks 0 .. nb - 1, SLIDING blocks a ring over the
 * window and the chunk (-1 below the window of the chunk's first query). */
static void prefill_plan(struct bench *b, int N, int c0, int n, struct step_plan *p)
{
    struct model *m = b->m;
    const int nb = (c0 + n + BS - 1) / BS, W = m->cfg->sliding_window;
    const int ring = (W + b->chunk) / BS + 2, first = W > 0 && c0 > W ? (c0 - W) / BS : 0;
    static uint64_t step_id;

    for (int j = 0; j < nb; j++) {
        b->tables[KV_GROUP_FULL][j] = j;
        b->tables[KV_GROUP_SLIDING][j] = j < first ? -1 : j % ring;
    }
    for (int t = 0; t < n; t++)
        b->pf_ids[t] = (int32_t)(rnd(b) % (uint64_t)m->vocab);
    b->pseqs[0] = (struct step_seq){
        .slot = 0, .pos0 = c0, .n_tokens = n, .n_logits = c0 + n == N, .tok_off = 0,
        .n_blocks = nb, .block_off = { 0, 0 }, .flags = c0 == 0 ? STEP_SEQ_NEW : 0,
    };
    *p = (struct step_plan){ .step_id = ++step_id, .n_seqs = 1, .n_tokens = n,
                             .seqs = b->pseqs, .tokens = b->pf_ids };
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        p->n_block_ids[g] = nb;
        p->blocks[g] = b->tables[g];
    }
}

/* One chunk layer by layer as model_step runs it on the CPU (the embedding, each layer's
 * attention half and FFN half, the head), with the attention kernel and the routed experts
 * run a second time on the same inputs, timed apart: adds the pass's time without those
 * re-runs to *tot and the pieces' times to attn, moe and head. */
static void prefill_split_chunk(struct bench *b, const struct step_plan *p, double *tot,
                                double *attn, double *moe, double *head)
{
    struct model *m = b->m;
    const struct model_config *cfg = m->cfg;
    struct batch bt;
    double t0, t1, rerun = 0;
    int n_rows, r;

    r = model__check_plan(m, p);
    if (r < 0)
        die("prefill plan", r, m);
    n_rows = model__trunk_batch(m, p, &bt);
    t0 = now();
    r = model__step_inputs(m, &bt, p, false);
    r = r ? r : model__embed(m, &bt, m->hid);
    for (int l = 0; l < m->n_layers && r >= 0; l++) {
        struct mlayer *L = &m->layers[l];
        struct attn_args aa = {
            .q = m->q, .out = m->att, .n_tok = bt.n_tok, .n_heads = L->n_heads,
            .n_kv_heads = L->n_kv_heads, .head_dim = L->head_dim,
            .scale = 1.0f / sqrtf((float)L->head_dim), .window = L->window, .kv = &L->kv,
            .n_seqs = bt.n_seqs, .seq_tok_start = bt.seq_start, .seq_pos0 = bt.seq_pos0,
            .block_tables = bt.tables[L->group], .block_table_off = bt.boff[L->group],
        };
        struct moe_args ma = {
            .x = m->a, .out = m->tmp, .n_tok = bt.n_tok, .hidden = m->hidden,
            .inter = cfg->moe_intermediate_size, .top_k = cfg->top_k, .ids = m->rids,
            .weights = m->rweights, .experts = L->experts, .expert_first = L->expert_first,
            .n_local = L->n_local, .limit = L->limit_routed,
        };

        r = model__attention_half(m, L, m->hid, &bt, false);
        t1 = now();
        r = r ? r : backend_attention(m->be, &aa);     /* the layer's queries, in m->q */
        r = r ? r : backend_sync(m->be);
        t1 = now() - t1;
        *attn += t1;
        rerun += t1;
        r = r ? r : model__ffn_half(m, L, m->hid, &bt, false);
        if (r >= 0 && L->is_moe && L->n_local > 0) {
            t1 = now();
            r = backend_moe(m->be, &ma);                /* its normed rows and routing */
            r = r ? r : backend_sync(m->be);
            t1 = now() - t1;
            *moe += t1;
            rerun += t1;
        }
    }
    if (r < 0)
        die("prefill layers", r, m);
    t1 = now();
    if (n_rows > 0)
        r = model__trunk_logits(m, m->h_rows, n_rows, b->logits);
    r = r ? r : backend_sync(m->be);
    if (r < 0)
        die("prefill head", r, m);
    *head += now() - t1;
    *tot += now() - t0 - rerun;
}

/* A prompt of c->N tokens in chunks of b->chunk: through model_step (the server's path;
 * time and CPU share), then layer by layer (prefill_split_chunk), each from position 0. */
static void prefill_run(struct bench *b, struct pf_cell *c)
{
    struct step_plan p;
    double t0, c0;
    int rep = b->rep;

    c0 = cpu_now();
    t0 = now();
    for (int pos = 0; pos < c->N; pos += b->chunk) {
        int n = c->N - pos < b->chunk ? c->N - pos : b->chunk;
        int r;

        prefill_plan(b, c->N, pos, n, &p);
        r = model_step(b->m, &p, b->logits);
        if (r < 0)
            die("model_step (prefill)", r, b->m);
    }
    c->t[rep] = now() - t0;
    c->cpu[rep] = (cpu_now() - c0) / (c->t[rep] * b->T);
    c->split[rep] = c->attn[rep] = c->moe[rep] = c->head[rep] = 0;
    for (int pos = 0; c->N <= b->split_max && pos < c->N; pos += b->chunk) {
        int n = c->N - pos < b->chunk ? c->N - pos : b->chunk;

        prefill_plan(b, c->N, pos, n, &p);
        prefill_split_chunk(b, &p, &c->split[rep], &c->attn[rep], &c->moe[rep], &c->head[rep]);
    }
    c->floor[rep] = prefill_floor(b, c, rep);
}

/* min .. max of v[0 .. n) */
static void range(const double *v, int n, double *lo, double *hi)
{
    *lo = *hi = n > 0 ? v[0] : 0;
    for (int i = 1; i < n; i++) {
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
}

/* One piece of the layer-by-layer pass: ms and % of its floor (FLOPs over its peak). */
static void report_piece(const struct bench *b, const char *name, const double *t, double flops,
                         const double *peak)
{
    double ms[MAX_REPS], pct[MAX_REPS];

    for (int r = 0; r < b->reps; r++) {
        ms[r] = 1e3 * t[r];
        pct[r] = peak[r] > 0 && t[r] > 0 ? 100.0 * flops / peak[r] / t[r] : 0;
    }
    printf("    %-62s %9.1f ms  %9.3f GFLOP  %5.1f %% of peak\n", name, median(ms, b->reps),
           flops / 1e9, median(pct, b->reps));
}

static void report_prefill(const struct bench *b)
{
    const struct model *m = b->m;
    const struct bweight *bw = bf16_peak_weight(m);
    double lo, hi;

    range(b->load, b->reps, &lo, &hi);
    printf("\nthreads %d: prefill in chunks of %d tokens, head on the last row; load average "
           "%.2f (%.2f .. %.2f) over %d rounds\n", b->T, b->chunk, median(b->load, b->reps), lo,
           hi, b->reps);
    range(b->peak, b->reps, &lo, &hi);
    printf("  peak, routed experts: %.1f GFLOP/s (%.1f .. %.1f; gemm_peak: backend_matmul on "
           "an expert's gate, %d x %d %s at %d tokens, isa %s)\n", median(b->peak, b->reps) / 1e9,
           lo / 1e9, hi / 1e9, b->peak_rows, m->hidden, b->peak_fmt, MAX_B,
           cpu_isa_name(cpu_isa()));
    range(b->bpeak, b->reps, &lo, &hi);
    printf("  peak, BF16 GEMMs and attention: %.1f GFLOP/s (%.1f .. %.1f; bf16_peak: "
           "backend_matmul on %s, k projection's first %d rows x %d at %d tokens)\n",
           median(b->bpeak, b->reps) / 1e9, lo / 1e9, hi / 1e9,
           bw && cpu_bf16_use_amx(bw) ? (cpu_bf16_fast(cpu_ctx(m->be), bw) ? "AMX-BF16 one-part tiles"
                                                                   : "AMX-BF16 three-part tiles") :
           bw && cpu_bf16_fast(cpu_ctx(m->be), bw) && cpu_bf16_dp_fits(bw) ? "vdpbf16ps" :
           cpu_isa_has(CPU_ISA_AVX512) ? "AVX-512 FMA over widened BF16" :
           cpu_isa_has(CPU_ISA_AVX2) ? "AVX2 FMA over widened BF16" : "scalar code",
           b->bpeak_rows, m->hidden, b->chunk);
    for (int i = 0; i < b->n_pf; i++) {
        const struct pf_cell *c = &b->pfc[i];
        double ms[MAX_REPS], pct[MAX_REPS], pct8[MAX_REPS], rest[MAX_REPS], split[MAX_REPS];
        double pcpu[MAX_REPS];
        double all = c->flops[PF_DENSE] + c->flops[PF_EXPERTS] + c->flops[PF_ATTN] +
                     c->flops[PF_HEAD];
        double fl[MAX_REPS];

        for (int r = 0; r < b->reps; r++) {
            ms[r] = 1e3 * c->t[r];
            fl[r] = 1e3 * c->floor[r];
            pct[r] = 100.0 * c->floor[r] / c->t[r];
            pcpu[r] = c->cpu[r] > 0 ? pct[r] / c->cpu[r] : 0;
            pct8[r] = b->peak[r] > 0 ? 100.0 * all / b->peak[r] / c->t[r] : 0;
            split[r] = 1e3 * c->split[r];
            rest[r] = c->split[r] - c->attn[r] - c->moe[r] - c->head[r];
        }
        range(ms, b->reps, &lo, &hi);
        printf("  prefill %d tokens: %9.1f ms (%.1f .. %.1f) = %.1f tok/s  cpu %.2f  %.1f "
               "GFLOP  floor %.1f ms  %5.1f %% of peak  (%5.1f %% of the expert peak alone; "
               "%5.1f %% of peak per cpu-s)\n", c->N, median(ms, b->reps), lo, hi,
               c->N / (median(ms, b->reps) / 1e3), median(c->cpu, b->reps), all / 1e9,
               median(fl, b->reps), median(pct, b->reps), median(pct8, b->reps),
               median(pcpu, b->reps));
        if (c->N > b->split_max) {
            printf("    layer by layer: not run (--prefill-split-max %d)\n", b->split_max);
            continue;
        }
        printf("    layer by layer: %.1f ms (the pieces timed by a second call each)\n",
               median(split, b->reps));
        report_piece(b, "attention (the kernel; FMA on widened BF16 KV)", c->attn,
                     c->flops[PF_ATTN], b->bpeak);
        report_piece(b, "routed experts (backend_moe)", c->moe, c->flops[PF_EXPERTS], b->peak);
        report_piece(b, "dense (projections, dense MLPs, shared experts, router, norms)", rest,
                     c->flops[PF_DENSE], b->bpeak);
        report_piece(b, "lm_head (the last row)", c->head, c->flops[PF_HEAD], b->bpeak);
    }
}

/* --prefill: per round the probe, both peaks, then each prompt length (prefill_run), on
 * the model as the worker builds it (the split rule of model__split_fit). */
static void bench_prefill(struct bench *b, struct ckpt *ck)
{
    struct step_plan p;

    threads_begin(b, ckpt_config(ck));
    model_build(b, ck);
    b->pf_ids = malloc(sizeof(*b->pf_ids) * (size_t)b->chunk);
    if (!b->pf_ids)
        die("prefill ids", -ENOMEM, NULL);
    {
        /* split steps as stepd-worker decides them (the bench builds with split_any_size) */
        bool any = b->m->o.split_any_size;

        b->m->o.split_any_size = false;
        model__split_fit(b->m);
        b->m->o.split_any_size = any;
    }
    if ((b->m->cfg->sliding_window + b->chunk) / BS + 2 > b->nbs) {
        fprintf(stderr, "bench-shapes: --prefill-chunk %d: the sliding pool holds too few "
                "blocks\n", b->chunk);
        exit(1);
    }
    for (int i = 0; i < b->n_pf; i++) {
        memset(&b->pfc[i], 0, sizeof(b->pfc[i]));
        b->pfc[i].N = b->pf[i];
        prefill_flops(b->m, b->pf[i], b->pfc[i].flops);
    }
    /* untimed: every routed expert's pages, then one chunk (the mapped weights, buffers) */
    for (int l = 0; l < b->m->n_layers; l++)
        if (b->m->layers[l].is_moe)
            experts_fault(&b->m->layers[l]);
    prefill_plan(b, b->chunk, 0, b->chunk, &p);
    if (model_step(b->m, &p, b->logits) < 0)
        die("model_step (prefill)", -EIO, b->m);
    printf("threads %d: split steps %s for the prefill\n", b->T,
           b->m->split_parts > 1 ? "on" : "off");
    for (b->rep = 0; b->rep < b->reps; b->rep++) {
        b->load[b->rep] = load_avg();
        b->bw[b->rep] = bw_probe_once(b->pool, b->arena, b->arena_bytes);
        b->peak[b->rep] = gemm_peak(b);
        b->bpeak[b->rep] = bf16_peak(b);
        for (int i = 0; i < b->n_pf; i++)
            prefill_run(b, &b->pfc[i]);
    }
    report_prefill(b);
    free(b->pf_ids);
    b->pf_ids = NULL;
    model_end(b);
    threads_end(b);
}

/* --formats: per thread count, the models of every format (one MoE layer each) built side by
 * side; per round, format after format: the probe, then that model's MoE layer at each batch
 * (layer_rows: the whole layer and its routed experts, realistic and uniform routing).  The
 * cells carry the format ("[fp8]"); report_formats compares each with the first format. */
static void report_formats(const struct bench *b)
{
    printf("\nthreads %d: per format (median over %d rounds; %% = bytes / that format's probe "
           "of the round / time; x = that %% over %s's in the same round)\n", b->T, b->reps,
           b->formats[0]);
    for (int i = 0; i < b->n_cells; i++) {
        const struct cell *ref = &b->cells[i];
        char base[96], suf[32];
        size_t bl;

        snprintf(suf, sizeof(suf), " [%s]", b->formats[0]);
        bl = strlen(ref->name);
        if (bl < strlen(suf) || strcmp(ref->name + bl - strlen(suf), suf) != 0)
            continue;
        snprintf(base, sizeof(base), "%.*s", (int)(bl - strlen(suf)), ref->name);
        printf("\n  B=%-2d %s\n", ref->B, base);
        for (int f = 0; f < b->n_formats; f++) {
            char name[sizeof(base) + sizeof(suf)];
            const struct cell *c = NULL;
            double t[MAX_REPS], pct[MAX_REPS], x[MAX_REPS], gb[MAX_REPS];
            int n;

            snprintf(name, sizeof(name), "%s [%s]", base, b->formats[f]);
            for (int k = 0; k < b->n_cells && !c; k++)
                if (b->cells[k].B == ref->B && strcmp(b->cells[k].name, name) == 0)
                    c = &b->cells[k];
            if (!c)
                continue;
            n = c->n < ref->n ? c->n : ref->n;
            for (int r = 0; r < n; r++) {
                t[r] = c->t[r] * 1e3;
                gb[r] = c->bytes[r] / 1e9;
                pct[r] = 100.0 * c->floor[r] / c->t[r];
                x[r] = (c->floor[r] / c->t[r]) / (ref->floor[r] / ref->t[r]);
            }
            printf("    %-6s %9.2f ms  %7.3f GB  %5.1f %% of bw  %5.2fx\n", b->formats[f],
                   median(t, n), median(gb, n), median(pct, n), median(x, n));
        }
    }
    printf("\n  probe per format (GB/s, median):");
    for (int f = 0; f < b->n_formats; f++) {
        double v[MAX_REPS];

        for (int r = 0; r < b->reps; r++)
            v[r] = b->fbw[f][r];
        printf(" %s %.2f", b->formats[f], median(v, b->reps));
    }
    printf("\n");
}

static void bench_formats(struct bench *b, struct ckpt **cks)
{
    struct model *ms[MAX_FMT];
    struct backend *bes[MAX_FMT];
    float *rrows[MAX_FMT][64];
    int moe = -1;

    threads_begin(b, ckpt_config(cks[0]));
    for (int f = 0; f < b->n_formats; f++) {
        b->tag = b->formats[f];
        model_build(b, cks[f]);
        ms[f] = b->m;
        bes[f] = b->be;
        memset(rrows[f], 0, sizeof(rrows[f]));
    }
    for (int l = 0; l < ms[0]->n_layers && moe < 0; l++)
        if (ms[0]->layers[l].is_moe)
            moe = l;
    if (moe < 0) {
        fprintf(stderr, "bench-shapes: --formats: the model has no MoE layer\n");
        exit(1);
    }
    /* one untimed layer run per model: its first touches the mapped attention weights and
     * the backend's buffers, which no round should count */
    for (int f = 0; f < b->n_formats; f++) {
        struct batch bt;
        int r;

        b->m = ms[f];
        batch_make(b, 1, CTX_LAYERS, &bt);
        fill_rows(b, b->m->hid, b->m->hidden);
        r = model__layer_forward(b->m, &b->m->layers[moe], b->m->hid, &bt);
        if (r < 0)
            die("layer", r, b->m);
    }
    b->n_cells = 0;
    for (b->rep = 0; b->rep < b->reps; b->rep++)
        for (int f = 0; f < b->n_formats; f++) {
            b->tag = b->formats[f];
            b->m = ms[f];
            b->be = bes[f];
            memcpy(b->rrows, rrows[f], sizeof(rrows[f]));
            b->bw[b->rep] = b->fbw[f][b->rep] = bw_probe_once(b->pool, b->arena, b->arena_bytes);
            b->peak[b->rep] = 0;            /* floors: the read bytes only */
            for (int bi = 0; bi < b->n_batches; bi++) {
                struct batch bt;
                int B = b->batches[bi];

                experts_fault(&b->m->layers[moe]);
                batch_make(b, B, CTX_LAYERS, &bt);
                b->real_distinct[B][b->rep] = 0;
                layer_rows(b, moe, B, &bt);
            }
            memcpy(rrows[f], b->rrows, sizeof(rrows[f]));
        }
    report_formats(b);
    for (int f = 0; f < b->n_formats; f++) {
        b->m = ms[f];
        b->be = bes[f];
        memcpy(b->rrows, rrows[f], sizeof(rrows[f]));
        model_end(b);
    }
    b->tag = NULL;
    threads_end(b);
}

/* --attn-only: attention alone of a full-attention layer at Step-3.7-Flash's shapes (64
 * query heads, 8 KV heads of 128; BF16 KV unless --kv-fp32) on caches of its own, without
 * a model: per thread count and round, the probe, then every batch x context (B sequences
 * decoding one token each, each with blocks of its own where the ~2.2 GB pool holds them,
 * else a shared history but for the last block). */
static void bench_attn_only(struct bench *b)
{
    const int NH = 64, NKV = 8, HD = 128;
    const size_t es = b->kv_f32 ? sizeof(float) : sizeof(uint16_t);
    const double per_block = (double)BS * NKV * HD * 2 * (double)es;
    struct backend_cfg bc = { .n_threads = b->T };
    struct kv_layer kv = { .dtype_f32 = b->kv_f32, .block_size = BS, .n_kv_heads = NKV,
                           .head_dim = HD };
    int32_t start[MAX_B + 1], pos0[MAX_B], boff[MAX_B], *tables;
    float *q, *out;
    int max_nb = 0, r;

    r = backend_new("cpu", &bc, &b->be);
    r = r ? r : cpu_pool_new(b->T, &b->pool);
    if (r < 0)
        die("cpu backend", r, NULL);
    for (int bi = 0; bi < b->n_batches; bi++)
        for (int ci = 0; ci < b->n_ctxs; ci++) {
            const int nb = (b->ctxs[ci] + BS - 1) / BS;
            const int64_t need = (int64_t)b->batches[bi] * nb + MAX_B;

            max_nb = nb > max_nb ? nb : max_nb;
            if (need * per_block <= 2.2e9 && need > kv.n_blocks)
                kv.n_blocks = (int)need;
        }
    kv.n_blocks = kv.n_blocks > max_nb + MAX_B ? kv.n_blocks : max_nb + MAX_B;
    /* through the backend, as the model's caches (huge pages) */
    if (backend_buf_alloc(b->be, (size_t)kv.n_blocks * (size_t)per_block / 2, 64, &kv.k) < 0 ||
        backend_buf_alloc(b->be, (size_t)kv.n_blocks * (size_t)per_block / 2, 64, &kv.v) < 0)
        die("attention caches", -ENOMEM, NULL);
    tables = malloc(sizeof(*tables) * MAX_B * (size_t)max_nb);
    q = malloc(sizeof(float) * MAX_B * NH * HD);
    out = malloc(sizeof(float) * MAX_B * NH * HD);
    if (!kv.k || !kv.v || !tables || !q || !out)
        die("attention caches", -ENOMEM, NULL);
    kv_fill(b, &kv);
    printf("\nthreads %d: attention only, KV %d blocks of %d (%s, %.0f MB)\n", b->T, kv.n_blocks,
           BS, b->kv_f32 ? "FP32" : "BF16", kv.n_blocks * per_block / 1e6);
    b->n_cells = 0;
    for (b->rep = 0; b->rep < b->reps; b->rep++) {
        const double pc0 = cpu_now(), pt0 = now();

        b->bw[b->rep] = bw_probe_once(b->pool, b->arena, b->arena_bytes);
        b->bw_cpu[b->rep] = (cpu_now() - pc0) / ((now() - pt0) * b->T);
        for (int bi = 0; bi < b->n_batches; bi++)
            for (int ci = 0; ci < b->n_ctxs; ci++) {
                const int B = b->batches[bi], ctx = b->ctxs[ci], nb = (ctx + BS - 1) / BS;
                const bool shared = (int64_t)B * nb > kv.n_blocks;
                char name[96];
                double t0, c0, t;

                for (int s = 0; s < B; s++) {
                    for (int j = 0; j < nb; j++)
                        tables[s * nb + j] = shared ? (j < nb - 1 ? j : nb - 1 + s) : s * nb + j;
                    start[s] = s;
                    pos0[s] = ctx - 1;
                    boff[s] = s * nb;
                }
                start[B] = B;
                fill_rows(b, q, (size_t)B * NH * HD);
                struct attn_args aa = {
                    .q = q, .out = out, .n_tok = B, .n_heads = NH, .n_kv_heads = NKV,
                    .head_dim = HD, .scale = 1.0f / sqrtf((float)HD), .kv = &kv, .n_seqs = B,
                    .seq_tok_start = start, .seq_pos0 = pos0, .block_tables = tables,
                    .block_table_off = boff,
                };
                c0 = cpu_now();
                t0 = now();
                r = backend_attention(b->be, &aa);
                t = now() - t0;
                if (r < 0)
                    die("attention", r, NULL);
                b->cpu_share = (cpu_now() - c0) / (t * b->T);
                snprintf(name, sizeof(name), "attention full (%d heads)%s", NH,
                         shared ? " shared history" : "");
                record(b, name, B, ctx, t, (double)B * ctx * NKV * HD * 2.0 * (double)es);
            }
    }
    report(b);
    b->cpu_share = 0;
    free(q);
    free(out);
    free(tables);
    backend_buf_free(b->be, kv.k);
    backend_buf_free(b->be, kv.v);
    backend_free(b->be);
    cpu_pool_free(b->pool);
}

/* bench-shapes' realistic inputs through b->m's real MoE layers: for each batch size and MoE
 * layer, routing_layer_inputs' rows as one run of B tokens (positions pos, slots; the tables
 * of one sequence) must reach exactly the chosen count and route every token to its set.
 * Prints a line per batch size; returns the failures. */
static int routing_check(struct bench *b, const int *Bs, int nB, const int32_t *pos,
                         const int32_t *slots, const int32_t *table)
{
    struct model *m = b->m;
    const int k = m->cfg->top_k;
    int32_t sets[MAX_B * 64], start[2] = { 0, 0 }, zero = 0;
    int bad = 0;

    for (int bi = 0; bi < nB; bi++) {
        const int B = Bs[bi];
        struct batch bt = { .n_tok = B, .n_seqs = 1, .ids = pos, .pos = pos,
                            .seq_start = start, .seq_pos0 = &zero };
        double sum = 0;
        int n = 0, off = 0;

        start[1] = B;
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            bt.slots[g] = slots;
            bt.boff[g] = &zero;
            bt.tables[g] = table;
        }
        for (int l = 0; l < m->n_layers; l++) {
            struct mlayer *L = &m->layers[l];
            float *bias = L->router_bias;
            int d, r;

            if (!L->is_moe)
                continue;
            d = routing_layer_inputs(b, L, l, B, m->hid, sets);
            L->router_bias = NULL;
            r = model__layer_forward(m, L, m->hid, &bt);
            L->router_bias = bias;
            if (r < 0)
                die("layer", r, m);
            for (int t = 0; t < B; t++)
                for (int j = 0; j < k; j++) {
                    bool found = false;

                    for (int q = 0; q < k && !found; q++)
                        found = m->rids[t * k + q] == sets[t * k + j];
                    off += !found;
                }
            bad += distinct_experts(m, B) != d;
            sum += distinct_experts(m, B);
            n++;
        }
        bad += off > 0;
        printf("  constructed inputs, batch %2d: %6.2f distinct experts per MoE layer (target "
               "%.2f), %d of %d token-expert choices off their sets\n", B, sum / n,
               routing_target(m->cfg->n_experts, k, B), off, n * B * k);
    }
    for (int l = 0; l < 64; l++) {     /* the router rows routing_layer_inputs made */
        free(b->rrows[l]);
        b->rrows[l] = NULL;
    }
    return bad;
}

/* --measure-routing MODEL_DIR FILE...: the distinct experts per MoE layer that the model's
 * own router gives at batch 1/4/16/64, measured on real text.  The files' text (tokenized
 * with the model's tokenizer) is cut into segments of MR_SEG tokens (at most MR_NSEG); each
 * segment is prefilled as a sequence of its own through the trunk, keeping every MoE
 * layer's routing of every token.  A draw takes B different segments and a random position
 * in each (B sequences decoding side by side) and counts, per MoE layer, the distinct
 * experts of their union; the table gives the mean over MR_DRAWS draws and the MoE layers
 * beside the uniform expectation N (1 - (1 - k/N)^B).  routing_ratio holds its figures. */
#define MR_SEG 128
#define MR_NSEG 256
#define MR_DRAWS 400

static int measure_routing(struct bench *b, int argc, char **argv)
{
    static const int Bs[] = { 1, 4, 16, 64 };
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = 0 };
    struct backend_cfg bc = { .n_threads = 1 };
    struct err_buf e = { { 0 } };
    struct tok_ids ids = { 0 };
    struct tokenizer *tk = NULL;
    struct ckpt *ck = NULL;
    struct model *m = NULL;
    struct backend *be = NULL;
    char path[4200];
    int32_t *routes = NULL, pos[MR_SEG], slots[MR_SEG], start[2] = { 0, MR_SEG }, zero = 0;
    int32_t table[MR_SEG / BS];
    int nseg, n_moe = 0, N, k, r, bad = 0;

    if (argc < 2) {
        fprintf(stderr, "usage: bench-shapes --measure-routing MODEL_DIR FILE...\n");
        return 2;
    }
    snprintf(path, sizeof(path), "%s/tokenizer.json", argv[0]);
    r = tok_load(path, &tk, &e);
    for (int i = 1; r >= 0 && i < argc; i++) {
        char *text;
        size_t len;

        r = file_read_all(argv[i], 64u << 20, FILE_REGULAR, &text, &len);
        if (r < 0) {
            snprintf(e.msg, sizeof(e.msg), "%s: %s", argv[i], err_str(r));
            break;
        }
        r = tok_encode(tk, text, len, 0, &ids, &e);
        free(text);
    }
    nseg = (int)(ids.n / MR_SEG) < MR_NSEG ? (int)(ids.n / MR_SEG) : MR_NSEG;
    if (r >= 0 && nseg < 64) {
        snprintf(e.msg, sizeof(e.msg), "the files hold %zu tokens, fewer than the 64 segments "
                 "of %d that batch 64 draws from", ids.n, MR_SEG);
        r = -EINVAL;
    }
    r = r < 0 ? r : ckpt_open(argv[0], &co, &ck, &e);
    r = r < 0 ? r : backend_new("cpu", &bc, &be);
    if (r >= 0) {
        struct model_opts mo = {
            .max_tokens_per_step = MR_SEG, .max_seqs = 1, .max_logit_rows = 1,
            .block_size = BS, .n_blocks = { MR_SEG / BS + 1, MR_SEG / BS + 1 },
            .max_seq_len = MR_SEG + BS, .kv_f32 = true,
        };
        r = model_new(ck, be, NULL, &mo, &m, &e);
    }
    if (r < 0) {
        fprintf(stderr, "bench-shapes: --measure-routing: %s\n", *e.msg ? e.msg : err_str(r));
        goto out;
    }
    N = m->cfg->n_experts;
    k = m->cfg->top_k;
    for (int l = 0; l < m->n_layers; l++)
        n_moe += m->layers[l].is_moe;
    if (n_moe == 0 || N > 1024) {
        fprintf(stderr, "bench-shapes: --measure-routing: %s has %s\n", argv[0],
                n_moe ? "more than 1024 experts" : "no MoE layer");
        r = -EINVAL;
        goto out;
    }
    routes = malloc(sizeof(int32_t) * (size_t)n_moe * nseg * MR_SEG * k);
    if (!routes)
        die("routes", -ENOMEM, NULL);
    for (int i = 0; i < MR_SEG; i++) {
        pos[i] = i;
        slots[i] = i;           /* table[j] = j: slot = position */
    }
    for (int j = 0; j < MR_SEG / BS; j++)
        table[j] = j;
    for (int s = 0; s < nseg; s++) {
        const int32_t *tok = ids.ids + (size_t)s * MR_SEG;
        struct step_seq sq = { .n_tokens = MR_SEG, .n_blocks = MR_SEG / BS };
        struct step_plan p = { .n_seqs = 1, .n_tokens = MR_SEG, .seqs = &sq,
                               .tokens = (int32_t *)tok };
        struct batch bt = { .n_tok = MR_SEG, .n_seqs = 1, .ids = tok, .pos = pos,
                            .seq_start = start, .seq_pos0 = &zero };
        int mi = 0;

        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            bt.slots[g] = slots;
            bt.boff[g] = &zero;
            bt.tables[g] = table;
            p.n_block_ids[g] = MR_SEG / BS;
            p.blocks[g] = table;
        }
        r = model__step_inputs(m, &bt, &p, false);
        r = r < 0 ? r : backend_embed(m->be, &m->embed, tok, MR_SEG, m->hid);
        for (int l = 0; r >= 0 && l < m->n_layers; l++) {
            r = model__layer_forward(m, &m->layers[l], m->hid, &bt);
            if (r >= 0 && m->layers[l].is_moe)
                memcpy(routes + ((size_t)mi++ * nseg + s) * MR_SEG * k, m->rids,
                       sizeof(int32_t) * MR_SEG * k);
        }
        if (r < 0)
            die("prefill", r, m);
    }
    printf("bench-shapes --measure-routing: %s (%d experts, top-%d, %d MoE of %d layers), %d "
           "segments of %d tokens, %d draws per batch size\n", argv[0], N, k, n_moe,
           m->n_layers, nseg, MR_SEG, MR_DRAWS);
    printf("  batch  distinct (range over MoE layers)  uniform  measured/uniform\n");
    for (size_t bi = 0; bi < sizeof(Bs) / sizeof(Bs[0]); bi++) {
        const int B = Bs[bi];
        double lo = INFINITY, hi = 0, all = 0, u = routing_uniform(N, k, B);
        int32_t seg[MR_NSEG];

        for (int mi = 0; mi < n_moe; mi++) {
            double sum = 0;

            for (int dr = 0; dr < MR_DRAWS; dr++) {
                uint64_t seen[16] = { 0 };
                int n = 0;

                for (int i = 0; i < nseg; i++)
                    seg[i] = i;
                for (int t = 0; t < B; t++) {
                    int j = t + (int)(rnd(b) % (uint64_t)(nseg - t)), sv = seg[t];
                    const int32_t *id;

                    seg[t] = seg[j];
                    seg[j] = sv;
                    id = routes + (((size_t)mi * nseg + seg[t]) * MR_SEG +
                                   rnd(b) % MR_SEG) * k;
                    for (int q = 0; q < k; q++)
                        if (id[q] >= 0 && id[q] < N && !(seen[id[q] / 64] >> (id[q] % 64) & 1)) {
                            seen[id[q] / 64] |= 1ull << (id[q] % 64);
                            n++;
                        }
                }
                /* what a router can give: k experts at batch 1, at most min(N, B k) */
                if ((B == 1 && n != k) || n > (B * k < N ? B * k : N) || n < k) {
                    fprintf(stderr, "bench-shapes: --measure-routing: %d experts at batch %d, "
                            "top-%d of %d\n", n, B, k, N);
                    bad++;
                }
                sum += n;
            }
            sum /= MR_DRAWS;
            lo = sum < lo ? sum : lo;
            hi = sum > hi ? sum : hi;
            all += sum / n_moe;
        }
        printf("  %5d  %6.2f (%.2f .. %.2f)  %7.2f  %.3f\n", B, all, lo, hi, u, all / u);
        for (size_t i = 0; i < sizeof(routing_ratio) / sizeof(routing_ratio[0]); i++)
            if (routing_ratio[i].B == B && fabs(all / u - routing_ratio[i].ratio) > 0.03) {
                fprintf(stderr, "bench-shapes: --measure-routing: the ratio at batch %d is %.3f, "
                        "routing_ratio holds %.3f: update it\n", B, all / u,
                        routing_ratio[i].ratio);
                bad++;
            }
    }
    b->m = m;
    bad += routing_check(b, Bs, sizeof(Bs) / sizeof(Bs[0]), pos, slots, table);
    b->m = NULL;
    if (bad) {
        fprintf(stderr, "bench-shapes: --measure-routing: %d checks failed\n", bad);
        r = -EPROTO;
    }
out:
    free(routes);
    model_free(m);
    if (be)
        backend_free(be);
    ckpt_close(ck);
    tok_ids_done(&ids);
    tok_free(tk);
    return r < 0 ? 1 : 0;
}

/* the probe's arena: STEPD_BENCH_MB MiB (default 1024), filled; 0 or -ENOMEM */
static int arena_new(struct bench *b)
{
    const char *env = getenv("STEPD_BENCH_MB");

    b->arena_bytes = (size_t)(env ? strtoul(env, NULL, 10) : 1024) << 20;
    b->arena = aligned_alloc(4096, b->arena_bytes);
    if (!b->arena) {
        fprintf(stderr, "bench-shapes: cannot allocate the probe's arena\n");
        return -ENOMEM;
    }
    for (size_t i = 0; i < b->arena_bytes; i++)
        b->arena[i] = (uint8_t)(i * 2654435761u >> 13);
    return 0;
}

/* --formats LIST: each of mxfp4, fp8, nvfp4, bf16 at most once; 0 or -1 */
static int parse_formats(struct bench *b, const char *s)
{
    static const char *const known[] = { "mxfp4", "fp8", "nvfp4", "bf16" };

    b->n_formats = 0;
    while (*s) {
        size_t n = strcspn(s, ",");
        int k = -1;

        for (int i = 0; i < MAX_FMT && k < 0; i++)
            if (strlen(known[i]) == n && strncmp(s, known[i], n) == 0)
                k = i;
        for (int i = 0; k >= 0 && i < b->n_formats; i++)
            if (b->formats[i] == known[k])
                k = -1;
        if (k < 0) {
            fprintf(stderr, "bench-shapes: --formats '%.*s': expected each of mxfp4, fp8, nvfp4 "
                    "or bf16 at most once\n", (int)n, s);
            return -1;
        }
        b->formats[b->n_formats++] = known[k];
        s += n + (s[n] == ',');
    }
    return b->n_formats > 0 ? 0 : -1;
}

/* --formats: the models (--mkmodel: one MoE layer, the real layer 3, in each format in a
 * temporary directory, embedding and heads sparse as no row reads them; --model DIR: DIR/F),
 * opened side by side, then bench_formats per thread count */
static int bench_formats_main(struct bench *b)
{
    const char *td = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    struct ckpt *cks[MAX_FMT];
    char tmp[4096] = "", dir[MAX_FMT][4200];
    struct err_buf e = { { 0 } };
    int r;

    if (!b->model_dir) {
        snprintf(tmp, sizeof(tmp), "%s/stepd-bench-shapes-XXXXXX", td);
        if (!mkdtemp(tmp)) {
            fprintf(stderr, "bench-shapes: mkdtemp %s: %s\n", tmp, strerror(errno));
            return 1;
        }
    }
    for (int f = 0; f < b->n_formats; f++) {
        snprintf(dir[f], sizeof(dir[f]), "%s/%s", b->model_dir ? b->model_dir : tmp,
                 b->formats[f]);
        if (!b->model_dir) {
            char *av[] = { (char *)b->mkmodel, "--real-layers", "3", "--mtp", "0", "--format",
                           (char *)b->formats[f], "--sparse", "embed,heads", "--out", dir[f],
                           NULL };
            double t0 = now();

            if (run_model(b->mkmodel, av) < 0) {
                fprintf(stderr, "bench-shapes: %s --format %s failed\n", b->mkmodel,
                        b->formats[f]);
                return 1;
            }
            printf("bench-shapes: %s model made in %.1f s\n", b->formats[f], now() - t0);
        }
    }
    if (arena_new(b) < 0)
        return 1;
    for (int f = 0; f < b->n_formats; f++) {
        struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = 0 };

        r = ckpt_open(dir[f], &co, &cks[f], &e);
        if (r < 0) {
            fprintf(stderr, "bench-shapes: %s: %s\n", dir[f], e.msg);
            return 1;
        }
    }
    for (int i = 0; i < b->n_threads; i++) {
        b->T = b->threads[i];
        bench_formats(b, cks);
    }
    for (int f = 0; f < b->n_formats; f++)
        ckpt_close(cks[f]);
    if (*tmp && !b->keep) {
        char *av[] = { "/bin/rm", "-rf", tmp, NULL };
        run_model("/bin/rm", av);
    } else if (*tmp) {
        printf("bench-shapes: models kept in %s\n", tmp);
    }
    free(b->arena);
    return 0;
}

int main(int argc, char **argv)
{
    struct bench *b = calloc(1, sizeof(*b));
    char tmp[4096] = "";
    struct ckpt *ck;
    struct err_buf e = { { 0 } };
    bool batches_set = false;
    int r;

    setvbuf(stdout, NULL, _IOLBF, 0);
    b->rng = 0x9e3779b97f4a7c15ull;
    if (argc > 1 && strcmp(argv[1], "--measure-routing") == 0) {
        r = measure_routing(b, argc - 2, argv + 2);
        free(b);
        return r;
    }
    b->threads[0] = 1, b->threads[1] = 2, b->n_threads = 2;
    b->batches[0] = 1, b->batches[1] = 4, b->batches[2] = 16, b->batches[3] = 64;
    b->n_batches = 4;
    b->ctxs[0] = 1024, b->ctxs[1] = 8192, b->ctxs[2] = 32768, b->n_ctxs = 3;
    b->reps = 5;
    b->dv = 32768;
    b->chunk = KVPLAN_DEFAULT_MAX_BATCHED_TOKENS;   /* the engine's default chunk */
    b->split_max = 131072;
    b->cpu_min_s = CPU_MIN_S;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;

        if (strcmp(a, "--keep") == 0) {
            b->keep = true;
            continue;
        }
        if (strcmp(a, "--ab-attn") == 0) {
            b->ab_attn = true;
            continue;
        }
        if (strcmp(a, "--attn-only") == 0) {
            b->attn_only = true;
            continue;
        }
        if (strcmp(a, "--bf16-exact") == 0) {
            cpu_bf16_fast_off = 1;
            continue;
        }
        if (strcmp(a, "--kv-fp32") == 0) {     /* the worker's --kv-cache-dtype fp32 */
            b->kv_f32 = true;
            continue;
        }
        if (!v)
            ok = 0;
        else if (strcmp(a, "--mkmodel") == 0)
            b->mkmodel = v;
        else if (strcmp(a, "--model") == 0)
            b->model_dir = v;
        else if (strcmp(a, "--threads") == 0)
            ok = (b->n_threads = parse_list(v, b->threads, MAX_LIST)) > 0;
        else if (strcmp(a, "--batches") == 0)
            ok = (b->n_batches = parse_list(v, b->batches, MAX_LIST)) > 0;
        else if (strcmp(a, "--contexts") == 0)
            ok = (b->n_ctxs = parse_list(v, b->ctxs, MAX_LIST)) > 0;
        else if (strcmp(a, "--reps") == 0)
            ok = (b->reps = atoi(v)) >= 1 && b->reps <= MAX_REPS;
        else if (strcmp(a, "--draft-vocab") == 0)
            ok = (b->dv = atoi(v)) >= 0 && b->dv % 64 == 0;
        else if (strcmp(a, "--formats") == 0)
            ok = parse_formats(b, v) == 0;
        else if (strcmp(a, "--prefill") == 0)
            ok = (b->n_pf = parse_list(v, b->pf, MAX_LIST)) > 0;
        else if (strcmp(a, "--prefill-chunk") == 0)
            ok = (b->chunk = atoi(v)) >= 1 && b->chunk <= 8192;
        else if (strcmp(a, "--prefill-split-max") == 0)
            ok = (b->split_max = atoi(v)) >= 0;
        else if (strcmp(a, "--cpu-min-ms") == 0)
            ok = (b->cpu_min_s = atof(v) * 1e-3) >= 0.0 && b->cpu_min_s <= 1.0;
        else
            ok = 0;
        batches_set |= strcmp(a, "--batches") == 0;
        for (int k = 0; ok && k < b->n_batches; k++)
            ok = b->batches[k] <= MAX_B;
        for (int k = 0; ok && strcmp(a, "--contexts") == 0 && k < b->n_ctxs; k++)
            ok = b->ctxs[k] >= 1024 && b->ctxs[k] <= 262144;
        for (int k = 0; ok && k < b->n_threads; k++)
            ok = b->threads[k] <= 127;
        for (int k = 0; ok && k < b->n_pf; k++)
            ok = b->pf[k] <= 131072;
        if (!ok) {
            fprintf(stderr, "usage: bench-shapes --mkmodel PATH | --model DIR [--threads 1,2] "
                            "[--batches 1,4,16,64 (<= %d)] [--contexts 1024,8192,32768] [--reps N "
                            "(1..%d)] [--keep] [--ab-attn] [--kv-fp32] [--draft-vocab N] [--formats "
                            "mxfp4,fp8,nvfp4,bf16] [--prefill N,... (<= 131072) [--prefill-chunk "
                            "N (1..8192)] [--prefill-split-max N]] [--cpu-min-ms MS (0..1000)] | --attn-only | --measure-routing MODEL_DIR FILE...\n",
                    MAX_B, MAX_REPS);
            return 2;
        }
        i++;
    }
    if (!b->model_dir && !b->mkmodel && !b->attn_only) {
        fprintf(stderr, "bench-shapes: --mkmodel PATH, --model DIR or --attn-only is required\n");
        return 2;
    }
    if ((b->n_formats > 0) + b->attn_only + (b->n_pf > 0) > 1) {
        fprintf(stderr, "bench-shapes: --formats, --attn-only and --prefill exclude each other\n");
        return 2;
    }
    if (b->n_pf > 0) {
        /* one sequence at each prompt length: the KV pools and tables sized for it */
        b->batches[0] = 1;
        b->n_batches = 1;
        memcpy(b->ctxs, b->pf, sizeof(b->ctxs));
        b->n_ctxs = b->n_pf;
        b->dv = 0;
    }
    if (b->n_formats > 0 && !batches_set) {
        b->batches[0] = 1, b->batches[1] = 16;
        b->n_batches = 2;
    }
    if (b->n_formats > 0)
        b->n_ctxs = 0;          /* the layer rows' context only (CTX_LAYERS) */
    printf("bench-shapes: CPU isa %s (host %s), %ld online CPUs, MemAvailable %ld MiB\n",
           cpu_isa_name(cpu_isa()), cpu_isa_name(cpu_isa_host()), sysconf(_SC_NPROCESSORS_ONLN),
           mem_available_mb());
    if (b->n_formats > 0)
        return bench_formats_main(b);
    if (!b->model_dir && !b->attn_only) {
        const char *td = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        char out[4200];
        double t0 = now();

        snprintf(tmp, sizeof(tmp), "%s/stepd-bench-shapes-XXXXXX", td);
        if (!mkdtemp(tmp)) {
            fprintf(stderr, "bench-shapes: mkdtemp %s: %s\n", tmp, strerror(errno));
            return 1;
        }
        snprintf(out, sizeof(out), "%s/model", tmp);
        char *av[] = { (char *)b->mkmodel, "--layers", "4", "--mtp", b->n_pf ? "0" : "1", "--out",
                       out, NULL };
        r = run_model(b->mkmodel, av);
        if (r < 0) {
            fprintf(stderr, "bench-shapes: %s failed\n", b->mkmodel);
            return 1;
        }
        printf("bench-shapes: model made in %.1f s\n", now() - t0);
        b->model_dir = strdup(out);
    }
    if (arena_new(b) < 0)
        return 1;
    if (b->attn_only) {
        for (int i = 0; i < b->n_threads; i++) {
            b->T = b->threads[i];
            bench_attn_only(b);
        }
        free(b->arena);
        return 0;
    }
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = 0, .headers_only = true };
    /* one MTP depth where the checkpoint has MTP layers (a trunk-only one: none) */
    r = ckpt_open(b->model_dir, &co, &ck, &e);
    if (r >= 0) {
        co.mtp_depth = ckpt_config(ck)->n_mtp_layers > 0 && b->n_pf == 0;
        co.headers_only = false;
        ckpt_close(ck);
        r = ckpt_open(b->model_dir, &co, &ck, &e);
    }
    if (r < 0) {
        fprintf(stderr, "bench-shapes: %s: %s\n", b->model_dir, e.msg);
        return 1;
    }
    for (int i = 0; i < b->n_threads; i++) {
        b->T = b->threads[i];
        if (b->n_pf > 0)
            bench_prefill(b, ck);
        else
            bench_threads(b, ck);
    }
    ckpt_close(ck);
    if (*tmp && !b->keep) {
        char *av[] = { "/bin/rm", "-rf", tmp, NULL };
        run_model("/bin/rm", av);
    } else if (*tmp) {
        printf("bench-shapes: model kept in %s\n", b->model_dir);
    }
    free(b->arena);
    return 0;
}
