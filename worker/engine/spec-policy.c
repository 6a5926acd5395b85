/* spec-policy.c - the draft depth of every decoding sequence, per step (spec-policy.h).
 *
 * Costs are kept per table cell: verify[B][n - B] (a decode step of B sequences, n
 * tokens), draft[k][m] (MTP depth k for m sequences), and one for the rest of a step; a
 * cell's value is the median of its last COST_RING measurements that are at most
 * COST_FRESH decisions old (else the newest): one step that lost its core on a shared
 * machine does not move it, and a cell that only probes measure (the choices not made)
 * does not keep the load of long ago.  Acceptance: per sequence, decayed
 * (ACC_DECAY per verify step) counts of the drafts tried and accepted at each position
 * (position j is tried when drafts 1 .. j-1 were accepted), shrunk towards the engine-wide
 * counts (decayed by GLOBAL_DECAY) with the weight of n0[j] verify steps: an empirical
 * Bayes prior (prior_update): where the decoding sequences' own rates spread no wider than
 * their counts' binomial noise, they are one population and n0 grows (up to ACC_PRIOR_MAX:
 * a sequence's few lucky verifies do not buy it deeper drafts than its neighbours, the
 * winner's curse that made the mock's 16 equal streams 7 % slower than a fixed K = 2);
 * where they differ truly it shrinks (down to ACC_PRIOR).
 */
#include "spec-policy.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"
#include "slab.h"

#define COST_FRESH 128
#define COST_TRUST 3
#define COST_STALE_W 0.25           /* a stale cell's weight in its curve's line */
#define COST_WAKE_S 0.01            /* work this soon after an idle wait is cold */
#define ACC_DECAY 0.9f
#define ACC_PRIOR 8.0
#define ACC_PRIOR_MAX 256.0
#define ACC_PRIOR_MIN_SEQS 4        /* sequences with counts behind one update of n0 */
#define GLOBAL_DECAY 0.995
#define GLOBAL_PRIOR 0.7            /* engine-wide acceptance before any verify step */

#define COST_RING 9

/* The gate (spec-policy.h): per batch-size bucket (log2 of the decoding sequences), windows
 * of GATE_WINDOW engine cycles (and GATE_WINDOW_S seconds), the first GATE_WARM not
 * measured, run in one of two arms: the drafts the model chooses (0), or none of them (1:
 * only its probes draft).  What a window measured is what ran: a window in which the model
 * drafted in at least half the cycles measures drafting, one in which it drafted in none
 * (or in arm 1) measures no drafts, one in between (or a warm one, below) nothing, and the
 * windows either side of it still pair.  The evidence is paired: each window that
 * measured one arm right after one that measured the other gives the log of their rates'
 * ratio (a load that comes and goes on a shared machine falls on both), and the median
 * of the last GATE_RING such pairs decides: drafting runs when it is ahead by
 * GATE_HYSTERESIS, a tie runs without.
 * The arm that loses gets a window every `explore` windows (GATE_EXPLORE_MIN, doubling up
 * to GATE_EXPLORE_MAX while it confirms the choice); an exploring window costs the gap
 * between the arms, and the wider the gap the less likely the next one reverses it: the
 * interval is at least GATE_EXPLORE_MIN * (gap / GATE_GAP_UNIT)^2 (gate_interval; after a
 * switch a quarter of it), so an arm 20 % behind is tried again after 128 windows, not 8.
 * After a window without drafts the next drafting one is not measured at all (warm: the
 * skipped MTP positions are holes in their caches until the layer's window passes them). */
#define GATE_BUCKETS SPEC_POLICY_BUCKETS
#define GATE_WINDOW 32
#define GATE_WINDOW_S 0.05
#define GATE_WARM 8
#define GATE_HYSTERESIS 0.02
#define GATE_EXPLORE_MIN 8
#define GATE_EXPLORE_SWITCH 2
#define GATE_EXPLORE_MAX 128
#define GATE_RING 5
#define GATE_GAP_UNIT 0.05
#define GATE_INFER_MAX 16           /* the most windows an arm inferred after a bucket's first
                                     * window waits for its first */

struct gate {
    bool off;                       /* this window: the model's drafts suppressed (arm 1) */
    bool warm;                      /* this window drafts again after one without: its MTP
                                     * caches have holes, it is not measured */
    int steps, chose;               /* cycles into the window; those the model drafted in */
    double tok, sec;                /* its measured part */
    int last;                       /* the arm the last measured window measured (-1: none) */
    double last_rate;               /* ... and its tokens/s */
    float ring[GATE_RING];          /* log(rate without drafts / rate with), adjacent pairs */
    uint8_t ring_n, ring_head;
    double lq;                      /* the ring's median, or the neighbours' (inferred) */
    bool inferred;                  /* lq is the neighbours' (gate_infer) */
    bool judge;                     /* this window is the first of a bucket that started in
                                     * the neighbours' arm: the model's choices in it judge
                                     * the inference */
    int explore, since;             /* explore every `explore` windows; windows since */
    /* the model's probes in this bucket (spec-policy.h): decisions taken here, the one at
     * which the next probe runs, the interval */
    uint64_t n_dec, next_probe;
    int probe_interval;
    int dm[SPEC_MAX_K], dn;         /* the model's last choice here that drafted (prefix
                                     * lengths over dn candidates; dn 0: none yet) */
    uint64_t n_cycles, n_drafted, n_probe_steps, n_pairs;   /* spec_policy_stats */
};

struct cost {
    double mean;                    /* median of the fresh measurements in ring (seconds) */
    float ring[COST_RING];
    uint64_t at[COST_RING];         /* the decision count at each measurement */
    uint8_t head, n_ring;
    uint8_t trust;                  /* measurements behind mean */
    uint32_t n;
};

struct spec_policy {
    enum spec_draft_policy mode;
    struct clk_src clock;           /* the caller's time source (every time read here) */
    int max_seqs, kmax, xmax;
    struct cost *verify;            /* [(max_seqs + 1) * (xmax + 1)] */
    struct cost *tokens;            /* [max_seqs + xmax + 1]: the same steps by their tokens
                                     * n = B + x, whatever the batch */
    double *ct;                     /* [max_seqs + xmax + 1] scratch: their curve */
    struct cost *draft;             /* [kmax * (max_seqs + 1)] */
    struct cost rest;
    double g_tried[SPEC_MAX_K], g_hit[SPEC_MAX_K];      /* engine-wide, all drafts */
    double g_tried_c[SPEC_MAX_K], g_hit_c[SPEC_MAX_K];  /* ... with complete caches */
    double n0[SPEC_MAX_K];          /* the prior's weight (verify steps) per position */
    int window;
    int fill_depth;                 /* depth of fill-only chains (-1: as the engine asks) */
    /* this decision's sampled sequences, which keep their depth (seeded sampling stays
     * reproducible): their drafts, sequences per depth, expected accepted drafts */
    int fix_x, fix_cnt[SPEC_MAX_K];
    double fix_gain;
    int64_t last_end_us;            /* end of the last decode step's work (0: none) */
    int64_t wake_us;                /* the end of the last idle wait (0: none) */
    bool last_decode;

