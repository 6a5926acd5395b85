/* naive.c - see naive.h.  Deliberately simple: every formula of docs/MODEL.md §2-§3 as loops. */
#include "naive.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct nmat {
    int64_t rows, cols;
    double *w;          /* [rows, cols] */
    bool mxfp4;         /* stored MXFP4 on disk */
    bool nvfp4;         /* stored NVFP4 on disk */
    bool bf16;          /* stored BF16 on disk */
    bool exact_act;     /* input never rounded by naive_bf16_act (the router: model-load.c) */
};

bool naive_int8_act;
bool naive_nvfp4_int8;
bool naive_bf16_act;
bool naive_bf16_kv;
struct naive_trace *naive_trace;

/* round an fp32 value to BF16 (nearest even), as a BF16 KV cache stores it */
static double to_bf16(double x)
{
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

struct nlayer {
    int nh, nkv, hd, R, window, is_moe, is_mtp;
    double theta, lim_shared, lim_routed;
    bool llama3;
    struct nmat in_norm, post_norm, q_norm, k_norm, wq, wk, wv, wg, wo;
    struct nmat gate, up, down;             /* dense MLP or shared expert */
    struct nmat router;
    double *bias;
    struct nmat *eg, *eu, *ed;              /* experts */
    struct nmat enorm, hnorm, eh, head_norm, head;
};

struct naive {
    const struct model_config *cfg;
    int H, V, n_layers, n_mtp;
    struct nmat embed, final_norm, lm_head;
    struct nlayer *L;
};

static double bf16(const void *p)
{
    uint16_t h;
    uint32_t u;
    float f;
    memcpy(&h, p, 2);
    u = (uint32_t)h << 16;
    memcpy(&f, &u, 4);
    return f;
}

static int get_dense(struct ckpt *c, const char *name, struct nmat *m)
{
    struct tview v;
    int64_t n;

    if (ckpt_get(c, name, &v) < 0)
        return -1;
    n = tview_numel(&v);
    m->rows = v.ndim == 2 ? v.shape[0] : 1;
    m->cols = n / m->rows;
    m->w = malloc(sizeof(double) * (size_t)n);
    m->bf16 = v.dtype == DTYPE_BF16;
    for (int64_t i = 0; i < n; i++) {
        if (v.dtype == DTYPE_BF16) {
            m->w[i] = bf16((const char *)v.data + 2 * i);
        } else if (v.dtype == DTYPE_F32) {
            float f;
            memcpy(&f, (const char *)v.data + 4 * i, 4);
            m->w[i] = f;
        } else {
            fprintf(stderr, "naive: %s: dtype %d\n", name, v.dtype);
            return -1;
        }
    }
    return 0;
}

static const double e2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};

/* E4M3 (docs/MODEL.md §5.6) from its bit fields */
static double e4m3(uint8_t b)
{
    int ex = (b >> 3) & 15, man = b & 7;
    double v = ex ? ldexp(1.0 + man / 8.0, ex - 7) : ldexp(man, -9);
    if (ex == 15 && man == 7)
        return NAN;
    return (b & 0x80) ? -v : v;
}

static float f32_at(const void *p, int64_t i)
{
    float f;
    memcpy(&f, (const char *)p + 4 * i, 4);
    return f;
}

/* FP8 "<base>.weight" E4M3 + ".weight_scale_inv" blocks, or NVFP4 "<base>.weight" U8 +
 * ".weight_scale" E4M3 per 16 + ".weight_scale_2": 1 if base is neither (no such .weight) */
