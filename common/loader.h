/* loader.h - THE checkpoint loader shared by every rank and role (docs/ARCHITECTURE.md §5).
 *
 * ckpt_open() reads config.json (+ quantization_config), the index or single file,
 * mmaps the shards, computes the load plan for (world size, rank, MTP depth) and
 * checks it against the shards: every required tensor present with exact dtype and
 * shape, or ONE error listing all missing/mismatched names with their shard.  The
 * optional-parameter rule (.k_scale .v_scale .q_scale .prob_scale .k_zero_point
 * .v_zero_point .q_zero_point .prob_zero_point: never required, never validated, whatever
 * the shape or dtype) applies to trunk and MTP layers alike: those the KV cache reads
 * (ckpt_opts.kv_params) are planned as flat values, the others ignored with one summary
 * warning.  MTP layers requested but incomplete: every missing name in the warnings, and
 * the plan without speculation (depth 0).  Unknown extra tensors: warnings.
 *
 * Names handed to ckpt_get() are canonical "model.layers.N..." spellings; files that
 * use "model.language_model.layers.N..." are mapped on open.  With
 * tie_word_embeddings, "lm_head.weight" is served from model.embed_tokens.weight.
 *
 * Sharding (docs/ARCHITECTURE.md §2) is decided here: ckpt_get() returns the RANK'S SLICE
 * of a tensor (rows of q/k/v/g/gate/up, columns of o_proj/down, the vocab rows of
 * lm_head).  Row slices are views into the mapping; column slices are copied once into
 * loader-owned memory.  Views stay valid until ckpt_close().
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "err.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ckpt;

/* The KV-quantisation parameters, by suffix (bits of ckpt_opts.kv_params). */
enum ckpt_kv_param {
    CKPT_KV_K_SCALE, CKPT_KV_V_SCALE, CKPT_KV_Q_SCALE, CKPT_KV_PROB_SCALE,
    CKPT_KV_K_ZERO_POINT, CKPT_KV_V_ZERO_POINT, CKPT_KV_Q_ZERO_POINT, CKPT_KV_PROB_ZERO_POINT,
};
#define CKPT_KV_PARAMS_ALL 0xffu

struct ckpt_opts {
    const char *mtp_dir;    /* --mtp-model DIR, or NULL: MTP tensors from the main checkpoint */
    int world_size;         /* 1, 2, 4, 8 */
    int rank;               /* 0 .. world_size-1 */
    int mtp_depth;          /* K = 0..n_mtp_layers requested; the plan may reduce it (see ckpt_mtp_depth) */
    bool headers_only;      /* validate without touching tensor data (stepd-inspect) */
    unsigned kv_params;     /* 1u << enum ckpt_kv_param: what the KV cache reads (0: none, the
                             * BF16/F32 KV cache of today); the rest is ignored */
    bool skip_vision;       /* images off (--limit-mm-per-prompt '{"image": 0}'): the vision
                             * tower is neither read from config.json nor loaded */
    char **ret_report;      /* optional: on failure receives the full problem list (one per
                             * line, malloc'd, caller frees; e holds as much as fits);
                             * NULL on success */
};

/* Open and plan.  On failure returns a negative errno and e holds the full report
 * (all problems, one per line).  Warnings (unknown tensors, MTP absent) are kept and
 * available through ckpt_warnings(). */
int ckpt_open(const char *dir, const struct ckpt_opts *opts, struct ckpt **ret, struct err_buf *e);
void ckpt_close(struct ckpt *c);

const struct model_config *ckpt_config(const struct ckpt *c);
/* MTP depth actually planned: 0 when MTP was requested but its layers are absent.
 * The same on every rank (the decision is group-wide); only rank 0 holds MTP tensors. */
int ckpt_mtp_depth(const struct ckpt *c);
/* Newline-separated warnings ("" if none). */
const char *ckpt_warnings(const struct ckpt *c);

/* The rank's slice of a required tensor, or of an optional one that is present.
 * -ENOENT if the tensor is not in this rank's plan (or optional and absent);
 * -ENODATA when opened headers_only.  Both name spellings are accepted.  Row
 * slices point into the mapping; column slices are copied on the first call into
 * loader-owned memory (thread-safe).  Views stay valid until ckpt_close(). */
int ckpt_get(struct ckpt *c, const char *name, struct tview *ret);

/* The vision tower planned on this rank (rank 0 with a vision_config and images on), or
 * NULL.  Its tensors come whole from ckpt_get() under their checkpoint names. */
struct vision_config;
const struct vision_config *ckpt_vision(const struct ckpt *c);

/* Experts held by this rank: [first, first + count). */
void ckpt_expert_range(const struct ckpt *c, int *first, int *count);

/* Plan summary for reporting (stepd-inspect, worker memory report). */
struct ckpt_plan_stats {
    int64_t n_tensors;      /* tensors (or slices) this rank loads */
    int64_t bytes;          /* bytes of those slices */
    int expert_first, expert_count;
    int64_t vision_tensors; /* of those, the vision tower's (rank 0, whole) */
    int64_t vision_bytes;
};
void ckpt_plan_stats(const struct ckpt *c, struct ckpt_plan_stats *ret);

/* Load progress by bytes: *total = ckpt_plan_stats().bytes, *done = the bytes of the planned
 * tensors (this rank's slices) ckpt_get() has handed out so far, each counted once, as the
 * model reads them in.  Thread-safe: another thread may ask while the model loads. */
void ckpt_load_progress(const struct ckpt *c, int64_t *done, int64_t *total);

/* Optional per-head parameter (the optional-parameter rule) of a kind in kv_params: fills
 * out[0..n-1] (n = this rank's heads of that kind) from the tensor `name` when present
 * (a scalar is broadcast, per-head values are this rank's slice, BF16 or F32), else with
 * def (scale 1, zero point 0).  Returns 1 if loaded, 0 if defaulted (absent, or a kind
 * the KV cache does not read), -EINVAL if the element count is neither 1 nor n or the
 * dtype neither F32 nor BF16, -ENODATA when headers_only. */
int ckpt_get_optional(struct ckpt *c, const char *name, float def, float *out, int n);

/* One line per planned tensor: "name dtype [shape] slice bytes", for inspection. */
void ckpt_plan_dump(const struct ckpt *c, FILE *f);

#ifdef __cplusplus
}
#endif
