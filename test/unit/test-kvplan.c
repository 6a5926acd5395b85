/* test-kvplan.c - KV pool sizing (common/kvplan.c) and byte-count flags (cli.c):
 *   - bytes per token per pool on the tiny checkpoint's config (argv[1]) and on a
 *     synthetic hybrid config, sharded and with MTP layers on rank 0 only;
 *   - the sliding-window pool does not grow with --max-model-len, the full pool takes the
 *     rest of the budget, budget < 0 sizes every sequence at full length;
 *   - the sliding pool's bound holds for any mix of sequences whose runs fit the step's
 *     token budget (the blocks the KV manager keeps for them, counted its way);
 *   - a budget below the minimum is -ENOSPC naming what is needed and what there is.
 * The sliding pool at --max-model-len 32768 with the tiny model's window is printed with
 * what the old sizing (both pools max_seqs x max_model_len, FP32) reserved. */
#include <errno.h>

#include "cli.h"
#include "harness.h"
#include "kvplan.h"

static void test_bytes(void)
{
    struct err_buf e;
    int64_t v;
    ASSERT_OK(cli_parse_bytes("--m", "123456", 1, INT64_MAX, &v, &e));
    ASSERT_EQ(v, 123456);
    ASSERT_OK(cli_parse_bytes("--m", "4GiB", 1, INT64_MAX, &v, &e));
    ASSERT_EQ(v, 4ll << 30);
    ASSERT_OK(cli_parse_bytes("--m", "141G", 1, INT64_MAX, &v, &e));
    ASSERT_EQ(v, 141000000000ll);
    ASSERT_OK(cli_parse_bytes("--m", "1.5mi", 1, INT64_MAX, &v, &e));
    ASSERT_EQ(v, 1572864);
    ASSERT_OK(cli_parse_bytes("--m", "2KB", 1, INT64_MAX, &v, &e));
    ASSERT_EQ(v, 2000);
    ASSERT_ERR(cli_parse_bytes("--m", "1.5", 1, INT64_MAX, &v, &e), -EINVAL);  /* bytes are whole */
    ASSERT_ERR(cli_parse_bytes("--m", "12x", 1, INT64_MAX, &v, &e), -EINVAL);
    ASSERT_CONTAINS(e.msg, "--m '12x'");
    ASSERT_ERR(cli_parse_bytes("--m", "-4G", 1, INT64_MAX, &v, &e), -EINVAL);
    ASSERT_ERR(cli_parse_bytes("--m", "", 1, INT64_MAX, &v, &e), -EINVAL);
    ASSERT_ERR(cli_parse_bytes("--m", "0", 1, INT64_MAX, &v, &e), -EINVAL);
    ASSERT_ERR(cli_parse_bytes("--m", "99999999T", 1, INT64_MAX / 2, &v, &e), -EINVAL);
    double f;
    ASSERT_OK(cli_parse_fraction("--u", "0.9", 0, 1, &f, &e));
    ASSERT_NEAR(f, 0.9, 1e-12);
    ASSERT_ERR(cli_parse_fraction("--u", "0", 0, 1, &f, &e), -EINVAL);
    ASSERT_ERR(cli_parse_fraction("--u", "1.01", 0, 1, &f, &e), -EINVAL);
}

/* 8 layers: full, sliding x 3, full, sliding x 3 (trunk 6 + MTP 2), 4 KV heads of 32 */
static void hybrid(struct model_config *c)
{
    memset(c, 0, sizeof(*c));
    c->n_layers = 6;
    c->n_mtp_layers = 2;
    c->n_layers_total = 8;
    c->sliding_window = 64;
    for (int i = 0; i < 8; i++) {
        c->layers[i].kind = i % 4 == 0 && i < 6 ? LAYER_KIND_FULL : LAYER_KIND_SLIDING;
        c->layers[i].n_kv_heads = 4;
        c->layers[i].head_dim = 32;
        c->layers[i].is_mtp = i >= 6;
    }
}