static int get_lowp(struct ckpt *c, const char *base, struct nmat *m)
{
    char n1[256], n2[256];
    struct tview w, s, g;

    snprintf(n1, sizeof(n1), "%s.weight", base);
    if (ckpt_get(c, n1, &w) < 0 || (w.dtype != DTYPE_F8_E4M3 && w.dtype != DTYPE_U8))
        return 1;
    snprintf(n2, sizeof(n2), "%s.%s", base, w.dtype == DTYPE_F8_E4M3 ? "weight_scale_inv" : "weight_scale");
    if (ckpt_get(c, n2, &s) < 0)
        return -1;
    m->rows = w.shape[0];
    m->cols = w.dtype == DTYPE_F8_E4M3 ? w.shape[1] : w.shape[1] * 2;
    m->w = malloc(sizeof(double) * (size_t)(m->rows * m->cols));
    if (w.dtype == DTYPE_F8_E4M3) {
        int64_t br = m->rows / s.shape[0], bc = m->cols / s.shape[1];
        for (int64_t o = 0; o < m->rows; o++)
            for (int64_t i = 0; i < m->cols; i++)
                m->w[o * m->cols + i] = e4m3(((const uint8_t *)w.data)[o * m->cols + i]) *
                                        f32_at(s.data, (o / br) * s.shape[1] + i / bc);
        return 0;
    }
    snprintf(n2, sizeof(n2), "%s.weight_scale_2", base);
    if (ckpt_get(c, n2, &g) < 0)
        return -1;
    m->nvfp4 = true;
    for (int64_t o = 0; o < m->rows; o++)
        for (int64_t i = 0; i < m->cols; i++) {
            uint8_t byte = ((const uint8_t *)w.data)[o * (m->cols / 2) + i / 2];
            uint8_t code = (byte >> (4 * (i % 2))) & 0xF;
            double val = e2m1[code & 7] * ((code & 8) ? -1 : 1);
            m->w[o * m->cols + i] = val * e4m3(((const uint8_t *)s.data)[o * (m->cols / 16) + i / 16]) *
                                    f32_at(g.data, 0);
        }
    return 0;
}

/* "<base>.weight", FP8 / NVFP4 (get_lowp) or MXFP4 "<base>.weight_packed/.weight_scale" */
static int get_linear(struct ckpt *c, const char *base, struct nmat *m)
{
    char n1[256], n2[256];
    struct tview p, s;
    int r = get_lowp(c, base, m);

    if (r <= 0)
        return r;
    snprintf(n1, sizeof(n1), "%s.weight", base);
    if (get_dense(c, n1, m) == 0)
        return 0;
    snprintf(n1, sizeof(n1), "%s.weight_packed", base);
    snprintf(n2, sizeof(n2), "%s.weight_scale", base);
    if (ckpt_get(c, n1, &p) < 0 || ckpt_get(c, n2, &s) < 0) {
        fprintf(stderr, "naive: %s missing\n", base);
        return -1;
    }
    m->rows = p.shape[0];
    m->cols = p.shape[1] * 2;
    m->mxfp4 = true;
    m->w = malloc(sizeof(double) * (size_t)(m->rows * m->cols));
    for (int64_t o = 0; o < m->rows; o++)
        for (int64_t i = 0; i < m->cols; i++) {
            uint8_t byte = ((const uint8_t *)p.data)[o * (m->cols / 2) + i / 2];
            uint8_t code = (byte >> (4 * (i % 2))) & 0xF;
            uint8_t sc = ((const uint8_t *)s.data)[o * (m->cols / 32) + i / 32];
            double val = e2m1[code & 7] * ((code & 8) ? -1 : 1);
            m->w[o * m->cols + i] = val * ldexp(1.0, (int)sc - 127);
        }
    return 0;
}

static void mat_free(struct nmat *m)
{
    free(m->w);
    m->w = NULL;
}

/* the n matrices of an array (NULL: none), then the array */
static void mats_free(struct nmat *m, int n)
{
    for (int i = 0; m && i < n; i++)
        mat_free(&m[i]);
    free(m);
}

#define GETL(field, fmt) do { snprintf(n, sizeof(n), fmt, p); \
    if (get_linear(c, n, &L->field) < 0) return -1; } while (0)
#define GETD(field, fmt) do { snprintf(n, sizeof(n), fmt, p); \
    if (get_dense(c, n, &L->field) < 0) { fprintf(stderr, "naive: %s missing\n", n); return -1; } } while (0)

