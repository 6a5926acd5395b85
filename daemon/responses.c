/* responses.c - OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.
 *
 * The body becomes the same struct request as chat completions (chat input: instructions as
 * the system message, input items as messages, function tools as tools), served by door.c;
 * the output items are the door's (a reasoning item, a message, a function_call per call),
 * streamed as the Responses API's semantic events (response.created, ...output_item.added,
 * ...output_text.delta, ...completed) or answered whole.  Errors are OpenAI error objects
 * naming the field.
 *
 * Stored responses (store, previous_response_id): a bounded in-memory store of the last
 * --responses-store-size responses (oldest dropped first), each kept --responses-store-ttl
 * seconds; either at 0 turns the store off.  An entry keeps the conversation (its input
 * messages, instructions left out as the API has it, and its output as an assistant turn) and
 * the response object GET returns.  Loop thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "coord-int.h"
#include "door.h"
#include "doors.h"
#include "http.h"
#include "json.h"
#include "log.h"
#include "openai.h"
#include "reply.h"

/* The field names validation uses in its messages. */
static const char *const *names(void)
{
    static const char *t[_RN_MAX];

    return door_names(t, "input", "reasoning.effort", "max_output_tokens", "stop");
}

/* ------------------------------------------------------------------ the store */

struct resp_entry {
    struct resp_entry *prev, *next;     /* oldest first */
    char *id;
    int64_t expires_ms;
    json_t *conv;                       /* the conversation: messages (chat JSON) */
    json_t *images;                     /* its images in order (door_images' parts), or NULL */
    json_t *response;                   /* what GET answers */
};

struct resp_store {
    struct resp_entry *head, *tail;
    size_t n;
};

static void entry_free(struct resp_store *st, struct resp_entry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        st->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        st->tail = e->prev;
    st->n--;
    free(e->id);
    json_decref(e->conv);
    json_decref(e->images);
    json_decref(e->response);
    free(e);
}

static bool store_on(const struct coord *co)
{
    return co->o.responses_store_size && co->o.responses_store_ttl_s;
}

/* The entry of id at now (rpc_now_ms), expired ones dropped on the way. */
static struct resp_entry *store_find(struct coord *co, const char *id, int64_t now)
{
    struct resp_store *st = co->responses;

    while (st && st->head && st->head->expires_ms <= now)
        entry_free(st, st->head);
    for (struct resp_entry *e = st ? st->head : NULL; e; e = e->next)
        if (e->expires_ms > now && !strcmp(e->id, id))
            return e;
    return NULL;
}

static int store_put(struct coord *co, const char *id, json_t *conv, json_t *images, json_t *response, int64_t now)
{
    struct resp_store *st = co->responses;
    struct resp_entry *e;

    if (!st && !(st = co->responses = calloc(1, sizeof(*st))))
        return -ENOMEM;
    if (!(e = calloc(1, sizeof(*e))) || !(e->id = strdup(id))) {
        free(e);
        return -ENOMEM;
    }
    e->conv = json_incref(conv);
    e->images = json_incref(images);
    e->response = json_incref(response);
    e->expires_ms = now + (int64_t)co->o.responses_store_ttl_s * 1000;
    e->prev = st->tail;
    if (st->tail)
        st->tail->next = e;
    else
        st->head = e;
    st->tail = e;
    st->n++;
    while (st->n > co->o.responses_store_size)
        entry_free(st, st->head);
    return 0;
}

int responses_store_put(struct coord *co, const char *id, json_t *conv, json_t *response, int64_t now_ms)
{
    return store_on(co) ? store_put(co, id, conv, NULL, response, now_ms) : 0;
}

const json_t *responses_store_get(struct coord *co, const char *id, int64_t now_ms)
{
    struct resp_entry *e = store_find(co, id, now_ms);

    return e ? e->response : NULL;
}

void responses_store_free(struct coord *co)
{
    struct resp_store *st = co->responses;

    while (st && st->head)
        entry_free(st, st->head);
    free(st);
    co->responses = NULL;
}

/* ------------------------------------------------------------------ a request's door state */

struct resp_ud {
    json_t *req;                /* the request's echoed fields: the response object's base */
    json_t *msgs;               /* the request's messages (instructions first when given) */
    size_t skip;                /* 1 when msgs[0] is the instructions */
    struct door_images im;      /* the conversation's images (kept to be stored with it) */
    bool store, stream;
    char id[160];
};

static void resp_ud_free(void *p)
{
    struct resp_ud *u = p;

    if (!u)
        return;
    json_decref(u->req);
    json_decref(u->msgs);
    door_images_done(&u->im);
    free(u);
}

/* ------------------------------------------------------------------ rendering */

