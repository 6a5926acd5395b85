/* vision.h - the Step-3.7 vision encoder on the backend (issue 40; docs/ARCHITECTURE.md
 * "Vision encoder"): PerceptionEncoder ViT, vit_downsampler1/2, vit_large_projector.
 *
 * Views arrive as uint8 RGB (square, side a multiple of the patch: 728 global, 504 crops);
 * normalisation (CLIP mean/std) is the first step here.  vision_encode() runs every view of
 * a call together: the GEMMs (conv1, QKV, out_proj, MLP, downsamplers as im2col GEMMs,
 * projector) take the tokens of all views at once, attention runs per view and head on
 * the backend's GEMM.  Output: [tokens, text hidden] embeddings, views in order, each
 * view's tokens row-major over its downsampled grid.
 */
#pragma once

#include <stdint.h>

#include "backend.h"
#include "err.h"
#include "loader.h"
#include "vision-tensors.h"

#ifdef __cplusplus
extern "C" {
#endif

struct vision;

/* The tower planned by the loader (ckpt_vision()): weights from ckpt_get(), prepared on be.
 * -ENOENT when the checkpoint plan has no vision tower (text only). */
int vision_new(struct ckpt *c, struct backend *be, struct vision **ret, struct err_buf *e);
void vision_free(struct vision *v);
const struct vision_config *vision_cfg(const struct vision *v);

/* The encoder's memory plan on a device backend (backend_native "vision"; nothing to do on
 * host buffers): the activation buffers of a call of up to max_views views of max_side
 * pixels (the worker: image_size, the largest view) allocated now, and the backend's
 * workspace for its ops and GEMMs reserved in the backend's plan, so that no call allocates
 * device memory; a call with more patches runs in parts that fit (a view larger than
 * max_side is refused).  Call it before the KV pools take the free memory.  *ret_bytes (may
 * be NULL): the bytes planned.  A device that cannot give them: -ENOMEM and a sentence
 * naming the need. */
int vision_plan(struct vision *v, int max_views, int max_side, int64_t *ret_bytes, struct err_buf *e);

/* Embedding tokens of a view of side `size` pixels, or -EINVAL when the tower cannot take
 * it (not a positive multiple of the patch, or larger than the position grid allows). */
int vision_view_tokens(const struct vision *v, int size);

struct vision_view {
    const uint8_t *rgb;     /* [size, size, 3] */
    int size;
};

/* Per-stage activations for tests: called once per view and stage, x [rows, cols]. */
enum vision_stage {
    VISION_PATCH_EMBED,     /* conv1 + position embedding (before ln_pre) */
    VISION_BLOCK0,          /* after block 0 */
    VISION_VIT,             /* after the last block */
    VISION_DS1, VISION_DS2, /* after each downsampler */
    VISION_PROJ,            /* the output embeddings */
    _VISION_STAGES,
};
typedef void (*vision_trace_fn)(void *arg, enum vision_stage st, int view, const float *x, int rows,
                                int cols);

/* Encode n views into out [sum of vision_view_tokens, text hidden]. */
int vision_encode(struct vision *v, const struct vision_view *views, int n, float *out,
                  vision_trace_fn trace, void *trace_arg, struct err_buf *e);

/* The embedding step's hook: rows of x [n_tok, hidden] whose id is image_token_id take the
 * next rows of emb [n_emb, hidden] (vision_encode's output), from *cursor on, in order; the
 * cursor advances (a prefill chunk hands it to the next).  Returns the rows consumed, or
 * -ERANGE (x unchanged) when the chunk has more image tokens than emb rows remain. */
int vision_splice(const int32_t *ids, int n_tok, int32_t image_token_id, const float *emb, int n_emb,
                  int *cursor, float *x, int hidden);

#ifdef __cplusplus
}
#endif
