/* naive.h - an independent, plain-loop, double-precision Step forward (docs/MODEL.md §2, §3)
 * used as the oracle of the model tests.  It reads the checkpoint through the loader
 * (ckpt_get) and decodes BF16 / MXFP4 itself; no backend code is shared with worker/model/.
 * It processes whole sequences at once (no KV cache, no paging). */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "loader.h"

struct naive;

/* When set, activations entering MXFP4 matrices are rounded as the CPU fast path does
 * (int8 per 32-block), so the oracle models the fast path's arithmetic exactly. */
extern bool naive_int8_act;
/* with naive_int8_act: round NVFP4 matrices' activations too (the CPU's level-vnni path) */
extern bool naive_nvfp4_int8;
/* When set, activations entering BF16 matrices of a multiple of 32 columns are rounded to
 * BF16 (nearest even), as the CPU's BF16 fast path does where the CPU has one (AMX, or
 * AVX-512 BF16 at level vnni). */
extern bool naive_bf16_act;
/* When set, post-RoPE k and v are rounded to BF16 (a BF16 KV cache). */
extern bool naive_bf16_kv;

/* When set, naive_trunk records what the forward did (for checks of weight scaling):
 * resid_rms[0] the rms of the residual stream over all positions after the embedding,
 * resid_rms[l + 1] after trunk layer l; expert_tokens[l * n_experts + e] += the positions
 * trunk MoE layer l routed to expert e.  Arrays are the caller's, zeroed by the caller. */
struct naive_trace {
    double *resid_rms;      /* [n_layers + 1] */
    int *expert_tokens;     /* [n_layers * n_experts] */
};
extern struct naive_trace *naive_trace;

/* Load every weight of the checkpoint (world size 1) as doubles.  NULL on failure
 * (message on stderr). */
struct naive *naive_new(struct ckpt *c);
void naive_free(struct naive *n);

/* Trunk over x[0..n): ret_hidden [n, H] (pre-final-norm) and ret_logits [n, V]
 * (either may be NULL). */
void naive_trunk(struct naive *nv, const int32_t *x, int n, double *ret_hidden, double *ret_logits);

/* MTP layer k (0-based) over positions 0..n-1: input ids ids[p] (already shifted by the
 * caller: ids[p] = token at p+k+1), previous hidden g [n, H]; writes h' [n, H] and draft
 * logits [n, V] (either may be NULL). */
void naive_mtp(struct naive *nv, int k, const int32_t *ids, const double *g, int n,
               double *ret_hidden, double *ret_logits);
