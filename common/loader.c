/* loader.c - see loader.h and docs/ARCHITECTURE.md §2, §5.
 *
 * Open sequence: config.json -> shard list (index or model.safetensors) -> every
 * shard header validated (and mapped unless headers_only) -> source table of
 * canonical names -> expected tensor list of the whole model (the tensor table of
 * tensors.c, which the model's load_layer walks too) -> this rank's plan
 * (needed entries + slices) -> check needed entries against the sources, collect
 * EVERY problem, fail once with all of them.
 */
#include "loader.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "safetensors.h"
#include "strbuf.h"
#include "tensors.h"
#include "vision-tensors.h"

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"
#define WARN_LIST_MAX 20

enum slice_kind { SLICE_NONE, SLICE_ROWS, SLICE_COLS };

/* A problem or warning list: one line each, in a strbuf (its sticky oom is checked once,
 * at the end of ckpt_open). */
static void line_add(struct strbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void line_add(struct strbuf *s, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    (void) strbuf_vprintf(s, fmt, ap);
    va_end(ap);
    (void) strbuf_add(s, "\n", 1);
}

static int lines_count(const struct strbuf *s)
{
    int n = 0;

    for (size_t i = 0; i < s->len; i++)
        n += s->p[i] == '\n';
    return n;
}

/* one shard file */
struct shard {
    char *name;                       /* as listed (relative to its directory) */
    struct sft_file *f;
    bool mtp_dir;
};

/* one tensor found in a shard */
struct src {
    char *canon;                      /* canonical name (model.language_model. -> model.) */
    int shard;
    const struct sft_tensor *t;
    bool matched;
    bool reported;                    /* a stacked tensor's mismatch is listed once */
};

/* one expected tensor of the whole model */
struct pent {
    char *name;                       /* canonical */
    enum dtype dtype, dtype_alt;      /* dtype_alt: also accepted (DTYPE_INVALID: none) */
    int ndim;
    int64_t shape[2];
    int layer;                        /* -1 global */
    int expert;                       /* -1 not an expert */
    bool optional;                    /* optional-parameter rule */
    bool needed;                      /* in this rank's plan */
    enum slice_kind slice;
    int64_t off, len;                 /* slice along dim 0 (rows) or dim 1 (cols) */
    int src;                          /* index in sources, -1 absent */
    bool stacked;                     /* src is the layer's 3-D [n_experts, ...] tensor: this
                                       * expert's slice of it */
    void *copy;                       /* column slice, loader-owned */
    atomic_flag counted;              /* its bytes are in ckpt.got_bytes */
};

/* open-addressing string -> index map */
struct hmap {
    int32_t *slot;
    uint32_t mask;
};

struct ckpt {
    struct model_config cfg;
    struct ckpt_opts opts;
    char *dir, *mtp_dir;
    struct shard *shards;
    int n_shards;
    struct src *srcs;
    size_t n_srcs, cap_srcs;
    struct hmap src_map;
    struct pent *ents;
    size_t n_ents, cap_ents;
    struct hmap ent_map;
    int mtp_depth;
    int expert_first, expert_count;
    struct strbuf warnings;
    pthread_mutex_t copy_lock;
    _Atomic int64_t got_bytes;        /* planned bytes handed out by ckpt_get() so far */
    /* the vision tower (vision_plan): planned whole on rank 0 unless opts.skip_vision */
    struct vision_config vis;
    struct vent {
        int src;                      /* index in sources, -1 absent */
        atomic_flag counted;
    } *vents;
    int n_vents;
};

/* ------------------------------------------------------------------------ */

/* Is name one of the optional-parameter suffixes (.k_scale, ..., .prob_zero_point)? */
static bool ckpt_name_is_optional(const char *name)
{
    return tensor_optional_index(name) >= 0;
}

static uint32_t hash_str(const char *s)
{
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char) *s) * 16777619u;
    return h;
}

static int hmap_init(struct hmap *m, size_t n)
{
    uint32_t cap = 16;
    while (cap < n * 2 + 1)
        cap <<= 1;
    m->slot = malloc(cap * sizeof(*m->slot));
    if (!m->slot)
        return -ENOMEM;
    memset(m->slot, 0xff, cap * sizeof(*m->slot));
    m->mask = cap - 1;
    return 0;
}

/* find name; names(i) gives the key of entry i. Returns the slot pointer. */
#define HMAP_LOOKUP(m, key, keyof, ret_slot) do { \
        uint32_t _h = hash_str(key) & (m)->mask; \
        while ((m)->slot[_h] >= 0 && strcmp(keyof((m)->slot[_h]), (key)) != 0) \
            _h = (_h + 1) & (m)->mask; \
        (ret_slot) = &(m)->slot[_h]; \
    } while (0)

/* "model.language_model.X" -> "model.X"; writes into buf. */
static const char *canon_name(const char *name, char *buf, size_t size)
{
    static const char lm[] = "model.language_model.";
    if (strncmp(name, lm, sizeof(lm) - 1) == 0) {
        snprintf(buf, size, "model.%s", name + sizeof(lm) - 1);
        return buf;
    }
    return name;
}

/* layer index of "model.layers.N.", or -1 */
static int name_layer(const char *name)
{
    static const char pre[] = "model.layers.";
    char *end;
    long l;

    if (strncmp(name, pre, sizeof(pre) - 1) != 0)
        return -1;
    l = strtol(name + sizeof(pre) - 1, &end, 10);
    if (end == name + sizeof(pre) - 1 || *end != '.' || l < 0 || l >= INT_MAX)
        return -1;
    return (int) l;
}

static void format_shape(char *buf, size_t size, int ndim, const int64_t *shape)
{
    size_t n = 0;
    n += (size_t) snprintf(buf + n, size - n, "[");
    for (int i = 0; i < ndim && n < size; i++)
        n += (size_t) snprintf(buf + n, size - n, "%s%lld", i ? "," : "", (long long) shape[i]);
    if (n < size)
        snprintf(buf + n, size - n, "]");
}

/* ------------------------------------------------------------------------ */
/* expected tensor list */

