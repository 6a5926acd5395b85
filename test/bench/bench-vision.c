/* bench-vision.c - the vision encoder at Step-3.7-Flash's real shapes on the CPU backend
 * (suite bench, not in the default run).
 *
 *   bench-vision --mkmodel PATH | --model DIR  [--threads 1,2] [--crops N] [--layers L]
 *                [--reps N] [--keep] [--no-ttft]
 *
 * The model: stepd-mkmodel --vision L (the full-width tower: width 1536, 16 heads, MLP 8960,
 * downsamplers to 6144, projector to 4096) beside a one-layer narrow text model with hidden
 * 4096, made at run time in a temporary directory unless --model names one (L = 47, the real
 * depth, by default: 3.7 GB of BF16 weights).  For each thread count: one 728x728 global view
 * plus N (default 4) 504x504 crops encoded in ONE vision_encode call (synthetic pixels), the
 * best of REPS (default 2), with the time of each stage (patch embed, blocks, downsamplers +
 * projector) from the trace callback; beside it the GEMM peak measured in the same run on the
 * same backend: backend_matmul of the MLP's c_fc shape ([8960, 1536] BF16) over the global
 * view's 2704 tokens, the best of 3 calls before the encoder and 3 after.  Printed: encode
 * ms, useful GFLOP (2 * MACs of every GEMM and of attention), GFLOP/s and that as % of the
 * GEMM peak.
 *
 * The encoder's share of the time to first token (unless --no-ttft): the model made then has
 * the full-width text trunk too (stepd-mkmodel --layers 4: the real layers 0 dense/full,
 * 1 dense/sliding, 3 MoE/sliding, 4 MoE/full, 288 experts x 1280 top-8, vocab 128896;
 * 13 GB in all with the 47-block tower), and after the encoder each thread count prefills
 * one prompt of the image's tokens (the encoder's output rows spliced in) plus TTFT_TEXT
 * text tokens through each of the 4 layers (best of REPS per layer), then the head's one row.
 * The prefill of Step-3.7-Flash's 45 layers is extrapolated per layer kind (1 dense/full,
 * 2 dense/sliding, 11 MoE/full, 31 MoE/sliding, as bench-shapes counts them); printed: the
 * encode, the 45-layer prefill, the head, their sum (the time to first token of a one-image
 * prompt on an idle server, queueing and sampling aside) and the encoder's share of it; with
 * --layers L < 47 the encode counts 47 blocks at the measured blocks' mean time.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckptw.h"
#include "clock.h"
#include "harness.h"
#include "loader.h"
#include "model-int.h"
#include "vision.h"

#define TTFT_TEXT 32                /* text tokens of the prompt beside the image's */
#define TTFT_BS 16                  /* KV block size of the prefill */
#define TTFT_BLOCKS 47              /* the real tower's blocks (--layers L < 47: scaled to it) */

struct stamps {
    int64_t t[_VISION_STAGES];
    bool seen[_VISION_STAGES];
};

static void stamp(void *arg, enum vision_stage st, int view, const float *x, int rows, int cols)
{
    struct stamps *s = arg;

    (void) view; (void) x; (void) rows; (void) cols;
    if (!s->seen[st]) {
        s->seen[st] = true;
        s->t[st] = clk_now_ns();
    }
}

/* 2 * multiply-adds of one view of g x g patches */
static double view_flops(const struct vision_config *c, int g)
{
    double n = (double) g * g, C = c->width, I = c->inter, P = c->patch;
    int g1 = (g - 1) / 2 + 1, g2 = (g1 - 1) / 2 + 1;
    double n1 = (double) g1 * g1, n2 = (double) g2 * g2;
    double blk = 2 * n * C * 3 * C + 2 * 2 * n * n * C + 2 * n * C * C + 2 * 2 * n * C * I;

    return 2 * n * C * 3 * P * P + c->layers * blk + 2 * n1 * 2 * C * 9 * C + 2 * n2 * 4 * C * 18 * C +
           2 * n2 * c->text_hidden * 4 * C;
}

/* Step-3.7-Flash's 45 trunk layers by kind: [moe][sliding] */
static const int ttft_layers[2][2] = { { 1, 2 }, { 11, 31 } };

