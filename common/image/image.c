/* image.c - decode (libpng, libjpeg-turbo, libwebp, giflib) and Step-3.7 preprocessing; see image.h. */
#include "image.h"

#include <math.h>
#include <stdbool.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gif_lib.h>
#include <jpeglib.h>
#include <png.h>
#include <webp/decode.h>

const float IMAGE_MEAN[3] = { 0.48145466f, 0.4578275f, 0.40821073f };
const float IMAGE_STD[3] = { 0.26862954f, 0.26130258f, 0.27577711f };

static const char *const format_names[_IMAGE_FORMAT_MAX] = { "PNG", "JPEG", "WebP", "GIF" };

void image_limits_default(struct image_limits *l)
{
    l->max_bytes = IMAGE_DEFAULT_MAX_BYTES;
    l->max_side = IMAGE_DEFAULT_MAX_SIDE;
    l->max_pixels = IMAGE_DEFAULT_MAX_PIXELS;
}

const char *image_format_name(enum image_format f)
{
    return (unsigned)f < _IMAGE_FORMAT_MAX ? format_names[f] : "?";
}

int image_sniff(const void *data, size_t n)
{
    const uint8_t *p = data;

    if (n >= 8 && !memcmp(p, "\x89PNG\r\n\x1a\n", 8))
        return IMAGE_PNG;
    if (n >= 3 && p[0] == 0xff && p[1] == 0xd8 && p[2] == 0xff)
        return IMAGE_JPEG;
    if (n >= 12 && !memcmp(p, "RIFF", 4) && !memcmp(p + 8, "WEBP", 4))
        return IMAGE_WEBP;
    if (n >= 6 && (!memcmp(p, "GIF87a", 6) || !memcmp(p, "GIF89a", 6)))
        return IMAGE_GIF;
    return -ENOTSUP;
}

/* the declared size against the limits, before any pixel is decoded */
static int check_dims(const char *fmt, uint64_t w, uint64_t h, const struct image_limits *lim, struct err_buf *e)
{
    if (w == 0 || h == 0)
        return err_set(e, -EBADMSG, "%s image declares an empty size %llux%llu", fmt, (unsigned long long)w,
                       (unsigned long long)h);
    if (w > lim->max_side || h > lim->max_side)
        return err_set(e, -E2BIG, "%s image declares %llux%llu pixels, more than the limit of %u per side",
                       fmt, (unsigned long long)w, (unsigned long long)h, lim->max_side);
    if (w * h > lim->max_pixels)
        return err_set(e, -E2BIG, "%s image declares %llux%llu = %llu pixels, more than the limit of %llu",
                       fmt, (unsigned long long)w, (unsigned long long)h, (unsigned long long)(w * h),
                       (unsigned long long)lim->max_pixels);
    return 0;
}

/* RGBA -> RGB over white, rounding as an exact division by 255 */
static void over_white(const uint8_t *rgba, uint8_t *rgb, size_t n_px)
{
    for (size_t i = 0; i < n_px; i++) {
        unsigned a = rgba[4 * i + 3];
        for (int c = 0; c < 3; c++) {
            unsigned v = rgba[4 * i + c] * a + 255u * (255u - a) + 128u;
            rgb[3 * i + c] = (uint8_t)((v + (v >> 8)) >> 8);
        }
    }
}

/* ---- PNG ---- */

struct png_src {
    const uint8_t *p;
    size_t n, off;
    struct err_buf *e;
    int err_set;
};

static void png_read_mem(png_structp png, png_bytep out, size_t len)
{
    struct png_src *s = png_get_io_ptr(png);

    if (len > s->n - s->off)
        png_error(png, "truncated data");
    memcpy(out, s->p + s->off, len);
    s->off += len;
}

