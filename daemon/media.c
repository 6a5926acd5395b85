/* media.c - images in on the doors; see media.h. */
#include "media.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <gnutls/gnutls.h>

#include "request.h"
#include "stepd.pb-c.h"
#include "tokenizer.h"

struct media_config media_conf = {
    .limit_image = MEDIA_DEFAULT_LIMIT_IMAGE,
    .fetch_timeout_ms = MEDIA_DEFAULT_FETCH_TIMEOUT_MS,
    .lim = { IMAGE_DEFAULT_MAX_BYTES, IMAGE_DEFAULT_MAX_SIDE, IMAGE_DEFAULT_MAX_PIXELS },
};

int media_limit_mm_parse(const char *s, char *msg, size_t len)
{
    json_error_t je;
    json_t *j = json_loads(s, 0, &je), *v;
    const char *k;
    int r = 0;

    if (!json_is_object(j)) {
        snprintf(msg, len, "expected a JSON object such as '{\"image\": 2}'");
        r = -EINVAL;
    } else {
        json_object_foreach(j, k, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0) {
                snprintf(msg, len, "%s: expected a count >= 0", k);
                r = -EINVAL;
            } else if (strcmp(k, "image") && json_integer_value(v) != 0) {
                snprintf(msg, len, "%s: stepd takes images only (audio, video and other media are not "
                         "supported); its limit must be 0", k);
                r = -EINVAL;
            }
            if (r)
                break;
        }
        if (!r && (v = json_object_get(j, "image")))
            media_conf.limit_image = json_integer_value(v);
    }
    json_decref(j);
    return r;
}

int media_allowed_domains_add(const char *list, char *msg, size_t len)
{
    const char *p = list;

    while (*p) {
        size_t n = strcspn(p, ", \t");
        if (n) {
            char **d = realloc(media_conf.allowed_domains, sizeof(char *) * (media_conf.n_allowed_domains + 1));
            if (!d)
                return -ENOMEM;
            media_conf.allowed_domains = d;
            for (size_t i = 0; i < n; i++)
                if (!isalnum((unsigned char)p[i]) && p[i] != '.' && p[i] != '-') {
                    snprintf(msg, len, "'%.*s' is not a host name", (int)n, p);
                    return -EINVAL;
                }
            if (!(d[media_conf.n_allowed_domains] = strndup(p, n)))
                return -ENOMEM;
            media_conf.n_allowed_domains++;
        }
        p += n;
        p += strspn(p, ", \t");
    }
    return 0;
}

void media_config_done(void)
{
    for (size_t i = 0; i < media_conf.n_allowed_domains; i++)
        free(media_conf.allowed_domains[i]);
    free(media_conf.allowed_domains);
    media_conf.allowed_domains = NULL;
    media_conf.n_allowed_domains = 0;
}

/* One image's result onto in->images (when prepared: ids were there). */
static int image_push(struct request *in, const struct image_prep *p)
{
    struct image_prep *n = realloc(in->images, sizeof(*n) * (in->n_images + 1));

    if (!n)
        return -ENOMEM;
    in->images = n;
    n[in->n_images++] = *p;
    return 0;
}

static int add_image(struct request *in, const void *data, size_t n, const struct image_token_ids *ids,
                     const char *at, char *msg, size_t len)
{
    struct image_prep p;
    struct err_buf e = { "" };
    bool prepped;
    int r = media_image_prepare(data, n, &media_conf.lim, ids, &p, &prepped, &e);

    if (r == -ENOMEM)
        return r;
    if (r < 0) {
        snprintf(msg, len, "%s: %s", at, e.msg);
        return -EINVAL;
    }
    if (prepped && (r = image_push(in, &p)) < 0)
        image_prep_done(&p);
    return r;
}

/* messages[mi].content[k] prepared off the loop (media_fetch_start): taken into in; -ENOENT
 * when it was not. */
static int take_prepared(struct request *in, struct media_fetch *fetched, size_t mi, size_t k, const char *at,
                         char *msg, size_t len)
{
    struct image_prep p;
    const char *err;
    bool prepped;
    int r = media_taken(fetched, mi, k, &p, &prepped, &err);

    if (r < 0)
        return r;
    if (err) {
        snprintf(msg, len, "%s: %s", at, err);
        return -EINVAL;
    }
    if (prepped && (r = image_push(in, &p)) < 0)
        image_prep_done(&p);
    return r;
}

