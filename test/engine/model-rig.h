/* model-rig.h - open the bundled tiny checkpoint as a struct forward for engine tests and
 * the engine benchmark (CPU backend, single rank).  Returns 77-worthy -ENOENT when the
 * model directory is absent. */
#pragma once

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "config.h"
#include "loader.h"
#include "model.h"

struct model_rig {
    struct ckpt *ck;
    struct backend *be;
    struct forward *f;
    const struct model_config *cfg;
};

/* n_blocks[g] <= 0: enough for max_seqs sequences of max_len in both groups. */
static inline int model_rig_open_kv(struct model_rig *r, const char *dir, int threads,
                                    int max_seqs, int max_tokens, int max_len,
                                    const int n_blocks[2], enum model_draft_quant dq,
                                    struct err_buf *e)
{
    char path[4096];
    memset(r, 0, sizeof(*r));
    snprintf(path, sizeof(path), "%s/config.json", dir);
    if (access(path, R_OK) != 0)
        return -ENOENT;
    struct ckpt_opts co = { .world_size = 1, .rank = 0, .mtp_depth = 3 };
    int rc = ckpt_open(dir, &co, &r->ck, e);
    if (rc < 0)
        return rc;
    r->cfg = ckpt_config(r->ck);
    struct backend_cfg bc = { .n_threads = threads };
    rc = backend_new("cpu", &bc, &r->be);
    if (rc < 0)
        return err_set(e, rc, "backend cpu: %s", err_str(rc));
    int bs = 16;
    int per_seq = (max_len + 4 + bs - 1) / bs;
    struct model_opts mo = {
        .max_tokens_per_step = max_tokens,
        .max_seqs = max_seqs,
        .max_logit_rows = max_seqs * 4,
        .block_size = bs,
        .n_blocks = { n_blocks[0] > 0 ? n_blocks[0] : per_seq * max_seqs,
                      n_blocks[1] > 0 ? n_blocks[1] : per_seq * max_seqs },
        .max_seq_len = max_len + 4,
        .draft_quant = dq,
    };
    return model_forward_new(r->ck, r->be, NULL, &mo, &r->f, e);
}

static inline int model_rig_open_q(struct model_rig *r, const char *dir, int threads,
                                   int max_seqs, int max_tokens, int max_len,
                                   enum model_draft_quant dq, struct err_buf *e)
{
    static const int defaults[2] = { 0, 0 };
    return model_rig_open_kv(r, dir, threads, max_seqs, max_tokens, max_len, defaults, dq, e);
}

static inline int model_rig_open(struct model_rig *r, const char *dir, int threads, int max_seqs,
                                 int max_tokens, int max_len, struct err_buf *e)
{
    return model_rig_open_q(r, dir, threads, max_seqs, max_tokens, max_len,
                            MODEL_DRAFT_CHECKPOINT, e);
}

static inline void model_rig_close(struct model_rig *r)
{
    if (r->f)
        r->f->ops->free(r->f);
    backend_free(r->be);
    ckpt_close(r->ck);
}

/* model_rig_open_kv for a test, or the process exits: 77 (skip) when dir holds no
 * checkpoint, 1 on any other error. */
static inline void model_rig_open_or_exit(struct model_rig *r, const char *dir, int threads,
                                          int max_seqs, int max_tokens, int max_len,
                                          const int n_blocks[2], enum model_draft_quant dq)
{
    struct err_buf err = { { 0 } };
    int rc = model_rig_open_kv(r, dir, threads, max_seqs, max_tokens, max_len, n_blocks, dq,
                               &err);
    if (rc == -ENOENT) {
        printf("SKIP: no checkpoint at %s\n", dir);
        exit(77);
    }
    if (rc < 0) {
        fprintf(stderr, "%s: %s\n", dir, err.msg);
        exit(1);
    }
}
