/* door.c - one generation behind one HTTP answer for the agent-harness doors (door.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coord-int.h"
#include "door.h"
#include "http.h"
#include "json.h"
#include "log.h"
#include "media.h"
#include "openai.h"
#include "reply.h"

static void door_free(void *ud)
{
    struct door_gen *g = ud;

    for (size_t i = 0; i < g->n_items; i++) {
        strbuf_done(&g->items[i].text);
        free(g->items[i].name);
    }
    free(g->items);
    free(g->stop_str);
    if (g->ops->free_ud)
        g->ops->free_ud(g->ud);
    free(g);
}

/* The last item stops growing (streaming: its closing events). */
static void item_close(struct door_gen *g, struct strbuf *b)
{
    if (g->open && g->rp->stream)
        g->ops->item_close(g, g->n_items - 1, b);
    g->open = false;
}

static struct door_item *item_new(struct door_gen *g, enum door_item_kind kind, struct strbuf *b)
{
    struct door_item *n = realloc(g->items, (g->n_items + 1) * sizeof(*n));

    if (!n)
        return NULL;
    g->items = n;
    item_close(g, b);
    n = &g->items[g->n_items++];
    memset(n, 0, sizeof(*n));
    n->kind = kind;
    return n;
}

/* Text of one kind: onto the last item when it is open and of that kind, else a new one. */
static int item_text(struct door_gen *g, enum door_item_kind kind, const char *s, struct strbuf *b)
{
    size_t n = strlen(s);
    struct door_item *it;

    if (!n)
        return 0;
    if (g->open && g->items[g->n_items - 1].kind == kind) {
        it = &g->items[g->n_items - 1];
    } else {
        if (!(it = item_new(g, kind, b)))
            return -ENOMEM;
        g->open = true;
        if (g->rp->stream)
            g->ops->item_open(g, g->n_items - 1, b);
    }
    strbuf_add(&it->text, s, n);
    if (g->rp->stream)
        g->ops->item_delta(g, (size_t)(it - g->items), s, n, b);
    return it->text.oom ? -ENOMEM : 0;
}

static int item_call(struct door_gen *g, const struct chunk_tool *t, struct strbuf *b)
{
    struct door_item *it = NULL;
    size_t n = strlen(t->arguments);

    if (t->id[0]) {
        if (!(it = item_new(g, DOOR_CALL, b)))
            return -ENOMEM;
        snprintf(it->call_id, sizeof(it->call_id), "%s", t->id);
        it->tool_index = t->index;
        if (!(it->name = strdup(t->name)))
            return -ENOMEM;
        g->open = true;
        if (g->rp->stream)
            g->ops->item_open(g, g->n_items - 1, b);
    } else {
        for (size_t i = g->n_items; i-- > 0 && !it;)
            if (g->items[i].kind == DOOR_CALL && g->items[i].tool_index == t->index)
                it = &g->items[i];
        if (!it)
            return 0;       /* the pipeline opens every call with its id */
    }
    if (!n)
        return 0;
    strbuf_add(&it->text, t->arguments, n);
    if (g->rp->stream)
        g->ops->item_delta(g, (size_t)(it - g->items), t->arguments, n, b);
    return it->text.oom ? -ENOMEM : 0;
}

/* ------------------------------------------------------------------ the reply's ops */

static void door_begin(struct reply *rp, struct strbuf *b)
{
    struct door_gen *g = rp->ud;

    if (!g->prompt_tokens)
        g->prompt_tokens = rp->prompt_tokens;
    g->ops->begin(g, b);
}

static int door_chunk(struct reply *rp, uint32_t i, const struct chunk *ch, struct strbuf *b)
{
    struct door_gen *g = rp->ud;
    int e;

    (void)i;
    if (ch->has_usage && !g->prompt_tokens)
        g->prompt_tokens = ch->prompt_tokens;
    e = item_text(g, DOOR_REASONING, ch->reasoning, b);
    if (!e)
        e = item_text(g, DOOR_TEXT, ch->content, b);
    for (size_t k = 0; !e && k < ch->n_tools; k++)
        e = item_call(g, &ch->tools[k], b);
    return e;
}

