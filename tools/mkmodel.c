/* mkmodel.c - stepd-mkmodel: synthetic Step-3.7-Flash-shaped checkpoints with random,
 * well-scaled weights, in the real checkpoint format (the shape reference of the
 * performance work).
 *
 *   stepd-mkmodel --out DIR [--preset full|narrow8] [--layers L | --real-layers LIST]
 *                 [--mtp D] [--seed S] [--shards N | --shard-size BYTES] [--sparse LIST]
 *                 [--threads T] [--tokenizer PATH] [--force]
 *                 [--hidden H] [--intermediate I] [--moe-inter M] [--shared-inter S]
 *                 [--experts E] [--top-k K] [--vocab V] [--head-dim D] [--window W]
 *                 [--format bf16|fp8|nvfp4|mxfp4]
 *
 * Format: exactly what the loader reads for the real model (ckptw writes the nested
 * Step-3.7 config.json with its quantization_config; the tensor list is ckptw_layout's,
 * the real one of test/data/step37-mxfp4-expected-tensors.tsv): sharded safetensors +
 * model.safetensors.index.json, routed experts as MXFP4 (U8 E2M1 nibbles [out, in/2] +
 * U8 E8M0 scales [out, in/32]) or, with --format, BF16 / block-FP8 stacked
 * [experts, out, in] per projection, NVFP4 per expert (docs/MODEL.md §5); router bias
 * F32, everything else BF16.
 *
 * Layers: generated layer i is a copy of real layer map[i] (kind, head count, RoPE,
 * dense or MoE, SwiGLU clamps); MTP layer L+k of real layer 45+k.  --layers L picks
 * map = 0..L-1 (the real prefix) for L >= 5; below that the real prefix has no MoE
 * layer of both attention kinds, so L < 5 takes the first L of the real layers
 * {3, 0, 4, 1} (MoE/sliding, dense/full, MoE/full, dense/sliding), in ascending order:
 * L=3 -> {0, 3, 4}.  --real-layers picks any list.
 *
 * Scaling (the residual stream's rms stays near 1): embeddings N(0, 1); every
 * projection that reads a normalised or unit-variance input N(0, 1/fan_in); the
 * projections that write the residual (o_proj, the MLP/shared-expert/expert down_proj)
 * are scaled so that each of the 2L sub-layers adds variance RESID_GROWTH/(2L) for the
 * first token (later tokens average their values and add less): the rms goes from 1 to
 * at most ~sqrt(1 + RESID_GROWTH).  Norm weights (Gemma-style, y = x*r*(1+w): neutral
 * w = 0) are N(0, NORM_STD^2); the router N(0, 1/H) (logits ~ N(0, 1), tokens spread
 * over the experts), its selection bias N(0, BIAS_STD^2).
 *
 * Data are drawn directly: BF16/F32 from a 65536-entry Gaussian quantile table, MXFP4
 * codes as the quantisation of N(0, CODE_RHO^2) onto the E2M1 grid (two nibbles per
 * 16-bit draw), the scale of each 32-block E8M0 2^e with e one of the two exponents
 * around the matrix's target std (chosen per block so that the mean square matches):
 * the distribution float->quantise would give for Gaussian weights, without the floats.
 * Every CHUNK bytes of a tensor come from their own xoshiro256** stream keyed by (seed,
 * tensor name, chunk index), so the bytes depend on the seed only (not on --threads or
 * the shard split), and chunks are generated in parallel and written with pwrite.
 *
 * Special ids: the real BOS 0 and EOS 1, 2, 128007 that fit the vocabulary; with
 * --tokenizer DIR holding a config.json, that model's (narrow8 with models/tiny-step:
 * vocab 4096, BOS 0, EOS 5, 2).
 *
 * --sparse: listed tensors are not written; their data regions are holes (the file is
 * extended with ftruncate), which read as zeros: the loader plans and maps them like
 * any other (BF16 0.0; MXFP4 code 0 with scale byte 0 = 2^-127, i.e. 0.0).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "ckptw.h"
#include "cli.h"
#include "clock.h"
#include "config.h"
#include "vision-tensors.h"
#include "file.h"
#include "loader.h"
#include "mxfp4.h"
#include "splitmix.h"
#include "stepd-config.h"

#define REAL_LAYERS 45          /* trunk layers of Step-3.7-Flash */
#define REAL_MTP 3              /* its MTP layers, 45..47 */
#define CHUNK (4u << 20)        /* bytes per random stream: part of what a seed means */
#define RESID_GROWTH 0.5        /* variance the trunk adds to the unit residual stream */
#define NORM_STD 0.02
#define BIAS_STD 0.01
#define CODE_RHO 2.0            /* E2M1 codes ~ quantised N(0, CODE_RHO^2) (block std / scale) */
#define E_SIG2 0.29327          /* E[sigmoid(z)^2], z ~ N(0,1): the head-wise gate */
#define E_SILU2 0.35531         /* E[silu(u)^2], u ~ N(0,1): SwiGLU with unit gate and up */
#define MAX_THREADS 64

enum fill_kind { FILL_BF16, FILL_F32, FILL_CODES, FILL_SCALES, FILL_FP8, FILL_BYTE, FILL_CONST_F32 };
#define FP8_RHO 64.0           /* E4M3 codes ~ quantised N(0, FP8_RHO^2) (std / scale_inv) */
#define NV_SCALE_BYTE 0x68     /* NVFP4 group scales: E4M3 64.0; weight_scale_2 sets the std */

/* how one tensor's data are drawn */
struct fill {
    enum fill_kind kind;
    float sigma;                /* BF16/F32: std of the values; FILL_CONST_F32: the value */
    uint8_t scale_lo;           /* FILL_SCALES: E8M0 byte e0 + 127 ...; FILL_BYTE: the byte */
    uint32_t p_hi;              /* ... or e0 + 128 when a 16-bit draw is below p_hi */
    bool hole;
};

struct job {
    int fd;
    int64_t off;                /* file offset */
    uint32_t len, chunk;
    size_t entry;
};

struct mk {
    /* options */
    const char *out, *tokenizer;
    bool narrow, force;
    int n_layers, n_mtp, map[MODEL_MAX_LAYERS], n_shards, threads;
    int64_t shard_size;
    uint64_t seed;
    int hidden, inter, moe_inter, shared_inter, experts, top_k, vocab, head_dim, window;
    bool sparse_all, sparse_embed, sparse_heads, sparse_experts;
    int sparse_experts_from;    /* experts with index >= this are holes (INT_MAX: none) */
    enum quant_scheme format;   /* --format: the routed experts' (the rest BF16) */
    int vision_layers;          /* --vision L: the full-width tower with L blocks (0: none) */

    struct model_config cfg;
    struct ckptw_entry *ents;
    size_t n_ents;
    struct fill *fills;
    struct job *jobs;
    size_t n_jobs;
    atomic_size_t next_job;
    atomic_int err;
    int err_entry;
};