static int load_layer(struct naive *nv, struct ckpt *c, int l)
{
    const struct model_config *cfg = nv->cfg;
    const struct layer_config *lc = &cfg->layers[l];
    struct nlayer *L = &nv->L[l];
    char p[64], n[256];

    snprintf(p, sizeof(p), "model.layers.%d", l);
    L->nh = lc->n_heads;
    L->nkv = lc->n_kv_heads;
    L->hd = lc->head_dim;
    L->R = lc->rotary_dims;
    L->theta = lc->rope_theta;
    L->llama3 = lc->rope_llama3 && cfg->rope_scaling.present;
    L->window = lc->kind == LAYER_KIND_SLIDING ? cfg->sliding_window : 0;
    L->is_mtp = l >= cfg->n_layers;
    L->is_moe = lc->is_moe && !L->is_mtp;
    L->lim_shared = lc->swiglu_limit_shared;
    L->lim_routed = lc->swiglu_limit;
    GETD(in_norm, "%s.input_layernorm.weight");
    GETD(post_norm, "%s.post_attention_layernorm.weight");
    GETL(wq, "%s.self_attn.q_proj");
    GETL(wk, "%s.self_attn.k_proj");
    GETL(wv, "%s.self_attn.v_proj");
    GETL(wo, "%s.self_attn.o_proj");
    if (cfg->use_head_wise_attn_gate)
        GETL(wg, "%s.self_attn.g_proj");
    if (cfg->use_qk_norm) {
        GETD(q_norm, "%s.self_attn.q_norm.weight");
        GETD(k_norm, "%s.self_attn.k_norm.weight");
    }
    if (L->is_moe) {
        struct nmat b = {0};
        GETL(gate, "%s.share_expert.gate_proj");
        GETL(up, "%s.share_expert.up_proj");
        GETL(down, "%s.share_expert.down_proj");
        GETL(router, "%s.moe.gate");
        L->router.exact_act = true;
        L->bias = calloc((size_t)cfg->n_experts, sizeof(double));
        if (cfg->use_router_bias) {
            snprintf(n, sizeof(n), "%s.moe.router_bias", p);
            if (get_dense(c, n, &b) < 0)
                return -1;
            memcpy(L->bias, b.w, sizeof(double) * (size_t)cfg->n_experts);
            mat_free(&b);
        }
        L->eg = calloc((size_t)cfg->n_experts, sizeof(struct nmat));
        L->eu = calloc((size_t)cfg->n_experts, sizeof(struct nmat));
        L->ed = calloc((size_t)cfg->n_experts, sizeof(struct nmat));
        for (int e = 0; e < cfg->n_experts; e++) {
            char q[128];
            snprintf(q, sizeof(q), "%s.moe.experts.%d", p, e);
            snprintf(n, sizeof(n), "%s.gate_proj", q);
            if (get_linear(c, n, &L->eg[e]) < 0) return -1;
            snprintf(n, sizeof(n), "%s.up_proj", q);
            if (get_linear(c, n, &L->eu[e]) < 0) return -1;
            snprintf(n, sizeof(n), "%s.down_proj", q);
            if (get_linear(c, n, &L->ed[e]) < 0) return -1;
        }
    } else {
        GETL(gate, "%s.mlp.gate_proj");
        GETL(up, "%s.mlp.up_proj");
        GETL(down, "%s.mlp.down_proj");
    }
    if (L->is_mtp) {
        GETD(enorm, "%s.enorm.weight");
        GETD(hnorm, "%s.hnorm.weight");
        GETL(eh, "%s.eh_proj");
        GETD(head_norm, "%s.transformer.shared_head.norm.weight");
        GETL(head, "%s.transformer.shared_head.output");
    }
    return 0;
}

struct naive *naive_new(struct ckpt *c)
{
    struct naive *nv = calloc(1, sizeof(*nv));

    nv->cfg = ckpt_config(c);
    nv->H = nv->cfg->hidden_size;
    nv->V = nv->cfg->vocab_size;
    nv->n_layers = nv->cfg->n_layers;
    nv->n_mtp = ckpt_mtp_depth(c);
    if (get_dense(c, "model.embed_tokens.weight", &nv->embed) < 0 ||
        get_dense(c, "model.norm.weight", &nv->final_norm) < 0 ||
        (nv->cfg->tie_word_embeddings ? get_dense(c, "model.embed_tokens.weight", &nv->lm_head)
                                      : get_linear(c, "lm_head", &nv->lm_head)) < 0) {
        naive_free(nv);
        return NULL;
    }
    nv->L = calloc((size_t)(nv->n_layers + nv->n_mtp), sizeof(*nv->L));
    for (int l = 0; l < nv->n_layers + nv->n_mtp; l++)
        if (load_layer(nv, c, l) < 0) {
            naive_free(nv);
            return NULL;
        }
    return nv;
}

