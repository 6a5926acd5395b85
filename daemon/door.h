/* door.h - what the agent-harness doors (OpenAI Responses: responses.c, Anthropic Messages:
 * messages.c) share: one generation behind one HTTP answer, its output as a list of items.
 *
 * A door parses its body into a struct request (chat input, the door's field names) and
 * hands it to door_submit(), which serves it through the generation's life shared with
 * chat completions (reply.h: req_submit(), the same prompt, the same reasoning and
 * tool-call parsers, the same cancellation and deadline).  The Chunks
 * of the text pipeline become items in the order they come: a reasoning item, a text item,
 * one item per tool call (a new item whenever the kind changes).  Streamed and whole answers
 * are rendered from the same items by the door's ops: item_open / item_delta / item_close
 * as they grow (streaming), whole at the end; so a streamed answer carries exactly what the
 * whole one does.
 *
 * Lifetime of a door_gen: its reply's (reply.h), which frees it.  Loop thread only.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>
#include "strbuf.h"

struct coord;
struct http_req;
struct reply;
struct request;

/* A door's field names (struct request's names table, [_RN_MAX]): chat completions' but the
 * prompt's, the reasoning effort's, the token limit's and the stop strings'.  names is
 * filled on the first call. */
const char *const *door_names(const char **names, const char *prompt, const char *effort, const char *max_tokens,
                              const char *stop);

enum door_item_kind {
    DOOR_REASONING,
    DOOR_TEXT,
    DOOR_CALL,
};

struct door_item {
    enum door_item_kind kind;
    struct strbuf text;             /* the reasoning, the text, or the call's arguments (JSON) */
    char call_id[40];               /* DOOR_CALL: the pipeline's "call_..." id */
    char *name;                     /* DOOR_CALL: the function */
    uint32_t tool_index;            /* DOOR_CALL: the pipeline's index of the call */
};

/* How the request ended (the Final). */
enum door_finish {
    DOOR_FINISH_STOP,               /* end of turn, or a stop string (stop_str) */
    DOOR_FINISH_LENGTH,             /* the token limit */
    DOOR_FINISH_OTHER,              /* aborted, error */
};

struct door_gen;

struct door_ops {
    /* streaming: the events, appended to b */
    void (*begin)(struct door_gen *g, struct strbuf *b);
    void (*item_open)(struct door_gen *g, size_t i, struct strbuf *b);
    void (*item_delta)(struct door_gen *g, size_t i, const char *s, size_t n, struct strbuf *b);
    void (*item_close)(struct door_gen *g, size_t i, struct strbuf *b);
    void (*end)(struct door_gen *g, struct strbuf *b);          /* after the Final */
    void (*fail_event)(struct door_gen *g, struct strbuf *b);   /* a failure after the start */
    /* the whole answer (not streaming); NULL: out of memory */
    json_t *(*whole)(struct door_gen *g);
    /* an error answer in the door's shape (rpc: enum rpc_status) */
    void (*error)(struct http_req *hr, int rpc, const char *msg);
    /* the request completed (Final, answer given): the door's own bookkeeping */
    void (*completed)(struct door_gen *g);
    /* the door's ud is let go */
    void (*free_ud)(void *ud);
};

struct door_gen {
    struct reply *rp;               /* the generation's life (reply.h): co, id, model, created,
                                     * stream, failed, fail_status, fail_msg */
    const struct door_ops *ops;
    void *ud;                       /* the door's */
    bool open;                      /* streaming: the last item is open */
    struct door_item *items;
    size_t n_items;
    uint64_t seq;                   /* the door's event counter */
    enum door_finish finish;
    char *stop_str;
    uint32_t prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens;
};

/* Serve `in` (owned from here, also on failure) for hr: stream or not, the answer id
 * (id_prefix + the request id), the door's ops and ud (ud is the door's until free_ud). */
void door_submit(struct coord *co, struct http_req *hr, struct request *in, bool stream, const char *id_prefix,
                 const struct door_ops *ops, void *ud);

/* A request held while its images are fetched, decoded and preprocessed off the loop
 * (media_fetch_start; the chat and completions door, /tokenize, door_serve): once they are,
 * on the loop, resume(h, f) when the client is still there (hr; f: the prepared images for
 * the parse), else drop(h) (the client went away, which cancelled the job); then h is freed
 * (free(h): it heads its container's allocation, whose fields resume and drop let go). */
struct media_fetch;
struct door_hold {
    struct coord *co;
    struct http_req *hr;            /* NULL: the client went away */
    void (*resume)(struct door_hold *h, struct media_fetch *f);
    void (*drop)(struct door_hold *h);
    struct media_fetch *f;          /* the job, from door_hold_start until resume or drop returns */
};

/* Start h's job on an OpenAI messages array (h->co, hr, resume, drop set): 0 (no image to
 * prepare: nothing held, parse now), 1 (held: resume or drop will run), or -EBUSY / -ENOMEM
 * with the answer in msg. */
int door_hold_start(struct door_hold *h, const json_t *messages, char *msg, size_t len);

/* A request whose images are being prepared (door_serve; door.c). */
struct door_fetch;

/* What a door's parser fills in from the body: in's fields (door_common_fields among them)
 * and the door's own (arg), its images taken by door_images_take with fx (door_serve's).
 * 0, -ENOMEM, -EINVAL or -ENOENT (a thing named is not there), the reason in msg naming the
 * field, -EBUSY (too many requests' images being prepared: RPC_UNAVAILABLE), or -EINPROGRESS
 * from door_images_take (the parse stops: it runs again once the images are prepared). */
