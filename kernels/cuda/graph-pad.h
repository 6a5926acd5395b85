/* graph-pad.h - the batch shapes the CUDA backend captures as CUDA graphs, and how a
 * step is padded up to one.
 *
 * Decode and MTP-verify steps (every run at most GRAPH_MAX_RUN tokens) of n tokens run
 * as the graph of bucket B = graph_bucket(n): the smallest listed size >= n.  The step's
 * index arrays are padded to B rows: token id 0, position 0, KV slot -1 (not stored),
 * and the padded rows belong to no sequence, so they never reach a KV cache, an expert
 * or a logit row; the kernels read the real counts from device memory.  Prefill chunks
 * (a run longer than GRAPH_MAX_RUN, or n above the largest bucket) run eagerly.
 */
#pragma once

#include <stdint.h>

#include "hd.h"

#define GRAPH_MAX_RUN 8         /* decode (1) and verify (K + 1 <= 8) runs */
#define GRAPH_N_BUCKETS 15

HD int graph_bucket_size(int i)
{
    /* 1, 2, 4, 8, then 16, 24, 32, 48, .. 512 (steps of 1.5x and 4/3x): above 16 tokens a
     * padded step does less than 50% more rows of work than it needs, below twice */
    int j = i - 4;

    if (i < 4)
        return 1 << i;
    return (j & 1) ? (16 << (j / 2)) * 3 / 2 : 16 << (j / 2);
}

/* Smallest bucket >= n that is <= max_tokens; 0 when there is none (run eagerly). */
HD int graph_bucket(int n, int max_tokens)
{
    for (int i = 0; i < GRAPH_N_BUCKETS; i++) {
        int b = graph_bucket_size(i);

        if (b > max_tokens)
            return 0;
        if (b >= n)
            return n > 0 ? b : 0;
    }
    return 0;
}

/* Index of bucket b in the list (-1 when b is not a bucket). */
HD int graph_bucket_index(int b)
{
    for (int i = 0; i < GRAPH_N_BUCKETS; i++)
        if (graph_bucket_size(i) == b)
            return i;
    return -1;
}

/* a[n .. b) = v: the padding of one index array. */
HD void graph_pad_i32(int32_t *a, int n, int b, int32_t v)
{
    for (int i = n; i < b; i++)
        a[i] = v;
}
