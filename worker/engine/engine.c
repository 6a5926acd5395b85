/* engine.c - rank 0's serving loop: inbox, deadlines, schedule, forward, verify, stop,
 * propose, deliver.
 *
 * Request life: engine_submit puts a request on the inbox and on the `all` list (both
 * under e->lock; `all` is what engine_abort scans).  The step thread moves the inbox to
 * its private `live` list and into the batcher, and from then on is the only one that
 * touches the request, except for the atomic abort flag.  A finished request gets its
 * final callback and is unlinked and freed by the step thread, after the callbacks.
 * Prefix cache: after every step each running request commits its computed blocks to the
 * KV pool (kv_seq_commit), a finishing one before its blocks are released, with how far
 * each MTP layer's KV is final: layer j is final below min(end of its last contiguous
 * run, known tokens - j - 1), the positions whose inputs held no draft.
 */
#include "clock.h"
#include "engine.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "batcher.h"
#include "grammar.h"
#include "kv.h"
#include "log.h"
#include "sha256.h"
#include "spec-policy.h"

#define RATE_SAMPLES 32

struct ereq {
    struct batch_seq seq;            /* first member: container of the batcher's view */
    struct ereq *all_prev, *all_next; /* e->all, under e->lock */
    struct ereq *live_next;          /* inbox (under lock) then live list (step thread) */
    char id[ENGINE_MAX_ID_LEN + 1];
    int32_t *tokens;                 /* [cap_tokens] prompt, output, then scratch drafts */
    int32_t cap_tokens;
    int n_prompt;
    int n_output;
    int n_emitted;
    int max_tokens;                  /* effective */
    int min_tokens;
    bool ignore_eos;
    int32_t *stop_ids;
    int n_stop;
    struct sampling_params sp;
    struct sampler_bias *bias;
    int32_t *ban;                    /* min_tokens ban list (stop ids + EOS) */
    int k;                           /* speculative depth for this request */
    int64_t deadline_usec;
    int32_t drafts[SPEC_MAX_K];
    int32_t fill_drafts[SPEC_MAX_K]; /* scratch of prompt-chunk MTP fills */
    uint8_t root[KV_DIGEST_BYTES];   /* prefix-cache chain root (seq.cache_root points here) */
    int32_t mtp_end[SPEC_MAX_K];     /* MTP layer j last wrote positions up to here (-1: none) */
    int32_t mtp_final[SPEC_MAX_K];   /* its KV is final below here (contiguously from 0) */
    int n_cached;                    /* prompt tokens reused at the first admission */
    float *q;                        /* [k * vocab] draft distributions (sampled + k > 0) */
    int logprobs;                    /* -1 none, else top-N */
    struct engine_logprob *lp;       /* [1 + SPEC_MAX_K]: the tokens not yet delivered */
    struct grammar_matcher *gm;      /* structured output (NULL: free) */
    engine_output_cb cb;
    void *ud;
    atomic_bool abort_flag;
    bool counted_queued;             /* still counted in e->n_queued */
    bool unlinked;                   /* removed from e->all (finished) */
    bool done;
    enum engine_finish finish;
    int32_t stop_token;
    char message[256];
    struct spec_stats mtp;
    struct spec_accept acc;          /* recent acceptance, for the draft policy */
    int64_t t_arrival, t_sched, t_first, t_last;
    struct engine_image *images;     /* copies (views and pixels) until encoded, then NULL */
    int n_images;
    float *img_emb;                  /* [image tokens of the prompt, hidden] once encoded */
};

/* The encoder cache: outputs by image content hash, least recently used evicted. */
struct img_cache_ent {
    uint8_t key[32];
    float *rows;                     /* NULL: empty entry */
    int n_rows;
    uint64_t used;
};

struct engine {
    struct engine_config cfg;
    struct forward *f;
    int vocab;
    int kmax;
    int max_blocks_per_seq;
    struct kv_pool *kv;
    struct batcher *b;
    struct sampler *smp;
    uint8_t salt[KV_DIGEST_BYTES];   /* deployment salt of the prefix-cache keys */
    struct spec_policy *pol;
    pthread_mutex_t gv_lock;          /* the grammar vocabulary, built at first use */
    struct grammar_vocab *gv;

    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct ereq *inbox_head, *inbox_tail;
    struct ereq *all;
    int n_alive;
    int n_queued;                    /* submitted, never admitted (bounded by max_waiting) */
    bool stopping;
    bool started;
    pthread_t thread;
    uint64_t arrival_ctr;
    struct engine_loads snap;

    /* step thread */
    struct ereq *live;
    int last_error;
    uint64_t n_steps, n_generated;
    int64_t t_forward_us, t_mtp_us, t_engine_us;
    struct spec_stats mtp_total;
    /* the draft vocabulary (engine_config.draft_vocab): output counts per token id */
    uint32_t *dv_count;
    uint64_t dv_counted, dv_next, dv_installs;
    bool dv_on;
    double dv_cover;
    int64_t rate_t[RATE_SAMPLES];
    uint64_t rate_n[RATE_SAMPLES];
    int rate_i;

    /* step buffers, reserved at creation */
    struct step_plan plan;
    struct step_seq *pseqs;
    int32_t *ptokens;
    int32_t *pblocks[_KV_GROUP_MAX];
    float *logits;
    float *mtp_logits;
    int32_t *ids;                    /* [rows] the rows' argmaxes (forward.step_argmax) */
    int32_t *mtp_ids;                /* [max_num_seqs] the drafts (forward.mtp_step_argmax) */
    bool argmax_off;                 /* the forward refused step_argmax: logits from now on */
    int32_t *cand_ids;               /* [rows, SAMPLER_CANDS_MAX] (forward.step_topk) */
    float *cand_vals;                /* [rows, SAMPLER_CANDS_MAX] */
    double *cand_sums;               /* [rows] */
    float *cand_temps;               /* [rows] */
    bool topk_off;                   /* the forward refused step_topk: logits from now on */
    bool topk_sum_off;               /* ... refused it with temps: top_p rows take logits */
    float *probs_buf;
    float *lp_buf;                   /* [vocab] one row's logprobs */
    int32_t *n_valid, *tok_in, *tok_scratch;
    struct spec_seq *sseqs;
    struct batch_seq **sched;        /* copy of the batcher's list (finishing edits it) */
    /* images (cfg.vision): the plan's rows and per-token index, the encoder cache */
    float *img_buf;                  /* [max_num_batched_tokens + max_num_seqs * K, hidden] */
    int32_t *img_row;                /* [max_num_batched_tokens] */
    int32_t *img_next;               /* [max_num_seqs * STEP_PLAN_IMG_NEXT] */
    struct img_cache_ent *icache;    /* [cfg.image_cache_entries] */
    uint64_t icache_tick, n_img_encodes, n_img_hits;
};

int64_t engine_now_usec(void)
{
    return clk_now_us();
}

/* engine_config.clock now: what deadlines and the engine's own costs are measured on */
static int64_t clock_us(const struct engine *e)
{
    return clk_src_now_us(&e->cfg.clock);
}

static const char *const finish_names[_ENGINE_FINISH_MAX] = {
    [ENGINE_FINISH_NONE] = "none",     [ENGINE_FINISH_STOP] = "stop",
    [ENGINE_FINISH_LENGTH] = "length", [ENGINE_FINISH_ABORT] = "abort",
    [ENGINE_FINISH_DEADLINE] = "deadline", [ENGINE_FINISH_ERROR] = "error",
};

const char *engine_finish_name(enum engine_finish f)
{
    return f >= 0 && f < _ENGINE_FINISH_MAX ? finish_names[f] : "?";
}

void engine_config_init(struct engine_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_num_batched_tokens = 512;
    cfg->max_model_len = 4096;
    cfg->max_waiting = 256;
    cfg->enable_prefix_caching = true;
    cfg->image_cache_entries = 16;
    cfg->image_batch_views = 8;
}

void engine_request_init(struct engine_request *r)
{
    memset(r, 0, sizeof(*r));
    sampling_params_init(&r->sampling);
    r->num_speculative_tokens = -1;
    r->logprobs = -1;
    r->constraint_start = -1;
}

/* --- creation --- */

