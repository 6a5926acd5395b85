/* ckptw.c - see ckptw.h.  Clarity over speed: ckptw_write builds each shard in memory (the
 * tests' tiny models); stepd-mkmodel uses the layout, header and config parts and streams its
 * own data. */
#include "ckptw.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "mxfp4.h"
#include "splitmix.h"
#include "strbuf.h"

/* ------------------------------------------------------------------------ */
/* numbers */

uint16_t ckptw_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t) ((u >> 16) | 0x40);   /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t) (u >> 16);
}

float ckptw_bf16_to_f32(uint16_t b)
{
    uint32_t u = (uint32_t) b << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char) *s) * 1099511628211ull;
    return h;
}

float ckptw_random_value(uint64_t seed, const char *name, int64_t i, float scale)
{
    uint64_t r = splitmix64(splitmix64(seed ^ name_hash(name)) + (uint64_t) i);
    double u = (double) (r >> 11) / (double) (1ull << 53);   /* [0, 1) */
    return (float) ((2.0 * u - 1.0) * scale);
}

int64_t ckptw_tensor_bytes(enum dtype dt, int ndim, const int64_t *shape)
{
    uint64_t n = 1, bits;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || __builtin_mul_overflow(n, (uint64_t) shape[i], &n))
            return -1;
    }
    if (__builtin_mul_overflow(n, (uint64_t) dtype_bits(dt), &bits) || bits % 8 || bits / 8 > INT64_MAX)
        return -1;
    return (int64_t) (bits / 8);
}

/* ------------------------------------------------------------------------ */
/* the tensor list of a model */

struct genlist {
    struct ckptw_entry *v;
    size_t n, cap;
};

static struct ckptw_entry *gen_push(struct genlist *l)
{
    if (l->n == l->cap) {
        size_t nc = l->cap ? l->cap * 2 : 128;
        struct ckptw_entry *nv = realloc(l->v, nc * sizeof(*nv));
        if (!nv)
            return NULL;
        l->v = nv;
        l->cap = nc;
    }
    memset(&l->v[l->n], 0, sizeof(l->v[l->n]));
    return &l->v[l->n++];
}

static int add(struct genlist *l, enum ckptw_kind k, enum dtype dt, int ndim, int64_t d0, int64_t d1,
               bool mtp, const char *fmt, ...) __attribute__((format(printf, 8, 9)));
static int add(struct genlist *l, enum ckptw_kind k, enum dtype dt, int ndim, int64_t d0, int64_t d1,
               bool mtp, const char *fmt, ...)
{
    struct ckptw_entry *g = gen_push(l);
    va_list ap;
    if (!g)
        return -ENOMEM;
    va_start(ap, fmt);
    vsnprintf(g->name, sizeof(g->name), fmt, ap);
    va_end(ap);
    g->kind = k;
    g->dtype = dt;
    g->ndim = ndim;
    g->shape[0] = d0;
    g->shape[1] = d1;
    g->mtp = mtp;
    return 0;
}

#define A(...) do { int _r = add(__VA_ARGS__); if (_r < 0) return _r; } while (0)

static int add_optional(struct genlist *l, const struct ckptw_opts *o, int layer, int kv, bool mtp)
{
    static const char *const sc[2] = { "k_scale", "v_scale" }, *const zp[2] = { "k_zero_point", "v_zero_point" };
    for (int i = 0; i < 2; i++) {
        if (o->kv_scales != CKPTW_OPT_NONE)
            A(l, CKPTW_OPT_SCALE, DTYPE_F32, o->kv_scales == CKPTW_OPT_PER_HEAD ? 1 : 0, kv, 0, mtp,
              "model.layers.%d.self_attn.%s", layer, sc[i]);
        if (o->zero_points != CKPTW_OPT_NONE)
            A(l, CKPTW_OPT_ZP, DTYPE_F32, o->zero_points == CKPTW_OPT_PER_HEAD ? 1 : 0, kv, 0, mtp,
              "model.layers.%d.self_attn.%s", layer, zp[i]);
    }
    return 0;
}


/* The tensors of linear module base (docs/MODEL.md §5; the loader's add_linear): the
 * logical float tensor "<base>.weight" [out, in] in format q, stacked [stack, ...] when
 * stack > 0. */
static int add_linear(struct genlist *l, const struct model_config *c, const char *base, enum quant_scheme q,
                      int64_t out, int64_t in, int stack, bool mtp)
{
    struct { const char *sfx; enum ckptw_kind k; enum dtype dt; int ndim; int64_t d0, d1; } t[3];
    int n = 0;

    switch (q) {
    case QUANT_MXFP4:
        t[n++] = (typeof(t[0])) { ".weight_packed", CKPTW_PACKED, DTYPE_U8, 2, out, in / 2 };
        t[n++] = (typeof(t[0])) { ".weight_scale", CKPTW_SCALE, DTYPE_U8, 2, out, in / 32 };
        break;
    case QUANT_FP8:
        t[n++] = (typeof(t[0])) { ".weight", CKPTW_FP8, DTYPE_F8_E4M3, 2, out, in };
        t[n++] = (typeof(t[0])) { ".weight_scale_inv", CKPTW_FP8_SCALE, DTYPE_F32, 2,
                                  out / c->quant_block_rows, in / c->quant_group_size };
        break;
    case QUANT_NVFP4:
        t[n++] = (typeof(t[0])) { ".weight", CKPTW_NV_PACKED, DTYPE_U8, 2, out, in / 2 };
        t[n++] = (typeof(t[0])) { ".weight_scale", CKPTW_NV_SCALE, DTYPE_F8_E4M3, 2, out, in / 16 };
        t[n++] = (typeof(t[0])) { ".weight_scale_2", CKPTW_NV_GSCALE, DTYPE_F32, 0, 0, 0 };
        break;
    default:
        t[n++] = (typeof(t[0])) { ".weight", CKPTW_DENSE, DTYPE_BF16, 2, out, in };
        break;
    }
    for (int i = 0; i < n; i++) {
        struct ckptw_entry *g;
        A(l, t[i].k, t[i].dt, t[i].ndim, t[i].d0, t[i].d1, mtp, "%s%s", base, t[i].sfx);
        g = &l->v[l->n - 1];
        if (stack) {
            memmove(g->shape + 1, g->shape, 2 * sizeof(g->shape[0]));
            g->shape[0] = stack;
            g->ndim++;
        }
        g->lout = out;
        g->lin = in;
        g->br = c->quant_block_rows;
        g->bc = c->quant_group_size;
        g->stack = stack;
        snprintf(g->base, sizeof(g->base), "%s.weight", base);
    }
    return 0;
}

