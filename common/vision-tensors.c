/* vision-tensors.c - vision_config parsing and the tower's expected tensors. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <jansson.h>

#include "json.h"
#include "vision-tensors.h"

#define REQ JSON_GET_REQUIRED
#define OPT JSON_GET_OPTIONAL
#define VISION_CONFIG_MAX (16u << 20)

/* An optional boolean that must have the value `want` (the variant the tower implements). */
static int want_bool(const json_t *vc, const char *key, bool want, struct err_buf *e)
{
    bool b = want;
    int r = json_get_bool(vc, "vision_config", key, OPT, &b, e);

    if (r < 0)
        return r;
    if (b != want)
        return err_set(e, -EINVAL, "vision_config.%s: %s is not supported (the Step-3.7 tower has %s)",
                       key, b ? "true" : "false", want ? "true" : "false");
    return 0;
}

int vision_config_parse(const void *root_, int text_hidden, struct vision_config *ret,
                        struct err_buf *e)
{
    const json_t *root = root_;
    json_t *vc = NULL;
    const char *act = NULL, *mt = NULL;
    double ratio = 0;
    bool pbias = false;
    int r;

    memset(ret, 0, sizeof(*ret));
    r = json_get_obj(root, "", "vision_config", OPT, &vc, e);
    if (r < 0 || !vc)
        return r;
    if ((r = json_get_str(vc, "vision_config", "model_type", OPT, &mt, e)) < 0 ||
        (r = json_get_i32(vc, "vision_config", "width", REQ, 4, 1 << 16, &ret->width, e)) < 0 ||
        (r = json_get_i32(vc, "vision_config", "layers", REQ, 1, 1024, &ret->layers, e)) < 0 ||
        (r = json_get_i32(vc, "vision_config", "heads", REQ, 1, 1024, &ret->heads, e)) < 0 ||
        (r = json_get_i32(vc, "vision_config", "patch_size", REQ, 1, 1024, &ret->patch, e)) < 0 ||
        (r = json_get_i32(vc, "vision_config", "image_size", REQ, 1, 1 << 16, &ret->image_size, e)) < 0 ||
        (r = json_get_num(vc, "vision_config", "mlp_ratio", REQ, &ratio, e)) < 0 ||
        (r = json_get_str(vc, "vision_config", "hidden_act", REQ, &act, e)) < 0)
        return r;
    if (mt && strcmp(mt, "perception_encoder") != 0)
        return err_set(e, -EINVAL, "vision_config.model_type: \"%s\" is not supported (perception_encoder)", mt);
    if (strcmp(act, "quick_gelu") != 0)
        return err_set(e, -EINVAL, "vision_config.hidden_act: \"%s\" is not supported (quick_gelu)", act);
    if ((r = want_bool(vc, "use_abs_posemb", true, e)) < 0 || (r = want_bool(vc, "use_rope2d", true, e)) < 0 ||
        (r = want_bool(vc, "use_ln_pre", true, e)) < 0 || (r = want_bool(vc, "use_ln_post", false, e)) < 0 ||
        (r = want_bool(vc, "use_cls_token", false, e)) < 0)
        return r;
    r = json_get_bool(root, "", "projector_bias", OPT, &pbias, e);
    if (r < 0)
        return r;
    ret->image_token_id = -1;
    r = json_get_i32(root, "", "image_token_id", OPT, 0, INT32_MAX, &ret->image_token_id, e);
    if (r < 0)
        return r;
    if (pbias)
        return err_set(e, -EINVAL, "projector_bias: true is not supported (vit_large_projector has no bias)");
    if (ret->width % ret->heads || (ret->width / ret->heads) % 4)
        return err_set(e, -EINVAL, "vision_config: width %d must split into %d heads of a multiple of 4 (2-D RoPE)",
                       ret->width, ret->heads);
    if (ret->image_size % ret->patch)
        return err_set(e, -EINVAL, "vision_config: image_size %d is not a multiple of patch_size %d",
                       ret->image_size, ret->patch);
    if (!(ratio > 0) || ratio * ret->width > (double) (1 << 20))
        return err_set(e, -EINVAL, "vision_config.mlp_ratio: %g is out of range", ratio);
    if (text_hidden <= 0)
        return err_set(e, -EINVAL, "vision_config: the text model's hidden_size is unknown");
    ret->head_dim = ret->width / ret->heads;
    ret->grid = ret->image_size / ret->patch;
    ret->inter = (int) lround(ratio * ret->width);
    ret->text_hidden = text_hidden;
    ret->present = true;
    return 0;
}

