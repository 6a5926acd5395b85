/* model-mtp.c - the MTP step (docs/MODEL.md §3): one draft depth over the sequences that
 * asked for it, with the repair of the positions the previous step computed from drafts
 * (model.h, model_mtp_step), and the draft vocabulary.  The layer itself is the script's
 * (model.c: input mix, decoder layer, head), run whole (fused on a GPU, model-gpu.c) or as
 * per-core parts or halves (model-split.c).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model-int.h"
#include "slab.h"

/* A sequence starts afresh in its slot (model_step: pos0 == 0 or STEP_SEQ_NEW, a new
 * request, preemption by recompute, a prefix-cache hit): the MTP layers' history of the
 * slot's previous sequence is void, and the positions before pos0 hold final KV, so the
 * history starts at pos0 with nothing to re-run. */
void model__mtp_restart(struct model *m, const struct step_plan *p)
{
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];

        if (s->pos0 == 0 || (s->flags & STEP_SEQ_NEW))
            for (int j = 0; j < m->n_mtp; j++) {
                m->mtp_end[(size_t)s->slot * m->n_mtp + j] = s->pos0;
                m->mtp_lo[(size_t)s->slot * m->n_mtp + j] = s->pos0;
            }
    }
}

/* One MTP depth as model_mtp_step runs it: the layer and the batch of rows laid out. */
struct mtp_run {
    int k;
    struct mlayer *L;
    bool keep;                      /* layer k's outputs feed depth k+1's re-run rows */
    int n, ns;                      /* batch rows, batch sequences */
    int n_rr, n_missed;             /* positions re-run; positions that needed it and could not */
    struct batch mb;
};

/* Check: depth k may run now on plan p (the last step's plan, depths in order) with these
 * per-sequence inputs. */
static int mtp_check(struct model *m, int k, const struct step_plan *p, const int32_t *n_valid,
                     const int32_t *tok_in, const float *logits)
{
    if (k < 0 || k >= m->n_mtp)
        return PLAN_ERR(m, -EINVAL, "mtp_step: depth %d but %d MTP layers loaded", k, m->n_mtp);
    if (!m->have_step || !p || p->step_id != m->last_step_id || p->n_tokens != m->last_n_tokens ||
        p->n_seqs != m->last_n_seqs)
        return PLAN_ERR(m, -EINVAL, "mtp_step: plan is not the one of the last successful step");
    if (k != m->mtp_next_k)
        return PLAN_ERR(m, -EINVAL, "mtp_step: depth %d called, expected depth %d", k, m->mtp_next_k);
    if (!n_valid || !tok_in || (!logits && !m->argmax_ids))
        return PLAN_ERR(m, -EINVAL, "mtp_step: n_valid, tok_in and logits are required");
    for (int i = 0; i < p->n_seqs; i++) {
        const struct step_seq *s = &p->seqs[i];
        if (s->mtp_depth <= k)
            continue;
        if (n_valid[i] < 0 || n_valid[i] > s->n_tokens)
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: n_valid %d of %d tokens", i, n_valid[i],
                            s->n_tokens);
        if (k > 0 && n_valid[i] != m->mtp_nv[i])
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: n_valid %d at depth %d but %d at depth "
                            "%d (must be the same at every depth)", i, n_valid[i], k,
                            m->mtp_nv[i], k - 1);
        if (tok_in[i] < 0 || tok_in[i] >= m->vocab)
            return PLAN_ERR(m, -EINVAL, "mtp_step: seq %d: token %d outside the vocab (%d)", i,
                            tok_in[i], m->vocab);
    }
    return 0;
}

/* Can MTP layer L re-run queries from position q of seq s (q < s->pos0)?  Their KV slots
 * and, for a sliding layer, the keys of q's window must be in valid blocks of the plan
 * (check_plan only vouches for the window of pos0; a full layer's blocks are all checked). */
static bool rerun_fits(const struct model *m, const struct step_plan *p, const struct step_seq *s,
                       const struct mlayer *L, int32_t q)
{
    int bs = m->o.block_size, g = L->group;
    int32_t lo;

    if (q < 0)
        return false;
    if (L->window <= 0)
        return true;
    lo = q - L->window + 1 > 0 ? q - L->window + 1 : 0;
    for (int32_t b = lo / bs; b <= (s->pos0 - 1) / bs; b++) {
        int32_t id = model__block_of(p, s, g, b);
        if (id < 0 || id >= m->o.n_blocks[g])
            return false;
    }
    return true;
}

