/* config.c - config.json -> struct model_config (docs/MODEL.md §1, §5.4).
 *
 * Flat Step-3.5 layout (text fields at top level) and Step-3.7 nested
 * "text_config" are both accepted.  Per-layer lists (layer_types, rope_theta,
 * partial_rotary_factors, swiglu_limits, swiglu_limits_shared) must have
 * n_layers + n_mtp entries, or n_layers entries; then the MTP layers get the
 * docs/MODEL.md §1.3 defaults (sliding attention, the sliding layers' theta and
 * rotary factor, no clamp) and model_config.notes says so.  rope_theta may be a
 * single number.  quantization_config selects each linear module's format
 * (layer_config.qfmt): compressed-tensors with MXFP4 groups only (num_bits 4, type
 * float, group_size 32; experts MXFP4, everything else dense), "fp8" with
 * weight_block_size (every linear FP8 unless modules_to_not_convert names it) or
 * modelopt NVFP4 (every linear unless exclude_modules names or globs it); no
 * quantization_config: all BF16.  Every error names the JSON path.
 */
#include "config.h"

#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "json.h"

#define CONFIG_FILE_MAX (16u << 20)

struct cfg_ctx {
    const json_t *text;      /* object holding the text fields */
    const json_t *top;       /* root object */
    const char *tpath;       /* "text_config" or "" */
    struct err_buf *e;
};

#define REQ JSON_GET_REQUIRED
#define OPT JSON_GET_OPTIONAL

static void note_add(struct model_config *c, const char *fmt, const char *arg)
{
    size_t n = strlen(c->notes);
    if (n && n < sizeof(c->notes) - 2) {
        c->notes[n++] = ';';
        c->notes[n++] = ' ';
        c->notes[n] = 0;
    }
    snprintf(c->notes + n, sizeof(c->notes) - n, fmt, arg);
}

/* A per-layer list: number entries, or null (-> null_value).  *ret_n gets the count;
 * 0 when absent. Accepts a single number when allow_scalar (broadcast). */
static int get_layer_list(struct cfg_ctx *x, const char *key, bool allow_scalar, double null_value,
                          int n_trunk, int n_total, double *out, int *ret_n)
{
    char p[256];
    json_t *v = json_object_get(x->text, key);

    json_path_join(p, sizeof(p), x->tpath, key);
    *ret_n = 0;
    if (!v || json_is_null(v))
        return 0;
    if (json_is_number(v) && allow_scalar) {
        for (int i = 0; i < n_total; i++)
            out[i] = json_number_value(v);
        *ret_n = n_total;
        return 0;
    }
    if (!json_is_array(v))
        return err_set(x->e, -EINVAL, "%s: expected %s, got %s", p,
                       allow_scalar ? "a number or a list of numbers" : "a list of numbers",
                       json_type_describe(v));
    if ((int) json_array_size(v) != n_total && (int) json_array_size(v) != n_trunk)
        return err_set(x->e, -EINVAL, "%s: has %zu entries, expected %d (num_hidden_layers + num_nextn_predict_layers)%s",
                       p, json_array_size(v), n_total,
                       n_total != n_trunk ? " or num_hidden_layers" : "");
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *it = json_array_get(v, i);
        if (json_is_null(it))
            out[i] = null_value;
        else if (json_is_number(it) && isfinite(json_number_value(it)))
            out[i] = json_number_value(it);
        else
            return err_set(x->e, -EINVAL, "%s[%zu]: expected a number, got %s", p, i,
                           json_type_describe(it));
    }
    *ret_n = (int) json_array_size(v);
    return 0;
}

/* moe_layers_enum: "3,4,5" string or a list of integers. */
static int get_moe_layers(struct cfg_ctx *x, int n_trunk, bool *is_moe, bool *present)
{
    char p[256];
    json_t *v = json_object_get(x->text, "moe_layers_enum");

    json_path_join(p, sizeof(p), x->tpath, "moe_layers_enum");
    *present = false;
    if (!v || json_is_null(v))
        return 0;
    *present = true;
    if (json_is_string(v)) {
        const char *s = json_string_value(v);
        while (*s) {
            char *end;
            long l;
            while (*s == ' ')
                s++;
            l = strtol(s, &end, 10);
            if (end == s || l < 0 || l >= n_trunk)
                return err_set(x->e, -EINVAL, "%s: '%.40s' is not a layer index in [0, %d)", p, s,
                               n_trunk);
            is_moe[l] = true;
            s = end;
            while (*s == ' ')
                s++;
            if (*s == ',')
                s++;
            else if (*s)
                return err_set(x->e, -EINVAL, "%s: unexpected '%c'", p, *s);
        }
        return 0;
    }
    if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) {
            json_t *it = json_array_get(v, i);
            if (!json_is_integer(it) || json_integer_value(it) < 0 || json_integer_value(it) >= n_trunk)
                return err_set(x->e, -EINVAL, "%s[%zu]: expected a layer index in [0, %d)", p, i, n_trunk);
            is_moe[json_integer_value(it)] = true;
        }
        return 0;
    }
    return err_set(x->e, -EINVAL, "%s: expected a string or a list of integers, got %s", p,
                   json_type_describe(v));
}

static int parse_eos(struct cfg_ctx *x, struct model_config *c)
{
    const json_t *holder = json_object_get(x->text, "eos_token_id") ? x->text : x->top;
    const char *path = holder == x->text ? x->tpath : "";
    char p[256];
    json_t *v = json_object_get(holder, "eos_token_id");

    json_path_join(p, sizeof(p), path, "eos_token_id");
    c->n_eos = 0;
    if (!v || json_is_null(v))
        return 0;
    if (json_is_integer(v)) {
        if (json_integer_value(v) < 0 || json_integer_value(v) >= c->vocab_size)
            return err_set(x->e, -EINVAL, "%s: %lld is not a token id below vocab_size %d", p,
                           (long long) json_integer_value(v), c->vocab_size);
        c->eos_token_ids[c->n_eos++] = (int) json_integer_value(v);
        return 0;
    }
    if (!json_is_array(v))
        return err_set(x->e, -EINVAL, "%s: expected an integer or a list of integers, got %s", p,
                       json_type_describe(v));
    if (json_array_size(v) > MODEL_MAX_EOS)
        return err_set(x->e, -EINVAL, "%s: %zu entries, at most %d supported", p, json_array_size(v),
                       MODEL_MAX_EOS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *it = json_array_get(v, i);
        if (!json_is_integer(it) || json_integer_value(it) < 0 || json_integer_value(it) >= c->vocab_size)
            return err_set(x->e, -EINVAL, "%s[%zu]: expected a token id below vocab_size %d", p, i,
                           c->vocab_size);
        c->eos_token_ids[c->n_eos++] = (int) json_integer_value(it);
    }
    return 0;
}