    /* decisions */
    int prev_m[SPEC_MAX_K], prev_n;
    uint64_t n_decisions, n_probes;
    int probe_dir;
    int probe_k, probe_delta;       /* a probe's frontier and its direction (+1 / -1) */
    int probe_more;                 /* the probe's steps still to run */
    uint64_t n_steps;               /* spec_policy_step calls */
    uint64_t draft_ran[SPEC_MAX_K]; /* the step at which each MTP depth last ran */
    uint64_t draft_meas[SPEC_MAX_K];/* 1 + the decision count at each depth's last cost
                                     * measurement (0: none) */
    bool chose;                     /* the last decision's model chose drafts (probes aside) */
    bool probe_check;               /* the decision after a probe: compare with probe_m */
    int probe_m[SPEC_MAX_K];
    int probe_gate;                 /* the bucket the probe ran in */
    bool probed;                    /* this decision ran a probe's depths */

    struct gate gate[GATE_BUCKETS];
    int64_t gate_last_us;           /* the previous call (0: none) */
    uint64_t gate_switches;

    /* scratch [max_seqs] */
    int *rank, *cand;
    double *a1, *p;                 /* p[pos * kmax + k]: p_{i,k+1} by ranking position */
    double *cv;                     /* [xmax + 1] */
    double *cd;                     /* [kmax * (max_seqs + 1)] */
    int *cnt;                       /* [kmax * (max_seqs + 1)] prefix counts */
    double *gain;                   /* [kmax * (max_seqs + 1)] prefix gains */
};

int spec_policy_new(enum spec_draft_policy mode, int max_seqs, int kmax, int window,
                    const struct clk_src *clock, struct spec_policy **ret)
{
    struct spec_policy t = { 0 }, *p;
    size_t S, X, K;
    int r;

    if (max_seqs < 1 || kmax < 0 || kmax > SPEC_MAX_K || window < 0 ||
        (mode != SPEC_POLICY_ADAPTIVE && mode != SPEC_POLICY_FIXED))
        return -EINVAL;
    S = (size_t)max_seqs + 1;
    X = (size_t)(kmax * max_seqs) + 1;
    K = (size_t)(kmax ? kmax : 1);
    /* the policy heads one slab with its arrays */
    const struct slab_part parts[] = {
        SLAB_PART(t.verify, S * X), SLAB_PART(t.cv, X),
        SLAB_PART(t.tokens, S + X), SLAB_PART(t.ct, S + X),
        SLAB_PART(t.rank, S), SLAB_PART(t.cand, S), SLAB_PART(t.a1, S),
        SLAB_PART(t.draft, K * S), SLAB_PART(t.p, S * K), SLAB_PART(t.cd, K * S),
        SLAB_PART(t.cnt, K * S), SLAB_PART(t.gain, K * S),
    };
    r = slab_new(&t, sizeof(t), parts, SLAB_N(parts), &p);
    if (r < 0)
        return r;
    p->mode = mode;
    if (clock)
        p->clock = *clock;
    p->max_seqs = max_seqs;
    p->kmax = kmax;
    p->xmax = kmax * max_seqs;
    for (int k = 0; k < SPEC_MAX_K; k++) {
        p->g_tried[k] = 2.0;
        p->g_hit[k] = 2.0 * GLOBAL_PRIOR;
        p->n0[k] = ACC_PRIOR;
    }
    for (int b = 0; b < GATE_BUCKETS; b++) {
        p->gate[b].explore = GATE_EXPLORE_MIN;
        p->gate[b].last = -1;
        p->gate[b].probe_interval = SPEC_POLICY_PROBE_MIN;
        p->gate[b].next_probe = SPEC_POLICY_PROBE_MIN;
    }
    p->window = window;
    p->fill_depth = -1;
    *ret = p;
    return 0;
}

void spec_policy_free(struct spec_policy *p)
{
    free(p);
}

int64_t spec_policy_now_us(const struct spec_policy *p)
{
    return clk_src_now_us(p ? &p->clock : NULL);
}

/* ---------------------------------------------------------------- costs -- */

/* The median of v[0 .. n), n >= 1 (the mean of the middle two for even n); sorts v. */
static double median_sort(float *v, int n)
{
    for (int i = 1; i < n; i++)         /* insertion sort: n is a ring's few entries */
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            float t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * ((double)v[n / 2 - 1] + v[n / 2]);
}

static void cost_add(struct spec_policy *p, struct cost *c, double secs)
{
    float v[COST_RING];
    int n = 0;

    if (!(secs >= 0.0))
        return;
    c->ring[c->head] = (float)secs;
    c->at[c->head] = p->n_decisions;
    c->head = (uint8_t)((c->head + 1) % COST_RING);
    if (c->n_ring < COST_RING)
        c->n_ring++;
    /* the median of the last COST_RING measurements no older than COST_FRESH decisions:
     * one step that lost its core moves nothing, and a cell measured only by probes
     * forgets the load it was measured under */
    for (int i = 0; i < c->n_ring; i++)
        if (p->n_decisions - c->at[i] <= COST_FRESH)
            v[n++] = c->ring[i];
    c->mean = median_sort(v, n);
    c->trust = (uint8_t)n;
    if (c->n < UINT32_MAX)
        c->n++;
}

static struct cost *verify_cell(struct spec_policy *p, int B, int x)
{
    return &p->verify[(size_t)B * (size_t)(p->xmax + 1) + (size_t)x];
}

static const struct cost *verify_cell_c(const struct spec_policy *p, int B, int x)
{
    return &p->verify[(size_t)B * (size_t)(p->xmax + 1) + (size_t)x];
}

/* The measured row nearest to B (B itself first), or -1. */
static int verify_row(const struct spec_policy *p, int B)
{
    for (int d = 0; d <= p->max_seqs; d++) {
        for (int s = -1; s <= 1; s += 2) {
            int b = B + s * d;

            if (b < 1 || b > p->max_seqs)
                continue;
            for (int x = 0; x <= p->xmax; x++)
                if (verify_cell_c(p, b, x)->n)
                    return b;
            if (d == 0)
                break;
        }
    }
    return -1;
}

/* A cell's value at decision `now`: the median of its measurements that are fresh now, or
 * when none is, its last value (*ret_fresh = 0: a stale cell) */
static double cell_read(const struct cost *c, uint64_t now, int *ret_fresh)
{
    float v[COST_RING];
    int n = 0;

    for (int i = 0; i < c->n_ring; i++)
        if (now - c->at[i] <= COST_FRESH)
            v[n++] = c->ring[i];
    *ret_fresh = n;
    /* as many as when the median was taken: the same ones (they only age) */
    return n == 0 || n == c->trust ? c->mean : median_sort(v, n);
}

