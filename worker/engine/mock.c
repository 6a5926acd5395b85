/* mock.c - deterministic fake forward with a self-checking paged KV store. */
#include "mock.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "splitmix.h"

#define MOCK_MAX_CONTEXT 8
#define MOCK_MAX_MTP 3

/* What a step wrote at a KV slot: position, token and the chain hash of the whole
 * history up to it, so that blocks shared between sequences (prefix cache) check out
 * exactly when they hold the same history. */
struct kv_cell {
    int32_t pos;
    int32_t token;
    uint64_t chain;
};

struct mock {
    struct mock_config cfg;
    struct kv_cell *cells[_KV_GROUP_MAX]; /* [n_blocks * block_size] */
    int32_t *chain;                       /* [max_seqs * MOCK_MAX_MTP] tok_in per depth */
    struct mock_stats stats;
};

static const struct forward_ops mock_ops;

void mock_config_init(struct mock_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->vocab_size = 256;
    cfg->n_mtp = 3;
    cfg->max_tokens_per_step = 512;
    cfg->max_seqs = 32;
    cfg->block_size = 16;
    cfg->n_blocks[KV_GROUP_FULL] = 256;
    cfg->n_blocks[KV_GROUP_SLIDING] = 256;
    cfg->context = 3;
    cfg->logit_scale = 4.0f;
    cfg->mtp_accuracy = 0.8f;
    cfg->seed = 1;
}

static uint64_t chain_start(uint64_t seed)
{
    return splitmix64(seed ^ 0x452821e638d01377ull);
}

static uint64_t chain_step(uint64_t h, int32_t token)
{
    return splitmix64(h ^ ((uint64_t) (uint32_t) token * 0x9e3779b97f4a7c15ull +
                           0x13198a2e03707344ull));
}

/* Hash of a context: first token of the sequence and the last n (<= context) tokens. */
static uint64_t ctx_hash(uint64_t seed, int32_t first, const int32_t *last, int n)
{
    uint64_t h = splitmix64(seed ^ 0x243f6a8885a308d3ull) ^
                 splitmix64((uint64_t) (uint32_t) first + 17);
    for (int i = 0; i < n; i++)
        h = splitmix64(h ^ ((uint64_t) (uint32_t) last[i] * 0x100000001b3ull + (uint64_t) i));
    return h;
}

static void fill_row(const struct mock_config *cfg, uint64_t h, float *logits)
{
    for (int v = 0; v < cfg->vocab_size; v++) {
        uint64_t z = splitmix64(h ^ ((uint64_t) v * 0x9e3779b97f4a7c15ull));
        double u = (double) (z >> 11) * (1.0 / 9007199254740992.0);
        /* cubing makes a few tokens stand out, like a real LM's peaked rows */
        logits[v] = cfg->logit_scale * (float) (u * u * u);
    }
}

void mock_forward_row(const struct forward *f, const int32_t *tokens, int n, float *logits)
{
    const struct mock *m = f->impl;
    if (m->cfg.full_history) {
        uint64_t h = chain_start(m->cfg.seed);
        for (int i = 0; i < n; i++)
            h = chain_step(h, tokens[i]);
        fill_row(&m->cfg, h, logits);
        return;
    }
    int c = n < m->cfg.context ? n : m->cfg.context;
    fill_row(&m->cfg, ctx_hash(m->cfg.seed, tokens[0], tokens + n - c, c), logits);
}

/* When a call began, on the clock its nominal cost is slept against (0 with a simulated
 * clock: there the mock's own work takes no time). */
static int64_t call_start(const struct mock *m)
{
    return m->cfg.clock ? 0 : clk_src_now_us(m->cfg.wall);
}

/* A call's nominal time usec: added to the simulated clock (mock_config.clock), or slept
 * until usec after its start t0, so that the mock's own work (hashing every row it
 * returns: at 16 sequences and a 4096-token vocabulary about as long as a nominal MTP
 * call, and longer on a loaded host) is part of the cost rather than added to it. */
static void nap(struct mock *m, int64_t t0, long usec)
{
    if (usec <= 0)
        return;
    if (m->cfg.clock) {
        clk_sim_advance_us(m->cfg.clock, usec);
        return;
    }
    int64_t left = (int64_t) usec - (clk_src_now_us(m->cfg.wall) - t0);
    if (left <= 0) {
        m->stats.overruns++;
        return;
    }
    m->stats.slept_us += (uint64_t) left;
    struct timespec ts = { .tv_sec = left / 1000000, .tv_nsec = (left % 1000000) * 1000 };
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR)
        ;
}

/* Cell of position pos through seq's table in group g, or NULL when unmapped. */
static struct kv_cell *cell_at(struct mock *m, const struct step_plan *p, const struct step_seq *s,
                               int g, int32_t pos)
{
    int bs = m->cfg.block_size;
    int32_t b = pos / bs;
    if (b >= s->n_blocks)
        return NULL;
    int32_t off = s->block_off[g] + b;
    if (off < 0 || off >= p->n_block_ids[g])
        return NULL;
    int32_t id = p->blocks[g][off];
    if (id < 0 || id >= m->cfg.n_blocks[g])
        return NULL;
    return &m->cells[g][(size_t) id * (size_t) bs + (size_t) (pos % bs)];
}

