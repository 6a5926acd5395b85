/* convert.c - stepd-mkmodel --from: one checkpoint rewritten in another release format.
 *
 *   stepd-mkmodel --from DIR --out DIR --format bf16|fp8|nvfp4|mxfp4 [--stacked yes|no]
 *                 [--block N] [--force]
 *
 * Reads every tensor of DIR through the loader (any format it loads: BF16, MXFP4, FP8,
 * NVFP4, per-expert or stacked), takes each linear module's weights as the floats they
 * decode to (docs/MODEL.md §5) and writes them with ckptw in the layout stepd-mkmodel
 * --format writes (model_config_set_quant: the routed experts in the format, every other
 * module BF16): BF16 exactly (an MXFP4 value is exact in BF16), FP8 in --block x --block
 * blocks (default 128) through fp8_block_quantize(), NVFP4 through nvfp4_row_quantize(),
 * MXFP4 through mxfp4_row_quantize().  Experts stacked [E, out, in] by default for bf16
 * and fp8, as those releases store them.  tokenizer.json and tokenizer_config.json are
 * copied.  The test suite converts models/tiny-step into each format this way
 * (test/model/run-formats.sh). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckptw.h"
#include "cli.h"
#include "loader.h"
#include "mxfp4.h"
#include "tensor.h"

struct conv {
    struct ckpt *src;
    int err;
    char bad[256];
};

static float bf16f(const uint8_t *p)
{
    uint32_t u = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 24;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* the floats of tensor name (a plain BF16/F32 tensor, or a linear module's "<base>.weight"
 * in any format) into out[n] */
static int source_floats(struct ckpt *c, const char *name, int64_t n, float *out)
{
    char base[256], nm[300];
    struct tview v, s, g;
    size_t bl = strlen(name);

    if (ckpt_get(c, name, &v) == 0 && (v.dtype == DTYPE_BF16 || v.dtype == DTYPE_F32)) {
        if (tview_numel(&v) != n)
            return -EINVAL;
        for (int64_t i = 0; i < n; i++) {
            if (v.dtype == DTYPE_BF16)
                out[i] = bf16f((const uint8_t *)v.data + 2 * i);
            else
                memcpy(&out[i], (const uint8_t *)v.data + 4 * i, 4);
        }
        return 0;
    }
    if (bl < 7 || strcmp(name + bl - 7, ".weight") != 0)
        return -ENOENT;
    snprintf(base, sizeof(base), "%.*s", (int)(bl - 7), name);
    if (ckpt_get(c, name, &v) == 0 && v.dtype == DTYPE_F8_E4M3) {
        int64_t rows = v.shape[0], cols = v.shape[1], br, bc;
        snprintf(nm, sizeof(nm), "%s.weight_scale_inv", base);
        if (ckpt_get(c, nm, &s) < 0 || rows * cols != n)
            return -ENOENT;
        br = rows / s.shape[0];
        bc = cols / s.shape[1];
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) {
                float sc;
                memcpy(&sc, (const uint8_t *)s.data + 4 * ((i / br) * s.shape[1] + j / bc), 4);
                out[i * cols + j] = fp8_e4m3_value(((const uint8_t *)v.data)[i * cols + j]) * sc;
            }
        return 0;
    }
    if (ckpt_get(c, name, &v) == 0 && v.dtype == DTYPE_U8) {
        int64_t rows = v.shape[0], cols = v.shape[1] * 2;
        float gs;
        snprintf(nm, sizeof(nm), "%s.weight_scale", base);
        if (ckpt_get(c, nm, &s) < 0 || rows * cols != n)
            return -ENOENT;
        snprintf(nm, sizeof(nm), "%s.weight_scale_2", base);
        if (ckpt_get(c, nm, &g) < 0)
            return -ENOENT;
        memcpy(&gs, g.data, 4);
        for (int64_t i = 0; i < rows; i++)
            if (nvfp4_row_decode((const uint8_t *)v.data + i * cols / 2, (const uint8_t *)s.data + i * cols / 16,
                                 gs, cols, out + i * cols) < 0)
                return -EBADMSG;
        return 0;
    }
    snprintf(nm, sizeof(nm), "%s.weight_packed", base);
    if (ckpt_get(c, nm, &v) == 0) {
        int64_t rows = v.shape[0], cols = v.shape[1] * 2;
        snprintf(nm, sizeof(nm), "%s.weight_scale", base);
        if (ckpt_get(c, nm, &s) < 0 || rows * cols != n)
            return -ENOENT;
        for (int64_t i = 0; i < rows; i++)
            if (mxfp4_row_decode((const uint8_t *)v.data + i * cols / 2, (const uint8_t *)s.data + i * cols / 32,
                                 cols, out + i * cols) < 0)
                return -EBADMSG;
        return 0;
    }
    return -ENOENT;
}

static int fill(void *user, const char *name, int ndim, const int64_t *shape, float *out)
{
    struct conv *cv = user;
    int64_t n = 1;
    int r;

    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    r = source_floats(cv->src, name, n, out);
    if (r < 0) {
        if (!cv->err) {
            cv->err = r;
            snprintf(cv->bad, sizeof(cv->bad), "%s", name);
        }
        memset(out, 0, (size_t)n * sizeof(float));
    }
    return 1;
}

static int copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rbe"), *b;
    char buf[65536];
    size_t k;
    int r = 0;

    if (!a)
        return errno == ENOENT ? 0 : -errno;
    b = fopen(to, "wbe");
    if (!b) {
        fclose(a);
        return -errno;
    }
    while ((k = fread(buf, 1, sizeof(buf), a)) > 0)
        if (fwrite(buf, 1, k, b) != k)
            r = -EIO;
    fclose(a);
    if (fclose(b) != 0)
        r = -EIO;
    return r;
}

