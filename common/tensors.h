/* tensors.h - THE tensor table of the reading side: every tensor a Step-3.x checkpoint holds
 * for the text model, once (docs/MODEL.md §4).  The loader's expected list (common/loader.c)
 * and the model's load_layer() (worker/model/model-load.c) both walk it; the writer
 * tools/ckptw.c stays independent of it (the tests' oracle).
 *
 * A row: the role (what the model does with it), the name after "model.layers.L." (or the
 * whole name of a global tensor; "%d" is the routed expert), which layers have it, its
 * logical shape [out, in] in config fields, how it splits over the ranks and its dtype rule:
 * a norm is BF16, the router bias F32 (or BF16), a linear module is stored in the format
 * quantization_config gives it (tensor_linear_parts).  A new tensor is one row here.
 *
 * The optional-parameter rule (.k_scale .v_scale .q_scale .prob_scale and their
 * _zero_point twins: never required, never validated, on trunk and MTP layers alike) is
 * here too: tensor_optional_index(). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a tensor is to the model (the model maps each to where it keeps it). */
enum tensor_role {
    TENSOR_EMBED, TENSOR_FINAL_NORM, TENSOR_LM_HEAD,
    TENSOR_IN_NORM, TENSOR_POST_NORM,
    TENSOR_Q, TENSOR_K, TENSOR_V, TENSOR_O, TENSOR_G, TENSOR_Q_NORM, TENSOR_K_NORM,
    TENSOR_MLP_GATE, TENSOR_MLP_UP, TENSOR_MLP_DOWN,
    TENSOR_ROUTER, TENSOR_ROUTER_BIAS,
    TENSOR_SHARED_GATE, TENSOR_SHARED_UP, TENSOR_SHARED_DOWN,
    TENSOR_EXPERT_GATE, TENSOR_EXPERT_UP, TENSOR_EXPERT_DOWN,
    TENSOR_ENORM, TENSOR_HNORM, TENSOR_EH_PROJ, TENSOR_HEAD_NORM, TENSOR_HEAD_OUT,
    _TENSOR_ROLE_MAX,
};

/* Which tensors (or layers) have a row. */
enum tensor_when {
    TENSOR_GLOBAL,          /* once per model, outside the layers */
    TENSOR_EVERY_LAYER,     /* trunk and MTP layers */
    TENSOR_HEAD_GATE,       /* every layer, with use_head_wise_attn_gate */
    TENSOR_QK_NORM,         /* every layer, with use_qk_norm */
    TENSOR_DENSE,           /* layers with a dense MLP (not MoE: dense trunk and MTP layers) */
    TENSOR_MOE,             /* MoE layers */
    TENSOR_MOE_BIAS,        /* MoE layers, with use_router_bias */
    TENSOR_EXPERT,          /* MoE layers, once per routed expert */
    TENSOR_MTP,             /* MTP layers */
};

/* A logical dimension, in config fields (layer l's where they differ per layer). */
enum tensor_dim {
    TENSOR_DIM_NONE,        /* 1-D tensors: no second dimension */
    TENSOR_DIM_HIDDEN,      /* hidden_size */
    TENSOR_DIM_2HIDDEN,     /* 2 * hidden_size (eh_proj's input) */
    TENSOR_DIM_HEAD,        /* head_dim of layer l */
    TENSOR_DIM_Q,           /* query heads x head_dim of layer l */
    TENSOR_DIM_KV,          /* KV heads x head_dim of layer l */
    TENSOR_DIM_HEADS,       /* query heads of layer l (the head-wise gate) */
    TENSOR_DIM_INTER,       /* intermediate_size (dense MLP) */
    TENSOR_DIM_SHARED,      /* share_expert_dim */
    TENSOR_DIM_MOE_INTER,   /* moe_intermediate_size (one routed expert) */
    TENSOR_DIM_EXPERTS,     /* moe_num_experts */
    TENSOR_DIM_VOCAB,       /* vocab_size */
};

/* Its dtype. */
enum tensor_dtype {
    TENSOR_DT_BF16,         /* norms, the embedding: BF16 */
    TENSOR_DT_F32_OR_BF16,  /* the router bias: F32, BF16 accepted */
    TENSOR_DT_LINEAR,       /* a linear module: the format of its quant_module (layers[l].qfmt,
                             * lm_head_qfmt): tensor_linear_parts() */
};