/* A cost curve out[0 .. xn] from cells[x * stride], x = 0 .. xcap (unmeasured: n == 0).
 * A cell stands for itself while COST_TRUST measurements fresh at decision `now` are behind
 * its median; the others are replaced by the least-squares line (weighted by those counts,
 * a stale cell by COST_STALE_W) through every measured cell, or by the nearest measured
 * cell's value while there is only one, so that one odd measurement of a rarely chosen
 * configuration, or an old one taken under another load, cannot steer the choice (a
 * cell's freshness is judged when it is read: one that is no longer measured ages out of
 * its curve).  The curve is then made non-decreasing (pool-adjacent-violators weighted the
 * same way: more tokens or more sequences never cost less).  Below the first measured x
 * the curve stays flat (fewer drafts are not assumed cheaper than the fewest measured: a
 * new engine starts at the maximum and learns down); beyond the last it follows the line
 * (a probe moves a quarter of the sequences, and the line through it and the choice is
 * what the whole batch would pay).  false when no cell is measured. */
static bool cost_curve(const struct cost *cells, int stride, int xcap, int xn, uint64_t now,
                       double *out)
{
    double sw = 0, sx = 0, sy = 0, sxx = 0, sxy = 0, slope = 0, icpt = 0;
    double v[SPEC_MAX_K * 256 + 2], w[SPEC_MAX_K * 256 + 2];
    double cy[SPEC_MAX_K * 256 + 2];    /* each measured cell's value now (cell_read) */
    int cfresh[SPEC_MAX_K * 256 + 2];   /* ... and its fresh measurements (0: unmeasured) */
    int len[SPEC_MAX_K * 256 + 2], nb = 0, n_meas = 0, first = -1;

    if (xn > SPEC_MAX_K * 256)
        xn = SPEC_MAX_K * 256;
    for (int x = 0; x <= xcap; x++) {
        const struct cost *c = &cells[(size_t)x * (size_t)stride];
        bool kept = x <= xn;            /* the output below reads these */
        double wt, y;
        int fresh;

        if (kept)
            cfresh[x] = 0;
        if (!c->n)
            continue;
        y = cell_read(c, now, &fresh);
        if (kept) {
            cy[x] = y;
            cfresh[x] = fresh;
        }
        wt = fresh ? fresh : COST_STALE_W;
        sw += wt;
        sx += wt * x;
        sy += wt * y;
        sxx += wt * x * x;
        sxy += wt * x * y;
        n_meas++;
        first = first < 0 ? x : first;
    }
    if (!n_meas)
        return false;
    if (n_meas >= 2 && sw * sxx - sx * sx > 0) {
        slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx);
        slope = slope > 0 ? slope : 0;
        icpt = (sy - slope * sx) / sw;
    } else {
        icpt = sy / sw;
    }
    for (int x = 0; x <= xn; x++) {
        int xc = x < first ? first : x;
        double y = icpt + slope * xc, wt = 1.0;

        if (x <= xcap && cfresh[x] >= COST_TRUST) {
            y = cy[x];
            wt = cfresh[x];
        }
        v[nb] = y;
        w[nb] = wt;
        len[nb] = 1;
        nb++;
        while (nb > 1 && v[nb - 2] > v[nb - 1]) {
            double ww = w[nb - 2] + w[nb - 1];

            v[nb - 2] = (v[nb - 2] * w[nb - 2] + v[nb - 1] * w[nb - 1]) / ww;
            w[nb - 2] = ww;
            len[nb - 2] += len[nb - 1];
            nb--;
        }
    }
    for (int bi = 0, x = 0; bi < nb; bi++)
        for (int j = 0; j < len[bi]; j++)
            out[x++] = v[bi];
    return true;
}

/* C_verify over x = 0 .. xn extra tokens of row B (the nearest measured row) into out.
 * Below the row's fewest measured drafts the row's own curve is flat (fewer drafts are not
 * assumed cheaper than the fewest measured); there the curve of every decode step by its
 * tokens n = B + x, whatever its batch (a verify of B sequences with K drafts each is a
 * forward of B (K + 1) tokens), lowers it by what the tokens saved cost in the steps that
 * ran them: a batch of sixteen that starts at three drafts each knows what sixteen tokens
 * cost from four sequences with three drafts (on the tiny model at concurrency 16 the
 * policy kept drafting, the cost of no drafts read as that of 64 tokens, until the gate's
 * windows learnt otherwise).  The token curve is itself flat below its fewest tokens
 * measured, so nothing is lowered that no step has measured. */
static bool verify_curve(const struct spec_policy *p, int B, int xn, double *out)
{
    int row = verify_row(p, B), first = -1, nt = p->max_seqs + p->xmax;

    if (row < 0 || !cost_curve(verify_cell_c(p, row, 0), 1, p->xmax, xn, p->n_decisions, out))
        return false;
    for (int x = 0; x <= xn && x <= p->xmax && first < 0; x++)
        if (verify_cell_c(p, row, x)->n)
            first = x;
    nt = nt < SPEC_MAX_K * 256 ? nt : SPEC_MAX_K * 256;
    if (row != B || first <= 0 || B + first > nt ||
        !cost_curve(p->tokens, 1, nt, nt, p->n_decisions, p->ct))
        return true;
    for (int x = first - 1; x >= 0; x--) {
        double y = out[first] - (p->ct[B + first] - p->ct[B + x]);

        if (x <= xn && y > 0.0 && y < out[x])
            out[x] = y;
    }
    return true;
}

static const struct cost *draft_cell_c(const struct spec_policy *p, int k, int m)
{
    return &p->draft[(size_t)k * (size_t)(p->max_seqs + 1) + (size_t)m];
}

/* Whether MTP depth k has a measurement fresh at this decision, at any count of sequences
 * (its latest is) */
static bool draft_row_fresh(const struct spec_policy *p, int k)
{
    return p->draft_meas[k] > 0 && p->n_decisions - (p->draft_meas[k] - 1) <= COST_FRESH;
}

/* C_draft(k, m) for m = 0 .. n into out (out[0] = 0, no call): row k's curve over m where
 * it has a fresh measurement, else the nearest depth's that has one (the MTP depths are
 * layers of one shape: a depth the choices have left, measured once long ago or under
 * another load, reads as dear as that one measurement until it runs again, and it runs
 * only when it is rated worth it - on the tiny model at one sequence through the server,
 * depth 2's single first measurement of 1.36 ms against depth 1's 0.07 ms held K = 2 and
 * 3 at a third of K = 1's rate for 6,000 decisions while fixed K = 2 was the best arm);
 * where none is fresh, row k's own curve, and a depth never measured takes the nearest
 * measured depth's. */
static void draft_curve(const struct spec_policy *p, int k, int n, double *out)
{
    for (int pass = 0; pass < 2; pass++)
        for (int d = 0; d < p->kmax; d++)
            for (int s = -1; s <= 1; s += 2) {
                int kk = k + s * d;

                if (kk < 0 || kk >= p->kmax || (d == 0 && s > 0) ||
                    (pass == 0 && !draft_row_fresh(p, kk)))
                    continue;
                /* cells m = 1 .. max_seqs as x = 0 .. max_seqs - 1 */
                if (cost_curve(draft_cell_c(p, kk, 1), 1, p->max_seqs - 1, n > 0 ? n - 1 : 0,
                               p->n_decisions, out + 1)) {
                    out[0] = 0.0;
                    return;
                }
            }
    for (int m = 0; m <= n; m++)
        out[m] = 0.0;
}