/* module mod of layer i (expert e, or -1) */
#define LIN(mod, e, out, in) do { \
        char _b[160], _m[128]; \
        snprintf(_b, sizeof(_b), "model.layers.%d.%s", i, quant_module_name(mod, e, _m, sizeof(_m))); \
        int _r = add_linear(l, c, _b, c->quant ? (enum quant_scheme) L->qfmt[mod] : QUANT_NONE, out, in, 0, m); \
        if (_r < 0) return _r; \
    } while (0)
#define L2(base, mod, out, in, stack) do { \
        int _r = add_linear(l, c, base, c->quant ? (enum quant_scheme) L->qfmt[mod] : QUANT_NONE, out, in, stack, m); \
        if (_r < 0) return _r; \
    } while (0)

static int build_list(const struct model_config *c, const struct ckptw_opts *o, struct genlist *l)
{
    const int64_t H = c->hidden_size, V = c->vocab_size;
    int n_layers = c->n_layers + (o->write_mtp ? c->n_mtp_layers : 0);

    A(l, CKPTW_DENSE, DTYPE_BF16, 2, V, H, false, "model.embed_tokens.weight");
    for (int i = 0; i < n_layers; i++) {
        const struct layer_config *L = &c->layers[i];
        const int64_t nh = L->n_heads, kv = L->n_kv_heads, hd = L->head_dim;
        bool m = L->is_mtp;

        if (m) {
            A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, m, "model.layers.%d.enorm.weight", i);
            A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, m, "model.layers.%d.hnorm.weight", i);
            LIN(QMOD_EH_PROJ, -1, H, 2 * H);
        }
        A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, m, "model.layers.%d.input_layernorm.weight", i);
        A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, m, "model.layers.%d.post_attention_layernorm.weight", i);
        LIN(QMOD_Q, -1, nh * hd, H);
        LIN(QMOD_K, -1, kv * hd, H);
        LIN(QMOD_V, -1, kv * hd, H);
        LIN(QMOD_O, -1, H, nh * hd);
        if (c->use_head_wise_attn_gate)
            LIN(QMOD_G, -1, nh, H);
        if (c->use_qk_norm) {
            A(l, CKPTW_DENSE, DTYPE_BF16, 1, hd, 0, m, "model.layers.%d.self_attn.q_norm.weight", i);
            A(l, CKPTW_DENSE, DTYPE_BF16, 1, hd, 0, m, "model.layers.%d.self_attn.k_norm.weight", i);
        }
        if ((m && o->optional_mtp) || (!m && o->optional_trunk)) {
            int r = add_optional(l, o, i, (int) kv, m);
            if (r < 0)
                return r;
        }
        if (!L->is_moe) {
            const int64_t I = c->intermediate_size;
            LIN(QMOD_MLP_GATE, -1, I, H);
            LIN(QMOD_MLP_UP, -1, I, H);
            LIN(QMOD_MLP_DOWN, -1, H, I);
        } else {
            const int64_t E = c->n_experts, S = c->shared_expert_dim, M = c->moe_intermediate_size;
            LIN(QMOD_ROUTER, -1, E, H);
            if (c->use_router_bias)
                A(l, CKPTW_F32, DTYPE_F32, 1, E, 0, m, "model.layers.%d.moe.router_bias", i);
            LIN(QMOD_SHARED_GATE, -1, S, H);
            LIN(QMOD_SHARED_UP, -1, S, H);
            LIN(QMOD_SHARED_DOWN, -1, H, S);
            if (o->stacked_experts) {
                for (int k = 0; k < 3; k++) {
                    enum quant_module q = (enum quant_module) (QMOD_EXPERT_GATE + k);
                    char b[160], mn[128];
                    snprintf(b, sizeof(b), "model.layers.%d.moe.%s", i, strrchr(quant_module_name(q, 0, mn, sizeof(mn)), '.') + 1);
                    L2(b, q, k < 2 ? M : H, k < 2 ? H : M, (int) E);
                }
            } else {
                for (int e = 0; e < E; e++)
                    for (int k = 0; k < 3; k++)
                        LIN((enum quant_module) (QMOD_EXPERT_GATE + k), e, k < 2 ? M : H, k < 2 ? H : M);
            }
        }
        if (m) {
            A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, m, "model.layers.%d.transformer.shared_head.norm.weight", i);
            LIN(QMOD_HEAD_OUT, -1, V, H);
        }
    }
    A(l, CKPTW_DENSE, DTYPE_BF16, 1, H, 0, false, "model.norm.weight");
    if (!c->tie_word_embeddings)
        { int _r = add_linear(l, c, "lm_head", c->quant ? (enum quant_scheme) c->lm_head_qfmt : QUANT_NONE, V, H, 0, false); if (_r < 0) return _r; }
    for (int i = 0; o->extra && o->extra[i]; i++)
        A(l, CKPTW_RAW, DTYPE_BF16, 1, 4, 0, false, "%s", o->extra[i]);
    return 0;
}
#undef A
#undef LIN
#undef L2

int ckptw_layout(const struct model_config *cfg, const struct ckptw_opts *o,
                 struct ckptw_entry **ret, size_t *ret_n)
{
    struct genlist l = { 0 };
    int r = build_list(cfg, o, &l);