static void test_bytes_per_token(const char *tiny)
{
    struct model_config c;
    int64_t b[2];
    hybrid(&c);
    kvplan_bytes_per_token(&c, 1, 0, 2, 2, b);
    ASSERT_EQ(b[KVPLAN_FULL], 2 * 2 * 4 * 32 * 2);          /* layers 0, 4 */
    ASSERT_EQ(b[KVPLAN_SLIDING], 6 * 2 * 4 * 32 * 2);       /* 1-3, 5 and 2 MTP */
    kvplan_bytes_per_token(&c, 4, 0, 2, 4, b);               /* FP32, TP4: 1 head per rank */
    ASSERT_EQ(b[KVPLAN_FULL], 2 * 2 * 1 * 32 * 4);
    ASSERT_EQ(b[KVPLAN_SLIDING], 4 * 2 * 1 * 32 * 4 + 2 * 2 * 4 * 32 * 4);   /* MTP unsharded */
    kvplan_bytes_per_token(&c, 4, 3, 2, 4, b);               /* no MTP layers on rank 3 */
    ASSERT_EQ(b[KVPLAN_SLIDING], 4 * 2 * 1 * 32 * 4);
    kvplan_bytes_per_token(&c, 1, 0, 0, 2, b);
    ASSERT_EQ(b[KVPLAN_SLIDING], 4 * 2 * 4 * 32 * 2);

    char path[4096];
    struct err_buf e;
    snprintf(path, sizeof(path), "%s/config.json", tiny);
    if (model_config_load(path, &c, &e) < 0)
        FAIL("%s", e.msg);
    kvplan_bytes_per_token(&c, 1, 0, 3, 2, b);
    ASSERT_EQ(b[KVPLAN_FULL], 1024);        /* 2 full layers x K,V x 4 heads x 32 x BF16 */
    ASSERT_EQ(b[KVPLAN_SLIDING], 3072);     /* 3 sliding + 3 MTP layers */

    /* the sliding pool at --max-model-len 32768: the window's, not the length's */
    struct kvplan_req q = {
        .block_size = 16, .max_num_seqs = 8, .max_model_len = 32768, .max_batched_tokens = 256,
        .sliding_window = c.sliding_window, .mtp_margin = 3,
        .bytes_per_token = { b[0], b[1] },
    };
    struct kvplan p, p1k;
    ASSERT_OK(kvplan_compute(&q, -1, &p, &e));
    q.max_model_len = 1024;
    ASSERT_OK(kvplan_compute(&q, -1, &p1k, &e));
    ASSERT_EQ(p.n_blocks[KVPLAN_SLIDING], p1k.n_blocks[KVPLAN_SLIDING]);
    int64_t old_blocks = 8 * ((32768 + 3 + 15) / 16 + 1);     /* the sizing before the plan */
    int64_t old_bytes = old_blocks * 16 * 2 * b[KVPLAN_SLIDING];   /* FP32: twice BF16 */
    printf("tiny model, --max-model-len 32768, 8 sequences, window %d (+3 MTP), 256 tokens per "
           "step: sliding pool %d blocks = %lld bytes BF16 (old sizing: %lld blocks = %lld bytes "
           "FP32, %.0fx more); full pool %d blocks = %lld bytes\n", c.sliding_window,
           p.n_blocks[KVPLAN_SLIDING], (long long) p.bytes[KVPLAN_SLIDING], (long long) old_blocks,
           (long long) old_bytes, (double) old_bytes / (double) p.bytes[KVPLAN_SLIDING],
           p.n_blocks[KVPLAN_FULL], (long long) p.bytes[KVPLAN_FULL]);
    ASSERT_EQ(p.n_blocks[KVPLAN_FULL], 8 * 2049);           /* every sequence at full length */
    ASSERT_EQ(p.full_seqs, 8);
}

/* blocks the KV manager keeps for a run [p, p + c) with W' positions behind (kv.c) */
static int64_t held(int64_t p, int64_t c, int64_t w, int bs)
{
    int64_t first = p - w + 1;
    int64_t lo = first <= 0 ? 0 : first / bs;
    return (p + c - 1) / bs - lo + 1;
}