/* Repair: how many positions before pos0 plan seq i re-runs at depth k (rr), given that
 * depth k-1 re-ran prr of them and kept its stash (pok); *missed += those it could not. */
static int mtp_rerun_count(const struct model *m, const struct step_plan *p, int i,
                           const struct mtp_run *run, int nv, bool contig, int prr, bool pok,
                           int *missed)
{
    const struct step_seq *s = &p->seqs[i];
    const int k = run->k, NM = m->n_mtp, ring = m->n_mtp;
    const int32_t *toks = p->tokens + s->tok_off, *hist = m->mtp_hist + (size_t)i * NM;
    size_t st = (size_t)s->slot * NM + k;
    int have = contig ? s->pos0 - m->mtp_lo[st] : 0, need = prr, cap, rr;

    /* The last k positions this layer wrote (pos0-k .. pos0-1) took ids from beyond the
     * accepted tokens.  Position pos0+t must be re-run when its id now differs from the
     * one it used (a rejected draft, a new draft) or its g changed (depth k-1 re-ran it:
     * t >= -prr), and with it every later position (they attended to it).  A re-run row
     * before depth k-1's batch takes its g from the stash. */
    if (have > k)
        have = k;
    for (int t = -have; t < -need; t++) {
        int idx = t + k + 1;
        int32_t id = idx < nv ? toks[idx] : hist[idx - nv];
        if (id != m->mtp_ids[st * ring + (size_t)((s->pos0 + t) % ring)]) {
            need = -t;
            break;
        }
    }
    if (!contig)        /* a hole: what the layer holds is unknown */
        need = k < s->pos0 ? k : s->pos0;
    cap = have < prr + (pok ? 1 : 0) ? have : prr + (pok ? 1 : 0);
    rr = need < cap ? need : cap;
    while (rr > 0 && !rerun_fits(m, p, s, run->L, s->pos0 - rr))
        rr--;
    *missed += need - rr;
    return rr;
}

/* Lay out: the batch's rows of plan seq i - its re-run positions, then its n_valid new
 * ones - with their input ids, positions, KV slots and where their g comes from. */
static int mtp_lay_out_seq(struct model *m, const struct step_plan *p, int i, int nv,
                           int32_t tok, struct mtp_run *run)
{
    const struct step_seq *s = &p->seqs[i];
    const int k = run->k, NM = m->n_mtp, ring = m->n_mtp;
    const int32_t *toks = p->tokens + s->tok_off, *hist = m->mtp_hist + (size_t)i * NM;
    size_t st = (size_t)s->slot * NM + k;
    int rr = 0, prr = m->mtp_rr[i], prow0 = m->mtp_row0[i], n = run->n, ns = run->ns;
    bool pok = m->mtp_stash_ok[i], contig;

    m->mtp_hist[(size_t)i * NM + k] = tok;
    m->mtp_nv[i] = nv;
    m->mtp_rr[i] = 0;
    m->mtp_row0[i] = -1;
    m->mtp_stash_ok[i] = false;
    if (nv == 0)
        return 0;
    contig = m->mtp_end[st] == s->pos0;
    if (!m->mtp_no_repair && k > 0)
        rr = mtp_rerun_count(m, p, i, run, nv, contig, prr, pok, &run->n_missed);
    if (n + rr + nv > m->max_rows)
        return PLAN_ERR(m, -E2BIG, "mtp_step %d: %d rows exceed the %d reserved", k,
                        n + rr + nv, m->max_rows);
    m->h_seq_start[ns] = n;
    m->h_seq_pos0[ns] = s->pos0 - rr;
    for (int g = 0; g < _KV_GROUP_MAX; g++)
        m->h_boff[g][ns] = s->block_off[g];
    for (int t = -rr; t < nv; t++) {
        /* input id at position pos0+t is the token k+1 further along: accepted run
         * tokens, then the sampled token (depth 0) and the drafts (depths 1..k) */
        int idx = t + k + 1;
        m->h_ids[n] = idx < nv ? toks[idx] : hist[idx - nv];
        /* an image token embeds as its image row here too (vLLM's MTP takes the target's
         * spliced input embeddings): the run's, or a prompt chunk's fill after the run */
        m->h_img_row[n] = !p->img_row ? -1 : idx < nv ? p->img_row[s->tok_off + idx] :
                          p->img_row_next && idx - nv < STEP_PLAN_IMG_NEXT ?
                          p->img_row_next[i * STEP_PLAN_IMG_NEXT + idx - nv] : -1;
        m->h_pos[n] = s->pos0 + t;
        /* g: trunk hidden (plan row), depth k-1's output (its batch row), or the stash */
        if (k == 0)
            m->h_src[n] = s->tok_off + t;
        else if (t >= -prr)
            m->h_src[n] = prow0 + t;
        else
            m->h_src[n] = -1 - s->slot;
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            if (m->group_used[g])
                m->h_slots[g][n] = model__slot_of(m, p, s, g, s->pos0 + t);
        n++;
    }
    m->mtp_rr[i] = rr;
    run->n_rr += rr;
    m->mtp_row0[i] = m->h_seq_start[ns] + rr;
    /* the stash for depth k+1: this layer's (clean) output just before the re-run rows,
     * still in the ring from an earlier step */
    {
        int32_t q = s->pos0 - rr - 1;
        m->mtp_stash_ok[i] = run->keep && contig && q >= 0 && q >= m->mtp_lo[st] &&
                             q >= s->pos0 - ring;
    }
    m->h_rows[ns] = i;      /* logits row (plan order) of this batch seq */
    run->n = n;
    run->ns = ns + 1;
    return 0;
}

