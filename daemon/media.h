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
 * Off the loop (media-fetch.c): before a door parses a request, media_fetch_start takes its
 * image_url parts (data URLs, and http(s) URLs whose host is one of --allowed-media-domains:
 * the exact host name, case-insensitive, a subdomain is another host, as in vLLM) to libuv's
 * threadpool (uv_queue_work; the loop never waits): one job per request, its parts one after
 * another, each fetched (URLs: libcurl, within --media-fetch-timeout, redirects included, and
 * --image-max-bytes, refused from Content-Length, else aborted as the body passes it; a
 * redirect is not followed by libcurl but checked like the first URL and followed here, at
 * most 5 times), base64-decoded (data URLs), decoded and preprocessed (image_decode,
 * image_prep); the first failure ends the job.  At most MEDIA_MAX_JOBS jobs are queued or
 * running at once (the threadpool, UV_THREADPOOL_SIZE threads, 4 by default, is shared with
 * other work); one more is refused (-EBUSY: the door answers 503, retry later) rather than
 * queued without bound.  The done callback runs on the loop; the request's parse then takes
 * each part's prepared image (media_taken) or its failure, a 400 naming the part.  A client
 * that goes away meanwhile cancels the job (media_fetch_cancel: no later part starts, a fetch
 * aborts); done still runs and frees what was prepared.
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

/* A request's images fetched, decoded and preprocessed off the loop (media-fetch.c). */
struct media_fetch;
typedef void (*media_fetch_fn)(struct media_fetch *f, void *ud);
#define MEDIA_MAX_JOBS 64
/* The test-only decode gate: with this variable naming a FIFO, each image decode first reads
 * one byte from it (blocking until a test writes it), so a test holds a decode deterministically.
 * Read once per process, at its first decode: set it before starting the process. */
#define MEDIA_TEST_DECODE_GATE_ENV "STEPD_TEST_DECODE_GATE"
/* Whether url is an http(s) URL whose host is one of --allowed-media-domains (or of
 * domains[0..n)); its host (or "") in host[0..len) when len > 0. */
bool media_url_host_allowed(const char *url, char *host, size_t len);
bool media_url_host_in(const char *url, const char *const *domains, size_t n_domains, char *host, size_t len);
/* Take the image_url parts of messages off the loop (see "Off the loop"), preprocessed with
 * tok's image tokens (none: decoded only): 0 (none: parse at once), 1 (*ret started: done(*ret,
 * ud) runs on loop when all are prepared, or the first failed, or after media_fetch_cancel),
 * -EBUSY (MEDIA_MAX_JOBS running) or -ENOMEM.  The caller frees *ret (media_fetch_free) after
 * done. */
int media_fetch_start(uv_loop_t *loop, const json_t *messages, const struct tokenizer *tok, media_fetch_fn done,
                      void *ud, struct media_fetch **ret);
/* The same for a GenerateRequest's images (ImageInput.data, read in place: pb must live until
 * done has run), taken by media_proto_images as messages[0].content[i]. */
int media_proto_start(uv_loop_t *loop, const struct Stepd__V1__GenerateRequest *pb, const struct tokenizer *tok,
                      media_fetch_fn done, void *ud, struct media_fetch **ret);
/* The client went away: the job stops soon (done still runs).  Loop thread. */
void media_fetch_cancel(struct media_fetch *f);
void media_fetch_free(struct media_fetch *f);
/* messages[msg].content[part]'s result, moved out (once): 0 with *err NULL and *ret the
 * prepared image when *prepped (the tokenizer had the image tokens), or *err the reason it
 * failed; -ENOMEM; -ENOENT when the job did not take it. */
int media_taken(struct media_fetch *f, size_t msg, size_t part, struct image_prep *ret, bool *prepped,
                const char **err);
/* media_fetch_start's error r (-EBUSY, -ENOMEM) as a one-sentence answer in msg. */
void media_start_error(int r, char *msg, size_t len);
/* Jobs queued or running (loop thread). */
unsigned media_jobs_running(void);
/* A well-formed data URL's base64 payload (within --image-max-bytes), or NULL (with msg naming
 * at, the _at form). */
const char *media_data_url_payload(const char *url);
const char *media_data_url_payload_at(const char *url, const char *at, char *msg, size_t len);
/* Base64 p decoded into *ret (gnutls_free), *n bytes: 0, -ENOMEM, or -EINVAL with err. */
int media_base64_decode(const char *p, void **ret, size_t *n, char *err, size_t len);
/* An encoded image decoded (within lim) and, with ids, preprocessed into *ret (*prepped):
 * 0, -ENOMEM, or another negative errno with e's reason.  Any thread. */
struct err_buf;
int media_image_prepare(const void *data, size_t n, const struct image_limits *lim,
                        const struct image_token_ids *ids, struct image_prep *ret, bool *prepped, struct err_buf *e);
/* libcurl's global state, at exit (after the loop's last fetch). */
void media_fetch_global_done(void);

/* The image_url parts of an OpenAI messages array: each checked, decoded and preprocessed
 * into in->images, taken from fetched where its job prepared them (media_fetch_start's, NULL:
 * none; data URLs are then decoded here, http(s) URLs refused).  0 (no image or all taken), -EINVAL with msg naming the part and the reason, or
 * -ENOMEM. */
int media_chat_images(const json_t *messages, const struct tokenizer *tok, bool served,
                      struct media_fetch *fetched, struct request *in, char *msg, size_t len);
/* The gRPC door's GenerateRequest.images (encoded bytes in ImageInput.data), each checked,
 * decoded and preprocessed into in->images as media_chat_images does (taken from fetched,
 * media_proto_start's, where its job prepared them).  0, -EINVAL with msg
 * naming images[i] and the reason (the engine wire's fields set, token_ids input, ...), or
 * -ENOMEM. */
int media_proto_images(const struct Stepd__V1__GenerateRequest *pb, const struct tokenizer *tok, bool served,
                       struct media_fetch *fetched, struct request *in, char *msg, size_t len);
/* A prompt text tokenized with flags (tok_encode's); with in's images each
 * MEDIA_IMAGE_PLACEHOLDER in it becomes the <im_patch> token while every other special token
 * stays plain text.  0, or tok_encode's error (with e). */
struct tok_ids;
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