/* compressed-tensors module matching: "re:<regex>" is matched from the start of the
 * module name (Python re.match), anything else is an exact module name or the
 * class name "Linear" (every linear module).  Returns 1 match, 0 no, <0 bad regex. */
static int ct_match(const char *pat, const char *module, const char *where, struct err_buf *e)
{
    pcre2_code *re;
    pcre2_match_data *md;
    PCRE2_SIZE off;
    int code, rc;

    if (strncmp(pat, "re:", 3) != 0)
        return strcmp(pat, "Linear") == 0 || strcmp(pat, module) == 0;
    re = pcre2_compile((PCRE2_SPTR) pat + 3, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED, &code, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[120];
        pcre2_get_error_message(code, msg, sizeof(msg));
        return err_set(e, -EINVAL, "%s: '%.80s': bad regex at %zu: %s", where, pat, (size_t) off, (char *) msg);
    }
    md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md) {
        pcre2_code_free(re);
        return err_set(e, -ENOMEM, "%s: out of memory", where);
    }
    rc = pcre2_match(re, (PCRE2_SPTR) module, PCRE2_ZERO_TERMINATED, 0, 0, md, NULL);
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    if (rc >= 0)
        return 1;
    if (rc == PCRE2_ERROR_NOMATCH)
        return 0;
    return err_set(e, -EINVAL, "%s: '%.80s': regex match failed (%d)", where, pat, rc);
}

/* 1 if any string in arr matches module */
static int ct_any(const json_t *arr, const char *module, const char *where, struct err_buf *e)
{
    for (size_t i = 0; arr && i < json_array_size(arr); i++) {
        const json_t *it = json_array_get(arr, i);
        int r;
        if (!json_is_string(it))
            return err_set(e, -EINVAL, "%s[%zu]: expected a string, got %s", where, i, json_type_describe(it));
        r = ct_match(json_string_value(it), module, where, e);
        if (r != 0)
            return r;
    }
    return 0;
}

/* Whether config group k (g) targets module: 1, 0, or < 0 (its targets are malformed) */
static int ct_group(const char *k, const json_t *g, const char *module, struct err_buf *e)
{
    char where[160];
    snprintf(where, sizeof(where), "quantization_config.config_groups.%.64s.targets", k);
    return ct_any(json_object_get(g, "targets"), module, where, e);
}

/* The engine runs MXFP4 for routed experts only: the groups must target the
 * experts and leave every dense linear alone (through ignore or by not matching). */
static int check_quant_targets(const json_t *q, const json_t *groups, struct err_buf *e)
{
    static const char *const dense[] = {
        "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.g_proj", "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj", "model.layers.3.moe.gate",
        "model.layers.3.share_expert.gate_proj", "model.layers.3.share_expert.up_proj",
        "model.layers.3.share_expert.down_proj", "model.layers.45.eh_proj",
        "model.layers.45.transformer.shared_head.output", "lm_head", "model.embed_tokens",
    };
    static const char *const experts[] = {
        "model.layers.3.moe.experts.0.gate_proj", "model.layers.3.moe.experts.0.up_proj",
        "model.layers.3.moe.experts.0.down_proj",
    };
    const json_t *ignore = json_object_get(q, "ignore");
    const char *k;
    json_t *g;
    int r;

    if (ignore && !json_is_array(ignore))
        return err_set(e, -EINVAL, "quantization_config.ignore: expected an array, got %s", json_type_describe(ignore));
    for (size_t i = 0; i < ARRAY_SIZE(experts); i++) {
        bool hit = false;
        json_object_foreach((json_t *) groups, k, g) {
            r = ct_group(k, g, experts[i], e);
            if (r < 0)
                return r;
            hit |= r == 1;
        }
        r = ct_any(ignore, experts[i], "quantization_config.ignore", e);
        if (r < 0)
            return r;
        if (!hit || r == 1)
            return err_set(e, -ENOTSUP,
                           "quantization_config: routed expert module '%s' is not MXFP4 (no group targets it, or ignore excludes it); only MXFP4 experts are supported",
                           experts[i]);
    }
    for (size_t i = 0; i < ARRAY_SIZE(dense); i++) {
        json_object_foreach((json_t *) groups, k, g) {
            r = ct_group(k, g, dense[i], e);
            if (r < 0)
                return r;
            if (r == 1) {
                r = ct_any(ignore, dense[i], "quantization_config.ignore", e);
                if (r < 0)
                    return r;
                if (r == 0)
                    return err_set(e, -ENOTSUP,
                                   "quantization_config.config_groups.%.64s: targets the dense module '%s' and ignore does not exclude it; only routed experts may be MXFP4",
                                   k, dense[i]);
            }
        }
    }
    return 0;
}