static void item_id(const struct door_gen *g, size_t i, char *buf, size_t n)
{
    static const char *const pre[] = { [DOOR_REASONING] = "rs", [DOOR_TEXT] = "msg", [DOOR_CALL] = "fc" };

    /* the request's id without its "resp_" */
    snprintf(buf, n, "%s_%s_%zu", pre[g->items[i].kind], g->rp->id + 5, i);
}

static json_t *content_part(const struct door_item *it, bool done)
{
    const char *t = done && it->text.p ? it->text.p : "";

    if (it->kind == DOOR_REASONING)
        return json_pack("{s:s, s:s}", "type", "reasoning_text", "text", t);
    return json_pack("{s:s, s:s, s:[], s:[]}", "type", "output_text", "text", t, "annotations", "logprobs");
}

/* Item i as the API has it (done: with all its text, status completed). */
static json_t *item_json(const struct door_gen *g, size_t i, bool done)
{
    const struct door_item *it = &g->items[i];
    const char *status = done ? "completed" : "in_progress";
    char id[200];

    item_id(g, i, id, sizeof(id));
    switch (it->kind) {
    case DOOR_REASONING:
        return json_pack("{s:s, s:s, s:[], s:o, s:s}", "type", "reasoning", "id", id, "summary", "content",
                         done ? json_pack("[o]", content_part(it, true)) : json_array(), "status", status);
    case DOOR_TEXT:
        return json_pack("{s:s, s:s, s:s, s:s, s:o}", "type", "message", "id", id, "status", status, "role",
                         "assistant", "content", done ? json_pack("[o]", content_part(it, true)) : json_array());
    case DOOR_CALL:
        return json_pack("{s:s, s:s, s:s, s:s, s:s, s:s}", "type", "function_call", "id", id, "call_id", it->call_id,
                         "name", it->name ? it->name : "", "arguments",
                         done ? (it->text.len ? it->text.p : "{}") : "", "status", status);
    }
    return NULL;
}

/* The response object (status: "in_progress", "completed", "incomplete", "failed"). */
static json_t *response_json(const struct door_gen *g, const char *status)
{
    const struct resp_ud *u = g->ud;
    json_t *o = json_deep_copy(u->req), *out = json_array();
    bool end = strcmp(status, "in_progress");

    for (size_t i = 0; end && !g->rp->failed && i < g->n_items; i++)
        json_array_append_new(out, item_json(g, i, true));
    json_object_set_new(o, "id", json_string(g->rp->id));
    json_object_set_new(o, "object", json_string("response"));
    json_object_set_new(o, "created_at", json_integer(g->rp->created));
    json_object_set_new(o, "status", json_string(status));
    json_object_set_new(o, "model", json_string(g->rp->model));
    json_object_set_new(o, "output", out);
    json_object_set_new(o, "incomplete_details", strcmp(status, "incomplete") ? json_null() :
                        json_pack("{s:s}", "reason", "max_output_tokens"));
    json_object_set_new(o, "error", !g->rp->failed ? json_null() :
                        json_pack("{s:s, s:s}", "code", http_status_of(g->rp->fail_status) >= 500 ? "server_error"
                                                                                               : "invalid_prompt",
                                  "message", g->rp->fail_msg));
    if (end && !g->rp->failed)
        json_object_set_new(o, "usage", json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}",
                                                  "input_tokens", (int)g->prompt_tokens, "input_tokens_details",
                                                  "cached_tokens", (int)g->cached_tokens, "output_tokens",
                                                  (int)g->completion_tokens, "output_tokens_details",
                                                  "reasoning_tokens", (int)g->reasoning_tokens, "total_tokens",
                                                  (int)(g->prompt_tokens + g->completion_tokens)));
    else
        json_object_set_new(o, "usage", json_null());
    return o;
}

static const char *final_status(const struct door_gen *g)
{
    return g->finish == DOOR_FINISH_LENGTH ? "incomplete" : "completed";
}

/* One event, numbered (o is stolen). */
static void event(struct door_gen *g, struct strbuf *b, const char *type, json_t *o)
{
    if (o)
        json_object_set_new(o, "sequence_number", json_integer((json_int_t)g->seq++));
    door_event(b, type, o);
}

static void r_begin(struct door_gen *g, struct strbuf *b)
{
    event(g, b, "response.created", json_pack("{s:o}", "response", response_json(g, "in_progress")));
    event(g, b, "response.in_progress", json_pack("{s:o}", "response", response_json(g, "in_progress")));
}