static int check_config(struct engine_config *c, const struct forward *f, struct err_buf *err)
{
    if (!f || !f->ops || !f->ops->step || f->vocab_size <= 0 || f->max_seqs <= 0 ||
        f->block_size <= 0 || f->max_tokens_per_step <= 0)
        return err_set(err, -EINVAL, "engine: forward is incomplete");
    if (c->max_num_seqs <= 0)
        c->max_num_seqs = f->max_seqs;
    if (c->max_num_seqs > f->max_seqs)
        return err_set(err, -EINVAL, "--max-num-seqs: %d exceeds the forward's %d",
                       c->max_num_seqs, f->max_seqs);
    if (c->max_num_batched_tokens <= 0 || c->max_num_batched_tokens > f->max_tokens_per_step)
        return err_set(err, -EINVAL, "--max-num-batched-tokens: %d is not in 1..%d",
                       c->max_num_batched_tokens, f->max_tokens_per_step);
    if (c->max_num_batched_tokens < 1 + SPEC_MAX_K && c->num_speculative_tokens > 0)
        return err_set(err, -EINVAL, "--max-num-batched-tokens: %d leaves no room for %d drafts",
                       c->max_num_batched_tokens, c->num_speculative_tokens);
    if (c->max_model_len < 2)
        return err_set(err, -EINVAL, "--max-model-len: %d is too small", c->max_model_len);
    if (c->max_waiting < 0)
        return err_set(err, -EINVAL, "max_waiting: must be >= 0");
    if (c->sliding_window < 0)
        return err_set(err, -EINVAL, "sliding_window: must be >= 0");
    if (spec_k_check("num_speculative_tokens", c->num_speculative_tokens, false, err) < 0)
        return -EINVAL;
    if (c->test_digest_cut_bits < 0 || c->test_digest_cut_bits > 8 * KV_DIGEST_BYTES)
        return err_set(err, -EINVAL, "test_digest_cut_bits: %d is not in 0..%d",
                       c->test_digest_cut_bits, 8 * KV_DIGEST_BYTES);
    if (c->vision && (!c->vision->encode || !c->vision->view_tokens || c->vision->hidden <= 0 ||
                      c->vision->image_token_id < 0 || c->vision->image_token_id >= f->vocab_size))
        return err_set(err, -EINVAL, "vision: incomplete encoder or image_token_id %d outside "
                       "the vocabulary", c->vision->image_token_id);
    if (c->image_cache_entries < 0)
        return err_set(err, -EINVAL, "image_cache_entries: must be >= 0");
    if (c->image_batch_views < 1)
        return err_set(err, -EINVAL, "image_batch_views: must be >= 1");
    if (c->n_eos < 0 || c->n_eos > ENGINE_MAX_EOS)
        return err_set(err, -EINVAL, "eos_ids: %d ids (max %d)", c->n_eos, ENGINE_MAX_EOS);
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_ids[i] < 0 || c->eos_ids[i] >= f->vocab_size)
            return err_set(err, -EINVAL, "eos_ids[%d]: %d is outside the vocabulary (%d)", i,
                           c->eos_ids[i], f->vocab_size);
    if (c->draft_vocab < 0 || c->draft_vocab % 64 || c->draft_vocab > f->vocab_size)
        return err_set(err, -EINVAL, "draft_vocab: %d is not a multiple of 64 in 0..%d (the "
                       "vocabulary)", c->draft_vocab, f->vocab_size);
    if (c->draft_vocab > 0 && f->n_mtp > 0 && !f->ops->set_draft_vocab)
        return err_set(err, -EINVAL, "draft_vocab: the forward '%s' has no draft vocabulary",
                       f->ops->name);
    if (c->num_speculative_tokens > f->n_mtp) {
        log_warn("engine: %d speculative tokens requested but the forward has %d MTP layers; "
                 "using %d", c->num_speculative_tokens, f->n_mtp, f->n_mtp);
        c->num_speculative_tokens = f->n_mtp;
    }
    /* one sequence of max_model_len must fit, or it could never finish */
    int bs = f->block_size;
    int full = (c->max_model_len + SPEC_MAX_K + bs - 1) / bs;
    if (full > f->n_blocks[KV_GROUP_FULL])
        return err_set(err, -EINVAL, "--max-model-len: %d needs %d KV blocks of %d tokens, the "
                       "full-attention pool has %d", c->max_model_len, full, bs,
                       f->n_blocks[KV_GROUP_FULL]);
    int sliding = full;
    if (c->sliding_window > 0) {
        /* + the MTP repair margin (engine_new) */
        int margin = f->n_mtp < SPEC_MAX_K ? f->n_mtp : SPEC_MAX_K;
        int s = (c->sliding_window + margin + c->max_num_batched_tokens + bs - 1) / bs + 1;
        sliding = s < full ? s : full;
    }
    if (sliding > f->n_blocks[KV_GROUP_SLIDING])
        return err_set(err, -EINVAL, "KV: one sequence needs %d sliding blocks, the pool has %d",
                       sliding, f->n_blocks[KV_GROUP_SLIDING]);
    return 0;
}

static int alloc_buffers(struct engine *e)
{
    size_t ms = (size_t) e->cfg.max_num_seqs;
    size_t v = (size_t) e->vocab;
    size_t rows = ms * (1 + SPEC_MAX_K);
    e->pseqs = calloc(ms, sizeof(*e->pseqs));
    e->ptokens = calloc((size_t) e->cfg.max_num_batched_tokens, sizeof(int32_t));
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        e->pblocks[g] = calloc(ms * (size_t) e->max_blocks_per_seq, sizeof(int32_t));
    e->logits = malloc(rows * v * sizeof(float));
    e->mtp_logits = malloc(ms * v * sizeof(float));
    e->ids = calloc(rows, sizeof(int32_t));
    e->mtp_ids = calloc(ms, sizeof(int32_t));
    e->cand_ids = calloc(rows * SAMPLER_CANDS_MAX, sizeof(int32_t));
    e->cand_vals = calloc(rows * SAMPLER_CANDS_MAX, sizeof(float));
    e->cand_sums = calloc(rows, sizeof(double));
    e->cand_temps = calloc(rows, sizeof(float));
    e->probs_buf = malloc((SPEC_MAX_K + 2) * v * sizeof(float));
    e->lp_buf = malloc(v * sizeof(float));
    e->n_valid = calloc(ms, sizeof(int32_t));
    e->tok_in = calloc(ms, sizeof(int32_t));
    e->tok_scratch = calloc(ms, sizeof(int32_t));
    e->sseqs = calloc(ms, sizeof(*e->sseqs));
    e->sched = calloc(ms, sizeof(*e->sched));
    if (!e->sched ||!e->pseqs || !e->ptokens || !e->pblocks[0] || !e->pblocks[1] || !e->logits ||
        !e->mtp_logits || !e->ids || !e->mtp_ids || !e->probs_buf || !e->lp_buf || !e->n_valid ||
        !e->tok_in || !e->tok_scratch || !e->sseqs || !e->cand_ids || !e->cand_vals ||
        !e->cand_sums || !e->cand_temps)
        return -ENOMEM;
    if (e->cfg.vision) {
        size_t nt = (size_t) e->cfg.max_num_batched_tokens;
        e->img_buf = malloc((nt + ms * SPEC_MAX_K) * (size_t) e->cfg.vision->hidden * sizeof(float));
        e->img_row = malloc(nt * sizeof(int32_t));
        e->img_next = malloc(ms * STEP_PLAN_IMG_NEXT * sizeof(int32_t));
        e->icache = calloc((size_t) e->cfg.image_cache_entries + 1, sizeof(*e->icache));
        if (!e->img_buf || !e->img_row || !e->img_next || !e->icache)
            return -ENOMEM;
    }
    e->plan.seqs = e->pseqs;
    e->plan.tokens = e->ptokens;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        e->plan.blocks[g] = e->pblocks[g];
    return 0;
}

int engine_new(struct forward *f, const struct engine_config *cfg, struct engine **ret,
               struct err_buf *err)
{
    struct engine_config c = *cfg;
    int r = check_config(&c, f, err);
    if (r < 0)
        return r;
    struct engine *e = calloc(1, sizeof(*e));
    if (!e)
        return -ENOMEM;
    e->cfg = c;
    e->f = f;
    e->vocab = f->vocab_size;
    e->kmax = f->n_mtp < SPEC_MAX_K ? f->n_mtp : SPEC_MAX_K;
    int max_len = c.max_model_len + SPEC_MAX_K + 1;
    e->max_blocks_per_seq = (max_len + f->block_size - 1) / f->block_size;
    pthread_mutex_init(&e->lock, NULL);
    pthread_mutex_init(&e->gv_lock, NULL);
    pthread_cond_init(&e->cond, NULL);
    if (c.prefix_cache_salt) {
        sha256(c.prefix_cache_salt, strlen(c.prefix_cache_salt), e->salt);
    } else if (getrandom(e->salt, sizeof(e->salt), 0) != (ssize_t) sizeof(e->salt)) {
        r = -errno;
        err_set(err, r, "engine: no random bytes for the prefix-cache salt: %s", err_str(r));
        engine_free(e);
        return r;
    }
    e->cfg.prefix_cache_salt = NULL;    /* not kept: the caller's string */

    struct kv_pool_config kc = {
        .block_size = f->block_size,
        .n_blocks = { f->n_blocks[0], f->n_blocks[1] },
        /* sliding blocks stay kmax positions longer than the window: the MTP layers re-run
         * the last kmax positions before a run (model.h, the "no trace" repair), and those
         * queries read their own window */
        .sliding_window = c.sliding_window > 0 ? c.sliding_window + e->kmax : 0,
        .max_seqs = c.max_num_seqs,
        .max_seq_len = max_len,
        .prefix_cache = c.enable_prefix_caching,
        .mtp_group = { (f->mtp_kv_groups >> KV_GROUP_FULL) & 1,
                       (f->mtp_kv_groups >> KV_GROUP_SLIDING) & 1 },
        .test_digest_cut_bits = c.test_digest_cut_bits,
    };
    struct batcher_config bc = {
        .max_num_batched_tokens = c.max_num_batched_tokens,
        .max_seqs = c.max_num_seqs,
        .max_waiting = c.max_waiting,
    };
    r = kv_pool_new(&kc, &e->kv);
    if (r == 0)
        r = batcher_new(&bc, e->kv, &e->b);
    if (r == 0)
        r = sampler_new(e->vocab, &e->smp);
    if (r == 0)
        r = spec_policy_new(c.spec_policy, c.max_num_seqs, e->kmax, c.sliding_window, &c.clock,
                            &e->pol);
    if (r == 0)
        r = alloc_buffers(e);
    if (r == 0 && c.draft_vocab > 0 && e->kmax > 0) {
        e->dv_count = calloc((size_t)e->vocab, sizeof(*e->dv_count));
        e->dv_next = 8 * (uint64_t)c.draft_vocab;
        r = e->dv_count ? 0 : -ENOMEM;
    }
    if (r < 0) {
        err_set(err, r, "engine: cannot reserve buffers: %s", err_str(r));
        engine_free(e);
        return r;
    }
    *ret = e;
    return 0;
}

/* --- requests --- */

static void images_free(struct engine_image *im, int n)
{
    for (int i = 0; im && i < n; i++) {
        for (int j = 0; im[i].views && j < im[i].n_views; j++)
            free((void *) im[i].views[j].rgb);
        free((void *) im[i].views);
    }
    free(im);
}

static void ereq_free(struct ereq *r)
{
    if (!r)
        return;
    images_free(r->images, r->n_images);
    free(r->img_emb);
    free(r->tokens);
    free(r->stop_ids);
    free(r->bias);
    free(r->ban);
    free(r->q);
    free(r->lp);
    grammar_matcher_free(r->gm);
    free(r);
}

static bool id_ok(const char *id)
{
    size_t n = id ? strnlen(id, ENGINE_MAX_ID_LEN + 1) : 0;
    if (n == 0 || n > ENGINE_MAX_ID_LEN)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isprint((unsigned char) id[i]))
            return false;
    return true;
}

/* The images agree with the prompt: each view one the encoder takes, and as many
 * image_token_id in the prompt as the views give rows. */
