/* gen.c - per-request output pipeline (see gen.h). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"
#include "internal.h"

struct tok_gen {
    const struct tokenizer *tok;
    struct tok_stream stream;
    struct tok_stop stop;
    struct tok_parser *parser;      /* NULL: plain content deltas */
    bool skip_special;
    bool text_events;
    int32_t *stop_ids;
    size_t n_stop_ids;
    int32_t parser_tags[4];         /* special ids the parser must see */
    enum tok_finish finish;
    int finish_index;
};

int tok_gen_new(const struct tokenizer *tok, const struct tok_gen_opts *o, struct tok_gen **ret)
{
    static const char *const tags[4] = { "<think>", "</think>", "<tool_call>", "</tool_call>" };
    struct tok_gen *g = calloc(1, sizeof(*g));
    int r;

    if (!g)
        return -ENOMEM;
    g->tok = tok;
    g->skip_special = o->skip_special;
    g->text_events = o->text_events;
    g->finish_index = -1;
    if ((r = tok_stop_init(&g->stop, o->stops, o->n_stops, o->include_stop)) < 0) {
        free(g);
        return r;
    }
    tok_stream_init(&g->stream, tok, false);
    if (o->n_stop_ids) {
        g->stop_ids = malloc(o->n_stop_ids * sizeof(int32_t));
        if (!g->stop_ids) {
            tok_gen_free(g);
            return -ENOMEM;
        }
        memcpy(g->stop_ids, o->stop_ids, o->n_stop_ids * sizeof(int32_t));
        g->n_stop_ids = o->n_stop_ids;
    }
    for (int i = 0; i < 4; i++)
        g->parser_tags[i] = tok_added_id(tok, tags[i]);
    if ((o->parser.reasoning || o->parser.tools) &&
        (r = tok_parser_new(&o->parser, &g->parser)) < 0) {
        tok_gen_free(g);
        return r;
    }
    *ret = g;
    return 0;
}

void tok_gen_free(struct tok_gen *g)
{
    if (!g)
        return;
    tok_stream_done(&g->stream);
    tok_stop_done(&g->stop);
    tok_parser_free(g->parser);
    free(g->stop_ids);
    free(g);
}

static bool hidden(const struct tok_gen *g, int32_t id)
{
    if (!tok_id_is_special(g->tok, id))
        return false;
    if (!g->parser)
        return g->skip_special;
    for (int i = 0; i < 4; i++)
        if (g->parser_tags[i] == id)
            return false;
    return true;
}

/* Text after stop strings goes to the parser or out as content. */
static int deliver(struct tok_gen *g, const char *s, size_t n, tok_ev_cb cb, void *ud)
{
    if (g->text_events && n) {
        struct tok_ev ev = { .kind = TOK_EV_TEXT, .tool_index = -1, .text = s, .len = n };
        int r = cb(ud, &ev);

        if (r < 0)
            return r;
    }
    if (g->parser)
        return tok_parser_feed(g->parser, s, n, cb, ud);
    if (!n)
        return 0;
    struct tok_ev ev = { .kind = TOK_EV_CONTENT, .tool_index = -1, .text = s, .len = n };
    return cb(ud, &ev);
}

/* Flush every stage in order; `stopped` means the stop-string stage already ended. */
static int flush(struct tok_gen *g, bool stopped, tok_ev_cb cb, void *ud)
{
    const char *d, *o;
    size_t dn, on;
    int r;

    if (!stopped) {
        if ((r = tok_stream_finish(&g->stream, &d, &dn)) < 0)
            return r;
        r = tok_stop_feed(&g->stop, d, dn, &o, &on);
        if (r < 0 || (r = deliver(g, o, on, cb, ud)) < 0)
            return r;
        if (g->stop.finish == TOK_FINISH_NONE) {
            if ((r = tok_stop_finish(&g->stop, &o, &on)) < 0 ||
                (r = deliver(g, o, on, cb, ud)) < 0)
                return r;
        } else {
            g->finish = TOK_FINISH_STOP;
            g->finish_index = g->stop.matched;
        }
    }
    return g->parser ? tok_parser_finish(g->parser, cb, ud) : 0;
}

int tok_gen_prime(struct tok_gen *g, const char *text, size_t len, tok_ev_cb cb, void *ud)
{
    return g->parser ? tok_parser_feed(g->parser, text, len, cb, ud) : 0;
}

int tok_gen_push(struct tok_gen *g, int32_t id, tok_ev_cb cb, void *ud)
{
    const char *d, *o;
    size_t dn, on;
    int r;

    if (g->finish != TOK_FINISH_NONE)
        return -EALREADY;
    if (!tok_id_bytes(g->tok, id, NULL))
        return -EINVAL;
    for (size_t i = 0; i < g->n_stop_ids; i++)
        if (g->stop_ids[i] == id) {
            r = flush(g, false, cb, ud);
            if (g->finish == TOK_FINISH_NONE) {
                g->finish = TOK_FINISH_EOS;
                g->finish_index = id;
            }
            return r < 0 ? r : 1;
        }
    if (hidden(g, id))
        return 0;
    if ((r = tok_stream_push(&g->stream, id, &d, &dn)) < 0)
        return r;
    r = tok_stop_feed(&g->stop, d, dn, &o, &on);
    if (r < 0)
        return r;
    bool stopped = r == 1;
    if ((r = deliver(g, o, on, cb, ud)) < 0)
        return r;
    if (!stopped)
        return 0;
    g->finish = TOK_FINISH_STOP;
    g->finish_index = g->stop.matched;
    r = flush(g, true, cb, ud);
    return r < 0 ? r : 1;
}

int tok_gen_finish(struct tok_gen *g, tok_ev_cb cb, void *ud)
{
    if (g->finish != TOK_FINISH_NONE)
        return 0;
    int r = flush(g, false, cb, ud);
    if (g->finish == TOK_FINISH_NONE)
        g->finish = TOK_FINISH_LENGTH;
    return r;
}

enum tok_finish tok_gen_finish_reason(const struct tok_gen *g, int *ret_index)
{
    if (ret_index)
        *ret_index = g->finish_index;
    return g->finish;
}
