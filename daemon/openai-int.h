/* openai-int.h - what the OpenAI door's files share: the request's parse (openai-parse.c),
 * its rendering (openai-render.c) and the routes that join them (openai-routes.c).
 * Loop thread only. */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

struct coord;
struct http_req;
struct media_fetch;
struct request;

/* What a chat or text completion asks of its answer, besides the request itself. */
struct oai_opts {
    bool stream, include_usage, continuous_usage, logprobs, return_ids;
    int64_t n;
    const char *model;
    struct media_fetch *fetched;        /* the request's images prepared off the loop (media.h), or NULL */
};

/* Text completions' field names (struct request's names table, [_RN_MAX]); chat
 * completions' are names_chat (openai.h). */
extern const char *const names_completion[];

/* The body's fields (OpenAI's, vLLM's extensions, stepd's) onto in and x (chat: the chat
 * completions' fields).  0, -ENOMEM, or -EINVAL naming the field in msg. */
int openai_body_conv(const struct coord *co, const json_t *body, bool chat, struct request *in, struct oai_opts *x,
                     char *msg, size_t len);
/* A field: absent or null is unset (0); 1 with the value; -EINVAL naming the field. */
int openai_get_bool(const json_t *o, const char *key, bool *v, char *msg, size_t len);
int openai_get_str(const json_t *o, const char *key, const char **v, char *msg, size_t len);
/* Chat messages as the chat template takes them (*ret: new).  0, -ENOMEM or -EINVAL. */
int openai_messages_conv(const json_t *ms, bool images, json_t **ret, char *msg, size_t len);
/* An array of token ids (at most max) named key.  0, -ENOMEM or -EINVAL. */
int openai_ids_conv(const json_t *a, const char *key, int32_t **ret, size_t *n, size_t max, char *msg, size_t len);

/* Serve in for hr as x asks, the answer rendered as a chat (chat) or text completion: in is
 * the reply's from here (reply.h).  0, or -ENOMEM with in still the caller's. */
int openai_reply_start(struct coord *co, struct http_req *hr, struct request *in, const struct oai_opts *x,
                       bool chat);
