/* test-config.c - config.json parsing (docs/MODEL.md §1, §5.4): the flat and nested
 * layouts, the real Step-3.7 values, MTP defaults when lists cover the trunk only,
 * and one error per bad field naming its JSON path. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "ckptw.h"
#include "config.h"
#include "harness.h"

static char *tmp;

/* config text for cfg as ckptw writes it */
static json_t *base_json(const struct model_config *cfg, bool nested, bool trunk_only)
{
    char path[512];
    struct err_buf e;
    json_error_t je;
    json_t *j;
    snprintf(path, sizeof(path), "%s/config.json", tmp);
    ASSERT_OK(ckptw_write_config(path, cfg, nested, trunk_only, &e));
    j = json_load_file(path, 0, &je);
    ASSERT_TRUE(j != NULL);
    return j;
}

static int parse_json(json_t *j, struct model_config *out, struct err_buf *e)
{
    char *s = json_dumps(j, JSON_COMPACT);
    int r = model_config_parse(s, strlen(s), "config.json", out, e);
    free(s);
    return r;
}

static void check_same(const struct model_config *a, const struct model_config *b)
{
    ASSERT_EQ(a->hidden_size, b->hidden_size);
    ASSERT_EQ(a->intermediate_size, b->intermediate_size);
    ASSERT_EQ(a->n_layers, b->n_layers);
    ASSERT_EQ(a->n_mtp_layers, b->n_mtp_layers);
    ASSERT_EQ(a->n_layers_total, b->n_layers_total);
    ASSERT_EQ(a->vocab_size, b->vocab_size);
    ASSERT_EQ(a->max_position_embeddings, b->max_position_embeddings);
    ASSERT_EQ(a->rms_norm_eps, b->rms_norm_eps);
    ASSERT_EQ(a->n_heads_full, b->n_heads_full);
    ASSERT_EQ(a->n_heads_sliding, b->n_heads_sliding);
    ASSERT_EQ(a->n_kv_heads, b->n_kv_heads);
    ASSERT_EQ(a->head_dim, b->head_dim);
    ASSERT_EQ(a->sliding_window, b->sliding_window);
    ASSERT_EQ(a->n_experts, b->n_experts);
    ASSERT_EQ(a->top_k, b->top_k);
    ASSERT_EQ(a->moe_intermediate_size, b->moe_intermediate_size);
    ASSERT_EQ(a->shared_expert_dim, b->shared_expert_dim);
    ASSERT_EQ(a->norm_expert_weight, b->norm_expert_weight);
    ASSERT_EQ(a->router_scaling_factor, b->router_scaling_factor);
    ASSERT_EQ(a->use_router_bias, b->use_router_bias);
    ASSERT_EQ(a->rope_scaling.present, b->rope_scaling.present);
    ASSERT_EQ(a->rope_scaling.factor, b->rope_scaling.factor);
    ASSERT_EQ(a->rope_scaling.high_freq_factor, b->rope_scaling.high_freq_factor);
    ASSERT_EQ(a->rope_scaling.original_max_position_embeddings, b->rope_scaling.original_max_position_embeddings);
    ASSERT_EQ(a->use_qk_norm, b->use_qk_norm);
    ASSERT_EQ(a->use_head_wise_attn_gate, b->use_head_wise_attn_gate);
    ASSERT_EQ(a->tie_word_embeddings, b->tie_word_embeddings);
    ASSERT_EQ(a->bos_token_id, b->bos_token_id);
    ASSERT_EQ(a->n_eos, b->n_eos);
    for (int i = 0; i < a->n_eos; i++)
        ASSERT_EQ(a->eos_token_ids[i], b->eos_token_ids[i]);
    ASSERT_EQ(a->quant, b->quant);
    ASSERT_EQ(a->quant_group_size, b->quant_group_size);
    ASSERT_EQ(a->quant_block_rows, b->quant_block_rows);
    ASSERT_EQ(a->lm_head_qfmt, b->lm_head_qfmt);
    for (int i = 0; i < a->n_layers_total; i++) {
        const struct layer_config *x = &a->layers[i], *y = &b->layers[i];
        if (memcmp(x->qfmt, y->qfmt, sizeof(x->qfmt)) != 0)
            FAIL("layer %d: module formats differ", i);
        if (x->kind != y->kind || x->n_heads != y->n_heads || x->n_kv_heads != y->n_kv_heads ||
            x->head_dim != y->head_dim || x->rotary_dims != y->rotary_dims || x->rope_theta != y->rope_theta ||
            x->rope_llama3 != y->rope_llama3 || x->is_moe != y->is_moe || x->is_mtp != y->is_mtp ||
            x->swiglu_limit != y->swiglu_limit || x->swiglu_limit_shared != y->swiglu_limit_shared)
            FAIL("layer %d differs", i);
    }
}