static void test_sliding_bound(void)
{
    struct kvplan_req q = {
        .block_size = 16, .max_num_seqs = 12, .max_model_len = 100000, .max_batched_tokens = 300,
        .sliding_window = 70, .mtp_margin = 3, .bytes_per_token = { 100, 50 },
    };
    struct kvplan p;
    struct err_buf e;
    ASSERT_OK(kvplan_compute(&q, -1, &p, &e));
    uint64_t z = 12345;
    int64_t worst = 0;
    for (int it = 0; it < 200000; it++) {
        int64_t left = q.max_batched_tokens, sum = 0;
        for (int s = 0; s < q.max_num_seqs; s++) {
            z = z * 6364136223846793005ull + 1442695040888963407ull;
            int64_t pos = (int64_t) (z >> 33) % 5000;
            int64_t c = left > 0 ? 1 + (int64_t) ((z >> 17) % (uint64_t) left) : 1;
            if (it % 3 == 0)
                c = s == 0 ? left - (q.max_num_seqs - 1) : 1;   /* one big chunk, decodes */
            left -= c;
            sum += held(pos, c, q.sliding_window + q.mtp_margin, q.block_size);
        }
        worst = sum > worst ? sum : worst;
    }
    printf("sliding bound: %d blocks for 12 sequences, worst of 200000 mixes %lld\n",
           p.n_blocks[KVPLAN_SLIDING], (long long) worst);
    ASSERT_LE(worst, p.n_blocks[KVPLAN_SLIDING]);
}

static void test_budget(void)
{
    struct kvplan_req q = {
        .block_size = 16, .max_num_seqs = 4, .max_model_len = 4096, .max_batched_tokens = 256,
        .sliding_window = 128, .mtp_margin = 0, .bytes_per_token = { 1000, 3000 },
    };
    struct kvplan p;
    struct err_buf e = { "" };
    ASSERT_OK(kvplan_compute(&q, -1, &p, &e));
    ASSERT_EQ(p.seq_blocks, (4096 + 3 + 15) / 16);
    ASSERT_EQ(p.n_blocks[KVPLAN_SLIDING], (4 * 128 + 256 + 15) / 16 + 8);
    ASSERT_EQ(p.all_bytes, p.bytes[KVPLAN_SLIDING] + 4LL * p.seq_blocks * 16000);
    ASSERT_EQ(p.full_seqs, 4);
    /* half the budget of every sequence at full length: the full pool shrinks, not the window */
    int64_t half = p.bytes[KVPLAN_SLIDING] + 2LL * p.seq_blocks * 16000 + 100;
    struct kvplan h;
    ASSERT_OK(kvplan_compute(&q, half, &h, &e));
    ASSERT_EQ(h.n_blocks[KVPLAN_SLIDING], p.n_blocks[KVPLAN_SLIDING]);
    ASSERT_EQ(h.n_blocks[KVPLAN_FULL], 2 * p.seq_blocks);
    ASSERT_EQ(h.full_seqs, 2);
    ASSERT_TRUE(h.bytes[0] + h.bytes[1] <= half);
    /* below one full-length sequence + the sliding pool */
    ASSERT_ERR(kvplan_compute(&q, p.min_bytes - 1, &h, &e), -ENOSPC);
    ASSERT_CONTAINS(e.msg, "--max-model-len 4096");
    ASSERT_CONTAINS(e.msg, "--max-num-seqs 4");
    ASSERT_CONTAINS(e.msg, "need at least");
    ASSERT_CONTAINS(e.msg, "the budget is");
    ASSERT_OK(kvplan_compute(&q, p.min_bytes, &h, &e));
    ASSERT_EQ(h.full_seqs, 1);
    q.block_size = 0;
    ASSERT_ERR(kvplan_compute(&q, -1, &h, &e), -EINVAL);
}

int main(int argc, char **argv)
{
    test_bytes();
    test_bytes_per_token(argc > 1 ? argv[1] : "models/tiny-step");
    test_sliding_bound();
    test_budget();
    printf("kvplan: ok\n");
    return 0;
}