static float unit_normal[65536];    /* quantiles of N(0,1) at (i + 0.5) / 65536 */
static uint8_t code_pair[65536];    /* two E2M1 codes (low nibble first) per 16-bit draw */
static uint8_t fp8_code[65536];     /* E4M3 code of unit_normal[i] * FP8_RHO */
static double code_m2;              /* E[value^2] of those codes */

/* ---------------------------------------------------------------- random -- */

struct rng {
    uint64_t s[4];
};

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* xoshiro256** */
static inline uint64_t rng_next(struct rng *r)
{
    uint64_t *s = r->s, res = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;

    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return res;
}

static void rng_seed(struct rng *r, uint64_t seed, const char *name, uint32_t chunk)
{
    uint64_t h = 1469598103934665603ull, x;

    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char) *p) * 1099511628211ull;
    x = splitmix64(splitmix64(seed) ^ h) ^ splitmix64((uint64_t) chunk + 0x5851f42d4c957f2dull);
    for (int i = 0; i < 4; i++)
        r->s[i] = x = splitmix64(x);
}

/* Inverse of the standard normal CDF (Acklam's rational approximation, then one Halley
 * step on erfc): |error| < 1e-12 over (0, 1). */
static double norm_inv(double p)
{
    static const double a[6] = { -3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                                 1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00 };
    static const double b[5] = { -5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                                 6.680131188771972e+01, -1.328068155288572e+01 };
    static const double c[6] = { -7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                                 -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00 };
    static const double d[4] = { 7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                                 3.754408661907416e+00 };
    double q, x, u, err;

    if (p < 0.02425 || p > 1 - 0.02425) {
        q = sqrt(-2 * log(p < 0.5 ? p : 1 - p));
        x = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
        if (p > 0.5)
            x = -x;
    } else {
        double r;
        q = p - 0.5;
        r = q * q;
        x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
            (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
    }
    err = 0.5 * erfc(-x / sqrt(2.0)) - p;
    u = err * sqrt(2 * M_PI) * exp(x * x / 2);
    return x - u / (1 + x * u / 2);
}

static void tables_init(void)
{
    uint8_t nib[256];
    double m2 = 0;

    for (int i = 0; i < 65536; i++)
        unit_normal[i] = (float) norm_inv((i + 0.5) / 65536.0);
    for (int j = 0; j < 256; j++) {
        double x = CODE_RHO * norm_inv((j + 0.5) / 256.0);
        unsigned c = mxfp4_e2m1_nearest((float) fmin(fabs(x), 6.0));
        nib[j] = (uint8_t) (c | (x < 0 ? 8u : 0u));
        m2 += (double) mxfp4_e2m1_value(c) * mxfp4_e2m1_value(c) / 256.0;
    }
    for (int i = 0; i < 65536; i++)
        code_pair[i] = (uint8_t) (nib[i & 255] | (nib[i >> 8] << 4));
    for (int i = 0; i < 65536; i++)
        fp8_code[i] = fp8_e4m3_nearest(unit_normal[i] * (float) FP8_RHO);
    code_m2 = m2;
}

static inline uint16_t f32_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t) (u >> 16);
}

/* bytes [chunk * CHUNK, + len) of entry's data into buf */
static void fill_chunk(const struct mk *m, const struct fill *f, const char *name, uint32_t chunk,
                       uint8_t *buf, uint32_t len)
{
    struct rng r;
    uint32_t i = 0;

    rng_seed(&r, m->seed, name, chunk);
    switch (f->kind) {
    case FILL_BF16:
        for (; i < len; i += 8) {
            uint64_t x = rng_next(&r);
            for (int k = 0; k < 4 && i + 2 * k < len; k++) {
                uint16_t h = f32_bf16(unit_normal[(x >> (16 * k)) & 0xffff] * f->sigma);
                buf[i + 2 * k] = (uint8_t) h;
                buf[i + 2 * k + 1] = (uint8_t) (h >> 8);
            }
        }
        break;
    case FILL_F32:
        for (; i < len; i += 4) {
            float v = unit_normal[rng_next(&r) & 0xffff] * f->sigma;
            memcpy(buf + i, &v, 4);
        }
        break;
    case FILL_CODES:
        for (; i < len; i += 4) {
            uint64_t x = rng_next(&r);
            for (int k = 0; k < 4 && i + k < len; k++)
                buf[i + k] = code_pair[(x >> (16 * k)) & 0xffff];
        }
        break;
    case FILL_FP8:
        for (; i < len; i += 4) {
            uint64_t x = rng_next(&r);
            for (int k = 0; k < 4 && i + k < len; k++)
                buf[i + k] = fp8_code[(x >> (16 * k)) & 0xffff];
        }
        break;
    case FILL_BYTE:
        memset(buf, f->scale_lo, len);
        break;
    case FILL_CONST_F32:
        for (; i + 4 <= len; i += 4)
            memcpy(buf + i, &f->sigma, 4);
        break;
    case FILL_SCALES:
        for (; i < len; i += 4) {
            uint64_t x = rng_next(&r);
            for (int k = 0; k < 4 && i + k < len; k++)
                buf[i + k] = (uint8_t) (f->scale_lo + (((x >> (16 * k)) & 0xffff) < f->p_hi));
        }
        break;
    }
}

/* ---------------------------------------------------------------- config -- */

static const int small_pick[4] = { 3, 0, 4, 1 };

static void default_map(int L, int *map)
{
    if (L >= 5) {
        for (int i = 0; i < L; i++)
            map[i] = i;
        return;
    }
    for (int i = 0; i < L; i++)
        map[i] = small_pick[i];
    for (int i = 1; i < L; i++)         /* ascending */
        for (int j = i; j > 0 && map[j - 1] > map[j]; j--) {
            int t = map[j];
            map[j] = map[j - 1];
            map[j - 1] = t;
        }
}

/* --tokenizer DIR with a config.json: its special ids replace the real ones (the ids must
 * match the tokenizer that is copied) */
static int tokenizer_ids(struct mk *m, struct err_buf *e)
{
    struct model_config tc;
    struct stat st;
    char path[PATH_MAX + 16];
    int r;

    if (!m->tokenizer || stat(m->tokenizer, &st) < 0 || !S_ISDIR(st.st_mode))
        return 0;
    snprintf(path, sizeof(path), "%s/config.json", m->tokenizer);
    if (access(path, R_OK) != 0)
        return 0;
    r = model_config_load(path, &tc, e);
    if (r < 0) {
        err_prefix(e, "--tokenizer %s", m->tokenizer);
        return r;
    }
    if (tc.vocab_size > m->cfg.vocab_size)
        return err_set(e, -EINVAL, "--tokenizer %s: its model has %d token ids, more than the vocab size %d",
                       m->tokenizer, tc.vocab_size, m->cfg.vocab_size);
    m->cfg.bos_token_id = tc.bos_token_id;
    m->cfg.n_eos = tc.n_eos;
    memcpy(m->cfg.eos_token_ids, tc.eos_token_ids, sizeof(tc.eos_token_ids));
    return 0;
}