/* Whether work that started at `start` (us) ran cold after an idle wait: within
 * COST_WAKE_S of its end.  After a wait the first steps of the tiny model on 2 threads took
 * 0.9, 0.8, 0.7 ms ... before they settled at 0.5 ms (at one sequence; the first step at 16):
 * no configuration pays that in a run, and one that happens to be measured there reads dear
 * until it is chosen again. */
static bool woken(const struct spec_policy *p, int64_t start)
{
    return p->wake_us > 0 && start - p->wake_us < (int64_t)(COST_WAKE_S * 1e6);
}

void spec_policy_draft_cost(struct spec_policy *p, int k, int m, bool fill, double seconds)
{
    bool cold, woke;

    if (!p || p->mode != SPEC_POLICY_ADAPTIVE)
        return;
    p->last_end_us = clk_src_now_us(&p->clock);
    if (k < 0 || k >= p->kmax)
        return;
    woke = woken(p, p->last_end_us - (int64_t)(seconds * 1e6));
    /* a depth that did not run in the previous step is cold (its weights left the caches,
     * its threads slept: on the tiny model's 2 threads the first MTP call after a stretch
     * without drafts took 530 us against 87 us in a run): its cost is not the one drafting
     * would pay, and probes (two steps) measure the second */
    cold = p->draft_ran[k] + 1 < p->n_steps;
    p->draft_ran[k] = p->n_steps;
    if (fill || cold || woke || m < 1 || m > p->max_seqs)
        return;
    cost_add(p, &p->draft[(size_t)k * (size_t)(p->max_seqs + 1) + (size_t)m], seconds);
    p->draft_meas[k] = p->n_decisions + 1;
}

/* ----------------------------------------------------------- acceptance -- */

/* Whether MTP layer j's cache is complete for sequence a: it wrote the last `window`
 * positions (or every one since position 0). */
static bool layer_clean(const struct spec_policy *p, const struct spec_accept *a, int j)
{
    return a->covered[j] >= a->pos || (p->window > 0 && a->covered[j] >= p->window);
}

/* The counts of a verify step of n_draft drafts of which `accepted` were: position j is
 * tried when drafts 1 .. j-1 were accepted; the engine-wide counts too. */
static void accept_add(struct spec_policy *p, struct spec_accept *a, int n_draft, int accepted)
{
    for (int j = 0; j < SPEC_MAX_K; j++) {
        a->tried[j] *= ACC_DECAY;
        a->hit[j] *= ACC_DECAY;
        a->tried_c[j] *= ACC_DECAY;
        a->hit_c[j] *= ACC_DECAY;
    }
    for (int j = 0; j < n_draft && j <= accepted; j++) {
        float h = j < accepted ? 1.0f : 0.0f;
        bool clean = layer_clean(p, a, j);

        a->tried[j] += 1.0f;
        a->hit[j] += h;
        p->g_tried[j] = p->g_tried[j] * GLOBAL_DECAY + 1.0;
        p->g_hit[j] = p->g_hit[j] * GLOBAL_DECAY + h;
        if (clean) {
            a->tried_c[j] += 1.0f;
            a->hit_c[j] += h;
            p->g_tried_c[j] = p->g_tried_c[j] * GLOBAL_DECAY + 1.0;
            p->g_hit_c[j] = p->g_hit_c[j] * GLOBAL_DECAY + h;
        }
    }
}

/* a_{j+1} of a sequence with counts a (NULL: the engine-wide rate): the complete-cache
 * counts where there are ACC_CLEAN_MIN of them (engine-wide) or ACC_CLEAN_SEQ (the
 * sequence's own), else all counts */
#define ACC_CLEAN_MIN 4.0
#define ACC_CLEAN_SEQ 2.0
static double accept_global(const struct spec_policy *p, int j)
{
    if (p->g_tried_c[j] >= ACC_CLEAN_MIN)
        return p->g_hit_c[j] / p->g_tried_c[j];
    return p->g_tried[j] > 0 ? p->g_hit[j] / p->g_tried[j] : GLOBAL_PRIOR;
}

/* The counts of a that stand for its rate at position j: tried into *n, accepted into *h */
static void accept_counts(const struct spec_accept *a, int j, double *n, double *h)
{
    bool clean = a->tried_c[j] >= ACC_CLEAN_SEQ;

    *n = clean ? a->tried_c[j] : a->tried[j];
    *h = clean ? a->hit_c[j] : a->hit[j];
}

static double accept_at(const struct spec_policy *p, const struct spec_accept *a, int j)
{
    double g = accept_global(p, j), n, h;

    if (!a)
        return g;
    accept_counts(a, j, &n, &h);
    return (h + p->n0[j] * g) / (n + p->n0[j]);
}

/* The prior's weight n0[j] from the candidates' counts (method of moments): the spread of
 * their own rates around the engine-wide g beyond what binomial noise gives is the
 * population's variance tau^2, and a Beta prior of that variance weighs g(1-g)/tau^2
 * verify steps.  Smoothed over decisions (in log), kept where fewer than
 * ACC_PRIOR_MIN_SEQS sequences have counts at j. */
static void prior_update(struct spec_policy *p, const struct spec_seq *seqs, int nc)
{
    for (int j = 0; j < p->kmax; j++) {
        double g = accept_global(p, j), v = g * (1.0 - g), s2 = 0.0, noise = 0.0, n0;
        int m = 0;

        for (int c = 0; c < nc; c++) {
            const struct spec_accept *a = seqs[p->cand[c]].acc;
            double n, h;

            if (!a)
                continue;
            accept_counts(a, j, &n, &h);
            if (n < 2.0)
                continue;
            s2 += (h / n - g) * (h / n - g);
            noise += v / n;
            m++;
        }
        if (m < ACC_PRIOR_MIN_SEQS || !(v > 0.0))
            continue;
        s2 = (s2 - noise) / m;
        n0 = s2 > v / ACC_PRIOR_MAX ? v / s2 : ACC_PRIOR_MAX;
        n0 = n0 < ACC_PRIOR ? ACC_PRIOR : n0;
        p->n0[j] = exp(0.9 * log(p->n0[j]) + 0.1 * log(n0));
    }
}

/* After the decision: the positions the chain of this step writes (n_valid of seq s),
 * layer by layer, for the cache-completeness test. */
static void coverage_add(struct spec_accept *a, int depth, int32_t pos0, int n_valid, int kmax)
{
    if (pos0 == 0)
        memset(a->covered, 0, sizeof(a->covered));
    for (int j = 0; j < kmax; j++)
        a->covered[j] = j < depth ? a->covered[j] + n_valid : 0;
    a->pos = pos0 + n_valid;
}

/* ------------------------------------------------------------- decision -- */

struct choice {
    int m[SPEC_MAX_K];
    double rate;
};