/* The prefill of one prompt: the image's `n_img` rows (img, the encoder's output) then
 * TTFT_TEXT text tokens, through each layer of model m (best of reps each), extrapolated to
 * the 45 layers; *head_s: the final norm and lm_head of the last row.  Seconds, or < 0. */
static double ttft_prefill(struct model *m, const float *img, int n_img, int reps, double *head_s)
{
    const int T = n_img + TTFT_TEXT, H = m->hidden;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t) T * 3), *pos = ids + T, *slots = pos + T;
    int32_t table[4096], start[2] = { 0, T }, zero = 0;
    struct step_seq sq = { .n_tokens = T, .n_blocks = (T + TTFT_BS - 1) / TTFT_BS };
    struct step_plan p = { .n_seqs = 1, .n_tokens = T, .seqs = &sq };
    struct batch bt = { .n_tok = T, .n_seqs = 1, .pos = NULL, .seq_start = start, .seq_pos0 = &zero };
    double kind_s[2][2] = { { 0, 0 }, { 0, 0 } }, total = 0;
    bool seen[2][2] = { { false, false }, { false, false } };
    float *x = malloc(sizeof(float) * (size_t) T * H);
    int r = 0;

    if (!ids || !x || sq.n_blocks > 4096) {
        free(ids);
        free(x);
        return -1;
    }
    for (int i = 0; i < T; i++) {
        ids[i] = (int32_t) ((i * 2654435761u) % (uint32_t) m->vocab);
        pos[i] = i;
        slots[i] = i;
    }
    for (int j = 0; j < sq.n_blocks; j++)
        table[j] = j;
    p.tokens = ids;
    bt.ids = ids;
    bt.pos = pos;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        bt.slots[g] = slots;
        bt.boff[g] = &zero;
        bt.tables[g] = table;
        p.n_block_ids[g] = sq.n_blocks;
        p.blocks[g] = table;
    }
    r = model__step_inputs(m, &bt, &p, false);
    r = r < 0 ? r : backend_embed(m->be, &m->embed, ids, T, x);
    if (r >= 0)
        memcpy(x, img, sizeof(float) * (size_t) n_img * H);     /* the image rows spliced in */
    for (int l = 0; r >= 0 && l < m->n_layers; l++) {
        struct mlayer *L = &m->layers[l];
        double best = 1e30;

        for (int k = 0; r >= 0 && k < reps; k++) {
            memcpy(m->hid, x, sizeof(float) * (size_t) T * H);
            int64_t t0 = clk_now_ns();
            r = model__layer_forward(m, L, m->hid, &bt);
            double dt = (clk_now_ns() - t0) / 1e9;
            best = dt < best ? dt : best;
        }
        if (r >= 0) {
            kind_s[L->is_moe][L->window > 0] = best;
            seen[L->is_moe][L->window > 0] = true;
        }
    }
    *head_s = 1e30;
    for (int k = 0; r >= 0 && k < reps; k++) {
        int64_t t0 = clk_now_ns();
        r = backend_rmsnorm(m->be, m->hid + (size_t) (T - 1) * H, &m->final_norm, 1, H, m->cfg->rms_norm_eps,
                            m->rows_h);
        r = r < 0 ? r : backend_matmul(m->be, &m->lm_head, m->rows_h, 1, m->rows_logits);
        double dt = (clk_now_ns() - t0) / 1e9;
        *head_s = dt < *head_s ? dt : *head_s;
    }
    free(ids);
    free(x);
    if (r < 0) {
        fprintf(stderr, "bench-vision: prefill: %s\n", model_last_error(m));
        return -1;
    }
    for (int moe = 0; moe < 2; moe++)
        for (int sl = 0; sl < 2; sl++) {
            if (!seen[moe][sl]) {
                fprintf(stderr, "bench-vision: the text model has no %s/%s layer\n", moe ? "MoE" : "dense",
                        sl ? "sliding" : "full");
                return -1;
            }
            total += ttft_layers[moe][sl] * kind_s[moe][sl];
        }
    return total;
}

/* The GEMM peak on backend be, GFLOP/s: BF16 c_fc's shape ([inter, width]) over the global
 * view's 2704 tokens, the best of n calls.  Measured before and after the encoder, the better
 * taken: one reading on a shared host can land in another process's time slice. */