static void r_item_open(struct door_gen *g, size_t i, struct strbuf *b)
{
    char id[200];

    item_id(g, i, id, sizeof(id));
    event(g, b, "response.output_item.added", json_pack("{s:i, s:o}", "output_index", (int)i, "item",
                                                         item_json(g, i, false)));
    if (g->items[i].kind != DOOR_CALL)
        event(g, b, "response.content_part.added", json_pack("{s:s, s:i, s:i, s:o}", "item_id", id, "output_index",
                                                              (int)i, "content_index", 0, "part",
                                                              content_part(&g->items[i], false)));
}

static void r_item_delta(struct door_gen *g, size_t i, const char *s, size_t n, struct strbuf *b)
{
    static const char *const ev[] = {
        [DOOR_REASONING] = "response.reasoning_text.delta",
        [DOOR_TEXT] = "response.output_text.delta",
        [DOOR_CALL] = "response.function_call_arguments.delta",
    };
    enum door_item_kind k = g->items[i].kind;
    char id[200];
    json_t *o;

    item_id(g, i, id, sizeof(id));
    o = json_pack("{s:s, s:i, s:s%}", "item_id", id, "output_index", (int)i, "delta", s, n);
    if (o && k != DOOR_CALL)
        json_object_set_new(o, "content_index", json_integer(0));
    if (o && k == DOOR_TEXT)
        json_object_set_new(o, "logprobs", json_array());
    event(g, b, ev[k], o);
}

static void r_item_close(struct door_gen *g, size_t i, struct strbuf *b)
{
    const struct door_item *it = &g->items[i];
    const char *text = it->text.p ? it->text.p : "";
    char id[200];

    item_id(g, i, id, sizeof(id));
    if (it->kind == DOOR_CALL) {
        event(g, b, "response.function_call_arguments.done",
              json_pack("{s:s, s:i, s:s, s:s}", "item_id", id, "output_index", (int)i, "name", it->name,
                        "arguments", it->text.len ? text : "{}"));
    } else {
        json_t *o = json_pack("{s:s, s:i, s:i, s:s}", "item_id", id, "output_index", (int)i, "content_index", 0,
                              "text", text);

        if (o && it->kind == DOOR_TEXT)
            json_object_set_new(o, "logprobs", json_array());
        event(g, b, it->kind == DOOR_TEXT ? "response.output_text.done" : "response.reasoning_text.done", o);
        event(g, b, "response.content_part.done", json_pack("{s:s, s:i, s:i, s:o}", "item_id", id, "output_index",
                                                             (int)i, "content_index", 0, "part",
                                                             content_part(it, true)));
    }
    event(g, b, "response.output_item.done", json_pack("{s:i, s:o}", "output_index", (int)i, "item",
                                                        item_json(g, i, true)));
}

static void r_end(struct door_gen *g, struct strbuf *b)
{
    const char *st = final_status(g);

    event(g, b, !strcmp(st, "completed") ? "response.completed" : "response.incomplete",
          json_pack("{s:o}", "response", response_json(g, st)));
}

static void r_fail_event(struct door_gen *g, struct strbuf *b)
{
    event(g, b, "response.failed", json_pack("{s:o}", "response", response_json(g, "failed")));
}

static json_t *r_whole(struct door_gen *g)
{
    return response_json(g, final_status(g));
}

static void r_error(struct http_req *hr, int rpc, const char *msg)
{
    char param[64];

    if (rpc != RPC_NOT_FOUND) {
        respond_status(hr, rpc, rpc == RPC_RESOURCE_EXHAUSTED ? 100 : 0, msg);
        return;
    }
    /* what is not there: "model: ...", "previous_response_id: ..." */
    snprintf(param, sizeof(param), "%.*s", (int)strcspn(msg, ":"), msg);
    http_respond_error(hr, 404, param, "%s", msg);
}

/* The answer as the next turn's history: the request's messages (no instructions) and the
 * output as one assistant message. */
static json_t *conversation(const struct door_gen *g)
{
    const struct resp_ud *u = g->ud;
    json_t *conv = json_array(), *a = json_pack("{s:s}", "role", "assistant"), *calls = json_array();
    struct strbuf text = STRBUF_INIT, reasoning = STRBUF_INIT;

    for (size_t i = u->skip; i < json_array_size(u->msgs); i++)
        json_array_append(conv, json_array_get(u->msgs, i));
    for (size_t i = 0; i < g->n_items; i++) {
        const struct door_item *it = &g->items[i];

        if (it->kind == DOOR_CALL)
            json_array_append_new(calls, json_pack("{s:s, s:s, s:{s:s, s:o}}", "id", it->call_id, "type", "function",
                                                   "function", "name", it->name, "arguments", door_call_args(it)));
        else
            strbuf_add(it->kind == DOOR_TEXT ? &text : &reasoning, it->text.p, it->text.len);
    }
    json_object_set_new(a, "content", json_stringn(text.p ? text.p : "", text.len));
    if (reasoning.len)
        json_object_set_new(a, "reasoning_content", json_stringn(reasoning.p, reasoning.len));
    if (json_array_size(calls))
        json_object_set(a, "tool_calls", calls);
    json_decref(calls);
    json_array_append_new(conv, a);
    strbuf_done(&text);
    strbuf_done(&reasoning);
    return conv;
}