/* rate of prefix lengths m[0..kmax) given the prepared curves (p->cv, p->cd, cnt, gain) */
static double rate_of(const struct spec_policy *p, int B, int n, const int *m)
{
    double tok = B + p->fix_gain, secs;
    int x = p->fix_x;

    for (int k = 0; k < p->kmax; k++) {
        size_t o = (size_t)k * (size_t)(p->max_seqs + 1);
        int c = p->cnt[o + (size_t)m[k]];

        tok += p->gain[o + (size_t)m[k]];
        x += c;
    }
    secs = p->cv[x > p->xmax ? p->xmax : x] + p->rest.mean;
    for (int k = 0; k < p->kmax; k++) {
        size_t o = (size_t)k * (size_t)(p->max_seqs + 1);
        secs += p->cd[o + (size_t)(p->cnt[o + (size_t)m[k]] + p->fix_cnt[k])];
    }
    (void)n;
    return secs > 0 ? tok / secs : 0.0;
}

/* candidate prefix lengths for n sequences: all of 0..n, or a grid of about
 * SPEC_POLICY_FULL_SEARCH values with 0 and n */
static int grid(int n, int *out)
{
    int c = 0;

    if (n <= SPEC_POLICY_FULL_SEARCH) {
        for (int m = 0; m <= n; m++)
            out[c++] = m;
        return c;
    }
    for (int i = 0; i <= SPEC_POLICY_FULL_SEARCH; i++) {
        int m = (int)((int64_t)n * i / SPEC_POLICY_FULL_SEARCH);

        if (c == 0 || out[c - 1] != m)
            out[c++] = m;
    }
    return c;
}

static void search(const struct spec_policy *p, int B, int n, struct choice *best)
{
    int g[SPEC_POLICY_FULL_SEARCH + 2], ng = grid(n, g);
    int m[SPEC_MAX_K] = { 0 };

    best->rate = -1.0;
    /* m[0] >= m[1] >= m[2]: indices into the grid, non-increasing */
    for (int i0 = 0; i0 < ng; i0++) {
        m[0] = g[i0];
        for (int i1 = 0; i1 <= (p->kmax > 1 ? i0 : 0); i1++) {
            m[1] = p->kmax > 1 ? g[i1] : 0;
            for (int i2 = 0; i2 <= (p->kmax > 2 ? i1 : 0); i2++) {
                double r;

                m[2] = p->kmax > 2 ? g[i2] : 0;
                r = rate_of(p, B, n, m);
                if (r > best->rate) {
                    best->rate = r;
                    memcpy(best->m, m, sizeof(m));
                }
            }
        }
    }
}

/* The depth of the sequence at ranking position pos under prefix lengths m, at most cap. */
static int depth_of(const struct spec_policy *p, const int *m, int pos, int cap)
{
    int d = 0;

    while (d < p->kmax && pos < m[d] && cap > d)
        d++;
    return d;
}

/* A probe's prefix lengths out: m with depth k's frontier moved by `share` sequences,
 * dir > 0 down the ranking (the sequences just past it draft once more), dir < 0 up it
 * (the last ones inside draft once less), kept nested (m[k - 1] >= m[k] >= m[k + 1]);
 * false when that changes no candidate's depth (their caps included). */
static bool probe_shift(const struct spec_policy *p, const struct spec_seq *seqs, int nc,
                        const int *m, int k, int dir, int share, int *out)
{
    int lim;

    memcpy(out, m, SPEC_MAX_K * sizeof(*out));
    if (dir > 0) {
        lim = k == 0 ? nc : m[k - 1];
        out[k] = m[k] + share < lim ? m[k] + share : lim;
    } else {
        lim = k + 1 < p->kmax ? m[k + 1] : 0;
        out[k] = m[k] - share > lim ? m[k] - share : lim;
    }
    for (int pos = 0; pos < nc; pos++) {
        int cap = seqs[p->rank[pos]].depth;

        if (depth_of(p, out, pos, cap) != depth_of(p, m, pos, cap))
            return true;
    }
    return false;
}

/* The gate of B decoding sequences (B >= 1): bucket log2(B). */
static struct gate *gate_of(struct spec_policy *p, int B)
{
    int b = 0;

    while (b < GATE_BUCKETS - 1 && (B >> (b + 1)) > 0)
        b++;
    return &p->gate[b];
}

/* The depths of the decoding sequences (candidates p->cand[0 .. nc)); `off`: the gate's
 * window without drafts, where only the probes draft (p->chose still says whether the model
 * would have). */