/* an http(s) URL: fetched and prepared off the loop when its host is allowed, else a 400 */
static int http_url(const char *url, struct media_fetch *fetched, size_t mi, size_t k, struct request *in,
                    const char *at, char *msg, size_t len)
{
    char host[128];
    int r;

    if (!media_url_host_allowed(url, host, sizeof(host))) {
        snprintf(msg, len, "%s: the image URL's domain '%.100s' is not allowed (--allowed-media-domains%s)", at,
                 host, media_conf.n_allowed_domains ? "" : " allows none: send a data URL");
        return -EINVAL;
    }
    if ((r = take_prepared(in, fetched, mi, k, at, msg, len)) == -ENOENT) {
        /* media_fetch_start fetches every allowed part before the parse: a door that did not */
        snprintf(msg, len, "%s: this door does not fetch image URLs (send a data URL)", at);
        return -EINVAL;
    }
    return r;
}

/* one image_url part, messages[mi].content[k] */
static int image_part(const json_t *part, struct media_fetch *fetched, size_t mi, size_t k,
                      struct request *in, const struct image_token_ids *ids, const char *at, char *msg, size_t len)
{
    const json_t *iu = json_object_get(part, "image_url"), *u, *d;
    const char *url;
    int r;

    if (!json_is_object(iu) || !json_is_string(u = json_object_get(iu, "url"))) {
        snprintf(msg, len, "%s.image_url: must be an object {\"url\": \"data:image/...;base64,...\"}", at);
        return -EINVAL;
    }
    d = json_object_get(iu, "detail");
    if (d && !json_is_null(d) && (!json_is_string(d) || strcmp(json_string_value(d), "auto"))) {
        snprintf(msg, len, "%s.image_url.detail: only \"auto\" is supported (Step-3.7's processor has one "
                 "resolution policy: a 728x728 view plus 504x504 crops)", at);
        return -EINVAL;
    }
    url = json_string_value(u);
    if (!strncasecmp(url, "data:", 5)) {
        const char *p = media_data_url_payload_at(url, at, msg, len);
        void *bytes;
        size_t n;

        if (!p)
            return -EINVAL;
        /* decoded off the loop (media_fetch_start) when the door started that; else here */
        if ((r = take_prepared(in, fetched, mi, k, at, msg, len)) != -ENOENT)
            return r;
        if ((r = media_base64_decode(p, &bytes, &n, msg, len)) < 0) {
            if (r == -EINVAL) {
                char why[256];

                snprintf(why, sizeof(why), "%s", msg);
                snprintf(msg, len, "%s: %s", at, why);
            }
            return r;
        }
        r = add_image(in, bytes, n, ids, at, msg, len);
        gnutls_free(bytes);
        return r;
    }
    if (!strncasecmp(url, "http://", 7) || !strncasecmp(url, "https://", 8))
        return http_url(url, fetched, mi, k, in, at, msg, len);
    snprintf(msg, len, "%s.image_url.url: must be a data: URL (or an http(s) URL of an allowed domain)", at);
    return -EINVAL;
}

/* The n-th image of a prompt (1-based) against --limit-mm-per-prompt: 0 or -EINVAL naming at. */
static int image_count_check(size_t n, const char *at, char *msg, size_t len)
{
    if (n <= (size_t)media_conf.limit_image)
        return 0;
    if (media_conf.limit_image == 0)
        snprintf(msg, len, "%s: this server serves text only (--limit-mm-per-prompt '{\"image\": 0}')", at);
    else
        snprintf(msg, len, "%s: more than %lld images in one prompt (--limit-mm-per-prompt)", at,
                 (long long)media_conf.limit_image);
    return -EINVAL;
}

/* After n good images (field names where they came from): can anything encode them?  0 or
 * -EINVAL + msg ("the model has no vision tower" or "no worker group serves images"). */
static int images_servable(size_t n, const char *field, bool have_ids, const char *why, bool served, char *msg,
                           size_t len)
{
    if (n == 0)
        return 0;
    if (!have_ids) {
        snprintf(msg, len, "%s: %zu image(s): %s", field, n, why);
        return -EINVAL;
    }
    if (!served) {
        snprintf(msg, len, "%s: %zu image(s): no worker group serves images (a vision tower on its "
                 "rank 0)", field, n);
        return -EINVAL;
    }
    return 0;
}