static double gemm_peak(struct backend *be, const struct vision_config *c, int n_calls)
{
    int64_t n = 2704, K = c->width, N = c->inter;
    uint16_t *w = malloc((size_t) (N * K) * 2);
    float *x = malloc((size_t) (n * K) * 4), *y = malloc((size_t) (n * N) * 4);
    struct bweight bw = {.fmt = WFMT_BF16, .rows = N, .cols = K, .data = w};
    double peak = 0;

    ASSERT_TRUE(w && x && y);
    for (int64_t k = 0; k < N * K; k++)
        w[k] = ckptw_f32_to_bf16(ckptw_random_value(7, "w", k, 0.03f));
    for (int64_t k = 0; k < n * K; k++)
        x[k] = ckptw_random_value(8, "x", k, 1.0f);
    ASSERT_OK(backend_weight_prepare(be, &bw));
    for (int r = 0; r < n_calls; r++) {
        int64_t t0 = clk_now_ns();
        ASSERT_OK(backend_matmul(be, &bw, x, (int) n, y));
        double gf = 2.0 * n * N * K / ((clk_now_ns() - t0) / 1e9) / 1e9;
        peak = gf > peak ? gf : peak;
    }
    backend_weight_release(be, &bw);
    free(w);
    free(x);
    free(y);
    return peak;
}

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        out[n++] = atoi(s);
        s = strchr(s, ',');
        if (!s)
            break;
        s++;
    }
    return n;
}