static int ent_add(struct ckpt *c, const char *name, enum dtype dt, int ndim, int64_t d0, int64_t d1,
                   int layer, int expert, enum slice_kind slice)
{
    struct pent *p;

    if (c->n_ents == c->cap_ents) {
        size_t nc = c->cap_ents ? c->cap_ents * 2 : 256;
        struct pent *np = realloc(c->ents, nc * sizeof(*np));
        if (!np)
            return -ENOMEM;
        c->ents = np;
        c->cap_ents = nc;
    }
    p = &c->ents[c->n_ents];
    memset(p, 0, sizeof(*p));
    p->name = strdup(name);
    if (!p->name)
        return -ENOMEM;
    p->dtype = dt;
    p->dtype_alt = DTYPE_INVALID;
    p->ndim = ndim;
    p->shape[0] = d0;
    p->shape[1] = d1;
    p->layer = layer;
    p->expert = expert;
    p->slice = slice;
    p->src = -1;
    c->n_ents++;
    return 0;
}

#define ADD(...) do { int _r = ent_add(c, __VA_ARGS__); if (_r < 0) return _r; } while (0)

/* The stored tensors of one linear module "<base>" of logical shape [out, in] in format q
 * (tensor_linear_parts).  A group or block size that does not divide the shape is a problem
 * of its own: returns 1. */
static int add_linear(struct ckpt *c, const char *base, enum quant_scheme q, int64_t out, int64_t in,
                      int layer, int expert, enum slice_kind slice, struct strbuf *probs)
{
    const struct model_config *m = &c->cfg;
    int64_t br = m->quant_block_rows, bc = m->quant_group_size;
    struct tensor_part parts[TENSOR_MAX_PARTS];
    int n_parts = tensor_linear_parts(q, out, in, br, bc, parts);
    char n[200];

    if (n_parts < 0 && q == QUANT_FP8) {
        line_add(probs, "%s: FP8 weight_block_size [%lld, %lld] does not divide its shape [%lld, %lld]", base,
                 (long long) br, (long long) bc, (long long) out, (long long) in);
        return 1;
    }
    if (n_parts < 0) {
        line_add(probs, "%s: %s needs in-features divisible by its group size %lld, got [%lld, %lld]", base,
                 quant_scheme_name(q), (long long) (q == QUANT_MXFP4 ? 32 : 16), (long long) out, (long long) in);
        return 1;
    }
    for (int i = 0; i < n_parts; i++) {
        const struct tensor_part *t = &parts[i];

        snprintf(n, sizeof(n), "%s%s", base, t->suffix);
        ADD(n, t->dtype, t->ndim, t->shape[0], t->shape[1], layer, expert, t->ndim ? slice : SLICE_NONE);
    }
    return 0;
}

/* One row of the tensor table (common/tensors.c) into the expected list. */
struct expect_ctx {
    struct ckpt *c;
    struct strbuf *probs;
    int bad_layer;              /* a routed expert's shape problem is listed once per layer */
};

static int expect_one(void *ctx, const struct tensor_ref *t)
{
    static const enum slice_kind slice[] = { [TENSOR_WHOLE] = SLICE_NONE, [TENSOR_ROWS] = SLICE_ROWS,
                                             [TENSOR_COLS] = SLICE_COLS };
    struct expect_ctx *x = ctx;
    struct ckpt *c = x->c;
    int r;

    if (t->spec->dtype != TENSOR_DT_LINEAR) {
        ADD(t->name, t->spec->dtype == TENSOR_DT_BF16 ? DTYPE_BF16 : DTYPE_F32, t->ndim, t->shape[0],
            t->ndim > 1 ? t->shape[1] : 0, t->layer, t->expert, slice[t->split]);
        if (t->spec->dtype == TENSOR_DT_F32_OR_BF16)
            c->ents[c->n_ents - 1].dtype_alt = DTYPE_BF16;
        return 0;
    }
    if (t->expert >= 0 && x->bad_layer == t->layer)
        return 0;
    r = add_linear(c, t->name, t->quant, t->shape[0], t->shape[1], t->layer, t->expert, slice[t->split],
                   x->probs);
    if (r > 0 && t->expert >= 0)        /* the same shape problem for every expert: listed once */
        x->bad_layer = t->layer;
    return r < 0 ? r : 0;
}

/* The whole model's tensors (every rank's, every expert), from the tensor table. */
static int build_expected(struct ckpt *c, struct strbuf *probs)
{
    const struct model_config *m = &c->cfg;
    struct expect_ctx x = { c, probs, -1 };
    int r;

    /* tied: lm_head.weight is served from the embedding (see plan()) */
    r = tensor_global_each(m, 1, expect_one, &x);
    for (int l = 0; l < m->n_layers_total && r >= 0; l++)
        r = tensor_layer_each(m, l, 1, 0, m->n_experts, expect_one, &x);
    return r;
}
#undef ADD

/* ------------------------------------------------------------------------ */
/* sources */

static int shard_open_one(struct ckpt *c, const char *dir, const char *rdir, const char *name,
                          bool mtp, struct strbuf *probs, int *first_err)
{
    char path[PATH_MAX], *real;
    struct err_buf e;
    struct shard *s, *ns;
    size_t rl = strlen(rdir);
    int r;

    snprintf(path, sizeof(path), "%s/%s", dir, name);
    real = realpath(path, NULL);
    if (!real) {
        r = -errno;
        line_add(probs, "%s: shard cannot be opened: %s", path, err_str(r));
        goto fail;
    }
    if (strncmp(real, rdir, rl) != 0 || real[rl] != '/') {
        line_add(probs, "%s: shard resolves to %s, outside the model directory %s (refused)", path,
                 real, rdir);
        free(real);
        r = -EACCES;
        goto fail;
    }
    free(real);
    ns = realloc(c->shards, (size_t) (c->n_shards + 1) * sizeof(*ns));
    if (!ns)
        return -ENOMEM;
    c->shards = ns;
    s = &c->shards[c->n_shards];
    memset(s, 0, sizeof(*s));
    r = sft_open(path, c->opts.headers_only ? SFT_OPEN_HEADERS_ONLY : 0, &s->f, &e);
    if (r < 0) {
        line_add(probs, "%s", e.msg);
        goto fail;
    }
    s->name = strdup(name);
    s->mtp_dir = mtp;
    if (!s->name) {
        sft_close(s->f);
        return -ENOMEM;
    }
    c->n_shards++;
    return 0;
fail:
    if (!*first_err)
        *first_err = r;
    return 1;
}