static void decide(struct spec_policy *p, struct step_plan *plan, struct spec_seq *seqs, int B,
                   int nc, int sum_cap, bool off, int probe_floor)
{
    struct gate *gb = gate_of(p, B);
    static const int none[SPEC_MAX_K];
    struct choice best;

    if (!verify_curve(p, B, sum_cap + p->fix_x < p->xmax ? sum_cap + p->fix_x : p->xmax, p->cv)) {
        /* nothing measured yet: the maximum (and learn) */
        p->chose = true;
        for (int c = 0; off && c < nc; c++) {
            seqs[p->cand[c]].depth = 0;
            plan->seqs[p->cand[c]].mtp_depth = 0;
        }
        p->fill_depth = off ? 0 : p->fill_depth;
        return;
    }
    prior_update(p, seqs, nc);
    /* rank the candidates by first-position acceptance (insertion sort, stable) */
    for (int c = 0; c < nc; c++) {
        double a = accept_at(p, seqs[p->cand[c]].acc, 0);
        int pos = c;

        while (pos > 0 && p->a1[pos - 1] < a) {
            p->a1[pos] = p->a1[pos - 1];
            p->rank[pos] = p->rank[pos - 1];
            pos--;
        }
        p->a1[pos] = a;
        p->rank[pos] = p->cand[c];
    }
    for (int k = 0; k < p->kmax; k++) {
        size_t o = (size_t)k * (size_t)(p->max_seqs + 1);

        p->cnt[o] = 0;
        p->gain[o] = 0.0;
        draft_curve(p, k, nc + p->fix_cnt[k], p->cd + o);
    }
    for (int pos = 0; pos < nc; pos++) {
        const struct spec_seq *s = &seqs[p->rank[pos]];
        double pr = 1.0;

        for (int k = 0; k < p->kmax; k++) {
            size_t o = (size_t)k * (size_t)(p->max_seqs + 1);
            bool in = s->depth > k;

            pr *= accept_at(p, s->acc, k);
            p->cnt[o + pos + 1] = p->cnt[o + pos] + in;
            p->gain[o + pos + 1] = p->gain[o + pos] + (in ? pr : 0.0);
        }
    }
    search(p, B, nc, &best);
    /* hysteresis: keep the previous choice unless the new one is clearly better; a
     * previous choice over a few more or fewer candidates (a quarter at most) is scaled to
     * this one (the same share of them at each depth: a batch that grows or shrinks by a
     * sequence keeps its depths, instead of a fresh pick among near-equal ones that noise
     * decides; a batch of another size altogether chooses afresh) */
    if (p->prev_n > 0 && 4 * abs(nc - p->prev_n) <= p->prev_n) {
        int m[SPEC_MAX_K];
        double r;

        for (int k = 0; k < SPEC_MAX_K; k++)     /* (the same choice when nc == prev_n) */
            m[k] = (int)(((int64_t)p->prev_m[k] * nc + p->prev_n / 2) / p->prev_n);
        r = rate_of(p, B, nc, m);
        if (best.rate < r * (1.0 + SPEC_POLICY_HYSTERESIS)) {
            memcpy(best.m, m, sizeof(m));
            best.rate = r;
        }
    }
    /* the gate's evidence against a choice of no drafts: where this bucket's own pairs
     * measured the model's drafting faster than none (by the factor exp(-lq)), and the
     * model now estimates its last drafting choice here behind no drafts by less than
     * that, the measurement wins and the drafting choice runs (the gate can veto drafting
     * by its arm without; this is its say the other way) */
    if (best.m[0] > 0) {
        memcpy(gb->dm, best.m, sizeof(best.m));
        gb->dn = nc;
    } else if (!off && gb->dn > 0 && gb->ring_n && gb->lq < -log1p(GATE_HYSTERESIS)) {
        int m[SPEC_MAX_K];
        double r;

        for (int k = 0; k < SPEC_MAX_K; k++) {
            m[k] = (int)(((int64_t)gb->dm[k] * nc + gb->dn / 2) / gb->dn);
            m[k] = m[k] < nc ? m[k] : nc;
        }
        m[0] = m[0] > 0 ? m[0] : 1;
        r = rate_of(p, B, nc, m);
        if (r * exp(-gb->lq) > best.rate) {
            memcpy(best.m, m, sizeof(m));
            best.rate = r;
        }
    }
    if (p->probe_check && !p->probe_more && p->probe_gate != (int)(gb - p->gate)) {
        /* the batch moved to another bucket before the probe was judged: the probe's bucket
         * probes again after its interval */
        struct gate *pg = &p->gate[p->probe_gate];

        pg->next_probe = pg->n_dec + (uint64_t)pg->probe_interval;
        p->probe_check = false;
    }
    if (p->probe_check && !p->probe_more) {
        /* after a probe: the interval doubles while probes confirm the choice, but stays
         * short while a neighbour is estimated within a few per cent of it */
        bool same = memcmp(best.m, p->probe_m, sizeof(best.m)) == 0;
        double margin = 1.0;
        int cap = SPEC_POLICY_PROBE_MIN;
        int up[SPEC_MAX_K] = { 0 }, down[SPEC_MAX_K] = { 0 };

        for (int k = 0; k < p->kmax; k++) {
            up[k] = k == 0 ? nc : best.m[k - 1];
            down[k] = k + 1 < p->kmax ? best.m[k + 1] : 0;
        }
        if (memcmp(up, best.m, sizeof(up)) != 0)
            margin = best.rate / rate_of(p, B, nc, up) - 1.0;
        if (memcmp(down, best.m, sizeof(down)) != 0) {
            double md = best.rate / rate_of(p, B, nc, down) - 1.0;
            margin = md < margin ? md : margin;
        }
        for (double t = 0.05; t <= margin && cap < SPEC_POLICY_PROBE_MAX; t += 0.05)
            cap *= 2;
        /* a probe that confirms that drafts lose here (the choice runs none: the gate's arm
         * without drafts, or the model's own choice with its neighbour 5 % behind) lets the
         * interval double on up to SPEC_POLICY_PROBE_BACKOFF: what it measures changes
         * nothing, and every one costs the gap */
        if (same && (off || (!best.m[0] && margin >= SPEC_POLICY_BACKOFF_MARGIN)))
            cap = SPEC_POLICY_PROBE_BACKOFF;
        gb->probe_interval = same ? gb->probe_interval * 2 : SPEC_POLICY_PROBE_MIN;
        gb->probe_interval = gb->probe_interval < cap ? gb->probe_interval : cap;
        /* where the gate has measured drafting slower and runs without, a probe that drafts
         * costs that gap: probes come no oftener than the gate's own explorations, counted
         * in decisions rather than windows */
        gb->probe_interval = gb->probe_interval > probe_floor ? gb->probe_interval : probe_floor;
        gb->next_probe = gb->n_dec + (uint64_t)gb->probe_interval;
        p->probe_check = false;
    }
    memcpy(p->prev_m, best.m, sizeof(best.m));
    p->prev_n = nc;
    p->n_decisions++;
    gb->n_dec++;
    if (p->n_decisions % 256 == 0 && log_get_level() >= LOG_LEVEL_DEBUG) {
        int mu[SPEC_MAX_K];
        char buf[160];
        int o = 0;

        for (int d = 0; d <= p->kmax; d++) {
            for (int k = 0; k < p->kmax; k++)
                mu[k] = k < d ? nc : 0;
            o += snprintf(buf + o, sizeof(buf) - (size_t)o, " K=%d %.0f", d, rate_of(p, B, nc, mu));
        }
        log_debug("spec policy: B %d, %d drafting, chose m = %d/%d/%d (%.0f tok/s); uniform%s; "
                  "rest %.0f us, acceptance %.2f %.2f %.2f", B, nc, best.m[0], best.m[1],
                  best.m[2], best.rate, buf, p->rest.mean * 1e6, accept_at(p, NULL, 0),
                  accept_at(p, NULL, 1), accept_at(p, NULL, 2));
    }

    /* depths: a prefix per depth, nested (none in the gate's window without drafts); a
     * probe moves one depth's frontier by `share` sequences (one draft more for the
     * sequences ranked just below it, or one fewer for those just above: probe_shift), and
     * runs again in the next step if the first one ran a depth cold */
    {
        int pm[SPEC_MAX_K], share = (nc + SPEC_POLICY_PROBE_SHARE - 1) / SPEC_POLICY_PROBE_SHARE;
        const int *base = off ? none : best.m;
        bool probing = false;

        if (gb->n_dec >= gb->next_probe) {
            double pr = -1.0;

            /* the preferred direction first (they alternate), and in it the frontier
             * whose move the model rates best: the neighbour most likely to overturn
             * the choice */
            p->probe_dir = !p->probe_dir;
            for (int t = 0; t < 2 && pr < 0.0; t++) {
                int dir = (p->probe_dir ^ t) ? 1 : -1;

                for (int k = 0; k < p->kmax; k++) {
                    double r;

                    if (!probe_shift(p, seqs, nc, base, k, dir, share, pm))
                        continue;
                    r = rate_of(p, B, nc, pm);
                    if (r > pr) {
                        pr = r;
                        p->probe_k = k;
                        p->probe_delta = dir;
                    }
                }
            }
            probing = pr >= 0.0;
            p->n_probes += probing;
            memcpy(p->probe_m, best.m, sizeof(best.m));
            p->probe_check = true;
            p->probe_gate = (int)(gb - p->gate);
            gb->next_probe = UINT64_MAX;
            /* a probe that runs a depth the step before did not runs it twice: the first
             * time it is cold (spec_policy_draft_cost) */
            p->probe_more = probing && p->probe_delta > 0 &&
                            p->draft_ran[p->probe_k] + 1 < p->n_steps
                                ? SPEC_POLICY_PROBE_STEPS - 1 : 0;
        } else if (p->probe_more > 0) {
            p->probe_more--;            /* the probe's next step: the first one ran cold */
            probing = true;
        }
        if (probing)
            probing = probe_shift(p, seqs, nc, base, p->probe_k, p->probe_delta, share, pm);
        p->probed = probing;
        p->fill_depth = 0;
        for (int pos = 0; pos < nc; pos++) {
            int i = p->rank[pos], cap = seqs[i].depth, d = depth_of(p, best.m, pos, cap);

            p->chose |= d > 0;
            d = off ? 0 : d;
            p->fill_depth = d > p->fill_depth ? d : p->fill_depth;
            if (probing)
                d = depth_of(p, pm, pos, cap);
            seqs[i].depth = d;
            plan->seqs[i].mtp_depth = d;
        }
    }
}