static void door_final(struct reply *rp, uint32_t i, const struct chunk_final *f)
{
    struct door_gen *g = rp->ud;

    (void)i;
    switch (f->finish) {
    case CHUNK_FINISH_STOP: g->finish = DOOR_FINISH_STOP; break;
    case CHUNK_FINISH_LENGTH: g->finish = DOOR_FINISH_LENGTH; break;
    default: g->finish = DOOR_FINISH_OTHER;
    }
    if (f->stop == CHUNK_STOP_STRING)
        g->stop_str = strdup(f->stop_string);
    g->prompt_tokens = f->prompt_tokens;
    g->completion_tokens = f->completion_tokens;
    g->cached_tokens = f->cached_tokens;
    g->reasoning_tokens = f->reasoning_tokens;
}

static void door_end(struct reply *rp, struct strbuf *b)
{
    struct door_gen *g = rp->ud;

    item_close(g, b);
    g->ops->end(g, b);
}

static void door_fail_event(struct reply *rp, struct strbuf *b)
{
    struct door_gen *g = rp->ud;

    g->ops->fail_event(g, b);
}

static void door_error(struct reply *rp, int rpc, const char *msg)
{
    struct door_gen *g = rp->ud;

    g->ops->error(rp->hr, rpc, msg);
}

static void door_whole(struct reply *rp)
{
    struct door_gen *g = rp->ud;
    json_t *o = g->ops->whole(g);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;

    if (!s)
        g->ops->error(rp->hr, RPC_INTERNAL, "out of memory");
    else
        http_respond(rp->hr, 200, "application/json", s, strlen(s), NULL);
    json_decref(o);
    free(s);
}

static void door_completed(struct reply *rp)
{
    struct door_gen *g = rp->ud;

    if (g->ops->completed)
        g->ops->completed(g);
}

static const struct reply_ops door_reply_ops = {
    .begin = door_begin, .chunk = door_chunk, .final = door_final, .end = door_end,
    .fail_event = door_fail_event, .whole = door_whole, .error = door_error, .completed = door_completed,
    .free_ud = door_free,
};

void door_submit(struct coord *co, struct http_req *hr, struct request *in, bool stream, const char *id_prefix,
                 const struct door_ops *ops, void *ud)
{
    struct door_gen *g = calloc(1, sizeof(*g));

    if (g)
        g->rp = reply_new(co, hr, 1, stream, &door_reply_ops, g);
    if (!g || !g->rp) {
        free(g);
        request_free(in);
        if (ops->free_ud)
            ops->free_ud(ud);
        ops->error(hr, RPC_INTERNAL, "out of memory");
        return;
    }
    g->ops = ops;
    g->ud = ud;
    reply_start(g->rp, in, id_prefix);
}

/* ------------------------------------------------------------------ requests */

/* The body as JSON: the object, or NULL with the reason in msg. */
static json_t *door_body(struct http_req *hr, char *msg, size_t len)
{
    size_t blen;
    const char *b = http_req_body(hr, &blen);
    json_error_t je;
    json_t *o = json_loadb(b, blen, JSON_REJECT_DUPLICATES, &je);

    if (!o) {
        bad_json(b, blen, &je, msg, len);
        return NULL;
    }
    if (!json_is_object(o)) {
        snprintf(msg, len, "the request body must be a JSON object (got %s)", json_type_describe(o));
        json_decref(o);
        return NULL;
    }
    return o;
}

static void hold_closed(struct http_req *hr, bool completed, void *ud)
{
    struct door_hold *h = ud;

    (void)hr, (void)completed;
    log_req_info("-", "cancelling: the client went away while its images were fetched and decoded");
    h->hr = NULL;
    media_fetch_cancel(h->f);
}

static void hold_done(struct media_fetch *f, void *ud)
{
    struct door_hold *h = ud;

    if (h->hr) {
        http_req_on_close(h->hr, NULL, NULL);
        h->resume(h, f);
    } else {
        log_req_info("-", "dropped: the client went away while its images were fetched and decoded");
        h->drop(h);
    }
    media_fetch_free(f);
    free(h);
}

int door_hold_start(struct door_hold *h, const json_t *messages, char *msg, size_t len)
{
    int r = media_fetch_start(&h->co->loop, messages, h->co->tok, hold_done, h, &h->f);

    if (r < 0)
        media_start_error(r, msg, len);
    else if (r > 0)
        http_req_on_close(h->hr, hold_closed, h);
    return r;
}

/* A request whose images are being prepared (door_serve): parsed again when they are. */
struct door_fetch {
    struct door_hold h;             /* first: hold_done frees it */
    const char *const *names;
    const struct door_serve *s;
    json_t *body;                   /* kept from the first parse */
};

