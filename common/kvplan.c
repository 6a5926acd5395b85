/* kvplan.c - KV pool sizing (kvplan.h). */
#include "kvplan.h"

#include <errno.h>
#include <stdio.h>

#define MAX_BLOCKS (1 << 24)

void kvplan_bytes_per_token(const struct model_config *c, int world, int rank, int n_mtp,
                            int elem_bytes, int64_t ret[_KVPLAN_POOLS])
{
    ret[KVPLAN_FULL] = ret[KVPLAN_SLIDING] = 0;
    if (world < 1)
        world = 1;
    for (int i = 0; i < c->n_layers + (rank == 0 ? n_mtp : 0) && i < c->n_layers_total; i++) {
        const struct layer_config *L = &c->layers[i];
        int heads = L->is_mtp ? L->n_kv_heads : L->n_kv_heads / world;
        ret[L->kind == LAYER_KIND_FULL ? KVPLAN_FULL : KVPLAN_SLIDING] +=
            2 * (int64_t) heads * L->head_dim * elem_bytes;
    }
}

int64_t kvplan_workspace_bytes(const struct model_config *c, int world, int rank, int n_mtp,
                               int max_tokens, int max_seqs, int max_logit_rows)
{
    int64_t T0 = max_tokens, S = max_seqs, H = c->hidden_size, V = c->vocab_size;
    int64_t qmax = 0, kvmax = 0, hmax = 0, imax = 1, nexp = 1, topk = 1;
    int k = rank == 0 ? n_mtp : 0;
    int64_t R = max_logit_rows < max_tokens ? max_logit_rows : max_tokens;
    if (world < 1)
        world = 1;
    for (int i = 0; i < c->n_layers + k && i < c->n_layers_total; i++) {
        const struct layer_config *L = &c->layers[i];
        int w = L->is_mtp ? 1 : world;
        int64_t inter = L->is_moe ? c->shared_expert_dim / w : c->intermediate_size / w;
        qmax = (int64_t) L->n_heads / w * L->head_dim > qmax ? (int64_t) L->n_heads / w * L->head_dim : qmax;
        kvmax = (int64_t) L->n_kv_heads / w * L->head_dim > kvmax ? (int64_t) L->n_kv_heads / w * L->head_dim
                                                                : kvmax;
        hmax = L->n_heads / w > hmax ? L->n_heads / w : hmax;
        imax = inter > imax ? inter : imax;
        if (L->is_moe && !L->is_mtp) {
            nexp = c->n_experts;
            topk = c->top_k;
        }
    }
    int64_t T = T0 + (k > 1 ? S * (k - 1) : 0);
    int64_t f = 2 * T * H + T0 * H + 2 * T * qmax + 2 * T * kvmax + T * hmax + 3 * T * imax +
                T0 * nexp + T0 * topk + R * H + R * (V / world);
    if (world > 1)
        f += R * V;
    if (k)
        f += 4 * T * H + S * V + S * k * k * H + S * H;
    return 4 * f + 4 * T0 * topk;
}

static int64_t div_up(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

const char *kvplan_fmt_bytes(int64_t n, char *buf, int len)
{
    static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB" };
    double v = (double) n;
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    snprintf(buf, (size_t) len, u ? "%.2f %s" : "%.0f %s", v, unit[u]);
    return buf;
}

int kvplan_compute(const struct kvplan_req *q, int64_t budget, struct kvplan *ret,
                   struct err_buf *e)
{
    int bs = q->block_size;
    if (bs <= 0 || q->max_num_seqs <= 0 || q->max_model_len <= 0 || q->max_batched_tokens <= 0 ||
        q->sliding_window < 0 || q->mtp_margin < 0 || q->bytes_per_token[KVPLAN_FULL] < 0 ||
        q->bytes_per_token[KVPLAN_SLIDING] < 0)
        return err_set(e, -EINVAL, "KV plan: block size, sequences, lengths and sizes must be "
                       "positive");
    struct kvplan p = { { 0 } };
    int64_t S = q->max_num_seqs;
    for (int g = 0; g < _KVPLAN_POOLS; g++)
        p.block_bytes[g] = q->bytes_per_token[g] * bs;
    p.seq_blocks = (int) div_up((int64_t) q->max_model_len + KVPLAN_MAX_DRAFTS, bs);
    int64_t sliding = S * p.seq_blocks;     /* no window: the sliding pool keeps everything */
    if (q->sliding_window > 0) {
        int64_t w = (int64_t) q->sliding_window + q->mtp_margin;
        int64_t bound = div_up(S * w + q->max_batched_tokens, bs) + 2 * S;
        if (bound < sliding)
            sliding = bound;
    }
    if (sliding > MAX_BLOCKS)
        return err_set(e, -E2BIG, "KV plan: %lld sliding blocks exceed the limit of %d (fewer "
                       "--max-num-seqs, a larger --block-size)", (long long) sliding, MAX_BLOCKS);
    p.n_blocks[KVPLAN_SLIDING] = (int) sliding;
    p.bytes[KVPLAN_SLIDING] = sliding * p.block_bytes[KVPLAN_SLIDING];
    p.min_bytes = p.bytes[KVPLAN_SLIDING] + p.seq_blocks * p.block_bytes[KVPLAN_FULL];
    p.all_bytes = p.bytes[KVPLAN_SLIDING] + S * p.seq_blocks * p.block_bytes[KVPLAN_FULL];
    if (budget < 0)
        budget = p.all_bytes;
    if (budget < p.min_bytes) {
        *ret = p;
        char need[32], have[32], sl[32], one[32];
        return err_set(e, -ENOSPC, "KV cache: --max-num-seqs %d and --max-model-len %d need at "
                       "least %s (sliding-window pool %s for %d sequences + %s for one sequence "
                       "of %d tokens), the budget is %s: lower --max-model-len or "
                       "--max-num-seqs, or give the KV cache more memory", q->max_num_seqs,
                       q->max_model_len, kvplan_fmt_bytes(p.min_bytes, need, sizeof(need)),
                       kvplan_fmt_bytes(p.bytes[KVPLAN_SLIDING], sl, sizeof(sl)), q->max_num_seqs,
                       kvplan_fmt_bytes(p.seq_blocks * p.block_bytes[KVPLAN_FULL], one,
                                        sizeof(one)), q->max_model_len,
                       kvplan_fmt_bytes(budget, have, sizeof(have)));
    }
    int64_t full = S * p.seq_blocks;        /* no full layers: ids only, one per position */
    if (p.block_bytes[KVPLAN_FULL] > 0)
        full = (budget - p.bytes[KVPLAN_SLIDING]) / p.block_bytes[KVPLAN_FULL];
    if (full > MAX_BLOCKS)
        full = MAX_BLOCKS;
    p.n_blocks[KVPLAN_FULL] = (int) full;
    p.bytes[KVPLAN_FULL] = full * p.block_bytes[KVPLAN_FULL];
    p.full_seqs = (int) (full / p.seq_blocks);
    *ret = p;
    return 0;
}