int main(int argc, char **argv)
{
    const char *mk = NULL, *model = NULL;
    int threads[8] = {1, 2}, n_threads = 2, crops = 4, layers = 47, reps = 2;
    bool keep = false, ttft = true;
    char *tmp = NULL, cmd[8192];
    struct err_buf e = {{0}};

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mkmodel") == 0 && i + 1 < argc)
            mk = argv[++i];
        else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc)
            model = argv[++i];
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            n_threads = parse_list(argv[++i], threads, 8);
        else if (strcmp(argv[i], "--crops") == 0 && i + 1 < argc)
            crops = atoi(argv[++i]);
        else if (strcmp(argv[i], "--layers") == 0 && i + 1 < argc)
            layers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--keep") == 0)
            keep = true;
        else if (strcmp(argv[i], "--no-ttft") == 0)
            ttft = false;
        else
            FAIL("usage: bench-vision --mkmodel PATH | --model DIR [--threads 1,2] [--crops N] "
                 "[--layers L] [--reps N] [--keep] [--no-ttft]");
    }
    if (!mk && !model)
        FAIL("bench-vision: --mkmodel PATH or --model DIR");
    if (crops < 0 || crops > 16 || layers < 1 || reps < 1 || n_threads < 1)
        FAIL("bench-vision: bad --crops, --layers, --reps or --threads");
    if (!model) {
        int64_t t0 = clk_now_ns();
        tmp = ckptw_tmpdir("bench-vision");
        ASSERT_TRUE(tmp != NULL);
        if (ttft)       /* the full-width text trunk beside the tower */
            snprintf(cmd, sizeof(cmd), "'%s' --out '%s' --layers 4 --vision %d --force > /dev/null", mk, tmp,
                     layers);
        else
            snprintf(cmd, sizeof(cmd), "'%s' --out '%s' --preset narrow8 --hidden 4096 --layers 1 --vision %d "
                     "--sparse experts --force > /dev/null", mk, tmp, layers);
        ASSERT_EQ(system(cmd), 0);
        model = tmp;
        printf("model: stepd-mkmodel --vision %d in %s (%.1f s)\n", layers, tmp, (clk_now_ns() - t0) / 1e9);
    }

    /* synthetic views: a global 728 view and `crops` 504 crops */
    struct vision_view views[17];
    uint8_t *pix[17];
    for (int i = 0; i <= crops; i++) {
        int size = i == 0 ? 728 : 504;
        pix[i] = malloc((size_t) size * size * 3);
        ASSERT_TRUE(pix[i] != NULL);
        for (size_t k = 0; k < (size_t) size * size * 3; k++)
            pix[i][k] = (uint8_t) ((k * 2654435761u) >> 24);
        views[i] = (struct vision_view) {.rgb = pix[i], .size = size};
    }

    struct ckpt_opts o = {.world_size = 1, .rank = 0};
    struct ckpt *ck;
    if (ckpt_open(model, &o, &ck, &e) < 0)
        FAIL("%s", e.msg);
    printf("%-8s %-10s %-9s %-9s %-9s %-9s %-10s %-10s %s\n", "threads", "encode ms", "embed ms",
           "blocks ms", "ds+proj", "GFLOP", "GFLOP/s", "GEMM peak", "% of peak");
    for (int ti = 0; ti < n_threads; ti++) {
        struct backend_cfg bc = {.n_threads = threads[ti]};
        struct backend *be;
        struct vision *v;
        const struct vision_config *c;
        double flops = 0, best = 1e30, peak = 0;
        struct stamps bs = {{0}};
        int tokens = 0;
        float *out;

        ASSERT_OK(backend_new("cpu", &bc, &be));
        if (vision_new(ck, be, &v, &e) < 0)
            FAIL("%s", e.msg);
        c = vision_cfg(v);
        for (int i = 0; i <= crops; i++) {
            flops += view_flops(c, views[i].size / c->patch);
            tokens += vision_view_tokens(v, views[i].size);
        }
        out = malloc((size_t) tokens * c->text_hidden * sizeof(float));
        ASSERT_TRUE(out != NULL);
        peak = gemm_peak(be, c, 3);
        for (int r = 0; r < reps; r++) {
            struct stamps s = {{0}};
            int64_t t0 = clk_now_ns();
            if (vision_encode(v, views, crops + 1, out, stamp, &s, &e) < 0)
                FAIL("%s", e.msg);
            double dt = (clk_now_ns() - t0) / 1e9;
            if (dt < best) {
                best = dt;
                bs = s;
                bs.t[0] -= t0;
                for (int k = 1; k < _VISION_STAGES; k++)
                    bs.t[k] -= t0;
            }
        }
        peak = fmax(peak, gemm_peak(be, c, 3));     /* after the encoder too: the better */
        double gfs = flops / best / 1e9;
        printf("%-8d %-10.1f %-9.1f %-9.1f %-9.1f %-9.1f %-10.1f %-10.1f %.1f %%\n", threads[ti], best * 1e3,
               bs.t[VISION_PATCH_EMBED] / 1e6, (bs.t[VISION_VIT] - bs.t[VISION_PATCH_EMBED]) / 1e6,
               (best * 1e9 - bs.t[VISION_VIT]) / 1e6, flops / 1e9, gfs, peak, 100 * gfs / peak);
        printf("  (%d views: 1 x 728 + %d x 504, %d tokens of %d, %d blocks)\n", crops + 1, crops, tokens,
               c->text_hidden, c->layers);
        if (ttft) {
            const int T = tokens + TTFT_TEXT;
            struct model_opts mo = {
                .max_tokens_per_step = T, .max_seqs = 1, .max_logit_rows = 1, .block_size = TTFT_BS,
                .n_blocks = { T / TTFT_BS + 1, T / TTFT_BS + 1 }, .max_seq_len = T + TTFT_BS,
            };
            struct model *m;
            double head = 0, pre, enc = best;
            const char *scaled = "";

            if (model_new(ck, be, NULL, &mo, &m, &e) < 0)
                FAIL("%s", e.msg);
            if (m->hidden != c->text_hidden)
                FAIL("bench-vision: the text model's hidden %d is not the projector's %d", m->hidden,
                     c->text_hidden);
            pre = ttft_prefill(m, out, tokens, reps, &head);
            if (pre < 0)
                FAIL("bench-vision: the prefill failed");
            if (c->layers < TTFT_BLOCKS) {    /* the real tower's 47 blocks from the measured ones */
                enc += (bs.t[VISION_VIT] - bs.t[VISION_PATCH_EMBED]) / 1e9 * (TTFT_BLOCKS - c->layers) /
                       c->layers;
                scaled = " (47 blocks scaled from the measured ones)";
            }
            printf("  time to first token, one image: encode %.1f ms%s + prefill of %d tokens through 45 "
                   "layers %.1f ms + head %.1f ms = %.1f ms; the encoder's share %.1f %%\n", enc * 1e3, scaled, T,
                   pre * 1e3, head * 1e3, (enc + pre + head) * 1e3, 100 * enc / (enc + pre + head));
            model_free(m);
        }
        free(out);
        vision_free(v);
        backend_free(be);
    }
    ckpt_close(ck);
    for (int i = 0; i <= crops; i++)
        free(pix[i]);
    if (tmp && !keep)
        ckptw_rmtree(tmp);
    free(tmp);
    return 0;
}
