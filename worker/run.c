/* run.c - stepd-run: offline driver for the forward pass (load, prefill, greedy decode).
 *
 *   stepd-run MODEL_DIR [--prompt-ids 1,2,3 | --prompt TEXT] [-n N] [--threads T]
 *             [--mtp K] [--exact] [--chunk C] [--backend NAME] [--ids-only]
 *             [--kv-cache-dtype auto|bf16|fp32]
 *
 * Loads the checkpoint with the loader (world size 1), builds the model on the chosen
 * backend, runs the prompt as prefill chunks of C tokens (default: one chunk), then N
 * greedy tokens.  With --mtp K it decodes speculatively: the MTP layers draft K tokens,
 * the trunk verifies them in one step and the longest matching prefix is accepted
 * (greedy output is identical to --mtp 0).  Prints the generated ids (and text when the
 * tokenizer is built in) and timings: load, prefill tok/s, decode tok/s, acceptance.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#include "clock.h"
#include "backend.h"
#include "cli.h"
#include "loader.h"
#include "loadwatch.h"
#include "log.h"
#include "model.h"
#include "spec.h"
#include "stepd-config.h"

#include "tok/tokenizer.h"

#define RUN_BLOCK_SIZE 16

struct run_args {
    const char *dir;
    const char *prompt_ids;
    const char *prompt;
    const char *backend;
    int n_gen, threads, mtp, chunk;
    enum spec_draft_quant draft_quant;
    bool exact, ids_only, kv_f32;
};

static double now_sec(void)
{
    return clk_now_s();
}

static void usage(FILE *f)
{
    fprintf(f, "usage: stepd-run MODEL_DIR [--prompt-ids 1,2,3 | --prompt TEXT] [-n N]\n"
               "                 [--threads T] [--mtp K] [--exact] [--chunk C] [--backend NAME]\n"
               "                 [--ids-only] [--draft-quant auto|none|mxfp4]\n"
               "                 [--kv-cache-dtype auto|bf16|fp32]\n"
               "  --prompt-ids L  comma-separated token ids\n"
               "  --prompt TEXT   text, encoded with MODEL_DIR/tokenizer.json (BOS prepended)\n"
               "  -n N            tokens to generate (default 32)\n"
               "  --threads T     CPU backend threads (default: online cores)\n"
               "  --mtp K         speculative decoding with K MTP drafts (default 0)\n"
               "  --exact         exact MXFP4 path (W4A32) instead of the fast int8 path\n"
               "  --chunk C       prefill chunk size in tokens (default: whole prompt)\n"
               "  --backend NAME  cpu (default) or cuda\n"
               "  --ids-only      print only the generated ids, one line\n"
               "  --draft-quant Q MTP draft weights: auto (default: mxfp4 on cpu, none elsewhere),\n"
               "                  none (the checkpoint's) or mxfp4 (re-quantised copies)\n"
               "  --kv-cache-dtype D  KV cache rows: auto or bf16 (default), fp32 (as stepd-worker)\n"
               "  --version, --help  print the version, or this text, and exit\n");
}

static int parse_int(const char *s, const char *what, int lo, int hi, int *ret)
{
    struct err_buf e;
    int r = cli_parse_int(what, s, lo, hi, ret, &e);

    if (r < 0)
        fprintf(stderr, "stepd-run: %s\n", e.msg);
    return r;
}

static int parse_args(int argc, char **argv, struct run_args *a)
{
    static const struct option lo[] = {
        {"prompt-ids", required_argument, NULL, 'i'},
        {"prompt", required_argument, NULL, 'p'},
        {"threads", required_argument, NULL, 't'},
        {"mtp", required_argument, NULL, 'k'},
        {"exact", no_argument, NULL, 'x'},
        {"chunk", required_argument, NULL, 'c'},
        {"backend", required_argument, NULL, 'b'},
        {"ids-only", no_argument, NULL, 'q'},
        {"draft-quant", required_argument, NULL, 'd'},
        {"kv-cache-dtype", required_argument, NULL, 'K'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {0},
    };
    int c;

    memset(a, 0, sizeof(*a));
    a->n_gen = 32;
    a->backend = "cpu";
    while ((c = getopt_long(argc, argv, "n:h", lo, NULL)) != -1) {
        switch (c) {
        case 'i': a->prompt_ids = optarg; break;
        case 'p': a->prompt = optarg; break;
        case 'b': a->backend = optarg; break;
        case 'x': a->exact = true; break;
        case 'q': a->ids_only = true; break;
        case 'd':
            if (strcmp(optarg, "mxfp4") == 0) {
                a->draft_quant = SPEC_DRAFT_MXFP4;
            } else if (strcmp(optarg, "none") == 0) {
                a->draft_quant = SPEC_DRAFT_NONE;
            } else if (strcmp(optarg, "auto") != 0) {
                fprintf(stderr, "stepd-run: --draft-quant: expected auto, none or mxfp4, got '%s'\n",
                        optarg);
                return -EINVAL;
            }
            break;
        case 'n': if (parse_int(optarg, "-n", 1, 1 << 20, &a->n_gen) < 0) return -EINVAL; break;
        case 't': if (parse_int(optarg, "--threads", 0, 1024, &a->threads) < 0) return -EINVAL; break;
        case 'k': if (parse_int(optarg, "--mtp", 0, 16, &a->mtp) < 0) return -EINVAL; break;
        case 'c': if (parse_int(optarg, "--chunk", 1, 1 << 20, &a->chunk) < 0) return -EINVAL; break;
        case 'K': {
            struct err_buf e;

            if (cli_parse_kv_dtype("--kv-cache-dtype", optarg, &a->kv_f32, &e) < 0) {
                fprintf(stderr, "stepd-run: %s\n", e.msg);
                return -EINVAL;
            }
            break;
        }
        case 'h': usage(stdout); exit(0);
        case 'V': printf("stepd-run %s\n", STEPD_VERSION); exit(0);
        default: usage(stderr); return -EINVAL;
        }
    }
    if (optind + 1 != argc) {
        fprintf(stderr, "stepd-run: expected exactly one MODEL_DIR\n");
        usage(stderr);
        return -EINVAL;
    }
    a->dir = argv[optind];
    if (!!a->prompt_ids == !!a->prompt) {
        fprintf(stderr, "stepd-run: give exactly one of --prompt-ids or --prompt\n");
        return -EINVAL;
    }
    return 0;
}

static int parse_ids(const char *s, int vocab, int32_t **ret, int *ret_n)
{
    struct err_buf e;
    int r = cli_parse_ids("--prompt-ids", s, vocab, ret, ret_n, &e);

    if (r < 0)
        fprintf(stderr, "stepd-run: %s\n", r == -ENOMEM ? "out of memory" : e.msg);
    return r;
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

/* One sequence in slot 0 with identity block tables in both groups. */
struct run_seq {
    struct step_plan plan;
    struct step_seq seq;
    int32_t *tokens;
    int32_t *table;
    int n_blocks;
};