/* Lay out every sequence that asked for depth k; the batch when any did (run->ns > 0). */
static int mtp_lay_out(struct model *m, const struct step_plan *p, const int32_t *n_valid,
                       const int32_t *tok_in, struct mtp_run *run)
{
    int r;

    for (int i = 0; i < p->n_seqs; i++) {
        if (p->seqs[i].mtp_depth <= run->k)
            continue;
        TRY(mtp_lay_out_seq(m, p, i, n_valid[i], tok_in[i], run));
    }
    if (run->ns == 0)
        return 0;
    m->h_seq_start[run->ns] = run->n;
    model__batch_fill(m, &run->mb, p, run->n, run->ns);
    run->mb.img_emb = p->img_emb;
    run->mb.img_row = p->img_row ? m->h_img_row : NULL;
    return 0;
}

/* Gather g into m->a: the trunk's hidden rows (k = 0) or depth k-1's outputs, then the
 * stash rows of re-run positions from before depth k-1's batch. */
static int mtp_gather_g(struct model *m, const struct mtp_run *run)
{
    int32_t *dst = m->h_ring, *src = m->h_ring + m->max_rows;
    int n = run->n, nd = 0, r;

    if (run->k == 0)
        return model__copy_rows(m, m->a, NULL, m->hid, m->h_src, n);
    for (int j = 0; j < n; j++)
        if (m->h_src[j] >= 0) {
            dst[nd] = j;
            src[nd++] = m->h_src[j];
        }
    r = model__copy_rows(m, m->a, dst, m->mh, src, nd);
    for (int32_t j = 0; j < n && !r; j++)
        if (m->h_src[j] < 0) {
            int32_t slot = -1 - m->h_src[j];
            r = model__copy_rows(m, m->a, &j, m->mstash, &slot, 1);
        }
    return r;
}

/* Run the layer on g (m->a) into m->x: as per-core halves (the last depth only for each
 * run's last row past the KV store), as per-core parts, or whole (fused on a GPU). */
