/* bench-model.c - tiny-model forward throughput: prefill tokens/s and batch-1 decode tokens/s,
 * exact and fast MXFP4 paths, 1 and 2 threads (medians of several runs).
 *
 *   bench-model MODEL_DIR [runs=5] [prompt=128] [decode=64]
 *
 * Prefill: one sequence, the whole prompt as one step (logits of the last token).
 * Decode: one token per step after the prompt (batch 1), logits every step; greedy feed.
 * Also: decode with 4 sequences in the batch (tokens/s over all sequences).
 * Prints figures and ratios only; no thresholds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "benchlib.h"
#include "model.h"

#define BS 16

struct bplan {
    struct step_plan p;
    struct step_seq seqs[4];
    int32_t *tokens, *blocks;
};

/* n_seqs sequences, each a run of n tokens at pos0, identity-ish block tables (seq s owns
 * blocks [s*nb, (s+1)*nb)). */
static void bplan_fill(struct bplan *b, int n_seqs, int pos0, int n, const int32_t *toks, int nb)
{
    static uint64_t id;
    b->p.step_id = ++id;
    b->p.n_seqs = n_seqs;
    b->p.n_tokens = n_seqs * n;
    b->p.seqs = b->seqs;
    b->p.tokens = b->tokens;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        b->p.n_block_ids[g] = n_seqs * nb;
        b->p.blocks[g] = b->blocks;
    }
    for (int s = 0; s < n_seqs; s++) {
        b->seqs[s] = (struct step_seq){
            .slot = s, .pos0 = pos0, .n_tokens = n, .n_logits = 1, .tok_off = s * n,
            .n_blocks = (pos0 + n + BS - 1) / BS, .block_off = {s * nb, s * nb},
        };
        memcpy(b->tokens + s * n, toks + (size_t)s * n, sizeof(int32_t) * (size_t)n);
    }
}

int main(int argc, char **argv)
{
    struct err_buf e = {{0}};
    struct ckpt *ck;
    int runs = argc > 2 ? atoi(argv[2]) : 5;
    int P = argc > 3 ? atoi(argv[3]) : 128, D = argc > 4 ? atoi(argv[4]) : 64;

    if (argc < 2) {
        fprintf(stderr, "usage: bench-model MODEL_DIR [runs] [prompt] [decode]\n");
        return 2;
    }
    struct ckpt_opts co = {.world_size = 1, .rank = 0, .mtp_depth = 0};
    if (ckpt_open(argv[1], &co, &ck, &e) < 0) {
        fprintf(stderr, "bench-model: %s\n", e.msg);
        return 1;
    }
    int V = ckpt_config(ck)->vocab_size;
    int maxlen = P + D + 1, nb = (maxlen + BS - 1) / BS;
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)P * 4);
    struct bplan b = {.tokens = malloc(sizeof(int32_t) * (size_t)P * 4),
                      .blocks = malloc(sizeof(int32_t) * (size_t)nb * 4)};
    float *lg = malloc(sizeof(float) * (size_t)V * 4);
    double *t = malloc(sizeof(double) * (size_t)runs);

    for (int i = 0; i < nb * 4; i++)
        b.blocks[i] = i;
    for (int i = 0; i < P * 4; i++)
        toks[i] = (int32_t)((i * 2654435761u) % (uint32_t)V);

    printf("tiny model %s: prompt %d, decode %d, %d runs (medians)\n", argv[1], P, D, runs);
    printf("%-6s %-7s %12s %14s %16s\n", "path", "threads", "prefill tok/s", "decode tok/s b1",
           "decode tok/s b4");
    double base_pf = 0, base_dc = 0;
    for (int exact = 1; exact >= 0; exact--) {
        for (int th = 1; th <= 2; th++) {
            struct backend *be;
            struct model *m;
            struct backend_cfg bc = {.n_threads = th, .mxfp4_exact = exact};
            struct model_opts mo = {.max_tokens_per_step = P * 4 > 4 ? P * 4 : 4, .max_seqs = 4,
                                    .block_size = BS, .n_blocks = {nb * 4, nb * 4},
                                    .max_seq_len = maxlen};
            double pf[64], dc[64], dc4[64];
            if (backend_new("cpu", &bc, &be) < 0 || model_new(ck, be, NULL, &mo, &m, &e) < 0) {
                fprintf(stderr, "bench-model: %s\n", e.msg);
                return 1;
            }
            for (int r = 0; r < runs && r < 64; r++) {
                double t0 = bench_now();
                bplan_fill(&b, 1, 0, P, toks, nb);
                if (model_step(m, &b.p, lg) < 0)
                    goto fail;
                pf[r] = P / (bench_now() - t0);
                int32_t cur[4];
                t0 = bench_now();
                cur[0] = toks[P - 1];
                for (int d = 0; d < D; d++) {
                    bplan_fill(&b, 1, P + d, 1, cur, nb);
                    if (model_step(m, &b.p, lg) < 0)
                        goto fail;
                    int best = 0;
                    for (int i = 1; i < V; i++)
                        best = lg[i] > lg[best] ? i : best;
                    cur[0] = best;
                }
                dc[r] = D / (bench_now() - t0);
                /* batch of 4: prefill all four, then decode together */
                bplan_fill(&b, 4, 0, P, toks, nb);
                if (model_step(m, &b.p, lg) < 0)
                    goto fail;
                for (int s = 0; s < 4; s++)
                    cur[s] = toks[s * P + P - 1];
                t0 = bench_now();
                for (int d = 0; d < D; d++) {
                    bplan_fill(&b, 4, P + d, 1, cur, nb);
                    if (model_step(m, &b.p, lg) < 0)
                        goto fail;
                    for (int s = 0; s < 4; s++) {
                        int best = 0;
                        for (int i = 1; i < V; i++)
                            best = lg[s * V + i] > lg[s * V + best] ? i : best;
                        cur[s] = best;
                    }
                }
                dc4[r] = 4.0 * D / (bench_now() - t0);
            }
            int n = runs < 64 ? runs : 64;
            double mpf = bench_median(pf, n), mdc = bench_median(dc, n), mdc4 = bench_median(dc4, n);
            printf("%-6s %-7d %12.0f %14.1f %16.1f", exact ? "exact" : "fast", th, mpf, mdc, mdc4);
            if (exact && th == 1) {
                base_pf = mpf;
                base_dc = mdc;
                printf("   (baseline)\n");
            } else {
                printf("   prefill x%.2f, decode x%.2f vs exact/1 thread\n", mpf / base_pf,
                       mdc / base_dc);
            }
            model_free(m);
            backend_free(be);
            continue;
fail:
            fprintf(stderr, "bench-model: step failed: %s\n", model_last_error(m));
            return 1;
        }
    }
    free(t);
    free(toks);
    free(b.tokens);
    free(b.blocks);
    free(lg);
    ckpt_close(ck);
    return 0;
}
