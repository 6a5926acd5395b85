/* fuzz-image.c - libFuzzer target: the image decoders' entry (common/image, issue 40) and, for
 * small accepted images (both sides at most 128: a thin image is padded to the square of its
 * long side before cropping, so a 9 x 1023 one of 9207 pixels was preprocessed as 1023 x 1023,
 * 1.5 s under the sanitizers, past libFuzzer's 1-second limit: corpus/image/thin-9x1023.gif),
 * the preprocessing.  Limits are small so that a run explores headers and bitstreams rather
 * than spending its time in large allocations; an accepted image must satisfy the decoder's
 * contract (size within the limits, pixels present), its views and tokens the processor's. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "image.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const struct image_limits lim = { 1u << 20, 2048, 1u << 20 };
    const struct image_token_ids ids = { 1, 2, 3, 4, 5, 6 };
    struct image img;
    struct image_prep p;
    struct err_buf e;

    e.msg[0] = 0;
    if (image_decode(data, size, &lim, &img, &e) < 0) {
        BUG_ON(!e.msg[0]);
        BUG_ON(img.rgb);
        return 0;
    }
    BUG_ON(!img.rgb || !img.w || !img.h || img.w > lim.max_side || img.h > lim.max_side);
    BUG_ON((uint64_t)img.w * img.h > lim.max_pixels);
    volatile uint8_t sink = img.rgb[(size_t)img.w * img.h * 3 - 1];
    (void)sink;
    if (img.w <= 128 && img.h <= 128 && image_prep(&img, &ids, &p, &e) == 0) {
        BUG_ON(p.n_views != p.n_crops + 1 || p.n_tokens != image_token_count(img.w, img.h));
        BUG_ON(p.tokens[p.n_tokens - 1] != ids.im_end);
        image_prep_done(&p);
    }
    image_done(&img);
    return 0;
}