static int build_config(struct mk *m, struct err_buf *e)
{
    struct model_config full, *c = &m->cfg;
    int n_eos = 0;

    ckptw_config_step37(&full);
    *c = full;
    c->n_layers = m->n_layers;
    c->n_mtp_layers = m->n_mtp;
    c->n_layers_total = m->n_layers + m->n_mtp;
    for (int i = 0; i < m->n_layers; i++)
        c->layers[i] = full.layers[m->map[i]];
    for (int k = 0; k < m->n_mtp; k++)
        c->layers[m->n_layers + k] = full.layers[REAL_LAYERS + k];
    if (m->narrow) {
        c->hidden_size = 256;
        c->intermediate_size = 768;
        c->n_experts = 32;
        c->moe_intermediate_size = 128;
        c->shared_expert_dim = 128;
        c->vocab_size = 4096;
    }
    if (m->hidden)
        c->hidden_size = m->hidden;
    if (m->inter)
        c->intermediate_size = m->inter;
    if (m->moe_inter)
        c->moe_intermediate_size = m->moe_inter;
    if (m->shared_inter)
        c->shared_expert_dim = m->shared_inter;
    if (m->experts)
        c->n_experts = m->experts;
    if (m->top_k)
        c->top_k = m->top_k;
    if (m->vocab)
        c->vocab_size = m->vocab;
    if (m->window)
        c->sliding_window = m->window;
    if (m->head_dim) {
        for (int i = 0; i < c->n_layers_total; i++) {
            struct layer_config *L = &c->layers[i];
            int64_t rd = (int64_t) L->rotary_dims * m->head_dim;
            if (rd % L->head_dim || (rd / L->head_dim) % 2)
                return err_set(e, -EINVAL, "--head-dim %d: layer %d rotates %d of %d dims, which is not an even number of %d",
                               m->head_dim, i, L->rotary_dims, L->head_dim, m->head_dim);
            L->rotary_dims = (int) (rd / L->head_dim);
            L->head_dim = m->head_dim;
        }
        c->head_dim = m->head_dim;
    }
    model_config_set_quant(c, m->format);
    if (m->format != QUANT_NONE && (c->hidden_size % c->quant_group_size || c->moe_intermediate_size % c->quant_group_size))
        return err_set(e, -EINVAL, "%s experts need --hidden (%d) and --moe-inter (%d) divisible by %d",
                       quant_scheme_name(m->format), c->hidden_size, c->moe_intermediate_size, c->quant_group_size);
    if (c->top_k > c->n_experts)
        return err_set(e, -EINVAL, "--top-k %d is more than the %d experts", c->top_k, c->n_experts);
    /* the real stop ids that fit the vocabulary */
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] < c->vocab_size)
            c->eos_token_ids[n_eos++] = c->eos_token_ids[i];
    c->n_eos = n_eos;
    if (c->bos_token_id >= c->vocab_size)
        c->bos_token_id = -1;
    return tokenizer_ids(m, e);
}

/* ----------------------------------------------------------------- fills -- */

