/* specconf.h - the one parser of --speculative-config (vLLM's JSON), used by `stepd serve`
 * (which checks it before it starts any rank) and by stepd-worker (which keeps the parsed
 * struct whole in its options and fills the engine's configuration from it).
 *
 * {"method": "mtp", "num_speculative_tokens": K} plus the optional keys below.  "method"
 * is required ("mtp": the checkpoint's own draft layers, the only method); without
 * "num_speculative_tokens" K is the checkpoint's MTP layer count, at most SPEC_MAX_K (as
 * vLLM takes num_nextn_predict_layers).  Unknown keys, methods and values are refused. */
#pragma once

#include <stdbool.h>
#include <string.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SPEC_MAX_K 3
#define SPEC_K_MODEL (-1)         /* num_speculative_tokens absent: the checkpoint's layers */

/* "draft_quantization": how the MTP draft layers hold their weights (model_opts.draft_quant;
 * outputs stay exact either way, see worker/model/model.h).  AUTO (null, "auto" or no key):
 * MXFP4 copies on the CPU backend, where batch-1 drafting is bound by the bytes each draft
 * reads (on the tiny model K=3 decodes ~1.2x faster than from the BF16 weights, for ~0.07
 * less mean acceptance length), the checkpoint's weights on any other backend. */
enum spec_draft_quant {
    SPEC_DRAFT_AUTO = 0,
    SPEC_DRAFT_NONE,              /* "none": the checkpoint's weights */
    SPEC_DRAFT_MXFP4,             /* "mxfp4": re-quantised copies, on every backend */
};

/* "draft_policy": how many drafts a step proposes (spec-policy.h).  ADAPTIVE ("adaptive",
 * null or no key): per step and sequence, 0 up to num_speculative_tokens, whatever the
 * engine's own measurements say gives the most tokens per second.  FIXED ("fixed"): always
 * num_speculative_tokens (a request's own, or the engine's default). */
enum spec_draft_policy {
    SPEC_POLICY_ADAPTIVE = 0,
    SPEC_POLICY_FIXED,
};

struct spec_config {
    /* 0 .. SPEC_MAX_K: the most drafts per step; SPEC_K_MODEL: as many as the checkpoint
     * has MTP layers (spec_config_k) */
    int num_speculative_tokens;
    enum spec_draft_quant draft_quant;
    enum spec_draft_policy draft_policy;
    int draft_vocab;              /* engine_config.draft_vocab: 0 or a multiple of 64 */
    char model[512];              /* "model": a directory holding the MTP layers ("": the
                                     checkpoint's own; stepd-worker --mtp-model) */
};

/* The draft weights a backend named `backend` ("cpu", "cuda", ...) gets for q: true = MXFP4. */
static inline bool spec_draft_mxfp4(enum spec_draft_quant q, const char *backend)
{
    if (q == SPEC_DRAFT_AUTO)
        return backend && strcmp(backend, "cpu") == 0;
    return q == SPEC_DRAFT_MXFP4;
}

/* The one range check of a number of speculative tokens K, wherever one comes in
 * (--speculative-config's num_speculative_tokens, stepd-worker --mtp, the engine's default,
 * a request's own): 0..SPEC_MAX_K, and -1 where allow_default ("the default": the
 * checkpoint's layers, the engine's K).  0, or -EINVAL with "<what>: K is not in 0..3" in e. */
int spec_k_check(const char *what, long long k, bool allow_default, struct err_buf *e);

/* Parse --speculative-config JSON, e.g. {"method":"mtp","num_speculative_tokens":3}, plus
 * the optional "draft_quantization": null | "auto" | "none" | "mxfp4" (enum
 * spec_draft_quant), "draft_policy": null | "adaptive" | "fixed" (enum
 * spec_draft_policy), "draft_vocab": null | N (engine_config.draft_vocab; N a multiple
 * of 64, checked against the vocabulary by the engine) and "model": null | DIR (vLLM's draft
 * model: a directory with the MTP layers, as stepd-worker --mtp-model).
 * NULL or "" means no speculation.  -EINVAL with a sentence in e on anything else
 * (unknown method, K out of range, unknown keys or values, bad JSON). */
int spec_config_parse(const char *json, struct spec_config *ret, struct err_buf *e);

/* The MTP depth to load for c (rank 0) from a checkpoint that declares `declared` MTP layers
 * (num_nextn_predict_layers): K, or every layer for SPEC_K_MODEL, at most `declared` (vLLM
 * would run one layer several times for a larger K; stepd drafts as deep as the layers go,
 * and says so). */
static inline int spec_config_depth(const struct spec_config *c, int declared)
{
    int k = c->num_speculative_tokens == SPEC_K_MODEL ? SPEC_MAX_K : c->num_speculative_tokens;

    return k < declared ? k : declared;
}

/* The drafts per step for c when `available` MTP layers were loaded. */
static inline int spec_config_k(const struct spec_config *c, int available)
{
    return spec_config_depth(c, available);
}

#ifdef __cplusplus
}
#endif
