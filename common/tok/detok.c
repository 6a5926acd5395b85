/* detok.c - streaming detokenizer (prefix/read offsets) and stop strings.
 *
 * Detokenizer: ids[prefix_offset, read_offset) were decoded last time as prefix_text; each
 * push decodes ids[prefix_offset, end).  If that text is longer than prefix_text and does not
 * end in U+FFFD (an incomplete character that a later token may complete), the difference is
 * the delta and both offsets advance.  Committing only at complete characters makes every
 * delta final: decoding restarts cleanly at such a boundary, so concatenated deltas equal a
 * one-shot tok_decode().
 *
 * Stop strings: the stream keeps the longest suffix that is a proper prefix of some stop
 * string ("held"); everything before it is safe to emit.  A match cuts the text before the
 * stop string and ends the stream.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void tok_stream_init(struct tok_stream *s, const struct tokenizer *tok, bool skip_special)
{
    memset(s, 0, sizeof(*s));
    s->tok = tok;
    s->skip_special = skip_special;
}

void tok_stream_done(struct tok_stream *s)
{
    tok_ids_done(&s->ids);
    free(s->out);
    s->out = NULL;
    s->out_cap = 0;
}

static int set_out(struct tok_stream *s, const char *p, size_t n)
{
    if (n + 1 > s->out_cap) {
        char *o = realloc(s->out, n + 1);
        if (!o)
            return -ENOMEM;
        s->out = o;
        s->out_cap = n + 1;
    }
    memcpy(s->out, p, n);
    s->out[n] = '\0';
    return 0;
}

static int stream_step(struct tok_stream *s, bool final, const char **ret_delta, size_t *ret_len)
{
    struct tok_buf raw = {0}, prefix = {0}, full = {0};
    const int32_t *ids = s->ids.ids ? s->ids.ids + s->prefix_offset : NULL;    /* none yet */
    size_t n_prefix = s->read_offset - s->prefix_offset, n_full = s->ids.n - s->prefix_offset;
    int r;

    *ret_delta = "";
    *ret_len = 0;
    if ((r = tok__decode_raw(s->tok, ids, n_full, s->skip_special, &raw)) < 0)
        goto out;
    /* an unfinished character may still be completed (or rewritten) by the next token */
    if (!final && tok__utf8_incomplete_tail(raw.p, raw.n))
        goto out;
    if ((r = tok__decode_buf(s->tok, ids, n_prefix, s->skip_special, &prefix)) < 0 ||
        (r = tok__utf8_lossy(&full, raw.p ? raw.p : "", raw.n)) < 0)
        goto out;
    if (full.n > prefix.n) {
        if ((r = set_out(s, full.p + prefix.n, full.n - prefix.n)) < 0)
            goto out;
        *ret_delta = s->out;
        *ret_len = full.n - prefix.n;
    }
    s->prefix_offset = s->read_offset;
    s->read_offset = s->ids.n;
out:
    tok__buf_done(&raw);
    tok__buf_done(&prefix);
    tok__buf_done(&full);
    return r;
}

int tok_stream_push(struct tok_stream *s, int32_t id, const char **ret_delta, size_t *ret_len)
{
    if (!tok_id_bytes(s->tok, id, NULL))
        return -EINVAL;
    int r = tok__ids_push(&s->ids, id);
    if (r < 0)
        return r;
    return stream_step(s, false, ret_delta, ret_len);
}

int tok_stream_finish(struct tok_stream *s, const char **ret_delta, size_t *ret_len)
{
    return stream_step(s, true, ret_delta, ret_len);
}

/* --- stop strings --------------------------------------------------------------------------- */