static void plan_fill(struct run_seq *rs, int pos0, const int32_t *toks, int n, int n_logits,
                      int mtp_depth)
{
    memcpy(rs->tokens, toks, sizeof(int32_t) * (size_t)n);
    rs->seq = (struct step_seq){
        .slot = 0, .pos0 = pos0, .n_tokens = n, .n_logits = n_logits, .tok_off = 0,
        .n_blocks = (pos0 + n + RUN_BLOCK_SIZE - 1) / RUN_BLOCK_SIZE,
        .block_off = {0, 0}, .mtp_depth = mtp_depth,
    };
    rs->plan.step_id++;
    rs->plan.n_seqs = 1;
    rs->plan.n_tokens = n;
    rs->plan.seqs = &rs->seq;
    rs->plan.tokens = rs->tokens;
    for (int g = 0; g < _KV_GROUP_MAX; g++) {
        rs->plan.n_block_ids[g] = rs->seq.n_blocks;
        rs->plan.blocks[g] = rs->table;
    }
}

/* MTP chain after a step: n_valid accepted tokens, `next` appended; drafts out. */
static int draft(struct model *m, struct run_seq *rs, int K, int n_valid, int32_t next,
                 const int32_t *future, float *logits, int vocab, int32_t *drafts)
{
    int32_t nv = n_valid, tok = next;
    int r;

    for (int k = 0; k < K; k++) {
        r = model_mtp_step(m, k, &rs->plan, &nv, &tok, logits);
        if (r < 0)
            return r;
        drafts[k] = (int32_t)argmax(logits, vocab);
        /* inside the prompt the true next token is known; else chain the draft */
        tok = future ? future[k] : drafts[k];
    }
    return 0;
}