static bool ends_with(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

/* expert index of "...moe.experts.N.", or -1 */
static int expert_of(const char *name)
{
    const char *p = strstr(name, ".moe.experts.");
    return p ? atoi(p + 13) : -1;
}

/* E8M0 bytes whose 2^e gives codes of E[c^2] = code_m2 a mean square of sigma^2 */
static void scale_fill(float sigma, struct fill *f)
{
    double x = log2(sigma / sqrt(code_m2)), p;
    int e0 = (int) floor(x);

    p = (pow(4.0, x - e0) - 1) / 3;     /* P(e0 + 1): p 4^(e0+1) + (1-p) 4^e0 = 4^x */
    if (e0 + 127 < 0)
        e0 = -127, p = 0;
    if (e0 + 128 > 254)
        e0 = 126, p = 1;
    f->kind = FILL_SCALES;
    f->scale_lo = (uint8_t) (e0 + 127);
    f->p_hi = (uint32_t) lround(p * 65536.0);
}

static int plan_fill(const struct mk *m, const struct ckptw_entry *t, struct fill *f, struct err_buf *e)
{
    const struct model_config *c = &m->cfg;
    const double t2 = RESID_GROWTH / (2.0 * c->n_layers);    /* variance each sub-layer adds */
    const bool quantised = t->kind == CKPTW_PACKED || t->kind == CKPTW_SCALE || t->kind == CKPTW_FP8 ||
                           t->kind == CKPTW_FP8_SCALE || t->kind == CKPTW_NV_PACKED ||
                           t->kind == CKPTW_NV_SCALE || t->kind == CKPTW_NV_GSCALE;
    const double fan_in = quantised || t->stack ? (double) t->lin : t->ndim == 2 ? (double) t->shape[1] : 1.0;
    const char *n = t->base[0] ? t->base : t->name;    /* the logical tensor */
    double s;
    int ex = t->stack ? 0 : expert_of(n);

    memset(f, 0, sizeof(*f));
    f->kind = FILL_BF16;
    if (vision_name_is(n, NULL))
        /* the vision tower (for timing): matrices and convolutions 1/sqrt(fan-in), vectors
         * and the position table small */
        s = t->ndim >= 2 ? 1.0 / sqrt((double) (ckptw_tensor_bytes(t->dtype, t->ndim, t->shape) / 2 / t->shape[0]))
                         : NORM_STD;
    else if (strcmp(n, "model.embed_tokens.weight") == 0)
        s = 1.0;
    else if (ends_with(n, "norm.weight"))
        s = NORM_STD;
    else if (ends_with(n, ".moe.router_bias"))
        f->kind = FILL_F32, s = BIAS_STD;
    else if (ends_with(n, ".self_attn.o_proj.weight"))
        s = sqrt(t2 / (fan_in * E_SIG2));
    else if (ends_with(n, ".mlp.down_proj.weight"))
        s = sqrt(t2 / (fan_in * E_SILU2));
    else if (ends_with(n, ".share_expert.down_proj.weight"))
        s = sqrt(t2 / 2 / (fan_in * E_SILU2));
    else if (ex >= 0 && ends_with(n, ".down_proj.weight"))
        /* k routed experts weighted ~f/k each: variance k (f/k)^2 v = t2/2 */
        s = sqrt(t2 / 2 * c->top_k / ((double) c->router_scaling_factor * c->router_scaling_factor) /
                 (fan_in * E_SILU2));
    else if (ends_with(n, "_proj.weight") || ends_with(n, "_proj.weight_packed") ||
             ends_with(n, "_proj.weight_scale") || ends_with(n, ".moe.gate.weight") ||
             strcmp(n, "lm_head.weight") == 0 || ends_with(n, ".shared_head.output.weight"))
        s = 1.0 / sqrt(fan_in);         /* reads a normalised (unit rms) input */
    else
        return err_set(e, -EINVAL, "no fill rule for tensor '%s'", n);

    f->sigma = (float) s;
    if (t->kind == CKPTW_PACKED || t->kind == CKPTW_NV_PACKED)
        f->kind = FILL_CODES;
    else if (t->kind == CKPTW_SCALE)
        scale_fill((float) s, f);
    else if (t->kind == CKPTW_FP8)
        f->kind = FILL_FP8;
    else if (t->kind == CKPTW_FP8_SCALE)
        f->kind = FILL_CONST_F32, f->sigma = (float) (s / FP8_RHO);
    else if (t->kind == CKPTW_NV_SCALE)
        f->kind = FILL_BYTE, f->scale_lo = NV_SCALE_BYTE;
    else if (t->kind == CKPTW_NV_GSCALE)
        f->kind = FILL_CONST_F32, f->sigma = (float) (s / sqrt(code_m2) / fp8_e4m3_value(NV_SCALE_BYTE));
    else if (t->kind != CKPTW_DENSE && t->kind != CKPTW_F32)
        return err_set(e, -EINVAL, "tensor '%s': unexpected kind %d", t->name, t->kind);

    f->hole = m->sparse_all ||
              (m->sparse_embed && strcmp(n, "model.embed_tokens.weight") == 0) ||
              (m->sparse_heads && (strcmp(n, "lm_head.weight") == 0 || ends_with(n, ".shared_head.output.weight"))) ||
              (ex >= 0 && (m->sparse_experts || ex >= m->sparse_experts_from));
    /* stacked experts are one tensor: a hole with --sparse experts (experts-from:N holes
     * them only for N = 0; otherwise they are written whole) */
    return 0;
}

/* ---------------------------------------------------------------- output -- */

/* --vision L: Step-3.7's PerceptionEncoder at full width (1536, 16 heads, MLP 8960, patch 14,
 * image 728) with L blocks and the projector to the text hidden size, in config.json ... */
static int add_vision_config(struct mk *m, const char *path, struct err_buf *e)
{
    struct vision_config vc;
    json_error_t je;
    json_t *c = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    int r;

    if (!c)
        return err_set(e, -EINVAL, "%s: %s", path, je.text);
    json_object_set_new(c, "vision_config", json_pack("{s:s, s:i, s:i, s:i, s:i, s:i, s:f, s:s, s:b, s:b, s:b, s:b, s:b}",
        "model_type", "perception_encoder", "width", 1536, "layers", m->vision_layers, "heads", 16,
        "patch_size", 14, "image_size", 728, "mlp_ratio", 8960.0 / 1536.0, "hidden_act", "quick_gelu",
        "use_abs_posemb", 1, "use_rope2d", 1, "use_ln_pre", 1, "use_ln_post", 0, "use_cls_token", 0));
    json_object_set_new(c, "projector_bias", json_false());
    r = json_dump_file(c, path, JSON_INDENT(2)) < 0 ? err_set(e, -EIO, "%s: cannot write", path) : 0;
    json_decref(c);
    if (r < 0)
        return r;
    /* as the loader reads it */
    r = vision_config_load(m->out, m->cfg.hidden_size, &vc, e);
    return r < 0 ? r : 0;
}

/* ... and its tensors, after the text ones */
static int add_vision_tensors(struct mk *m, struct err_buf *e)
{
    struct vision_config vc;
    struct ckptw_entry *ne;
    int n, r;

    if (!m->vision_layers)
        return 0;
    r = vision_config_load(m->out, m->cfg.hidden_size, &vc, e);
    if (r < 0)
        return r;
    n = vision_tensor_count(&vc);
    ne = realloc(m->ents, (m->n_ents + (size_t) n) * sizeof(*ne));
    if (!ne)
        return err_set(e, -ENOMEM, "out of memory");
    m->ents = ne;
    for (int i = 0; i < n; i++) {
        struct ckptw_entry *t = &m->ents[m->n_ents++];
        struct vision_tensor vt;

        vision_tensor_get(&vc, i, &vt);
        memset(t, 0, sizeof(*t));
        snprintf(t->name, sizeof(t->name), "%s", vt.name);
        t->dtype = DTYPE_BF16;
        t->ndim = vt.ndim;
        memcpy(t->shape, vt.shape, sizeof(vt.shape));
        t->kind = CKPTW_DENSE;
    }
    return 0;
}

static int pwrite_all(int fd, const void *buf, size_t n, off_t off)
{
    const char *p = buf;
    while (n) {
        ssize_t k = pwrite(fd, p, n, off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return k < 0 ? -errno : -EIO;
        p += k;
        n -= (size_t) k;
        off += k;
    }
    return 0;
}

static void *worker(void *arg)
{
    struct mk *m = arg;
    uint8_t *buf = malloc(CHUNK);

    if (!buf) {
        atomic_store(&m->err, -ENOMEM);
        return NULL;
    }
    for (;;) {
        size_t j = atomic_fetch_add(&m->next_job, 1);
        const struct job *jb;
        int r;

        if (j >= m->n_jobs || atomic_load(&m->err))
            break;
        jb = &m->jobs[j];
        fill_chunk(m, &m->fills[jb->entry], m->ents[jb->entry].name, jb->chunk, buf, jb->len);
        r = pwrite_all(jb->fd, buf, jb->len, (off_t) jb->off);
        if (r < 0) {
            int z = 0;
            if (atomic_compare_exchange_strong(&m->err, &z, r))
                m->err_entry = (int) jb->entry;
            break;
        }
    }
    free(buf);
    return NULL;
}

#define TOKENIZER_MAX (256u << 20)

static int copy_file(const char *from, const char *to, struct err_buf *e)
{
    char *buf;
    size_t n;
    FILE *out;
    int r = file_read_all(from, TOKENIZER_MAX, 0, &buf, &n);

    if (r < 0)
        return err_set(e, r, "%s: cannot read: %s", from, err_str(r));
    out = fopen(to, "wbe");
    if (!out) {
        r = err_set(e, -errno, "%s: cannot create: %s", to, strerror(errno));
    } else {
        bool ok = fwrite(buf, 1, n, out) == n;
        if (fclose(out) != 0 || !ok)
            r = err_set(e, -EIO, "%s: write failed", to);
    }
    free(buf);
    return r;
}

/* tokenizer.json (+ tokenizer_config.json beside it) from a file or a model directory */
static int copy_tokenizer(const char *src, const char *dir, struct err_buf *e)
{
    char from[PATH_MAX + 32], to[PATH_MAX + 32], base[PATH_MAX];
    struct stat st;
    int r;

    if (stat(src, &st) < 0)
        return err_set(e, -errno, "--tokenizer %s: %s", src, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        snprintf(base, sizeof(base), "%s", src);
        snprintf(from, sizeof(from), "%s/tokenizer.json", src);
    } else {
        const char *sl = strrchr(src, '/');
        snprintf(base, sizeof(base), "%.*s", sl ? (int) (sl - src) : 1, sl ? src : ".");
        snprintf(from, sizeof(from), "%s", src);
    }
    snprintf(to, sizeof(to), "%s/tokenizer.json", dir);
    r = copy_file(from, to, e);
    if (r < 0)
        return r;
    snprintf(from, sizeof(from), "%s/tokenizer_config.json", base);
    snprintf(to, sizeof(to), "%s/tokenizer_config.json", dir);
    if (access(from, R_OK) == 0)
        r = copy_file(from, to, e);
    return r;
}

static bool is_ckpt_file(const char *n)
{
    return strcmp(n, "config.json") == 0 || strcmp(n, "model.safetensors.index.json") == 0 ||
           strcmp(n, "tokenizer.json") == 0 || strcmp(n, "tokenizer_config.json") == 0 ||
           (strncmp(n, "model", 5) == 0 && ends_with(n, ".safetensors"));
}

/* --out: created, or holding no checkpoint files (with --force: those are removed) */
static int prepare_dir(const struct mk *m, struct err_buf *e)
{
    struct dirent *de;
    bool found = false;
    DIR *d;
    int r = 0;

    if (mkdir(m->out, 0755) == 0)
        return 0;
    if (errno != EEXIST)
        return err_set(e, -errno, "--out %s: cannot create: %s", m->out, strerror(errno));
    d = opendir(m->out);
    if (!d)
        return err_set(e, -errno, "--out %s: %s", m->out, strerror(errno));
    while (r == 0 && (de = readdir(d))) {
        char path[PATH_MAX];
        if (!is_ckpt_file(de->d_name))
            continue;
        found = true;
        snprintf(path, sizeof(path), "%s/%s", m->out, de->d_name);
        if (m->force && unlink(path) < 0)
            r = err_set(e, -errno, "%s: cannot remove: %s", path, strerror(errno));
    }
    closedir(d);
    if (r == 0 && found && !m->force)
        r = err_set(e, -EEXIST, "--out %s already holds checkpoint files (--force replaces them)", m->out);
    return r;
}

struct shard {
    char name[64];
    size_t first, n;            /* entries */
    int fd;
    size_t hdr_len;
    uint64_t data_len;
};

/* Split entries into shards: n_shards by bytes, or a new shard whenever the next tensor
 * would take the current one past shard_size (Hugging Face's rule). */
static int split_shards(const struct mk *m, const int64_t *bytes, struct shard **ret, int *ret_n,
                        struct err_buf *e)
{
    struct shard *sh = calloc(m->n_ents + 1, sizeof(*sh));
    uint64_t total = 0, acc = 0, cur = 0;
    int n = 0;

    if (!sh)
        return err_set(e, -ENOMEM, "out of memory");
    for (size_t i = 0; i < m->n_ents; i++)
        total += (uint64_t) bytes[i];
    if (m->n_shards > 0 && (size_t) m->n_shards > m->n_ents) {
        free(sh);
        return err_set(e, -EINVAL, "--shards %d: more shards than the %zu tensors", m->n_shards, m->n_ents);
    }
    for (size_t i = 0; i < m->n_ents; i++) {
        bool start;
        if (m->n_shards > 0)
            /* shard s ends at the first tensor reaching total (s+1)/N, keeping one tensor
             * for each later shard */
            start = i == 0 || (n < m->n_shards &&
                               (acc >= total / (uint64_t) m->n_shards * (uint64_t) n ||
                                m->n_ents - i <= (size_t) (m->n_shards - n)));
        else
            start = i == 0 || (cur > 0 && cur + (uint64_t) bytes[i] > (uint64_t) m->shard_size);
        if (start) {
            sh[n++].first = i;
            cur = 0;
        }
        sh[n - 1].n++;
        cur += (uint64_t) bytes[i];
        acc += (uint64_t) bytes[i];
    }
    for (int s = 0; s < n; s++) {
        snprintf(sh[s].name, sizeof(sh[s].name), "model-%05d-of-%05d.safetensors", s + 1, n);
        sh[s].fd = -1;
    }
    *ret = sh;
    *ret_n = n;
    return 0;
}

static int write_model(struct mk *m, struct err_buf *e)
{
    struct ckptw_opts wo;
    struct shard *sh = NULL;
    int64_t *bytes = NULL;
    json_t *idx = NULL, *wm;
    pthread_t th[MAX_THREADS];
    char path[PATH_MAX];
    uint64_t total = 0, written = 0, disk = 0;
    double t0 = clk_now_s(), t_write;
    int n_sh = 0, n_th = 0, r;

    r = prepare_dir(m, e);
    if (r < 0)
        return r;
    snprintf(path, sizeof(path), "%s/config.json", m->out);
    r = ckptw_write_config(path, &m->cfg, true, false, e);
    if (r < 0)
        return r;
    if (m->vision_layers) {
        r = add_vision_config(m, path, e);
        if (r < 0)
            return r;
    }
    {
        /* the config as the loader reads it: every field checked */
        struct model_config back;
        r = model_config_load(path, &back, e);
        if (r < 0)
            return r;
    }
    ckptw_opts_default(&wo);
    wo.write_mtp = true;
    wo.stacked_experts = m->format == QUANT_NONE || m->format == QUANT_FP8;   /* as those releases */
    r = ckptw_layout(&m->cfg, &wo, &m->ents, &m->n_ents);
    if (r < 0)
        return err_set(e, r, "out of memory");
    r = add_vision_tensors(m, e);
    if (r < 0)
        return r;
    m->fills = calloc(m->n_ents + 1, sizeof(*m->fills));
    bytes = calloc(m->n_ents + 1, sizeof(*bytes));
    if (!m->fills || !bytes) {
        r = err_set(e, -ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < m->n_ents; i++) {
        r = plan_fill(m, &m->ents[i], &m->fills[i], e);
        if (r < 0)
            goto out;
        bytes[i] = ckptw_tensor_bytes(m->ents[i].dtype, m->ents[i].ndim, m->ents[i].shape);
        if (bytes[i] < 0) {
            r = err_set(e, -EOVERFLOW, "tensor '%s': no whole byte size", m->ents[i].name);
            goto out;
        }
        if (!m->fills[i].hole)
            m->n_jobs += (size_t) ((bytes[i] + CHUNK - 1) / CHUNK);
    }
    r = split_shards(m, bytes, &sh, &n_sh, e);
    if (r < 0)
        goto out;
    m->jobs = calloc(m->n_jobs + 1, sizeof(*m->jobs));
    idx = json_object();
    wm = json_object();
    if (!m->jobs || !idx || !wm) {
        json_decref(wm);
        r = err_set(e, -ENOMEM, "out of memory");
        goto out;
    }
    json_object_set_new(idx, "weight_map", wm);
    m->n_jobs = 0;
    for (int s = 0; s < n_sh; s++) {
        struct ckptw_tensor *ts = calloc(sh[s].n + 1, sizeof(*ts));
        char *hdr = NULL;
        int64_t off;

        if (!ts) {
            r = err_set(e, -ENOMEM, "out of memory");
            goto out;
        }
        for (size_t k = 0; k < sh[s].n; k++) {
            const struct ckptw_entry *t = &m->ents[sh[s].first + k];
            ts[k] = (struct ckptw_tensor) { .name = t->name, .dtype = t->dtype, .ndim = t->ndim };
            memcpy(ts[k].shape, t->shape, sizeof(ts[k].shape));
            json_object_set_new(wm, t->name, json_string(sh[s].name));
        }
        r = ckptw_safetensors_header(ts, sh[s].n, &hdr, &sh[s].hdr_len, &sh[s].data_len, e);
        free(ts);
        if (r < 0)
            goto out;
        snprintf(path, sizeof(path), "%s/%s", m->out, sh[s].name);
        sh[s].fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (sh[s].fd < 0) {
            r = err_set(e, -errno, "%s: cannot create: %s", path, strerror(errno));
            free(hdr);
            goto out;
        }
        r = pwrite_all(sh[s].fd, hdr, sh[s].hdr_len, 0);
        free(hdr);
        if (r == 0 && ftruncate(sh[s].fd, (off_t) (sh[s].hdr_len + sh[s].data_len)) < 0)
            r = -errno;
        if (r < 0) {
            r = err_set(e, r, "%s: write failed: %s", path, strerror(-r));
            goto out;
        }
        total += sh[s].data_len;
        off = (int64_t) sh[s].hdr_len;
        for (size_t k = 0; k < sh[s].n; k++) {
            size_t i = sh[s].first + k;
            if (!m->fills[i].hole)
                for (int64_t b = 0; b < bytes[i]; b += CHUNK) {
                    struct job *jb = &m->jobs[m->n_jobs++];
                    jb->fd = sh[s].fd;
                    jb->off = off + b;
                    jb->len = (uint32_t) (bytes[i] - b < CHUNK ? bytes[i] - b : CHUNK);
                    jb->chunk = (uint32_t) (b / CHUNK);
                    jb->entry = i;
                    written += jb->len;
                }
            off += bytes[i];
        }
    }
    json_object_set_new(idx, "metadata", json_pack("{s:I}", "total_size", (json_int_t) total));
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", m->out);
    if (json_dump_file(idx, path, JSON_INDENT(2) | JSON_SORT_KEYS) < 0) {
        r = err_set(e, -EIO, "%s: cannot write", path);
        goto out;
    }

    atomic_store(&m->next_job, 0);
    atomic_store(&m->err, 0);
    for (n_th = 0; n_th < m->threads; n_th++)
        if (pthread_create(&th[n_th], NULL, worker, m) != 0)
            break;
    if (n_th == 0) {
        r = err_set(e, -EAGAIN, "cannot start a thread");
        goto out;
    }
    for (int i = 0; i < n_th; i++)
        pthread_join(th[i], NULL);
    r = atomic_load(&m->err);
    if (r < 0) {
        r = err_set(e, r, "writing '%s': %s", m->err_entry >= 0 ? m->ents[m->err_entry].name : "?",
                    strerror(-r));
        goto out;
    }
    for (int s = 0; s < n_sh; s++) {
        struct stat st;
        if (fstat(sh[s].fd, &st) == 0)
            disk += (uint64_t) st.st_blocks * 512;
        if (close(sh[s].fd) < 0 && r == 0)
            r = err_set(e, -errno, "%s/%s: %s", m->out, sh[s].name, strerror(errno));
        sh[s].fd = -1;
    }
    if (r < 0)
        goto out;
    t_write = clk_now_s() - t0;
    if (m->tokenizer) {
        r = copy_tokenizer(m->tokenizer, m->out, e);
        if (r < 0)
            goto out;
    }
    printf("wrote %s: %d shard%s, %zu tensors, %.3f GB (%.3f GB of data written, %.3f GB in holes, "
           "%.3f GB on disk) in %.1f s with %d thread%s\n",
           m->out, n_sh, n_sh == 1 ? "" : "s", m->n_ents, (double) total / 1e9, (double) written / 1e9,
           (double) (total - written) / 1e9, (double) disk / 1e9, t_write, n_th, n_th == 1 ? "" : "s");
out:
    for (int s = 0; sh && s < n_sh; s++)
        if (sh[s].fd >= 0)
            close(sh[s].fd);
    json_decref(idx);
    free(sh);
    free(bytes);
    return r;
}

/* ------------------------------------------------------------------ main -- */

static const char usage_line[] =
    "usage: stepd-mkmodel --out DIR [--preset full|narrow8] [--layers L] [--mtp D] [--seed S] ... (--help)\n";

static void usage(FILE *f)
{
    fprintf(f,
        "usage: stepd-mkmodel --out DIR [--preset full|narrow8] [--layers L | --real-layers LIST]\n"
        "                     [--mtp D] [--seed S] [--shards N | --shard-size BYTES] [--sparse LIST]\n"
        "                     [--threads T] [--tokenizer PATH] [--force]\n"
        "                     [--hidden H] [--intermediate I] [--moe-inter M] [--shared-inter S]\n"
        "                     [--experts E] [--top-k K] [--vocab V] [--head-dim D] [--window W]\n"
        "                     [--format bf16|fp8|nvfp4|mxfp4] [--vision L]\n"
        "       stepd-mkmodel --from DIR --out DIR --format bf16|fp8|nvfp4|mxfp4 [--stacked yes|no]\n"
        "                     [--block N] [--force]\n"
        "  --from DIR          rewrite the checkpoint in DIR in another release format (its routed\n"
        "                      experts; every other module BF16) instead of making a synthetic one\n"
        "  --format F          the routed experts' format (default mxfp4): bf16 and fp8 write them\n"
        "                      stacked [experts, out, in] per projection as those releases do, fp8\n"
        "                      with 128x128 block scales, nvfp4 (modelopt) and mxfp4 per expert\n"
        "  --preset P          full (default): Step-3.7-Flash widths (hidden 4096, 288 experts x 1280\n"
        "                      top-8, vocab 128896); narrow8: the real head counts (64/96 query, 8 KV\n"
        "                      heads of 128) with hidden 256, dense MLP 768, 32 experts x 128 top-8,\n"
        "                      shared expert 128, vocab 4096 (TP=8 / EP=8 in seconds on a CPU)\n"
        "  --layers L          trunk layers (default 3: real layers 0,3,4 = dense/full, MoE/sliding,\n"
        "                      MoE/full; L >= 5: real layers 0..L-1)\n"
        "  --real-layers LIST  the real layers to copy, e.g. 0,3,4 or 43,44 (0..44)\n"
        "  --mtp D             MTP draft layers (real layers 45.., 0..3, default 0)\n"
        "  --seed S            random seed (default 1): the same seed gives the same bytes\n"
        "  --shards N          split into N shards of about equal bytes\n"
        "  --shard-size B      start a new shard before one would exceed B bytes (suffix K, M, G:\n"
        "                      2^10, 2^20, 2^30; default 5G)\n"
        "  --sparse LIST       leave data as holes (zeros): all, embed, heads (lm_head and MTP\n"
        "                      shared_head.output), experts, experts-from:N (experts N..)\n"
        "  --threads T         generator threads (default: online cores)\n"
        "  --tokenizer PATH    copy tokenizer.json (+ tokenizer_config.json) from a file or model dir\n"
        "                      (a model dir's config.json also gives the BOS/EOS ids)\n"
        "  --force             replace the checkpoint files already in DIR\n"
        "  --hidden ... --window   override one width of the preset (--window: sliding window)\n"
        "  --vision L          add Step-3.7's vision tower at full width (1536, 16 heads, MLP 8960,\n"
        "                      image 728 / patch 14) with L blocks (real: 47), BF16, and its\n"
        "                      vision_config; the projector maps to the text hidden size\n"
        "  --version, --help   print the version, or this text, and exit\n");
}

static int parse_u64(const char *flag, const char *s, bool suffix, uint64_t *ret, struct err_buf *e)
{
    char *end;
    unsigned long long v;

    errno = 0;
    v = strtoull(s, &end, 0);
    if (end == s || errno || s[0] == '-')
        return err_set(e, -EINVAL, "%s '%s': expected a non-negative integer", flag, s);
    if (suffix && *end) {
        int sh = *end == 'K' || *end == 'k' ? 10 : *end == 'M' || *end == 'm' ? 20 : *end == 'G' || *end == 'g' ? 30 : -1;
        if (sh < 0 || end[1] || v > (UINT64_MAX >> sh))
            return err_set(e, -EINVAL, "%s '%s': expected bytes with an optional K, M or G", flag, s);
        v <<= sh;
        end++;
    }
    if (*end)
        return err_set(e, -EINVAL, "%s '%s': expected a non-negative integer", flag, s);
    *ret = v;
    return 0;
}

static int parse_sparse(struct mk *m, const char *s, struct err_buf *e)
{
    char buf[256], *save = NULL;

    snprintf(buf, sizeof(buf), "%s", s);
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (strcmp(t, "all") == 0)
            m->sparse_all = true;
        else if (strcmp(t, "embed") == 0)
            m->sparse_embed = true;
        else if (strcmp(t, "heads") == 0)
            m->sparse_heads = true;
        else if (strcmp(t, "experts") == 0)
            m->sparse_experts = true;
        else if (strncmp(t, "experts-from:", 13) == 0) {
            if (cli_parse_int("--sparse experts-from", t + 13, 0, 1 << 16, &m->sparse_experts_from, e) < 0)
                return -EINVAL;
        } else if (strcmp(t, "none") != 0)
            return err_set(e, -EINVAL, "--sparse '%s': expected all, embed, heads, experts, experts-from:N or none", t);
    }
    return 0;
}

static int parse_layers(struct mk *m, const char *s, struct err_buf *e)
{
    char buf[512], *save = NULL;
    int n = 0;

    snprintf(buf, sizeof(buf), "%s", s);
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == MODEL_MAX_LAYERS - REAL_MTP)
            return err_set(e, -EINVAL, "--real-layers: more than %d layers", MODEL_MAX_LAYERS - REAL_MTP);
        if (cli_parse_int("--real-layers", t, 0, REAL_LAYERS - 1, &m->map[n], e) < 0)
            return -EINVAL;
        n++;
    }
    if (n == 0)
        return err_set(e, -EINVAL, "--real-layers '%s': expected a list of layer indices", s);
    m->n_layers = n;
    return 0;
}