typedef int (*door_conv_fn)(struct coord *co, const json_t *body, struct request *in, void *arg,
                            struct door_fetch *fx, char *msg, size_t len);

/* How a door serves a request (door_serve): a fresh ud (ud_new) for each parse, conv
 * filling in it and the request, ready taking both (owned from there), ud_free letting an
 * unused one go; error answers in the door's shape. */
struct door_serve {
    door_conv_fn conv;
    void *(*ud_new)(void);
    void (*ud_free)(void *ud);
    void (*ready)(struct coord *co, struct http_req *hr, struct request *in, void *ud);
    void (*error)(struct http_req *hr, int rpc, const char *msg);
};

/* The request of hr's body (field names: names), converted by s->conv and its model
 * checked, then served by s->ready; or refused: counted, logged and answered through
 * s->error (RPC_INVALID_ARGUMENT, RPC_NOT_FOUND for -ENOENT and a model not served,
 * RPC_INTERNAL, RPC_UNAVAILABLE for -EBUSY).  As the chat door does, a request with images
 * (data URLs, http(s) URLs of --allowed-media-domains) is parsed until its images are
 * (door_images_take starts door_hold_start on them), held while they are fetched, decoded and
 * preprocessed off the loop (the client going away cancels the job: nothing is served,
 * nothing leaks), and parsed again when they are, with a fresh request and ud and the
 * prepared images (the parse is deterministic: the same images in the same order).  s lives as long as the program. */
void door_serve(struct coord *co, struct http_req *hr, const char *const *names, const struct door_serve *s);

/* A request's tools (the door's, converted) with tool_choice, checked alike on both doors:
 * a named tool must be one of them, required/named need tools and the tool-call parser.
 * field: the door's name of its tool choice.  0 or -EINVAL with msg. */
int door_tool_choice_check(const struct coord *co, struct request *in, const char *field, char *msg, size_t len);

/* The body's fields are all known (known: NULL-terminated lists, any of them): 0, or
 * -EINVAL naming the first that is not. */
int door_fields_known(const json_t *body, const char *const *const *known, char *msg, size_t len);

/* The fields both doors share alike onto in: "model" (required), "temperature", "top_p",
 * "stream" (into *stream).  0, -ENOMEM or -EINVAL naming the field. */
int door_common_fields(const json_t *body, struct request *in, bool *stream, char *msg, size_t len);

/* A door's images, gathered in prompt order for media_chat_images (media.h), which checks,
 * decodes and preprocesses them as the chat door's image_url parts: parts holds one chat
 * message per image, {"role": "user", "content": [{"type": "image_url", "image_url": ...}]};
 * at the door's name of each image part ("input[0].content[2]", "messages.0.content.1").
 * url_field, detail_field: the door's names of an image's URL and detail under its part
 * (".image_url", ".source.url"; ".detail"), for the messages about image_url.url and
 * image_url.detail. */
struct door_images {
    json_t *parts;
    char **at;
    size_t n;
    const char *url_field, *detail_field;
};

/* One image part (image_url, an OpenAI image_url object: stolen) named at.  0 or -ENOMEM. */
int door_image_add(struct door_images *im, const char *at, json_t *image_url);
/* Each of im's images checked, decoded and preprocessed into in->images (media_chat_images),
 * its errors naming the door's part ("field" for the request's images together).  With fx
 * (door_serve's) they are prepared off the loop: on the first parse the job is started
 * (-EINPROGRESS), on the second the prepared images are taken; without fx data URLs are
 * decoded here and an http(s) URL is refused.  0, -EINPROGRESS, -EBUSY or -EINVAL with msg,
 * or -ENOMEM. */
int door_images_take(struct coord *co, const struct door_images *im, struct door_fetch *fx, const char *field,
                     struct request *in, char *msg, size_t len);
void door_images_done(struct door_images *im);

/* How a door's content parts read (door_parts_text): text_types carry "text"; image_type
 * (NULL: none) is the door's image part, turned by image into an OpenAI image_url object
 * (0, or -EINVAL with msg naming at); media_types are refused as unsupported. */
struct door_parts {
    bool dotted;                    /* parts named path.k (Anthropic's style), else path[k] */
    const char *const *text_types;
    const char *const *media_types;
    const char *image_type;
    int (*image)(const json_t *part, const char *at, json_t **image_url, char *msg, size_t len);
    const char *image_where;        /* where images are taken, for the refusal elsewhere */
};

/* A message's content onto b: a string, or an array of parts: text parts joined by "\n", and
 * with im each image part as MEDIA_IMAGE_PLACEHOLDER where it stands (no separator on either
 * side, as the chat door renders an image_url part) and added to im; without im an image
 * part is refused (not taken here: p->image_where says where).  0, -ENOMEM or -EINVAL naming
 * the part. */
int door_parts_text(const json_t *c, const char *path, const struct door_parts *p, struct door_images *im,
                    struct strbuf *b, char *msg, size_t len);

/* One server-sent event onto b: "event: TYPE", data o (stolen) with "type": TYPE added. */
void door_event(struct strbuf *b, const char *type, json_t *o);

/* An item's arguments as a JSON object (DOOR_CALL): parsed, or {} when empty. */
json_t *door_call_args(const struct door_item *it);