static void r_completed(struct door_gen *g)
{
    struct resp_ud *u = g->ud;
    json_t *conv, *resp;

    if (!u->store || !store_on(g->rp->co))
        return;
    conv = conversation(g);
    resp = response_json(g, final_status(g));
    if (!conv || !resp || store_put(g->rp->co, g->rp->id, conv, u->im.parts, resp, rpc_now_ms()) < 0)
        log_req_info(g->rp->id, "response not stored: out of memory");
    json_decref(conv);
    json_decref(resp);
}

static const struct door_ops resp_ops = {
    .begin = r_begin, .item_open = r_item_open, .item_delta = r_item_delta, .item_close = r_item_close,
    .end = r_end, .fail_event = r_fail_event, .whole = r_whole, .error = r_error, .completed = r_completed,
    .free_ud = resp_ud_free,
};

/* ------------------------------------------------------------------ requests */

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* An input_image part as an OpenAI image_url object: image_url (a data URL, or an http(s)
 * URL taken as the chat door takes one) and detail go on to media_chat_images as they are;
 * file_id is refused (no Files API here). */
static int image_conv(const json_t *part, const char *at, json_t **ret, char *msg, size_t len)
{
    const json_t *u = json_object_get(part, "image_url"), *f = json_object_get(part, "file_id");
    const json_t *d = json_object_get(part, "detail");
    const char *key;
    json_t *v;

    json_object_foreach((json_t *)part, key, v)
        if (strcmp(key, "type") && strcmp(key, "image_url") && strcmp(key, "file_id") && strcmp(key, "detail"))
            BAD("%s.%.32s: unknown or unsupported field", at, key);
    if (f && !json_is_null(f))
        BAD("%s.file_id: file_id images are not supported: send image_url", at);
    if (!json_is_string(u))
        BAD("%s.image_url: required, a data URL (data:image/<type>;base64,<data>)", at);
    *ret = json_pack("{s:O}", "url", u);
    if (*ret && d && json_object_set(*ret, "detail", (json_t *)d)) {
        json_decref(*ret);
        *ret = NULL;
    }
    return *ret ? 0 : -ENOMEM;
}

/* The text of a message's content: a string or input_text/output_text parts (joined by
 * "\n"); with im, input_image parts as the chat door's image_url parts; files and audio are
 * refused, other part types too. */
static int content_text(const json_t *c, const char *path, struct door_images *im, struct strbuf *b, char *msg,
                        size_t len)
{
    static const char *const text[] = { "input_text", "output_text", "text", NULL };
    static const char *const media[] = { "input_file", "input_audio", NULL };
    static const struct door_parts parts = {
        .text_types = text, .media_types = media, .image_type = "input_image", .image = image_conv,
        .image_where = "user, system and developer messages and function_call_output items",
    };

    return door_parts_text(c, path, &parts, im, b, msg, len);
}

/* The last message when it is the assistant's (a function_call joins it), else a new one. */
static json_t *assistant_turn(json_t *msgs, json_t **pending_reasoning)
{
    json_t *last = json_array_get(msgs, json_array_size(msgs) - 1), *a;
    const json_t *role = json_object_get(last, "role");

    if (json_array_size(msgs) && json_is_string(role) && !strcmp(json_string_value(role), "assistant") &&
        !*pending_reasoning)
        return last;
    a = json_pack("{s:s}", "role", "assistant");
    if (a && *pending_reasoning) {
        json_object_set_new(a, "reasoning_content", *pending_reasoning);
        *pending_reasoning = NULL;
    }
    json_array_append_new(msgs, a);
    return a;
}

