/* test-inspect.c - stepd-inspect end to end: exit 0 and a plan for a loadable
 * checkpoint (every rank, or one), exit 1 with every problem listed for a broken
 * one, exit 2 on usage errors; --json is valid JSON with per-rank figures; the memory
 * plan: both pools per rank and the group's, a budget too small is exit 1 naming what is
 * needed and the longest --max-model-len that fits, the same figures in JSON; incomplete
 * MTP layers: the missing names and the trunk's plan, exit 0 (1 with --strict).
 * argv[1] = path of stepd-inspect. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "ckptw.h"
#include "harness.h"

static const char *inspect;

/* run inspect with args; returns exit status, output in *out (malloc'd) */
static int run(const char *args, char **out)
{
    char cmd[4096];

    snprintf(cmd, sizeof(cmd), "'%s' %s", inspect, args);
    return test_run(cmd, out);
}

/* run inspect on dir (none: NULL) with args: exit status want and every needle in the output */
static void expect(const char *dir, const char *args, int want, const char *const *needles)
{
    char cmd[1200], *out;

    if (dir)
        snprintf(cmd, sizeof(cmd), "'%s' %s", dir, args);
    else
        snprintf(cmd, sizeof(cmd), "%s", args);
    ASSERT_EQ(run(cmd, &out), want);
    for (int i = 0; needles && needles[i]; i++)
        ASSERT_CONTAINS(out, needles[i]);
    free(out);
}

/* The text-mode cases: checkpoint (under the test's directory; NULL: none), arguments, exit
 * status and what the output must contain. */
static const struct icase {
    const char *dir, *args;
    int want;
    const char *needles[9];     /* NULL-terminated */
} cases[] = {
    { "good", "--world-size 4", 0,
      { "rank 0/4: ok:", "rank 3/4: ok:",
        "experts 12..15 (4), MTP depth 2",  /* the group-wide depth; tensors on rank 0 only */
        "rank 3/4: ok: 103 tensors",        /* the k/v scales: ignored by the KV cache */
        "warning: 8 KV-quantisation parameters ignored: the KV cache does not use them",
        "loadable" } },
    { "bad", "--world-size 2", 1,
      { "rank 0/2: NOT loadable", "problem: missing: model.layers.1.mlp.up_proj.weight",
        "rank 1/2: NOT loadable",
        "problem: missing: model.layers.3.moe.experts.12.up_proj.weight_scale" } },
    /* incomplete MTP layers: every missing name, the trunk's plan, exit 0; --strict: 1 */
    { "mtp-partial", "--world-size 2", 0,
      { "rank 0/2: ok:", "MTP depth 0,",
        "warning: MTP requested (K=2) but 2 of the 34 tensors of layers 4..5 are missing",
        "serving without speculation (the trunk only)",
        "warning: MTP tensor missing: model.layers.4.enorm.weight (BF16)",
        "warning: MTP tensor missing: model.layers.5.eh_proj.weight (BF16)",
        "note: MTP depth 0 of the 2 requested: a worker serves this plan without speculation",
        "\nloadable" } },
    { "mtp-partial", "--world-size 2 --strict", 1,
      { "NOT loadable as requested (--strict): MTP depth 0 of the 2 requested" } },
    { "mtp-partial", "--mtp 0 --strict", 0, { NULL } },
    /* the memory plan: both pools, the group's; a budget too small names what it needs */
    { "good", "--world-size 2 --kv-cache-memory 64MiB --max-model-len 2048 --max-num-seqs 4", 0,
      { "memory plan: --max-model-len 2048, --max-num-seqs 4", "KV: full-attention pool",
        "sliding-window pool", "group: full-attention pool",
        "sequences of 2048 tokens at once" } },
    { "good", "--kv-cache-memory 2MiB --max-model-len 2048", 1,
      { "does NOT fit", "need at least", "the longest --max-model-len that fits is",
        "loadable; the KV cache does NOT fit" } },
    /* usage errors and a missing checkpoint */
    { "good", "--device-memory 12x", 2, { "--device-memory '12x'" } },
    { "good", "--world-size 3", 2, { "must be 1, 2, 4 or 8" } },
    { "good", "--world-size 2 --rank 2", 2, { NULL } },
    { NULL, "", 2, { "usage: stepd-inspect" } },
    { "nonexistent", "", 1, { "cannot open" } },
};