/* Property: the real Step-3.7 values round-trip through both layouts. */
static void test_real_values(void)
{
    struct model_config want, got;
    struct err_buf e = { "" };
    json_t *j;

    ckptw_config_step37(&want);
    for (int nested = 0; nested < 2; nested++) {
        j = base_json(&want, nested, false);
        if (parse_json(j, &got, &e) < 0)
            FAIL("%s", e.msg);
        check_same(&want, &got);
        ASSERT_EQ(got.nested, nested);
        ASSERT_STREQ(got.notes, "");
        json_decref(j);
    }
    /* spot checks against docs/MODEL.md §1.3 */
    ASSERT_EQ(got.layers[0].n_heads, 64);
    ASSERT_EQ(got.layers[0].rotary_dims, 64);
    ASSERT_EQ(got.layers[1].n_heads, 96);
    ASSERT_EQ(got.layers[2].is_moe, 0);
    ASSERT_EQ(got.layers[3].is_moe, 1);
    ASSERT_EQ(got.layers[44].swiglu_limit, 7.0f);
    ASSERT_EQ(got.layers[44].kind, LAYER_KIND_FULL);
    ASSERT_TRUE(got.layers[44].rope_llama3);
    ASSERT_EQ(got.layers[45].kind, LAYER_KIND_SLIDING);
    ASSERT_TRUE(got.layers[45].is_mtp && !got.layers[45].is_moe);
    ASSERT_EQ(got.layers[47].rope_theta, 1e4);
}

/* Property: lists with only num_hidden_layers entries give MTP layers the §1.3
 * defaults, and the parser says so. A scalar rope_theta applies to every layer. */
static void test_trunk_only_lists(void)
{
    struct model_config want, got;
    struct err_buf e = { "" };
    json_t *j;

    ckptw_config_step37(&want);
    j = base_json(&want, true, true);
    ASSERT_EQ(json_array_size(json_object_get(json_object_get(j, "text_config"), "layer_types")), 45);
    if (parse_json(j, &got, &e) < 0)
        FAIL("%s", e.msg);
    check_same(&want, &got);
    ASSERT_CONTAINS(got.notes, "MTP layers use the docs/MODEL.md 1.3 defaults");
    json_object_set_new(json_object_get(j, "text_config"), "rope_theta", json_real(1e6));
    ASSERT_OK(parse_json(j, &got, &e));
    ASSERT_EQ(got.layers[0].rope_theta, 1e6);
    ASSERT_EQ(got.layers[47].rope_theta, 1e6);
    json_decref(j);
}

struct bad {
    const char *key;       /* text_config key to change ("" -> top-level change via top_key) */
    const char *value;     /* JSON text, or NULL to delete */
    int err;
    const char *msg;
};