/* input (a string or items) onto msgs as chat messages. */
static int input_conv(const json_t *input, json_t *msgs, struct door_images *im, char *msg, size_t len)
{
    json_t *it, *pending = NULL;        /* a reasoning item's text, for the next assistant turn */
    size_t i;
    int r = 0;

    if (json_is_string(input)) {
        json_array_append_new(msgs, json_pack("{s:s, s:O}", "role", "user", "content", input));
        return 0;
    }
    if (!json_is_array(input))
        BAD("input: must be a string or an array of input items (got %s)", json_type_describe(input));
    json_array_foreach(input, i, it) {
        const json_t *t = json_object_get(it, "type"), *role = json_object_get(it, "role");
        const char *type = json_is_string(t) ? json_string_value(t) : "message";
        char path[64];

        snprintf(path, sizeof(path), "input[%zu]", i);
        if (!json_is_object(it)) {
            snprintf(msg, len, "%s: must be an input item object (got %s)", path, json_type_describe(it));
            r = -EINVAL;
        } else if (t && !json_is_string(t)) {
            snprintf(msg, len, "%s.type: must be a string", path);
            r = -EINVAL;
        } else if (!strcmp(type, "message")) {
            struct strbuf text = STRBUF_INIT;
            const char *rs = json_is_string(role) ? json_string_value(role) : NULL;
            char cpath[80];
            json_t *m;

            snprintf(cpath, sizeof(cpath), "%s.content", path);
            if (!rs || (strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "system") &&
                        strcmp(rs, "developer"))) {
                snprintf(msg, len, "%s.role: must be \"user\", \"assistant\", \"system\" or \"developer\"", path);
                r = -EINVAL;
            } else if (!json_object_get(it, "content")) {
                snprintf(msg, len, "%s: required", cpath);
                r = -EINVAL;
            } else if ((r = content_text(json_object_get(it, "content"), cpath, strcmp(rs, "assistant") ? im : NULL,
                                         &text, msg, len)) == 0) {
                json_t *c = json_stringn(text.p ? text.p : "", text.len);

                if (!strcmp(rs, "assistant") && pending) {
                    /* the reasoning item before it is this turn's */
                    m = assistant_turn(msgs, &pending);
                    r = m && c && json_object_set_new(m, "content", c) == 0 ? 0 : -ENOMEM;
                } else {
                    m = json_pack("{s:s, s:o}", "role", !strcmp(rs, "developer") ? "system" : rs, "content", c);
                    r = m && json_array_append_new(msgs, m) == 0 ? 0 : -ENOMEM;
                }
            }
            strbuf_done(&text);
        } else if (!strcmp(type, "function_call")) {
            const json_t *name = json_object_get(it, "name"), *args = json_object_get(it, "arguments");
            const json_t *cid = json_object_get(it, "call_id");
            json_t *a, *calls, *av;
            json_error_t je;

            if (!json_is_string(cid) || !json_string_length(cid)) {
                snprintf(msg, len, "%s.call_id: must be a non-empty string", path);
                r = -EINVAL;
            } else if (!json_is_string(name) || !json_string_length(name)) {
                snprintf(msg, len, "%s.name: must be a non-empty string", path);
                r = -EINVAL;
            } else if (!json_is_string(args)) {
                snprintf(msg, len, "%s.arguments: must be a string of JSON", path);
                r = -EINVAL;
            } else if (!(av = json_string_length(args) ? json_loads(json_string_value(args), JSON_REJECT_DUPLICATES,
                                                                     &je) : json_object())) {
                snprintf(msg, len, "%s.arguments: not valid JSON (%s)", path, je.text);
                r = -EINVAL;
            } else if (!json_is_object(av)) {
                json_decref(av);
                snprintf(msg, len, "%s.arguments: must be a JSON object", path);
                r = -EINVAL;
            } else {
                a = assistant_turn(msgs, &pending);
                calls = json_object_get(a, "tool_calls");
                if (!calls) {
                    calls = json_array();
                    json_object_set_new(a, "tool_calls", calls);
                }
                if (json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:o}}", "id", cid, "type", "function",
                                                           "function", "name", name, "arguments", av)))
                    r = -ENOMEM;
            }
        } else if (!strcmp(type, "function_call_output")) {
            const json_t *cid = json_object_get(it, "call_id"), *out = json_object_get(it, "output");
            struct strbuf text = STRBUF_INIT;
            char opath[80];

            snprintf(opath, sizeof(opath), "%s.output", path);
            if (!json_is_string(cid) || !json_string_length(cid)) {
                snprintf(msg, len, "%s.call_id: must be a non-empty string", path);
                r = -EINVAL;
            } else if (!out) {
                snprintf(msg, len, "%s: required", opath);
                r = -EINVAL;
            } else if ((r = content_text(out, opath, im, &text, msg, len)) == 0 &&
                       json_array_append_new(msgs, json_pack("{s:s, s:O, s:s%}", "role", "tool", "tool_call_id", cid,
                                                             "content", text.p ? text.p : "", text.len))) {
                r = -ENOMEM;
            }
            strbuf_done(&text);
        } else if (!strcmp(type, "reasoning")) {
            const json_t *content = json_object_get(it, "content"), *part;
            struct strbuf text = STRBUF_INIT;
            size_t k;

            if (content && !json_is_null(content) && !json_is_array(content)) {
                snprintf(msg, len, "%s.content: must be an array of reasoning_text parts", path);
                r = -EINVAL;
            }
            json_array_foreach(content, k, part) {
                const json_t *pt = json_object_get(part, "type"), *tx = json_object_get(part, "text");

                if (r)
                    break;
                if (!json_is_string(pt) || strcmp(json_string_value(pt), "reasoning_text") || !json_is_string(tx)) {
                    snprintf(msg, len, "%s.content[%zu]: must be {\"type\": \"reasoning_text\", \"text\": ...}", path, k);
                    r = -EINVAL;
                    break;
                }
                if (text.len)
                    strbuf_add(&text, "\n", 1);
                strbuf_add(&text, json_string_value(tx), json_string_length(tx));
            }
            if (!r && text.len) {
                json_decref(pending);
                pending = json_stringn(text.p, text.len);
            }
            strbuf_done(&text);
        } else {
            snprintf(msg, len, "%s.type: unknown input item type \"%.32s\" (message, function_call, "
                     "function_call_output or reasoning)", path, type);
            r = -EINVAL;
        }
        if (r)
            break;
    }
    if (!r && pending) {
        snprintf(msg, len, "input[%zu]: a reasoning item must come before the assistant turn it belongs to (a "
                 "message or function_call)", json_array_size(input) - 1);
        r = -EINVAL;
    }
    json_decref(pending);
    return r;
}