static int parse_ct(const json_t *q, struct model_config *c, struct err_buf *e)
{
    const char *k;
    json_t *groups, *g;
    int r;

    r = json_get_obj(q, "quantization_config", "config_groups", REQ, &groups, e);
    if (r < 0)
        return r;
    if (json_object_size(groups) == 0)
        return err_set(e, -EINVAL, "quantization_config.config_groups: empty");
    json_object_foreach(groups, k, g) {
        char gp[200], wp[256];
        json_t *w, *ia, *targets;
        const char *fmt = NULL, *type = NULL, *strategy = NULL;
        int bits = 0, gs = 0;

        snprintf(gp, sizeof(gp), "quantization_config.config_groups.%.64s", k);
        if (!json_is_object(g))
            return err_set(e, -EINVAL, "%s: expected an object, got %s", gp, json_type_describe(g));
        r = json_get_str(g, gp, "format", OPT, &fmt, e);
        if (r < 0)
            return r;
        if (r == 1 && strcmp(fmt, "mxfp4-pack-quantized") != 0)
            return err_set(e, -ENOTSUP, "%s.format: '%.40s' is not supported (only mxfp4-pack-quantized)",
                           gp, fmt);
        ia = json_object_get(g, "input_activations");
        if (ia && !json_is_null(ia))
            return err_set(e, -ENOTSUP, "%s.input_activations: activation quantization is not supported (weight-only MXFP4)", gp);
        r = json_get_arr(g, gp, "targets", REQ, &targets, e);
        if (r < 0)
            return r;
        if (json_array_size(targets) == 0)
            return err_set(e, -EINVAL, "%s.targets: empty", gp);
        for (size_t i = 0; i < json_array_size(targets); i++)
            if (!json_is_string(json_array_get(targets, i)))
                return err_set(e, -EINVAL, "%s.targets[%zu]: expected a string, got %s", gp, i,
                               json_type_describe(json_array_get(targets, i)));
        r = json_get_obj(g, gp, "weights", REQ, &w, e);
        if (r < 0)
            return r;
        snprintf(wp, sizeof(wp), "%s.weights", gp);
        r = json_get_i32(w, wp, "num_bits", REQ, 1, 64, &bits, e);
        if (r < 0)
            return r;
        r = json_get_str(w, wp, "type", REQ, &type, e);
        if (r < 0)
            return r;
        r = json_get_i32(w, wp, "group_size", REQ, 1, 1 << 20, &gs, e);
        if (r < 0)
            return r;
        r = json_get_str(w, wp, "strategy", OPT, &strategy, e);
        if (r < 0)
            return r;
        if (bits != 4 || strcmp(type, "float") != 0 || gs != 32 || (strategy && strcmp(strategy, "group") != 0))
            return err_set(e, -ENOTSUP,
                           "%s: num_bits %d, type '%.16s', group_size %d%s%s is not supported (only MXFP4: num_bits 4, type float, group_size 32)",
                           wp, bits, type, gs, strategy ? ", strategy " : "", strategy ? strategy : "");
    }
    r = check_quant_targets(q, groups, e);
    if (r < 0)
        return r;
    c->quant = QUANT_MXFP4;
    c->quant_group_size = 32;
    for (int l = 0; l < c->n_layers_total; l++)
        if (c->layers[l].is_moe)
            for (int m = QMOD_EXPERT_GATE; m <= QMOD_EXPERT_DOWN; m++)
                c->layers[l].qfmt[m] = QUANT_MXFP4;
    return 0;
}

static const char *const qmod_names[_QMOD_MAX] = {
    [QMOD_Q] = "self_attn.q_proj", [QMOD_K] = "self_attn.k_proj", [QMOD_V] = "self_attn.v_proj",
    [QMOD_O] = "self_attn.o_proj", [QMOD_G] = "self_attn.g_proj",
    [QMOD_MLP_GATE] = "mlp.gate_proj", [QMOD_MLP_UP] = "mlp.up_proj", [QMOD_MLP_DOWN] = "mlp.down_proj",
    [QMOD_ROUTER] = "moe.gate",
    [QMOD_SHARED_GATE] = "share_expert.gate_proj", [QMOD_SHARED_UP] = "share_expert.up_proj",
    [QMOD_SHARED_DOWN] = "share_expert.down_proj",
    [QMOD_EXPERT_GATE] = "moe.experts.%d.gate_proj", [QMOD_EXPERT_UP] = "moe.experts.%d.up_proj",
    [QMOD_EXPERT_DOWN] = "moe.experts.%d.down_proj",
    [QMOD_EH_PROJ] = "eh_proj", [QMOD_HEAD_OUT] = "transformer.shared_head.output",
};

const char *quant_module_name(enum quant_module m, int expert, char *buf, size_t size)
{
    if (m >= QMOD_EXPERT_GATE && m <= QMOD_EXPERT_DOWN)
        snprintf(buf, size, qmod_names[m], expert);
    else
        snprintf(buf, size, "%s", qmod_names[m]);
    return buf;
}

const char *quant_scheme_name(enum quant_scheme q)
{
    static const char *const n[_QUANT_MAX] = { "BF16", "MXFP4", "FP8", "NVFP4" };
    return (unsigned) q < _QUANT_MAX ? n[q] : "?";
}

bool model_config_has_module(const struct model_config *c, int l, enum quant_module m)
{
    const struct layer_config *L = &c->layers[l];

    switch (m) {
    case QMOD_G: return c->use_head_wise_attn_gate;
    case QMOD_MLP_GATE: case QMOD_MLP_UP: case QMOD_MLP_DOWN: return !L->is_moe;
    case QMOD_ROUTER: case QMOD_SHARED_GATE: case QMOD_SHARED_UP: case QMOD_SHARED_DOWN:
    case QMOD_EXPERT_GATE: case QMOD_EXPERT_UP: case QMOD_EXPERT_DOWN: return L->is_moe;
    case QMOD_EH_PROJ: case QMOD_HEAD_OUT: return L->is_mtp;
    default: return true;
    }
}

void model_config_set_quant(struct model_config *c, enum quant_scheme q)
{
    c->quant = q;
    c->quant_group_size = q == QUANT_MXFP4 ? 32 : q == QUANT_NVFP4 ? 16 : q == QUANT_FP8 ? 128 : 0;
    c->quant_block_rows = q == QUANT_FP8 ? 128 : 1;
    c->lm_head_qfmt = QUANT_NONE;
    for (int l = 0; l < c->n_layers_total; l++) {
        memset(c->layers[l].qfmt, 0, sizeof(c->layers[l].qfmt));
        if (c->layers[l].is_moe)
            for (int m = QMOD_EXPERT_GATE; m <= QMOD_EXPERT_DOWN; m++)
                c->layers[l].qfmt[m] = (uint8_t) q;
    }
}