/* Property: each bad field is refused with a message naming its JSON path. */
static void test_bad_fields(void)
{
    static const struct bad cases[] = {
        { "hidden_size", NULL, -ENOENT, "config.json: text_config.hidden_size: required field is missing" },
        { "hidden_size", "\"4096\"", -EINVAL, "text_config.hidden_size: expected an integer, got a string" },
        { "hidden_size", "4096.5", -EINVAL, "text_config.hidden_size: expected an integer, got a real number" },
        { "hidden_size", "-1", -EINVAL, "text_config.hidden_size: -1 is out of range" },
        { "num_hidden_layers", "0", -EINVAL, "text_config.num_hidden_layers: 0 is out of range" },
        { "num_hidden_layers", "200", -EINVAL, "num_hidden_layers: 200 is out of range" },
        { "vocab_size", NULL, -ENOENT, "text_config.vocab_size: required field is missing" },
        { "head_dim", "true", -EINVAL, "text_config.head_dim: expected an integer, got true" },
        { "layer_types", "[\"full_attention\"]", -EINVAL, "text_config.layer_types: has 1 entries, expected 48 (num_hidden_layers + num_nextn_predict_layers) or num_hidden_layers" },
        { "layer_types", "\"full_attention\"", -EINVAL, "text_config.layer_types: expected an array, got a string" },
        { "rope_theta", "[1, 2, 3]", -EINVAL, "text_config.rope_theta: has 3 entries, expected 48" },
        { "rope_theta", NULL, -ENOENT, "text_config.rope_theta: required field is missing" },
        { "rope_theta", "\"big\"", -EINVAL, "text_config.rope_theta: expected a number or a list of numbers, got a string" },
        { "rope_theta", "-5", -EINVAL, "text_config.rope_theta[0]: rope_theta must be positive" },
        { "partial_rotary_factors", "[0.5]", -EINVAL, "text_config.partial_rotary_factors: has 1 entries, expected 48" },
        { "partial_rotary_factors", "0.5", -EINVAL, "text_config.partial_rotary_factors: expected a list of numbers, got a real number" },
        { "swiglu_limits", "[]", -EINVAL, "text_config.swiglu_limits: has 0 entries, expected 48" },
        { "swiglu_limits_shared", "{}", -EINVAL, "text_config.swiglu_limits_shared: expected a list of numbers, got an object" },
        { "num_attention_heads", "60", -EINVAL, "text_config.num_attention_groups: 8 KV heads do not divide 60 (full) / 96 (sliding) query heads" },
        { "att_impl_type", "\"MLA\"", -ENOTSUP, "text_config.att_impl_type: 'MLA' is not supported (only GQA)" },
        { "attention_other_setting", "{\"num_attention_heads\": 96, \"head_dim\": 64}", -ENOTSUP, "text_config.attention_other_setting: num_attention_groups 8 / head_dim 64 differ" },
        { "attention_other_setting", "[]", -EINVAL, "text_config.attention_other_setting: expected an object, got an array" },
        { "sliding_window", NULL, -ENOENT, "text_config.sliding_window: required field is missing" },
        { "moe_layers_enum", "\"3,x\"", -EINVAL, "text_config.moe_layers_enum: 'x' is not a layer index in [0, 45)" },
        { "moe_layers_enum", "\"3,45\"", -EINVAL, "text_config.moe_layers_enum: '45' is not a layer index" },
        { "moe_layers_enum", "[3, -1]", -EINVAL, "text_config.moe_layers_enum[1]: expected a layer index in [0, 45)" },
        { "moe_num_experts", NULL, -ENOENT, "text_config.moe_num_experts: required field is missing" },
        { "moe_top_k", "300", -EINVAL, "text_config.moe_top_k: 300 is out of range [1, 288]" },
        { "moe_router_activation", "\"softmax\"", -ENOTSUP, "text_config.moe_router_activation: 'softmax' is not supported" },
        { "moe_router_scaling_factor", "0", -EINVAL, "text_config.moe_router_scaling_factor: must be positive" },
        { "norm_expert_weight", "1", -EINVAL, "text_config.norm_expert_weight: expected true or false, got an integer" },
        { "rope_scaling", "{\"rope_type\": \"yarn\"}", -ENOTSUP, "text_config.rope_scaling.rope_type: 'yarn' is not supported" },
        { "rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 2}", -ENOENT, "text_config.rope_scaling.low_freq_factor: required field is missing" },
        { "use_rope_layers", "[true, false]", -ENOTSUP, "text_config.use_rope_layers: per-layer RoPE selection is not supported" },
        { "eos_token_id", "[1, 999999]", -EINVAL, "text_config.eos_token_id[1]: expected a token id below vocab_size 128896" },
        { "eos_token_id", "\"1\"", -EINVAL, "text_config.eos_token_id: expected an integer or a list of integers" },
        { "rms_norm_eps", "2", -EINVAL, "text_config.rms_norm_eps: 2 is not in (0, 1)" },
        { "yarn_only_types", "[1]", -EINVAL, "text_config.yarn_only_types[0]: expected a string, got an integer" },
        { "num_nextn_predict_layers", "100", -EINVAL, "text_config.num_nextn_predict_layers: 45 trunk + 100 MTP layers exceed the supported 128" },
    };
    struct model_config want, got;

    ckptw_config_step37(&want);
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        json_t *j = base_json(&want, true, false), *t = json_object_get(j, "text_config");
        struct err_buf e = { "" };
        int r;
        if (cases[i].value) {
            json_error_t je;
            json_t *v = json_loads(cases[i].value, JSON_DECODE_ANY, &je);
            ASSERT_TRUE(v != NULL);
            json_object_set_new(t, cases[i].key, v);
        } else {
            json_object_del(t, cases[i].key);
        }
        r = parse_json(j, &got, &e);
        if (r != cases[i].err || !strstr(e.msg, cases[i].msg))
            FAIL("case %zu (%s): got %d \"%s\", expected %d \"%s\"", i, cases[i].key, r, e.msg, cases[i].err, cases[i].msg);
        json_decref(j);
    }
    /* layer_types entry */
    {
        json_t *j = base_json(&want, true, false);
        struct err_buf e;
        json_array_set_new(json_object_get(json_object_get(j, "text_config"), "layer_types"), 5, json_string("global"));
        ASSERT_ERR(parse_json(j, &got, &e), -EINVAL);
        ASSERT_CONTAINS(e.msg, "text_config.layer_types[5]: expected \"full_attention\" or \"sliding_attention\", got a string \"global\"");
        json_decref(j);
    }
    /* a list entry of the wrong type */
    {
        json_t *j = base_json(&want, true, false);
        struct err_buf e;
        json_array_set_new(json_object_get(json_object_get(j, "text_config"), "swiglu_limits"), 2, json_string("7"));
        ASSERT_ERR(parse_json(j, &got, &e), -EINVAL);
        ASSERT_CONTAINS(e.msg, "text_config.swiglu_limits[2]: expected a number, got a string");
        json_decref(j);
    }
}

