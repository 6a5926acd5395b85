/* image-dump - decode and preprocess one image file with common/image (test/unit/test_image.py
 * compares the result with tools/reference/image_ref.py).
 *   image-dump FILE OUT [MAX_BYTES MAX_SIDE MAX_PIXELS]
 * writes OUT.json (format, size, hash, grid, tokens, views), OUT.decoded.rgb and
 * OUT.view<i>.rgb; on a refused image prints "refused <errno name>: <reason>" and exits 2.
 * Token ids are the test's own: im_start 1, im_end 2, patch_start 3, patch_end 4,
 * patch_newline 5, im_patch 6. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image.h"

static int write_raw(const char *out, const char *suffix, const uint8_t *p, size_t n)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s%s", out, suffix);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n) {
        perror(path);
        if (f)
            fclose(f);
        return -1;
    }
    return fclose(f);
}

int main(int argc, char **argv)
{
    struct image_limits lim;
    struct image img;
    struct image_prep prep;
    struct err_buf e = { "" };
    const struct image_token_ids ids = { 1, 2, 3, 4, 5, 6 };
    char path[4096];
    FILE *f;
    int r;

    if (argc != 3 && argc != 6) {
        fprintf(stderr, "usage: image-dump FILE OUT [MAX_BYTES MAX_SIDE MAX_PIXELS]\n");
        return 1;
    }
    image_limits_default(&lim);
    if (argc == 6) {
        lim.max_bytes = strtoull(argv[3], NULL, 10);
        lim.max_side = (uint32_t)strtoul(argv[4], NULL, 10);
        lim.max_pixels = strtoull(argv[5], NULL, 10);
    }
    f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    size_t cap = 1 << 16, n = 0;
    uint8_t *data = malloc(cap);
    for (size_t k; data && (k = fread(data + n, 1, cap - n, f)) > 0;) {
        n += k;
        if (n == cap)
            data = realloc(data, cap *= 2);
    }
    fclose(f);
    if (!data)
        return 1;
    if ((r = image_decode(data, n, &lim, &img, &e)) < 0) {
        printf("refused %s: %s\n", strerrorname_np(-r), e.msg);
        free(data);
        return 2;
    }
    free(data);
    if (image_prep(&img, &ids, &prep, &e) < 0) {
        fprintf(stderr, "image-dump: %s\n", e.msg);
        return 1;
    }
    write_raw(argv[2], ".decoded.rgb", img.rgb, (size_t)img.w * img.h * 3);
    snprintf(path, sizeof(path), "%s.json", argv[2]);
    f = fopen(path, "w");
    fprintf(f, "{\"format\": \"%s\", \"w\": %u, \"h\": %u, \"hash\": \"", image_format_name(img.format), img.w, img.h);
    for (int i = 0; i < SHA256_BYTES; i++)
        fprintf(f, "%02x", prep.hash[i]);
    fprintf(f, "\", \"window\": %u, \"crops_x\": %u, \"crops_y\": %u, \"n_token_count\": %zu, \"tokens\": [",
            prep.window, prep.crops_x, prep.crops_y, image_token_count(img.w, img.h));
    for (size_t i = 0; i < prep.n_tokens; i++)
        fprintf(f, "%s%d", i ? ", " : "", prep.tokens[i]);
    fprintf(f, "], \"views\": [");
    for (uint32_t i = 0; i < prep.n_views; i++) {
        struct image_view *v = &prep.views[i];
        fprintf(f, "%s{\"w\": %u, \"h\": %u, \"tokens\": %u, \"global\": %d}", i ? ", " : "", v->w, v->h,
                v->n_tokens, v->is_global);
        char suffix[64];
        snprintf(suffix, sizeof(suffix), ".view%u.rgb", i);
        write_raw(argv[2], suffix, v->rgb, (size_t)v->w * v->h * 3);
    }
    fprintf(f, "]}\n");
    fclose(f);
    image_prep_done(&prep);
    image_done(&img);
    return 0;
}