/* Open every shard of dir; check the index against the headers. */
static int open_dir(struct ckpt *c, const char *dir, bool mtp, struct strbuf *probs, int *first_err)
{
    char ipath[PATH_MAX], spath[PATH_MAX], *rdir;
    struct sft_index idx = { 0 };
    struct err_buf e;
    struct stat st;
    int first_shard = c->n_shards, r = 0, *shard_at = NULL;

    rdir = realpath(dir, NULL);
    if (!rdir) {
        r = -errno;
        line_add(probs, "%s: cannot open model directory: %s", dir, err_str(r));
        *first_err = *first_err ? *first_err : r;
        return 0;
    }
    snprintf(ipath, sizeof(ipath), "%s/%s", dir, INDEX_NAME);
    snprintf(spath, sizeof(spath), "%s/%s", dir, SINGLE_NAME);
    if (stat(ipath, &st) == 0) {
        FILE *f = fopen(ipath, "rbe");
        char *text = NULL;
        long sz = -1;
        if (f && fseek(f, 0, SEEK_END) == 0)
            sz = ftell(f);
        if (!f || sz < 0 || fseek(f, 0, SEEK_SET) != 0) {
            line_add(probs, "%s: cannot read", ipath);
            *first_err = *first_err ? *first_err : -EIO;
            if (f)
                fclose(f);
            goto out;
        }
        if ((unsigned long) sz > SFT_INDEX_MAX) {
            line_add(probs, "%s: %ld bytes, more than %u", ipath, sz, SFT_INDEX_MAX);
            *first_err = *first_err ? *first_err : -E2BIG;
            fclose(f);
            goto out;
        }
        text = malloc((size_t) sz + 1);
        if (!text || fread(text, 1, (size_t) sz, f) != (size_t) sz) {
            free(text);
            fclose(f);
            line_add(probs, "%s: cannot read", ipath);
            *first_err = *first_err ? *first_err : -EIO;
            goto out;
        }
        fclose(f);
        r = sft_index_parse(text, (size_t) sz, ipath, &idx, &e);
        free(text);
        if (r < 0) {
            line_add(probs, "%s", e.msg);
            *first_err = *first_err ? *first_err : r;
            r = 0;
            goto out;
        }
        shard_at = calloc(idx.n_shards + 1, sizeof(*shard_at));
        if (!shard_at) {
            r = -ENOMEM;
            goto out;
        }
        for (size_t i = 0; i < idx.n_shards; i++) {
            int before = c->n_shards;
            r = shard_open_one(c, dir, rdir, idx.shards[i], mtp, probs, first_err);
            if (r < 0)
                goto out;
            shard_at[i] = c->n_shards > before ? before : -1;
        }
        /* index vs headers, both directions */
        for (size_t i = 0; i < idx.n; i++) {
            int s = shard_at[idx.shard_of[i]];
            if (s >= 0 && !sft_header_find(sft_file_header(c->shards[s].f), idx.names[i])) {
                line_add(probs, "%s: tensor '%s' is listed in %s but missing from %s", dir,
                         idx.names[i], INDEX_NAME, idx.shards[idx.shard_of[i]]);
                *first_err = *first_err ? *first_err : -ENOENT;
            }
        }
        for (int s = first_shard; s < c->n_shards; s++) {
            const struct sft_header *h = sft_file_header(c->shards[s].f);
            for (size_t t = 0; t < h->n_tensors; t++) {
                long at = sft_index_find(&idx, h->tensors[t].name);
                if (at < 0) {
                    line_add(probs, "%s/%s: tensor '%s' is not listed in %s", dir, c->shards[s].name,
                             h->tensors[t].name, INDEX_NAME);
                    *first_err = *first_err ? *first_err : -EBADMSG;
                } else if (strcmp(idx.shards[idx.shard_of[at]], c->shards[s].name) != 0) {
                    line_add(probs, "%s/%s: tensor '%s' is also present here, but %s maps it to %s",
                             dir, c->shards[s].name, h->tensors[t].name, INDEX_NAME,
                             idx.shards[idx.shard_of[at]]);
                    *first_err = *first_err ? *first_err : -EEXIST;
                }
            }
        }
    } else if (stat(spath, &st) == 0) {
        r = shard_open_one(c, dir, rdir, SINGLE_NAME, mtp, probs, first_err);
        if (r < 0)
            goto out;
    } else {
        line_add(probs, "%s: neither %s nor %s found", dir, INDEX_NAME, SINGLE_NAME);
        *first_err = *first_err ? *first_err : -ENOENT;
    }
    r = 0;
out:
    free(shard_at);
    sft_index_done(&idx);
    free(rdir);
    return r;
}

#define SRC_KEY(i) (c->srcs[(i)].canon)
#define ENT_KEY(i) (c->ents[(i)].name)