static int check_images(const struct engine *e, const struct engine_request *q, struct err_buf *err)
{
    const struct engine_vision *v = e->cfg.vision;
    int64_t rows = 0;
    int n_tok = 0;

    if (q->n_images < 0 || (q->n_images > 0 && !q->images))
        return err_set(err, -EINVAL, "images: %d images without their data", q->n_images);
    if (q->n_images == 0)
        return 0;
    if (!v)
        return err_set(err, -EINVAL, "images: this model has no vision encoder (text only)");
    for (int i = 0; i < q->n_images; i++) {
        const struct engine_image *im = &q->images[i];
        if (im->n_views <= 0 || !im->views)
            return err_set(err, -EINVAL, "images[%d]: no views", i);
        for (int j = 0; j < im->n_views; j++) {
            const struct engine_view *w = &im->views[j];
            int t = w->rgb && w->width > 0 && w->height > 0 ? v->view_tokens(v->ctx, w) : -EINVAL;
            if (t < 0)
                return err_set(err, -EINVAL, "images[%d].views[%d]: %dx%d is not a view the "
                               "encoder takes", i, j, w->width, w->height);
            rows += t;
        }
    }
    for (int i = 0; i < q->n_prompt; i++)
        n_tok += q->prompt[i] == v->image_token_id;
    if (n_tok != rows)
        return err_set(err, -EINVAL, "images: the prompt holds %d image tokens (id %d) but the "
                       "%d images' views give %lld rows", n_tok, v->image_token_id, q->n_images,
                       (long long) rows);
    return 0;
}

/* Copies of the request's images (views and pixels), kept until the step encodes them.
 * Each copy's sha256 becomes the engine's own key: SHA-256 over the client's hash and every
 * view's size and pixels, so a hash that does not match its pixels can neither take
 * another image's encoder rows nor share its KV. */
static int images_copy(struct ereq *r, const struct engine_request *q)
{
    if (q->n_images == 0)
        return 0;
    r->images = calloc((size_t) q->n_images, sizeof(*r->images));
    if (!r->images)
        return -ENOMEM;
    r->n_images = q->n_images;
    for (int i = 0; i < q->n_images; i++) {
        const struct engine_image *src = &q->images[i];
        struct engine_view *views = calloc((size_t) src->n_views, sizeof(*views));
        r->images[i] = *src;
        r->images[i].views = views;
        if (!views) {
            r->images[i].n_views = 0;
            return -ENOMEM;
        }
        struct sha256 h;
        sha256_init(&h);
        sha256_update(&h, src->sha256, sizeof(src->sha256));
        for (int j = 0; j < src->n_views; j++) {
            size_t n = (size_t) src->views[j].width * (size_t) src->views[j].height * 3;
            int32_t wh[2] = { src->views[j].width, src->views[j].height };
            uint8_t *px = malloc(n);
            if (!px)
                return -ENOMEM;
            memcpy(px, src->views[j].rgb, n);
            views[j] = src->views[j];
            views[j].rgb = px;
            sha256_update(&h, wh, sizeof(wh));
            sha256_update(&h, px, n);
        }
        sha256_final(&h, r->images[i].sha256);
    }
    return 0;
}

static int check_request(const struct engine *e, const struct engine_request *q, struct err_buf *err)
{
    const char *field = NULL;
    if (!id_ok(q->id))
        return err_set(err, -EINVAL, "request_id: must be 1..%d printable bytes", ENGINE_MAX_ID_LEN);
    if (!q->prompt || q->n_prompt <= 0)
        return err_set(err, -EINVAL, "token_ids: empty prompt");
    if (q->n_prompt >= e->cfg.max_model_len)
        return err_set(err, -EINVAL, "token_ids: %d prompt tokens leave no room under "
                       "max_model_len %d", q->n_prompt, e->cfg.max_model_len);
    for (int i = 0; i < q->n_prompt; i++)
        if (q->prompt[i] < 0 || q->prompt[i] >= e->vocab)
            return err_set(err, -EINVAL, "token_ids[%d]: %d is outside the vocabulary (0..%d)",
                           i, q->prompt[i], e->vocab - 1);
    if (sampling_params_check(&q->sampling, e->vocab, &field) < 0)
        return err_set(err, -EINVAL, "sampling_params.%s: out of range", field);
    if (q->min_tokens < 0)
        return err_set(err, -EINVAL, "sampling_params.min_tokens: must be >= 0");
    if (q->max_tokens > 0 && q->min_tokens > q->max_tokens)
        return err_set(err, -EINVAL, "sampling_params.min_tokens: exceeds max_tokens");
    if (q->n_stop_token_ids < 0 || q->n_stop_token_ids > ENGINE_MAX_STOP_IDS ||
        (q->n_stop_token_ids > 0 && !q->stop_token_ids))
        return err_set(err, -EINVAL, "sampling_params.stop_token_ids: at most %d ids",
                       ENGINE_MAX_STOP_IDS);
    for (int i = 0; i < q->n_stop_token_ids; i++)
        if (q->stop_token_ids[i] < 0 || q->stop_token_ids[i] >= e->vocab)
            return err_set(err, -EINVAL, "sampling_params.stop_token_ids[%d]: %d is outside the "
                           "vocabulary", i, q->stop_token_ids[i]);
    if (spec_k_check("num_speculative_tokens", q->num_speculative_tokens, true, err) < 0)
        return -EINVAL;
    if (q->logprobs < -1 || q->logprobs > ENGINE_MAX_LOGPROBS || q->logprobs >= e->vocab)
        return err_set(err, -EINVAL, "sampling_params.logprobs: %d is not in 0..%d", q->logprobs,
                       ENGINE_MAX_LOGPROBS < e->vocab - 1 ? ENGINE_MAX_LOGPROBS : e->vocab - 1);
    if (q->cache_salt && strnlen(q->cache_salt, ENGINE_MAX_CACHE_SALT + 1) > ENGINE_MAX_CACHE_SALT)
        return err_set(err, -EINVAL, "cache_salt: longer than %d bytes", ENGINE_MAX_CACHE_SALT);
    return check_images(e, q, err);
}

static struct ereq *ereq_new(const struct engine *e, const struct engine_request *q)
{
    struct ereq *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->logprobs = -1;
    snprintf(r->id, sizeof(r->id), "%s", q->id);
    r->n_prompt = q->n_prompt;
    int room = e->cfg.max_model_len - q->n_prompt;
    r->max_tokens = q->max_tokens > 0 && q->max_tokens < room ? q->max_tokens : room;
    r->min_tokens = q->min_tokens;
    r->ignore_eos = q->ignore_eos;
    r->cap_tokens = q->n_prompt + r->max_tokens + SPEC_MAX_K + 1;
    r->tokens = malloc((size_t) r->cap_tokens * sizeof(int32_t));
    r->sp = q->sampling;
    r->sp.min_tokens = 0;
    r->sp.ban = NULL;
    r->sp.n_ban = 0;
    int k = q->num_speculative_tokens < 0 ? e->cfg.num_speculative_tokens : q->num_speculative_tokens;
    r->k = k < e->kmax ? k : e->kmax;
    if (!r->tokens)
        goto out_free;
    memcpy(r->tokens, q->prompt, (size_t) q->n_prompt * sizeof(int32_t));
    if (q->n_stop_token_ids > 0) {
        r->stop_ids = malloc((size_t) q->n_stop_token_ids * sizeof(int32_t));
        if (!r->stop_ids)
            goto out_free;
        memcpy(r->stop_ids, q->stop_token_ids, (size_t) q->n_stop_token_ids * sizeof(int32_t));
        r->n_stop = q->n_stop_token_ids;
    }
    if (q->sampling.n_logit_bias > 0) {
        r->bias = malloc((size_t) q->sampling.n_logit_bias * sizeof(*r->bias));
        if (!r->bias)
            goto out_free;
        memcpy(r->bias, q->sampling.logit_bias, (size_t) q->sampling.n_logit_bias * sizeof(*r->bias));
        r->sp.logit_bias = r->bias;
    }
    if (q->min_tokens > 0) {
        /* EOS (unless ignored) and stop ids cannot be sampled before min_tokens */
        int n = r->n_stop + (q->ignore_eos ? 0 : e->cfg.n_eos);
        r->ban = malloc((size_t) (n > 0 ? n : 1) * sizeof(int32_t));
        if (!r->ban)
            goto out_free;
        memcpy(r->ban, r->stop_ids ? r->stop_ids : r->ban, (size_t) r->n_stop * sizeof(int32_t));
        if (!q->ignore_eos)
            memcpy(r->ban + r->n_stop, e->cfg.eos_ids, (size_t) e->cfg.n_eos * sizeof(int32_t));
        r->sp.min_tokens = q->min_tokens;
        r->sp.ban = r->ban;
        r->sp.n_ban = n;
    }
    if (r->k > 0 && !sampling_params_greedy(&r->sp)) {
        r->q = malloc((size_t) r->k * (size_t) e->vocab * sizeof(float));
        if (!r->q)
            goto out_free;
    }
    r->logprobs = q->logprobs;
    if (r->logprobs >= 0) {
        /* outputs are delivered every step: at most 1 + K tokens wait for it */
        r->lp = calloc(1 + SPEC_MAX_K, sizeof(*r->lp));
        if (!r->lp)
            goto out_free;
    }
    r->seq.priority = q->priority;
    r->seq.n_known = q->n_prompt;
    r->seq.slot = -1;
    r->seq.tokens = r->tokens;
    r->seq.mtp_depth = r->k;
    /* the prefix cache's MTP bound (docs/ARCHITECTURE.md): only a client's seed promises a
     * realisation, and a sampled sequence's tokens depend on the drafts they were verified
     * against (either policy keeps its depth: spec_seq.keep_depth), so only it reuses blocks whose MTP KV is
     * final alone: the same tokens as with the cache off.  Every other request reuses the
     * trunk's prefix whatever its MTP KV (its drafts read holes until the window passes):
     * greedy output does not depend on the drafts, sampled output with a drawn seed need
     * only be the target's distribution, which it is whatever they are (the rejection test) */
    r->seq.mtp_exact = r->k > 0 && !sampling_params_greedy(&r->sp) && !q->seed_random;
    if (images_copy(r, q) < 0)
        goto out_free;
    if (e->cfg.enable_prefix_caching) {
        kv_prefix_root(e->salt, q->cache_salt, q->cache_salt ? strlen(q->cache_salt) : 0, r->root);
        if (q->n_images > 0) {
            /* the images' hashes, in order, enter the chain's root: the same tokens with
             * other images (or in another order) never share KV */
            struct sha256 h;
            sha256_init(&h);
            sha256_update(&h, r->root, sizeof(r->root));
            for (int i = 0; i < r->n_images; i++)
                sha256_update(&h, r->images[i].sha256, sizeof(r->images[i].sha256));
            sha256_final(&h, r->root);
        }
        r->seq.cache_root = r->root;
    }
    r->deadline_usec = q->deadline_usec;
    r->stop_token = -1;
    atomic_init(&r->abort_flag, false);
    return r;

out_free:
    ereq_free(r);
    return NULL;
}