int tok_stop_init(struct tok_stop *st, const char *const *stops, size_t n, bool include_stop)
{
    memset(st, 0, sizeof(*st));
    st->matched = -1;
    st->include_stop = include_stop;
    if (!n)
        return 0;
    st->stops = calloc(n, sizeof(char *));
    if (!st->stops)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        if (!stops[i] || !*stops[i]) {
            tok_stop_done(st);
            return -EINVAL;
        }
        st->stops[i] = strdup(stops[i]);
        st->n_stops = i + 1;
        if (!st->stops[i]) {
            tok_stop_done(st);
            return -ENOMEM;
        }
        size_t l = strlen(stops[i]);
        if (l > st->max_len)
            st->max_len = l;
    }
    st->held = malloc(st->max_len + 1);
    if (!st->held) {
        tok_stop_done(st);
        return -ENOMEM;
    }
    return 0;
}

void tok_stop_done(struct tok_stop *st)
{
    for (size_t i = 0; i < st->n_stops; i++)
        free(st->stops[i]);
    free(st->stops);
    free(st->held);
    free(st->out);
    st->stops = NULL;
    st->held = NULL;
    st->out = NULL;
    st->n_stops = 0;
}

static int out_reserve(struct tok_stop *st, size_t n)
{
    if (n + 1 <= st->out_cap)
        return 0;
    char *o = realloc(st->out, n + 1);
    if (!o)
        return -ENOMEM;
    st->out = o;
    st->out_cap = n + 1;
    return 0;
}

/* Length of the longest suffix of s[0..n) that is a proper prefix of a stop string. */
static size_t held_suffix(const struct tok_stop *st, const char *s, size_t n)
{
    size_t best = 0;
    for (size_t i = 0; i < st->n_stops; i++) {
        size_t l = strlen(st->stops[i]);
        for (size_t k = (l - 1 < n ? l - 1 : n); k > best; k--)
            if (memcmp(s + n - k, st->stops[i], k) == 0) {
                best = k;
                break;
            }
    }
    return best;
}

int tok_stop_feed(struct tok_stop *st, const char *text, size_t len, const char **ret_out,
                  size_t *ret_len)
{
    size_t n;
    int r;

    *ret_out = "";
    *ret_len = 0;
    if (st->finish != TOK_FINISH_NONE)
        return 1;
    if (!st->n_stops) {
        if ((r = out_reserve(st, len)) < 0)
            return r;
        memcpy(st->out, text, len);
        st->out[len] = '\0';
        *ret_out = st->out;
        *ret_len = len;
        return 0;
    }
    /* work = held + text, in out */
    n = st->n_held + len;
    if ((r = out_reserve(st, n)) < 0)
        return r;
    memcpy(st->out, st->held, st->n_held);
    memcpy(st->out + st->n_held, text, len);
    st->out[n] = '\0';
    size_t best_pos = SIZE_MAX;
    int best = -1;
    for (size_t i = 0; i < st->n_stops; i++) {
        const char *hit = memmem(st->out, n, st->stops[i], strlen(st->stops[i]));
        if (hit && (size_t)(hit - st->out) < best_pos) {
            best_pos = (size_t)(hit - st->out);
            best = (int) i;
        }
    }
    if (best >= 0) {
        size_t cut = best_pos + (st->include_stop ? strlen(st->stops[best]) : 0);
        st->out[cut] = '\0';
        st->finish = TOK_FINISH_STOP;
        st->matched = best;
        st->n_held = 0;
        *ret_out = st->out;
        *ret_len = cut;
        return 1;
    }
    size_t h = held_suffix(st, st->out, n);
    memcpy(st->held, st->out + n - h, h);
    st->n_held = h;
    st->out[n - h] = '\0';
    *ret_out = st->out;
    *ret_len = n - h;
    return 0;
}

int tok_stop_finish(struct tok_stop *st, const char **ret_out, size_t *ret_len)
{
    int r;
    *ret_out = "";
    *ret_len = 0;
    if (st->finish != TOK_FINISH_NONE || !st->n_held)
        return 0;
    if ((r = out_reserve(st, st->n_held)) < 0)
        return r;
    memcpy(st->out, st->held, st->n_held);
    st->out[st->n_held] = '\0';
    *ret_out = st->out;
    *ret_len = st->n_held;
    st->n_held = 0;
    return 0;
}