/* hr's request (door_serve): body (owned; NULL: hr's) converted by conv; or NULL when
 * refused and answered, or when fx's fetch started (nothing answered, the body kept in
 * fx->body for the second parse). */
static struct request *request_parse(struct coord *co, struct http_req *hr, json_t *body, const char *const *names,
                                     door_conv_fn conv, void *arg, struct door_fetch *fx,
                                     void (*error)(struct http_req *hr, int rpc, const char *msg))
{
    struct request *in = request_new(names);
    char msg[768] = "";
    int r = -ENOMEM;

    if (in && !body && (body = door_body(hr, msg, sizeof(msg))) == NULL)
        r = -EINVAL;
    else if (in && (r = conv(co, body, in, arg, fx, msg, sizeof(msg))) == 0 &&
             (co->o.model_name || co->model.known) && !model_known(co, in->model)) {
        snprintf(msg, sizeof(msg), "model: \"%.64s\" is not served here (GET /v1/models lists the names)", in->model);
        r = -ENOENT;
    }
    if (fx && fx->h.f && !fx->body) {
        /* the first parse reached the images, which are being fetched: the second one serves */
        fx->body = body;
        request_free(in);
        return NULL;
    }
    json_decref(body);
    if (r == 0)
        return in;
    if (r == -ENOMEM)
        snprintf(msg, sizeof(msg), "out of memory");
    else if (r != -EBUSY)
        co->m.rejected_invalid++;
    log_req_info(in && in->id[0] ? in->id : "-", "rejected: %s", msg);
    if (in)
        request_free(in);
    error(hr, r == -ENOMEM ? RPC_INTERNAL : r == -ENOENT ? RPC_NOT_FOUND : r == -EBUSY ? RPC_UNAVAILABLE
          : RPC_INVALID_ARGUMENT, msg);
    return NULL;
}

/* One parse of fx's request with a fresh ud: served (s->ready), or refused and answered, or
 * (the first parse only) its images being prepared. */
static void serve_parse(struct door_fetch *fx, json_t *body)
{
    const struct door_serve *s = fx->s;
    void *ud = s->ud_new();
    struct request *in;

    if (!ud) {
        json_decref(body);
        s->error(fx->h.hr, RPC_INTERNAL, "out of memory");
        return;
    }
    if ((in = request_parse(fx->h.co, fx->h.hr, body, fx->names, s->conv, ud, fx, s->error)))
        s->ready(fx->h.co, fx->h.hr, in, ud);
    else
        s->ud_free(ud);
}

static void serve_resume(struct door_hold *h, struct media_fetch *f)
{
    struct door_fetch *fx = (struct door_fetch *)h;

    (void)f;        /* fx->h.f: the second parse takes the images */
    serve_parse(fx, fx->body);
}

static void serve_drop(struct door_hold *h)
{
    json_decref(((struct door_fetch *)h)->body);
}

void door_serve(struct coord *co, struct http_req *hr, const char *const *names, const struct door_serve *s)
{
    struct door_fetch *fx = calloc(1, sizeof(*fx));

    if (!fx) {
        s->error(hr, RPC_INTERNAL, "out of memory");
        return;
    }
    *fx = (struct door_fetch){ .h = { .co = co, .hr = hr, .resume = serve_resume, .drop = serve_drop },
                               .names = names, .s = s };
    serve_parse(fx, NULL);
    if (!fx->h.f)
        free(fx);       /* else held until hold_done */
}

int door_tool_choice_check(const struct coord *co, struct request *in, const char *field, char *msg, size_t len)
{
    bool have_tools = in->tools && json_array_size(in->tools);

    if (!have_tools && in->tool_choice == REQUEST_TOOLS_AUTO)
        in->tool_choice = REQUEST_TOOLS_NONE;
    if ((in->tool_choice == REQUEST_TOOLS_REQUIRED || in->tool_choice == REQUEST_TOOLS_NAMED) && !have_tools) {
        snprintf(msg, len, "%s: choosing a tool needs tools", field);
        return -EINVAL;
    }
    if (in->tool_choice == REQUEST_TOOLS_NAMED) {
        size_t i;
        const json_t *t;
        bool found = false;

        json_array_foreach(in->tools, i, t) {
            const json_t *n = json_object_get(json_object_get(t, "function"), "name");

            found |= json_is_string(n) && !strcmp(json_string_value(n), in->tool_choice_name);
        }
        if (!found) {
            snprintf(msg, len, "%s: \"%.64s\" is not one of the tools", field, in->tool_choice_name);
            return -EINVAL;
        }
    }
    if (in->tool_choice != REQUEST_TOOLS_NONE && !co->o.tool_parser) {
        snprintf(msg, len, "%s: tool calls need the tool-call parser (stepd runs without it: "
                 "--tool-call-parser none)", field);
        return -EINVAL;
    }
    return 0;
}

