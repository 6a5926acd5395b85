/* media.h - images in on the doors (issue 40): OpenAI chat image_url parts, the operator's
 * limits (--limit-mm-per-prompt, --allowed-media-domains, --image-max-*), and the gRPC
 * GenerateRequest's images.
 *
 * Every image part is checked, decoded (common/image) and preprocessed into the request
 * (request->images) before the request goes anywhere; each bad part is a 400 naming
 * messages[i].content[k] and the reason.  A request whose images are all good is still refused
 * when nothing can encode them: "model has no vision tower" when the tokenizer lacks the image
 * tokens, "no worker group serves images" while no ready group's engine reports that it
 * encodes them (wpool_serves_images) — an image is never dropped silently.  The gRPC door's
 * GenerateRequest.images carry encoded images (ImageInput.data), taken the same way; the
 * client places each by a MEDIA_IMAGE_PLACEHOLDER in its text or chat messages.
 *
 * Fetching (media-fetch.c): an http(s) image URL is fetched only when its host is one of
 * --allowed-media-domains (the exact host name, case-insensitive: a subdomain is another
 * host, as in vLLM).  Before the chat door parses a request, media_fetch_start fetches its
 * allowed URLs with libcurl on libuv's threadpool (uv_queue_work; the loop never waits), one
 * after another, each within --media-fetch-timeout (redirects included) and --image-max-bytes
 * (refused from Content-Length, else aborted as the body passes it); a redirect is not
 * followed by libcurl but checked like the first URL (http(s), allowed host) and followed
 * here, at most 5 times.  The done callback runs on the loop; the request's parse then takes
 * each part's bytes (media_fetched) or its failure, a 400 naming the part.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>
#include <uv.h>

#include "image.h"

struct request;
struct tokenizer;
struct Stepd__V1__GenerateRequest;

/* How the chat door renders an image part into the prompt text; tokenized, it is the
 * model's <im_patch> token, which media_prompt_expand replaces by the image's layout. */
#define MEDIA_IMAGE_PLACEHOLDER "<im_patch>"

struct media_config {
    int64_t limit_image;            /* images per prompt; 0 = text only */
    unsigned fetch_timeout_ms;      /* an http(s) image URL's fetch, redirects included */
    char **allowed_domains;         /* http(s) image hosts allowed (none by default) */
    size_t n_allowed_domains;
    struct image_limits lim;        /* per image */
};

#define MEDIA_DEFAULT_LIMIT_IMAGE 16
#define MEDIA_DEFAULT_FETCH_TIMEOUT_MS 10000u

/* The process's configuration (main.c's flags fill it before the doors open). */
extern struct media_config media_conf;

/* --limit-mm-per-prompt JSON ('{"image": N}'; other modalities must be 0): 0 or -EINVAL + msg. */
int media_limit_mm_parse(const char *json, char *msg, size_t len);
/* --allowed-media-domains: one or more host names, separated by commas or spaces; adds them. */
int media_allowed_domains_add(const char *list, char *msg, size_t len);
void media_config_done(void);

/* The image token ids of tok: 0, or -ENOENT naming the missing token in msg. */
int media_token_ids(const struct tokenizer *tok, struct image_token_ids *ret, char *msg, size_t len);

/* The http(s) image URLs of a request, fetched (media-fetch.c). */
struct media_fetch;
typedef void (*media_fetch_fn)(struct media_fetch *f, void *ud);
/* Whether url is an http(s) URL whose host is one of --allowed-media-domains (or of
 * domains[0..n)); its host (or "") in host[0..len) when len > 0. */
bool media_url_host_allowed(const char *url, char *host, size_t len);
bool media_url_host_in(const char *url, const char *const *domains, size_t n_domains, char *host, size_t len);
/* Fetch the allowed http(s) image URLs of messages: 0 (none: parse at once), 1 (*ret started:
 * done(*ret, ud) runs on loop when all are fetched, or the first failed, or after
 * media_fetch_cancel), or -ENOMEM.  The caller frees *ret (media_fetch_free) after done. */
int media_fetch_start(uv_loop_t *loop, const json_t *messages, media_fetch_fn done, void *ud,
                      struct media_fetch **ret);
/* The client went away: the fetch stops soon (done still runs).  Loop thread. */
void media_fetch_cancel(struct media_fetch *f);
void media_fetch_free(struct media_fetch *f);
/* messages[msg].content[part]'s fetch: 0 with its bytes (*err NULL) or *err the reason it
 * failed; -ENOENT when it was not fetched. */
int media_fetched(const struct media_fetch *f, size_t msg, size_t part, const void **data, size_t *n,
                  const char **err);
/* libcurl's global state, at exit (after the loop's last fetch). */
void media_fetch_global_done(void);

/* The image_url parts of an OpenAI messages array: each checked, decoded and preprocessed
 * into in->images; http(s) URLs of allowed hosts from fetched (media_fetch_start's, NULL:
 * none).  0 (no image or all taken), -EINVAL with msg naming the part and the reason, or
 * -ENOMEM. */
int media_chat_images(const json_t *messages, const struct tokenizer *tok, bool served,
                      const struct media_fetch *fetched, struct request *in, char *msg, size_t len);
/* The gRPC door's GenerateRequest.images (encoded bytes in ImageInput.data), each checked,
 * decoded and preprocessed into in->images as media_chat_images does.  0, -EINVAL with msg
 * naming images[i] and the reason (the engine wire's fields set, token_ids input, ...), or
 * -ENOMEM. */
int media_proto_images(const struct Stepd__V1__GenerateRequest *pb, const struct tokenizer *tok, bool served,
                       struct request *in, char *msg, size_t len);
/* A prompt text tokenized with flags (tok_encode's); with in's images each
 * MEDIA_IMAGE_PLACEHOLDER in it becomes the <im_patch> token while every other special token
 * stays plain text.  0, or tok_encode's error (with e). */
struct tok_ids;
struct err_buf;
int media_text_encode(const struct request *in, const struct tokenizer *tok, const char *text, unsigned flags,
                      struct tok_ids *out, struct err_buf *e);
/* The tokenized prompt with each image's MEDIA_IMAGE_PLACEHOLDER token replaced
 * by the image's token layout, in order; *ret_pos (malloc, one per image): where each layout
 * starts.  0 (no images: nothing changes), -EINVAL with msg when the placeholders do not
 * match the images one to one (naming the first image without one on the gRPC door), or
 * -ENOMEM. */
int media_prompt_expand(const struct request *in, const struct tokenizer *tok, int32_t **prompt, size_t *n,
                        uint32_t **ret_pos, char *msg, size_t len);
/* Free a request's images (request_free calls it). */
void media_images_free(struct request *in);