/* The request's grammar matcher, compiled on the caller's thread (never the step's); the
 * vocabulary is built by the first constrained request. */
static int constraint_new(struct engine *e, const struct engine_request *q,
                          struct grammar_matcher **ret, struct err_buf *err)
{
    int r = 0;

    if (!q->constraint_kind)
        return err_set(err, -EINVAL, "structured_output: a constraint needs its kind");
    if (!e->cfg.grammar_tokenizer)
        return err_set(err, -EINVAL, "structured_output: this engine has no tokenizer for "
                       "the grammar engine");
    if (q->constraint_start >= e->vocab)
        return err_set(err, -EINVAL, "structured_output.start_token: %d is outside the vocabulary",
                       q->constraint_start);
    pthread_mutex_lock(&e->gv_lock);
    if (!e->gv)
        r = grammar_vocab_new(e->cfg.grammar_tokenizer, e->vocab, e->cfg.eos_ids,
                              e->cfg.n_eos, &e->gv, err);
    pthread_mutex_unlock(&e->gv_lock);
    if (r < 0)
        return r == -ENOENT || r == -ENOEXEC ? err_set(err, -EOPNOTSUPP, "%s", err->msg) : r;
    r = grammar_matcher_new(e->gv, q->constraint_kind, q->constraint, q->constraint_start, ret, err);
    if (r < 0)
        err_prefix(err, "structured_output.%s", q->constraint_kind);
    return r;
}

int engine_submit(struct engine *e, const struct engine_request *q, engine_output_cb cb, void *ud,
                  struct err_buf *err)
{
    if (!cb)
        return err_set(err, -EINVAL, "engine_submit: no output callback");
    int r = check_request(e, q, err);
    if (r < 0)
        return r;
    struct grammar_matcher *gm = NULL;
    if (q->constraint && (r = constraint_new(e, q, &gm, err)) < 0)
        return r;
    struct ereq *req = ereq_new(e, q);
    if (!req) {
        grammar_matcher_free(gm);
        return err_set(err, -ENOMEM, "out of memory");
    }
    req->gm = gm;
    req->cb = cb;
    req->ud = ud;
    req->t_arrival = engine_now_usec();

    pthread_mutex_lock(&e->lock);
    if (e->stopping || e->last_error) {
        r = err_set(err, -ESHUTDOWN, "engine is %s", e->last_error ? "failed" : "stopping");
        goto out_unlock;
    }
    /* one bound, the capacity the engine reports (engine_get_loads): it also keeps
     * preempted requests (back in the queue) within the batcher's max_waiting + max_seqs
     * waiting slots */
    if (e->n_alive >= e->cfg.max_waiting + e->cfg.max_num_seqs) {
        r = err_set(err, -EAGAIN, "the engine is at capacity: %d requests in flight "
                    "(max_num_seqs %d + max_waiting %d); the waiting queue is full",
                    e->n_alive, e->cfg.max_num_seqs, e->cfg.max_waiting);
        goto out_unlock;
    }
    for (struct ereq *o = e->all; o; o = o->all_next) {
        if (strcmp(o->id, req->id) == 0) {
            r = err_set(err, -EEXIST, "request_id: \"%s\" is already in flight", req->id);
            goto out_unlock;
        }
    }
    req->seq.arrival = ++e->arrival_ctr;
    e->snap.n_requests_created++;
    req->counted_queued = true;
    e->n_queued++;
    e->n_alive++;
    req->all_next = e->all;
    if (e->all)
        e->all->all_prev = req;
    e->all = req;
    if (e->inbox_tail)
        e->inbox_tail->live_next = req;
    else
        e->inbox_head = req;
    e->inbox_tail = req;
    pthread_cond_signal(&e->cond);
    pthread_mutex_unlock(&e->lock);
    return 0;

out_unlock:
    pthread_mutex_unlock(&e->lock);
    ereq_free(req);
    return r;
}

int engine_abort(struct engine *e, const char *const *ids, int n_ids)
{
    int found = 0;
    pthread_mutex_lock(&e->lock);
    for (int i = 0; i < n_ids; i++) {
        if (!ids[i])
            continue;
        for (struct ereq *o = e->all; o; o = o->all_next) {
            if (strcmp(o->id, ids[i]) == 0) {
                atomic_store(&o->abort_flag, true);
                found++;
                break;
            }
        }
    }
    if (found)
        pthread_cond_signal(&e->cond);
    pthread_mutex_unlock(&e->lock);
    return found;
}

/* --- step helpers --- */

static int engine_step_inner(struct engine *e);

/* Hand the request's computed blocks to the prefix cache (running requests only). */
static void commit_blocks(struct engine *e, struct ereq *r)
{
    if (r->seq.state == BATCH_STATE_RUNNING)
        kv_seq_commit(e->kv, r->seq.slot, r->tokens, r->seq.n_computed, r->mtp_final, r->k);
}

static void finish(struct engine *e, struct ereq *r, enum engine_finish why, const char *msg)
{
    if (r->done)
        return;
    commit_blocks(e, r);
    batcher_remove(e->b, &r->seq);
    r->done = true;
    r->finish = why;
    snprintf(r->message, sizeof(r->message), "%s", msg ? msg : "");
}

static void take_inbox(struct engine *e)
{
    pthread_mutex_lock(&e->lock);
    struct ereq *head = e->inbox_head;
    e->inbox_head = e->inbox_tail = NULL;
    pthread_mutex_unlock(&e->lock);
    while (head) {
        struct ereq *r = head;
        head = r->live_next;
        r->live_next = e->live;
        e->live = r;
        /* the submit-time bound guarantees room; preempted ones bypass the bound */
        int rc = batcher_add(e->b, &r->seq);
        if (rc < 0)
            finish(e, r, ENGINE_FINISH_ERROR, "waiting queue is full");
    }
}

/* The cache entry of key, or NULL; a hit becomes the most recently used. */
static struct img_cache_ent *icache_find(struct engine *e, const uint8_t key[32])
{
    for (int i = 0; i < e->cfg.image_cache_entries; i++) {
        struct img_cache_ent *c = &e->icache[i];
        if (c->rows && memcmp(c->key, key, 32) == 0) {
            c->used = ++e->icache_tick;
            return c;
        }
    }
    return NULL;
}

/* Keep a copy of rows [n, hidden] under key, evicting the least recently used entry
 * (out of memory: not kept). */
static void icache_put(struct engine *e, const uint8_t key[32], const float *rows, int n)
{
    struct img_cache_ent *lru = NULL;
    size_t bytes = (size_t) n * (size_t) e->cfg.vision->hidden * sizeof(float);
    float *copy;

    for (int i = 0; i < e->cfg.image_cache_entries; i++) {
        struct img_cache_ent *c = &e->icache[i];
        if (!lru || !c->rows || (lru->rows && c->used < lru->used))
            lru = c;
        if (!c->rows)
            break;
    }
    if (!lru || !(copy = malloc(bytes)))
        return;
    memcpy(copy, rows, bytes);
    free(lru->rows);
    memcpy(lru->key, key, 32);
    lru->rows = copy;
    lru->n_rows = n;
    lru->used = ++e->icache_tick;
}

/* One image of a request new this step that the cache did not have: its rows go to
 * r->img_emb from row off.  src < 0: encoded by this job; else the job with the same key
 * earlier in the step, whose rows it takes. */
struct enc_job {
    struct ereq *r;
    int image;                       /* index in r->images */
    int64_t off;
    int n;                           /* rows */
    int n_views;
    int src;
    int rc;                          /* < 0: the encoder failed on it (why says how) */
    char why[192];
};

static int image_rows(const struct engine_vision *v, const struct engine_image *im)
{
    int n = 0;
    for (int j = 0; j < im->n_views; j++)
        n += v->view_tokens(v->ctx, &im->views[j]);
    return n;
}

/* One encoder call over the images of jobs idx[0..n): every view in order, then each
 * job's rows to its request and the cache.  When a call of several images fails (or its
 * buffers cannot be had) each image is encoded again alone, so a failure stays with the
 * image that causes it. */
static void encode_call(struct engine *e, struct enc_job *jobs, const int *idx, int n)
{
    const struct engine_vision *v = e->cfg.vision;
    size_t H = (size_t) v->hidden;
    struct err_buf eb = { { 0 } };
    struct engine_view *views = NULL;
    float *out = NULL;
    int64_t rows = 0;
    int nv = 0, rc;

    for (int i = 0; i < n; i++) {
        rows += jobs[idx[i]].n;
        nv += jobs[idx[i]].r->images[jobs[idx[i]].image].n_views;
    }
    if (n == 1) {
        struct enc_job *j = &jobs[idx[0]];
        const struct engine_image *im = &j->r->images[j->image];
        out = j->r->img_emb + j->off * H;
        rc = v->encode(v->ctx, im->views, im->n_views, out, &eb);
        if (rc < 0) {
            j->rc = rc;
            snprintf(j->why, sizeof(j->why), "%.180s", eb.msg);
            return;
        }
        e->n_img_encodes++;
        icache_put(e, im->sha256, out, j->n);
        return;
    }
    views = malloc((size_t) nv * sizeof(*views));
    out = malloc((size_t) rows * H * sizeof(float));
    rc = views && out ? 0 : -ENOMEM;
    nv = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        const struct engine_image *im = &jobs[idx[i]].r->images[jobs[idx[i]].image];
        memcpy(views + nv, im->views, (size_t) im->n_views * sizeof(*views));
        nv += im->n_views;
    }
    if (rc == 0)
        rc = v->encode(v->ctx, views, nv, out, &eb);
    if (rc < 0) {
        free(views);
        free(out);
        for (int i = 0; i < n; i++)
            encode_call(e, jobs, idx + i, 1);
        return;
    }
    rows = 0;
    for (int i = 0; i < n; i++) {
        struct enc_job *j = &jobs[idx[i]];
        float *dst = j->r->img_emb + j->off * H;
        memcpy(dst, out + rows * H, (size_t) j->n * H * sizeof(float));
        rows += j->n;
        e->n_img_encodes++;
        icache_put(e, j->r->images[j->image].sha256, dst, j->n);
    }
    free(views);
    free(out);
}