int door_fields_known(const json_t *body, const char *const *const *known, char *msg, size_t len)
{
    const char *key;
    json_t *v;

    json_object_foreach((json_t *)body, key, v) {
        bool ok = false;

        for (size_t l = 0; known[l] && !ok; l++)
            for (size_t k = 0; known[l][k] && !ok; k++)
                ok = !strcmp(key, known[l][k]);
        if (!ok) {
            snprintf(msg, len, "%.64s: unknown or unsupported field", key);
            return -EINVAL;
        }
    }
    return 0;
}

int door_common_fields(const json_t *body, struct request *in, bool *stream, char *msg, size_t len)
{
    struct err_buf eb;
    const char *model = NULL;
    double d;
    int r;

    *stream = false;
    if ((r = json_get_str(body, "", "model", JSON_GET_REQUIRED, &model, &eb)) < 0 ||
        (r = json_get_bool(body, "", "stream", JSON_GET_OPTIONAL, stream, &eb)) < 0)
        goto bad;
    free(in->model);
    if (!(in->model = strdup(model)))
        return -ENOMEM;
    if ((r = json_get_num(body, "", "temperature", JSON_GET_OPTIONAL, &d, &eb)) < 0)
        goto bad;
    if (r)
        REQUEST_SET(&in->sp, RO_TEMPERATURE, temperature, (float)d);
    if ((r = json_get_num(body, "", "top_p", JSON_GET_OPTIONAL, &d, &eb)) < 0)
        goto bad;
    if (r)
        REQUEST_SET(&in->sp, RO_TOP_P, top_p, (float)d);
    return 0;
bad:
    snprintf(msg, len, "%.600s", eb.msg);
    return -EINVAL;
}

static bool one_of(const char *s, const char *const *list)
{
    for (size_t i = 0; list[i]; i++)
        if (!strcmp(s, list[i]))
            return true;
    return false;
}

int door_image_add(struct door_images *im, const char *at, json_t *image_url)
{
    json_t *m = json_pack("{s:s, s:[{s:s, s:o}]}", "role", "user", "content", "type", "image_url", "image_url",
                          image_url);
    char **n, *a;

    if (!m)
        return -ENOMEM;
    if ((!im->parts && !(im->parts = json_array())) || !(n = realloc(im->at, (im->n + 1) * sizeof(*n)))) {
        json_decref(m);
        return -ENOMEM;
    }
    im->at = n;
    if (!(a = strdup(at))) {
        json_decref(m);
        return -ENOMEM;
    }
    if (json_array_append_new(im->parts, m)) {
        free(a);
        return -ENOMEM;
    }
    im->at[im->n++] = a;
    return 0;
}

/* media_chat_images names image j of im->parts "messages[j].content[0]" (and the request's
 * images together "messages"): the door's names in their place. */
static void images_msg_rename(const struct door_images *im, const char *field, char *msg, size_t len)
{
    const char *const sub[][2] = { { ".image_url.url", im->url_field }, { ".image_url.detail", im->detail_field } };
    char rest[768];
    size_t j;
    int end = 0;

    if (sscanf(msg, "messages[%zu].content[0]%n", &j, &end) == 1 && end > 0 && j < im->n) {
        const char *r = msg + end, *to = "";

        for (size_t k = 0; k < 2; k++)
            if (sub[k][1] && !strncmp(r, sub[k][0], strlen(sub[k][0]))) {
                r += strlen(sub[k][0]);
                to = sub[k][1];
                break;
            }
        snprintf(rest, sizeof(rest), "%s", r);
        snprintf(msg, len, "%s%s%s", im->at[j], to, rest);
    } else if (!strncmp(msg, "messages:", 9)) {
        snprintf(rest, sizeof(rest), "%s", msg + 8);
        snprintf(msg, len, "%s%s", field, rest);
    }
}

int door_images_take(struct coord *co, const struct door_images *im, struct door_fetch *fx, const char *field,
                     struct request *in, char *msg, size_t len)
{
    int r;