int main(int argc, char **argv)
{
    struct run_args a;
    struct err_buf e = {{0}};
    struct ckpt *ck = NULL;
    struct backend *be = NULL;
    struct model *m = NULL;
    struct run_seq rs = {0};
    int32_t *prompt = NULL, *out = NULL, *drafts = NULL;
    float *logits = NULL;
    int n_prompt = 0, n_out = 0, vocab, K, r, rc = 1;
    double t0, t_load, t_prefill = 0, t_decode = 0;
    long n_steps = 0, n_drafted = 0, n_accepted = 0;

    log_init("stepd-run", NULL);
    if (parse_args(argc, argv, &a) < 0)
        return 2;

    t0 = now_sec();
    struct ckpt_opts co = {.world_size = 1, .rank = 0, .mtp_depth = a.mtp};
    r = ckpt_open(a.dir, &co, &ck, &e);
    if (r < 0) {
        fprintf(stderr, "stepd-run: %s: %s\n", a.dir, e.msg);
        goto out;
    }
    if (a.mtp > ckpt_mtp_depth(ck)) {
        fprintf(stderr, "stepd-run: --mtp %d but the checkpoint has %d MTP layers\n", a.mtp,
                ckpt_mtp_depth(ck));
        goto out;
    }
    K = a.mtp;
    vocab = ckpt_config(ck)->vocab_size;

    if (a.prompt_ids) {
        r = parse_ids(a.prompt_ids, vocab, &prompt, &n_prompt);
        if (r < 0)
            goto out;
    } else {
        char path[4096];
        struct tokenizer *tk;
        struct tok_ids ids = {0};
        snprintf(path, sizeof(path), "%s/tokenizer.json", a.dir);
        r = tok_load(path, &tk, &e);
        if (r < 0) {
            fprintf(stderr, "stepd-run: %s\n", e.msg);
            goto out;
        }
        if (tok_bos_id(tk) < 0)
            tok_bos_set(tk, ckpt_config(ck)->bos_token_id);
        r = tok_encode(tk, a.prompt, strlen(a.prompt), TOK_ENCODE_ADD_BOS, &ids, &e);
        tok_free(tk);
        if (r < 0) {
            fprintf(stderr, "stepd-run: --prompt: %s\n", e.msg);
            goto out;
        }
        prompt = ids.ids;
        n_prompt = (int)ids.n;
    }
    if (n_prompt < 1) {
        fprintf(stderr, "stepd-run: empty prompt\n");
        goto out;
    }

    struct backend_cfg bc = {.n_threads = a.threads, .mxfp4_exact = a.exact};
    r = backend_new(a.backend, &bc, &be);
    if (r < 0) {
        fprintf(stderr, "stepd-run: backend '%s': %s\n", a.backend, err_str(r));
        goto out;
    }

    int max_len = n_prompt + a.n_gen + K + 1;
    int chunk = a.chunk > 0 && a.chunk < n_prompt ? a.chunk : n_prompt;
    int T = chunk > K + 1 ? chunk : K + 1;
    int n_blocks = (max_len + RUN_BLOCK_SIZE - 1) / RUN_BLOCK_SIZE;
    struct model_opts mo = {
        .max_tokens_per_step = T, .max_seqs = 1, .max_logit_rows = K + 1,
        .block_size = RUN_BLOCK_SIZE, .n_blocks = {n_blocks, n_blocks}, .max_seq_len = max_len,
        .kv_f32 = a.kv_f32,
        .draft_quant = spec_draft_mxfp4(a.draft_quant, a.backend) ? MODEL_DRAFT_MXFP4
                                                                  : MODEL_DRAFT_CHECKPOINT,
    };
    /* on a terminal, the load's progress in place (loadwatch.c); elsewhere a log line each 5 s */
    struct load_watch *lw = NULL;
    struct load_watch_opts lwo = { .tty = isatty(STDERR_FILENO) };
    if (load_watch_start(&lwo, &lw) == 0)
        load_watch_set(lw, ck);
    r = model_new(ck, be, NULL, &mo, &m, &e);
    load_watch_stop(lw);
    if (r < 0) {
        fprintf(stderr, "stepd-run: %s\n", e.msg);
        goto out;
    }
    t_load = now_sec() - t0;

    rs.tokens = calloc((size_t)T, sizeof(int32_t));
    rs.table = calloc((size_t)n_blocks, sizeof(int32_t));
    logits = calloc((size_t)(K + 1) * (size_t)vocab, sizeof(float));
    out = calloc((size_t)a.n_gen + (size_t)K + 1, sizeof(int32_t));
    drafts = calloc((size_t)K + 1, sizeof(int32_t));
    if (!rs.tokens || !rs.table || !logits || !out || !drafts) {
        fprintf(stderr, "stepd-run: out of memory\n");
        goto out;
    }
    for (int b = 0; b < n_blocks; b++)
        rs.table[b] = b;

    /* prefill in chunks; the last chunk yields the first token */
    t0 = now_sec();
    int32_t next = -1;
    for (int p0 = 0; p0 < n_prompt; p0 += chunk) {
        int n = n_prompt - p0 < chunk ? n_prompt - p0 : chunk;
        bool last = p0 + n == n_prompt;
        plan_fill(&rs, p0, prompt + p0, n, last ? 1 : 0, K);
        r = model_step(m, &rs.plan, logits);
        if (r < 0) {
            fprintf(stderr, "stepd-run: prefill: %s\n", model_last_error(m));
            goto out;
        }
        if (last) {
            next = (int32_t)argmax(logits, vocab);
        }
        if (K > 0) {
            /* MTP KV over the chunk: known prompt tokens where they exist */
            int32_t fut[16];
            for (int k = 0; k < K; k++) {
                int idx = p0 + n + 1 + k;
                fut[k] = idx < n_prompt ? prompt[idx] : -1;
            }
            int32_t in0 = last ? next : prompt[p0 + n];
            bool known = true;
            for (int k = 0; k + 1 < K; k++)
                known = known && fut[k] >= 0;
            r = draft(m, &rs, K, n, in0, known ? fut : NULL, logits, vocab, drafts);
            if (r < 0) {
                fprintf(stderr, "stepd-run: prefill MTP: %s\n", model_last_error(m));
                goto out;
            }
        }
    }
    t_prefill = now_sec() - t0;
    out[n_out++] = next;

    /* decode: verify [next, d1..dK] per step (K = 0: plain greedy) */
    t0 = now_sec();
    int pos = n_prompt;
    while (n_out < a.n_gen) {
        int32_t run[17];
        int acc = 0;
        run[0] = next;
        for (int k = 0; k < K; k++)
            run[1 + k] = drafts[k];
        plan_fill(&rs, pos, run, 1 + K, 1 + K, K);
        r = model_step(m, &rs.plan, logits);
        if (r < 0) {
            fprintf(stderr, "stepd-run: decode: %s\n", model_last_error(m));
            goto out;
        }
        n_steps++;
        /* greedy verification: accept drafts while they match the trunk's argmax */
        int32_t y = (int32_t)argmax(logits, vocab);
        while (acc < K && y == run[1 + acc] && n_out < a.n_gen) {
            out[n_out++] = y;
            acc++;
            y = (int32_t)argmax(logits + (size_t)acc * vocab, vocab);
        }
        n_drafted += K;
        n_accepted += acc;
        if (n_out < a.n_gen)
            out[n_out++] = y;
        next = y;
        pos += 1 + acc;
        if (K > 0 && n_out < a.n_gen) {
            r = draft(m, &rs, K, 1 + acc, next, NULL, logits, vocab, drafts);
            if (r < 0) {
                fprintf(stderr, "stepd-run: MTP: %s\n", model_last_error(m));
                goto out;
            }
        }
    }
    t_decode = now_sec() - t0;

    if (a.ids_only) {
        for (int i = 0; i < n_out; i++)
            printf("%s%d", i ? "," : "", out[i]);
        printf("\n");
    } else {
        printf("prompt (%d tokens):", n_prompt);
        for (int i = 0; i < n_prompt; i++)
            printf(" %d", prompt[i]);
        printf("\ngenerated (%d tokens):", n_out);
        for (int i = 0; i < n_out; i++)
            printf(" %d", out[i]);
        printf("\n");
        {
            char path[4096], *text = NULL;
            struct tokenizer *tk;
            snprintf(path, sizeof(path), "%s/tokenizer.json", a.dir);
            if (tok_load(path, &tk, NULL) == 0) {
                if (tok_decode(tk, out, (size_t)n_out, false, &text, NULL) == 0)
                    printf("text: %s\n", text);
                free(text);
                tok_free(tk);
            }
        }
        printf("load %.3f s; prefill %d tokens in %.4f s = %.1f tok/s (chunk %d); "
               "decode %d tokens in %.4f s = %.1f tok/s",
               t_load, n_prompt, t_prefill, n_prompt / t_prefill, chunk, n_out - 1, t_decode,
               n_out > 1 ? (n_out - 1) / t_decode : 0.0);
        if (K > 0)
            printf("; mtp K=%d: %ld steps, accepted %ld of %ld drafts (%.2f per step)", K, n_steps,
                   n_accepted, n_drafted, n_steps ? (double)n_accepted / n_steps : 0.0);
        printf("; backend %s%s, threads %d, KV cache %s\n", a.backend, a.exact ? " (exact MXFP4)" : "", a.threads,
               a.kv_f32 ? "FP32" : "BF16");
    }
    rc = 0;
out:
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
    free(prompt);
    free(out);
    free(drafts);
    free(logits);
    free(rs.tokens);
    free(rs.table);
    return rc;
}