/* pat occurs in name on component boundaries ("moe.gate" matches "model.layers.3.moe.gate"
 * but not "...moe.gate_proj"; "layers.45" matches every module of layer 45) */
static bool aligned_substr(const char *name, const char *pat)
{
    size_t k = strlen(pat);
    if (!k)
        return false;
    for (const char *p = strstr(name, pat); p; p = strstr(p + 1, pat))
        if ((p == name || p[-1] == '.' || pat[0] == '.') && (p[k] == 0 || p[k] == '.' || pat[k - 1] == '.'))
            return true;
    return false;
}

/* Whether an exclusion list (fp8 modules_to_not_convert: names; modelopt exclude_modules:
 * names or fnmatch globs) names module (both spellings of the name are tried) */
static int excluded(const json_t *list, const char *where, const char *module, bool globs, struct err_buf *e)
{
    char lm[224];
    const char *alt = module;

    if (strncmp(module, "model.", 6) == 0) {
        snprintf(lm, sizeof(lm), "model.language_model.%s", module + 6);
        alt = lm;
    }
    for (size_t i = 0; list && i < json_array_size(list); i++) {
        const json_t *it = json_array_get(list, i);
        const char *p;
        if (!json_is_string(it))
            return err_set(e, -EINVAL, "%s[%zu]: expected a string, got %s", where, i, json_type_describe(it));
        p = json_string_value(it);
        if (aligned_substr(module, p) || aligned_substr(alt, p))
            return 1;
        if (globs && (fnmatch(p, module, 0) == 0 || fnmatch(p, alt, 0) == 0))
            return 1;
    }
    return 0;
}

/* Every linear module of every layer gets scheme q unless the exclusion list names it
 * (the routed experts by expert 0's name: "model.layers.L.moe.experts" excludes them) */
static int assign_modules(struct model_config *c, enum quant_scheme q, const json_t *list, const char *where,
                          bool globs, struct err_buf *e)
{
    char mod[192], m1[128];
    int r;

    if (list && !json_is_null(list) && !json_is_array(list))
        return err_set(e, -EINVAL, "%s: expected an array, got %s", where, json_type_describe(list));
    for (int l = 0; l < c->n_layers_total; l++) {
        struct layer_config *L = &c->layers[l];
        for (int m = 0; m < _QMOD_MAX; m++) {
            if (!model_config_has_module(c, l, (enum quant_module) m))
                continue;
            snprintf(mod, sizeof(mod), "model.layers.%d.%s", l, quant_module_name((enum quant_module) m, 0, m1, sizeof(m1)));
            r = excluded(list, where, mod, globs, e);
            if (r < 0)
                return r;
            L->qfmt[m] = r ? QUANT_NONE : q;
        }
    }
    r = excluded(list, where, "lm_head", globs, e);
    if (r < 0)
        return r;
    c->lm_head_qfmt = r ? QUANT_NONE : q;
    return 0;
}

/* "fp8" (block-scaled, as DeepSeek-V3 and the Step FP8 releases write it) */
static int parse_fp8(const json_t *q, struct model_config *c, struct err_buf *e)
{
    const char *fmt = NULL, *act = NULL;
    json_t *bs;
    int r;

    r = json_get_str(q, "quantization_config", "fmt", OPT, &fmt, e);
    if (r < 0)
        return r;
    if (r == 1 && strcmp(fmt, "e4m3") != 0)
        return err_set(e, -ENOTSUP, "quantization_config.fmt: '%.40s' is not supported (only e4m3)", fmt);
    r = json_get_str(q, "quantization_config", "activation_scheme", OPT, &act, e);
    if (r < 0)
        return r;
    if (r == 1 && strcmp(act, "dynamic") != 0)
        return err_set(e, -ENOTSUP,
                       "quantization_config.activation_scheme: '%.40s' is not supported (only dynamic: activations are not quantised)",
                       act);
    r = json_get_arr(q, "quantization_config", "weight_block_size", OPT, &bs, e);
    if (r < 0)
        return r;
    if (r == 0)
        return err_set(e, -ENOTSUP,
                       "quantization_config.weight_block_size: required field is missing (only block-scaled FP8 is supported)");
    if (json_array_size(bs) != 2 || !json_is_integer(json_array_get(bs, 0)) || !json_is_integer(json_array_get(bs, 1)) ||
        json_integer_value(json_array_get(bs, 0)) < 1 || json_integer_value(json_array_get(bs, 0)) > 4096 ||
        json_integer_value(json_array_get(bs, 1)) < 1 || json_integer_value(json_array_get(bs, 1)) > 4096)
        return err_set(e, -EINVAL, "quantization_config.weight_block_size: expected [rows, columns] of 1..4096");
    c->quant = QUANT_FP8;
    c->quant_block_rows = (int) json_integer_value(json_array_get(bs, 0));
    c->quant_group_size = (int) json_integer_value(json_array_get(bs, 1));
    return assign_modules(c, QUANT_FP8, json_object_get(q, "modules_to_not_convert"),
                          "quantization_config.modules_to_not_convert", false, e);
}

