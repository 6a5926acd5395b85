/* test-split-fit.c - when a 2-thread CPU step runs as per-core parts (model-split.c,
 * model__split_fit): the tiny model's trunk (shared weights of a few MB) splits a step of
 * 2 sequences x 4 tokens; a full-width dense layer of stepd-mkmodel (0.43 GB of attention
 * and MLP weights, written as holes) runs the same step whole, unless the model is built
 * with split_any_size.  The outputs are the same either way (test-model-split).
 *
 *   test-split-fit STEPD_MKMODEL TINY_MODEL_DIR
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "harness.h"
#include "loader.h"
#include "model.h"

#define BS 16

/* split steps of one 8-token step (2 sequences x 4) on a 2-thread backend */
static uint64_t split_steps(const char *dir, bool any_size)
{
    struct ckpt_opts co = { .world_size = 1, .rank = 0 };
    struct backend_cfg bc = { .n_threads = 2 };
    struct err_buf e = { { 0 } };
    struct ckpt *ck;
    struct backend *be;
    struct model *m;
    struct step_seq seqs[2];
    int32_t tokens[8], blocks[2][2] = { { 0, 1 }, { 0, 1 } };
    float *logits;
    uint64_t n;

    if (ckpt_open(dir, &co, &ck, &e) < 0)
        FAIL("%s: %s", dir, e.msg);
    ASSERT_OK(backend_new("cpu", &bc, &be));
    struct model_opts mo = {
        .max_tokens_per_step = 8, .max_seqs = 2, .max_logit_rows = 2, .block_size = BS,
        .n_blocks = { 4, 4 }, .max_seq_len = 64, .split_any_size = any_size,
    };
    if (model_new(ck, be, NULL, &mo, &m, &e) < 0)
        FAIL("%s: model: %s", dir, e.msg);
    for (int i = 0; i < 8; i++)
        tokens[i] = i + 1;
    for (int s = 0; s < 2; s++)
        seqs[s] = (struct step_seq){ .slot = s, .pos0 = 0, .n_tokens = 4, .n_logits = 1,
                                     .tok_off = 4 * s, .n_blocks = 1,
                                     .block_off = { s, s } };
    struct step_plan p = { .step_id = 1, .n_seqs = 2, .n_tokens = 8, .seqs = seqs,
                           .tokens = tokens, .n_block_ids = { 2, 2 },
                           .blocks = { blocks[0], blocks[1] } };
    logits = malloc(sizeof(float) * 2 * (size_t)ckpt_config(ck)->vocab_size);
    ASSERT_TRUE(logits != NULL);
    if (model_step(m, &p, logits) < 0)
        FAIL("%s: step: %s", dir, model_last_error(m));
    n = model_split_steps(m);
    free(logits);
    model_free(m);
    backend_free(be);
    ckpt_close(ck);
    return n;
}

int main(int argc, char **argv)
{
    char dir[] = "/tmp/stepd-test-split-fit-XXXXXX", out[64];
    pid_t pid;
    int st;

    if (argc < 3)
        FAIL("usage: test-split-fit STEPD_MKMODEL TINY_MODEL_DIR");
    if (!mkdtemp(dir))
        FAIL("mkdtemp: %s", strerror(errno));
    snprintf(out, sizeof(out), "%s/m", dir);
    pid = fork();
    if (pid == 0) {
        execl(argv[1], argv[1], "--real-layers", "0", "--vocab", "4096", "--sparse", "all",
              "--out", out, (char *)NULL);
        _exit(127);
    }
    ASSERT_TRUE(pid > 0 && waitpid(pid, &st, 0) == pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    ASSERT_EQ(split_steps(argv[2], false), 1);      /* small shared weights: parts */
    ASSERT_EQ(split_steps(out, false), 0);          /* 0.43 GB of them: whole */
    ASSERT_EQ(split_steps(out, true), 1);           /* unless asked for */
    if (fork() == 0) {
        execl("/bin/rm", "rm", "-rf", dir, (char *)NULL);
        _exit(127);
    }
    wait(NULL);
    printf("split-fit: ok\n");
    return 0;
}