int media_chat_images(const json_t *messages, const struct tokenizer *tok, bool served,
                      struct media_fetch *fetched, struct request *in, char *msg, size_t len)
{
    struct image_token_ids ids;
    const json_t *m, *part;
    size_t i, k, n = 0;
    char at[64], why[256] = "";
    bool have_ids;
    int r;

    if (!json_is_array(messages))
        return 0;
    have_ids = media_token_ids(tok, &ids, why, sizeof(why)) == 0;
    json_array_foreach(messages, i, m) {
        const json_t *c = json_object_get(m, "content"), *t;
        if (!json_is_array(c))
            continue;
        json_array_foreach(c, k, part) {
            if (!json_is_object(part) || !json_is_string(t = json_object_get(part, "type")) ||
                strcmp(json_string_value(t), "image_url"))
                continue;
            snprintf(at, sizeof(at), "messages[%zu].content[%zu]", i, k);
            if ((r = image_count_check(++n, at, msg, len)) < 0)
                return r;
            /* every part is checked even when none could be served: the client learns of a bad one */
            if ((r = image_part(part, fetched, i, k, in, have_ids ? &ids : NULL, at, msg, len)) < 0)
                return r;
        }
    }
    return images_servable(n, "messages", have_ids, why, served, msg, len);
}

int media_proto_images(const Stepd__V1__GenerateRequest *pb, const struct tokenizer *tok, bool served,
                       struct media_fetch *fetched, struct request *in, char *msg, size_t len)
{
    struct image_token_ids ids;
    char at[32], why[256] = "";
    bool have_ids;
    int r;

    if (pb->n_images == 0)
        return 0;
    if (pb->input_case == STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS) {
        snprintf(msg, len, "images: take text or chat input, whose %s placeholders place them (token_ids "
                 "input with images is the engine service's, preprocessed)", MEDIA_IMAGE_PLACEHOLDER);
        return -EINVAL;
    }
    have_ids = media_token_ids(tok, &ids, why, sizeof(why)) == 0;
    for (size_t i = 0; i < pb->n_images; i++) {
        const Stepd__V1__ImageInput *im = pb->images[i];

        snprintf(at, sizeof(at), "images[%zu]", i);
        if ((r = image_count_check(i + 1, at, msg, len)) < 0)
            return r;
        /* the engine wire's fields: the coordinator computes them, a client never sends them */
        if (im->sha256.len || im->n_views || im->n_token_ids || im->token_position) {
            snprintf(msg, len, "%s: sha256, views, token_ids and token_position are the coordinator's "
                     "wire to the engines; send the encoded image in data", at);
            return -EINVAL;
        }
        if ((r = take_prepared(in, fetched, 0, i, at, msg, len)) == -ENOENT)
            r = add_image(in, im->data.data, im->data.len, have_ids ? &ids : NULL, at, msg, len);
        if (r < 0)
            return r;
    }
    return images_servable(pb->n_images, "images", have_ids, why, served, msg, len);
}

void media_images_free(struct request *in)
{
    for (size_t i = 0; i < in->n_images; i++)
        image_prep_done(&in->images[i]);
    free(in->images);
    in->images = NULL;
    in->n_images = 0;
}

/* Append n ids to out (none: ids may be NULL). */
static int ids_append(struct tok_ids *out, const int32_t *ids, size_t n)
{
    if (n == 0)
        return 0;
    if (out->n + n > out->cap) {
        size_t cap = out->cap ? out->cap : 64;
        while (cap < out->n + n)
            cap *= 2;
        int32_t *p = realloc(out->ids, cap * sizeof(*p));
        if (!p)
            return -ENOMEM;
        out->ids = p;
        out->cap = cap;
    }
    memcpy(out->ids + out->n, ids, n * sizeof(*ids));
    out->n += n;
    return 0;
}

int media_text_encode(const struct request *in, const struct tokenizer *tok, const char *text, unsigned flags,
                      struct tok_ids *out, struct err_buf *e)
{
    const size_t n_mark = strlen(MEDIA_IMAGE_PLACEHOLDER);
    struct image_token_ids ids;
    const int32_t *t;
    size_t n_t;
    char why[256];
    int r;