/* "modelopt" NVFP4; the fields may sit in a nested "quantization" object (hf_quant_config) */
static int parse_modelopt(const json_t *q, struct model_config *c, struct err_buf *e)
{
    const json_t *inner = json_object_get(q, "quantization");
    const char *algo = NULL, *kv = NULL, *where = "quantization_config";
    int gs = 16, r;

    if (inner && json_is_object(inner)) {
        q = inner;
        where = "quantization_config.quantization";
    }
    r = json_get_str(q, where, "quant_algo", REQ, &algo, e);
    if (r < 0)
        return r;
    if (strcmp(algo, "NVFP4") != 0)
        return err_set(e, -ENOTSUP, "%s.quant_algo: '%.40s' is not supported (only NVFP4)", where, algo);
    r = json_get_i32(q, where, "group_size", OPT, 1, 1 << 20, &gs, e);
    if (r < 0)
        return r;
    if (gs != 16)
        return err_set(e, -ENOTSUP, "%s.group_size: %d is not supported (NVFP4 groups are 16)", where, gs);
    r = json_is_null(json_object_get(q, "kv_cache_quant_algo")) ? 0
        : json_get_str(q, where, "kv_cache_quant_algo", OPT, &kv, e);
    if (r < 0)
        return r;
    if (r == 1)
        note_add(c, "kv_cache_quant_algo %s: the KV cache stays unquantised (its k/v scales are optional parameters)", kv);
    c->quant = QUANT_NVFP4;
    c->quant_block_rows = 1;
    c->quant_group_size = 16;
    return assign_modules(c, QUANT_NVFP4, json_object_get(q, "exclude_modules"),
                          inner ? "quantization_config.quantization.exclude_modules" : "quantization_config.exclude_modules",
                          true, e);
}

static int parse_quant(const json_t *q, struct model_config *c, struct err_buf *e)
{
    const char *method = NULL;
    int r;

    c->quant = QUANT_NONE;
    c->quant_group_size = 0;
    c->quant_block_rows = 1;
    c->lm_head_qfmt = QUANT_NONE;
    for (int l = 0; l < c->n_layers_total; l++)
        memset(c->layers[l].qfmt, 0, sizeof(c->layers[l].qfmt));
    if (!q || json_is_null(q))
        return 0;
    if (!json_is_object(q))
        return err_set(e, -EINVAL, "quantization_config: expected an object, got %s", json_type_describe(q));
    r = json_get_str(q, "quantization_config", "quant_method", REQ, &method, e);
    if (r < 0)
        return r;
    if (strcmp(method, "compressed-tensors") == 0)
        return parse_ct(q, c, e);
    if (strcmp(method, "fp8") == 0)
        return parse_fp8(q, c, e);
    if (strcmp(method, "modelopt") == 0)
        return parse_modelopt(q, c, e);
    return err_set(e, -ENOTSUP,
                   "quantization_config.quant_method: '%.40s' is not supported (compressed-tensors MXFP4, fp8 block-scaled or modelopt NVFP4)",
                   method);
}

