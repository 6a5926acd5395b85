/* vision-tensors.h - the vision tower's config (config.json "vision_config", issue 40) and
 * its expected tensors (docs/ARCHITECTURE.md "Vision encoder").
 *
 * Step-3.7-Flash's PerceptionEncoder: conv1 (patch x patch, no bias), positional_embedding
 * [grid^2, width], ln_pre, `layers` blocks (ln_1, fused attn in_proj, out_proj, ls_1, ln_2,
 * mlp c_fc / c_proj, ls_2), vit_downsampler1/2 (3x3 stride-2 convs width -> 2 width ->
 * 4 width), vit_large_projector [text hidden, 4 width] without bias.  Only the variant the
 * checkpoint uses is accepted (quick_gelu, 2-D RoPE, absolute position embedding, ln_pre,
 * no CLS token, no ln_post, no projector bias): any other value is an error naming the field.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

struct vision_config {
    bool present;           /* config.json has a vision_config */
    int width, layers, heads, head_dim, patch, image_size;
    int grid;               /* image_size / patch: the position-embedding grid side */
    int inter;              /* MLP intermediate: round(width * mlp_ratio) */
    int text_hidden;        /* the projector's output */
    int image_token_id;     /* config.json's image_token_id (<im_patch>), -1 when absent */
};

/* Parse dir/config.json's vision_config for a text model of hidden size text_hidden.
 * No vision_config: 0 with ret->present false.  Errors name the field. */
int vision_config_load(const char *dir, int text_hidden, struct vision_config *ret,
                       struct err_buf *e);
/* The same from a parsed config.json object (a json_t *, void here to keep jansson out). */
int vision_config_parse(const void *root, int text_hidden, struct vision_config *ret,
                        struct err_buf *e);

#define VISION_NAME_MAX 96

struct vision_tensor {
    char name[VISION_NAME_MAX];
    int ndim;
    int64_t shape[4];
};

/* Number of tensors the tower has (4 + 14 * layers + 5). */
int vision_tensor_count(const struct vision_config *v);
/* The i-th expected tensor (0 <= i < vision_tensor_count). */
void vision_tensor_get(const struct vision_config *v, int i, struct vision_tensor *ret);
/* Is name one of the tower's tensor names' prefixes (vision_model., vit_large_projector.,
 * model.vision_model., model.vit_large_projector.)?  *canon receives the name without the
 * "model." prefix. */
bool vision_name_is(const char *name, const char **canon);

#ifdef __cplusplus
}
#endif