    if (r < 0) {
        free(l.v);
        return r;
    }
    *ret = l.v;
    *ret_n = l.n;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* data */

static int gen_floats(const struct ckptw_opts *o, const char *name, int ndim, const int64_t *shape,
                      float **ret)
{
    int64_t n = 1;
    float *v;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    v = malloc((size_t) (n ? n : 1) * sizeof(float));
    if (!v)
        return -ENOMEM;
    if (!o->fill || o->fill(o->fill_user, name, ndim, shape, v) == 0)
        for (int64_t i = 0; i < n; i++)
            v[i] = ckptw_random_value(o->seed, name, i, o->init_scale);
    *ret = v;
    return 0;
}

/* "model.layers.L.moe.X" -> "model.layers.L.moe.experts.E.X" (a stacked name's expert e) */
static void expert_name(char *buf, size_t size, const char *stacked, int e)
{
    const char *p = strstr(stacked, ".moe.");
    if (!p)
        snprintf(buf, size, "%s", stacked);
    else
        snprintf(buf, size, "%.*s.moe.experts.%d.%s", (int) (p - stacked), stacked, e, p + 5);
}

static int gen_bytes(const struct ckptw_opts *o, const struct ckptw_entry *g, int64_t nbytes, unsigned char **ret);

/* a stacked tensor: expert e's bytes are those of its per-expert tensor */
static int gen_stacked(const struct ckptw_opts *o, const struct ckptw_entry *g, int64_t nbytes, unsigned char **ret)
{
    struct ckptw_entry one = *g;
    int64_t per = nbytes / g->stack;
    unsigned char *b = malloc((size_t) (nbytes ? nbytes : 1));

    if (!b)
        return -ENOMEM;
    one.stack = 0;
    one.ndim = g->ndim - 1;
    memmove(one.shape, g->shape + 1, (size_t) one.ndim * sizeof(one.shape[0]));
    for (int e = 0; e < g->stack; e++) {
        unsigned char *piece;
        int r;
        expert_name(one.name, sizeof(one.name), g->name, e);
        expert_name(one.base, sizeof(one.base), g->base, e);
        r = gen_bytes(o, &one, per, &piece);
        if (r < 0) {
            free(b);
            return r;
        }
        memcpy(b + per * e, piece, (size_t) per);
        free(piece);
    }
    *ret = b;
    return 0;
}

/* Produce the bytes of g (nbytes); caller frees. */
static int gen_bytes(const struct ckptw_opts *o, const struct ckptw_entry *g, int64_t nbytes, unsigned char **ret)
{
    unsigned char *b;
    float *f = NULL;
    int r = 0;

    if (g->stack > 0)
        return gen_stacked(o, g, nbytes, ret);
    b = calloc(1, (size_t) (nbytes ? nbytes : 1));
    if (!b)
        return -ENOMEM;
    switch (g->kind) {
    case CKPTW_DENSE:
    case CKPTW_F32: {
        int64_t n = nbytes / (g->dtype == DTYPE_F32 ? 4 : 2);
        r = gen_floats(o, g->name, g->ndim, g->shape, &f);
        if (r < 0)
            break;
        for (int64_t i = 0; i < n; i++) {
            if (g->dtype == DTYPE_F32) {
                memcpy(b + 4 * i, &f[i], 4);
            } else {
                uint16_t h = ckptw_f32_to_bf16(f[i]);
                b[2 * i] = (unsigned char) h;
                b[2 * i + 1] = (unsigned char) (h >> 8);
            }
        }
        break;
    }
    case CKPTW_PACKED:
    case CKPTW_SCALE: {
        int64_t lshape[2] = { g->lout, g->lin };
        uint8_t *scale_row = malloc((size_t) g->lin / 32), *packed_row = malloc((size_t) g->lin / 2);
        if (!scale_row || !packed_row) {
            free(scale_row);
            free(packed_row);
            r = -ENOMEM;
            break;
        }
        r = gen_floats(o, g->base, 2, lshape, &f);
        for (int64_t row = 0; r == 0 && row < g->lout; row++) {
            r = mxfp4_row_quantize(f + row * g->lin, g->lin, packed_row, scale_row);
            if (g->kind == CKPTW_PACKED)
                memcpy(b + row * (g->lin / 2), packed_row, (size_t) g->lin / 2);
            else
                memcpy(b + row * (g->lin / 32), scale_row, (size_t) g->lin / 32);
        }
        free(scale_row);
        free(packed_row);
        break;
    }
    case CKPTW_FP8:
    case CKPTW_FP8_SCALE: {
        int64_t lshape[2] = { g->lout, g->lin };
        int64_t nb = (g->lout / g->br) * (g->lin / g->bc);
        uint8_t *codes = malloc((size_t) (g->lout * g->lin));
        float *sinv = malloc((size_t) nb * sizeof(float));
        r = codes && sinv ? gen_floats(o, g->base, 2, lshape, &f) : -ENOMEM;
        if (r == 0)
            r = fp8_block_quantize(f, g->lout, g->lin, g->br, g->bc, codes, sinv);
        if (r == 0 && g->kind == CKPTW_FP8)
            memcpy(b, codes, (size_t) (g->lout * g->lin));
        else if (r == 0)
            memcpy(b, sinv, (size_t) nb * sizeof(float));
        free(codes);
        free(sinv);
        break;
    }
    case CKPTW_NV_PACKED:
    case CKPTW_NV_SCALE:
    case CKPTW_NV_GSCALE: {
        int64_t lshape[2] = { g->lout, g->lin };
        uint8_t *packed = malloc((size_t) g->lin / 2), *sc = malloc((size_t) g->lin / 16);
        float gs = 1.0f;
        r = packed && sc ? gen_floats(o, g->base, 2, lshape, &f) : -ENOMEM;
        if (r == 0)
            gs = nvfp4_global_scale(f, g->lout * g->lin);
        if (r == 0 && g->kind == CKPTW_NV_GSCALE)
            memcpy(b, &gs, 4);
        for (int64_t row = 0; r == 0 && g->kind != CKPTW_NV_GSCALE && row < g->lout; row++) {
            r = nvfp4_row_quantize(f + row * g->lin, g->lin, gs, packed, sc);
            if (g->kind == CKPTW_NV_PACKED)
                memcpy(b + row * (g->lin / 2), packed, (size_t) g->lin / 2);
            else
                memcpy(b + row * (g->lin / 16), sc, (size_t) g->lin / 16);
        }
        free(packed);
        free(sc);
        break;
    }
    case CKPTW_OPT_SCALE:
    case CKPTW_OPT_ZP: {
        int64_t n = g->ndim ? g->shape[0] : 1;
        for (int64_t h = 0; h < n; h++) {
            float v = g->kind == CKPTW_OPT_SCALE ? 1.0f + 0.125f * (float) h : (float) h;
            memcpy(b + 4 * h, &v, 4);
        }
        break;
    }
    case CKPTW_RAW:
        for (int64_t i = 0; i < nbytes; i++)
            b[i] = (unsigned char) (splitmix64(name_hash(g->name) + (uint64_t) i) & 0x3f);
        break;
    }
    free(f);
    if (r < 0) {
        free(b);
        return r;
    }
    *ret = b;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* files */

static int write_all(int fd, const void *buf, size_t n)
{
    const char *p = buf;
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return -errno;
        p += k;
        n -= (size_t) k;
    }
    return 0;
}

/* Header of n tensors with sequential offsets, after 8 bytes for its length; the JSON is
 * padded to a multiple of 8. */
static int build_header(const struct ckptw_tensor *t, size_t n, struct strbuf *s, uint64_t *ret_data,
                        struct err_buf *e)
{
    uint64_t off = 0, hl;