int mkmodel_convert(int argc, char **argv)
{
    static const struct option lo[] = {
        { "from", required_argument, NULL, 'f' }, { "out", required_argument, NULL, 'o' },
        { "format", required_argument, NULL, 'F' }, { "stacked", required_argument, NULL, 's' },
        { "block", required_argument, NULL, 'b' }, { "force", no_argument, NULL, 'x' },
        { "help", no_argument, NULL, 'h' }, { 0 },
    };
    const char *from = NULL, *out = NULL, *fmt = NULL, *stacked = NULL;
    struct ckpt_opts co = { .world_size = 1 };
    struct model_config cfg;
    struct ckptw_opts o;
    struct conv cv = { 0 };
    struct err_buf e = { "" };
    struct stat st;
    enum quant_scheme q;
    int opt, block = 128, r;
    bool force = false;

    while ((opt = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (opt) {
        case 'f': from = optarg; break;
        case 'o': out = optarg; break;
        case 'F': fmt = optarg; break;
        case 's': stacked = optarg; break;
        case 'x': force = true; break;
        case 'b':
            if (cli_parse_int("--block", optarg, 1, 4096, &block, &e) < 0)
                goto usage;
            break;
        case 'h':
            printf("usage: stepd-mkmodel --from DIR --out DIR --format bf16|fp8|nvfp4|mxfp4 [--stacked yes|no]\n"
                   "                     [--block N] [--force]\n");
            return 0;
        default:
            return 2;
        }
    }
    if (!from || !out || !fmt || optind != argc) {
        err_set(&e, -EINVAL, optind != argc ? "unexpected argument '%s'" : "--from, --out and --format are required",
                optind != argc ? argv[optind] : "");
        goto usage;
    }
    if (strcmp(fmt, "bf16") == 0)
        q = QUANT_NONE;
    else if (strcmp(fmt, "fp8") == 0)
        q = QUANT_FP8;
    else if (strcmp(fmt, "nvfp4") == 0)
        q = QUANT_NVFP4;
    else if (strcmp(fmt, "mxfp4") == 0)
        q = QUANT_MXFP4;
    else {
        err_set(&e, -EINVAL, "--format '%s': expected bf16, fp8, nvfp4 or mxfp4", fmt);
        goto usage;
    }
    if (stacked && strcmp(stacked, "yes") != 0 && strcmp(stacked, "no") != 0) {
        err_set(&e, -EINVAL, "--stacked '%s': expected yes or no", stacked);
        goto usage;
    }
    if (!force && stat(out, &st) == 0) {
        char p[PATH_MAX];
        snprintf(p, sizeof(p), "%s/config.json", out);
        if (stat(p, &st) == 0) {
            fprintf(stderr, "stepd-mkmodel: --out %s already holds a checkpoint (--force replaces it)\n", out);
            return 1;
        }
    }
    {
        /* every MTP layer the source declares */
        char p[PATH_MAX];
        struct model_config pc;
        snprintf(p, sizeof(p), "%s/config.json", from);
        r = model_config_load(p, &pc, &e);
        if (r < 0)
            goto fail;
        co.mtp_depth = pc.n_mtp_layers;
    }
    r = ckpt_open(from, &co, &cv.src, &e);
    if (r < 0)
        goto fail;
    cfg = *ckpt_config(cv.src);
    model_config_set_quant(&cfg, q);
    if (q == QUANT_FP8)
        cfg.quant_block_rows = cfg.quant_group_size = block;
    ckptw_opts_default(&o);
    o.nested = cfg.nested;
    o.write_mtp = ckpt_mtp_depth(cv.src) == cfg.n_mtp_layers;
    o.optional_trunk = o.optional_mtp = false;
    o.stacked_experts = stacked ? strcmp(stacked, "yes") == 0 : (q == QUANT_NONE || q == QUANT_FP8);
    o.fill = fill;
    o.fill_user = &cv;
    mkdir(out, 0755);
    r = ckptw_write(out, &cfg, &o, &e);
    if (r == 0 && cv.err)
        r = err_set(&e, cv.err, "%s: tensor '%s' cannot be read as floats: %s", from, cv.bad, err_str(cv.err));
    if (r < 0)
        goto fail;
    for (int i = 0; i < 2; i++) {
        static const char *const tf[2] = { "tokenizer.json", "tokenizer_config.json" };
        char a[PATH_MAX], b[PATH_MAX];
        snprintf(a, sizeof(a), "%s/%s", from, tf[i]);
        snprintf(b, sizeof(b), "%s/%s", out, tf[i]);
        r = copy_file(a, b);
        if (r < 0) {
            err_set(&e, r, "%s: cannot copy: %s", a, err_str(r));
            goto fail;
        }
    }
    printf("stepd-mkmodel: %s -> %s (%s experts%s, every other module BF16)\n", from, out,
           quant_scheme_name(q), o.stacked_experts ? ", stacked" : "");
    ckpt_close(cv.src);
    return 0;
usage:
    fprintf(stderr, "stepd-mkmodel: %s\nusage: stepd-mkmodel --from DIR --out DIR --format bf16|fp8|nvfp4|mxfp4 (--help)\n",
            e.msg);
    return 2;
fail:
    fprintf(stderr, "stepd-mkmodel: %s\n", e.msg);
    ckpt_close(cv.src);
    return 1;
}