void naive_free(struct naive *nv)
{
    if (!nv)
        return;
    mat_free(&nv->embed);
    mat_free(&nv->final_norm);
    mat_free(&nv->lm_head);
    for (int l = 0; nv->L && l < nv->n_layers + nv->n_mtp; l++) {
        struct nlayer *L = &nv->L[l];
        struct nmat *all[] = {&L->in_norm, &L->post_norm, &L->q_norm, &L->k_norm, &L->wq, &L->wk,
                              &L->wv, &L->wg, &L->wo, &L->gate, &L->up, &L->down, &L->router,
                              &L->enorm, &L->hnorm, &L->eh, &L->head_norm, &L->head};
        for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
            mat_free(all[i]);
        mats_free(L->eg, nv->cfg->n_experts);
        mats_free(L->eu, nv->cfg->n_experts);
        mats_free(L->ed, nv->cfg->n_experts);
        free(L->bias);
    }
    free(nv->L);
    free(nv);
}

/* y[rows] = W x; with naive_int8_act, x of an MXFP4 W (and with naive_nvfp4_int8 of an NVFP4
 * W of a multiple of 64 columns: the CPU's int8 NVFP4 path, matmul-nvfp4-vnni.c) is first
 * rounded the way the fast kernel quantises activations (per 32-block, d = amax/127 in
 * fp32, round to nearest); with naive_bf16_act, x of a BF16 W of a multiple of 32 columns
 * is rounded to fp32 and then to BF16 (nearest even), as the BF16 fast path does (not
 * the routers' input: the model keeps them on the exact kernels) */
static void mv(const struct nmat *W, const double *x, double *y)
{
    double *xq = NULL;

    if (naive_bf16_act && W->bf16 && !W->exact_act && W->cols % 32 == 0) {
        xq = malloc(sizeof(double) * (size_t)W->cols);
        for (int64_t i = 0; i < W->cols; i++)
            xq[i] = to_bf16(x[i]);
        x = xq;
    }
    if (naive_int8_act && (W->mxfp4 || (naive_nvfp4_int8 && W->nvfp4 && W->cols % 64 == 0))) {
        xq = malloc(sizeof(double) * (size_t)W->cols);
        for (int64_t b = 0; b < W->cols / 32; b++) {
            float amax = 0, d, id;
            for (int j = 0; j < 32; j++)
                amax = fmaxf(amax, fabsf((float)x[b * 32 + j]));
            d = amax / 127.0f;
            id = d > 0 ? 1.0f / d : 0.0f;
            for (int j = 0; j < 32; j++) {
                long q = lrintf((float)x[b * 32 + j] * id);
                q = q > 127 ? 127 : (q < -127 ? -127 : q);
                xq[b * 32 + j] = (double)q * d;
            }
        }
        x = xq;
    }
    for (int64_t o = 0; o < W->rows; o++) {
        double s = 0;
        for (int64_t i = 0; i < W->cols; i++)
            s += W->w[o * W->cols + i] * x[i];
        y[o] = s;
    }
    free(xq);
}

static void rms(const double *x, const struct nmat *w, int n, double eps, double *y)
{
    double ss = 0, r;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    r = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        y[i] = x[i] * r * (1.0 + w->w[i]);
}

static double silu(double z)
{
    return z / (1.0 + exp(-z));
}

/* SwiGLU FFN with clamp (docs/MODEL.md §2.4) */
static void ffn(const struct nmat *g, const struct nmat *u, const struct nmat *d, double L,
                const double *x, double *out)
{
    int64_t I = g->rows;
    double *a = malloc(sizeof(double) * (size_t)I), *b = malloc(sizeof(double) * (size_t)I);
    mv(g, x, a);
    mv(u, x, b);
    for (int64_t i = 0; i < I; i++) {
        double s = silu(a[i]), w = b[i];
        if (L > 0) {
            s = s < L ? s : L;
            w = w < -L ? -L : (w > L ? L : w);
        }
        a[i] = s * w;
    }
    mv(d, a, out);
    free(a);
    free(b);
}

