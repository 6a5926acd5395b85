/* step-guard.h - the CUDA backend's host-side decisions that, taken wrongly, put a step on
 * the wrong GPU, replay a graph over freed memory, route padding rows to real experts,
 * hand a released KV block to a kernel or fail a step for want of a cuBLASLt algorithm.
 *
 * Plain C with the CUDA calls behind function pointers: backend-cuda.cu, block.cu,
 * attention.cu and gemm.cu decide through these functions, and test/gpu/test-cuda-guard.c
 * runs the same functions against fakes on every machine (no GPU, no CUDA headers).
 */
#pragma once

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

#include "flash.h"

/* ---- the device of the calling thread ---- */

/* CUDA's current device belongs to the host thread (a new thread starts on device 0), and
 * a backend is called from several threads: init on the worker's thread, rank 0's steps
 * on the engine thread.  Every entry point makes the backend's device current first.
 * get/set: cudaGetDevice/cudaSetDevice as 0 or a negative errno. */
struct sg_dev_ops {
    int (*get)(int *dev);
    int (*set)(int dev);
};

static inline int sg_use_device(const struct sg_dev_ops *ops, int want)
{
    int cur = -1;

    if (ops->get(&cur) == 0 && cur == want)
        return 0;
    return ops->set(want);
}

/* ---- graphs against the memory they read ---- */

/* A graph reads the workspace and the step area at the addresses they had when it was
 * captured.  Each reallocation of either bumps the backend's memory epoch; a graph of an
 * older epoch is destroyed and captured again instead of replayed. */
enum sg_graph_action {
    SG_GRAPH_CAPTURE,       /* none yet: capture one */
    SG_GRAPH_REPLAY,        /* captured in this epoch: launch it */
    SG_GRAPH_RECAPTURE,     /* captured before the memory moved: destroy, capture again */
};

static inline enum sg_graph_action sg_graph_lookup(bool have, uint32_t graph_epoch,
                                                   uint32_t mem_epoch)
{
    if (!have)
        return SG_GRAPH_CAPTURE;
    return graph_epoch == mem_epoch ? SG_GRAPH_REPLAY : SG_GRAPH_RECAPTURE;
}

/* ---- padding rows ---- */

/* Whether a fused half of n_tok tokens passes the step area's real row count (read on the
 * device at every launch) to the kernels that must skip padding rows.  Always when the
 * step area describes these tokens: a graph captured with a full bucket is replayed
 * later with padding, so the decision cannot depend on the rows of the capturing step. */
static inline bool sg_mask_padding(bool map_valid, int map_n_tok, int n_tok)
{
    return map_valid && n_tok == map_n_tok;
}

/* ---- block ids ---- */

/* Every block a sequence's queries read: the keys of its run, pos0 .. last, read by the
 * kernel (flash_key_range: from max(0, pos0 - window + 1), from 0 with window 0, to last;
 * the engine's pool keeps the same range for a run, kv.c sliding_lo_block(pos_lo)).  0 when all are in [0, n_blocks); -EINVAL when one is
 * released (-1) or outside the pool (*ret_seq: the sequence).  *ret_max_tab: the table
 * entries the step reads (offset + blocks of the longest reach). */
static inline int sg_blocks_check(const int32_t *tables, const int32_t *off,
                                  const int32_t *seq_start, const int32_t *pos0, int n_seqs,
                                  int window, int block_size, int n_blocks, int *ret_max_tab,
                                  int *ret_seq)
{
    int max_tab = 0;

    for (int s = 0; s < n_seqs; s++) {
        const int64_t last = (int64_t) pos0[s] + (seq_start[s + 1] - seq_start[s]) - 1;
        const int end = off[s] + (int) (last / block_size) + 1;
        int64_t klo, khi;

        flash_key_range(pos0[s], last, window, &klo, &khi);
        max_tab = end > max_tab ? end : max_tab;
        for (int64_t b = klo / block_size; b <= last / block_size; b++) {
            const int32_t id = tables[off[s] + b];

            if (id < 0 || id >= n_blocks) {
                if (ret_seq)
                    *ret_seq = s;
                return -EINVAL;
            }
        }
    }
    if (ret_max_tab)
        *ret_max_tab = max_tab;
    return 0;
}

/* The check once per step for each (table, window, pool) the step's layers use: the
 * fused attention halves of all layers share the step's tables, so the first layer of
 * each kind scans them and the others reuse its answer.  sg_blocks_reset() at each
 * step_begin. */
#define SG_BLOCK_KEYS 4

struct sg_blocks_memo {
    int n;
    struct {
        const int32_t *tables;
        int window, block_size, n_blocks, result;
    } key[SG_BLOCK_KEYS];
    unsigned scans;         /* full scans done (for the tests) */
};

static inline void sg_blocks_reset(struct sg_blocks_memo *m)
{
    m->n = 0;
}

static inline int sg_blocks_once(struct sg_blocks_memo *m, const int32_t *tables,
                                 const int32_t *off, const int32_t *seq_start,
                                 const int32_t *pos0, int n_seqs, int window, int block_size,
                                 int n_blocks, int *ret_seq)
{
    for (int i = 0; i < m->n; i++)
        if (m->key[i].tables == tables && m->key[i].window == window &&
            m->key[i].block_size == block_size && m->key[i].n_blocks == n_blocks)
            return m->key[i].result;
    m->scans++;
    const int r = sg_blocks_check(tables, off, seq_start, pos0, n_seqs, window, block_size,
                                  n_blocks, NULL, ret_seq);
    if (m->n < SG_BLOCK_KEYS) {
        m->key[m->n].tables = tables;
        m->key[m->n].window = window;
        m->key[m->n].block_size = block_size;
        m->key[m->n].n_blocks = n_blocks;
        m->key[m->n].result = r;
        m->n++;
    }
    return r;
}

/* ---- GEMM algorithm ---- */

/* A GEMM shape runs through cuBLASLt when its heuristic returns an algorithm; on a miss
 * (no algorithm, or CUBLAS_STATUS_NOT_SUPPORTED as -ENOTSUP) it runs on the backend's
 * plain kernel, and the backend's first such shape warns once (*warned).  Other errors of
 * the heuristic (allocation) fail the call. */
struct sg_gemm_ops {
    int (*heuristic)(void *ctx, int *found);
    void (*warn)(void *ctx);
    void *ctx;
};

static inline int sg_gemm_pick(const struct sg_gemm_ops *ops, bool *warned, bool *ret_plain)
{
    int found = 0;
    const int r = ops->heuristic(ops->ctx, &found);

    if (r == 0 && found > 0) {
        *ret_plain = false;
        return 0;
    }
    if (r < 0 && r != -ENOTSUP)
        return r;
    *ret_plain = true;
    if (!*warned) {
        *warned = true;
        ops->warn(ops->ctx);
    }
    return 0;
}