/* Property: quantization_config accepts only compressed-tensors MXFP4 groups. */
static void test_quant(void)
{
    static const struct {
        const char *path;    /* "group_0.weights.num_bits" style under config_groups, or top key */
        const char *value;
        int err;
        const char *msg;
    } cases[] = {
        { "quant_method", "\"gptq\"", -ENOTSUP, "quantization_config.quant_method: 'gptq' is not supported (compressed-tensors MXFP4, fp8 block-scaled or modelopt NVFP4)" },
        { "quant_method", NULL, -ENOENT, "quantization_config.quant_method: required field is missing" },
        { "config_groups", NULL, -ENOENT, "quantization_config.config_groups: required field is missing" },
        { "config_groups", "{}", -EINVAL, "quantization_config.config_groups: empty" },
        { "g.num_bits", "8", -ENOTSUP, "quantization_config.config_groups.group_0.weights: num_bits 8, type 'float', group_size 32" },
        { "g.group_size", "16", -ENOTSUP, "group_size 16" },
        { "g.type", "\"int\"", -ENOTSUP, "type 'int'" },
        { "g.strategy", "\"channel\"", -ENOTSUP, "strategy channel" },
        { "g.num_bits", "\"4\"", -EINVAL, "quantization_config.config_groups.group_0.weights.num_bits: expected an integer, got a string" },
        { "f.format", "\"nvfp4-pack-quantized\"", -ENOTSUP, "quantization_config.config_groups.group_0.format: 'nvfp4-pack-quantized' is not supported" },
        { "f.input_activations", "{\"num_bits\": 8}", -ENOTSUP, "group_0.input_activations: activation quantization is not supported" },
        { "f.targets", "[]", -EINVAL, "group_0.targets: empty" },
        { "f.weights", NULL, -ENOENT, "group_0.weights: required field is missing" },
        { "f.targets", "[\"re:.*self_attn.*\"]", -ENOTSUP, "routed expert module 'model.layers.3.moe.experts.0.gate_proj' is not MXFP4" },
        { "f.targets", "[\"re:(\"]", -EINVAL, "quantization_config.config_groups.group_0.targets: 're:(': bad regex" },
        { "f.targets", "[\"re:.*experts.*\", \"re:.*mlp\\\\.down_proj$\", \"model.embed_tokens\"]", 0, "" },
        { "ignore", "[]", 0, "" },   /* the targets name only experts */
        { "ignore", "\"x\"", -EINVAL, "quantization_config.ignore: expected an array, got a string" },
        { "ignore", "[\"re:.*\"]", -ENOTSUP, "routed expert module" },
        { "f.targets", "[\"Linear\"]", 0, "" },   /* every dense linear is in ignore */
    };
    struct model_config want, got;
    struct err_buf e;

    ckptw_config_step37(&want);
    for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
        json_t *j = base_json(&want, true, false), *q = json_object_get(j, "quantization_config");
        json_t *g0 = json_object_get(json_object_get(q, "config_groups"), "group_0"), *target = q, *v = NULL;
        const char *key = cases[i].path;
        int r;
        if (key[0] == 'g' && key[1] == '.')
            target = json_object_get(g0, "weights"), key += 2;
        else if (key[0] == 'f' && key[1] == '.')
            target = g0, key += 2;
        if (cases[i].value) {
            json_error_t je;
            v = json_loads(cases[i].value, JSON_DECODE_ANY, &je);
            json_object_set_new(target, key, v);
        } else {
            json_object_del(target, key);
        }
        e.msg[0] = 0;
        r = parse_json(j, &got, &e);
        if (r != cases[i].err || (r < 0 && !strstr(e.msg, cases[i].msg)))
            FAIL("quant case %zu: got %d \"%s\"", i, r, e.msg);
        json_decref(j);
    }
    /* "Linear" without an ignore list would quantise the dense layers too */
    {
        json_t *j = base_json(&want, true, false), *q = json_object_get(j, "quantization_config");
        json_object_set_new(json_object_get(json_object_get(q, "config_groups"), "group_0"), "targets",
                            json_pack("[s]", "Linear"));
        json_object_del(q, "ignore");
        ASSERT_ERR(parse_json(j, &got, &e), -ENOTSUP);
        ASSERT_CONTAINS(e.msg, "quantization_config.config_groups.group_0: targets the dense module 'model.layers.0.self_attn.q_proj' and ignore does not exclude it");
        json_decref(j);
    }
    /* no quantization_config: everything dense */
    {
        json_t *j = base_json(&want, false, false);
        json_object_del(j, "quantization_config");
        ASSERT_OK(parse_json(j, &got, &e));
        ASSERT_EQ(got.quant, QUANT_NONE);
        json_decref(j);
    }
}