/* A pair's log ratio into the bucket's ring; lq becomes the ring's median (of up to
 * GATE_RING: one disturbed pair moves it no further than its neighbours) */
static void gate_pair_add(struct gate *g, double q)
{
    float v[GATE_RING];

    g->n_pairs++;
    g->ring[g->ring_head] = (float)q;
    g->ring_head = (uint8_t)((g->ring_head + 1) % GATE_RING);
    if (g->ring_n < GATE_RING)
        g->ring_n++;
    memcpy(v, g->ring, sizeof(v));
    g->lq = median_sort(v, g->ring_n);
    g->inferred = false;
}

/* The explore interval that the gap between the arms asks for (windows):
 * GATE_EXPLORE_MIN * (gap / GATE_GAP_UNIT)^2, capped at GATE_EXPLORE_MAX */
static int gate_interval(const struct gate *g)
{
    double u = (exp(fabs(g->lq)) - 1.0) / GATE_GAP_UNIT;

    u = GATE_EXPLORE_MIN * u * u;
    return u < GATE_EXPLORE_MIN ? GATE_EXPLORE_MIN
                                : (u > GATE_EXPLORE_MAX ? GATE_EXPLORE_MAX : (int)u);
}

/* The fewest decisions between probes while gate g runs without drafts: its explore
 * interval where it has measured (or inferred) the gap, else none. */
static int gate_probe_floor(const struct gate *g)
{
    return g->ring_n || g->inferred ? gate_interval(g) : 0;
}

/* While bucket b has no pair of its own: the ratio of the nearest buckets that have one
 * (at the least distance, any; of two, the one nearer to 1) into its lq; false (nothing
 * set) when none has. */
static bool gate_infer(struct spec_policy *p, int b)
{
    struct gate *g = &p->gate[b];
    bool found = false;
    double q = 0.0;

    for (int d = 1; d < GATE_BUCKETS && !found; d++)
        for (int s = -1; s <= 1; s += 2) {
            int nb = b + s * d;

            if (nb < 0 || nb >= GATE_BUCKETS || !p->gate[nb].ring_n)
                continue;
            if (!found || fabs(p->gate[nb].lq) < fabs(q))
                q = p->gate[nb].lq;
            found = true;
        }
    if (found)
        g->lq = q;
    return found;
}

/* The gate's bookkeeping for one engine cycle of B decoding sequences that emitted tok
 * tokens; returns whether this step runs without the model's drafts.  A window's end
 * picks the next arm (the gate above). */
static bool gate_step(struct spec_policy *p, int B, int tok, int64_t now)
{
    int b, arm, eff, best;
    struct gate *g;
    double dt = p->gate_last_us > 0 ? (double)(now - p->gate_last_us) * 1e-6 : 0.0;
    bool explored, known, paired = false;

    p->gate_last_us = now;
    if (B < 1)
        return false;
    g = gate_of(p, B);
    b = (int)(g - p->gate);
    if (!g->steps && g->last < 0 && !g->ring_n && !g->inferred && gate_infer(p, b)) {
        /* a bucket's first cycle, and another bucket has measured a pair: start in the arm
         * its ratio favours (a batch size where drafts pay drafts from its first step); the
         * window judges it (below) */
        g->inferred = true;
        g->judge = true;
        g->explore = gate_interval(g);
        g->since = 0;
        g->off = g->lq > -log1p(GATE_HYSTERESIS);
    }
    g->chose += p->chose;
    if (g->steps++ >= GATE_WARM && dt > 0.0 && dt < 1.0) {
        g->tok += tok;
        g->sec += dt;
    }
    if (g->steps < GATE_WARM + GATE_WINDOW || g->sec < GATE_WINDOW_S)
        return g->off;
    arm = g->off;
    explored = g->since == -1;          /* this window explored the arm that loses */
    /* what the window measured: 0 drafting, 1 none, -1 nothing (warm, or drafting in
     * fewer than half its cycles: a window the model began or stopped drafting in; the
     * windows either side still pair) */
    eff = g->warm ? -1 : (arm || !g->chose) ? 1 : 2 * g->chose >= g->steps ? 0 : -1;
    if (eff >= 0) {
        double r = g->tok / g->sec;

        if (g->last == !eff && g->last_rate > 0.0 && r > 0.0) {
            gate_pair_add(g, eff ? log(r / g->last_rate) : log(g->last_rate / r));
            paired = true;
        }
        g->last = eff;
        g->last_rate = r;
    }
    if (g->judge) {
        /* the first window of a bucket started in its neighbours' arm without drafts: where
         * the model would have drafted in most of its cycles, the neighbours and the model
         * disagree, and the next window drafts (the bucket's own pair follows); where they
         * agree the inference stands for the interval its gap asks for.  (In the drafting
         * arm the model's own choices ran: a model that disagrees did not draft.) */
        g->judge = false;
        if (arm && 2 * g->chose >= g->steps)
            g->since = g->explore;
    }
    if (!g->ring_n && gate_infer(p, b) && !g->inferred) {
        /* no pair here, but the neighbours have one: the arm they find slower waits for
         * the interval their gap asks for (a batch size seen only in the tails of larger
         * batches would otherwise spend its first windows on it) */
        int gi = gate_interval(g);

        g->inferred = true;
        g->explore = gi < GATE_INFER_MAX ? gi : GATE_INFER_MAX;
        g->since = 0;
    }
    known = g->ring_n || g->inferred;
    if (g->warm) {
        best = arm;                     /* the warm window ends: the measured one follows */
    } else if (!known) {
        best = eff == 0;                /* after a window that drafted, one without */
    } else {
        int v = g->lq > -log1p(GATE_HYSTERESIS);    /* a tie: no drafts */

        if (explored) {
            /* did the exploring window confirm the arm it left?  Then twice the interval,
             * or what the gap asks for (an exploration that measured no pair says nothing) */
            int gi = gate_interval(g);

            if (paired)
                g->explore = v == !arm ? (g->explore * 2 > GATE_EXPLORE_MAX ? GATE_EXPLORE_MAX
                                                                            : g->explore * 2)
                                       : GATE_EXPLORE_MIN;
            if (v == !arm && gi > g->explore)
                g->explore = gi;
            g->since = 0;
            best = v;
        } else if (v == arm) {
            best = ++g->since >= g->explore ? !v : v;   /* explore the other for a window */
            g->since = best == v ? g->since : -1;
        } else {
            /* a switch on a pair from windows the model drafted in or not on its own: the
             * arm left is checked again soon, so that one disturbed pair does not decide
             * for long */
            int gi = gate_interval(g) / 4;

            g->explore = gi > GATE_EXPLORE_SWITCH ? gi : GATE_EXPLORE_SWITCH;
            g->since = 0;
            best = v;
        }
    }
    if (best != arm)
        p->gate_switches++;
    g->warm = arm && !best;
    g->off = best;
    g->chose = 0;
    g->steps = 0;
    g->tok = g->sec = 0.0;
    return g->off;
}