int vision_config_load(const char *dir, int text_hidden, struct vision_config *ret,
                       struct err_buf *e)
{
    char path[4096];
    json_t *root;
    int r;

    memset(ret, 0, sizeof(*ret));
    if (snprintf(path, sizeof(path), "%s/config.json", dir) >= (int) sizeof(path))
        return err_set(e, -ENAMETOOLONG, "%s: path too long", dir);
    r = json_parse_file(path, VISION_CONFIG_MAX, &root, e);
    if (r < 0)
        return r;
    r = json_is_object(root) ? vision_config_parse(root, text_hidden, ret, e)
                             : err_set(e, -EINVAL, "expected a JSON object");
    if (r < 0)
        err_prefix(e, "%s", path);
    json_decref(root);
    return r;
}

/* ---- expected tensors ---- */

#define VT_GLOBAL 4
#define VT_BLOCK 14
#define VT_TAIL 5

int vision_tensor_count(const struct vision_config *v)
{
    return v->present ? VT_GLOBAL + VT_BLOCK * v->layers + VT_TAIL : 0;
}

static void vt_set(struct vision_tensor *t, const char *name, int ndim, int64_t d0, int64_t d1, int64_t d2,
                   int64_t d3)
{
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shape[2] = d2;
    t->shape[3] = d3;
}

void vision_tensor_get(const struct vision_config *v, int i, struct vision_tensor *t)
{
    int64_t C = v->width, P = v->patch;
    char nm[VISION_NAME_MAX];

    BUG_ON(i < 0 || i >= vision_tensor_count(v));
    memset(t, 0, sizeof(*t));
    if (i < VT_GLOBAL) {
        static const char *const names[] = {"vision_model.conv1.weight", "vision_model.ln_pre.weight",
                                            "vision_model.ln_pre.bias", "vision_model.positional_embedding"};
        if (i == 0)
            vt_set(t, names[0], 4, C, 3, P, P);
        else if (i < 3)
            vt_set(t, names[i], 1, C, 0, 0, 0);
        else
            vt_set(t, names[3], 2, (int64_t) v->grid * v->grid, C, 0, 0);
        return;
    }
    i -= VT_GLOBAL;
    if (i < VT_BLOCK * v->layers) {
        static const char *const sfx[VT_BLOCK] = {
            "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight", "attn.out_proj.bias",
            "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ls_1.gamma", "ls_2.gamma",
            "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
        };
        int l = i / VT_BLOCK, k = i % VT_BLOCK;
        int64_t I = v->inter;

        snprintf(nm, sizeof(nm), "vision_model.transformer.resblocks.%d.%s", l, sfx[k]);
        switch (k) {
        case 0: vt_set(t, nm, 2, 3 * C, C, 0, 0); break;
        case 1: vt_set(t, nm, 1, 3 * C, 0, 0, 0); break;
        case 2: vt_set(t, nm, 2, C, C, 0, 0); break;
        case 10: vt_set(t, nm, 2, I, C, 0, 0); break;
        case 11: vt_set(t, nm, 1, I, 0, 0, 0); break;
        case 12: vt_set(t, nm, 2, C, I, 0, 0); break;
        default: vt_set(t, nm, 1, C, 0, 0, 0); break;
        }
        return;
    }
    i -= VT_BLOCK * v->layers;
    switch (i) {
    case 0: vt_set(t, "vision_model.vit_downsampler1.weight", 4, 2 * C, C, 3, 3); break;
    case 1: vt_set(t, "vision_model.vit_downsampler1.bias", 1, 2 * C, 0, 0, 0); break;
    case 2: vt_set(t, "vision_model.vit_downsampler2.weight", 4, 4 * C, 2 * C, 3, 3); break;
    case 3: vt_set(t, "vision_model.vit_downsampler2.bias", 1, 4 * C, 0, 0, 0); break;
    default: vt_set(t, "vit_large_projector.weight", 2, v->text_hidden, 4 * C, 0, 0); break;
    }
}

bool vision_name_is(const char *name, const char **canon)
{
    const char *n = strncmp(name, "model.", 6) == 0 ? name + 6 : name;

    if (strncmp(n, "vision_model.", 13) != 0 && strncmp(n, "vit_large_projector.", 20) != 0)
        return false;
    if (canon)
        *canon = n;
    return true;
}