static int mtp_run_layer(struct model *m, struct mtp_run *run)
{
    struct batch *mb = &run->mb;
    const int ns = run->ns;
    struct split_cut cut;
    int r;

    if (m->mtp_tp && run->k == m->n_mtp - 1 && !m->o.no_mtp_tail) {
        /* the last depth: only each run's last row feeds anything (the draft logits;
         * no depth reads this layer's outputs), the others just need their KV */
        struct batch tail = *mb;
        tail.n_tok = ns;
        tail.ids = NULL;
        tail.pos = tail.seq_pos0 = m->h_tail_pos;
        tail.seq_start = m->h_tail_start;
        for (int si = 0; si < ns; si++) {
            int last = m->h_seq_start[si + 1] - 1;
            m->h_tail_pos[si] = m->h_pos[last];
            m->h_tail_start[si] = si;
            for (int g = 0; g < _KV_GROUP_MAX; g++)
                m->h_tail_slots[g][si] = m->h_slots[g][last];
        }
        m->h_tail_start[ns] = ns;
        for (int g = 0; g < _KV_GROUP_MAX; g++)
            tail.slots[g] = m->h_tail_slots[g];
        r = model__mtp_tp_run(m, run->k, mb, &tail);
        m->n_mtp_tails++;
        return r;
    }
    if (m->mtp_tp)
        return model__mtp_tp_run(m, run->k, mb, NULL);
    if (model__split_choose(m, mb, &cut))
        return model__split_layers(m, mb, &cut, run->L);
    TRY(model__mtp_input(m, run->L, mb, m->a, m->me, m->mn, m->x));
    return model__layer_forward_fused(m, run->L, m->x, mb);
}

/* Remember the ids the last `ring` positions of each run used, for the next step's
 * comparison (mtp_rerun_count). */
static void mtp_keep_ids(struct model *m, const struct step_plan *p, const struct mtp_run *run)
{
    const int k = run->k, NM = m->n_mtp, ring = m->n_mtp;

    for (int si = 0; si < run->ns && !m->mtp_no_repair && k > 0; si++) {
        const struct step_seq *s = &p->seqs[m->h_rows[si]];
        int32_t first = m->h_seq_pos0[si], end = m->h_seq_pos0[si] +
                        (m->h_seq_start[si + 1] - m->h_seq_start[si]);
        int32_t *ids = m->mtp_ids + ((size_t)s->slot * NM + k) * ring;
        for (int32_t pos = end - ring > first ? end - ring : first; pos < end; pos++)
            ids[pos % ring] = m->h_ids[m->h_seq_start[si] + (pos - first)];
    }
}

/* Keep h' for the re-runs of later steps: first the stash (the row before this step's
 * rows, still in the ring), then the ring gets the last `ring` positions written. */
static int mtp_keep_outputs(struct model *m, const struct step_plan *p, const struct mtp_run *run)
{
    const int k = run->k, NM = m->n_mtp, ring = m->n_mtp;
    int32_t *dst = m->h_ring, *src = m->h_ring + m->max_rows;
    int nr = 0, r = 0;

    if (!run->keep)
        return 0;
    for (int si = 0; si < run->ns && !r; si++) {
        int i = m->h_rows[si];
        const struct step_seq *s = &p->seqs[i];
        int32_t base = (s->slot * NM + k) * ring, first = m->h_seq_pos0[si];
        int32_t end = s->pos0 + m->mtp_nv[i];
        if (m->mtp_stash_ok[i]) {
            int32_t q = first - 1, row = base + q % ring, slot = s->slot;
            r = model__copy_rows(m, m->mstash, &slot, m->mring, &row, 1);
        }
        for (int32_t pos = end - ring > first ? end - ring : first; pos < end; pos++) {
            dst[nr] = base + pos % ring;
            src[nr++] = m->h_seq_start[si] + (pos - first);
        }
    }
    return r ? r : model__copy_rows(m, m->mring, dst, m->x, src, nr);
}

/* Hand over: each run's last row to the head's rows (the halves took theirs already) and
 * h' (m->x) to the next depth (m->mh). */
static int mtp_hand_over(struct model *m, const struct mtp_run *run)
{
    float *t;
    int r;

    if (!m->mtp_tp) {
        for (int si = 0; si < run->ns; si++)
            m->h_last[si] = m->h_seq_start[si + 1] - 1;
        TRY(model__copy_rows(m, m->rows_h, NULL, m->x, m->h_last, run->ns));
    }
    t = m->mh;
    m->mh = m->x;
    m->x = t;
    return 0;
}

/* Draft logits of each run's last position into its plan row of logits: over the draft
 * vocabulary (scattered into -inf rows) or the whole vocabulary; the halves computed
 * theirs, one half of the vocabulary each. */