/* Property: the fp8 (modules_to_not_convert) and modelopt NVFP4 (exclude_modules) dialects
 * select each module's format: what the writer excluded round-trips, names match on
 * whole components ("moe.gate" is the router, not the experts' gate_proj), globs apply
 * to modelopt, both name spellings match, and every bad field is named. */
static void test_quant_dialects(void)
{
    struct model_config want, got;
    struct err_buf e = { "" };
    json_t *j, *q;

    ckptw_config_step37(&want);
    for (int f = 0; f < 3; f++) {
        enum quant_scheme qs = f == 0 ? QUANT_FP8 : f == 1 ? QUANT_NVFP4 : QUANT_NONE;
        model_config_set_quant(&want, qs);
        j = base_json(&want, true, false);
        if (parse_json(j, &got, &e) < 0)
            FAIL("%s: %s", quant_scheme_name(qs), e.msg);
        check_same(&want, &got);
        ASSERT_EQ(got.layers[3].qfmt[QMOD_EXPERT_DOWN], qs);
        ASSERT_EQ(got.layers[3].qfmt[QMOD_ROUTER], QUANT_NONE);
        ASSERT_EQ(got.layers[0].qfmt[QMOD_Q], QUANT_NONE);
        json_decref(j);
    }
    /* fp8: everything converted but the listed modules */
    model_config_set_quant(&want, QUANT_FP8);
    j = base_json(&want, true, false);
    q = json_object_get(j, "quantization_config");
    json_object_set_new(q, "modules_to_not_convert",
                        json_pack("[s, s, s, s]", "lm_head", "model.language_model.layers.45", "self_attn.g_proj", "moe.gate"));
    ASSERT_OK(parse_json(j, &got, &e));
    ASSERT_EQ(got.quant, QUANT_FP8);
    ASSERT_EQ(got.quant_block_rows, 128);
    ASSERT_EQ(got.quant_group_size, 128);
    ASSERT_EQ(got.layers[0].qfmt[QMOD_Q], QUANT_FP8);
    ASSERT_EQ(got.layers[0].qfmt[QMOD_G], QUANT_NONE);
    ASSERT_EQ(got.layers[0].qfmt[QMOD_MLP_DOWN], QUANT_FP8);
    ASSERT_EQ(got.layers[3].qfmt[QMOD_ROUTER], QUANT_NONE);
    ASSERT_EQ(got.layers[3].qfmt[QMOD_EXPERT_GATE], QUANT_FP8);
    ASSERT_EQ(got.layers[3].qfmt[QMOD_SHARED_UP], QUANT_FP8);
    ASSERT_EQ(got.layers[45].qfmt[QMOD_EH_PROJ], QUANT_NONE);
    ASSERT_EQ(got.layers[45].qfmt[QMOD_Q], QUANT_NONE);
    ASSERT_EQ(got.layers[46].qfmt[QMOD_EH_PROJ], QUANT_FP8);
    ASSERT_EQ(got.lm_head_qfmt, QUANT_NONE);
    json_decref(j);
    /* modelopt: globs, the nested "quantization" object, the KV-cache algorithm noted */
    model_config_set_quant(&want, QUANT_NVFP4);
    j = base_json(&want, true, false);
    q = json_object_get(j, "quantization_config");
    json_object_del(q, "exclude_modules");
    json_object_del(q, "quant_algo");
    json_object_del(q, "group_size");
    json_object_set_new(q, "quantization", json_pack("{s:s, s:i, s:s, s:[s, s, s]}", "quant_algo", "NVFP4",
                        "group_size", 16, "kv_cache_quant_algo", "FP8", "exclude_modules", "lm_head",
                        "*.moe.gate", "model.layers.4[5-7]*"));
    ASSERT_OK(parse_json(j, &got, &e));
    ASSERT_EQ(got.quant, QUANT_NVFP4);
    ASSERT_EQ(got.quant_group_size, 16);
    ASSERT_EQ(got.layers[3].qfmt[QMOD_ROUTER], QUANT_NONE);
    ASSERT_EQ(got.layers[3].qfmt[QMOD_EXPERT_UP], QUANT_NVFP4);
    ASSERT_EQ(got.layers[1].qfmt[QMOD_O], QUANT_NVFP4);
    ASSERT_EQ(got.layers[44].qfmt[QMOD_O], QUANT_NVFP4);
    ASSERT_EQ(got.layers[47].qfmt[QMOD_HEAD_OUT], QUANT_NONE);
    ASSERT_EQ(got.lm_head_qfmt, QUANT_NONE);
    ASSERT_CONTAINS(got.notes, "kv_cache_quant_algo FP8: the KV cache stays unquantised");
    json_decref(j);

    {
        static const struct {
            enum quant_scheme q;
            const char *key, *value;   /* value NULL: delete key */
            int err;
            const char *msg;
        } cases[] = {
            { QUANT_FP8, "weight_block_size", NULL, -ENOTSUP, "quantization_config.weight_block_size: required field is missing (only block-scaled FP8" },
            { QUANT_FP8, "weight_block_size", "[128]", -EINVAL, "quantization_config.weight_block_size: expected [rows, columns]" },
            { QUANT_FP8, "weight_block_size", "[0, 128]", -EINVAL, "weight_block_size: expected [rows, columns] of 1..4096" },
            { QUANT_FP8, "fmt", "\"e5m2\"", -ENOTSUP, "quantization_config.fmt: 'e5m2' is not supported (only e4m3)" },
            { QUANT_FP8, "activation_scheme", "\"static\"", -ENOTSUP, "quantization_config.activation_scheme: 'static' is not supported" },
            { QUANT_FP8, "modules_to_not_convert", "\"lm_head\"", -EINVAL, "quantization_config.modules_to_not_convert: expected an array, got a string" },
            { QUANT_FP8, "modules_to_not_convert", "[7]", -EINVAL, "quantization_config.modules_to_not_convert[0]: expected a string, got an integer" },
            { QUANT_NVFP4, "quant_algo", "\"FP8\"", -ENOTSUP, "quantization_config.quant_algo: 'FP8' is not supported (only NVFP4)" },
            { QUANT_NVFP4, "quant_algo", NULL, -ENOENT, "quantization_config.quant_algo: required field is missing" },
            { QUANT_NVFP4, "group_size", "32", -ENOTSUP, "quantization_config.group_size: 32 is not supported (NVFP4 groups are 16)" },
            { QUANT_NVFP4, "exclude_modules", "{}", -EINVAL, "quantization_config.exclude_modules: expected an array, got an object" },
            { QUANT_NVFP4, "quant_method", "\"modelopt_fp4\"", -ENOTSUP, "quant_method: 'modelopt_fp4' is not supported" },
        };
        for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
            model_config_set_quant(&want, cases[i].q);
            j = base_json(&want, true, false);
            q = json_object_get(j, "quantization_config");
            if (cases[i].value) {
                json_error_t je;
                json_object_set_new(q, cases[i].key, json_loads(cases[i].value, JSON_DECODE_ANY, &je));
            } else {
                json_object_del(q, cases[i].key);
            }
            e.msg[0] = 0;
            int r = parse_json(j, &got, &e);
            if (r != cases[i].err || !strstr(e.msg, cases[i].msg))
                FAIL("dialect case %zu: got %d \"%s\"", i, r, e.msg);
            json_decref(j);
        }
    }
}