static void png_on_error(png_structp png, png_const_charp msg)
{
    struct png_src *s = png_get_error_ptr(png);

    if (!s->err_set)
        err_set(s->e, -EBADMSG, "corrupt or truncated PNG image: %s", msg);
    s->err_set = 1;
    png_longjmp(png, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg;
}

static int decode_png(const uint8_t *data, size_t n, const struct image_limits *lim, struct image *img,
                      struct err_buf *e)
{
    struct png_src src = { data, n, 0, e, 0 };
    png_structp png;
    png_infop info;
    uint8_t *volatile buf = NULL;
    png_bytep *volatile rows = NULL;
    volatile int r = 0;

    png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
    if (!png || !(info = png_create_info_struct(png))) {
        png_destroy_read_struct(&png, NULL, NULL);
        return err_set(e, -ENOMEM, "out of memory for the PNG decoder");
    }
    if (setjmp(png_jmpbuf(png))) {
        r = -EBADMSG;
        goto out;
    }
    png_set_user_limits(png, 0x7fffffff, 0x7fffffff);   /* ours decide, with their message */
    png_set_chunk_malloc_max(png, 8u << 20);
    png_set_read_fn(png, &src, png_read_mem);
    png_read_info(png, info);

    png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
    int ct = png_get_color_type(png, info), depth = png_get_bit_depth(png, info);
    if ((r = check_dims("PNG", w, h, lim, e)) < 0)
        goto out;
    if (depth == 16)
        png_set_strip_16(png);
    if (ct == PNG_COLOR_TYPE_PALETTE)
        png_set_palette_to_rgb(png);
    if (ct == PNG_COLOR_TYPE_GRAY && depth < 8)
        png_set_expand_gray_1_2_4_to_8(png);
    if (ct == PNG_COLOR_TYPE_GRAY || ct == PNG_COLOR_TYPE_GRAY_ALPHA)
        png_set_gray_to_rgb(png);
    if (ct == PNG_COLOR_TYPE_GRAY_ALPHA)
        png_set_strip_alpha(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);

    int ch = png_get_channels(png, info);
    if (ch != 3 && ch != 4) {
        r = err_set(e, -EBADMSG, "PNG image decodes to %d channels", ch);
        goto out;
    }
    size_t stride = (size_t)w * ch;
    buf = malloc(stride * h);
    rows = malloc(sizeof(*rows) * h);
    if (!buf || !rows) {
        r = err_set(e, -ENOMEM, "out of memory for a %ux%u PNG image", (unsigned)w, (unsigned)h);
        goto out;
    }
    for (size_t y = 0; y < h; y++)
        rows[y] = buf + y * stride;
    png_read_image(png, rows);
    png_read_end(png, NULL);
    if (ch == 4) {
        uint8_t *rgb = malloc((size_t)w * h * 3);
        if (!rgb) {
            r = err_set(e, -ENOMEM, "out of memory for a %ux%u PNG image", (unsigned)w, (unsigned)h);
            goto out;
        }
        over_white(buf, rgb, (size_t)w * h);
        free(buf);
        buf = rgb;
    }
    img->w = w;
    img->h = h;
    img->rgb = buf;
    buf = NULL;
out:
    png_destroy_read_struct(&png, &info, NULL);
    free(buf);
    free(rows);
    return r;
}

/* ---- JPEG ---- */

struct jpeg_err {
    struct jpeg_error_mgr mgr;
    jmp_buf jmp;
    struct err_buf *e;
};

static void jpeg_on_error(j_common_ptr cinfo)
{
    struct jpeg_err *je = (struct jpeg_err *)cinfo->err;
    char msg[JMSG_LENGTH_MAX];

    cinfo->err->format_message(cinfo, msg);
    err_set(je->e, -EBADMSG, "corrupt or truncated JPEG image: %s", msg);
    longjmp(je->jmp, 1);
}

/* warnings ("premature end of JPEG file", corrupt data) are counted and refused afterwards:
 * libjpeg would otherwise fill the missing part with grey */
static void jpeg_on_message(j_common_ptr cinfo, int level)
{
    struct jpeg_err *je = (struct jpeg_err *)cinfo->err;

    if (level < 0 && je->mgr.num_warnings++ == 0) {
        char msg[JMSG_LENGTH_MAX];
        cinfo->err->format_message(cinfo, msg);
        err_set(je->e, -EBADMSG, "corrupt or truncated JPEG image: %s", msg);
    }
}

static int decode_jpeg(const uint8_t *data, size_t n, const struct image_limits *lim, struct image *img,
                       struct err_buf *e)
{
    struct jpeg_decompress_struct cinfo;
    struct jpeg_err je;
    uint8_t *volatile buf = NULL;
    volatile int r = 0;

    cinfo.err = jpeg_std_error(&je.mgr);
    je.mgr.error_exit = jpeg_on_error;
    je.mgr.emit_message = jpeg_on_message;
    je.e = e;
    if (setjmp(je.jmp)) {
        r = -EBADMSG;
        goto out;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, n);
    jpeg_read_header(&cinfo, TRUE);
    if (je.mgr.num_warnings) {
        r = -EBADMSG;
        goto out;
    }
    if ((r = check_dims("JPEG", cinfo.image_width, cinfo.image_height, lim, e)) < 0)
        goto out;
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        r = err_set(e, -ENOTSUP, "CMYK JPEG images are not supported");
        goto out;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.mem->max_memory_to_use = (long)(lim->max_pixels * 16 + (64u << 20));
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3) {
        r = err_set(e, -EBADMSG, "JPEG image decodes to %d components", cinfo.output_components);
        goto out;
    }
    size_t stride = (size_t)cinfo.output_width * 3;
    buf = malloc(stride * cinfo.output_height);
    if (!buf) {
        r = err_set(e, -ENOMEM, "out of memory for a %ux%u JPEG image", cinfo.output_width, cinfo.output_height);
        goto out;
    }
    while (cinfo.output_scanline < cinfo.output_height) {
        JSAMPROW row = buf + stride * cinfo.output_scanline;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    if (je.mgr.num_warnings) {
        r = -EBADMSG;
        goto out;
    }
    img->w = cinfo.output_width;
    img->h = cinfo.output_height;
    img->rgb = buf;
    buf = NULL;
out:
    jpeg_destroy_decompress(&cinfo);
    free(buf);
    return r;
}

/* ---- WebP ---- */

static int decode_webp(const uint8_t *data, size_t n, const struct image_limits *lim, struct image *img,
                       struct err_buf *e)
{
    WebPBitstreamFeatures f;
    VP8StatusCode st = WebPGetFeatures(data, n, &f);
    int r;

    if (st != VP8_STATUS_OK)
        return err_set(e, -EBADMSG, "corrupt or truncated WebP image: bad header (libwebp status %d)", (int)st);
    if ((r = check_dims("WebP", (uint64_t)f.width, (uint64_t)f.height, lim, e)) < 0)
        return r;
    if (f.has_animation)
        return err_set(e, -ENOTSUP, "animated WebP images are not supported");
    size_t n_px = (size_t)f.width * f.height;
    int ch = f.has_alpha ? 4 : 3;
    uint8_t *buf = malloc(n_px * ch), *rgb;
    if (!buf)
        return err_set(e, -ENOMEM, "out of memory for a %dx%d WebP image", f.width, f.height);
    if (!(ch == 4 ? WebPDecodeRGBAInto(data, n, buf, n_px * 4, f.width * 4)
                  : WebPDecodeRGBInto(data, n, buf, n_px * 3, f.width * 3))) {
        free(buf);
        return err_set(e, -EBADMSG, "corrupt or truncated WebP image: the bitstream does not decode");
    }
    if (ch == 4) {
        if (!(rgb = malloc(n_px * 3))) {
            free(buf);
            return err_set(e, -ENOMEM, "out of memory for a %dx%d WebP image", f.width, f.height);
        }
        over_white(buf, rgb, n_px);
        free(buf);
        buf = rgb;
    }
    img->w = f.width;
    img->h = f.height;
    img->rgb = buf;
    return 0;
}

/* ---- GIF (first frame) ---- */

struct gif_src {
    const uint8_t *p;
    size_t n, off;
};

static int gif_read_mem(GifFileType *g, GifByteType *out, int len)
{
    struct gif_src *s = g->UserData;
    size_t k = len < 0 ? 0 : (size_t)len;

    if (k > s->n - s->off)
        k = s->n - s->off;
    memcpy(out, s->p + s->off, k);
    s->off += k;
    return (int)k;
}

static int gif_fail(struct err_buf *e, int code, const char *what)
{
    const char *s = GifErrorString(code);
    return err_set(e, -EBADMSG, "corrupt or truncated GIF image: %s (%s)", what, s ? s : "unknown error");
}

static int decode_gif(const uint8_t *data, size_t n, const struct image_limits *lim, struct image *img,
                      struct err_buf *e)
{
    struct gif_src src = { data, n, 0 };
    int gerr = 0, r = 0;
    GifFileType *g = DGifOpen(&src, gif_read_mem, &gerr);
    uint8_t *idx = NULL, *rgb = NULL;

    if (!g)
        return gif_fail(e, gerr, "bad header");
    if ((r = check_dims("GIF", (uint64_t)g->SWidth, (uint64_t)g->SHeight, lim, e)) < 0)
        goto out;
    for (;;) {
        GifRecordType rt;
        if (DGifGetRecordType(g, &rt) == GIF_ERROR) {
            r = gif_fail(e, g->Error, "bad record");
            goto out;
        }
        if (rt == TERMINATE_RECORD_TYPE) {
            r = err_set(e, -EBADMSG, "corrupt GIF image: it has no frame");
            goto out;
        }
        if (rt == EXTENSION_RECORD_TYPE) {
            int code;
            GifByteType *ext;
            if (DGifGetExtension(g, &code, &ext) == GIF_ERROR) {
                r = gif_fail(e, g->Error, "bad extension");
                goto out;
            }
            while (ext) {
                if (DGifGetExtensionNext(g, &ext) == GIF_ERROR) {
                    r = gif_fail(e, g->Error, "bad extension");
                    goto out;
                }
            }
            continue;
        }
        if (rt != IMAGE_DESC_RECORD_TYPE)
            continue;
        if (DGifGetImageDesc(g) == GIF_ERROR) {
            r = gif_fail(e, g->Error, "bad frame descriptor");
            goto out;
        }
        break;
    }

    GifImageDesc *d = &g->Image;
    uint64_t fw = d->Width > 0 ? (uint64_t)d->Width : 0, fh = d->Height > 0 ? (uint64_t)d->Height : 0;
    if ((r = check_dims("GIF frame of a", fw, fh, lim, e)) < 0)
        goto out;
    ColorMapObject *cm = d->ColorMap ? d->ColorMap : g->SColorMap;
    if (!cm || !cm->Colors || cm->ColorCount <= 0) {
        r = err_set(e, -EBADMSG, "corrupt GIF image: its first frame has no colour table");
        goto out;
    }
    size_t sw = (size_t)g->SWidth, sh = (size_t)g->SHeight;
    idx = malloc(fw * fh);
    rgb = malloc(sw * sh * 3);
    if (!idx || !rgb) {
        r = err_set(e, -ENOMEM, "out of memory for a %zux%zu GIF image", sw, sh);
        goto out;
    }
    if (d->Interlace) {
        static const int start[4] = { 0, 4, 2, 1 }, step[4] = { 8, 8, 4, 2 };
        for (int pass = 0; pass < 4; pass++)
            for (size_t y = start[pass]; y < fh; y += step[pass])
                if (DGifGetLine(g, idx + y * fw, (int)fw) == GIF_ERROR) {
                    r = gif_fail(e, g->Error, "bad pixel data");
                    goto out;
                }
    } else {
        for (size_t y = 0; y < fh; y++)
            if (DGifGetLine(g, idx + y * fw, (int)fw) == GIF_ERROR) {
                r = gif_fail(e, g->Error, "bad pixel data");
                goto out;
            }
    }
    /* the canvas: the screen's background colour, the frame at its offset (clipped) */
    GifColorType bg = { 0, 0, 0 };
    if (g->SColorMap && g->SBackGroundColor < g->SColorMap->ColorCount)
        bg = g->SColorMap->Colors[g->SBackGroundColor];
    for (size_t i = 0; i < sw * sh; i++) {
        rgb[3 * i] = bg.Red;
        rgb[3 * i + 1] = bg.Green;
        rgb[3 * i + 2] = bg.Blue;
    }
    for (size_t y = 0; y < fh; y++) {
        size_t cy = (size_t)d->Top + y;
        if (d->Top < 0 || cy >= sh)
            continue;
        for (size_t x = 0; x < fw; x++) {
            size_t cx = (size_t)d->Left + x;
            if (d->Left < 0 || cx >= sw)
                continue;
            unsigned k = idx[y * fw + x];
            GifColorType c = k < (unsigned)cm->ColorCount ? cm->Colors[k] : (GifColorType){ 0, 0, 0 };
            uint8_t *o = rgb + 3 * (cy * sw + cx);
            o[0] = c.Red;
            o[1] = c.Green;
            o[2] = c.Blue;
        }
    }
    img->w = (uint32_t)sw;
    img->h = (uint32_t)sh;
    img->rgb = rgb;
    rgb = NULL;
out:
    DGifCloseFile(g, &gerr);
    free(idx);
    free(rgb);
    return r;
}

int image_decode(const void *data, size_t n, const struct image_limits *lim, struct image *ret,
                 struct err_buf *e)
{
    struct image_limits def;
    int f, r;

    memset(ret, 0, sizeof(*ret));
    if (!lim) {
        image_limits_default(&def);
        lim = &def;
    }
    if (n == 0)
        return err_set(e, -EBADMSG, "the image is empty");
    if (n > lim->max_bytes)
        return err_set(e, -E2BIG, "the image has %zu bytes, more than the limit of %zu", n, lim->max_bytes);
    if ((f = image_sniff(data, n)) < 0)
        return err_set(e, -ENOTSUP, "unsupported image type: not PNG, JPEG, WebP or GIF");
    switch (f) {
    case IMAGE_PNG: r = decode_png(data, n, lim, ret, e); break;
    case IMAGE_JPEG: r = decode_jpeg(data, n, lim, ret, e); break;
    case IMAGE_WEBP: r = decode_webp(data, n, lim, ret, e); break;
    default: r = decode_gif(data, n, lim, ret, e); break;
    }
    if (r < 0) {
        image_done(ret);
        return r;
    }
    ret->format = (enum image_format)f;
    sha256(data, n, ret->hash);
    return 0;
}

void image_done(struct image *img)
{
    if (!img)
        return;
    free(img->rgb);
    img->rgb = NULL;
}

/* ---- resize: antialiased bilinear (triangle filter, support widened by the downscale) ---- */

struct taps {
    uint32_t *start, *len;
    double *w;          /* n_out x max_len */
    int32_t *wi;        /* the same in 22-bit fixed point */
    uint32_t max_len;
};

#define FIX_BITS 22

static void taps_done(struct taps *t)
{
    free(t->start);
    free(t->len);
    free(t->w);
    free(t->wi);
}

static int taps_init(struct taps *t, uint32_t in, uint32_t out)
{
    double scale = (double)in / out, fs = scale > 1.0 ? scale : 1.0, support = fs;

    t->max_len = (uint32_t)ceil(support) * 2 + 1;
    t->start = malloc(sizeof(uint32_t) * out);
    t->len = malloc(sizeof(uint32_t) * out);
    t->w = calloc((size_t)out * t->max_len, sizeof(double));
    t->wi = calloc((size_t)out * t->max_len, sizeof(int32_t));
    if (!t->start || !t->len || !t->w || !t->wi) {
        taps_done(t);
        return -ENOMEM;
    }
    for (uint32_t o = 0; o < out; o++) {
        double center = (o + 0.5) * scale, sum = 0;
        long lo = (long)(center - support + 0.5), hi = (long)(center + support + 0.5);
        if (lo < 0)
            lo = 0;
        if (hi > (long)in)
            hi = in;
        if (hi - lo > (long)t->max_len)
            hi = lo + t->max_len;
        double *w = t->w + (size_t)o * t->max_len;
        for (long k = 0; k < hi - lo; k++) {
            double x = fabs((k + lo - center + 0.5) / fs);
            w[k] = x < 1.0 ? 1.0 - x : 0.0;
            sum += w[k];
        }
        for (long k = 0; k < hi - lo; k++) {
            w[k] = sum != 0 ? w[k] / sum : 0;
            t->wi[(size_t)o * t->max_len + k] = (int32_t)lround(w[k] * (1 << FIX_BITS));
        }
        t->start[o] = (uint32_t)lo;
        t->len[o] = (uint32_t)(hi - lo);
    }
    return 0;
}

static uint8_t clip8d(double v)
{
    return v <= 0 ? 0 : v >= 255 ? 255 : (uint8_t)lrint(v);
}

static uint8_t clip8i(int64_t v)
{
    v >>= FIX_BITS;
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* Resize the virtual vw x vh image whose top-left rw x rh pixels are src and the rest black
 * (the processor's square pad, never materialised: a 16384 x 1 image would pad to 800 MB) to
 * dw x dh.  Rows and columns past the real ones contribute zero, so the intermediate holds only
 * the rh real rows. */
static int resize_pad(const uint8_t *src, uint32_t rw, uint32_t rh, uint32_t vw, uint32_t vh, uint8_t *dst,
                      uint32_t dw, uint32_t dh, int round_mid)
{
    struct taps tx, ty;
    int r = 0;

    if (taps_init(&tx, vw, dw) < 0)
        return -ENOMEM;
    if (taps_init(&ty, vh, dh) < 0) {
        taps_done(&tx);
        return -ENOMEM;
    }
    /* PIL (round_mid): 8-bit fixed point, the horizontal pass rounded to 8 bits and skipped
     * when the width stays; torchvision on float tensors: no rounding until the end */
    bool skip_h = round_mid && vw == dw;
    float *mid = malloc((size_t)dw * rh * 3 * sizeof(float));
    if (!mid) {
        r = -ENOMEM;
        goto out;
    }
    for (uint32_t y = 0; y < rh; y++)
        for (uint32_t x = 0; x < dw; x++) {
            const uint8_t *row = src + (size_t)y * rw * 3;
            float *o = mid + ((size_t)y * dw + x) * 3;
            if (skip_h) {
                for (int c = 0; c < 3; c++)
                    o[c] = x < rw ? row[3 * x + c] : 0;
                continue;
            }
            int64_t i0 = 1 << (FIX_BITS - 1), i1 = i0, i2 = i0;
            double a0 = 0, a1 = 0, a2 = 0;
            for (uint32_t k = 0; k < tx.len[x] && tx.start[x] + k < rw; k++) {
                const uint8_t *p = row + (size_t)(tx.start[x] + k) * 3;
                if (round_mid) {
                    int32_t w = tx.wi[(size_t)x * tx.max_len + k];
                    i0 += (int64_t)p[0] * w;
                    i1 += (int64_t)p[1] * w;
                    i2 += (int64_t)p[2] * w;
                } else {
                    double w = tx.w[(size_t)x * tx.max_len + k];
                    a0 += p[0] * w;
                    a1 += p[1] * w;
                    a2 += p[2] * w;
                }
            }
            if (round_mid) {
                o[0] = clip8i(i0);
                o[1] = clip8i(i1);
                o[2] = clip8i(i2);
            } else {
                o[0] = (float)a0;
                o[1] = (float)a1;
                o[2] = (float)a2;
            }
        }
    for (uint32_t y = 0; y < dh; y++)
        for (uint32_t x = 0; x < dw; x++) {
            int64_t i0 = 1 << (FIX_BITS - 1), i1 = i0, i2 = i0;
            double a0 = 0, a1 = 0, a2 = 0;
            for (uint32_t k = 0; k < ty.len[y] && ty.start[y] + k < rh; k++) {
                const float *p = mid + ((size_t)(ty.start[y] + k) * dw + x) * 3;
                if (round_mid) {
                    int32_t w = ty.wi[(size_t)y * ty.max_len + k];
                    i0 += (int64_t)p[0] * w;
                    i1 += (int64_t)p[1] * w;
                    i2 += (int64_t)p[2] * w;
                } else {
                    double w = ty.w[(size_t)y * ty.max_len + k];
                    a0 += p[0] * w;
                    a1 += p[1] * w;
                    a2 += p[2] * w;
                }
            }
            uint8_t *o = dst + ((size_t)y * dw + x) * 3;
            if (round_mid) {
                o[0] = clip8i(i0);
                o[1] = clip8i(i1);
                o[2] = clip8i(i2);
            } else {
                o[0] = clip8d(a0);
                o[1] = clip8d(a1);
                o[2] = clip8d(a2);
            }
        }
    free(mid);
out:
    taps_done(&tx);
    taps_done(&ty);
    return r;
}

int image_resize(const uint8_t *src, uint32_t sw, uint32_t sh, uint8_t *dst, uint32_t dw, uint32_t dh,
                 int round_mid)
{
    return resize_pad(src, sw, sh, sw, sh, dst, dw, dh, round_mid);
}

/* ---- the processor's geometry ---- */

struct plan {
    uint32_t pad;           /* square side after padding, 0: none */
    uint32_t pw, ph;        /* after the 3024 limit */
    uint32_t window;        /* 0: no crops */
    uint32_t cw, ch;        /* the image the crops are cut from */
    uint32_t nx, ny;
};

static uint32_t window_size(uint32_t lng, uint32_t sht)
{
    double ratio = (double)lng / sht;

    if (lng <= IMAGE_GLOBAL_SIZE)
        return ratio > 1.5 ? sht : 0;
    if (ratio > 4)
        return sht < IMAGE_CROP_SIZE ? sht : IMAGE_CROP_SIZE;
    return IMAGE_CROP_SIZE;
}

static uint32_t crop_side(uint32_t side, uint32_t window)
{
    double ratio = (double)side / window;

    if (ratio < 1)
        return side;
    uint32_t k = (uint32_t)ratio;
    double frac = ratio - (double)(side / window);
    return window * (frac > 0.2 ? k + 1 : k);
}

static uint32_t grid_count(uint32_t side, uint32_t window)
{
    return side <= window ? 1 : (uint32_t)ceil((double)(side - window) / window + 1);
}

static void plan_make(uint32_t w, uint32_t h, struct plan *p)
{
    memset(p, 0, sizeof(*p));
    double ratio = (double)w / h;
    if ((w < h ? w : h) < 32 && (ratio > 4 || ratio < 1.0 / 4)) {
        p->pad = w > h ? w : h;
        w = h = p->pad;
    }
    uint32_t lng = w > h ? w : h;
    if (lng > IMAGE_PREP_MAX_SIDE) {
        double sf = (double)IMAGE_PREP_MAX_SIDE / lng;
        w = (uint32_t)(w * sf);
        h = (uint32_t)(h * sf);
        if (w == 0)
            w = 1;
        if (h == 0)
            h = 1;
    }
    p->pw = w;
    p->ph = h;
    p->window = window_size(w > h ? w : h, w < h ? w : h);
    if (!p->window)
        return;
    p->cw = crop_side(w, p->window);
    p->ch = crop_side(h, p->window);
    p->nx = grid_count(p->cw, p->window);
    p->ny = grid_count(p->ch, p->window);
}

void image_crop_grid(uint32_t w, uint32_t h, uint32_t *ret_window, uint32_t *ret_x, uint32_t *ret_y)
{
    struct plan p;

    plan_make(w, h, &p);
    *ret_window = p.window;
    *ret_x = p.nx;
    *ret_y = p.ny;
}

size_t image_token_count(uint32_t w, uint32_t h)
{
    struct plan p;

    plan_make(w, h, &p);
    size_t n_crops = (size_t)p.nx * p.ny, n_newlines = n_crops ? p.ny - 1 : 0;
    return n_crops * (IMAGE_CROP_TOKENS + 2) + n_newlines + IMAGE_GLOBAL_TOKENS + 2;
}

/* the window at (x0, y0) of src (black outside), resized to out x out */
static int crop_view(const uint8_t *src, uint32_t sw, uint32_t sh, uint32_t x0, uint32_t y0, uint32_t win,
                     uint8_t *out, uint32_t out_side)
{
    uint8_t *c = calloc((size_t)win * win, 3);
    int r;

    if (!c)
        return -ENOMEM;
    for (uint32_t y = 0; y < win && y0 + y < sh; y++) {
        uint32_t n = x0 >= sw ? 0 : (sw - x0 < win ? sw - x0 : win);
        memcpy(c + (size_t)y * win * 3, src + ((size_t)(y0 + y) * sw + x0) * 3, (size_t)n * 3);
    }
    r = image_resize(c, win, win, out, out_side, out_side, 0);
    free(c);
    return r;
}

int image_prep(const struct image *img, const struct image_token_ids *ids, struct image_prep *ret,
               struct err_buf *e)
{
    struct plan p;
    uint8_t *padded = NULL, *pre = NULL, *forcrop = NULL;
    const uint8_t *cur = img->rgb;
    uint32_t w = img->w, h = img->h;
    int r = 0;

    memset(ret, 0, sizeof(*ret));
    memcpy(ret->hash, img->hash, SHA256_BYTES);
    plan_make(w, h, &p);
    if (p.pad && (p.pw != p.pad || p.ph != p.pad)) {
        /* padded and scaled down in one pass: the square is never materialised */
        if (!(pre = malloc((size_t)p.pw * p.ph * 3)) ||
            resize_pad(cur, w, h, p.pad, p.pad, pre, p.pw, p.ph, 1) < 0)
            goto oom;
        cur = pre;
        w = p.pw;
        h = p.ph;
    } else if (p.pad) {
        if (!(padded = calloc((size_t)p.pad * p.pad, 3)))
            goto oom;
        for (uint32_t y = 0; y < h; y++)
            memcpy(padded + (size_t)y * p.pad * 3, cur + (size_t)y * w * 3, (size_t)w * 3);
        cur = padded;
        w = h = p.pad;
    } else if (p.pw != w || p.ph != h) {
        if (!(pre = malloc((size_t)p.pw * p.ph * 3)) || image_resize(cur, w, h, pre, p.pw, p.ph, 1) < 0)
            goto oom;
        cur = pre;
        w = p.pw;
        h = p.ph;
    }

    ret->window = p.window;
    ret->crops_x = p.nx;
    ret->crops_y = p.ny;
    ret->n_crops = p.nx * p.ny;
    ret->n_views = ret->n_crops + 1;
    ret->n_tokens = image_token_count(img->w, img->h);
    if (!(ret->views = calloc(ret->n_views, sizeof(*ret->views))) ||
        !(ret->tokens = malloc(sizeof(int32_t) * ret->n_tokens)))
        goto oom;

    const uint8_t *crop_src = cur;
    if (p.window && (p.cw != w || p.ch != h)) {
        if (!(forcrop = malloc((size_t)p.cw * p.ch * 3)) || image_resize(cur, w, h, forcrop, p.cw, p.ch, 1) < 0)
            goto oom;
        crop_src = forcrop;
    }
    size_t t = 0;
    for (uint32_t i = 0; i < ret->n_crops; i++) {
        uint32_t gx = i % p.nx, gy = i / p.nx;
        uint32_t x0 = gx * p.window, y0 = gy * p.window;
        if (p.nx > 1 && gx == p.nx - 1 && x0 + p.window > p.cw)
            x0 = p.cw - p.window;
        if (p.ny > 1 && gy == p.ny - 1 && y0 + p.window > p.ch)
            y0 = p.ch - p.window;
        struct image_view *v = &ret->views[i];
        v->w = v->h = IMAGE_CROP_SIZE;
        v->n_tokens = IMAGE_CROP_TOKENS;
        if (!(v->rgb = malloc((size_t)IMAGE_CROP_SIZE * IMAGE_CROP_SIZE * 3)) ||
            crop_view(crop_src, p.cw, p.ch, x0, y0, p.window, v->rgb, IMAGE_CROP_SIZE) < 0)
            goto oom;
        ret->tokens[t++] = ids->patch_start;
        for (uint32_t k = 0; k < IMAGE_CROP_TOKENS; k++)
            ret->tokens[t++] = ids->im_patch;
        ret->tokens[t++] = ids->patch_end;
        if ((i + 1) % p.nx == 0 && i + 1 < ret->n_crops)
            ret->tokens[t++] = ids->patch_newline;
    }
    struct image_view *g = &ret->views[ret->n_crops];
    g->w = g->h = IMAGE_GLOBAL_SIZE;
    g->n_tokens = IMAGE_GLOBAL_TOKENS;
    g->is_global = 1;
    if (!(g->rgb = malloc((size_t)IMAGE_GLOBAL_SIZE * IMAGE_GLOBAL_SIZE * 3)) ||
        image_resize(cur, w, h, g->rgb, IMAGE_GLOBAL_SIZE, IMAGE_GLOBAL_SIZE, 0) < 0)
        goto oom;
    ret->tokens[t++] = ids->im_start;
    for (uint32_t k = 0; k < IMAGE_GLOBAL_TOKENS; k++)
        ret->tokens[t++] = ids->im_patch;
    ret->tokens[t++] = ids->im_end;
    BUG_ON(t != ret->n_tokens);
    goto out;
oom:
    r = err_set(e, -ENOMEM, "out of memory preprocessing a %ux%u image", img->w, img->h);
    image_prep_done(ret);
out:
    free(padded);
    free(pre);
    free(forcrop);
    return r;
}

void image_prep_done(struct image_prep *p)
{
    if (!p)
        return;
    if (p->views)
        for (uint32_t i = 0; i < p->n_views; i++)
            free(p->views[i].rgb);
    free(p->views);
    free(p->tokens);
    p->views = NULL;
    p->tokens = NULL;
    p->n_views = 0;
    p->n_tokens = 0;
}