static int mtp_draft_logits(struct model *m, const struct mtp_run *run, float *logits)
{
    const struct mlayer *L = run->L;
    const int ns = run->ns, V = m->vocab;
    int r = 0;

    if (m->argmax_ids) {        /* model_mtp_step_argmax: whole heads, one rank */
        int32_t id[ns];
        r = model__mtp_head(m, L, &L->head, m->rows_h, ns, m->mtp_logits);
        r = r ? r : backend_argmax(m->be, m->mtp_logits, ns, V, 1, id, NULL);
        for (int si = 0; si < ns && !r; si++)
            m->argmax_ids[m->h_rows[si]] = id[si];
        return r;
    }
    if (m->dv_on) {
        const int D = m->dv_n, D2 = D / 2;
        if (m->mtp_tp) {
            for (int si = 0; si < ns && !r; si++)
                for (int q = 0; q < 2 && !r; q++)
                    r = backend_download(m->be, m->dv_host + (size_t)si * D + (size_t)q * D2,
                                         m->tp_logits[q] + (size_t)si * D2,
                                         sizeof(float) * (size_t)D2);
        } else {
            r = model__mtp_head(m, L, &L->head_sub, m->rows_h, ns, m->mtp_logits);
            r = r ? r : backend_download(m->be, m->dv_host, m->mtp_logits,
                                         sizeof(float) * (size_t)ns * (size_t)D);
        }
        r = r ? r : backend_sync(m->be);
        m->logits_host_bytes += sizeof(float) * (size_t)ns * (size_t)D;
        for (int si = 0; si < ns && !r; si++) {
            float *row = logits + (size_t)m->h_rows[si] * V;
            const float *sub = m->dv_host + (size_t)si * D;
            for (int j = 0; j < V; j++)
                row[j] = -INFINITY;
            for (int j = 0; j < D; j++)
                row[m->dv_ids[j]] = sub[j];
        }
    } else if (m->mtp_tp) {
        const int V2 = V / 2;
        for (int si = 0; si < ns && !r; si++)
            for (int q = 0; q < 2 && !r; q++)
                r = backend_download(m->be, logits + (size_t)m->h_rows[si] * V + (size_t)q * V2,
                                     m->tp_logits[q] + (size_t)si * V2, sizeof(float) * (size_t)V2);
        m->logits_host_bytes += sizeof(float) * (size_t)ns * (size_t)V;
    } else {
        r = model__mtp_head(m, L, &L->head, m->rows_h, ns, m->mtp_logits);
        for (int si = 0; si < ns && !r; si++)
            r = backend_download(m->be, logits + (size_t)m->h_rows[si] * V,
                                 m->mtp_logits + (size_t)si * V, sizeof(float) * (size_t)V);
        m->logits_host_bytes += sizeof(float) * (size_t)ns * (size_t)V;
    }
    return r ? r : backend_sync(m->be);
}

/* Commit: the layer now holds positions [lo, pos0 + n_valid) of each slot contiguously;
 * count the repair's re-runs and misses. */
static void mtp_commit(struct model *m, const struct step_plan *p, const struct mtp_run *run)
{
    for (int si = 0; si < run->ns; si++) {
        int i = m->h_rows[si];
        const struct step_seq *s = &p->seqs[i];
        size_t st = (size_t)s->slot * m->n_mtp + run->k;
        if (m->mtp_end[st] != s->pos0)
            m->mtp_lo[st] = s->pos0;
        m->mtp_end[st] = s->pos0 + m->mtp_nv[i];
    }
    m->n_mtp_rerun += (uint64_t)run->n_rr;
    m->n_mtp_missed += (uint64_t)run->n_missed;
}

/* Roll back after a failure: the layer's KV / kept outputs of these slots are partly
 * written, so no later repair may rely on them, and the chain of this step is over. */
static int mtp_fail(struct model *m, const struct step_plan *p, const struct mtp_run *run, int r,
                    const char *what)
{
    for (int si = 0; si < run->ns; si++)
        m->mtp_end[(size_t)p->seqs[m->h_rows[si]].slot * m->n_mtp + run->k] = -1;
    m->mtp_next_k = m->n_mtp;
    return PLAN_ERR(m, r, "mtp_step %d: %s failed: %s", run->k, what, err_str(r));
}

/* One MTP depth (forward.h protocol step 2, docs/MODEL.md §3.2), with the repair of the
 * positions the previous step computed from drafts (model.h). */