static int parse_text(struct cfg_ctx *x, struct model_config *c)
{
    struct err_buf *e = x->e;
    const char *tp = x->tpath;
    json_t *other = NULL, *lt = NULL, *rs = NULL, *yot = NULL, *url;
    double lists[4][MODEL_MAX_LAYERS];   /* theta, prf, swl, swls */
    double *theta = lists[0], *prf = lists[1], *swl = lists[2], *swls = lists[3];
    bool is_moe[MODEL_MAX_LAYERS] = { 0 }, moe_enum = false, use_moe = false;
    bool any_moe = false, any_sliding = false, mtp_defaulted = false;
    int n_theta, n_prf, n_swl, n_swls, n_lt = 0, r, tmp;
    double d;

#define TRY(expr) do { r = (expr); if (r < 0) return r; } while (0)
    TRY(json_get_i32(x->text, tp, "hidden_size", REQ, 1, 1 << 20, &c->hidden_size, e));
    TRY(json_get_i32(x->text, tp, "intermediate_size", REQ, 1, 1 << 22, &c->intermediate_size, e));
    TRY(json_get_i32(x->text, tp, "num_hidden_layers", REQ, 1, MODEL_MAX_LAYERS, &c->n_layers, e));
    c->n_mtp_layers = 0;
    TRY(json_get_i32(x->text, tp, "num_nextn_predict_layers", OPT, 0, MODEL_MAX_LAYERS, &c->n_mtp_layers, e));
    if (c->n_layers + c->n_mtp_layers > MODEL_MAX_LAYERS) {
        char p[256];
        return err_set(e, -EINVAL, "%s: %d trunk + %d MTP layers exceed the supported %d",
                       json_path_join(p, sizeof(p), tp, "num_nextn_predict_layers"), c->n_layers,
                       c->n_mtp_layers, MODEL_MAX_LAYERS);
    }
    c->n_layers_total = c->n_layers + c->n_mtp_layers;
    TRY(json_get_i32(x->text, tp, "vocab_size", REQ, 1, 1 << 26, &c->vocab_size, e));
    r = json_get_i32(x->text, tp, "max_position_embeddings", OPT, 1, INT32_MAX, &c->max_position_embeddings, e);
    if (r == 0)
        r = json_get_i32(x->text, tp, "max_seq_len", REQ, 1, INT32_MAX, &c->max_position_embeddings, e);
    if (r < 0)
        return r;
    d = 1e-5;
    TRY(json_get_num(x->text, tp, "rms_norm_eps", OPT, &d, e));
    if (!(d > 0 && d < 1)) {
        char p[256];
        return err_set(e, -EINVAL, "%s: %g is not in (0, 1)", json_path_join(p, sizeof(p), tp, "rms_norm_eps"), d);
    }
    c->rms_norm_eps = (float) d;

    TRY(json_get_i32(x->text, tp, "head_dim", REQ, 2, 4096, &c->head_dim, e));
    TRY(json_get_i32(x->text, tp, "num_attention_heads", REQ, 1, 4096, &c->n_heads_full, e));
    r = json_get_i32(x->text, tp, "num_attention_groups", OPT, 1, 4096, &c->n_kv_heads, e);
    if (r == 0)
        r = json_get_i32(x->text, tp, "num_key_value_heads", REQ, 1, 4096, &c->n_kv_heads, e);
    if (r < 0)
        return r;
    {
        const char *impl = NULL;
        char p[256];
        TRY(json_get_str(x->text, tp, "att_impl_type", OPT, &impl, e));
        if (impl && strcmp(impl, "GQA") != 0)
            return err_set(e, -ENOTSUP, "%s: '%.32s' is not supported (only GQA)",
                           json_path_join(p, sizeof(p), tp, "att_impl_type"), impl);
    }
    c->n_heads_sliding = c->n_heads_full;
    TRY(json_get_obj(x->text, tp, "attention_other_setting", OPT, &other, e));
    if (other) {
        char op[256];
        int kv = c->n_kv_heads, hd = c->head_dim;
        json_path_join(op, sizeof(op), tp, "attention_other_setting");
        TRY(json_get_i32(other, op, "num_attention_heads", REQ, 1, 4096, &c->n_heads_sliding, e));
        TRY(json_get_i32(other, op, "num_attention_groups", OPT, 1, 4096, &kv, e));
        TRY(json_get_i32(other, op, "head_dim", OPT, 2, 4096, &hd, e));
        if (kv != c->n_kv_heads || hd != c->head_dim)
            return err_set(e, -ENOTSUP, "%s: num_attention_groups %d / head_dim %d differ from the full layers' %d / %d (unsupported)",
                           op, kv, hd, c->n_kv_heads, c->head_dim);
    }
    if (c->n_heads_full % c->n_kv_heads || c->n_heads_sliding % c->n_kv_heads) {
        char p[256];
        return err_set(e, -EINVAL, "%s: %d KV heads do not divide %d (full) / %d (sliding) query heads",
                       json_path_join(p, sizeof(p), tp, "num_attention_groups"), c->n_kv_heads,
                       c->n_heads_full, c->n_heads_sliding);
    }

    /* layer kinds */
    TRY(json_get_arr(x->text, tp, "layer_types", OPT, &lt, e));
    if (lt) {
        char p[256];
        json_path_join(p, sizeof(p), tp, "layer_types");
        n_lt = (int) json_array_size(lt);
        if (n_lt != c->n_layers_total && n_lt != c->n_layers)
            return err_set(e, -EINVAL, "%s: has %d entries, expected %d (num_hidden_layers + num_nextn_predict_layers)%s",
                           p, n_lt, c->n_layers_total, c->n_mtp_layers ? " or num_hidden_layers" : "");
        for (int i = 0; i < n_lt; i++) {
            json_t *it = json_array_get(lt, (size_t) i);
            const char *s = json_is_string(it) ? json_string_value(it) : NULL;
            if (s && strcmp(s, "full_attention") == 0)
                c->layers[i].kind = LAYER_KIND_FULL;
            else if (s && strcmp(s, "sliding_attention") == 0)
                c->layers[i].kind = LAYER_KIND_SLIDING;
            else
                return err_set(e, -EINVAL, "%s[%d]: expected \"full_attention\" or \"sliding_attention\", got %s%s%.40s%s",
                               p, i, json_type_describe(it), s ? " \"" : "", s ? s : "", s ? "\"" : "");
        }
    }
    for (int i = n_lt; i < c->n_layers_total; i++) {
        /* trunk without layer_types: full attention; MTP layers: sliding (docs/MODEL.md §1.3) */
        c->layers[i].kind = i >= c->n_layers && n_lt ? LAYER_KIND_SLIDING : LAYER_KIND_FULL;
        if (i >= c->n_layers && n_lt)
            mtp_defaulted = true;
    }
    for (int i = 0; i < c->n_layers_total; i++)
        any_sliding |= c->layers[i].kind == LAYER_KIND_SLIDING;
    c->sliding_window = 0;
    TRY(json_get_i32(x->text, tp, "sliding_window", any_sliding ? REQ : OPT, 1, INT32_MAX, &c->sliding_window, e));

    /* rope */
    TRY(get_layer_list(x, "rope_theta", true, 0, c->n_layers, c->n_layers_total, theta, &n_theta));
    if (n_theta == 0) {
        char p[256];
        return err_set(e, -ENOENT, "%s: required field is missing", json_path_join(p, sizeof(p), tp, "rope_theta"));
    }
    TRY(get_layer_list(x, "partial_rotary_factors", false, 1.0, c->n_layers, c->n_layers_total, prf, &n_prf));
    TRY(get_layer_list(x, "swiglu_limits", false, 0.0, c->n_layers, c->n_layers_total, swl, &n_swl));
    TRY(get_layer_list(x, "swiglu_limits_shared", false, 0.0, c->n_layers, c->n_layers_total, swls, &n_swls));
    if (n_prf == 0)
        for (int i = 0; i < c->n_layers_total; i++)
            prf[i] = 1.0;
    c->rope_scaling.present = false;
    TRY(json_get_obj(x->text, tp, "rope_scaling", OPT, &rs, e));
    if (rs) {
        char rp[256];
        const char *type = NULL;
        json_path_join(rp, sizeof(rp), tp, "rope_scaling");
        r = json_get_str(rs, rp, "rope_type", OPT, &type, e);
        if (r == 0)
            r = json_get_str(rs, rp, "type", REQ, &type, e);
        if (r < 0)
            return r;
        if (strcmp(type, "llama3") == 0) {
            c->rope_scaling.present = true;
            TRY(json_get_num(rs, rp, "factor", REQ, &c->rope_scaling.factor, e));
            TRY(json_get_num(rs, rp, "low_freq_factor", REQ, &c->rope_scaling.low_freq_factor, e));
            TRY(json_get_num(rs, rp, "high_freq_factor", REQ, &c->rope_scaling.high_freq_factor, e));
            TRY(json_get_num(rs, rp, "original_max_position_embeddings", REQ,
                             &c->rope_scaling.original_max_position_embeddings, e));
            if (!(c->rope_scaling.factor > 0) || !(c->rope_scaling.low_freq_factor > 0) ||
                !(c->rope_scaling.high_freq_factor > c->rope_scaling.low_freq_factor) ||
                !(c->rope_scaling.original_max_position_embeddings > 0))
                return err_set(e, -EINVAL, "%s: factors must be positive and high_freq_factor > low_freq_factor", rp);
        } else if (strcmp(type, "default") != 0) {
            return err_set(e, -ENOTSUP, "%s.rope_type: '%.32s' is not supported (llama3 or default)", rp, type);
        }
    }
    TRY(json_get_arr(x->text, tp, "yarn_only_types", OPT, &yot, e));
    url = json_object_get(x->text, "use_rope_layers");
    if (url && !json_is_null(url) && !(json_is_array(url) && json_array_size(url) == 0)) {
        char p[256];
        return err_set(e, -ENOTSUP, "%s: per-layer RoPE selection is not supported (expected absent or empty)",
                       json_path_join(p, sizeof(p), tp, "use_rope_layers"));
    }

    /* booleans */
    c->use_qk_norm = true;
    c->use_head_wise_attn_gate = false;
    TRY(json_get_bool(x->text, tp, "use_qk_norm", OPT, &c->use_qk_norm, e));
    TRY(json_get_bool(x->text, tp, "use_head_wise_attn_gate", OPT, &c->use_head_wise_attn_gate, e));
    c->tie_word_embeddings = false;
    r = json_get_bool(x->text, tp, "tie_word_embeddings", OPT, &c->tie_word_embeddings, e);
    if (r == 0 && x->text != x->top)
        r = json_get_bool(x->top, "", "tie_word_embeddings", OPT, &c->tie_word_embeddings, e);
    if (r < 0)
        return r;

    /* MoE */
    TRY(json_get_bool(x->text, tp, "use_moe", OPT, &use_moe, e));
    TRY(get_moe_layers(x, c->n_layers, is_moe, &moe_enum));
    if (!moe_enum && use_moe) {
        int off = 0, every = 1;
        TRY(json_get_i32(x->text, tp, "moe_layer_offset", OPT, 0, MODEL_MAX_LAYERS, &off, e));
        TRY(json_get_i32(x->text, tp, "moe_every_n_layer", OPT, 1, MODEL_MAX_LAYERS, &every, e));
        for (int i = off; i < c->n_layers; i++)
            is_moe[i] = (i - off) % every == 0;
    }
    for (int i = 0; i < c->n_layers; i++)
        any_moe |= is_moe[i];
    c->n_experts = c->top_k = c->moe_intermediate_size = c->shared_expert_dim = 0;
    c->norm_expert_weight = true;
    c->router_scaling_factor = 1.0f;
    c->use_router_bias = false;
    if (any_moe) {
        const char *act = NULL;
        char p[256];
        bool fp32_gate = true;
        TRY(json_get_i32(x->text, tp, "moe_num_experts", REQ, 1, 1 << 16, &c->n_experts, e));
        TRY(json_get_i32(x->text, tp, "moe_top_k", REQ, 1, c->n_experts, &c->top_k, e));
        TRY(json_get_i32(x->text, tp, "moe_intermediate_size", REQ, 1, 1 << 22, &c->moe_intermediate_size, e));
        TRY(json_get_i32(x->text, tp, "share_expert_dim", REQ, 1, 1 << 22, &c->shared_expert_dim, e));
        TRY(json_get_bool(x->text, tp, "norm_expert_weight", OPT, &c->norm_expert_weight, e));
        TRY(json_get_bool(x->text, tp, "use_moe_router_bias", OPT, &c->use_router_bias, e));
        TRY(json_get_bool(x->text, tp, "need_fp32_gate", OPT, &fp32_gate, e));
        d = 1.0;
        TRY(json_get_num(x->text, tp, "moe_router_scaling_factor", OPT, &d, e));
        if (!(d > 0))
            return err_set(e, -EINVAL, "%s: must be positive",
                           json_path_join(p, sizeof(p), tp, "moe_router_scaling_factor"));
        c->router_scaling_factor = (float) d;
        TRY(json_get_str(x->text, tp, "moe_router_activation", OPT, &act, e));
        if (act && strcmp(act, "sigmoid") != 0)
            return err_set(e, -ENOTSUP, "%s: '%.32s' is not supported (sigmoid)",
                           json_path_join(p, sizeof(p), tp, "moe_router_activation"), act);
    }

    /* per-layer table */
    for (int i = 0; i < c->n_layers_total; i++) {
        struct layer_config *L = &c->layers[i];
        bool mtp = i >= c->n_layers;
        double th = i < n_theta ? theta[i] : 0, pf = i < n_prf || n_prf == 0 ? prf[i] : 0;
        char p[256];

        if (mtp && (i >= n_theta || (n_prf && i >= n_prf))) {
            /* docs/MODEL.md §1.3: MTP layers take the sliding layers' RoPE */
            for (int j = 0; j < c->n_layers; j++)
                if (c->layers[j].kind == L->kind) {
                    if (i >= n_theta)
                        th = theta[j];
                    if (n_prf && i >= n_prf)
                        pf = prf[j];
                    break;
                }
            if (th == 0)
                th = theta[c->n_layers - 1];
            if (pf == 0)
                pf = 1.0;
            mtp_defaulted = true;
        }
        if (mtp && ((n_swl && i >= n_swl) || (n_swls && i >= n_swls)))
            mtp_defaulted = true;
        L->is_mtp = mtp;
        L->is_moe = !mtp && is_moe[i];
        L->n_heads = L->kind == LAYER_KIND_FULL ? c->n_heads_full : c->n_heads_sliding;
        L->n_kv_heads = c->n_kv_heads;
        L->head_dim = c->head_dim;
        if (!(th > 0))
            return err_set(e, -EINVAL, "%s[%d]: rope_theta must be positive",
                           json_path_join(p, sizeof(p), tp, "rope_theta"), i);
        L->rope_theta = th;
        if (!(pf > 0 && pf <= 1))
            return err_set(e, -EINVAL, "%s[%d]: %g is not in (0, 1]",
                           json_path_join(p, sizeof(p), tp, "partial_rotary_factors"), i, pf);
        tmp = (int) lround(pf * c->head_dim);
        if (fabs(pf * c->head_dim - tmp) > 1e-6 || tmp % 2)
            return err_set(e, -EINVAL, "%s[%d]: %g x head_dim %d is not an even whole number of dims",
                           json_path_join(p, sizeof(p), tp, "partial_rotary_factors"), i, pf, c->head_dim);
        L->rotary_dims = tmp;
        L->swiglu_limit = i < n_swl ? (float) swl[i] : 0.0f;
        L->swiglu_limit_shared = i < n_swls ? (float) swls[i] : 0.0f;
        if (L->swiglu_limit < 0 || L->swiglu_limit_shared < 0)
            return err_set(e, -EINVAL, "%s[%d]: negative clamp limit",
                           json_path_join(p, sizeof(p), tp, L->swiglu_limit < 0 ? "swiglu_limits" : "swiglu_limits_shared"), i);
        L->rope_llama3 = false;
        if (c->rope_scaling.present) {
            if (!yot) {
                L->rope_llama3 = true;
            } else {
                const char *kn = L->kind == LAYER_KIND_FULL ? "full_attention" : "sliding_attention";
                for (size_t j = 0; j < json_array_size(yot); j++) {
                    json_t *it = json_array_get(yot, j);
                    if (!json_is_string(it))
                        return err_set(e, -EINVAL, "%s[%zu]: expected a string, got %s",
                                       json_path_join(p, sizeof(p), tp, "yarn_only_types"), j,
                                       json_type_describe(it));
                    if (strcmp(json_string_value(it), kn) == 0)
                        L->rope_llama3 = true;
                }
            }
        }
    }
    if (mtp_defaulted)
        note_add(c, "%s", "per-layer lists cover only the trunk: MTP layers use the docs/MODEL.md 1.3 defaults (sliding attention, sliding RoPE, no clamp)");

    c->bos_token_id = -1;
    {
        const json_t *holder = json_object_get(x->text, "bos_token_id") ? x->text : x->top;
        json_t *b = json_object_get(holder, "bos_token_id");
        if (b && !json_is_null(b))
            TRY(json_get_i32(holder, holder == x->text ? tp : "", "bos_token_id", REQ, 0, c->vocab_size - 1,
                             &c->bos_token_id, e));
    }
    TRY(parse_eos(x, c));
#undef TRY
    return 0;
}