/* tools: function tools as chat tools. */
static int tools_conv(const json_t *tools, struct request *in, char *msg, size_t len)
{
    json_t *out, *t;
    size_t i;

    if (!tools || json_is_null(tools))
        return 0;
    if (!json_is_array(tools))
        BAD("tools: must be an array of tools (got %s)", json_type_describe(tools));
    if (!(out = in->tools = json_array()))
        return -ENOMEM;
    json_array_foreach(tools, i, t) {
        const json_t *type = json_object_get(t, "type"), *name = json_object_get(t, "name");
        const json_t *desc = json_object_get(t, "description"), *params = json_object_get(t, "parameters");
        const json_t *strict = json_object_get(t, "strict");
        json_t *fn;

        if (!json_is_object(t) || !json_is_string(type))
            BAD("tools[%zu]: must be a tool object with a \"type\"", i);
        if (strcmp(json_string_value(type), "function"))
            BAD("tools[%zu].type: \"%.32s\" tools are not supported (function tools only)", i,
                json_string_value(type));
        if (!json_is_string(name) || !json_string_length(name))
            BAD("tools[%zu].name: must be a non-empty string", i);
        if (desc && !json_is_null(desc) && !json_is_string(desc))
            BAD("tools[%zu].description: must be a string", i);
        if (params && !json_is_null(params) && !json_is_object(params))
            BAD("tools[%zu].parameters: must be a JSON schema object", i);
        if (json_is_true(strict))
            BAD("tools[%zu].strict: not enforced on calls the model opens itself; tool_choice "
                "\"required\" or a named function constrains the arguments to the schema", i);
        fn = json_pack("{s:O}", "name", name);
        if (fn && json_is_string(desc))
            json_object_set(fn, "description", (json_t *)desc);
        if (fn && json_is_object(params))
            json_object_set(fn, "parameters", (json_t *)params);
        if (json_array_append_new(out, json_pack("{s:s, s:o}", "type", "function", "function", fn)))
            return -ENOMEM;
    }
    return 0;
}

static int tool_choice_conv(const json_t *tc, struct request *in, char *msg, size_t len)
{
    int r;

    in->tool_choice = REQUEST_TOOLS_AUTO;
    if (!tc || json_is_null(tc))
        return 0;
    if ((r = request_tool_choice_string(tc, "{\"type\": \"function\", \"name\": ...}", in, msg, len)) != 0)
        return r < 0 ? r : 0;
    if (!json_is_object(tc))
        BAD("tool_choice: must be a string or an object (got %s)", json_type_describe(tc));
    if (!json_is_string(json_object_get(tc, "type")) || strcmp(json_string_value(json_object_get(tc, "type")),
                                                               "function"))
        BAD("tool_choice.type: only \"function\" choices are supported");
    if (!json_is_string(json_object_get(tc, "name")))
        BAD("tool_choice.name: required (the function to call)");
    in->tool_choice = REQUEST_TOOLS_NAMED;
    return (in->tool_choice_name = strdup(json_string_value(json_object_get(tc, "name")))) ? 0 : -ENOMEM;
}

/* The fields the response object echoes. */
static const char *const echoed[] = {
    "instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id", "reasoning",
    "store", "temperature", "text", "tool_choice", "tools", "top_p", "truncation", "user", NULL,
};

/* Fields accepted that do not change the output. */
static const char *const accepted[] = {
    "model", "input", "stream", "include", "service_tier", "prompt_cache_key", "safety_identifier", NULL,
};