int model_mtp_step(struct model *m, int k, const struct step_plan *p, const int32_t *n_valid,
                   const int32_t *tok_in, float *logits)
{
    struct mtp_run run;
    int r = mtp_check(m, k, p, n_valid, tok_in, logits);

    if (r < 0)
        return r;
    m->mtp_next_k = k + 1;
    m->dv_on = p->draft_sub && m->dv_n > 0;
    run = (struct mtp_run){ .k = k, .L = &m->layers[m->n_layers + k],
                            .keep = !m->mtp_no_repair && k + 1 < m->n_mtp };
    r = mtp_lay_out(m, p, n_valid, tok_in, &run);
    if (r < 0 || run.ns == 0)
        return r;
    r = model__step_inputs(m, &run.mb, p, false);
    if (r < 0)
        return mtp_fail(m, p, &run, r, "step inputs");
    r = mtp_gather_g(m, &run);
    r = r ? r : mtp_run_layer(m, &run);
    if (r < 0)
        return mtp_fail(m, p, &run, r, "forward");
    mtp_keep_ids(m, p, &run);
    r = mtp_keep_outputs(m, p, &run);
    r = r ? r : mtp_hand_over(m, &run);
    if (r < 0)
        return mtp_fail(m, p, &run, r, "forward");
    r = mtp_draft_logits(m, &run, logits);
    if (r < 0)
        return mtp_fail(m, p, &run, r, "draft logits");
    mtp_commit(m, p, &run);
    return 0;
}

int model_mtp_step_argmax(struct model *m, int k, const struct step_plan *p, const int32_t *n_valid,
                          const int32_t *tok_in, int32_t *ids)
{
    int r = model__argmax_check(m, "mtp_step_argmax");

    if (r < 0)
        return r;
    if (m->mtp_tp)
        return PLAN_ERR(m, -ENOTSUP, "mtp_step_argmax: the MTP layers run as per-core halves");
    if (p && p->draft_sub && m->dv_n > 0)
        return PLAN_ERR(m, -ENOTSUP, "mtp_step_argmax: the plan scores the draft vocabulary");
    if (!ids)
        return PLAN_ERR(m, -EINVAL, "mtp_step_argmax: ids are required");
    m->argmax_ids = ids;
    r = model_mtp_step(m, k, p, n_valid, tok_in, NULL);
    m->argmax_ids = NULL;
    return r;
}

void model_mtp_repair_stats(const struct model *m, uint64_t *ret_rerun, uint64_t *ret_missed)
{
    if (ret_rerun)
        *ret_rerun = m->n_mtp_rerun;
    if (ret_missed)
        *ret_missed = m->n_mtp_missed;
}


/* ------------------------------------------------------- draft vocabulary -- */

#define DV_MAX_LAYERS 8

/* Rows r0 .. r1 of src (a gathered head) as a weight of their own, prepared (and released
 * by model__draft_vocab_release, not in the model's list: an install replaces them). */
static int view_prepare(struct model *m, const struct bweight *src, int64_t r0, int64_t r1,
                        struct bweight *out)
{
    int r = model__row_view(src, r0, r1, out);

    return r < 0 ? r : backend_weight_prepare(m->be, out);
}

static void release_w(struct model *m, struct bweight *w)
{
    if (w->rows > 0)
        backend_weight_release(m->be, w);
    memset(w, 0, sizeof(*w));
}

void model__draft_vocab_release(struct model *m)
{
    for (int k = 0; k < m->n_mtp && m->dv_n > 0; k++) {
        release_w(m, &m->layers[m->n_layers + k].head_sub);
        for (int p = 0; m->tp_half && p < 2; p++)
            release_w(m, &m->tp_half[2 * k + p].head_sub);
    }
    free(m->dv_buf);        /* ids, host logits and rows: one allocation */
    m->dv_buf = NULL;
    m->dv_ids = NULL;
    m->dv_host = NULL;
    m->dv_n = 0;
}