/* The cell of position pos in group g; -EUCLEAN when it does not hold that position. */
static int read_cell(struct mock *m, const struct step_plan *p, const struct step_seq *s, int g,
                     int32_t pos, const struct kv_cell **ret)
{
    const struct kv_cell *c = cell_at(m, p, s, g, pos);
    if (!c || c->pos != pos)
        return -EUCLEAN;
    *ret = c;
    return 0;
}

static int check_plan(const struct mock *m, const struct step_plan *p)
{
    if (p->n_seqs < 0 || p->n_seqs > m->cfg.max_seqs || p->n_tokens < 0 ||
        p->n_tokens > m->cfg.max_tokens_per_step)
        return -EINVAL;
    int32_t sum = 0;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        if (s->slot < 0 || s->slot >= m->cfg.max_seqs || s->n_tokens <= 0 || s->pos0 < 0 ||
            s->n_logits < 0 || s->n_logits > s->n_tokens || s->tok_off < 0 ||
            s->tok_off + s->n_tokens > p->n_tokens || s->mtp_depth < 0 ||
            s->mtp_depth > m->cfg.n_mtp)
            return -EINVAL;
        if ((int64_t) s->n_blocks * m->cfg.block_size < (int64_t) s->pos0 + s->n_tokens)
            return -EINVAL;
        if (s->flags & ~STEP_SEQ_FLAGS_KNOWN)
            return -EINVAL;
        sum += s->n_tokens;
    }
    return sum == p->n_tokens ? 0 : -EINVAL;
}

/* Logits row for the sequence prefix ending at position pos (all read from KV), then
 * the n_extra tokens: the window's sliding cells must form one history (each cell's chain
 * follows from the one before) that agrees with the full-attention cells. */
static int row_from_kv(struct mock *m, const struct step_plan *p, const struct step_seq *s,
                       int32_t pos, const int32_t *extra, int n_extra, float *logits)
{
    int32_t ctx[MOCK_MAX_CONTEXT + MOCK_MAX_MTP + 1];
    const struct kv_cell *first, *last = NULL, *full, *prev = NULL;
    int r = read_cell(m, p, s, KV_GROUP_FULL, 0, &first);
    if (r < 0)
        return r;
    int c = m->cfg.context;
    int n = 0;
    for (int32_t q = pos - (c - 1); q <= pos; q++) {
        if (q < 0)
            continue;
        r = read_cell(m, p, s, KV_GROUP_SLIDING, q, &last);
        if (r < 0)
            return r;
        if (prev && last->chain != chain_step(prev->chain, last->token))
            return -EUCLEAN;
        prev = last;
        ctx[n++] = last->token;
    }
    r = read_cell(m, p, s, KV_GROUP_FULL, pos, &full);
    if (r < 0 || !last || full->chain != last->chain || full->token != last->token)
        return -EUCLEAN;
    if (m->cfg.full_history) {
        uint64_t h = full->chain;
        for (int i = 0; i < n_extra; i++)
            h = chain_step(h, extra[i]);
        fill_row(&m->cfg, h, logits);
        return 0;
    }
    for (int i = 0; i < n_extra; i++)
        ctx[n++] = extra[i];
    int use = n < c ? n : c;
    fill_row(&m->cfg, ctx_hash(m->cfg.seed, first->token, ctx + n - use, use), logits);
    return 0;
}

static int mock_step(struct forward *f, const struct step_plan *p, float *logits)
{
    struct mock *m = f->impl;
    int64_t t0 = call_start(m);
    int r = check_plan(m, p);
    if (r < 0)
        return r;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        /* the history so far: a run continues the cell before it (this sequence's own, or
         * a cached prefix's when a new sequence starts above 0) */
        uint64_t h = chain_start(m->cfg.seed);
        if (s->pos0 > 0) {
            const struct kv_cell *prev;
            r = read_cell(m, p, s, KV_GROUP_FULL, s->pos0 - 1, &prev);
            if (r < 0)
                return r;
            h = prev->chain;
        }
        for (int t = 0; t < s->n_tokens; t++) {
            int32_t pos = s->pos0 + t;
            int32_t tok = p->tokens[s->tok_off + t];
            h = chain_step(h, tok);
            for (int g = 0; g < _KV_GROUP_MAX; g++) {
                struct kv_cell *c = cell_at(m, p, s, g, pos);
                if (!c)
                    return -EUCLEAN;
                *c = (struct kv_cell) { .pos = pos, .token = tok, .chain = h };
            }
        }
    }
    size_t row = 0;
    size_t v = (size_t) m->cfg.vocab_size;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        for (int t = s->n_tokens - s->n_logits; t < s->n_tokens; t++) {
            r = row_from_kv(m, p, s, s->pos0 + t, NULL, 0, logits + row++ * v);
            if (r < 0)
                return r;
        }
    }
    m->stats.steps++;
    m->stats.tokens += (uint64_t) p->n_tokens;
    if (p->n_seqs > m->stats.max_seqs_in_step)
        m->stats.max_seqs_in_step = p->n_seqs;
    if (p->n_tokens > m->stats.max_tokens_in_step)
        m->stats.max_tokens_in_step = p->n_tokens;
    nap(m, t0, m->cfg.step_usec + m->cfg.token_usec * p->n_tokens);
    return 0;
}

