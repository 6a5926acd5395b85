/* bench-grammar-step.c - the engine step time structured output adds on the tiny model: batch
 * 1, 16 and 64 decoding TOKENS tokens each (K = 0, greedy), free against every sequence under
 * a grammar (a regex that cannot end within TOKENS, so both runs decode the same number of
 * steps).  Median step time of each run and the ratio; one run each, free first.  The grammar
 * vocabulary is built before the timed runs (a first constrained request).
 *
 * Usage: bench-grammar-step MODEL_DIR [TOKENS (24)] [THREADS (0 = the CPUs usable)]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "benchlib.h"
#include "engine.h"
#include "grammar.h"
#include "../engine/model-rig.h"

#define MAX_B 64
#define MAX_STEPS 4096

static int n_done;

static void on_out(void *ud, const struct engine_output *o)
{
    (void) ud;
    n_done += o->finished;
}

/* B requests, constrained or free, stepped to the end: the median step time in ms. */
static double run(struct engine *e, int b, int tokens, bool constrained, int round)
{
    static double steps[MAX_STEPS];
    int32_t prompt[16];
    struct err_buf err;
    int n = 0;

    n_done = 0;
    for (int i = 0; i < b; i++) {
        struct engine_request q;
        char id[32];
        for (int k = 0; k < 16; k++)
            prompt[k] = 10 + (i * 131 + k * 17 + round * 7) % 3000;
        engine_request_init(&q);
        snprintf(id, sizeof(id), "r%d-%d-%d", round, constrained, i);
        q.id = id;
        q.prompt = prompt;
        q.n_prompt = 16;
        q.max_tokens = tokens;
        q.num_speculative_tokens = 0;
        if (constrained) {
            q.constraint_kind = "regex";
            q.constraint = "[a-z ,.]{2000}";
        } else {
            q.ignore_eos = true;
        }
        if (engine_submit(e, &q, on_out, NULL, &err) < 0) {
            fprintf(stderr, "submit: %s\n", err.msg);
            exit(1);
        }
    }
    while (n_done < b && n < MAX_STEPS) {
        double t0 = bench_now();
        if (engine_step(e) < 0)
            exit(1);
        steps[n++] = (bench_now() - t0) * 1e3;
    }
    return bench_median(steps, n);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : "models/tiny-step";
    int tokens = argc > 2 ? atoi(argv[2]) : 24, threads = argc > 3 ? atoi(argv[3]) : 0;
    char tokjson[4096];
    struct model_rig rig;
    struct err_buf err;
    struct engine_config ec;
    struct engine *e;

    if (grammar_lib_open(&err) < 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 77;
    }
    if (model_rig_open(&rig, dir, threads, MAX_B, 2048, 256, &err) < 0) {
        fprintf(stderr, "bench-grammar-step: %s: %s\n", dir, err.msg);
        return 1;
    }
    snprintf(tokjson, sizeof(tokjson), "%s/tokenizer.json", dir);
    engine_config_init(&ec);
    ec.max_num_batched_tokens = 2048;
    ec.max_num_seqs = MAX_B;
    ec.max_model_len = 256;
    ec.sliding_window = rig.cfg->sliding_window;
    ec.num_speculative_tokens = 0;
    for (int i = 0; i < rig.cfg->n_eos && i < ENGINE_MAX_EOS; i++)
        ec.eos_ids[ec.n_eos++] = rig.cfg->eos_token_ids[i];
    ec.grammar_tokenizer = tokjson;
    ec.enable_prefix_caching = false;
    if (engine_new(rig.f, &ec, &e, &err) < 0) {
        fprintf(stderr, "bench-grammar-step: %s\n", err.msg);
        return 1;
    }
    (void) run(e, 1, 2, true, 0);      /* builds the grammar vocabulary */
    printf("bench-grammar-step: %s, %d tokens per sequence, K = 0, greedy; median step (ms)\n", dir, tokens);
    printf("%6s %10s %12s %8s\n", "batch", "free", "constrained", "ratio");
    static const int batches[] = { 1, 16, 64 };
    for (int i = 0; i < 3; i++) {
        double f = run(e, batches[i], tokens, false, 1 + i);
        double c = run(e, batches[i], tokens, true, 1 + i);
        printf("%6d %10.2f %12.2f %8.2f\n", batches[i], f, c, c / f);
    }
    engine_free(e);
    model_rig_close(&rig);
    return 0;
}