/* The rows of every image of the requests new to the step thread (before they are
 * scheduled): from the cache by key, else through the encoder, the images of all these
 * requests in calls of at most image_batch_views views (an image seen twice in the step is
 * encoded once, the other counting as a cache hit; an image is never split over calls).
 * The cap bounds the encoder's scratch, which grows with the patches of a call: about
 * 195 MB per 728² view at full width, 1.6 GB at the default 8; one 728² view already
 * gives the ViT's GEMMs 2704 rows, so more views a call gain little.  A request whose
 * image failed ends with the encoder's sentence; the others go on.  The copies of the
 * pixels are freed. */
static void encode_new(struct engine *e)
{
    const struct engine_vision *v = e->cfg.vision;
    size_t H = (size_t) v->hidden;
    struct enc_job *jobs;
    int *prim, n_jobs = 0, n_prim = 0, n_all = 0;
    char msg[256];

    for (struct ereq *r = e->live; r; r = r->live_next)
        if (!r->done && r->n_images > 0)
            n_all += r->n_images;
    if (n_all == 0)
        return;
    jobs = calloc((size_t) n_all, sizeof(*jobs));
    prim = calloc((size_t) n_all, sizeof(*prim));
    for (struct ereq *r = e->live; r; r = r->live_next) {
        if (r->done || r->n_images == 0)
            continue;
        int64_t rows = 0;
        for (int i = 0; i < r->n_images; i++)
            rows += image_rows(v, &r->images[i]);
        r->img_emb = malloc((size_t) (rows > 0 ? rows : 1) * H * sizeof(float));
        if (!r->img_emb || !jobs || !prim) {
            snprintf(msg, sizeof(msg), "images: out of memory for %lld encoder rows", (long long) rows);
            finish(e, r, ENGINE_FINISH_ERROR, msg);
            continue;
        }
        int64_t off = 0;
        for (int i = 0; i < r->n_images; i++) {
            const struct engine_image *im = &r->images[i];
            struct img_cache_ent *c = icache_find(e, im->sha256);
            int n = image_rows(v, im), src = -1;
            if (c && c->n_rows == n) {
                memcpy(r->img_emb + off * H, c->rows, (size_t) n * H * sizeof(float));
                e->n_img_hits++;
                off += n;
                continue;
            }
            for (int k = 0; k < n_prim && src < 0; k++) {
                struct enc_job *p = &jobs[prim[k]];
                if (p->n == n && memcmp(p->r->images[p->image].sha256, im->sha256, 32) == 0)
                    src = prim[k];
            }
            jobs[n_jobs] = (struct enc_job){ .r = r, .image = i, .off = off, .n = n,
                                             .n_views = im->n_views, .src = src };
            if (src < 0)
                prim[n_prim++] = n_jobs;
            n_jobs++;
            off += n;
        }
    }
    for (int k = 0; k < n_prim;) {
        int nv = jobs[prim[k]].n_views, m = 1;
        while (k + m < n_prim && nv + jobs[prim[k + m]].n_views <= e->cfg.image_batch_views)
            nv += jobs[prim[k + m++]].n_views;
        encode_call(e, jobs, prim + k, m);
        k += m;
    }
    for (int k = 0; k < n_jobs; k++) {
        struct enc_job *j = &jobs[k], *s = j->src < 0 ? j : &jobs[j->src];
        if (s->rc < 0) {
            snprintf(msg, sizeof(msg), "images[%d]: the vision encoder failed: %.180s", j->image, s->why);
            finish(e, j->r, ENGINE_FINISH_ERROR, msg);
        } else if (j != s) {
            memcpy(j->r->img_emb + j->off * H, s->r->img_emb + s->off * H, (size_t) j->n * H * sizeof(float));
            e->n_img_hits++;
        }
    }
    for (struct ereq *r = e->live; r; r = r->live_next)
        if (r->n_images > 0) {
            images_free(r->images, r->n_images);
            r->images = NULL;
            r->n_images = 0;
        }
    free(jobs);
    free(prim);
}

static void expire_and_abort(struct engine *e, int64_t now)
{
    for (struct ereq *r = e->live; r; r = r->live_next) {
        if (r->done)
            continue;
        if (atomic_load(&r->abort_flag))
            finish(e, r, ENGINE_FINISH_ABORT, "aborted");
        else if (r->deadline_usec > 0 && now >= r->deadline_usec)
            finish(e, r, ENGINE_FINISH_DEADLINE,
                   r->seq.state == BATCH_STATE_RUNNING ? "deadline exceeded while running"
                                                       : "deadline exceeded in queue");
    }
}

static bool is_stop(const struct engine *e, const struct ereq *r, int32_t t)
{
    for (int i = 0; i < r->n_stop; i++)
        if (r->stop_ids[i] == t)
            return true;
    if (!r->ignore_eos)
        for (int i = 0; i < e->cfg.n_eos; i++)
            if (e->cfg.eos_ids[i] == t)
                return true;
    return false;
}

/* Append one output token and apply the stop conditions; returns true when finished. */
static bool append_token(struct engine *e, struct ereq *r, int32_t t, int64_t now)
{
    BUG_ON(r->n_prompt + r->n_output >= r->cap_tokens);
    r->tokens[r->n_prompt + r->n_output++] = t;
    r->seq.n_known = r->n_prompt + r->n_output;
    if (e->dv_count) {
        e->dv_count[t]++;
        e->dv_counted++;
    }
    if (!r->t_first)
        r->t_first = now;
    r->t_last = now;
    e->n_generated++;
    if (r->n_output >= r->min_tokens && is_stop(e, r, t)) {
        r->stop_token = t;
        finish(e, r, ENGINE_FINISH_STOP, "");
    } else if (r->n_output >= r->max_tokens || r->seq.n_known >= e->cfg.max_model_len) {
        finish(e, r, ENGINE_FINISH_LENGTH, "");
    }
    return r->done;
}

static struct ereq *req_of(struct batch_seq *s)
{
    return (struct ereq *) s;
}

/* Seq s's run at plan token tok (plan seq i): the prompt's image tokens it covers take the
 * next rows of the plan's image buffer (from n_img on), every other token -1; so do the
 * prompt tokens after a prompt chunk that its MTP fills take as tok_in.  Returns the rows
 * used so far. */
static int32_t plan_images(struct engine *e, struct ereq *r, const struct batch_seq *s, int i,
                           int32_t tok, int32_t n_img)
{
    int32_t id = e->cfg.vision->image_token_id, k = 0;
    size_t H = (size_t) e->cfg.vision->hidden;

    for (int32_t q = 0; r->img_emb && q < s->n_computed && q < r->n_prompt; q++)
        k += r->tokens[q] == id;
    for (int32_t t = 0; t < s->sched_tokens; t++) {
        int32_t pos = s->n_computed + t;
        e->img_row[tok + t] = -1;
        if (r->img_emb && t < s->sched_tokens - s->sched_drafts && pos < r->n_prompt &&
            r->tokens[pos] == id) {
            memcpy(e->img_buf + (size_t) n_img * H, r->img_emb + (size_t) k++ * H, H * sizeof(float));
            e->img_row[tok + t] = n_img++;
        }
    }
    for (int j = 0; j < STEP_PLAN_IMG_NEXT; j++) {
        /* finish_seq's fills: tok_in of depth j is the prompt token at end + j */
        int32_t pos = s->n_computed + s->sched_tokens + j;
        int32_t *at = &e->img_next[i * STEP_PLAN_IMG_NEXT + j];
        *at = -1;
        if (!r->img_emb || s->sched_final || j >= r->k || pos >= r->n_prompt)
            continue;
        if (r->tokens[pos] == id) {
            memcpy(e->img_buf + (size_t) n_img * H, r->img_emb + (size_t) k * H, H * sizeof(float));
            *at = n_img++;
        }
        k += r->tokens[pos] == id;
    }
    return n_img;
}

static void build_plan(struct engine *e, struct batch_seq **seqs, int n)
{
    struct step_plan *p = &e->plan;
    int bs = e->f->block_size;
    int32_t tok = 0, n_img = 0;
    int32_t boff[_KV_GROUP_MAX] = { 0, 0 };
    p->step_id = e->n_steps;
    p->draft_sub = e->dv_on;
    p->n_seqs = n;
    for (int i = 0; i < n; i++) {
        struct batch_seq *s = seqs[i];
        struct ereq *r = req_of(s);
        struct step_seq *ps = &p->seqs[i];
        int32_t n_plain = s->sched_tokens - s->sched_drafts;
        ps->slot = s->slot;
        ps->pos0 = s->n_computed;
        ps->n_tokens = s->sched_tokens;
        ps->n_logits = s->sched_final ? 1 + s->sched_drafts : 0;
        ps->tok_off = tok;
        memcpy(p->tokens + tok, r->tokens + s->n_computed, (size_t) n_plain * sizeof(int32_t));
        memcpy(p->tokens + tok + n_plain, r->drafts, (size_t) s->sched_drafts * sizeof(int32_t));
        if (e->img_row)
            n_img = plan_images(e, r, s, i, tok, n_img);
        tok += s->sched_tokens;
        ps->n_blocks = (ps->pos0 + ps->n_tokens + bs - 1) / bs;
        for (int g = 0; g < _KV_GROUP_MAX; g++) {
            int nb;
            const int32_t *t = kv_seq_table(e->kv, s->slot, g, &nb);
            BUG_ON(nb < ps->n_blocks);
            ps->block_off[g] = boff[g];
            memcpy(p->blocks[g] + boff[g], t, (size_t) ps->n_blocks * sizeof(int32_t));
            boff[g] += ps->n_blocks;
        }
        ps->mtp_depth = s->sched_final ? r->k : 0;
        ps->flags = s->sched_new ? STEP_SEQ_NEW : 0;
        /* trunk writes never land in a shared or cached block */
        BUG_ON(!kv_seq_writable(e->kv, s->slot, ps->pos0));
        if (s->sched_new) {
            /* the MTP layers start at pos0, final below it (kv_seq_begin's guarantee for
             * the r->k layers this request drafts with), or below n_cached_mtp after a
             * reuse of the trunk's prefix alone: then never final again (a hole that no
             * later run repairs; below pos0 - SPEC_MAX_K track_mtp never extends it) */
            int32_t fin = s->n_cached_mtp;
            bool whole = fin >= ps->pos0;
            if (!whole && fin > ps->pos0 - SPEC_MAX_K - 1)
                fin = ps->pos0 - SPEC_MAX_K - 1 > 0 ? ps->pos0 - SPEC_MAX_K - 1 : 0;
            for (int j = 0; j < SPEC_MAX_K; j++) {
                r->mtp_end[j] = j < r->k && whole ? ps->pos0 : -1;
                r->mtp_final[j] = j < r->k ? (whole ? ps->pos0 : fin) : 0;
            }
        }
        if (!r->t_sched) {
            r->t_sched = engine_now_usec();
            r->n_cached = s->n_cached;
        }
    }
    p->n_tokens = tok;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        p->n_block_ids[g] = boff[g];
    p->img_emb = n_img ? e->img_buf : NULL;
    p->img_row = n_img ? e->img_row : NULL;
    p->img_row_next = n_img ? e->img_next : NULL;
    p->n_img_emb = n_img;
    p->img_width = n_img ? e->cfg.vision->hidden : 0;
}