int model_set_draft_vocab(struct model *m, const int32_t *ids, int n, struct err_buf *e)
{
    const int V = m->vocab, NM = m->n_mtp;
    struct bweight nw[DV_MAX_LAYERS] = { 0 }, nh[2 * DV_MAX_LAYERS] = { 0 };
    size_t head = 0, off = 0;
    uint8_t *seen = NULL, *rows = NULL;
    void *buf = NULL;
    int32_t *nids = NULL;
    float *host = NULL;
    int r = 0;

    if (n == 0) {
        model__draft_vocab_release(m);
        return 0;
    }
    if (NM <= 0)
        return err_set(e, -EINVAL, "draft vocabulary: this rank has no MTP layers");
    if (NM > DV_MAX_LAYERS)
        return err_set(e, -EINVAL, "draft vocabulary: %d MTP layers (at most %d)", NM,
                       DV_MAX_LAYERS);
    if (!ids || n < 0 || n % 64 || n > V)
        return err_set(e, -EINVAL, "draft vocabulary: %d ids (a multiple of 64 up to the "
                       "vocabulary's %d)", n, V);
    for (int k = 0; k < NM; k++) {
        size_t sb, rb = model__row_bytes(&m->layers[m->n_layers + k].head, &sb);
        if (!rb || !m->layers[m->n_layers + k].head.data)
            return err_set(e, -EINVAL, "draft vocabulary: MTP layer %d's head has no host rows "
                           "of a known format", k);
        head += (rb + sb) * (size_t)n;
    }
    /* one allocation: the ids, the host logits [max_seqs, n], every layer's rows */
    {
        const struct slab_part parts[] = {
            SLAB_PART(nids, n), SLAB_PART(host, (size_t)n * (size_t)m->o.max_seqs),
            SLAB_PART(rows, head),
        };
        seen = calloc((size_t)V, 1);
        r = seen ? slab_alloc(parts, SLAB_N(parts), &buf) : -ENOMEM;
        if (r < 0) {
            r = err_set(e, r, "draft vocabulary: out of memory (%zu bytes of head rows)", head);
            goto out;
        }
    }
    for (int j = 0; j < n; j++) {
        if (ids[j] < 0 || ids[j] >= V || seen[ids[j]]) {
            r = err_set(e, -EINVAL, "draft vocabulary: id %d at %d is %s", (int)ids[j], j,
                        ids[j] < 0 || ids[j] >= V ? "outside the vocabulary" : "repeated");
            goto out;
        }
        seen[ids[j]] = 1;
        nids[j] = ids[j];
    }
    /* every layer's rows: [n rows][n scale rows], one after the other */
    for (int k = 0; k < NM && !r; k++) {
        const struct bweight *h = &m->layers[m->n_layers + k].head;
        size_t sb, rb = model__row_bytes(h, &sb);
        uint8_t *d = rows + off, *sc = d + rb * (size_t)n;
        struct bweight g = { .fmt = h->fmt, .rows = n, .cols = h->cols, .data = d,
                             .scale = sb ? sc : NULL };

        for (int j = 0; j < n; j++) {
            memcpy(d + (size_t)j * rb, (const uint8_t *)h->data + (size_t)nids[j] * rb, rb);
            if (sb)
                memcpy(sc + (size_t)j * sb, h->scale + (size_t)nids[j] * sb, sb);
        }
        off += (rb + sb) * (size_t)n;
        r = view_prepare(m, &g, 0, n, &nw[k]);
        for (int p = 0; m->mtp_tp && p < 2 && !r; p++)
            r = view_prepare(m, &g, (int64_t)p * (n / 2), (int64_t)(p + 1) * (n / 2),
                             &nh[2 * k + p]);
        if (r < 0)
            err_set(e, r, "draft vocabulary: backend '%s' cannot prepare MTP layer %d's head "
                    "rows: %s", m->be->ops->name, k, err_str(r));
    }
    if (r < 0) {
        for (int k = 0; k < NM; k++)
            for (int p = -1; p < 2; p++)
                release_w(m, p < 0 ? &nw[k] : &nh[2 * k + p]);
        goto out;
    }
    model__draft_vocab_release(m);
    for (int k = 0; k < NM; k++) {
        m->layers[m->n_layers + k].head_sub = nw[k];
        for (int p = 0; m->mtp_tp && p < 2; p++)
            m->tp_half[2 * k + p].head_sub = nh[2 * k + p];
    }
    m->dv_buf = buf;
    m->dv_ids = nids;
    m->dv_host = host;
    m->dv_n = n;
    buf = NULL;
out:
    free(seen);
    free(buf);
    return r;
}