static int mock_mtp_step(struct forward *f, int k, const struct step_plan *p, const int32_t *n_valid,
                         const int32_t *tok_in, float *logits)
{
    struct mock *m = f->impl;
    int64_t t0 = call_start(m);
    if (k < 0 || k >= m->cfg.n_mtp)
        return -EINVAL;
    size_t v = (size_t) m->cfg.vocab_size;
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        if (s->mtp_depth <= k)
            continue;
        if (n_valid[i] < 1 || n_valid[i] > s->n_tokens)
            return -EINVAL;
        int32_t *chain = m->chain + (size_t) s->slot * MOCK_MAX_MTP;
        chain[k] = tok_in[i];
        float *row = logits + (size_t) i * v;
        int r = row_from_kv(m, p, s, s->pos0 + n_valid[i] - 1, chain, k + 1, row);
        if (r < 0)
            return r;
        /* the accuracy coin depends on the context row itself: reproducible */
        uint64_t h = splitmix64(m->cfg.seed ^ 0xabcdefull ^ (uint64_t) k);
        for (int j = 0; j < 4 && j < (int) v; j++)
            h = splitmix64(h ^ (uint64_t) (row[j] * 1e6f));
        double u = (double) (h >> 11) * (1.0 / 9007199254740992.0);
        if (u >= m->cfg.mtp_accuracy)
            fill_row(&m->cfg, splitmix64(h ^ 0x5151), row);
    }
    m->stats.mtp_steps++;
    nap(m, t0, m->cfg.mtp_usec);
    return 0;
}

static void mock_free(struct forward *f)
{
    if (!f)
        return;
    struct mock *m = f->impl;
    if (m) {
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            free(m->cells[g]);
        free(m->chain);
        free(m);
    }
    free(f);
}

static const struct forward_ops mock_ops = {
    .name = "mock",
    .step = mock_step,
    .mtp_step = mock_mtp_step,
    .free = mock_free,
};

int mock_forward_new(const struct mock_config *cfg, struct forward **ret)
{
    if (!cfg || cfg->vocab_size < 2 || cfg->n_mtp < 0 || cfg->n_mtp > MOCK_MAX_MTP ||
        cfg->max_tokens_per_step <= 0 || cfg->max_seqs <= 0 || cfg->block_size <= 0 ||
        cfg->context < 1 || cfg->context > MOCK_MAX_CONTEXT || cfg->mtp_accuracy < 0.0f ||
        cfg->mtp_accuracy > 1.0f || cfg->n_blocks[0] <= 0 || cfg->n_blocks[1] <= 0)
        return -EINVAL;
    struct forward *f = calloc(1, sizeof(*f));
    struct mock *m = calloc(1, sizeof(*m));
    if (!f || !m) {
        free(f);
        free(m);
        return -ENOMEM;
    }
    f->ops = &mock_ops;
    f->impl = m;
    m->cfg = *cfg;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        size_t n = (size_t) cfg->n_blocks[g] * (size_t) cfg->block_size;
        m->cells[g] = malloc(n * sizeof(struct kv_cell));
        if (!m->cells[g])
            goto out_nomem;
        for (size_t i = 0; i < n; i++)
            m->cells[g][i] = (struct kv_cell) { .pos = -1, .token = -1 };
    }
    m->chain = calloc((size_t) cfg->max_seqs * MOCK_MAX_MTP, sizeof(int32_t));
    if (!m->chain)
        goto out_nomem;
    f->vocab_size = cfg->vocab_size;
    f->n_mtp = cfg->n_mtp;
    f->mtp_kv_groups = cfg->mtp_kv_groups;
    f->max_tokens_per_step = cfg->max_tokens_per_step;
    f->max_seqs = cfg->max_seqs;
    f->block_size = cfg->block_size;
    f->n_blocks[0] = cfg->n_blocks[0];
    f->n_blocks[1] = cfg->n_blocks[1];
    *ret = f;
    return 0;

out_nomem:
    mock_free(f);
    return -ENOMEM;
}

void mock_forward_stats(const struct forward *f, struct mock_stats *ret)
{
    memset(ret, 0, sizeof(*ret));
    if (f && f->ops == &mock_ops)
        *ret = ((const struct mock *) f->impl)->stats;
}