/* Output token i of r (not delivered yet) came from logits row: its logprob and the top N.
 * Selection keeps the N best in order (higher logprob first, lower id on ties). */
static void logprob_fill(struct engine *e, struct ereq *r, int i, const float *row)
{
    struct engine_logprob *lp = &r->lp[i - r->n_emitted];
    struct sampler_hist h = { .tokens = r->tokens, .n_prompt = r->n_prompt, .n_output = i };
    const float *x = e->lp_buf;
    int32_t t = r->tokens[r->n_prompt + i];
    int n = 0;

    BUG_ON(i - r->n_emitted < 0 || i - r->n_emitted > SPEC_MAX_K);
    sampler_logprobs(e->smp, &r->sp, &h, row, e->cfg.logprobs_processed, e->lp_buf);
    lp->token = t;
    lp->logprob = x[t];
    for (int v = 0; v < e->vocab && r->logprobs > 0; v++) {
        /* x[v] enters when it beats the current N-th (ids ascend: ties keep the earlier) */
        if (n == r->logprobs && !(x[v] > lp->top_logprobs[n - 1]))
            continue;
        int k = n < r->logprobs ? n++ : n - 1;
        while (k > 0 && x[v] > lp->top_logprobs[k - 1]) {
            lp->top_logprobs[k] = lp->top_logprobs[k - 1];
            lp->top_ids[k] = lp->top_ids[k - 1];
            k--;
        }
        lp->top_logprobs[k] = x[v];
        lp->top_ids[k] = v;
    }
    lp->n_top = n;
}

/* Verify/sample one scheduled sequence from its logits rows, or from their argmaxes ids
 * (rows NULL: a step of greedy rows, step_greedy), or from its row's candidates (rows NULL
 * and kc > 0: a sampled row of a step_cands step, row index first_row); prepares its MTP
 * proposal.  Returns the rows consumed. */
static int finish_seq(struct engine *e, int i, struct batch_seq *s, const float *rows,
                      const int32_t *ids, int kc, size_t first_row, int64_t now)
{
    struct ereq *r = req_of(s);
    struct step_seq *ps = &e->plan.seqs[i];
    struct spec_seq *ss = &e->sseqs[i];
    /* finishing the request below resets the batcher's per-step fields: copy them */
    int n_drafts = s->sched_drafts;
    int rows_used = s->sched_final ? 1 + n_drafts : 0;
    int32_t n_plain = s->sched_tokens - n_drafts;
    /* nothing of the sequence this slot of the step held before: the draft policy reads
     * .acc of every entry (a K = 0 prompt chunk kept a finished request's, freed since) */
    *ss = (struct spec_seq) { 0 };
    ps->mtp_depth = 0;
    if (!s->sched_final) {
        s->n_computed += s->sched_tokens;
        if (r->k > 0) {
            /* keep the MTP layers' KV complete over prompt chunks (docs/MODEL.md §3.2) */
            int32_t end = s->n_computed;
            *ss = (struct spec_seq) {
                .sp = &r->sp, .depth = r->k, .drafts = r->fill_drafts, .fill_only = true,
                .forced = r->tokens + end + 1, .n_forced = s->n_known - end - 1,
                .acc = &r->acc, .keep_depth = s->mtp_exact,
            };
            ps->mtp_depth = r->k;
            e->n_valid[i] = s->sched_tokens;
            e->tok_in[i] = r->tokens[end];
        }
        return 0;
    }
    *ss = (struct spec_seq) {
        .sp = &r->sp,
        .hist = { .tokens = r->tokens, .n_prompt = r->n_prompt, .n_output = r->n_output },
        .out_index = (uint64_t) r->n_output,
        .drafts = r->drafts,
        .q = r->q,
        .acc = &r->acc,
        .gm = r->gm,
        .keep_depth = s->mtp_exact,     /* a client's seed on a sampled sequence */
    };
    int32_t next;
    int a;
    if (rows) {
        a = spec_verify(e->smp, ss, rows, n_drafts, e->vocab, e->probs_buf, &r->mtp, &next);
    } else if (kc > 0 && !sampling_params_greedy(&r->sp)) {
        const struct sampler_cands c = {
            .k = kc, .vals = e->cand_vals + first_row * (size_t) kc,
            .ids = e->cand_ids + first_row * (size_t) kc, .sum = e->cand_sums[first_row],
        };
        a = spec_verify_cands(ss, &c, n_drafts, &r->mtp, &next);
    } else {
        a = spec_verify_ids(ss, ids, n_drafts, &r->mtp, &next);
    }
    s->n_computed = ps->pos0 + n_plain + a;
    s->n_draft = 0;
    bool done = false;
    int n_before = r->n_output;
    for (int k = 0; k < a && !done; k++)
        done = append_token(e, r, r->drafts[k], now);
    if (!done)
        done = append_token(e, r, next, now);
    /* token j of this step came from row j: the target's distribution after the j drafts
     * accepted before it (a request with logprobs makes its steps' rows come, step_greedy) */
    BUG_ON(r->logprobs >= 0 && !rows);
    for (int j = 0; r->logprobs >= 0 && j < r->n_output - n_before; j++)
        logprob_fill(e, r, n_before + j, rows + (size_t) j * (size_t) e->vocab);
    ss->depth = 0;
    if (done || r->k == 0)
        return rows_used;
    int depth = r->k;
    int left = r->max_tokens - r->n_output;          /* tokens still allowed */
    int room = e->cfg.max_model_len - s->n_known;
    if (depth > left - 1)
        depth = left - 1;
    if (depth > room - 1)
        depth = room - 1;
    if (depth <= 0)
        return rows_used;
    ss->hist.n_output = r->n_output;
    ss->out_index = (uint64_t) r->n_output;
    ss->depth = depth;
    ps->mtp_depth = depth;
    e->n_valid[i] = n_plain + a;
    e->tok_in[i] = next;
    return rows_used;
}

/* After the MTP chain of step seq i: how far each layer it ran is final now. */
static void track_mtp(struct engine *e, int i, struct ereq *r)
{
    const struct step_seq *ps = &e->plan.seqs[i];
    int32_t pos0 = ps->pos0, end = pos0 + e->n_valid[i], known = r->seq.n_known;
    for (int j = 0; j < e->sseqs[i].depth && j < r->k; j++) {
        /* a contiguous run repairs what the previous one computed from drafts (at most j
         * positions before pos0); after a hole nothing new is final */
        if (r->mtp_end[j] == pos0 && r->mtp_final[j] >= pos0 - j) {
            int32_t v = end < known - j - 1 ? end : known - j - 1;
            if (j > 0 && v > r->mtp_final[j - 1])
                v = r->mtp_final[j - 1];
            if (v > r->mtp_final[j])
                r->mtp_final[j] = v;
        }
        r->mtp_end[j] = end;
    }
}

/* Every way a step can fail ends here: every live request finishes ERROR (its status is
 * UNAVAILABLE, engine-rpc.c) with the failure in words, and the engine stops. */
static void fail_all(struct engine *e, int rc, const char *what)
{
    char msg[256], why[200];

    if (e->cfg.describe_failure)
        e->cfg.describe_failure(e->cfg.describe_failure_ctx, rc, why, sizeof(why));
    else
        snprintf(why, sizeof(why), "%s", err_str(rc));
    snprintf(msg, sizeof(msg), "%s failed: %s", what, why);
    log_error("engine: %s; failing every request", msg);
    for (struct ereq *r = e->live; r; r = r->live_next)
        finish(e, r, ENGINE_FINISH_ERROR, msg);
    pthread_mutex_lock(&e->lock);
    e->last_error = rc;
    pthread_mutex_unlock(&e->lock);
}

static void fill_output(const struct ereq *r, struct engine_output *o, int64_t now)
{
    memset(o, 0, sizeof(*o));
    o->id = r->id;
    o->tokens = r->tokens + r->n_prompt + r->n_emitted;
    o->n_tokens = r->n_output - r->n_emitted;
    o->logprobs = r->lp && o->n_tokens > 0 ? r->lp : NULL;
    o->finished = r->done;
    o->finish = r->finish;
    o->stop_token = r->stop_token;
    o->message = r->message;
    o->n_prompt = r->n_prompt;
    o->n_cached = r->n_cached;
    o->n_completion = r->n_output;
    o->n_preempted = r->seq.n_preempted;
    o->mtp = r->mtp;
    if (!r->done)
        return;
    struct engine_timings *t = &o->timings;
    double us = 1e-6;
    if (r->t_sched)
        t->queue_s = (double) (r->t_sched - r->t_arrival) * us;
    if (r->t_first) {
        t->prefill_s = (double) (r->t_first - r->t_sched) * us;
        t->first_token_s = (double) (r->t_first - r->t_arrival) * us;
        t->decode_s = (double) (r->t_last - r->t_first) * us;
        if (r->n_output > 1)
            t->mean_inter_token_s = t->decode_s / (r->n_output - 1);
    }
    t->e2e_s = (double) (now - r->t_arrival) * us;
}