    if (in->n_images == 0 || media_token_ids(tok, &ids, why, sizeof(why)) < 0)
        return tok_encode(tok, text, strlen(text), flags, out, e);
    /* as tok_encode(flags | TOK_ENCODE_SPECIAL) would split the placeholder out, but no other
     * special token: the rest of a prompt text stays plain text */
    n_t = tok_template_ids(tok, false, &t);
    if ((flags & TOK_ENCODE_ADD_SPECIAL) && (r = ids_append(out, t, n_t)) < 0)
        return err_set(e, r, "out of memory");
    for (const char *p = text;; p += n_mark) {
        const char *q = strstr(p, MEDIA_IMAGE_PLACEHOLDER);
        size_t n = q ? (size_t)(q - p) : strlen(p);

        if (n && (r = tok_encode(tok, p, n, flags & ~TOK_ENCODE_ADD_SPECIAL, out, e)) < 0)
            return r;
        if (!q)
            break;
        if ((r = ids_append(out, &ids.im_patch, 1)) < 0)
            return err_set(e, r, "out of memory");
        p = q;
    }
    n_t = tok_template_ids(tok, true, &t);
    if ((flags & TOK_ENCODE_ADD_SPECIAL) && (r = ids_append(out, t, n_t)) < 0)
        return err_set(e, r, "out of memory");
    return 0;
}

int media_prompt_expand(const struct request *in, const struct tokenizer *tok, int32_t **prompt, size_t *n,
                        uint32_t **ret_pos, char *msg, size_t len)
{
    struct image_token_ids ids;
    size_t n_marks = 0, n_out, k = 0, o = 0;
    int32_t *out;
    uint32_t *pos;
    int r;

    *ret_pos = NULL;
    if (in->n_images == 0)
        return 0;
    if ((r = media_token_ids(tok, &ids, msg, len)) < 0)
        return -EINVAL;
    n_out = *n;
    for (size_t i = 0; i < *n; i++)
        n_marks += (*prompt)[i] == ids.im_patch;
    if (n_marks != in->n_images) {
        const char *field = in->names[in->input == REQUEST_INPUT_TEXT ? RN_TEXT : RN_MESSAGES];

        if (in->names != request_names_grpc)
            snprintf(msg, len, "%s: the prompt holds %zu %s tokens for %zu image(s) (a text part may not "
                     "contain %s)", field, n_marks, MEDIA_IMAGE_PLACEHOLDER, in->n_images, MEDIA_IMAGE_PLACEHOLDER);
        else if (n_marks < in->n_images)    /* the gRPC door: the placeholders are the client's */
            snprintf(msg, len, "images[%zu]: no %s placeholder in %s places it (%zu placeholder(s) for %zu "
                     "image(s))", n_marks, MEDIA_IMAGE_PLACEHOLDER, field, n_marks, in->n_images);
        else
            snprintf(msg, len, "%s: %zu %s placeholders for %zu image(s) in images (one per image, in order)",
                     field, n_marks, MEDIA_IMAGE_PLACEHOLDER, in->n_images);
        return -EINVAL;
    }
    for (size_t i = 0; i < in->n_images; i++)
        n_out += in->images[i].n_tokens - 1;
    out = malloc(n_out * sizeof(*out));
    pos = malloc(in->n_images * sizeof(*pos));
    if (!out || !pos || n_out > UINT32_MAX) {
        free(out);
        free(pos);
        if (n_out > UINT32_MAX) {
            snprintf(msg, len, "messages: the prompt with its images has %zu tokens", n_out);
            return -EINVAL;
        }
        return -ENOMEM;
    }
    for (size_t i = 0; i < *n; i++) {
        if ((*prompt)[i] != ids.im_patch) {
            out[o++] = (*prompt)[i];
            continue;
        }
        pos[k] = (uint32_t)o;
        memcpy(out + o, in->images[k].tokens, in->images[k].n_tokens * sizeof(*out));
        o += in->images[k].n_tokens;
        k++;
    }
    free(*prompt);
    *prompt = out;
    *n = n_out;
    *ret_pos = pos;
    return 0;
}
