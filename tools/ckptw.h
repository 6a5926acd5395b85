/* ckptw.h - checkpoint WRITER: Step-3.x models in the real layout, for the tests
 * (tiny random models) and stepd-mkmodel (synthetic full-width models).
 *
 * Writes DIR/config.json (flat Step-3.5 or nested Step-3.7 text_config, with the
 * quantization_config of cfg->quant: compressed-tensors MXFP4, fp8 block-scaled with
 * modules_to_not_convert, modelopt NVFP4 with exclude_modules, each module's format
 * from cfg->layers[].qfmt), the
 * safetensors shards "model-0000i-of-0000N.safetensors" plus
 * model.safetensors.index.json (or one model.safetensors), with every tensor of
 * docs/MODEL.md §4 for cfg: BF16 dense weights, F32 router_bias, MXFP4 experts packed
 * per docs/MODEL.md §5 (U8 weight_packed [out, in/2] + U8 weight_scale [out, in/32]),
 * MTP layers with enorm/hnorm/eh_proj/transformer.shared_head.{norm,output}.
 * ckptw_layout() is that tensor list (names, dtypes, shapes, in file order) for
 * writers that produce the data themselves (stepd-mkmodel streams it).
 *
 * Weights are random (uniform in [-init_scale, init_scale], deterministic in seed
 * and tensor name) unless fill() provides them; norm weights get the same random
 * values (the model is Gemma-style 1+w).  Typical use in a test:
 *
 *     struct model_config cfg;
 *     struct ckptw_opts o;
 *     ckptw_config_tiny(&cfg);          // 4 trunk layers (2 MoE) + 2 MTP, MXFP4
 *     ckptw_opts_default(&o);           // 3 shards, MTP written, seed 1
 *     o.kv_scales = CKPTW_OPT_PER_HEAD; // add .k_scale/.v_scale per KV head
 *     ASSERT_OK(ckptw_write(dir, &cfg, &o, &e));
 *     ASSERT_OK(ckpt_open(dir, &(struct ckpt_opts){ .world_size = 1, .mtp_depth = 2 }, &c, &e));
 *
 * ckptw_tmpdir() makes a fresh directory under $TMPDIR (or /tmp); ckptw_rmtree()
 * removes it.  Generated files never go to the source tree.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "err.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ckptw_optional {
    CKPTW_OPT_NONE,        /* not written */
    CKPTW_OPT_SCALAR,      /* shape [] F32 */
    CKPTW_OPT_PER_HEAD,    /* shape [n_kv_heads] F32 */
};

struct ckptw_override {    /* write this tensor with another dtype / shape (for error tests) */
    const char *name;      /* canonical name */
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
};

/* fill: store the float values of a tensor (numel floats, row-major, the
 * logical dequantised shape: MXFP4 experts are [out, in]); return 1 when filled,
 * 0 to get random values. */
typedef int (*ckptw_fill_t)(void *user, const char *name, int ndim, const int64_t *shape, float *out);

struct ckptw_opts {
    int n_shards;                      /* >= 1 */
    bool single_file;                  /* n_shards == 1: model.safetensors without an index */
    bool write_mtp;                    /* write the cfg->n_mtp_layers MTP layers */
    const char *mtp_dir;               /* non-NULL: MTP tensors go to this directory instead */
    enum ckptw_optional kv_scales;     /* self_attn.k_scale / self_attn.v_scale */
    enum ckptw_optional zero_points;   /* self_attn.k_zero_point / self_attn.v_zero_point */
    bool optional_trunk;               /* put the optional tensors on trunk layers */
    bool optional_mtp;                 /* ... and/or on MTP layers */
    bool nested;                       /* Step-3.7 "text_config" layout (else flat Step-3.5) */
    bool lists_trunk_only;             /* per-layer lists with num_hidden_layers entries */
    bool language_model_prefix;        /* spell names model.language_model.* */
    bool stacked_experts;              /* routed experts as one [n_experts, out, in] tensor per
                                        * projection ("model.layers.L.moe.gate_proj.weight",
                                        * as the BF16 and FP8 releases store them) */
    uint64_t seed;
    float init_scale;
    ckptw_fill_t fill;
    void *fill_user;
    const char *const *omit;           /* NULL-terminated canonical names to leave out */
    const char *const *extra;          /* NULL-terminated extra (unknown) names: BF16 [4] */
    const struct ckptw_override *overrides;
    int n_overrides;
};

/* One tensor of the layout (what ckptw_write would write for cfg and o). */
enum ckptw_kind {
    CKPTW_DENSE,        /* BF16 from floats */
    CKPTW_F32,          /* F32 from floats (router_bias) */
    CKPTW_PACKED,       /* MXFP4 codes of base.weight */
    CKPTW_SCALE,        /* MXFP4 scales of base.weight */
    CKPTW_OPT_SCALE,    /* optional scale: 1 + h/8 */
    CKPTW_OPT_ZP,       /* optional zero point: h */
    CKPTW_RAW,          /* override / extra: deterministic bytes */
    CKPTW_FP8,          /* E4M3 codes of base (block-scaled FP8) */
    CKPTW_FP8_SCALE,    /* F32 weight_scale_inv of base, one per br x bc block */
    CKPTW_NV_PACKED,    /* NVFP4 E2M1 codes of base */
    CKPTW_NV_SCALE,     /* NVFP4 E4M3 group-16 scales of base */
    CKPTW_NV_GSCALE,    /* NVFP4 F32 weight_scale_2 of base */
};