    if (!im->n)
        return 0;
    if (fx && !fx->h.f) {
        /* the first parse: the images are fetched and decoded off the loop, if any */
        if ((r = door_hold_start(&fx->h, im->parts, msg, len)) < 0)
            return r;
        if (r > 0)
            return -EINPROGRESS;
    }
    r = media_chat_images(im->parts, co->tok, wpool_serves_images(co), fx ? fx->h.f : NULL, in, msg, len);
    if (r == -EINVAL)
        images_msg_rename(im, field, msg, len);
    return r;
}

void door_images_done(struct door_images *im)
{
    for (size_t i = 0; i < im->n; i++)
        free(im->at[i]);
    free(im->at);
    json_decref(im->parts);
    im->at = NULL;
    im->parts = NULL;
    im->n = 0;
}

int door_parts_text(const json_t *c, const char *path, const struct door_parts *dp, struct door_images *im,
                    struct strbuf *b, char *msg, size_t len)
{
    bool sep = true;            /* a newline before the next text (none right after an image) */
    size_t k;
    json_t *p;

    if (json_is_string(c)) {
        strbuf_add(b, json_string_value(c), json_string_length(c));
        return 0;
    }
    if (!json_is_array(c)) {
        snprintf(msg, len, "%s: must be a string or an array of content parts (got %s)", path, json_type_describe(c));
        return -EINVAL;
    }
    json_array_foreach(c, k, p) {
        const json_t *t = json_object_get(p, "type"), *text = json_object_get(p, "text");
        const char *type = json_is_string(t) ? json_string_value(t) : NULL;
        char at[160];

        snprintf(at, sizeof(at), dp->dotted ? "%s.%zu" : "%s[%zu]", path, k);
        if (!json_is_object(p) || !type) {
            snprintf(msg, len, "%s: must be a content part object with a \"type\"", at);
        } else if (dp->image_type && !strcmp(type, dp->image_type)) {
            json_t *iu = NULL;
            int r;

            if (!im) {
                snprintf(msg, len, "%s.type: \"%s\" parts are taken in %s only", at, type, dp->image_where);
                return -EINVAL;
            }
            if ((r = dp->image(p, at, &iu, msg, len)) < 0 || (r = door_image_add(im, at, iu)) < 0)
                return r;
            strbuf_adds(b, MEDIA_IMAGE_PLACEHOLDER);
            sep = false;
            continue;
        } else if (one_of(type, dp->media_types)) {
            snprintf(msg, len, "%s.type: \"%s\" parts are not supported (this server takes text and images only)",
                     at, type);
        } else if (!one_of(type, dp->text_types)) {
            snprintf(msg, len, "%s.type: unknown or unsupported content part type \"%.32s\" (%s)", at, type,
                     dp->text_types[0]);
        } else if (!json_is_string(text)) {
            snprintf(msg, len, "%s.text: must be a string", at);
        } else {
            if (sep && b->len)
                strbuf_add(b, "\n", 1);
            strbuf_add(b, json_string_value(text), json_string_length(text));
            sep = true;
            continue;
        }
        return -EINVAL;
    }
    return b->oom ? -ENOMEM : 0;
}

void door_event(struct strbuf *b, const char *type, json_t *o)
{
    char *s = NULL;

    if (o && json_object_set_new(o, "type", json_string(type)) == 0)
        s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) {
        b->oom = true;
        return;
    }
    strbuf_printf(b, "event: %s\ndata: %s\n\n", type, s);
    free(s);
}

const char *const *door_names(const char **names, const char *prompt, const char *effort, const char *max_tokens,
                              const char *stop)
{
    if (!names[RN_MODEL]) {
        memcpy(names, names_chat, _RN_MAX * sizeof(*names));
        names[RN_TEXT] = names[RN_MESSAGES] = names[RN_TOKEN_IDS] = names[RN_INPUT] = prompt;
        names[RN_REASONING_EFFORT] = effort;
        names[RN_MAX_TOKENS] = max_tokens;
        names[RN_STOP] = stop;
    }
    return names;
}

json_t *door_call_args(const struct door_item *it)
{
    json_t *a = it->text.len ? json_loadb(it->text.p, it->text.len, 0, NULL) : json_object();

    if (!json_is_object(a)) {
        /* not an object (cannot be: the parser writes the arguments as one): keep the text */
        json_decref(a);
        a = json_pack("{s:s%}", "_raw", it->text.p ? it->text.p : "", it->text.len);
    }
    return a;
}