static int body_conv(struct coord *co, const json_t *body, struct request *in, struct resp_ud *u, bool *stream,
                     struct door_fetch *fx, char *msg, size_t len)
{
    struct err_buf eb;
    const char *key, *s = NULL;
    const json_t *v, *prev;
    json_t *j;
    int64_t n;
    bool bv;
    int r;

    if ((r = door_fields_known(body, (const char *const *const[]){ echoed, accepted, NULL }, msg, len)) < 0 ||
        (r = door_common_fields(body, in, stream, msg, len)) < 0)
        return r;
#define GET(fn, ...) do { if ((r = fn(body, "", __VA_ARGS__, &eb)) < 0) BAD("%.600s", eb.msg); } while (0)
    u->store = true;
    GET(json_get_bool, "store", JSON_GET_OPTIONAL, &u->store);
    bv = true;
    GET(json_get_bool, "parallel_tool_calls", JSON_GET_OPTIONAL, &bv);
    in->single_tool_call = !bv;     /* false: at most one call, the output ends where a second starts */
    GET(json_get_int, "max_output_tokens", JSON_GET_OPTIONAL, 1, INT32_MAX, &n);
    if (r)
        REQUEST_SET(&in->sp, RO_MAX_TOKENS, max_tokens, n);
    GET(json_get_str, "truncation", JSON_GET_OPTIONAL, &s);
    if (r && strcmp(s, "disabled"))
        BAD("truncation: only \"disabled\" (a prompt over the context is refused, never cut)");
    if ((v = json_object_get(body, "metadata")) && !json_is_null(v) && !json_is_object(v))
        BAD("metadata: must be an object");
    GET(json_get_str, "user", JSON_GET_OPTIONAL, &s);
    if ((v = json_object_get(body, "include")) && !json_is_null(v)) {
        size_t i;
        const json_t *x;

        if (!json_is_array(v))
            BAD("include: must be an array of strings");
        json_array_foreach(v, i, x)
            if (!json_is_string(x) || strcmp(json_string_value(x), "reasoning.encrypted_content"))
                BAD("include[%zu]: only \"reasoning.encrypted_content\" (reasoning is returned as plain text)", i);
    }
    if ((v = json_object_get(body, "reasoning")) && !json_is_null(v)) {
        const json_t *e = json_object_get(v, "effort"), *sm = json_object_get(v, "summary");

        if (!json_is_object(v))
            BAD("reasoning: must be an object");
        if (e && !json_is_null(e)) {
            static const char *const map[][2] = {
                { "minimal", "low" }, { "low", "low" }, { "medium", "medium" }, { "high", "high" },
            };
            const char *to = NULL;

            for (size_t k = 0; json_is_string(e) && k < 4; k++)
                if (!strcmp(json_string_value(e), map[k][0]))
                    to = map[k][1];
            if (!to)
                BAD("reasoning.effort: must be \"minimal\", \"low\", \"medium\" or \"high\"");
            if (!(in->reasoning_effort = strdup(to)))
                return -ENOMEM;
        }
        if (sm && !json_is_null(sm) && !json_is_string(sm))
            BAD("reasoning.summary: must be a string");
    }
    if ((v = json_object_get(body, "text")) && !json_is_null(v)) {
        const json_t *f = json_object_get(v, "format"), *ft = json_object_get(f, "type");

        if (!json_is_object(v))
            BAD("text: must be an object");
        if (f && !json_is_null(f)) {
            /* structured output (daemon/structured.c) */
            const json_t *sc = json_object_get(f, "schema");
            const char *t = json_string_value(ft);
            int rs = 0;

            if (!json_is_object(f) || !t)
                BAD("text.format: must be an object with a \"type\"");
            if (!strcmp(t, "json_object")) {
                rs = request_set_structured(in, "text.format", "json_object", "", msg, len);
            } else if (!strcmp(t, "json_schema")) {
                char *st;
                if (!json_is_object(sc))
                    BAD("text.format.schema: must be a JSON schema object");
                if (!(st = json_dumps(sc, JSON_COMPACT)))
                    return -ENOMEM;
                rs = request_set_structured(in, "text.format.schema", "json_schema", st, msg, len);
                free(st);
            } else if (strcmp(t, "text")) {
                BAD("text.format.type: must be \"text\", \"json_object\" or \"json_schema\"");
            }
            if (rs < 0)
                return rs;
        }
        json_object_foreach((json_t *)v, key, j)
            if (strcmp(key, "format"))
                BAD("text.%.32s: unknown or unsupported field", key);
    }
    /* the conversation: instructions, the stored one, the input */
    in->input = REQUEST_INPUT_CHAT;
    if (!(in->messages = json_array()))
        return -ENOMEM;
    GET(json_get_str, "instructions", JSON_GET_OPTIONAL, &s);
    if (r) {
        json_array_append_new(in->messages, json_pack("{s:s, s:s}", "role", "system", "content", s));
        u->skip = 1;
    }
    if ((prev = json_object_get(body, "previous_response_id")) && !json_is_null(prev)) {
        struct resp_entry *e;

        if (!json_is_string(prev))
            BAD("previous_response_id: must be a string");
        if (!store_on(co))
            BAD("previous_response_id: responses are not stored on this server (--responses-store-size 0)");
        if (!(e = store_find(co, json_string_value(prev), rpc_now_ms()))) {
            snprintf(msg, len, "previous_response_id: response \"%.64s\" not found", json_string_value(prev));
            return -ENOENT;
        }
        json_array_extend(in->messages, e->conv);
        /* its images come first, as its placeholders do */
        for (size_t k = 0; k < json_array_size(e->images); k++) {
            const json_t *p = json_array_get(json_object_get(json_array_get(e->images, k), "content"), 0);

            if ((r = door_image_add(&u->im, "previous_response_id",
                                    json_incref(json_object_get(p, "image_url")))) < 0)
                return r;
        }
    }
    if (!(v = json_object_get(body, "input")) || json_is_null(v))
        BAD("input: required");
    u->im.url_field = ".image_url";
    u->im.detail_field = ".detail";
    if ((r = input_conv(v, in->messages, &u->im, msg, len)) < 0 ||
        (r = door_images_take(co, &u->im, fx, "input", in, msg, len)) < 0)
        return r;
    if (!u->store || !store_on(co))
        door_images_done(&u->im);   /* not kept */
    if ((r = tools_conv(json_object_get(body, "tools"), in, msg, len)) < 0 ||
        (r = tool_choice_conv(json_object_get(body, "tool_choice"), in, msg, len)) < 0 ||
        (r = door_tool_choice_check(co, in, "tool_choice", msg, len)) < 0)
        return r;
#undef GET
    /* the echoed fields, with the API's defaults */
    if (!(u->req = json_pack("{s:n, s:n, s:{}, s:b, s:n, s:{s:n, s:n}, s:b, s:n, s:{s:{s:s}}, s:s, s:[], s:n, "
                             "s:s, s:n}", "instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                             true, "previous_response_id", "reasoning", "effort", "summary", "store", u->store,
                             "temperature", "text", "format", "type", "text", "tool_choice", "auto", "tools",
                             "top_p", "truncation", "disabled", "user")))
        return -ENOMEM;
    for (size_t k = 0; echoed[k]; k++)
        if ((v = json_object_get(body, echoed[k])) && !json_is_null(v))
            json_object_set(u->req, echoed[k], (json_t *)v);
    u->msgs = json_incref(in->messages);
    return 0;
}