static int build_sources(struct ckpt *c, struct strbuf *probs, int *first_err)
{
    size_t total = 0;
    int n_main_mtp_ignored = 0, n_mtpdir_trunk_ignored = 0, r;

    for (int s = 0; s < c->n_shards; s++)
        total += sft_file_header(c->shards[s].f)->n_tensors;
    c->srcs = calloc(total + 1, sizeof(*c->srcs));
    if (!c->srcs)
        return -ENOMEM;
    r = hmap_init(&c->src_map, total);
    if (r < 0)
        return r;
    for (int s = 0; s < c->n_shards; s++) {
        const struct sft_header *h = sft_file_header(c->shards[s].f);
        for (size_t t = 0; t < h->n_tensors; t++) {
            char buf[SFT_NAME_MAX + 16];
            const char *cn = canon_name(h->tensors[t].name, buf, sizeof(buf));
            int layer = name_layer(cn);
            bool is_mtp_layer = layer >= c->cfg.n_layers;
            int32_t *slot;

            if (c->mtp_dir) {
                if (!c->shards[s].mtp_dir && is_mtp_layer) {
                    n_main_mtp_ignored++;
                    continue;
                }
                if (c->shards[s].mtp_dir && !is_mtp_layer) {
                    n_mtpdir_trunk_ignored++;
                    continue;
                }
            }
            HMAP_LOOKUP(&c->src_map, cn, SRC_KEY, slot);
            if (*slot >= 0) {
                const struct src *o = &c->srcs[*slot];
                line_add(probs, "tensor '%s' appears twice: in %s (as '%s') and in %s (as '%s')", cn,
                         sft_file_path(c->shards[o->shard].f), o->t->name,
                         sft_file_path(c->shards[s].f), h->tensors[t].name);
                *first_err = *first_err ? *first_err : -EEXIST;
                continue;
            }
            c->srcs[c->n_srcs].canon = strdup(cn);
            if (!c->srcs[c->n_srcs].canon)
                return -ENOMEM;
            c->srcs[c->n_srcs].shard = s;
            c->srcs[c->n_srcs].t = &h->tensors[t];
            *slot = (int32_t) c->n_srcs++;
        }
    }
    if (n_main_mtp_ignored)
        line_add(&c->warnings, "%d MTP-layer tensors of %s ignored: MTP comes from --mtp-model %s",
                 n_main_mtp_ignored, c->dir, c->mtp_dir);
    if (n_mtpdir_trunk_ignored)
        line_add(&c->warnings, "%d non-MTP tensors of --mtp-model %s ignored (the trunk's are used)",
                 n_mtpdir_trunk_ignored, c->mtp_dir);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* plan */

static int check_divisible(struct ckpt *c, struct strbuf *probs)
{
    const struct model_config *m = &c->cfg;
    int N = c->opts.world_size, bad = 0;
    struct { const char *what; int v; } d[] = {
        { "num_attention_heads (full layers)", m->n_heads_full },
        { "attention_other_setting.num_attention_heads (sliding layers)", m->n_heads_sliding },
        { "num_attention_groups (KV heads)", m->n_kv_heads },
        { "intermediate_size (dense MLP)", m->intermediate_size },
        { "share_expert_dim", m->shared_expert_dim },
        { "moe_num_experts", m->n_experts },
        { "vocab_size (lm_head rows)", m->vocab_size },
    };
    for (size_t i = 0; i < ARRAY_SIZE(d); i++)
        if (d[i].v % N) {
            line_add(probs, "world size %d does not divide %s = %d", N, d[i].what, d[i].v);
            bad = 1;
        }
    return bad;
}

static void slice_plan(struct ckpt *c, struct pent *p)
{
    int N = c->opts.world_size, r = c->opts.rank;
    int64_t full;

    if (p->slice == SLICE_NONE || N == 1) {
        p->slice = SLICE_NONE;
        p->off = 0;
        p->len = p->shape[0];
        return;
    }
    full = p->slice == SLICE_ROWS ? p->shape[0] : p->shape[1];
    /* q/k/v/g rows and o columns split by heads (a whole number of heads per rank,
     * guaranteed by check_divisible); MLP rows/cols and lm_head rows split evenly */
    p->len = full / N;
    p->off = p->len * r;
}

static bool ent_matches(const struct ckpt *c, const struct pent *p, const struct sft_tensor *t)
{
    int lead = p->stacked ? 1 : 0;

    if (t->dtype != p->dtype && (p->dtype_alt == DTYPE_INVALID || t->dtype != p->dtype_alt))
        return false;
    if (t->ndim != p->ndim + lead || (p->stacked && t->shape[0] != c->cfg.n_experts))
        return false;
    for (int i = 0; i < p->ndim; i++)
        if (t->shape[i + lead] != p->shape[i])
            return false;
    return true;
}

/* "model.layers.L.moe.experts.E.gate_proj.weight" -> "model.layers.L.moe.gate_proj.weight" */
static void stacked_name(const char *name, char *buf, size_t size)
{
    const char *x = strstr(name, ".experts."), *after;

    if (!x) {
        snprintf(buf, size, "%s", name);
        return;
    }
    after = strchr(x + 9, '.');
    snprintf(buf, size, "%.*s%s", (int) (x - name), name, after ? after : "");
}

static int64_t ent_slice_bytes(const struct pent *p, const struct sft_tensor *t)
{
    int64_t bytes = (int64_t) (t->end - t->begin);
    if (p->stacked)
        return t->ndim && t->shape[0] ? bytes / t->shape[0] : 0;
    if (p->slice == SLICE_NONE || p->shape[p->slice == SLICE_ROWS ? 0 : 1] == 0)
        return bytes;
    return bytes / (p->slice == SLICE_ROWS ? p->shape[0] : p->shape[1]) * p->len;
}

/* The vision tower's tensors (common/vision-tensors.h), whole, on rank 0 when config.json
 * has a vision_config and images are on: each present with its exact shape, BF16 or F32. */
static int vision_plan(struct ckpt *c, struct strbuf *probs, int *first_err)
{
    int n = vision_tensor_count(&c->vis);

    if (!c->vis.present || c->opts.skip_vision || c->opts.rank != 0 || n == 0)
        return 0;
    c->vents = calloc((size_t) n, sizeof(*c->vents));
    if (!c->vents)
        return -ENOMEM;
    c->n_vents = n;
    for (int i = 0; i < n; i++) {
        struct vision_tensor vt;
        char alt[VISION_NAME_MAX + 8], want[64], got[64];
        const struct sft_tensor *t;
        int32_t *slot;
        bool ok;

        vision_tensor_get(&c->vis, i, &vt);
        HMAP_LOOKUP(&c->src_map, vt.name, SRC_KEY, slot);
        if (*slot < 0) {
            snprintf(alt, sizeof(alt), "model.%s", vt.name);
            HMAP_LOOKUP(&c->src_map, alt, SRC_KEY, slot);
        }
        c->vents[i].src = *slot;
        format_shape(want, sizeof(want), vt.ndim, vt.shape);
        if (*slot < 0) {
            line_add(probs, "missing: %s (BF16 %s): in no shard of %s (vision tower; "
                     "--limit-mm-per-prompt '{\"image\": 0}' serves text only)", vt.name, want, c->dir);
            *first_err = *first_err ? *first_err : -ENOENT;
            continue;
        }
        c->srcs[*slot].matched = true;
        t = c->srcs[*slot].t;
        ok = (t->dtype == DTYPE_BF16 || t->dtype == DTYPE_F32) && t->ndim == vt.ndim;
        for (int d = 0; ok && d < vt.ndim; d++)
            ok = t->shape[d] == vt.shape[d];
        if (!ok) {
            format_shape(got, sizeof(got), t->ndim, t->shape);
            line_add(probs, "mismatch: %s in %s: %s %s, expected BF16 or F32 %s", t->name,
                     sft_file_path(c->shards[c->srcs[*slot].shard].f), dtype_name(t->dtype), got, want);
            *first_err = *first_err ? *first_err : -EINVAL;
            c->vents[i].src = -1;
        }
    }
    return 0;
}

static int plan(struct ckpt *c, struct strbuf *probs, int *first_err)
{
    const struct model_config *m = &c->cfg;
    int N = c->opts.world_size, rank = c->opts.rank, K = c->opts.mtp_depth;
    int n_mtp_req = 0, r;
    struct strbuf unknown = STRBUF_INIT;
    int n_unknown = 0, n_vision = 0, n_kvq_ignored = 0, n_input_scale = 0;
    char kvq_example[SFT_NAME_MAX + 1] = "";

    c->expert_count = m->n_experts / N;
    c->expert_first = c->expert_count * rank;
    r = hmap_init(&c->ent_map, c->n_ents);
    if (r < 0)
        return r;
    for (size_t i = 0; i < c->n_ents; i++) {
        struct pent *p = &c->ents[i];
        int32_t *slot;
        HMAP_LOOKUP(&c->ent_map, p->name, ENT_KEY, slot);
        BUG_ON(*slot >= 0);
        *slot = (int32_t) i;
        HMAP_LOOKUP(&c->src_map, p->name, SRC_KEY, slot);
        p->src = *slot;
        if (p->src < 0 && p->expert >= 0) {
            /* the release's 3-D spelling: every expert of the layer in one tensor */
            char sn[SFT_NAME_MAX + 16];
            stacked_name(p->name, sn, sizeof(sn));
            HMAP_LOOKUP(&c->src_map, sn, SRC_KEY, slot);
            p->src = *slot;
            p->stacked = p->src >= 0;
        }
        if (p->src >= 0)
            c->srcs[p->src].matched = true;
    }
    if (m->tie_word_embeddings) {
        /* tie_word_embeddings: lm_head.weight names the embedding (its vocab rows
         * on this rank); a stored lm_head.weight would be ignored, so say so */
        struct pent *lm = &c->ents[2], *emb = &c->ents[0];
        BUG_ON(strcmp(lm->name, "lm_head.weight") != 0 || strcmp(emb->name, "model.embed_tokens.weight") != 0);
        if (lm->src >= 0)
            line_add(&c->warnings, "tie_word_embeddings is true: the stored lm_head.weight is ignored (the embedding is used)");
        lm->src = emb->src;
    }

    /* MTP requested but incomplete: every missing name in the warnings, and the plan
     * without speculation (the trunk serves; a missing draft costs speculation only) */
    c->mtp_depth = K;
    if (K > 0) {
        struct strbuf miss = STRBUF_INIT;
        int n_missing = 0;

        for (size_t i = 0; i < c->n_ents; i++) {
            const struct pent *p = &c->ents[i];
            if (p->layer >= m->n_layers && p->layer < m->n_layers + K) {
                n_mtp_req++;
                if (p->src < 0) {
                    n_missing++;
                    line_add(&miss, "MTP tensor missing: %s (%s)", p->name, dtype_name(p->dtype));
                }
            }
        }
        if (n_missing == n_mtp_req)
            line_add(&c->warnings, "MTP requested (K=%d) but none of the %d tensors of layers %d..%d are in %s: "
                     "serving without speculation (the trunk only)", K, n_mtp_req, m->n_layers,
                     m->n_layers + K - 1, c->mtp_dir ? c->mtp_dir : c->dir);
        else if (n_missing)
            line_add(&c->warnings, "MTP requested (K=%d) but %d of the %d tensors of layers %d..%d are missing from "
                     "%s: serving without speculation (the trunk only)\n%.*s", K, n_missing, n_mtp_req, m->n_layers,
                     m->n_layers + K - 1, c->mtp_dir ? c->mtp_dir : c->dir, (int) (miss.len ? miss.len - 1 : 0),
                     strbuf_str(&miss));
        if (miss.oom)
            c->warnings.oom = true;
        strbuf_done(&miss);
        if (n_missing)
            c->mtp_depth = 0;
    }

    for (size_t i = 0; i < c->n_ents; i++) {
        struct pent *p = &c->ents[i];
        const struct sft_tensor *t;
        char want[64], got[64];

        if (p->layer >= m->n_layers)
            p->needed = rank == 0 && p->layer < m->n_layers + c->mtp_depth;
        else if (p->expert >= 0)
            p->needed = p->expert >= c->expert_first && p->expert < c->expert_first + c->expert_count;
        else
            p->needed = true;
        if (!p->needed)
            continue;
        slice_plan(c, p);
        if (p->src < 0) {
            format_shape(want, sizeof(want), p->ndim, p->shape);
            if (p->expert >= 0) {
                char sn[SFT_NAME_MAX + 16];
                stacked_name(p->name, sn, sizeof(sn));
                line_add(probs, "missing: %s (%s %s, or %s stacked [%d, ...]): in no shard of %s", p->name,
                         dtype_name(p->dtype), want, sn, m->n_experts,
                         p->layer >= m->n_layers && c->mtp_dir ? c->mtp_dir : c->dir);
            } else {
                line_add(probs, "missing: %s (%s %s): in no shard of %s", p->name, dtype_name(p->dtype), want,
                         p->layer >= m->n_layers && c->mtp_dir ? c->mtp_dir : c->dir);
            }
            *first_err = *first_err ? *first_err : -ENOENT;
            continue;
        }
        t = c->srcs[p->src].t;
        if (!ent_matches(c, p, t)) {
            int64_t sh[TENSOR_MAX_DIMS] = { m->n_experts };
            if (c->srcs[p->src].reported)
                continue;
            c->srcs[p->src].reported = p->stacked;
            for (int d = 0; d < p->ndim; d++)
                sh[d + p->stacked] = p->shape[d];
            format_shape(want, sizeof(want), p->ndim + p->stacked, sh);
            format_shape(got, sizeof(got), t->ndim, t->shape);
            line_add(probs, "mismatch: %s in %s: %s %s, expected %s%s%s %s", p->stacked ? t->name : p->name,
                     sft_file_path(c->shards[c->srcs[p->src].shard].f), dtype_name(t->dtype), got,
                     dtype_name(p->dtype), p->dtype_alt ? " or " : "",
                     p->dtype_alt ? dtype_name(p->dtype_alt) : "", want);
            *first_err = *first_err ? *first_err : -EINVAL;
            continue;
        }
        if (p->slice != SLICE_NONE && p->shape[p->slice == SLICE_ROWS ? 0 : 1] % N) {
            /* a scale tensor whose blocks or groups do not split evenly over the ranks */
            line_add(probs, "%s: its %s (%lld) do not split over world size %d", p->name,
                     p->slice == SLICE_ROWS ? "rows" : "columns",
                     (long long) p->shape[p->slice == SLICE_ROWS ? 0 : 1], N);
            *first_err = *first_err ? *first_err : -EINVAL;
        }
    }

    r = vision_plan(c, probs, first_err);
    if (r < 0)
        return r;

    /* optional parameters and unknown tensors */
    for (size_t i = 0; i < c->n_srcs; i++) {
        struct src *s = &c->srcs[i];
        const struct sft_tensor *t = s->t;
        int l;

        if (s->matched)
            continue;
        l = name_layer(s->canon);
        if (ckpt_name_is_optional(s->canon)) {
            /* the optional-parameter rule: by suffix, whatever the shape or dtype.  Only
             * the ones the KV cache reads (opts.kv_params) are planned, as their flat
             * values; the reader judges them (ckpt_get_optional) */
            bool in_plan, mtp = l >= m->n_layers;
            int64_t numel = 1;
            int err;

            s->matched = true;
            if (l >= m->n_layers_total)
                goto unknown;
            in_plan = !mtp || (rank == 0 && l < m->n_layers + c->mtp_depth);
            if (!in_plan)
                continue;
            if (!(c->opts.kv_params & 1u << tensor_optional_index(s->canon))) {
                if (n_kvq_ignored++ == 0)
                    snprintf(kvq_example, sizeof(kvq_example), "%s", s->canon);
                continue;
            }
            for (int d = 0; d < t->ndim; d++)
                numel *= t->shape[d];
            /* per-head values are this rank's heads when they split evenly */
            err = ent_add(c, s->canon, t->dtype, 1, numel, 0, l, -1,
                          numel > 1 && !mtp && numel % N == 0 ? SLICE_ROWS : SLICE_NONE);
            if (err < 0)
                return err;
            {
                struct pent *p = &c->ents[c->n_ents - 1];
                int32_t *slot;
                p->optional = true;
                p->needed = true;
                p->src = (int) i;
                /* planned as flat values: scalar [] stays rank 0, anything else [numel] */
                p->ndim = t->ndim ? 1 : 0;
                p->shape[0] = numel;
                slice_plan(c, p);
                if (p->ndim == 0)
                    p->slice = SLICE_NONE;
                /* ent_map was sized for the expected list: grow by rebuilding */
                if ((c->n_ents * 2 + 1) > c->ent_map.mask) {
                    free(c->ent_map.slot);
                    err = hmap_init(&c->ent_map, c->n_ents * 2);
                    if (err < 0)
                        return err;
                    for (size_t j = 0; j < c->n_ents; j++) {
                        HMAP_LOOKUP(&c->ent_map, c->ents[j].name, ENT_KEY, slot);
                        *slot = (int32_t) j;
                    }
                } else {
                    HMAP_LOOKUP(&c->ent_map, p->name, ENT_KEY, slot);
                    *slot = (int32_t) (c->n_ents - 1);
                }
            }
            continue;
        }
unknown:
        if (m->quant == QUANT_NVFP4 && strlen(s->canon) > 12 &&
            strcmp(s->canon + strlen(s->canon) - 12, ".input_scale") == 0) {
            /* W4A4 activation scales: the kernels keep activations unquantised */
            n_input_scale++;
            continue;
        }
        if (!c->vents && vision_name_is(s->canon, NULL)) {
            n_vision++;
            continue;
        }
        if (n_unknown++ < WARN_LIST_MAX)
            line_add(&unknown, "unknown tensor %s in %s (ignored)", t->name,
                     sft_file_path(c->shards[s->shard].f));
    }
    if (unknown.len)
        line_add(&c->warnings, "%.*s", (int) unknown.len - 1, unknown.p);
    if (n_unknown > WARN_LIST_MAX)
        line_add(&c->warnings, "... and %d more unknown tensors (ignored)", n_unknown - WARN_LIST_MAX);
    if (n_vision && c->opts.skip_vision)
        line_add(&c->warnings, "%d vision tensors skipped (images off: --limit-mm-per-prompt image 0)", n_vision);
    else if (n_vision && rank == 0)
        line_add(&c->warnings, "%d vision tensors ignored (config.json has no vision_config)", n_vision);
    if (n_input_scale)
        line_add(&c->warnings, "%d NVFP4 input_scale tensors ignored: activations are not quantised (W4A16)",
                 n_input_scale);
    if (n_kvq_ignored)
        line_add(&c->warnings, "%d KV-quantisation parameters ignored: the KV cache does not use them "
                 "(e.g. %s)", n_kvq_ignored, kvq_example);
    strbuf_done(&unknown);
    return 0;
}

/* ------------------------------------------------------------------------ */

int ckpt_open(const char *dir, const struct ckpt_opts *opts, struct ckpt **ret, struct err_buf *e)
{
    struct strbuf probs = STRBUF_INIT;
    struct ckpt *c;
    char path[PATH_MAX];
    int first_err = 0, r, ws = opts ? opts->world_size : 0;

    *ret = NULL;
    if (opts && opts->ret_report)
        *opts->ret_report = NULL;
    if (!opts || !dir)
        return err_set(e, -EINVAL, "ckpt_open: no directory or options");
    if (ws != 1 && ws != 2 && ws != 4 && ws != 8)
        return err_set(e, -EINVAL, "world size %d is not 1, 2, 4 or 8", ws);
    if (opts->rank < 0 || opts->rank >= ws)
        return err_set(e, -EINVAL, "rank %d is not in [0, %d)", opts->rank, ws);
    if (opts->mtp_depth < 0)
        return err_set(e, -EINVAL, "MTP depth %d is negative", opts->mtp_depth);
    c = calloc(1, sizeof(*c));
    if (!c)
        return err_set(e, -ENOMEM, "out of memory");
    pthread_mutex_init(&c->copy_lock, NULL);
    c->opts = *opts;
    c->opts.ret_report = NULL;
    c->dir = strdup(dir);
    c->mtp_dir = opts->mtp_dir ? strdup(opts->mtp_dir) : NULL;
    c->opts.mtp_dir = c->mtp_dir;
    if (!c->dir || (opts->mtp_dir && !c->mtp_dir)) {
        r = err_set(e, -ENOMEM, "out of memory");
        goto fail;
    }
    snprintf(path, sizeof(path), "%s/config.json", dir);
    r = model_config_load(path, &c->cfg, e);
    if (r < 0)
        goto fail;
    if (opts->mtp_depth > c->cfg.n_mtp_layers) {
        r = err_set(e, -EINVAL, "MTP depth %d requested but %s declares num_nextn_predict_layers = %d",
                    opts->mtp_depth, path, c->cfg.n_mtp_layers);
        goto fail;
    }
    if (c->cfg.notes[0])
        line_add(&c->warnings, "%s: %s", path, c->cfg.notes);
    if (!opts->skip_vision) {
        r = vision_config_load(dir, c->cfg.hidden_size, &c->vis, e);
        if (r < 0)
            goto fail;
    }
    if (check_divisible(c, &probs)) {
        r = -EINVAL;
        goto report;
    }
    r = open_dir(c, dir, false, &probs, &first_err);
    if (r < 0)
        goto oom;
    if (c->mtp_dir && opts->mtp_depth > 0) {
        r = open_dir(c, c->mtp_dir, true, &probs, &first_err);
        if (r < 0)
            goto oom;
    }
    /* a broken shard or index makes every tensor it holds "missing": report the
     * structural problems alone */
    if (probs.len) {
        r = first_err ? first_err : -EINVAL;
        goto report;
    }
    r = build_sources(c, &probs, &first_err);
    if (r < 0)
        goto oom;
    r = build_expected(c, &probs);
    if (r < 0)
        goto oom;
    if (probs.len && !first_err)
        first_err = -EINVAL;
    r = plan(c, &probs, &first_err);
    if (r < 0)
        goto oom;
    if (probs.oom || c->warnings.oom) {
        r = -ENOMEM;
        goto oom;
    }
    if (probs.len) {
        r = first_err ? first_err : -EINVAL;
        goto report;
    }
    strbuf_done(&probs);
    *ret = c;
    return 0;

oom:
    r = err_set(e, r, "%s: %s while planning", dir, err_str(r));
    goto fail;
report:
    {
        size_t used;
        const char *p = strbuf_str(&probs);
        int shown = 0, n_lines = lines_count(&probs);
        used = (size_t) snprintf(e->msg, sizeof(e->msg), "%s: %d problem%s (world size %d, rank %d):",
                                 dir, n_lines, n_lines == 1 ? "" : "s", ws, opts->rank);
        /* as many whole lines as fit, then a count of the rest */
        while (p && *p) {
            const char *nl = strchr(p, '\n');
            size_t ln = nl ? (size_t) (nl - p) : strlen(p);
            if (used + ln + 2 + 48 >= sizeof(e->msg))
                break;
            used += (size_t) snprintf(e->msg + used, sizeof(e->msg) - used, "\n%.*s", (int) ln, p);
            shown++;
            p = nl ? nl + 1 : p + ln;
        }
        if (shown < n_lines)
            snprintf(e->msg + used, sizeof(e->msg) - used, "\n... and %d more (full list: stepd-inspect)",
                     n_lines - shown);
        if (opts->ret_report)
            *opts->ret_report = strbuf_take(&probs);
    }
fail:
    strbuf_done(&probs);
    ckpt_close(c);
    return r;
}

void ckpt_close(struct ckpt *c)
{
    if (!c)
        return;
    for (size_t i = 0; i < c->n_ents; i++) {
        free(c->ents[i].name);
        free(c->ents[i].copy);
    }
    free(c->ents);
    free(c->vents);
    free(c->ent_map.slot);
    for (size_t i = 0; i < c->n_srcs; i++)
        free(c->srcs[i].canon);
    free(c->srcs);
    free(c->src_map.slot);
    for (int s = 0; s < c->n_shards; s++) {
        sft_close(c->shards[s].f);
        free(c->shards[s].name);
    }
    free(c->shards);
    strbuf_done(&c->warnings);
    free(c->dir);
    free(c->mtp_dir);
    pthread_mutex_destroy(&c->copy_lock);
    free(c);
}

const struct model_config *ckpt_config(const struct ckpt *c) { return &c->cfg; }
int ckpt_mtp_depth(const struct ckpt *c) { return c->mtp_depth; }
const char *ckpt_warnings(const struct ckpt *c) { return strbuf_str(&c->warnings); }

void ckpt_expert_range(const struct ckpt *c, int *first, int *count)
{
    *first = c->expert_first;
    *count = c->expert_count;
}

void ckpt_plan_stats(const struct ckpt *c, struct ckpt_plan_stats *ret)
{
    memset(ret, 0, sizeof(*ret));
    for (size_t i = 0; i < c->n_ents; i++) {
        const struct pent *p = &c->ents[i];
        if (!p->needed || p->src < 0)
            continue;
        ret->n_tensors++;
        ret->bytes += ent_slice_bytes(p, c->srcs[p->src].t);
    }
    for (int i = 0; i < c->n_vents; i++) {
        const struct sft_tensor *t;
        if (c->vents[i].src < 0)
            continue;
        t = c->srcs[c->vents[i].src].t;
        ret->vision_tensors++;
        ret->vision_bytes += (int64_t) (t->end - t->begin);
    }
    ret->n_tensors += ret->vision_tensors;
    ret->bytes += ret->vision_bytes;
    ret->expert_first = c->expert_first;
    ret->expert_count = c->expert_count;
}

const struct vision_config *ckpt_vision(const struct ckpt *c)
{
    return c->n_vents ? &c->vis : NULL;
}

/* A vision tensor of the plan, whole. */
static int vision_get(struct ckpt *c, const char *name, struct tview *ret)
{
    const char *want;

    if (!vision_name_is(name, &want))
        return -ENOENT;
    for (int i = 0; i < c->n_vents; i++) {
        const struct src *s;
        const char *cn;

        if (c->vents[i].src < 0)
            continue;
        s = &c->srcs[c->vents[i].src];
        if (!vision_name_is(s->canon, &cn) || strcmp(cn, want) != 0)
            continue;
        if (c->opts.headers_only)
            return -ENODATA;
        sft_file_view(c->shards[s->shard].f, s->t, ret);
        if (!atomic_flag_test_and_set(&c->vents[i].counted))
            atomic_fetch_add(&c->got_bytes, (int64_t) (s->t->end - s->t->begin));
        return 0;
    }
    return -ENOENT;
}

void ckpt_load_progress(const struct ckpt *c, int64_t *done, int64_t *total)
{
    struct ckpt_plan_stats ps;

    ckpt_plan_stats(c, &ps);
    *total = ps.bytes;
    *done = atomic_load(&((struct ckpt *)c)->got_bytes);
}

static struct pent *ent_find(struct ckpt *c, const char *name)
{
    char buf[SFT_NAME_MAX + 16];
    const char *cn = canon_name(name, buf, sizeof(buf));
    int32_t *slot;

    if (!c->ent_map.slot)
        return NULL;
    HMAP_LOOKUP(&c->ent_map, cn, ENT_KEY, slot);
    return *slot >= 0 ? &c->ents[*slot] : NULL;
}

int ckpt_get(struct ckpt *c, const char *name, struct tview *ret)
{
    struct pent *p = ent_find(c, name);
    const struct src *s;
    struct tview full;
    size_t esz;

    memset(ret, 0, sizeof(*ret));
    if (!p && c->n_vents)
        return vision_get(c, name, ret);
    if (!p || !p->needed || p->src < 0)
        return -ENOENT;
    if (c->opts.headers_only)
        return -ENODATA;
    s = &c->srcs[p->src];
    sft_file_view(c->shards[s->shard].f, s->t, &full);
    if (p->stacked) {
        /* this expert's [out, in] of the [n_experts, out, in] tensor: a view, so a rank
         * touches the pages of its own experts only */
        size_t per = full.nbytes / (size_t) full.shape[0];
        full.data = (const unsigned char *) full.data + per * (size_t) p->expert;
        full.nbytes = per;
        full.ndim--;
        memmove(full.shape, full.shape + 1, (size_t) full.ndim * sizeof(full.shape[0]));
    }
    if (p->optional && full.ndim > 1) {
        /* an optional parameter of any shape is read as its flat values */
        full.shape[0] = tview_numel(&full);
        full.ndim = 1;
    }
    *ret = full;
    if (!atomic_flag_test_and_set(&p->counted))
        atomic_fetch_add(&c->got_bytes, ent_slice_bytes(p, s->t));
    if (p->slice == SLICE_NONE)
        return 0;
    esz = (size_t) dtype_bits(full.dtype) / 8;
    if (p->slice == SLICE_ROWS) {
        size_t row = full.nbytes / (size_t) full.shape[0];
        ret->data = (const unsigned char *) full.data + row * (size_t) p->off;
        ret->shape[0] = p->len;
        ret->nbytes = row * (size_t) p->len;
        return 0;
    }
    /* columns: copy once */
    pthread_mutex_lock(&c->copy_lock);
    if (!p->copy) {
        size_t rows = (size_t) full.shape[0], src_row = (size_t) full.shape[1] * esz;
        size_t dst_row = (size_t) p->len * esz;
        unsigned char *dst = malloc(rows * dst_row > 0 ? rows * dst_row : 1);
        if (!dst) {
            pthread_mutex_unlock(&c->copy_lock);
            return -ENOMEM;
        }
        for (size_t i = 0; i < rows; i++)
            memcpy(dst + i * dst_row, (const unsigned char *) full.data + i * src_row + (size_t) p->off * esz,
                   dst_row);
        p->copy = dst;
    }
    pthread_mutex_unlock(&c->copy_lock);
    ret->data = p->copy;
    ret->shape[1] = p->len;
    ret->nbytes = (size_t) full.shape[0] * (size_t) p->len * esz;
    return 0;
}

static float bf16_to_f32(const unsigned char *b)
{
    uint32_t u = (uint32_t) b[0] << 16 | (uint32_t) b[1] << 24;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

int ckpt_get_optional(struct ckpt *c, const char *name, float def, float *out, int n)
{
    struct tview v;
    int64_t numel;
    int r;

    if (n <= 0)
        return -EINVAL;
    r = ckpt_get(c, name, &v);
    if (r == -ENOENT) {
        for (int i = 0; i < n; i++)
            out[i] = def;
        return 0;
    }
    if (r < 0)
        return r;
    numel = tview_numel(&v);
    if ((numel != 1 && numel != n) || (v.dtype != DTYPE_F32 && v.dtype != DTYPE_BF16))
        return -EINVAL;
    for (int i = 0; i < n; i++) {
        const unsigned char *b = (const unsigned char *) v.data + (size_t) (numel == 1 ? 0 : i) *
                                 (size_t) (dtype_bits(v.dtype) / 8);
        if (v.dtype == DTYPE_F32)
            memcpy(&out[i], b, sizeof(float));
        else
            out[i] = bf16_to_f32(b);
    }
    return 1;
}

void ckpt_plan_dump(const struct ckpt *c, FILE *f)
{
    for (size_t i = 0; i < c->n_ents; i++) {
        const struct pent *p = &c->ents[i];
        char shape[64];
        if (!p->needed || p->src < 0)
            continue;
        format_shape(shape, sizeof(shape), p->ndim, p->shape);
        fprintf(f, "%s %s %s %s", p->name, dtype_name(c->srcs[p->src].t->dtype), shape,
                p->slice == SLICE_ROWS ? "rows" : p->slice == SLICE_COLS ? "cols" : "full");
        if (p->slice != SLICE_NONE)
            fprintf(f, "[%lld:%lld]", (long long) p->off, (long long) (p->off + p->len));
        fprintf(f, " %lld%s\n", (long long) ent_slice_bytes(p, c->srcs[p->src].t), p->optional ? " optional" : "");
    }
    for (int i = 0; i < c->n_vents; i++) {
        const struct sft_tensor *t;
        char shape[64];
        if (c->vents[i].src < 0)
            continue;
        t = c->srcs[c->vents[i].src].t;
        format_shape(shape, sizeof(shape), t->ndim, t->shape);
        fprintf(f, "%s %s %s full %lld vision\n", t->name, dtype_name(t->dtype), shape,
                (long long) (t->end - t->begin));
    }
}