int main(int argc, char **argv)
{
    static const char *const omit[] = { "model.layers.1.mlp.up_proj.weight", "model.layers.3.moe.experts.12.up_proj.weight_scale", NULL };
    struct model_config cfg;
    struct ckptw_opts o;
    struct err_buf e;
    static const char *const omit_mtp[] = { "model.layers.4.enorm.weight", "model.layers.5.eh_proj.weight", NULL };
    char *root, good[512], bad[512], mtp_partial[512], args[1200], *out;
    json_error_t je;
    json_t *j;

    ASSERT_TRUE(argc == 2);
    inspect = argv[1];
    root = ckptw_tmpdir("stepd-test-inspect");
    ASSERT_TRUE(root != NULL);
    snprintf(good, sizeof(good), "%s/good", root);
    snprintf(bad, sizeof(bad), "%s/bad", root);
    snprintf(mtp_partial, sizeof(mtp_partial), "%s/mtp-partial", root);
    ckptw_config_tiny(&cfg);
    ckptw_opts_default(&o);
    o.kv_scales = CKPTW_OPT_PER_HEAD;
    ASSERT_OK(ckptw_write(good, &cfg, &o, &e));
    o.omit = omit;
    ASSERT_OK(ckptw_write(bad, &cfg, &o, &e));
    o.omit = omit_mtp;
    ASSERT_OK(ckptw_write(mtp_partial, &cfg, &o, &e));

    snprintf(args, sizeof(args), "'%s' --world-size 2 --rank 1 --mtp 1 --json", good);
    ASSERT_EQ(run(args, &out), 0);
    j = json_loads(out, 0, &je);
    ASSERT_TRUE(j != NULL);
    ASSERT_TRUE(json_is_true(json_object_get(j, "ok")));
    ASSERT_EQ(json_array_size(json_object_get(j, "ranks")), 1);
    ASSERT_EQ(json_integer_value(json_object_get(json_array_get(json_object_get(j, "ranks"), 0), "expert_first")), 8);
    json_decref(j);
    free(out);

    /* rank 0 of 2 lacks only the dense tensor: still not loadable */
    snprintf(args, sizeof(args), "'%s' --world-size 2 --rank 0 --json", bad);
    ASSERT_EQ(run(args, &out), 1);
    ASSERT_CONTAINS(out, "\"ok\": false");
    ASSERT_TRUE(strstr(out, "experts.12") == NULL);
    free(out);

    snprintf(args, sizeof(args), "'%s' --device-memory 1GiB --overhead 64MiB --max-model-len 4096 "
             "--json", good);
    ASSERT_EQ(run(args, &out), 0);
    j = json_loads(out, 0, &je);
    ASSERT_TRUE(j != NULL);
    ASSERT_TRUE(json_is_true(json_object_get(j, "memory_fits")));
    {
        json_t *m = json_object_get(json_array_get(json_object_get(j, "ranks"), 0), "memory");
        ASSERT_TRUE(json_is_true(json_object_get(m, "fits")));
        ASSERT_TRUE(json_integer_value(json_object_get(m, "full_blocks")) > 0);
        ASSERT_TRUE(json_integer_value(json_object_get(m, "sliding_blocks")) > 0);
        ASSERT_TRUE(json_integer_value(json_object_get(m, "weights_bytes")) > 0);
    }
    json_decref(j);
    free(out);

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char dir[600];

        snprintf(dir, sizeof(dir), "%s/%s", root, cases[i].dir ? cases[i].dir : "");
        expect(cases[i].dir ? dir : NULL, cases[i].args, cases[i].want, cases[i].needles);
    }
    ckptw_rmtree(root);
    free(root);
    return 0;
}