int model_config_parse(const char *json, size_t len, const char *name,
                       struct model_config *ret, struct err_buf *e)
{
    struct cfg_ctx x = { .e = e };
    json_t *root = NULL, *tc = NULL, *q = NULL;
    const char *mt = NULL;
    int r;

    memset(ret, 0, sizeof(*ret));
    if (len > CONFIG_FILE_MAX)
        return err_set(e, -EFBIG, "%s: %zu bytes, more than %u", name, len, CONFIG_FILE_MAX);
    r = json_parse_text(json, len, name, &root, e);
    if (r < 0)
        return r;
    if (!json_is_object(root)) {
        r = err_set(e, -EINVAL, "%s: expected a JSON object, got %s", name, json_type_describe(root));
        goto out;
    }
    r = json_get_str(root, "", "model_type", OPT, &mt, e);
    if (r < 0)
        goto out_prefix;
    r = json_get_obj(root, "", "text_config", OPT, &tc, e);
    if (r < 0)
        goto out_prefix;
    x.top = root;
    x.text = tc ? tc : root;
    x.tpath = tc ? "text_config" : "";
    ret->nested = tc != NULL;
    if (tc && !mt)
        (void) json_get_str(tc, "text_config", "model_type", OPT, &mt, NULL);
    snprintf(ret->model_type, sizeof(ret->model_type), "%s", mt ? mt : "");
    r = parse_text(&x, ret);
    if (r < 0)
        goto out_prefix;
    q = json_object_get(root, "quantization_config");
    if (!q && tc)
        q = json_object_get(tc, "quantization_config");
    r = parse_quant(q, ret, e);
    if (r < 0)
        goto out_prefix;
    if (ret->quant == QUANT_MXFP4 && ret->n_experts && (ret->hidden_size % 32 || ret->moe_intermediate_size % 32)) {
        r = err_set(e, -EINVAL, "quantization_config: MXFP4 needs hidden_size (%d) and moe_intermediate_size (%d) divisible by 32",
                    ret->hidden_size, ret->moe_intermediate_size);
        goto out_prefix;
    }
    r = 0;
    goto out;
out_prefix:
    err_prefix(e, "%s", name);
out:
    json_decref(root);
    return r;
}

