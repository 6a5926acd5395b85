/* tensors.c - the tensor table of the reading side (tensors.h). */
#include "tensors.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "err.h"

#define LIN TENSOR_DT_LINEAR
#define BF16 TENSOR_DT_BF16
#define D(x) TENSOR_DIM_##x

const struct tensor_spec tensor_table[] = {
    /* globals: embed, final norm, head */
    { TENSOR_EMBED, "model.embed_tokens.weight", TENSOR_GLOBAL, BF16, -1, { D(VOCAB), D(HIDDEN) }, TENSOR_WHOLE },
    { TENSOR_FINAL_NORM, "model.norm.weight", TENSOR_GLOBAL, BF16, -1, { D(HIDDEN), D(NONE) }, TENSOR_WHOLE },
    { TENSOR_LM_HEAD, "lm_head", TENSOR_GLOBAL, LIN, -1, { D(VOCAB), D(HIDDEN) }, TENSOR_ROWS },
    /* every layer: attention */
    { TENSOR_IN_NORM, "input_layernorm.weight", TENSOR_EVERY_LAYER, BF16, -1, { D(HIDDEN), D(NONE) }, TENSOR_WHOLE },
    { TENSOR_POST_NORM, "post_attention_layernorm.weight", TENSOR_EVERY_LAYER, BF16, -1, { D(HIDDEN), D(NONE) },
      TENSOR_WHOLE },
    { TENSOR_Q, "self_attn.q_proj", TENSOR_EVERY_LAYER, LIN, QMOD_Q, { D(Q), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_K, "self_attn.k_proj", TENSOR_EVERY_LAYER, LIN, QMOD_K, { D(KV), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_V, "self_attn.v_proj", TENSOR_EVERY_LAYER, LIN, QMOD_V, { D(KV), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_O, "self_attn.o_proj", TENSOR_EVERY_LAYER, LIN, QMOD_O, { D(HIDDEN), D(Q) }, TENSOR_COLS },
    { TENSOR_G, "self_attn.g_proj", TENSOR_HEAD_GATE, LIN, QMOD_G, { D(HEADS), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_Q_NORM, "self_attn.q_norm.weight", TENSOR_QK_NORM, BF16, -1, { D(HEAD), D(NONE) }, TENSOR_WHOLE },
    { TENSOR_K_NORM, "self_attn.k_norm.weight", TENSOR_QK_NORM, BF16, -1, { D(HEAD), D(NONE) }, TENSOR_WHOLE },
    /* dense layers (trunk and MTP): the MLP */
    { TENSOR_MLP_GATE, "mlp.gate_proj", TENSOR_DENSE, LIN, QMOD_MLP_GATE, { D(INTER), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_MLP_UP, "mlp.up_proj", TENSOR_DENSE, LIN, QMOD_MLP_UP, { D(INTER), D(HIDDEN) }, TENSOR_ROWS },
    { TENSOR_MLP_DOWN, "mlp.down_proj", TENSOR_DENSE, LIN, QMOD_MLP_DOWN, { D(HIDDEN), D(INTER) }, TENSOR_COLS },
    /* MoE layers: router, shared expert, routed experts */
    { TENSOR_ROUTER, "moe.gate", TENSOR_MOE, LIN, QMOD_ROUTER, { D(EXPERTS), D(HIDDEN) }, TENSOR_WHOLE },
    { TENSOR_ROUTER_BIAS, "moe.router_bias", TENSOR_MOE_BIAS, TENSOR_DT_F32_OR_BF16, -1, { D(EXPERTS), D(NONE) },
      TENSOR_WHOLE },
    { TENSOR_SHARED_GATE, "share_expert.gate_proj", TENSOR_MOE, LIN, QMOD_SHARED_GATE, { D(SHARED), D(HIDDEN) },
      TENSOR_ROWS },
    { TENSOR_SHARED_UP, "share_expert.up_proj", TENSOR_MOE, LIN, QMOD_SHARED_UP, { D(SHARED), D(HIDDEN) },
      TENSOR_ROWS },
    { TENSOR_SHARED_DOWN, "share_expert.down_proj", TENSOR_MOE, LIN, QMOD_SHARED_DOWN, { D(HIDDEN), D(SHARED) },
      TENSOR_COLS },
    { TENSOR_EXPERT_GATE, "moe.experts.%d.gate_proj", TENSOR_EXPERT, LIN, QMOD_EXPERT_GATE,
      { D(MOE_INTER), D(HIDDEN) }, TENSOR_WHOLE },
    { TENSOR_EXPERT_UP, "moe.experts.%d.up_proj", TENSOR_EXPERT, LIN, QMOD_EXPERT_UP, { D(MOE_INTER), D(HIDDEN) },
      TENSOR_WHOLE },
    { TENSOR_EXPERT_DOWN, "moe.experts.%d.down_proj", TENSOR_EXPERT, LIN, QMOD_EXPERT_DOWN,
      { D(HIDDEN), D(MOE_INTER) }, TENSOR_WHOLE },
    /* MTP layers: the input projection and the shared head */
    { TENSOR_ENORM, "enorm.weight", TENSOR_MTP, BF16, -1, { D(HIDDEN), D(NONE) }, TENSOR_WHOLE },
    { TENSOR_HNORM, "hnorm.weight", TENSOR_MTP, BF16, -1, { D(HIDDEN), D(NONE) }, TENSOR_WHOLE },
    { TENSOR_EH_PROJ, "eh_proj", TENSOR_MTP, LIN, QMOD_EH_PROJ, { D(HIDDEN), D(2HIDDEN) }, TENSOR_WHOLE },
    { TENSOR_HEAD_NORM, "transformer.shared_head.norm.weight", TENSOR_MTP, BF16, -1, { D(HIDDEN), D(NONE) },
      TENSOR_WHOLE },
    { TENSOR_HEAD_OUT, "transformer.shared_head.output", TENSOR_MTP, LIN, QMOD_HEAD_OUT, { D(VOCAB), D(HIDDEN) },
      TENSOR_WHOLE },
    { 0 },
};

#undef LIN
#undef BF16
#undef D

static const char *const optional_suffixes[] = {
    ".k_scale", ".v_scale", ".q_scale", ".prob_scale",
    ".k_zero_point", ".v_zero_point", ".q_zero_point", ".prob_zero_point",
};

int tensor_optional_index(const char *name)
{
    size_t n = strlen(name);

    for (size_t i = 0; i < ARRAY_SIZE(optional_suffixes); i++) {
        size_t k = strlen(optional_suffixes[i]);

        if (n > k && strcmp(name + n - k, optional_suffixes[i]) == 0)
            return (int)i;
    }
    return -1;
}

bool tensor_in_layer(const struct model_config *c, int l, const struct tensor_spec *t)
{
    const struct layer_config *L = &c->layers[l];

    switch (t->when) {
    case TENSOR_GLOBAL: return false;
    case TENSOR_EVERY_LAYER: return true;
    case TENSOR_HEAD_GATE: return c->use_head_wise_attn_gate;
    case TENSOR_QK_NORM: return c->use_qk_norm;
    case TENSOR_DENSE: return !L->is_moe;
    case TENSOR_MOE: case TENSOR_EXPERT: return L->is_moe;
    case TENSOR_MOE_BIAS: return L->is_moe && c->use_router_bias;
    case TENSOR_MTP: return L->is_mtp;
    }
    return false;
}

static int64_t dim_value(const struct model_config *c, int l, enum tensor_dim d)
{
    const struct layer_config *L = l >= 0 ? &c->layers[l] : NULL;

    switch (d) {
    case TENSOR_DIM_NONE: return 0;
    case TENSOR_DIM_HIDDEN: return c->hidden_size;
    case TENSOR_DIM_2HIDDEN: return 2 * (int64_t)c->hidden_size;
    case TENSOR_DIM_HEAD: return L->head_dim;
    case TENSOR_DIM_Q: return (int64_t)L->n_heads * L->head_dim;
    case TENSOR_DIM_KV: return (int64_t)L->n_kv_heads * L->head_dim;
    case TENSOR_DIM_HEADS: return L->n_heads;
    case TENSOR_DIM_INTER: return c->intermediate_size;
    case TENSOR_DIM_SHARED: return c->shared_expert_dim;
    case TENSOR_DIM_MOE_INTER: return c->moe_intermediate_size;
    case TENSOR_DIM_EXPERTS: return c->n_experts;
    case TENSOR_DIM_VOCAB: return c->vocab_size;
    }
    return 0;
}

/* ref for row t of layer l (-1: global) as a rank of world reads it */
static void ref_fill(const struct model_config *c, int l, int expert, int world, const struct tensor_spec *t,
                     struct tensor_ref *r)
{
    char mod[128];

    memset(r, 0, sizeof(*r));
    r->spec = t;
    r->layer = l;
    r->expert = expert;
    if (l < 0) {
        snprintf(r->name, sizeof(r->name), "%s", t->name);
    } else {
        if (expert >= 0)
            snprintf(mod, sizeof(mod), t->name, expert);
        else
            snprintf(mod, sizeof(mod), "%s", t->name);
        snprintf(r->name, sizeof(r->name), "model.layers.%d.%s", l, mod);
    }
    r->ndim = t->dim[1] == TENSOR_DIM_NONE ? 1 : 2;
    r->shape[0] = dim_value(c, l, t->dim[0]);
    r->shape[1] = dim_value(c, l, t->dim[1]);
    r->split = l >= 0 && c->layers[l].is_mtp ? TENSOR_WHOLE : t->split;
    if (r->split != TENSOR_WHOLE && world > 1)
        r->shape[r->split == TENSOR_ROWS ? 0 : 1] /= world;
    if (t->dtype == TENSOR_DT_LINEAR)
        r->quant = l < 0 ? (c->tie_word_embeddings ? QUANT_NONE : (enum quant_scheme)c->lm_head_qfmt)
                         : (enum quant_scheme)c->layers[l].qfmt[t->quant_module];
}

int tensor_layer_each(const struct model_config *c, int l, int world, int expert_first, int expert_count,
                      int (*fn)(void *ctx, const struct tensor_ref *t), void *ctx)
{
    struct tensor_ref ref;
    int r;

    if (c->layers[l].is_mtp)
        world = 1;
    for (const struct tensor_spec *t = tensor_table; t->name; t++) {
        if (!tensor_in_layer(c, l, t))
            continue;
        if (t->when != TENSOR_EXPERT) {
            ref_fill(c, l, -1, world, t, &ref);
            if ((r = fn(ctx, &ref)) < 0)
                return r;
            continue;
        }
        /* the routed experts: all three projections of one expert, then the next */
        for (int x = expert_first; x < expert_first + expert_count; x++) {
            for (const struct tensor_spec *u = t; u->name && u->when == TENSOR_EXPERT; u++) {
                ref_fill(c, l, x, world, u, &ref);
                if ((r = fn(ctx, &ref)) < 0)
                    return r;
            }
        }
        while (t[1].name && t[1].when == TENSOR_EXPERT)
            t++;
    }
    return 0;
}

int tensor_global_each(const struct model_config *c, int world,
                       int (*fn)(void *ctx, const struct tensor_ref *t), void *ctx)
{
    struct tensor_ref ref;
    int r;

    for (const struct tensor_spec *t = tensor_table; t->name; t++) {
        if (t->when != TENSOR_GLOBAL)
            continue;
        ref_fill(c, -1, -1, world, t, &ref);
        if ((r = fn(ctx, &ref)) < 0)
            return r;
    }
    return 0;
}

int tensor_linear_parts(enum quant_scheme q, int64_t out, int64_t in, int64_t br, int64_t bc,
                        struct tensor_part parts[TENSOR_MAX_PARTS])
{
    switch (q) {
    case QUANT_MXFP4:
    case QUANT_NVFP4: {
        int64_t g = q == QUANT_MXFP4 ? 32 : 16;

        if (in % g)
            return -EINVAL;
        parts[0] = (struct tensor_part){ q == QUANT_MXFP4 ? ".weight_packed" : ".weight", DTYPE_U8, 2,
                                         { out, in / 2 } };
        parts[1] = (struct tensor_part){ ".weight_scale", q == QUANT_MXFP4 ? DTYPE_U8 : DTYPE_F8_E4M3, 2,
                                         { out, in / g } };
        if (q == QUANT_MXFP4)
            return 2;
        parts[2] = (struct tensor_part){ ".weight_scale_2", DTYPE_F32, 0, { 0, 0 } };
        return 3;
    }
    case QUANT_FP8:
        if (br <= 0 || bc <= 0 || out % br || in % bc)
            return -EINVAL;
        parts[0] = (struct tensor_part){ ".weight", DTYPE_F8_E4M3, 2, { out, in } };
        parts[1] = (struct tensor_part){ ".weight_scale_inv", DTYPE_F32, 2, { out / br, in / bc } };
        return 2;
    case QUANT_NONE:
    case _QUANT_MAX:
        break;
    }
    parts[0] = (struct tensor_part){ ".weight", DTYPE_BF16, 2, { out, in } };
    return 1;
}