static void unlink_all(struct engine *e, struct ereq *r)
{
    if (r->all_prev)
        r->all_prev->all_next = r->all_next;
    else
        e->all = r->all_next;
    if (r->all_next)
        r->all_next->all_prev = r->all_prev;
}

static void update_snapshot(struct engine *e, int64_t now)
{
    e->rate_i = (e->rate_i + 1) % RATE_SAMPLES;
    e->rate_t[e->rate_i] = now;
    e->rate_n[e->rate_i] = e->n_generated;
    int old = (e->rate_i + 1) % RATE_SAMPLES;
    if (!e->rate_t[old])
        old = 1;    /* ring not full yet: the first sample went to index 1 */
    double dt = (double) (now - e->rate_t[old]) * 1e-6;

    struct engine_loads *l = &e->snap;
    l->image_encodes = e->n_img_encodes;
    l->image_cache_hits = e->n_img_hits;
    l->n_running = batcher_n_running(e->b);
    l->n_waiting = batcher_n_waiting(e->b);
    l->kv_blocks_total = kv_pool_total(e->kv, KV_GROUP_FULL) + kv_pool_total(e->kv, KV_GROUP_SLIDING);
    l->kv_blocks_used = kv_pool_held_count(e->kv, KV_GROUP_FULL) +
                        kv_pool_held_count(e->kv, KV_GROUP_SLIDING);
    l->kv_blocks_cached = kv_pool_cached_count(e->kv, KV_GROUP_FULL) +
                          kv_pool_cached_count(e->kv, KV_GROUP_SLIDING);
    l->kv_usage = kv_pool_usage(e->kv);
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        l->kv_pool[g].used = kv_pool_held_count(e->kv, g);
        l->kv_pool[g].cached = kv_pool_cached_count(e->kv, g);
        l->kv_pool[g].total = kv_pool_total(e->kv, g);
    }
    batcher_prefix_stats(e->b, &l->prefix_queries, &l->prefix_hits);
    l->prefix_evictions = kv_pool_evictions(e->kv);
    l->n_preemptions = batcher_n_preemptions(e->b);
    l->n_steps = e->n_steps;
    l->n_generated = e->n_generated;
    l->tokens_per_s = dt > 0 ? (double) (e->n_generated - e->rate_n[old]) / dt : 0.0;
    l->mtp = e->mtp_total;
    l->mean_accept_len = spec_stats_mean_accept_len(&e->mtp_total);
    l->draft_vocab = e->dv_on ? e->cfg.draft_vocab : 0;
    l->draft_vocab_cover = e->dv_cover;
    l->draft_vocab_installs = e->dv_installs;
}

/* Deliver outputs, then unlink and free finished requests. */
static void deliver(struct engine *e)
{
    int64_t now = engine_now_usec();
    int admitted = 0;
    /* finished ids leave the `all` list and the capacity count before their final
     * callback, so a client may reuse an id, or send the next request in its place, as
     * soon as it has seen the final (they are freed below, in this call) */
    pthread_mutex_lock(&e->lock);
    for (struct ereq *r = e->live; r; r = r->live_next)
        if (r->done && !r->unlinked) {
            unlink_all(e, r);
            r->unlinked = true;
            e->n_alive--;
        }
    pthread_mutex_unlock(&e->lock);
    for (struct ereq *r = e->live; r; r = r->live_next) {
        if (r->counted_queued && (r->seq.state == BATCH_STATE_RUNNING || r->done)) {
            r->counted_queued = false;
            admitted++;
        }
        if (!r->done && r->n_output == r->n_emitted)
            continue;
        struct engine_output o;
        fill_output(r, &o, now);
        r->n_emitted = r->n_output;
        if (r->done)
            spec_stats_add(&e->mtp_total, &r->mtp);
        r->cb(r->ud, &o);
    }
    struct ereq **pp = &e->live;
    int freed = 0;
    struct ereq *dead = NULL;
    while (*pp) {
        struct ereq *r = *pp;
        if (r->done) {
            *pp = r->live_next;
            r->live_next = dead;
            dead = r;
            freed++;
        } else {
            pp = &r->live_next;
        }
    }
    pthread_mutex_lock(&e->lock);
    e->n_queued -= admitted;
    e->snap.n_requests_freed += (uint64_t) freed;
    update_snapshot(e, now);
    e->snap.n_alive = e->n_alive;
    e->snap.last_error = e->last_error;
    pthread_mutex_unlock(&e->lock);
    while (dead) {
        struct ereq *r = dead;
        dead = r->live_next;
        ereq_free(r);
    }
}

struct dv_rank {
    uint32_t count;
    int32_t id;
};