int model_config_load(const char *path, struct model_config *ret, struct err_buf *e)
{
    FILE *f = fopen(path, "rbe");
    char *text;
    long sz;
    int r;

    if (!f)
        return err_set(e, -errno, "%s: cannot open: %s", path, err_str(errno));
    if (fseek(f, 0, SEEK_END) < 0 || (sz = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) < 0) {
        r = err_set(e, -EIO, "%s: cannot determine size", path);
        fclose(f);
        return r;
    }
    if ((unsigned long) sz > CONFIG_FILE_MAX) {
        fclose(f);
        return err_set(e, -EFBIG, "%s: %ld bytes, more than %u", path, sz, CONFIG_FILE_MAX);
    }
    text = malloc((size_t) sz + 1);
    if (!text) {
        fclose(f);
        return err_set(e, -ENOMEM, "%s: out of memory", path);
    }
    if (fread(text, 1, (size_t) sz, f) != (size_t) sz) {
        free(text);
        fclose(f);
        return err_set(e, -EIO, "%s: short read", path);
    }
    fclose(f);
    r = model_config_parse(text, (size_t) sz, path, ret, e);
    free(text);
    return r;
}

int model_config_check_len(const struct model_config *c, int max_model_len, bool allow_long,
                           struct err_buf *e)
{
    if (max_model_len <= c->max_position_embeddings || allow_long)
        return 0;
    return err_set(e, -EINVAL, "--max-model-len %d is above the model's max_position_embeddings %d "
                   "(config.json); serve at most %d, or give --allow-long-max-model-len to go past what "
                   "the model was trained for", max_model_len, c->max_position_embeddings,
                   c->max_position_embeddings);
}