static void rope(double *x, int R, int pos, double theta, bool llama3, const struct model_config *cfg)
{
    for (int i = 0; i < R / 2; i++) {
        double f = pow(theta, -2.0 * i / R);
        if (llama3) {
            double s = cfg->rope_scaling.factor, lf = cfg->rope_scaling.low_freq_factor,
                   hf = cfg->rope_scaling.high_freq_factor,
                   l0 = cfg->rope_scaling.original_max_position_embeddings;
            double lam = 2 * M_PI / f;
            if (lam < l0 / hf)
                ;
            else if (lam > l0 / lf)
                f /= s;
            else {
                double mu = (l0 / lam - lf) / (hf - lf);
                f = (1 - mu) * f / s + mu * f;
            }
        }
        double ph = pos * f, c = cos(ph), sn = sin(ph);
        double a = x[i], b = x[i + R / 2];
        x[i] = a * c - b * sn;
        x[i + R / 2] = b * c + a * sn;
    }
}

/* One decoder layer over all n positions, in place on h [n, H]. */
static void layer(struct naive *nv, struct nlayer *L, double *h, int n)
{
    const struct model_config *cfg = nv->cfg;
    int H = nv->H, hd = L->hd, nh = L->nh, nkv = L->nkv;
    double eps = cfg->rms_norm_eps;
    double *a = malloc(sizeof(double) * H), *o = malloc(sizeof(double) * H);
    double *q = malloc(sizeof(double) * (size_t)n * nh * hd);
    double *k = malloc(sizeof(double) * (size_t)n * nkv * hd);
    double *v = malloc(sizeof(double) * (size_t)n * nkv * hd);
    double *g = malloc(sizeof(double) * (size_t)n * nh);
    double *att = malloc(sizeof(double) * (size_t)nh * hd);
    double *sc = malloc(sizeof(double) * (size_t)n);

    for (int t = 0; t < n; t++) {
        rms(h + (size_t)t * H, &L->in_norm, H, eps, a);
        mv(&L->wq, a, q + (size_t)t * nh * hd);
        mv(&L->wk, a, k + (size_t)t * nkv * hd);
        mv(&L->wv, a, v + (size_t)t * nkv * hd);
        if (cfg->use_head_wise_attn_gate)
            mv(&L->wg, a, g + (size_t)t * nh);
        for (int j = 0; j < nh; j++) {
            double *x = q + ((size_t)t * nh + j) * hd;
            if (cfg->use_qk_norm)
                rms(x, &L->q_norm, hd, eps, x);
            rope(x, L->R, t, L->theta, L->llama3, cfg);
        }
        for (int j = 0; j < nkv; j++) {
            double *x = k + ((size_t)t * nkv + j) * hd;
            if (cfg->use_qk_norm)
                rms(x, &L->k_norm, hd, eps, x);
            rope(x, L->R, t, L->theta, L->llama3, cfg);
        }
        if (naive_bf16_kv)
            for (int i = 0; i < nkv * hd; i++) {
                /* the kernels see fp32 k/v; storage rounds them */
                k[(size_t)t * nkv * hd + i] = to_bf16((float)k[(size_t)t * nkv * hd + i]);
                v[(size_t)t * nkv * hd + i] = to_bf16((float)v[(size_t)t * nkv * hd + i]);
            }
    }
    for (int t = 0; t < n; t++) {
        int lo = L->window > 0 ? t - L->window + 1 : 0;
        if (lo < 0)
            lo = 0;
        for (int j = 0; j < nh; j++) {
            int kvh = j / (nh / nkv);
            const double *qh = q + ((size_t)t * nh + j) * hd;
            double mx = -INFINITY, sum = 0;
            for (int tau = lo; tau <= t; tau++) {
                const double *kh = k + ((size_t)tau * nkv + kvh) * hd;
                double s = 0;
                for (int d = 0; d < hd; d++)
                    s += qh[d] * kh[d];
                sc[tau] = s / sqrt((double)hd);
                mx = sc[tau] > mx ? sc[tau] : mx;
            }
            for (int tau = lo; tau <= t; tau++) {
                sc[tau] = exp(sc[tau] - mx);
                sum += sc[tau];
            }
            double gate = cfg->use_head_wise_attn_gate ? 1.0 / (1.0 + exp(-g[(size_t)t * nh + j])) : 1.0;
            for (int d = 0; d < hd; d++) {
                double s = 0;
                for (int tau = lo; tau <= t; tau++)
                    s += sc[tau] * v[((size_t)tau * nkv + kvh) * hd + d];
                att[j * hd + d] = s / sum * gate;
            }
        }
        mv(&L->wo, att, o);
        for (int i = 0; i < H; i++)
            h[(size_t)t * H + i] += o[i];
    }
    /* FFN */
    for (int t = 0; t < n; t++) {
        double *ht = h + (size_t)t * H;
        rms(ht, &L->post_norm, H, eps, a);
        ffn(&L->gate, &L->up, &L->down, L->lim_shared, a, o);
        if (L->is_moe) {
            int E = cfg->n_experts, K = cfg->top_k;
            double z[1024], s[1024], c[1024], tmp[8192];
            int sel[64];
            bool used[1024] = {0};
            mv(&L->router, a, z);
            for (int e = 0; e < E; e++) {
                s[e] = 1.0 / (1.0 + exp(-z[e]));
                c[e] = s[e] + L->bias[e];
            }
            double tot = 0;
            for (int kk = 0; kk < K; kk++) {
                int best = -1;
                for (int e = 0; e < E; e++)
                    if (!used[e] && (best < 0 || c[e] > c[best]))
                        best = e;
                used[best] = true;
                sel[kk] = best;
                tot += s[best];
                if (naive_trace && naive_trace->expert_tokens && !L->is_mtp)
                    naive_trace->expert_tokens[(L - nv->L) * E + best]++;
            }
            for (int kk = 0; kk < K; kk++) {
                double w = cfg->norm_expert_weight ? s[sel[kk]] / tot : s[sel[kk]];
                w *= cfg->router_scaling_factor;
                ffn(&L->eg[sel[kk]], &L->eu[sel[kk]], &L->ed[sel[kk]], L->lim_routed, a, tmp);
                for (int i = 0; i < H; i++)
                    o[i] += w * tmp[i];
            }
        }
        for (int i = 0; i < H; i++)
            ht[i] += o[i];
    }
    free(a); free(o); free(q); free(k); free(v); free(g); free(att); free(sc);
}