static int dv_rank_cmp(const void *a, const void *b)
{
    const struct dv_rank *x = a, *y = b;

    if (x->count != y->count)
        return x->count > y->count ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* The draft vocabulary from the output counts so far (engine_config.draft_vocab); a forward
 * that refuses it turns the feature off for this engine (logged), drafting goes on over the
 * whole vocabulary. */
static void dv_rank(struct engine *e)
{
    const int V = e->vocab, N = e->cfg.draft_vocab;
    struct dv_rank *rk = malloc(sizeof(*rk) * (size_t)V);
    int32_t *ids = malloc(sizeof(*ids) * (size_t)N);
    uint64_t in = 0;
    struct err_buf err;
    int r;

    e->dv_next = 2 * e->dv_counted;
    if (!rk || !ids) {
        free(rk);
        free(ids);
        return;             /* tried again at the next doubling */
    }
    for (int i = 0; i < V; i++)
        rk[i] = (struct dv_rank){ .count = e->dv_count[i], .id = i };
    qsort(rk, (size_t)V, sizeof(*rk), dv_rank_cmp);
    for (int j = 0; j < N; j++) {
        ids[j] = rk[j].id;
        in += rk[j].count;
    }
    r = e->f->ops->set_draft_vocab(e->f, ids, N, &err);
    if (r < 0) {
        log_warn("engine: draft vocabulary of %d ids refused, drafting over all %d: %s", N, V,
                 err.msg);
        free(e->dv_count);
        e->dv_count = NULL;
        e->dv_on = false;
    } else {
        e->dv_on = true;
        e->dv_installs++;
        e->dv_cover = e->dv_counted ? (double)in / (double)e->dv_counted : 0.0;
        log_info("engine: draft vocabulary: the %d most frequent of %d token ids (%.1f %% of "
                 "%llu output tokens)", N, V, 100.0 * e->dv_cover,
                 (unsigned long long)e->dv_counted);
    }
    free(rk);
    free(ids);
}

/* Whether the step's tokens are the argmaxes of its rows: every sequence that takes tokens
 * from this step (sched_final) chooses its own and verifies its drafts by the raw argmax
 * (sampler_takes_argmax, no grammar) and wants no logprobs, and the forward offers the
 * greedy form.  A mixed batch takes the logits path for the whole step. */
static bool step_greedy(const struct engine *e, struct batch_seq **seqs, int n)
{
    if (!e->f->ops->step_argmax || e->argmax_off)
        return false;
    for (int i = 0; i < n; i++) {
        const struct ereq *r = req_of(seqs[i]);
        if (seqs[i]->sched_final &&
            (r->logprobs >= 0 || r->gm || !sampler_takes_argmax(&r->sp, r->n_output)))
            return false;
    }
    return true;
}

/* Whether the step's tokens can come from its rows' candidates (forward.h, step_topk):
 * every sequence that takes tokens from this step chooses them from its rows' best
 * logits (sampler_takes_cands: greedy as step_greedy, or sampled with a top_k and no
 * processor before the distribution), wants no logprobs and no grammar, and a sampled one
 * verifies no drafts (rejection sampling reads whole distributions).  Returns the k the
 * step needs (the largest top_k, 1 for greedy rows), 0 for the logits path; *ret_sums: a
 * sampled row has a top_p (its row's softmax mass is needed too). */
static int step_cands(const struct engine *e, struct batch_seq **seqs, int n, bool *ret_sums)
{
    int k = 0;

    *ret_sums = false;
    if (!e->f->ops->step_topk || e->topk_off)
        return 0;
    for (int i = 0; i < n; i++) {
        const struct ereq *r = req_of(seqs[i]);
        const struct sampling_params *sp = &r->sp;
        bool sampled = !sampling_params_greedy(sp);

        if (!seqs[i]->sched_final)
            continue;
        if (r->logprobs >= 0 || r->gm ||
            !sampler_takes_cands(sp, r->n_output, e->vocab, SAMPLER_CANDS_MAX) ||
            (sampled && seqs[i]->sched_drafts > 0))
            return 0;
        int want = sampled ? sp->top_k : 1;
        k = want > k ? want : k;
        *ret_sums = *ret_sums || (sampled && sp->top_p < 1.0f);
    }
    if (*ret_sums && e->topk_sum_off)
        return 0;
    return k;
}

/* The step through forward.step_topk with k candidates a row: cand_temps of the sampled
 * rows when sums (0 elsewhere), every row's place 0 (its argmax) into ids for the greedy
 * rows.  -ENOTSUP: the forward refused it before running anything (remembered). */
static int run_topk(struct engine *e, struct batch_seq **seqs, int n, int k, bool sums)
{
    size_t row = 0;
    int r;

    for (int i = 0; sums && i < n; i++) {
        const struct ereq *q = req_of(seqs[i]);
        int used = seqs[i]->sched_final ? 1 + seqs[i]->sched_drafts : 0;
        for (int j = 0; j < used; j++)
            e->cand_temps[row + (size_t) j] =
                sampling_params_greedy(&q->sp) ? 0.0f : q->sp.temperature;
        row += (size_t) used;
    }
    r = e->f->ops->step_topk(e->f, &e->plan, k, sums ? e->cand_temps : NULL, e->cand_ids,
                             e->cand_vals, sums ? e->cand_sums : NULL);
    if (r == -ENOTSUP) {
        log_info("engine: forward '%s' gives no candidates%s: logits rows are copied for "
                 "%s", e->f->ops->name, sums ? " with the rows' softmax mass" : "",
                 sums ? "steps with top_p rows" : "sampled steps");
        if (sums)
            e->topk_sum_off = true;
        else
            e->topk_off = true;
        return r;
    }
    if (r < 0)
        return r;
    row = 0;
    for (int i = 0; i < n; i++)
        row += (size_t) (seqs[i]->sched_final ? 1 + seqs[i]->sched_drafts : 0);
    for (size_t j = 0; j < row; j++)
        e->ids[j] = e->cand_ids[j * (size_t) k];
    return 0;
}

static int run_forward(struct engine *e, struct batch_seq **seqs, int n)
{
    build_plan(e, seqs, n);
    int r = 0;
    if (e->cfg.on_plan)
        r = e->cfg.on_plan(e->cfg.on_plan_ctx, &e->plan);
    if (r < 0) {
        fail_all(e, r, "step plan broadcast");
        return r;
    }
    int64_t t0 = clock_us(e);
    bool greedy = step_greedy(e, seqs, n);
    if (greedy) {
        r = e->f->ops->step_argmax(e->f, &e->plan, e->ids);
        if (r == -ENOTSUP) {
            log_info("engine: forward '%s' chooses no tokens itself here: logits rows are "
                     "copied for greedy steps too", e->f->ops->name);
            e->argmax_off = true;
            greedy = false;
        }
    }
    bool sums = false;
    int kc = greedy ? 0 : step_cands(e, seqs, n, &sums);
    if (kc > 0) {
        r = run_topk(e, seqs, n, kc, sums);
        if (r == -ENOTSUP)
            kc = 0;
    }
    if (!greedy && kc == 0)
        r = e->f->ops->step(e->f, &e->plan, e->logits);
    int64_t now = engine_now_usec();
    e->t_forward_us += clock_us(e) - t0;
    if (r < 0) {
        fail_all(e, r, "forward step");
        return r;
    }
    size_t row = 0;
    for (int i = 0; i < n; i++) {
        int used = greedy || kc > 0
                       ? finish_seq(e, i, seqs[i], NULL, e->ids + row, kc, row, now)
                       : finish_seq(e, i, seqs[i], e->logits + row * (size_t) e->vocab, NULL, 0,
                                    0, now);
        row += (size_t) used;
    }
    /* the draft depths of the next step (spec-policy.h) */
    bool any_mtp = spec_policy_step(e->pol, &e->plan, e->sseqs, n,
                                    (double) (clock_us(e) - t0) * 1e-6);
    /* prefix cache: blocks of the requests without MTP work this step are committed now
     * (finished ones in finish()); with MTP work, after the chain below.  A depth the
     * policy skipped leaves its MTP positions unwritten: a later request reuses the
     * prefix's trunk KV and drafts less well there, its outputs are the same or, sampled,
     * equally distributed (drafts are verified); one with a client's seed reuses only
     * blocks with final MTP KV (ereq_new, kv.h). */
    for (int i = 0; i < n; i++)
        if (!req_of(seqs[i])->done && e->sseqs[i].depth == 0)
            commit_blocks(e, req_of(seqs[i]));
    if (!any_mtp)
        return 0;
    /* stream this step's tokens before drafting the next ones: the MTP chain then costs
     * no latency.  Finished requests are reaped here; they have no MTP work (depth 0). */
    deliver(e);
    t0 = clock_us(e);
    r = spec_propose(e->f, e->smp, &e->plan, e->sseqs, e->n_valid, e->tok_in, e->mtp_logits,
                     e->tok_scratch, e->mtp_ids, e->pol);
    e->t_mtp_us += clock_us(e) - t0;
    if (r < 0) {
        fail_all(e, r, "MTP step");
        return r;
    }
    for (int i = 0; i < n; i++) {
        if (e->sseqs[i].depth == 0)
            continue;       /* finished ones are freed by now */
        if (!e->sseqs[i].fill_only)
            seqs[i]->n_draft = e->sseqs[i].depth;
        track_mtp(e, i, req_of(seqs[i]));
        commit_blocks(e, req_of(seqs[i]));
    }
    return 0;
}

int engine_step(struct engine *e)
{
    int64_t t_start = clock_us(e);
    int64_t fwd0 = e->t_forward_us, mtp0 = e->t_mtp_us;
    int r = engine_step_inner(e);
    e->t_engine_us += clock_us(e) - t_start - (e->t_forward_us - fwd0) - (e->t_mtp_us - mtp0);
    pthread_mutex_lock(&e->lock);
    e->snap.forward_s = (double) e->t_forward_us * 1e-6;
    e->snap.mtp_s = (double) e->t_mtp_us * 1e-6;
    e->snap.engine_s = (double) e->t_engine_us * 1e-6;
    spec_policy_stats(e->pol, &e->snap.policy);
    pthread_mutex_unlock(&e->lock);
    return r;
}

static int engine_step_inner(struct engine *e)
{
    take_inbox(e);
    if (e->last_error) {
        fail_all(e, e->last_error, "engine");
        deliver(e);
        return e->last_error;
    }
    expire_and_abort(e, clock_us(e));
    if (e->cfg.vision)
        encode_new(e);
    struct batch_seq **seqs;
    if (e->dv_count && e->dv_counted >= e->dv_next)
        dv_rank(e);
    int n = batcher_schedule(e->b, &seqs);
    int r = 0;
    if (n > 0) {
        memcpy(e->sched, seqs, (size_t) n * sizeof(*seqs));
        r = run_forward(e, e->sched, n);
        e->n_steps++;
    }
    deliver(e);
    return r < 0 ? r : n;
}

int engine_run_until_idle(struct engine *e)
{
    for (;;) {
        pthread_mutex_lock(&e->lock);
        int alive = e->n_alive;
        pthread_mutex_unlock(&e->lock);
        if (!alive)
            return 0;
        int r = engine_step(e);
        if (r < 0)
            return r;
    }
}

/* --- thread --- */

static void *engine_thread(void *arg)
{
    struct engine *e = arg;
    pthread_mutex_lock(&e->lock);
    while (!e->stopping) {
        if (e->n_alive == 0 || (e->last_error && !e->inbox_head)) {
            pthread_cond_wait(&e->cond, &e->lock);
            spec_policy_idle(e->pol);   /* the wait is no step's cost */
            continue;
        }
        pthread_mutex_unlock(&e->lock);
        int n = engine_step(e);
        if (n == 0) {
            /* alive but nothing schedulable (e.g. only aborted/expired pending): yield */
            struct timespec ts = { 0, 200000 };
            nanosleep(&ts, NULL);
        }
        pthread_mutex_lock(&e->lock);
    }
    pthread_mutex_unlock(&e->lock);
    return NULL;
}

int engine_start(struct engine *e)
{
    if (e->started)
        return -EALREADY;
    e->stopping = false;
    int r = pthread_create(&e->thread, NULL, engine_thread, e);
    if (r)
        return -r;
    e->started = true;
    return 0;
}

void engine_stop(struct engine *e)
{
    if (!e || !e->started)
        return;
    pthread_mutex_lock(&e->lock);
    e->stopping = true;
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->lock);
    pthread_join(e->thread, NULL);
    e->started = false;
}

void engine_free(struct engine *e)
{
    if (!e)
        return;
    engine_stop(e);
    if (e->b) {
        take_inbox(e);
        for (struct ereq *r = e->live; r; r = r->live_next)
            finish(e, r, ENGINE_FINISH_ABORT, "engine shutting down");
        deliver(e);
    }
    batcher_free(e->b);
    kv_pool_free(e->kv);
    sampler_free(e->smp);
    spec_policy_free(e->pol);
    free(e->dv_count);
    free(e->pseqs);
    free(e->ptokens);
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        free(e->pblocks[g]);
    free(e->logits);
    free(e->mtp_logits);
    free(e->ids);
    free(e->mtp_ids);
    free(e->cand_ids);
    free(e->cand_vals);
    free(e->cand_sums);
    free(e->cand_temps);
    free(e->probs_buf);
    free(e->lp_buf);
    free(e->n_valid);
    free(e->tok_in);
    free(e->tok_scratch);
    free(e->sseqs);
    free(e->sched);
    for (int i = 0; e->icache && i < e->cfg.image_cache_entries; i++)
        free(e->icache[i].rows);
    free(e->icache);
    free(e->img_buf);
    free(e->img_row);
    free(e->img_next);
    pthread_cond_destroy(&e->cond);
    pthread_mutex_destroy(&e->lock);
    grammar_vocab_free(e->gv);
    pthread_mutex_destroy(&e->gv_lock);
    free(e);
}

/* --- queries --- */

void engine_get_loads(struct engine *e, struct engine_loads *ret)
{
    pthread_mutex_lock(&e->lock);
    *ret = e->snap;
    ret->n_alive = e->n_alive;
    ret->max_num_seqs = e->cfg.max_num_seqs;
    ret->max_waiting = e->cfg.max_waiting;
    ret->last_error = e->last_error;
    if (!ret->kv_blocks_total) {     /* no step yet: the pool sizes are known already */
        ret->kv_blocks_total = kv_pool_total(e->kv, KV_GROUP_FULL) +
                               kv_pool_total(e->kv, KV_GROUP_SLIDING);
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            ret->kv_pool[g].total = kv_pool_total(e->kv, g);
    }
    if (ret->mean_accept_len == 0.0)
        ret->mean_accept_len = 1.0;
    if (engine_now_usec() - e->rate_t[e->rate_i] > 2000000)
        ret->tokens_per_s = 0.0;    /* idle: no recent generation */
    pthread_mutex_unlock(&e->lock);
}

int engine_check(struct engine *e)
{
    int r = kv_pool_check(e->kv);
    if (r < 0)
        return r;
    pthread_mutex_lock(&e->lock);
    int alive = e->n_alive;
    int queued = e->n_queued;
    pthread_mutex_unlock(&e->lock);
    pthread_mutex_lock(&e->lock);
    bool balanced = e->snap.n_requests_created == e->snap.n_requests_freed;
    pthread_mutex_unlock(&e->lock);
    if (alive == 0) {
        if (!kv_pool_idle(e->kv) || batcher_n_running(e->b) || batcher_n_waiting(e->b) ||
            e->live || queued != 0 || !balanced)
            return -EUCLEAN;
    }
    return 0;
}

const struct engine_config *engine_get_config(const struct engine *e)
{
    return &e->cfg;
}

int engine_vocab_size(const struct engine *e)
{
    return e->vocab;
}

int engine_max_spec(const struct engine *e)
{
    return e->kmax;
}
