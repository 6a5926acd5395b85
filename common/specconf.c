/* specconf.c - --speculative-config, parsed once for stepd serve and stepd-worker
 * (specconf.h). */
#include "specconf.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

/* A string option: values[i] for names[i] (NULL-ended), null for values[0]; -1 otherwise. */
static int choice_of(const json_t *val, const char *const *names, const int *values)
{
    const char *q = json_is_string(val) ? json_string_value(val) : NULL;

    if (json_is_null(val))
        return values[0];
    for (int i = 0; q && names[i]; i++)
        if (strcmp(q, names[i]) == 0)
            return values[i];
    return -1;
}

int spec_k_check(const char *what, long long k, bool allow_default, struct err_buf *e)
{
    if ((k < 0 && !(allow_default && k == -1)) || k > SPEC_MAX_K)
        return err_set(e, -EINVAL, "%s: %lld is not in 0..%d", what, k, SPEC_MAX_K);
    return 0;
}

int spec_config_parse(const char *json, struct spec_config *ret, struct err_buf *e)
{
    struct spec_config cfg = { 0 };

    if (!json || !*json) {
        *ret = cfg;
        return 0;
    }
    json_error_t jerr;
    cfg.num_speculative_tokens = SPEC_K_MODEL;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return err_set(e, -EINVAL, "--speculative-config: invalid JSON at column %d: %s",
                       jerr.column, jerr.text);
    int r = 0;
    const char *key;
    json_t *val;
    if (!json_is_object(root)) {
        r = err_set(e, -EINVAL, "--speculative-config: expected a JSON object");
        goto out;
    }
    json_object_foreach(root, key, val) {
        if (strcmp(key, "method") == 0) {
            if (!json_is_string(val) || strcmp(json_string_value(val), "mtp") != 0) {
                r = err_set(e, -EINVAL, "--speculative-config: method: only \"mtp\" is supported");
                goto out;
            }
        } else if (strcmp(key, "num_speculative_tokens") == 0) {
            if (!json_is_integer(val)) {
                r = err_set(e, -EINVAL,
                            "--speculative-config: num_speculative_tokens: must be an integer in 0..%d",
                            SPEC_MAX_K);
                goto out;
            }
            r = spec_k_check("--speculative-config: num_speculative_tokens", json_integer_value(val), false, e);
            if (r < 0)
                goto out;
            cfg.num_speculative_tokens = (int) json_integer_value(val);
        } else if (strcmp(key, "draft_quantization") == 0) {
            static const char *const names[] = { "auto", "none", "mxfp4", NULL };
            static const int values[] = { SPEC_DRAFT_AUTO, SPEC_DRAFT_NONE, SPEC_DRAFT_MXFP4 };
            int v = choice_of(val, names, values);

            if (v < 0) {
                r = err_set(e, -EINVAL, "--speculative-config: draft_quantization: expected null, "
                            "\"auto\", \"none\" or \"mxfp4\"");
                goto out;
            }
            cfg.draft_quant = (enum spec_draft_quant)v;
        } else if (strcmp(key, "draft_policy") == 0) {
            static const char *const names[] = { "adaptive", "fixed", NULL };
            static const int values[] = { SPEC_POLICY_ADAPTIVE, SPEC_POLICY_FIXED };
            int v = choice_of(val, names, values);

            if (v < 0) {
                r = err_set(e, -EINVAL, "--speculative-config: draft_policy: expected null, "
                            "\"adaptive\" or \"fixed\"");
                goto out;
            }
            cfg.draft_policy = (enum spec_draft_policy)v;
        } else if (strcmp(key, "draft_vocab") == 0) {
            json_int_t n = json_is_integer(val) ? json_integer_value(val) : -1;

            if (json_is_null(val)) {
                cfg.draft_vocab = 0;
            } else if (n < 0 || n % 64 || n > (1 << 24)) {
                r = err_set(e, -EINVAL, "--speculative-config: draft_vocab: expected null or a "
                            "multiple of 64 (0: the whole vocabulary)");
                goto out;
            } else {
                cfg.draft_vocab = (int)n;
            }
        } else if (strcmp(key, "model") == 0) {
            if (json_is_null(val)) {
                cfg.model[0] = '\0';
            } else if (!json_is_string(val) || !json_string_value(val)[0] ||
                       strlen(json_string_value(val)) >= sizeof(cfg.model)) {
                r = err_set(e, -EINVAL, "--speculative-config: model: expected null or the directory of the "
                            "MTP layers (at most %zu bytes)", sizeof(cfg.model) - 1);
                goto out;
            } else {
                snprintf(cfg.model, sizeof(cfg.model), "%s", json_string_value(val));
            }
        } else {
            r = err_set(e, -EINVAL, "--speculative-config: unknown key \"%s\" (stepd takes method, "
                        "num_speculative_tokens, model, draft_quantization, draft_policy, draft_vocab)", key);
            goto out;
        }
    }
    if (!json_object_get(root, "method")) {
        r = err_set(e, -EINVAL, "--speculative-config: method: missing (expected \"mtp\")");
        goto out;
    }
    *ret = cfg;
out:
    json_decref(root);
    return r;
}