/* How a trunk tensor splits over tensor-parallel ranks (MTP layers are whole on rank 0; the
 * routed experts are split by expert, not by rows). */
enum tensor_split {
    TENSOR_WHOLE,           /* every rank holds all of it */
    TENSOR_ROWS,            /* dimension 0: query/KV heads, MLP rows, lm_head's vocab rows */
    TENSOR_COLS,            /* dimension 1: o_proj, down_proj */
};

struct tensor_spec {
    enum tensor_role role;
    const char *name;               /* after "model.layers.L." ("%d": the expert), or global */
    enum tensor_when when;
    enum tensor_dtype dtype;
    int quant_module;               /* enum quant_module of a linear (-1: none, or lm_head) */
    enum tensor_dim dim[2];         /* [out, in]; dim[1] NONE: a vector [dim[0]] */
    enum tensor_split split;
};

/* The table, in the order the loader lists (and plan dumps print) the tensors: the globals,
 * then each layer's.  Ends with a row whose name is NULL. */
extern const struct tensor_spec tensor_table[];

/* Whether layer l of c has row t (never for globals). */
bool tensor_in_layer(const struct model_config *c, int l, const struct tensor_spec *t);

/* One tensor of the table as a rank reads it. */
struct tensor_ref {
    const struct tensor_spec *spec;
    char name[160];                 /* "model.layers.L.<name>" (a linear: its base, before
                                     * ".weight"), or the global name */
    int layer;                      /* -1 for globals */
    int expert;                     /* -1 unless TENSOR_EXPERT */
    int ndim;                       /* 1 or 2 */
    int64_t shape[2];               /* [out, in]: the rank's share when split (world > 1) */
    enum tensor_split split;        /* TENSOR_WHOLE on MTP layers */
    enum quant_scheme quant;        /* TENSOR_DT_LINEAR: the module's format */
};

/* Call fn for each tensor of layer l, in table order, as a rank of `world` holding routed
 * experts [expert_first, expert_first + expert_count) reads it (world 1 and every expert:
 * the whole model's shapes, as the loader lists them).  MTP layers are whole (world 1).
 * Stops at the first negative return of fn and returns it; 0 otherwise. */
int tensor_layer_each(const struct model_config *c, int l, int world, int expert_first, int expert_count,
                      int (*fn)(void *ctx, const struct tensor_ref *t), void *ctx);

/* The same for the global tensors (the embedding, the final norm, lm_head: its format is
 * lm_head_qfmt, or BF16 when tied to the embedding). */
int tensor_global_each(const struct model_config *c, int world,
                       int (*fn)(void *ctx, const struct tensor_ref *t), void *ctx);

/* The stored tensors of a linear module of logical shape [out, in] in format q (suffixes to
 * its base name):
 *   BF16   .weight BF16 [out, in]
 *   MXFP4  .weight_packed U8 [out, in/2], .weight_scale U8 (E8M0) [out, in/32]
 *   FP8    .weight F8_E4M3 [out, in], .weight_scale_inv F32 [out/br, in/bc]
 *   NVFP4  .weight U8 [out, in/2], .weight_scale F8_E4M3 [out, in/16], .weight_scale_2 F32 []
 * br, bc: the FP8 block (quant_block_rows, quant_group_size).  Fills parts[] (at most
 * TENSOR_MAX_PARTS) and returns their number, or -EINVAL when a group or block size does not
 * divide the shape. */
#define TENSOR_MAX_PARTS 3
struct tensor_part {
    const char *suffix;
    enum dtype dtype;
    int ndim;                       /* 2, or 0 for a scalar */
    int64_t shape[2];
};
int tensor_linear_parts(enum quant_scheme q, int64_t out, int64_t in, int64_t br, int64_t bc,
                        struct tensor_part parts[TENSOR_MAX_PARTS]);

/* The optional-parameter rule: which suffix name ends with, as enum ckpt_kv_param
 * (.k_scale, .v_scale, .q_scale, .prob_scale, .k_zero_point, .v_zero_point, .q_zero_point,
 * .prob_zero_point), or -1. */
int tensor_optional_index(const char *name);

#ifdef __cplusplus
}
#endif
