/* image.h - images in: decode PNG, JPEG, WebP and GIF (first frame) from memory with Debian's
 * libraries (libpng, libjpeg-turbo, libwebp, giflib), and cut a decoded image into the views and
 * the token layout of Step-3.7's image processor.
 *
 * Decoding checks the limits before any pixel is decoded: the encoded size first, then the
 * width, height and pixel count the header declares (a decompression bomb is refused from its
 * header).  Corrupt, truncated (libjpeg's "premature end" warnings included) and unsupported data
 * get a negative errno and one sentence in the err_buf:
 *   -E2BIG       over a limit (bytes, side, pixels)
 *   -ENOTSUP     not PNG/JPEG/WebP/GIF, or a variant stepd does not take (CMYK JPEG, animated WebP)
 *   -EBADMSG     corrupt or truncated data
 *   -ENOMEM      out of memory
 * The result is 8-bit RGB.  An RGBA source (PNG colour type 6, WebP with alpha) is composited
 * over white, as vLLM's loader does; grey+alpha and palette transparency are dropped (PIL's
 * convert("RGB")).
 *
 * Preprocessing (image_prep) follows the reference processor (vLLM's step3_vl.py processor,
 * which Step3p7ForConditionalGeneration inherits; transformers' Step3VisionProcessor):
 *   1. an image whose short side is < 32 with an aspect ratio > 4 is padded (black, at the
 *      bottom/right) to a square;
 *   2. a long side > 3024 is scaled down to 3024 (sizes truncated), PIL bilinear;
 *   3. the window size: long <= 728: the short side if long/short > 1.5, else no crops;
 *      long > 728: min(short, 504) if long/short > 4, else 504;
 *   4. with a window, the image is resized (PIL bilinear) so that each side is a multiple of
 *      the window (a side's window count rounds up when its fraction is > 0.2, down otherwise;
 *      a side shorter than the window is kept) and cut into a row-major grid of window x window
 *      crops (the last column/row pulled back inside; outside the image is black);
 *   5. the global view: the whole image resized to 728 x 728, each crop resized to 504 x 504,
 *      antialiased bilinear (a triangle filter widened by the scale factor, as PIL and
 *      torchvision's antialias=True compute it).
 * Views are returned in token order: the crops (row-major), then the global view.  Token layout
 * per image: for each crop <patch_start> 81 x <im_patch> <patch_end>, followed by
 * <patch_newline> after each full row of crops except the last; then <im_start>
 * 169 x <im_patch> <im_end>.  Normalisation, (x/255 - IMAGE_MEAN[c]) / IMAGE_STD[c], is the
 * encoder's first step; the views stay uint8.
 */
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "sha256.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IMAGE_GLOBAL_SIZE 728     /* the global view, pixels per side */
#define IMAGE_CROP_SIZE 504       /* a local crop, pixels per side */
#define IMAGE_GLOBAL_TOKENS 169   /* 728/14 = 52 patches, two stride-2 downsamplers: 13 x 13 */
#define IMAGE_CROP_TOKENS 81      /* 504/14 = 36 -> 9 x 9 */
#define IMAGE_PREP_MAX_SIDE 3024  /* longer sides are scaled down to this before cropping */

/* CLIP's normalisation constants, per RGB channel (the reference processor's mean/std) */
extern const float IMAGE_MEAN[3];
extern const float IMAGE_STD[3];

/* defaults of struct image_limits */
#define IMAGE_DEFAULT_MAX_BYTES (20u << 20)
#define IMAGE_DEFAULT_MAX_SIDE 16384u
#define IMAGE_DEFAULT_MAX_PIXELS 40000000ull

enum image_format { IMAGE_PNG, IMAGE_JPEG, IMAGE_WEBP, IMAGE_GIF, _IMAGE_FORMAT_MAX };

struct image_limits {
    size_t max_bytes;       /* encoded size */
    uint32_t max_side;      /* declared width and height */
    uint64_t max_pixels;    /* declared width x height */
};

struct image {
    enum image_format format;
    uint32_t w, h;
    uint8_t *rgb;           /* h rows of w RGB triplets */
    uint8_t hash[SHA256_BYTES];   /* SHA-256 of the encoded bytes */
};

/* The image token ids, read from the model's tokenizer/config (never built in). */
struct image_token_ids {
    int32_t im_start, im_end, patch_start, patch_end, patch_newline, im_patch;
};

struct image_view {
    uint32_t w, h;          /* IMAGE_CROP_SIZE or IMAGE_GLOBAL_SIZE, square */
    uint8_t *rgb;
    uint32_t n_tokens;      /* its <im_patch> count: IMAGE_CROP_TOKENS or IMAGE_GLOBAL_TOKENS */
    int is_global;
};

struct image_prep {
    uint8_t hash[SHA256_BYTES];
    uint32_t n_views;       /* n_crops + 1 */
    struct image_view *views;   /* token order: crops row-major, the global view last */
    uint32_t n_crops, crops_x, crops_y, window;   /* window: the crop size before resizing, 0: none */
    int32_t *tokens;        /* the image's token sequence */
    size_t n_tokens;
};

void image_limits_default(struct image_limits *l);
const char *image_format_name(enum image_format f);
/* The format from the magic bytes, or -ENOTSUP. */
int image_sniff(const void *data, size_t n);
/* Decode data[0..n) into *ret (image_done() frees it). */
int image_decode(const void *data, size_t n, const struct image_limits *lim, struct image *ret,
                 struct err_buf *e);
void image_done(struct image *img);

/* The crop grid the processor picks for a w x h image: *ret_window 0 when none. */
void image_crop_grid(uint32_t w, uint32_t h, uint32_t *ret_window, uint32_t *ret_x, uint32_t *ret_y);
/* The token count of a w x h image's layout. */
size_t image_token_count(uint32_t w, uint32_t h);
/* Views and tokens of img (image_prep_done() frees them). */
int image_prep(const struct image *img, const struct image_token_ids *ids, struct image_prep *ret,
               struct err_buf *e);
void image_prep_done(struct image_prep *p);

/* Antialiased resize of 8-bit RGB (exposed for the tests): round_mid rounds the horizontal
 * pass to 8 bits as PIL does; without it the intermediate stays float (torchvision). */
int image_resize(const uint8_t *src, uint32_t sw, uint32_t sh, uint8_t *dst, uint32_t dw, uint32_t dh,
                 int round_mid);

#ifdef __cplusplus
}
#endif