static void head(struct naive *nv, const struct nmat *norm, const struct nmat *W, const double *h,
                 int n, double *logits)
{
    double *a = malloc(sizeof(double) * (size_t)nv->H);
    for (int t = 0; t < n; t++) {
        rms(h + (size_t)t * nv->H, norm, nv->H, nv->cfg->rms_norm_eps, a);
        mv(W, a, logits + (size_t)t * W->rows);
    }
    free(a);
}

void naive_trunk(struct naive *nv, const int32_t *x, int n, double *ret_hidden, double *ret_logits)
{
    int H = nv->H;
    double *h = malloc(sizeof(double) * (size_t)n * H);

    for (int t = 0; t < n; t++)
        memcpy(h + (size_t)t * H, nv->embed.w + (size_t)x[t] * H, sizeof(double) * H);
    for (int l = 0; l <= nv->n_layers; l++) {
        if (l > 0)
            layer(nv, &nv->L[l - 1], h, n);
        if (naive_trace && naive_trace->resid_rms) {
            double ss = 0;
            for (size_t i = 0; i < (size_t)n * H; i++)
                ss += h[i] * h[i];
            naive_trace->resid_rms[l] = sqrt(ss / ((double)n * H));
        }
    }
    if (ret_hidden)
        memcpy(ret_hidden, h, sizeof(double) * (size_t)n * H);
    if (ret_logits)
        head(nv, &nv->final_norm, &nv->lm_head, h, n, ret_logits);
    free(h);
}

void naive_mtp(struct naive *nv, int k, const int32_t *ids, const double *g, int n,
               double *ret_hidden, double *ret_logits)
{
    struct nlayer *L = &nv->L[nv->n_layers + k];
    int H = nv->H;
    double *h = malloc(sizeof(double) * (size_t)n * H), *cat = malloc(sizeof(double) * 2 * H);

    for (int t = 0; t < n; t++) {
        rms(nv->embed.w + (size_t)ids[t] * H, &L->enorm, H, nv->cfg->rms_norm_eps, cat);
        rms(g + (size_t)t * H, &L->hnorm, H, nv->cfg->rms_norm_eps, cat + H);
        mv(&L->eh, cat, h + (size_t)t * H);
    }
    layer(nv, L, h, n);
    if (ret_hidden)
        memcpy(ret_hidden, h, sizeof(double) * (size_t)n * H);
    if (ret_logits)
        head(nv, &L->head_norm, &L->head, h, n, ret_logits);
    free(h);
    free(cat);
}