static int conv(struct coord *co, const json_t *body, struct request *in, void *arg, struct door_fetch *fx,
                char *msg, size_t len)
{
    struct resp_ud *u = arg;

    return body_conv(co, body, in, u, &u->stream, fx, msg, len);
}

static void *resp_ud_new(void)
{
    return calloc(1, sizeof(struct resp_ud));
}

static void resp_ready(struct coord *co, struct http_req *hr, struct request *in, void *ud)
{
    struct resp_ud *u = ud;

    door_submit(co, hr, in, u->stream, "resp_", &resp_ops, u);
}

void responses_create(struct http_req *hr, void *ud)
{
    static const struct door_serve serve = {
        .conv = conv, .ud_new = resp_ud_new, .ud_free = resp_ud_free, .ready = resp_ready, .error = r_error,
    };

    door_serve(ud, hr, names(), &serve);
}

/* GET /v1/responses/{id}; DELETE /v1/responses/{id}. */
void responses_get(struct http_req *hr, void *ud)
{
    struct coord *co = ud;
    const char *id = http_req_path(hr) + strlen("/v1/responses/");
    struct resp_entry *e = store_find(co, id, rpc_now_ms());
    char *s;

    if (!e) {
        http_respond_error(hr, 404, "response_id", "response \"%.64s\" not found", id);
        return;
    }
    if (!strcmp(http_req_method(hr), "DELETE")) {
        json_t *o = json_pack("{s:s, s:s, s:b}", "id", e->id, "object", "response", "deleted", true);

        s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        entry_free(co->responses, e);
    } else {
        s = json_dumps(e->response, JSON_COMPACT);
    }
    if (s)
        http_respond(hr, 200, "application/json", s, strlen(s), NULL);
    else
        http_respond_error(hr, 500, NULL, "out of memory");
    free(s);
}