void spec_policy_idle(struct spec_policy *p)
{
    if (!p)
        return;
    p->gate_last_us = 0;
    p->last_end_us = 0;
    p->wake_us = clk_src_now_us(&p->clock);
}

bool spec_policy_step(struct spec_policy *p, struct step_plan *plan, struct spec_seq *seqs, int n,
                      double step_s)
{
    int B = 0, nc = 0, tok = 0, sum_cap = 0, out = 0;
    bool decode = true, any = false, off;
    int64_t now = clk_src_now_us(&p->clock), start;

    if (!p || p->mode != SPEC_POLICY_ADAPTIVE) {
        for (int i = 0; i < n; i++)
            any |= seqs[i].depth > 0;
        return any;
    }
    for (int i = 0; i < n; i++) {
        const struct step_seq *ps = &plan->seqs[i];

        if (ps->n_logits == ps->n_tokens)
            B++;
        else
            decode = false;
        tok += ps->n_tokens;
        if (ps->n_logits > 0)
            out += 1 + seqs[i].accepted;
    }
    p->n_steps++;
    off = gate_step(p, B, out, now);
    /* the acceptance of this step's verifications */
    for (int i = 0; i < n; i++)
        if (seqs[i].acc && seqs[i].verified > 0)
            accept_add(p, seqs[i].acc, seqs[i].verified, seqs[i].accepted);
    /* the step's cost, and the rest of the cycle since the previous decode step */
    start = now - (int64_t)(step_s * 1e6);
    if (decode && B >= 1 && B <= p->max_seqs && tok - B <= p->xmax && !woken(p, start)) {
        cost_add(p, verify_cell(p, B, tok - B), step_s);
        cost_add(p, &p->tokens[tok], step_s);
        if (p->last_decode && p->last_end_us > 0 && start >= p->last_end_us &&
            (double)(start - p->last_end_us) * 1e-6 < 2.0 * step_s)
            cost_add(p, &p->rest, (double)(start - p->last_end_us) * 1e-6);
    }
    p->last_decode = decode;
    p->last_end_us = now;

    /* candidates: decoding sequences that may draft, but those that keep their depth (a
     * sampled sequence with the client's seed: its tokens depend on the drafts they were
     * verified against, and a seed must give the same tokens whatever the machine's load;
     * a drawn seed promises only the target's distribution, which the rejection test keeps
     * whatever the drafts) */
    p->fix_x = 0;
    p->fix_gain = 0.0;
    memset(p->fix_cnt, 0, sizeof(p->fix_cnt));
    for (int i = 0; i < n; i++) {
        struct spec_seq *q = &seqs[i];

        if (q->depth <= 0 || q->fill_only)
            continue;
        if (q->keep_depth) {
            double pr = 1.0;

            p->fix_x += q->depth;
            for (int k = 0; k < q->depth && k < p->kmax; k++) {
                pr *= accept_at(p, q->acc, k);
                p->fix_gain += pr;
                p->fix_cnt[k]++;
            }
            continue;
        }
        p->cand[nc++] = i;
        sum_cap += q->depth;
    }
    p->chose = false;
    p->probed = false;
    if (nc > 0)     /* (in the gate's window without drafts only the probes draft) */
        decide(p, plan, seqs, B < nc ? nc : (B > p->max_seqs ? p->max_seqs : B), nc, sum_cap,
               off, off && B >= 1 ? gate_probe_floor(gate_of(p, B)) : 0);
    else if (off)
        p->fill_depth = 0;
    /* prompt chunks fill the caches the decode steps will read; every chain's positions */
    for (int i = 0; i < n; i++) {
        const struct step_seq *ps = &plan->seqs[i];
        struct spec_seq *s = &seqs[i];

        if (s->fill_only && s->depth > p->fill_depth && p->fill_depth >= 0 && !s->keep_depth) {
            s->depth = p->fill_depth;
            plan->seqs[i].mtp_depth = s->depth;
        }
        if (s->acc)
            coverage_add(s->acc, s->depth, ps->pos0, ps->n_tokens - s->verified + s->accepted,
                         p->kmax);
        any |= s->depth > 0;
    }
    if (nc > 0 && decode && B >= 1) {
        struct gate *g = gate_of(p, B);
        bool drafted = false;

        for (int c = 0; c < nc; c++)
            drafted |= seqs[p->cand[c]].depth > 0;
        g->n_cycles++;
        g->n_drafted += drafted;
        g->n_probe_steps += p->probed;
    }
    return any;
}

void spec_policy_stats(const struct spec_policy *p, struct spec_policy_stats *ret)
{
    memset(ret, 0, sizeof(*ret));
    if (!p || p->mode != SPEC_POLICY_ADAPTIVE)
        return;
    ret->decisions = p->n_decisions;
    ret->probes = p->n_probes;
    ret->gate_switches = p->gate_switches;
    for (int b = 0; b < GATE_BUCKETS; b++) {
        const struct gate *g = &p->gate[b];

        ret->b[b] = (struct spec_policy_bucket) {
            .cycles = g->n_cycles, .drafted = g->n_drafted, .probe_steps = g->n_probe_steps,
            .pairs = (uint32_t)g->n_pairs, .lq = g->ring_n ? g->lq : 0.0,
        };
    }
}

/* ------------------------------------------------------------ diagnostics -- */

double spec_policy_rate(const struct spec_policy *p, int B, int d)
{
    double cv[SPEC_MAX_K * 256 + 1], cd[SPEC_MAX_K][257], tok = B, secs;
    struct spec_policy q;

    if (!p || B < 1 || B > p->max_seqs || B > 256 || d < 0 || d > p->kmax)
        return 0.0;
    q = *p;
    q.cv = cv;
    if (!verify_curve(&q, B, B * d, cv))
        return 0.0;
    secs = cv[B * d] + p->rest.mean;
    for (int k = 0; k < d; k++) {
        double pr = 1.0;

        draft_curve(p, k, B, cd[k]);
        secs += cd[k][B];
        for (int j = 0; j <= k; j++)
            pr *= accept_at(p, NULL, j);
        tok += B * pr;
    }
    return secs > 0 ? tok / secs : 0.0;
}
