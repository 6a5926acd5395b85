/* moe-plan.h - grouping a MoE layer's routed (token, expert) pairs by expert on the
 * device: the plan the grouped MXFP4 GEMMs read, built from the router's top-k with no
 * host round trip.
 *
 * Input: ids[n_slots] (slot s = t * top_k + k, the router's output; -1 = padding) and the
 * rank's local experts [expert_first, expert_first + n_local).  Output:
 *   offsets[n_local + 1]   pairs of local expert e are [offsets[e], offsets[e + 1]);
 *   pair_slot[n_pairs]     the slot of each pair: token = slot / top_k, routing weight =
 *                          weights[slot]; within an expert in slot order, i.e. token order
 *                          (the order of the CPU backend's counting sort, kernels/cpu/moe.c);
 *   slot_pair[n_slots]     the inverse (-1: the slot's expert is not local);
 *   items[2 * n_items]     GEMM work items (local expert, first pair of the chunk - offset):
 *                          each expert's pairs cut in chunks of `chunk`, experts in order;
 *   counts[2]              n_pairs, n_items.
 * One thread block of MOE_PLAN_THREADS threads builds it in phases separated by
 * barriers.  Each phase is a function of (thread id, shared state) written once below:
 * the kernel (moe.cu) calls it per thread between __syncthreads(), the host emulation
 * (moe_plan_host, used by test/gpu/test-cuda-host.c) calls it for every thread id in
 * turn, so the test runs the device's arithmetic.
 */
#pragma once

#include <stdint.h>

#include "hd.h"

#define MOE_PLAN_THREADS 1024

struct moe_plan_args {
    const int32_t *ids;
    int n_slots, expert_first, n_local, chunk;
    int32_t *offsets, *pair_slot, *slot_pair, *items, *counts;
};

/* Shared state of the building block: cnt/run/ccnt [n_local], es [MOE_PLAN_THREADS]. */
struct moe_plan_shared {
    int32_t *cnt, *run, *ccnt, *es;
};

#ifdef __CUDA_ARCH__
#define MOE_PLAN_ADD(p, v) atomicAdd((p), (v))
#else
#define MOE_PLAN_ADD(p, v) (*(p) += (v))
#endif

HD int moe_local(int32_t id, int expert_first, int n_local)
{
    int e = id - expert_first;

    return id >= 0 && e >= 0 && e < n_local ? e : -1;
}

/* Most work items a plan of n_slots slots can have (the GEMM grid is sized by it). */
HD int moe_items_max(int n_slots, int n_local, int chunk)
{
    return n_slots / chunk + (n_local < n_slots ? n_local : n_slots);
}

/* phase 0: zero the counters */
HD void moe_plan_p0(int tid, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    for (int e = tid; e < a->n_local; e += MOE_PLAN_THREADS)
        sh->cnt[e] = sh->run[e] = sh->ccnt[e] = 0;
}

/* phase 1: pairs per local expert */
HD void moe_plan_p1(int tid, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    for (int s = tid; s < a->n_slots; s += MOE_PLAN_THREADS) {
        int e = moe_local(a->ids[s], a->expert_first, a->n_local);

        if (e >= 0)
            MOE_PLAN_ADD(&sh->cnt[e], 1);
    }
}

/* phase 2 (thread 0): offsets and work items */
HD void moe_plan_p2(int tid, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    int32_t off = 0, n_items = 0;

    if (tid != 0)
        return;
    for (int e = 0; e < a->n_local; e++) {
        a->offsets[e] = off;
        for (int32_t m0 = 0; m0 < sh->cnt[e]; m0 += a->chunk) {
            a->items[2 * n_items] = e;
            a->items[2 * n_items + 1] = m0;
            n_items++;
        }
        off += sh->cnt[e];
    }
    a->offsets[a->n_local] = off;
    a->counts[0] = off;
    a->counts[1] = n_items;
}

/* phase 3a, per chunk of MOE_PLAN_THREADS slots from `base`: each thread's expert */
HD void moe_plan_p3a(int tid, int base, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    int s = base + tid;
    int e = s < a->n_slots ? moe_local(a->ids[s], a->expert_first, a->n_local) : -1;

    sh->es[tid] = e;
    if (e >= 0)
        MOE_PLAN_ADD(&sh->ccnt[e], 1);
}

/* phase 3b: the slot's place among its expert's pairs (earlier chunks, then earlier
 * threads of this chunk with the same expert) */
HD void moe_plan_p3b(int tid, int base, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    int s = base + tid, e = sh->es[tid], before = 0;

    if (s >= a->n_slots)
        return;
    if (e < 0) {
        a->slot_pair[s] = -1;
        return;
    }
    for (int t = 0; t < tid; t++)
        before += sh->es[t] == e;
    {
        int32_t p = a->offsets[e] + sh->run[e] + before;

        a->pair_slot[p] = s;
        a->slot_pair[s] = p;
    }
}

/* phase 3c: carry the chunk's counts */
HD void moe_plan_p3c(int tid, const struct moe_plan_args *a, struct moe_plan_shared *sh)
{
    for (int e = tid; e < a->n_local; e += MOE_PLAN_THREADS) {
        sh->run[e] += sh->ccnt[e];
        sh->ccnt[e] = 0;
    }
}

#ifndef __CUDACC__
/* The plan built on the host by the device's phases (shared state from the caller:
 * 3 * n_local + MOE_PLAN_THREADS int32). */
static inline void moe_plan_host(const struct moe_plan_args *a, int32_t *shared)
{
    struct moe_plan_shared sh = { shared, shared + a->n_local, shared + 2 * a->n_local,
                                  shared + 3 * a->n_local };

    for (int t = 0; t < MOE_PLAN_THREADS; t++)
        moe_plan_p0(t, a, &sh);
    for (int t = 0; t < MOE_PLAN_THREADS; t++)
        moe_plan_p1(t, a, &sh);
    moe_plan_p2(0, a, &sh);
    for (int base = 0; base < a->n_slots; base += MOE_PLAN_THREADS) {
        for (int t = 0; t < MOE_PLAN_THREADS; t++)
            moe_plan_p3a(t, base, a, &sh);
        for (int t = 0; t < MOE_PLAN_THREADS; t++)
            moe_plan_p3b(t, base, a, &sh);
        for (int t = 0; t < MOE_PLAN_THREADS; t++)
            moe_plan_p3c(t, a, &sh);
    }
}
#endif
