/* config.h - the typed model configuration parsed from config.json.
 *
 * Accepts both the flat Step-3.5 layout (text fields at top level) and Step-3.7's
 * nested "text_config".  Every constant of the forward pass is derived from here
 * (docs/MODEL.md §2 preamble), so tiny models of the same family run through the same
 * code.  Per-layer arrays cover trunk and MTP layers: index 0 .. n_layers_total-1,
 * n_layers_total = num_hidden_layers + num_nextn_predict_layers.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MODEL_MAX_LAYERS 128
#define MODEL_MAX_EOS 8

enum layer_kind {
    LAYER_KIND_FULL,     /* full (causal) attention */
    LAYER_KIND_SLIDING,  /* sliding window attention */
    _LAYER_KIND_MAX,
};

enum quant_scheme {
    QUANT_NONE,          /* dense BF16 "<base>.weight" */
    QUANT_MXFP4,         /* compressed-tensors mxfp4-pack-quantized: group 32, E2M1 + E8M0 */
    QUANT_FP8,           /* "fp8" with weight_block_size [128, 128]: E4M3 + F32 weight_scale_inv */
    QUANT_NVFP4,         /* modelopt NVFP4: E2M1 + E4M3 scale per 16 + F32 weight_scale_2 */
    _QUANT_MAX,
};

/* The linear modules of a layer whose format quantization_config selects (the
 * routed experts' three projections share one entry each for every expert). */
enum quant_module {
    QMOD_Q, QMOD_K, QMOD_V, QMOD_O, QMOD_G,
    QMOD_MLP_GATE, QMOD_MLP_UP, QMOD_MLP_DOWN,
    QMOD_ROUTER,
    QMOD_SHARED_GATE, QMOD_SHARED_UP, QMOD_SHARED_DOWN,
    QMOD_EXPERT_GATE, QMOD_EXPERT_UP, QMOD_EXPERT_DOWN,
    QMOD_EH_PROJ, QMOD_HEAD_OUT,
    _QMOD_MAX,
};

struct layer_config {
    enum layer_kind kind;
    int n_heads;              /* query heads (full: num_attention_heads; sliding: attention_other_setting) */
    int n_kv_heads;           /* num_attention_groups (or the sliding override) */
    int head_dim;
    int rotary_dims;          /* R = partial_rotary_factors[l] * head_dim (even) */
    double rope_theta;
    bool rope_llama3;         /* llama3 scaling applies (layer kind listed in yarn_only_types) */
    bool is_moe;              /* listed in moe_layers_enum (never for MTP layers) */
    bool is_mtp;
    float swiglu_limit;       /* routed experts; 0 = no clamp */
    float swiglu_limit_shared;/* dense MLP and shared expert; 0 = no clamp */
    uint8_t qfmt[_QMOD_MAX];  /* enum quant_scheme of each linear module (QUANT_NONE: BF16) */
};

struct model_config {
    char model_type[32];      /* "step3p7" or "step3p5" */
    bool nested;              /* fields came from text_config */

    int hidden_size;
    int intermediate_size;    /* dense MLP (dense trunk layers and MTP layers) */
    int n_layers;             /* num_hidden_layers (trunk) */
    int n_mtp_layers;         /* num_nextn_predict_layers */
    int n_layers_total;       /* n_layers + n_mtp_layers */
    int vocab_size;
    int max_position_embeddings;
    float rms_norm_eps;

    int n_heads_full, n_heads_sliding;
    int n_kv_heads;           /* num_attention_groups */
    int head_dim;
    int sliding_window;       /* keys visible to a sliding layer, including the current one */

    /* MoE */
    int n_experts;            /* moe_num_experts */
    int top_k;                /* moe_top_k */
    int moe_intermediate_size;
    int shared_expert_dim;    /* share_expert_dim */
    bool norm_expert_weight;
    float router_scaling_factor;
    bool use_router_bias;

    /* llama3 rope scaling (applies where layer_config.rope_llama3) */
    struct {
        bool present;
        double factor;
        double low_freq_factor, high_freq_factor;
        double original_max_position_embeddings;
    } rope_scaling;

    bool use_qk_norm;
    bool use_head_wise_attn_gate;
    bool tie_word_embeddings;

    int bos_token_id;
    int eos_token_ids[MODEL_MAX_EOS];
    int n_eos;

    /* quantization_config: the checkpoint's scheme, and per module layers[l].qfmt */
    enum quant_scheme quant;
    int quant_group_size;     /* elements per scale: 32 MXFP4, 16 NVFP4, 128 FP8 (block columns) */
    int quant_block_rows;     /* FP8: rows per scale block (128); 1 otherwise */
    uint8_t lm_head_qfmt;     /* enum quant_scheme of lm_head (QUANT_NONE unless quantised) */

    struct layer_config layers[MODEL_MAX_LAYERS];

    /* what the parser assumed (e.g. MTP layer defaults when the per-layer lists only
     * cover the trunk); "" if nothing. For logs and stepd-inspect. */
    char notes[512];
};

/* "self_attn.q_proj", "moe.experts.E.gate_proj" (E = the expert), ...: the module's
 * name after "model.layers.L." (buf holds it). */
const char *quant_module_name(enum quant_module m, int expert, char *buf, size_t size);
/* Whether layer l of c has linear module m (g_proj with the head-wise gate, the dense
 * MLP or the MoE modules, eh_proj / shared_head.output on MTP layers, ...). */
bool model_config_has_module(const struct model_config *c, int l, enum quant_module m);
/* Set quant to q with its group sizes (FP8: 128 x 128 blocks) and the layout the
 * writers use: the routed experts in q, every other module BF16. */
void model_config_set_quant(struct model_config *c, enum quant_scheme q);
/* "BF16", "MXFP4", "FP8", "NVFP4" */
const char *quant_scheme_name(enum quant_scheme q);

/* Parse config.json at path into *ret.  On error returns a negative errno and
 * writes one sentence into e naming the file and the JSON path of the bad field
 * (e.g. "config.json: text_config.layer_types: has 7 entries, expected 8"). */
int model_config_load(const char *path, struct model_config *ret, struct err_buf *e);
/* --max-model-len L against the model's max_position_embeddings: 0, or -EINVAL with a
 * sentence naming the model's limit and the override (allow_long: --allow-long-max-model-len,
 * as vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) when L is above it and allow_long is false. */
int model_config_check_len(const struct model_config *c, int max_model_len, bool allow_long,
                           struct err_buf *e);
/* Same, from a JSON text already in memory; name is used in messages. */
int model_config_parse(const char *json, size_t len, const char *name,
                       struct model_config *ret, struct err_buf *e);

#ifdef __cplusplus
}
#endif