/* Property: JSON-level problems (duplicates, not an object, oversize) are refused. */
static void test_json_level(void)
{
    struct model_config got;
    struct err_buf e;
    const char *dup = "{\"text_config\": {\"hidden_size\": 1, \"hidden_size\": 2}}";
    ASSERT_ERR(model_config_parse(dup, strlen(dup), "config.json", &got, &e), -EBADMSG);
    ASSERT_CONTAINS(e.msg, "duplicate object key");
    ASSERT_ERR(model_config_parse("[]", 2, "config.json", &got, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "config.json: expected a JSON object, got an array");
    ASSERT_ERR(model_config_parse("{\"text_config\": 3}", 18, "config.json", &got, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "config.json: text_config: expected an object, got an integer");
    ASSERT_ERR(model_config_load("/nonexistent/config.json", &got, &e), -ENOENT);
    ASSERT_CONTAINS(e.msg, "/nonexistent/config.json: cannot open");
}

int main(void)
{
    tmp = ckptw_tmpdir("stepd-test-config");
    ASSERT_TRUE(tmp != NULL);
    test_real_values();
    test_trunk_only_lists();
    test_bad_fields();
    test_quant();
    test_quant_dialects();
    test_json_level();
    ckptw_rmtree(tmp);
    free(tmp);
    return 0;
}