    strbuf_add(s, "\0\0\0\0\0\0\0\0", 8);
    strbuf_adds(s, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        int64_t nb = ckptw_tensor_bytes(t[i].dtype, t[i].ndim, t[i].shape);
        if (nb < 0)
            return err_set(e, -EOVERFLOW, "ckptw: tensor '%s' has no whole byte size", t[i].name);
        strbuf_printf(s, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t[i].name, dtype_name(t[i].dtype));
        for (int d = 0; d < t[i].ndim; d++)
            strbuf_printf(s, "%s%lld", d ? "," : "", (long long) t[i].shape[d]);
        strbuf_printf(s, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long) off,
                      (unsigned long long) (off + (uint64_t) nb));
        off += (uint64_t) nb;
    }
    strbuf_adds(s, "}");
    while (!s->oom && s->len % 8)
        strbuf_adds(s, " ");
    if (s->oom)
        return err_set(e, -ENOMEM, "ckptw: out of memory");
    hl = s->len - 8;
    for (int i = 0; i < 8; i++)
        s->p[i] = (char) (unsigned char) (hl >> (8 * i));
    *ret_data = off;
    return 0;
}

int ckptw_safetensors_header(const struct ckptw_tensor *t, size_t n, char **ret_hdr,
                             size_t *ret_len, uint64_t *ret_data_len, struct err_buf *e)
{
    struct strbuf s = STRBUF_INIT;
    int r = build_header(t, n, &s, ret_data_len, e);

    if (r < 0) {
        strbuf_done(&s);
        return r;
    }
    *ret_len = s.len;
    *ret_hdr = strbuf_take(&s);
    return 0;
}

int ckptw_write_safetensors(const char *path, const struct ckptw_tensor *t, size_t n, bool sparse,
                            struct err_buf *e)
{
    char *hdr = NULL;
    size_t hl;
    uint64_t data_len = 0;
    int fd, r;

    r = ckptw_safetensors_header(t, n, &hdr, &hl, &data_len, e);
    if (r < 0)
        return r;
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        r = err_set(e, -errno, "%s: cannot create: %s", path, strerror(errno));
        goto out;
    }
    r = write_all(fd, hdr, hl);
    for (size_t i = 0; r == 0 && !sparse && i < n; i++)
        r = write_all(fd, t[i].data, (size_t) ckptw_tensor_bytes(t[i].dtype, t[i].ndim, t[i].shape));
    if (r == 0 && sparse && ftruncate(fd, (off_t) (hl + data_len)) < 0)
        r = -errno;
    if (close(fd) < 0 && r == 0)
        r = -errno;
    if (r < 0)
        r = err_set(e, r, "%s: write failed: %s", path, strerror(-r));
out:
    free(hdr);
    return r;
}

/* ------------------------------------------------------------------------ */
/* The modules cfg keeps in BF16, for fp8 modules_to_not_convert / modelopt
 * exclude_modules: a whole layer as "model.layers.L", a routed projection by expert 0's
 * name (config.c decides the experts' format from it). */
static json_t *exclusions(const struct model_config *c)
{
    json_t *a = json_array();
    char b[200], m[128];

    for (int l = 0; a && l < c->n_layers_total; l++) {
        bool all = true;
        for (int k = 0; k < _QMOD_MAX; k++)
            if (model_config_has_module(c, l, (enum quant_module) k) && c->layers[l].qfmt[k] != QUANT_NONE)
                all = false;
        if (all) {
            snprintf(b, sizeof(b), "model.layers.%d", l);
            json_array_append_new(a, json_string(b));
            continue;
        }
        for (int k = 0; k < _QMOD_MAX; k++) {
            if (!model_config_has_module(c, l, (enum quant_module) k) || c->layers[l].qfmt[k] != QUANT_NONE)
                continue;
            if (k >= QMOD_EXPERT_GATE && k <= QMOD_EXPERT_DOWN)
                snprintf(b, sizeof(b), "model.layers.%d.moe.experts.0.%s", l,
                         strrchr(quant_module_name((enum quant_module) k, 0, m, sizeof(m)), '.') + 1);
            else
                snprintf(b, sizeof(b), "model.layers.%d.%s", l, quant_module_name((enum quant_module) k, 0, m, sizeof(m)));
            json_array_append_new(a, json_string(b));
        }
    }
    if (a && c->lm_head_qfmt == QUANT_NONE)
        json_array_append_new(a, json_string("lm_head"));
    return a;
}

/* config.json */

static json_t *num_list(const struct model_config *c, int n, int which)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) {
        const struct layer_config *L = &c->layers[i];
        double v = which == 0 ? L->rope_theta
                 : which == 1 ? (double) L->rotary_dims / L->head_dim
                 : which == 2 ? L->swiglu_limit : L->swiglu_limit_shared;
        json_array_append_new(a, json_real(v));
    }
    return a;
}