int mkmodel_convert(int argc, char **argv);  /* convert.c */

int main(int argc, char **argv)
{
    /* --from DIR: rewrite an existing checkpoint in another release format (convert.c) */
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--from") == 0 || strncmp(argv[i], "--from=", 7) == 0)
            return mkmodel_convert(argc, argv);

    enum { O_PRESET = 256, O_LAYERS, O_REAL, O_MTP, O_SEED, O_SHARDS, O_SHARD_SIZE, O_SPARSE,
           O_THREADS, O_TOK, O_FORCE, O_HIDDEN, O_INTER, O_MOE, O_SHARED, O_EXPERTS, O_TOPK,
           O_VOCAB, O_HEADDIM, O_WINDOW, O_OUT, O_FORMAT, O_VISION };
    static const struct option lo[] = {
        { "out", required_argument, NULL, O_OUT },
        { "preset", required_argument, NULL, O_PRESET },
        { "layers", required_argument, NULL, O_LAYERS },
        { "real-layers", required_argument, NULL, O_REAL },
        { "mtp", required_argument, NULL, O_MTP },
        { "seed", required_argument, NULL, O_SEED },
        { "shards", required_argument, NULL, O_SHARDS },
        { "shard-size", required_argument, NULL, O_SHARD_SIZE },
        { "sparse", required_argument, NULL, O_SPARSE },
        { "threads", required_argument, NULL, O_THREADS },
        { "tokenizer", required_argument, NULL, O_TOK },
        { "force", no_argument, NULL, O_FORCE },
        { "hidden", required_argument, NULL, O_HIDDEN },
        { "intermediate", required_argument, NULL, O_INTER },
        { "moe-inter", required_argument, NULL, O_MOE },
        { "shared-inter", required_argument, NULL, O_SHARED },
        { "experts", required_argument, NULL, O_EXPERTS },
        { "top-k", required_argument, NULL, O_TOPK },
        { "vocab", required_argument, NULL, O_VOCAB },
        { "head-dim", required_argument, NULL, O_HEADDIM },
        { "window", required_argument, NULL, O_WINDOW },
        { "format", required_argument, NULL, O_FORMAT },
        { "vision", required_argument, NULL, O_VISION },
        { "help", no_argument, NULL, 'h' },
        { "version", no_argument, NULL, 'V' },
        { 0 },
    };
    struct mk *m = calloc(1, sizeof(*m));
    struct err_buf e = { "" };
    bool layers_set = false, real_set = false, shard_size_set = false;
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    uint64_t u;
    int opt, r = 0;

    if (!m) {
        fprintf(stderr, "stepd-mkmodel: out of memory\n");
        return 1;
    }
    m->n_layers = 3;
    m->seed = 1;
    m->shard_size = (int64_t) 5 << 30;
    m->threads = nproc > 0 ? (int) (nproc < MAX_THREADS ? nproc : MAX_THREADS) : 1;
    m->sparse_experts_from = INT_MAX;
    m->format = QUANT_MXFP4;
    m->err_entry = -1;
#define INT_ARG(flag, lo_, hi_, dst) do { if (cli_parse_int(flag, optarg, lo_, hi_, dst, &e) < 0) goto usage_err; } while (0)
    while ((opt = getopt_long(argc, argv, "hV", lo, NULL)) != -1) {
        switch (opt) {
        case O_OUT: m->out = optarg; break;
        case O_PRESET:
            if (strcmp(optarg, "full") == 0)
                m->narrow = false;
            else if (strcmp(optarg, "narrow8") == 0)
                m->narrow = true;
            else {
                err_set(&e, -EINVAL, "--preset '%s': expected full or narrow8", optarg);
                goto usage_err;
            }
            break;
        case O_LAYERS: INT_ARG("--layers", 1, REAL_LAYERS, &m->n_layers); layers_set = true; break;
        case O_REAL:
            if (parse_layers(m, optarg, &e) < 0)
                goto usage_err;
            real_set = true;
            break;
        case O_MTP: INT_ARG("--mtp", 0, REAL_MTP, &m->n_mtp); break;
        case O_SEED:
            if (parse_u64("--seed", optarg, false, &m->seed, &e) < 0)
                goto usage_err;
            break;
        case O_SHARDS: INT_ARG("--shards", 1, 99999, &m->n_shards); break;
        case O_SHARD_SIZE:
            if (parse_u64("--shard-size", optarg, true, &u, &e) < 0)
                goto usage_err;
            if (u == 0 || u > INT64_MAX) {
                err_set(&e, -EINVAL, "--shard-size '%s': must be positive", optarg);
                goto usage_err;
            }
            m->shard_size = (int64_t) u;
            shard_size_set = true;
            break;
        case O_SPARSE:
            if (parse_sparse(m, optarg, &e) < 0)
                goto usage_err;
            break;
        case O_THREADS: INT_ARG("--threads", 1, MAX_THREADS, &m->threads); break;
        case O_TOK: m->tokenizer = optarg; break;
        case O_FORCE: m->force = true; break;
        case O_HIDDEN: INT_ARG("--hidden", 32, 1 << 16, &m->hidden); break;
        case O_INTER: INT_ARG("--intermediate", 1, 1 << 20, &m->inter); break;
        case O_MOE: INT_ARG("--moe-inter", 32, 1 << 20, &m->moe_inter); break;
        case O_SHARED: INT_ARG("--shared-inter", 1, 1 << 20, &m->shared_inter); break;
        case O_EXPERTS: INT_ARG("--experts", 1, 1024, &m->experts); break;
        case O_TOPK: INT_ARG("--top-k", 1, 64, &m->top_k); break;
        case O_VOCAB: INT_ARG("--vocab", 8, 1 << 24, &m->vocab); break;
        case O_HEADDIM: INT_ARG("--head-dim", 2, 1024, &m->head_dim); break;
        case O_WINDOW: INT_ARG("--window", 1, 1 << 20, &m->window); break;
        case O_VISION: INT_ARG("--vision", 0, 1024, &m->vision_layers); break;
        case O_FORMAT:
            if (strcmp(optarg, "bf16") == 0)
                m->format = QUANT_NONE;
            else if (strcmp(optarg, "fp8") == 0)
                m->format = QUANT_FP8;
            else if (strcmp(optarg, "nvfp4") == 0)
                m->format = QUANT_NVFP4;
            else if (strcmp(optarg, "mxfp4") == 0)
                m->format = QUANT_MXFP4;
            else {
                err_set(&e, -EINVAL, "--format '%s': expected bf16, fp8, nvfp4 or mxfp4", optarg);
                goto usage_err;
            }
            break;
        case 'h': usage(stdout); free(m); return 0;
        case 'V': printf("stepd-mkmodel %s\n", STEPD_VERSION); free(m); return 0;
        default: fputs(usage_line, stderr); free(m); return 2;
        }
    }
#undef INT_ARG
    if (optind != argc || !m->out) {
        err_set(&e, -EINVAL, optind != argc ? "unexpected argument '%s'" : "--out DIR is required",
                optind != argc ? argv[optind] : "");
        goto usage_err;
    }
    if (layers_set && real_set) {
        err_set(&e, -EINVAL, "give --layers or --real-layers, not both");
        goto usage_err;
    }
    if (m->n_shards && shard_size_set) {
        err_set(&e, -EINVAL, "give --shards or --shard-size, not both");
        goto usage_err;
    }
    if (!real_set)
        default_map(m->n_layers, m->map);

    tables_init();
    r = build_config(m, &e);
    if (r < 0)
        goto fail;
    {
        const struct model_config *c = &m->cfg;
        printf("stepd-mkmodel: %s, seed %llu, %d layers (real layers", m->narrow ? "narrow8" : "full width",
               (unsigned long long) m->seed, c->n_layers);
        for (int i = 0; i < c->n_layers; i++)
            printf("%s%d %s/%s", i ? ", " : " ", m->map[i], c->layers[i].is_moe ? "MoE" : "dense",
                   c->layers[i].kind == LAYER_KIND_FULL ? "full" : "sliding");
        printf(") + %d MTP\n  hidden %d, query heads %d full / %d sliding, %d KV heads x %d, window %d, "
               "dense MLP %d, %d experts x %d top-%d, shared expert %d, vocab %d\n",
               c->n_mtp_layers, c->hidden_size, c->n_heads_full, c->n_heads_sliding, c->n_kv_heads,
               c->head_dim, c->sliding_window, c->intermediate_size, c->n_experts,
               c->moe_intermediate_size, c->top_k, c->shared_expert_dim, c->vocab_size);
        fflush(stdout);
    }
    r = write_model(m, &e);
    if (r < 0)
        goto fail;
    {
        /* what the loader makes of it */
        struct ckpt_opts co = { .world_size = 1, .mtp_depth = m->n_mtp, .headers_only = true };
        struct ckpt_plan_stats st;
        struct ckpt *ck;
        r = ckpt_open(m->out, &co, &ck, &e);
        if (r < 0)
            goto fail;
        ckpt_plan_stats(ck, &st);
        printf("loader: plans %lld tensors, %.3f GB at world size 1, MTP depth %d\n",
               (long long) st.n_tensors, (double) st.bytes / 1e9, ckpt_mtp_depth(ck));
        ckpt_close(ck);
    }
    free(m->ents);
    free(m->fills);
    free(m->jobs);
    free(m);
    return 0;
usage_err:
    fprintf(stderr, "stepd-mkmodel: %s\n%s", e.msg, usage_line);
    free(m);
    return 2;
fail:
    fprintf(stderr, "stepd-mkmodel: %s\n", e.msg);
    free(m->ents);
    free(m->fills);
    free(m->jobs);
    free(m);
    return 1;
}