struct ckptw_entry {
    char name[160];     /* canonical */
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    enum ckptw_kind kind;
    int64_t lout, lin;  /* logical [out, in] of a quantised tensor (one expert's when stacked) */
    int br, bc;         /* FP8 block rows, columns */
    int stack;          /* > 0: the routed experts of a layer stacked, shape [stack, ...] */
    char base[160];     /* the logical float tensor ("<module>.weight") the data come from */
    bool mtp;
};

/* The tensor list of cfg under o (MTP layers when o->write_mtp, optional and extra
 * tensors as o asks; o->omit, o->overrides and o->mtp_dir are not applied), in the
 * order ckptw_write writes it.  *ret is malloc'd (caller frees). 0 or -ENOMEM. */
int ckptw_layout(const struct model_config *cfg, const struct ckptw_opts *o,
                 struct ckptw_entry **ret, size_t *ret_n);

/* 3 shards, MTP written, no optional tensors, nested, seed 1, init_scale 0.05. */
void ckptw_opts_default(struct ckptw_opts *o);

/* A tiny Step-like config: hidden 64, 4 trunk layers (0 full/dense, 1 sliding/dense,
 * 2-3 sliding/MoE with 16 experts top-2), 2 MTP layers, heads 8 full / 16 sliding,
 * 8 KV heads of 16 dims, vocab 256, MXFP4 experts.  Divisible for world sizes 1-8. */
void ckptw_config_tiny(struct model_config *cfg);

/* The full Step-3.7-Flash text config of docs/MODEL.md §1.2/§1.3 (45 + 3 layers,
 * 288 experts, MXFP4).  For dry runs over sparse files, never for random weights. */
void ckptw_config_step37(struct model_config *cfg);

/* Write the whole checkpoint into dir (created if needed). */
int ckptw_write(const char *dir, const struct model_config *cfg, const struct ckptw_opts *o,
                struct err_buf *e);

/* Write only config.json (the same text ckptw_write writes). */
int ckptw_write_config(const char *path, const struct model_config *cfg, bool nested,
                       bool lists_trunk_only, struct err_buf *e);

/* Low level: one safetensors file from in-memory tensors (data may be NULL with
 * sparse = true: the file is extended with ftruncate, no data written). */
struct ckptw_tensor {
    const char *name;
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    const void *data;                  /* nbytes of data, or NULL when sparse */
};
int ckptw_write_safetensors(const char *path, const struct ckptw_tensor *t, size_t n, bool sparse,
                            struct err_buf *e);

/* The bytes that precede the data of such a file: the 8-byte little-endian header
 * length and the JSON header (tensors at sequential offsets in the given order,
 * padded to a multiple of 8).  *ret_hdr is malloc'd; *ret_len its size (the offset
 * of the first data byte); *ret_data_len the bytes of all tensors' data. */
int ckptw_safetensors_header(const struct ckptw_tensor *t, size_t n, char **ret_hdr,
                             size_t *ret_len, uint64_t *ret_data_len, struct err_buf *e);

/* The expected-tensor list of the real checkpoint (test/data/step37-mxfp4-expected-
 * tensors.tsv: "name<TAB>dtype<TAB>[shape]<TAB>note", '#' comments, "{0..287}" ranges
 * expanded, a trailing '?' on the dtype ignored).  *ret (malloc'd entries with
 * malloc'd names) is freed with ckptw_tsv_free. */
struct ckptw_tsv_row {
    char *name;
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
};
int ckptw_tsv_read(const char *path, struct ckptw_tsv_row **ret, size_t *ret_n, struct err_buf *e);
void ckptw_tsv_free(struct ckptw_tsv_row *rows, size_t n);

/* Bytes of a tensor (numel x bits / 8); -1 on overflow or sub-byte remainder. */
int64_t ckptw_tensor_bytes(enum dtype dt, int ndim, const int64_t *shape);

/* Deterministic value of element i of tensor name in [-scale, scale] (what the
 * random fill writes before BF16 rounding / MXFP4 quantisation). */
float ckptw_random_value(uint64_t seed, const char *name, int64_t i, float scale);

/* BF16 helpers (round to nearest even). */
uint16_t ckptw_f32_to_bf16(float f);
float ckptw_bf16_to_f32(uint16_t b);

/* mkdtemp under $TMPDIR or /tmp with the given prefix; returns a malloc'd path. */
char *ckptw_tmpdir(const char *prefix);
/* rm -r path (no symlink following). */
void ckptw_rmtree(const char *path);

#ifdef __cplusplus
}
#endif