int ckptw_write_config(const char *path, const struct model_config *c, bool nested,
                       bool lists_trunk_only, struct err_buf *e)
{
    json_t *root = json_object(), *t = nested ? json_object() : root, *lt = json_array();
    json_t *eos = json_array();
    char moe[2048] = "";
    size_t ml = 0;
    int nl = lists_trunk_only ? c->n_layers : c->n_layers_total, r = 0;
    bool llama_full = false, llama_sliding = false;

    json_object_set_new(root, "model_type", json_string(c->model_type[0] ? c->model_type : "step3p7"));
    json_object_set_new(root, "architectures", json_pack("[s]", nested ? "Step3p7ForConditionalGeneration" : "Step3p5ForCausalLM"));
    if (nested) {
        json_object_set_new(root, "text_config", t);
        json_object_set_new(t, "model_type", json_string("step3p5"));
        json_object_set_new(t, "architectures", json_pack("[s]", "Step3p5ForCausalLM"));
        json_object_set_new(root, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
        json_object_set_new(root, "torch_dtype", json_string("bfloat16"));
        /* the real Step-3.7 file repeats the special ids at the top level */
        if (c->bos_token_id >= 0)
            json_object_set_new(root, "bos_token_id", json_integer(c->bos_token_id));
        json_object_set_new(root, "eos_token_id", json_array());
        for (int i = 0; i < c->n_eos; i++)
            json_array_append_new(json_object_get(root, "eos_token_id"), json_integer(c->eos_token_ids[i]));
        json_object_set_new(t, "zero_centered", json_true());
        json_object_set_new(t, "sink", json_false());
    } else {
        json_object_set_new(t, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
    }
    json_object_set_new(t, "hidden_size", json_integer(c->hidden_size));
    json_object_set_new(t, "intermediate_size", json_integer(c->intermediate_size));
    json_object_set_new(t, "num_hidden_layers", json_integer(c->n_layers));
    json_object_set_new(t, "num_nextn_predict_layers", json_integer(c->n_mtp_layers));
    json_object_set_new(t, "vocab_size", json_integer(c->vocab_size));
    json_object_set_new(t, "max_position_embeddings", json_integer(c->max_position_embeddings));
    json_object_set_new(t, "max_seq_len", json_integer(c->max_position_embeddings));
    json_object_set_new(t, "torch_dtype", json_string("bfloat16"));
    /* the float's shortest decimal (1e-05, as the real file), not its double expansion */
    {
        char eps[32];
        snprintf(eps, sizeof(eps), "%.7g", (double) c->rms_norm_eps);
        json_object_set_new(t, "rms_norm_eps", json_real(strtod(eps, NULL)));
    }
    json_object_set_new(t, "head_dim", json_integer(c->head_dim));
    json_object_set_new(t, "num_attention_heads", json_integer(c->n_heads_full));
    json_object_set_new(t, "num_attention_groups", json_integer(c->n_kv_heads));
    json_object_set_new(t, "attention_other_setting",
                        json_pack("{s:s, s:i, s:i, s:i, s:i}", "attention_type", "sliding_attention",
                                  "num_attention_heads", c->n_heads_sliding, "num_attention_groups",
                                  c->n_kv_heads, "head_dim", c->head_dim, "true_head_dim", c->head_dim));
    json_object_set_new(t, "att_impl_type", json_string("GQA"));
    for (int i = 0; i < nl; i++)
        json_array_append_new(lt, json_string(c->layers[i].kind == LAYER_KIND_FULL ? "full_attention" : "sliding_attention"));
    json_object_set_new(t, "layer_types", lt);
    json_object_set_new(t, "sliding_window", json_integer(c->sliding_window));
    json_object_set_new(t, "rope_theta", num_list(c, nl, 0));
    json_object_set_new(t, "partial_rotary_factors", num_list(c, nl, 1));
    json_object_set_new(t, "swiglu_limits", num_list(c, nl, 2));
    json_object_set_new(t, "swiglu_limits_shared", num_list(c, nl, 3));
    for (int i = 0; i < c->n_layers_total; i++) {
        if (c->layers[i].rope_llama3)
            *(c->layers[i].kind == LAYER_KIND_FULL ? &llama_full : &llama_sliding) = true;
    }
    if (c->rope_scaling.present) {
        json_t *y = json_array();
        json_object_set_new(t, "rope_scaling",
                            json_pack("{s:s, s:f, s:f, s:f, s:o}", "rope_type", "llama3", "factor",
                                      c->rope_scaling.factor, "low_freq_factor", c->rope_scaling.low_freq_factor,
                                      "high_freq_factor", c->rope_scaling.high_freq_factor,
                                      "original_max_position_embeddings",
                                      /* an integer in the real file */
                                      fmod(c->rope_scaling.original_max_position_embeddings, 1.0) == 0
                                          ? json_integer((json_int_t) c->rope_scaling.original_max_position_embeddings)
                                          : json_real(c->rope_scaling.original_max_position_embeddings)));
        if (llama_full)
            json_array_append_new(y, json_string("full_attention"));
        if (llama_sliding)
            json_array_append_new(y, json_string("sliding_attention"));
        json_object_set_new(t, "yarn_only_types", y);
    }
    json_object_set_new(t, "use_qk_norm", json_boolean(c->use_qk_norm));
    json_object_set_new(t, "use_head_wise_attn_gate", json_boolean(c->use_head_wise_attn_gate));
    for (int i = 0; i < c->n_layers; i++)
        if (c->layers[i].is_moe)
            ml += (size_t) snprintf(moe + ml, sizeof(moe) - ml, "%s%d", ml ? "," : "", i);
    json_object_set_new(t, "use_moe", json_boolean(ml > 0));
    if (ml) {
        json_object_set_new(t, "moe_layers_enum", json_string(moe));
        json_object_set_new(t, "moe_layer_offset", json_integer(0));
        json_object_set_new(t, "moe_every_n_layer", json_integer(1));
        json_object_set_new(t, "moe_num_experts", json_integer(c->n_experts));
        json_object_set_new(t, "moe_top_k", json_integer(c->top_k));
        json_object_set_new(t, "moe_intermediate_size", json_integer(c->moe_intermediate_size));
        json_object_set_new(t, "share_expert_dim", json_integer(c->shared_expert_dim));
        json_object_set_new(t, "norm_expert_weight", json_boolean(c->norm_expert_weight));
        json_object_set_new(t, "moe_router_activation", json_string("sigmoid"));
        json_object_set_new(t, "moe_router_scaling_factor", json_real(c->router_scaling_factor));
        json_object_set_new(t, "use_moe_router_bias", json_boolean(c->use_router_bias));
        json_object_set_new(t, "need_fp32_gate", json_true());
    }
    if (c->bos_token_id >= 0)
        json_object_set_new(t, "bos_token_id", json_integer(c->bos_token_id));
    for (int i = 0; i < c->n_eos; i++)
        json_array_append_new(eos, json_integer(c->eos_token_ids[i]));
    json_object_set_new(t, "eos_token_id", eos);
    if (c->quant == QUANT_MXFP4) {
        json_t *q = json_pack(
            "{s:s, s:s, s:s, s:n, s:{s:{s:s, s:{s:i, s:s, s:s, s:i, s:b, s:b, s:n, s:s}, s:n, s:n, s:[s, s]}},"
            " s:[s, s, s, s, s, s, s, s, s, s, s, s, s, s]}",
            "quant_method", "compressed-tensors", "format", "mixed-precision",
            "quantization_status", "compressed", "kv_cache_scheme",
            "config_groups", "group_0", "format", "mxfp4-pack-quantized",
            "weights", "num_bits", 4, "type", "float", "strategy", "group", "group_size", 32, "symmetric", 1,
            "dynamic", 0, "actorder", "observer", "minmax", "input_activations", "output_activations",
            "targets", "re:.*\\.experts\\.\\d+\\..*", "re:.*model\\.layers\\.\\d+\\.moe\\.experts\\.\\d+\\.gate_up_proj$",
            "ignore", "re:.*model\\.layers\\.\\d+\\.self_attn\\.q_proj$", "re:.*model\\.layers\\.\\d+\\.self_attn\\.k_proj$",
            "re:.*model\\.layers\\.\\d+\\.self_attn\\.v_proj$", "re:.*model\\.layers\\.\\d+\\.self_attn\\.o_proj$",
            "re:.*model\\.layers\\.\\d+\\.self_attn\\.g_proj$", "re:.*model\\.layers\\.\\d+\\.mlp\\.gate_proj$",
            "re:.*model\\.layers\\.\\d+\\.mlp\\.up_proj$", "re:.*model\\.layers\\.\\d+\\.mlp\\.down_proj$",
            "re:.*model\\.layers\\.\\d+\\.moe\\.gate$", "re:.*model\\.layers\\.\\d+\\.share_expert\\..*$",
            "re:.*model\\.layers\\.\\d+\\.eh_proj$", "re:.*model\\.layers\\.\\d+\\.transformer\\.shared_head\\.output$",
            "re:.*lm_head$", "re:.*model\\.embed_tokens$");
        if (!q) {
            r = err_set(e, -EINVAL, "ckptw: cannot build quantization_config");
            goto out;
        }
        json_object_set_new(root, "quantization_config", q);
    } else if (c->quant == QUANT_FP8 || c->quant == QUANT_NVFP4) {
        json_t *q = json_object(), *ex = exclusions(c);
        if (!q || !ex) {
            json_decref(q);
            json_decref(ex);
            r = err_set(e, -ENOMEM, "ckptw: cannot build quantization_config");
            goto out;
        }
        if (c->quant == QUANT_FP8) {
            json_object_set_new(q, "quant_method", json_string("fp8"));
            json_object_set_new(q, "fmt", json_string("e4m3"));
            json_object_set_new(q, "activation_scheme", json_string("dynamic"));
            json_object_set_new(q, "weight_block_size", json_pack("[i, i]", c->quant_block_rows, c->quant_group_size));
            json_object_set_new(q, "modules_to_not_convert", ex);
        } else {
            json_object_set_new(q, "quant_method", json_string("modelopt"));
            json_object_set_new(q, "quant_algo", json_string("NVFP4"));
            json_object_set_new(q, "group_size", json_integer(16));
            json_object_set_new(q, "kv_cache_quant_algo", json_null());
            json_object_set_new(q, "exclude_modules", ex);
        }
        json_object_set_new(root, "quantization_config", q);
    }
    if (json_dump_file(root, path, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(17)) < 0)
        r = err_set(e, -EIO, "%s: cannot write", path);
out:
    json_decref(root);
    return r;
}

/* ------------------------------------------------------------------------ */

void ckptw_opts_default(struct ckptw_opts *o)
{
    memset(o, 0, sizeof(*o));
    o->n_shards = 3;
    o->write_mtp = true;
    o->optional_trunk = true;
    o->optional_mtp = true;
    o->nested = true;
    o->seed = 1;
    o->init_scale = 0.05f;
}

/* What the tiny and the Step-3.7 configs share: c cleared to the family's constants
 * (config_step_family), then, once the sizes are set, its layer pattern
 * (config_step_layers: every 4th trunk layer full attention with llama3 RoPE on half the
 * head, the rest sliding; MoE from trunk layer first_moe; SwiGLU limits on the last
 * n_limited trunk layers). */
static void config_step_family(struct model_config *c)
{
    memset(c, 0, sizeof(*c));
    snprintf(c->model_type, sizeof(c->model_type), "step3p7");
    c->rms_norm_eps = 1e-5f;
    c->norm_expert_weight = true;
    c->router_scaling_factor = 3.0f;
    c->use_router_bias = true;
    c->rope_scaling.present = true;
    c->rope_scaling.factor = 2.0;
    c->rope_scaling.low_freq_factor = 1.0;
    c->rope_scaling.high_freq_factor = 32.0;
    c->use_qk_norm = true;
    c->use_head_wise_attn_gate = true;
    c->bos_token_id = 0;
    c->eos_token_ids[0] = 1;
    c->eos_token_ids[1] = 2;
    c->n_eos = 2;
    c->quant = QUANT_MXFP4;
    c->quant_group_size = 32;
}

static void config_step_layers(struct model_config *c, int first_moe, int n_limited)
{
    for (int i = 0; i < c->n_layers_total; i++) {
        struct layer_config *L = &c->layers[i];
        bool mtp = i >= c->n_layers;
        bool limited = !mtp && i >= c->n_layers - n_limited;
        L->kind = !mtp && i % 4 == 0 ? LAYER_KIND_FULL : LAYER_KIND_SLIDING;
        L->n_heads = L->kind == LAYER_KIND_FULL ? c->n_heads_full : c->n_heads_sliding;
        L->n_kv_heads = c->n_kv_heads;
        L->head_dim = c->head_dim;
        L->rotary_dims = L->kind == LAYER_KIND_FULL ? c->head_dim / 2 : c->head_dim;
        L->rope_theta = L->kind == LAYER_KIND_FULL ? 5e6 : 1e4;
        L->rope_llama3 = L->kind == LAYER_KIND_FULL;
        L->is_moe = !mtp && i >= first_moe;
        L->is_mtp = mtp;
        L->swiglu_limit = limited ? 7.0f : 0.0f;
        L->swiglu_limit_shared = limited ? 16.0f : 0.0f;
    }
    model_config_set_quant(c, c->quant);
}

void ckptw_config_tiny(struct model_config *c)
{
    config_step_family(c);
    c->hidden_size = 64;
    c->intermediate_size = 128;
    c->n_layers = 4;
    c->n_mtp_layers = 2;
    c->n_layers_total = 6;
    c->vocab_size = 256;
    c->max_position_embeddings = 4096;
    c->n_heads_full = 8;
    c->n_heads_sliding = 16;
    c->n_kv_heads = 8;
    c->head_dim = 16;
    c->sliding_window = 8;
    c->n_experts = 16;
    c->top_k = 2;
    c->moe_intermediate_size = 64;
    c->shared_expert_dim = 32;
    c->rope_scaling.original_max_position_embeddings = 2048;
    c->tie_word_embeddings = false;
    config_step_layers(c, 2, 1);
}

void ckptw_config_step37(struct model_config *c)
{
    config_step_family(c);
    c->hidden_size = 4096;
    c->intermediate_size = 11264;
    c->n_layers = 45;
    c->n_mtp_layers = 3;
    c->n_layers_total = 48;
    c->vocab_size = 128896;
    c->max_position_embeddings = 262144;
    c->n_heads_full = 64;
    c->n_heads_sliding = 96;
    c->n_kv_heads = 8;
    c->head_dim = 128;
    c->sliding_window = 512;
    c->n_experts = 288;
    c->top_k = 8;
    c->moe_intermediate_size = 1280;
    c->shared_expert_dim = 1280;
    c->rope_scaling.original_max_position_embeddings = 131072;
    c->eos_token_ids[c->n_eos++] = 128007;
    config_step_layers(c, 3, 2);
}

static int write_group(const char *dir, const struct genlist *l, const bool *pick, int n_shards,
                       bool single, const struct ckptw_opts *o, struct err_buf *e)
{
    size_t n = 0, done = 0;
    json_t *idx = json_object(), *wm = json_object();
    uint64_t total = 0;
    char path[PATH_MAX];
    int r = 0;

    for (size_t i = 0; i < l->n; i++)
        n += pick[i];
    if (n_shards < 1)
        n_shards = 1;
    json_object_set_new(idx, "weight_map", wm);
    for (int s = 0; s < n_shards && r == 0; s++) {
        size_t want = (n * (size_t) (s + 1)) / (size_t) n_shards, cnt = 0, k = 0;
        struct ckptw_tensor *ts = calloc(n + 1, sizeof(*ts));
        unsigned char **bufs = calloc(n + 1, sizeof(*bufs));
        char **names = calloc(n + 1, sizeof(*names));
        char fname[64];

        if (!ts || !bufs || !names) {
            free(ts);
            free(bufs);
            free(names);
            r = err_set(e, -ENOMEM, "ckptw: out of memory");
            break;
        }
        if (single)
            snprintf(fname, sizeof(fname), "model.safetensors");
        else
            snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        for (size_t i = 0; i < l->n && r == 0; i++) {
            const struct ckptw_entry *g;
            struct ckptw_tensor *t;
            int64_t nb;
            if (!pick[i])
                continue;
            if (cnt++ < done)
                continue;
            if (done + k >= want)
                break;
            g = &l->v[i];
            t = &ts[k];
            t->dtype = g->dtype;
            t->ndim = g->ndim;
            memcpy(t->shape, g->shape, sizeof(t->shape));
            for (int v = 0; v < o->n_overrides; v++)
                if (strcmp(o->overrides[v].name, g->name) == 0) {
                    t->dtype = o->overrides[v].dtype;
                    t->ndim = o->overrides[v].ndim;
                    memcpy(t->shape, o->overrides[v].shape, sizeof(t->shape));
                }
            names[k] = malloc(strlen(g->name) + 32);
            if (!names[k]) {
                r = err_set(e, -ENOMEM, "ckptw: out of memory");
                break;
            }
            if (o->language_model_prefix && strncmp(g->name, "model.", 6) == 0)
                sprintf(names[k], "model.language_model.%s", g->name + 6);
            else
                strcpy(names[k], g->name);
            t->name = names[k];
            nb = ckptw_tensor_bytes(t->dtype, t->ndim, t->shape);
            if (nb < 0) {
                r = err_set(e, -EINVAL, "ckptw: %s: bad override shape", g->name);
                break;
            }
            if (t->dtype != g->dtype || t->ndim != g->ndim || memcmp(t->shape, g->shape, sizeof(t->shape))) {
                struct ckptw_entry raw = *g;
                raw.kind = CKPTW_RAW;
                r = gen_bytes(o, &raw, nb, &bufs[k]);
            } else {
                r = gen_bytes(o, g, nb, &bufs[k]);
            }
            if (r < 0) {
                r = err_set(e, r, "ckptw: %s: cannot generate data", g->name);
                break;
            }
            t->data = bufs[k];
            total += (uint64_t) nb;
            json_object_set_new(wm, t->name, json_string(fname));
            k++;
        }
        done += k;
        if (r == 0) {
            snprintf(path, sizeof(path), "%s/%s", dir, fname);
            r = ckptw_write_safetensors(path, ts, k, false, e);
        }
        for (size_t i = 0; i < k + 1; i++) {
            free(bufs[i]);
            free(names[i]);
        }
        free(ts);
        free(bufs);
        free(names);
        if (single)
            break;
    }
    if (r == 0 && !single) {
        json_object_set_new(idx, "metadata", json_pack("{s:I}", "total_size", (json_int_t) total));
        snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
        if (json_dump_file(idx, path, JSON_INDENT(2) | JSON_SORT_KEYS) < 0)
            r = err_set(e, -EIO, "%s: cannot write", path);
    }
    json_decref(idx);
    return r;
}

int ckptw_write(const char *dir, const struct model_config *cfg, const struct ckptw_opts *o,
                struct err_buf *e)
{
    struct genlist l = { 0 };
    bool *pick = NULL;
    char path[PATH_MAX];
    int r;

    if (mkdir(dir, 0755) < 0 && errno != EEXIST)
        return err_set(e, -errno, "%s: cannot create: %s", dir, strerror(errno));
    if (o->mtp_dir && mkdir(o->mtp_dir, 0755) < 0 && errno != EEXIST)
        return err_set(e, -errno, "%s: cannot create: %s", o->mtp_dir, strerror(errno));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    r = ckptw_write_config(path, cfg, o->nested, o->lists_trunk_only, e);
    if (r < 0)
        return r;
    r = build_list(cfg, o, &l);
    if (r < 0) {
        r = err_set(e, r, "ckptw: out of memory");
        goto out;
    }
    pick = calloc(l.n + 1, sizeof(*pick));
    if (!pick) {
        r = err_set(e, -ENOMEM, "ckptw: out of memory");
        goto out;
    }
    for (size_t i = 0; i < l.n; i++) {
        bool omitted = false;
        for (int k = 0; o->omit && o->omit[k]; k++)
            omitted |= strcmp(o->omit[k], l.v[i].name) == 0;
        pick[i] = !omitted && !(o->mtp_dir && l.v[i].mtp);
    }
    r = write_group(dir, &l, pick, o->n_shards, o->single_file && o->n_shards <= 1, o, e);
    if (r < 0 || !o->mtp_dir)
        goto out;
    for (size_t i = 0; i < l.n; i++) {
        bool omitted = false;
        for (int k = 0; o->omit && o->omit[k]; k++)
            omitted |= strcmp(o->omit[k], l.v[i].name) == 0;
        pick[i] = !omitted && l.v[i].mtp;
    }
    r = write_group(o->mtp_dir, &l, pick, 1, true, o, e);
out:
    free(pick);
    free(l.v);
    return r;
}

char *ckptw_tmpdir(const char *prefix)
{
    const char *base = getenv("TMPDIR");
    char *p;
    if (!base || !*base)
        base = "/tmp";
    if (asprintf(&p, "%s/%s-XXXXXX", base, prefix) < 0)
        return NULL;
    if (!mkdtemp(p)) {
        free(p);
        return NULL;
    }
    return p;
}

void ckptw_rmtree(const char *path)
{
    struct stat st;
    DIR *d;
    struct dirent *de;

    if (lstat(path, &st) < 0)
        return;
    if (!S_ISDIR(st.st_mode)) {
        unlink(path);
        return;
    }
    d = opendir(path);
    if (d) {
        while ((de = readdir(d))) {
            char sub[PATH_MAX];
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            snprintf(sub, sizeof(sub), "%s/%s", path, de->d_name);
            ckptw_rmtree(sub);
        }
        closedir(d);
    }
    rmdir(path);
}

/* ------------------------------------------------------------------------ */
/* the expected-tensor TSV */

static int tsv_push(struct ckptw_tsv_row **rows, size_t *n, size_t *cap, const char *name,
                    enum dtype dt, int ndim, const int64_t *shape)
{
    struct ckptw_tsv_row *r;

    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 4096;
        struct ckptw_tsv_row *nr = realloc(*rows, nc * sizeof(*nr));
        if (!nr)
            return -ENOMEM;
        *rows = nr;
        *cap = nc;
    }
    r = &(*rows)[*n];
    memset(r, 0, sizeof(*r));
    r->name = strdup(name);
    if (!r->name)
        return -ENOMEM;
    r->dtype = dt;
    r->ndim = ndim;
    memcpy(r->shape, shape, sizeof(r->shape));
    (*n)++;
    return 0;
}

int ckptw_tsv_read(const char *path, struct ckptw_tsv_row **ret, size_t *ret_n, struct err_buf *e)
{
    struct ckptw_tsv_row *rows = NULL;
    size_t n = 0, cap = 0;
    FILE *f = fopen(path, "re");
    char line[1024];
    int lineno = 0, r = 0;

    if (!f)
        return err_set(e, -errno, "%s: cannot open: %s", path, strerror(errno));
    while (r == 0 && fgets(line, sizeof(line), f)) {
        char *name, *dt, *shape, *save = NULL, *br, dts[32];
        int64_t sh[TENSOR_MAX_DIMS] = { 0 };
        int nd = 0, lo, hi;
        enum dtype t;

        lineno++;
        if (line[0] == '#' || line[0] == '\n')
            continue;
        name = strtok_r(line, "\t\n", &save);
        dt = strtok_r(NULL, "\t\n", &save);
        shape = strtok_r(NULL, "\t\n", &save);
        if (!name || !dt || !shape || shape[0] != '[') {
            r = err_set(e, -EINVAL, "%s:%d: expected name, dtype, [shape]", path, lineno);
            break;
        }
        snprintf(dts, sizeof(dts), "%s", dt);
        if (dts[0] && dts[strlen(dts) - 1] == '?')
            dts[strlen(dts) - 1] = 0;
        t = dtype_parse(dts);
        if (t == DTYPE_INVALID) {
            r = err_set(e, -EINVAL, "%s:%d: unknown dtype '%s'", path, lineno, dt);
            break;
        }
        for (char *p = shape + 1; *p && *p != ']';) {
            char *end;
            if (nd == TENSOR_MAX_DIMS) {
                r = err_set(e, -EINVAL, "%s:%d: more than %d dimensions", path, lineno, TENSOR_MAX_DIMS);
                break;
            }
            sh[nd++] = strtoll(p, &end, 10);
            if (end == p) {
                r = err_set(e, -EINVAL, "%s:%d: bad shape '%s'", path, lineno, shape);
                break;
            }
            p = *end == ',' ? end + 1 : end;
        }
        if (r < 0)
            break;
        br = strchr(name, '{');
        if (br && sscanf(br, "{%d..%d}", &lo, &hi) == 2 && strchr(br, '}') && lo <= hi) {
            char full[600];
            for (int i = lo; r == 0 && i <= hi; i++) {
                snprintf(full, sizeof(full), "%.*s%d%s", (int) (br - name), name, i, strchr(br, '}') + 1);
                r = tsv_push(&rows, &n, &cap, full, t, nd, sh);
            }
        } else {
            r = tsv_push(&rows, &n, &cap, name, t, nd, sh);
        }
        if (r == -ENOMEM)
            r = err_set(e, r, "%s: out of memory", path);
    }
    fclose(f);
    if (r < 0) {
        ckptw_tsv_free(rows, n);
        return r;
    }
    *ret = rows;
    *ret_n = n;
    return 0;
}

void ckptw_tsv_free(struct ckptw_tsv_row *rows, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(rows[i].name);
    free(rows);
}
