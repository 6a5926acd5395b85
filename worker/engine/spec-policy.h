/* spec-policy.h - how many MTP drafts each sequence gets, step by step (rank 0's engine).
 *
 * num_speculative_tokens (the engine's default and a request's own) stays the most drafts
 * a sequence may get.  With the FIXED policy every decoding sequence gets exactly that many
 * (as vLLM does).  The ADAPTIVE policy (the default) picks, after every step, a depth
 * d_i in 0 .. cap_i for each decoding sequence i so that the output tokens per second of
 * the next step is largest, from the engine's own running measurements:
 *
 *   rate = (B + sum_i sum_{j <= d_i} p_ij) / (C_verify(B, B + sum_i d_i)
 *                                             + sum_k C_draft(k, m_k) + C_rest)
 *
 *   B            the decoding sequences of the step (each emits at least one token);
 *   p_ij         the chance that sequence i's drafts 1..j are all accepted: the product of
 *                its per-position acceptance a_i1 .. a_ij, estimated from its own recent
 *                verify steps (decayed counts) with the engine-wide rates as the prior,
 *                weighed by how far the sequences' own rates spread beyond their counts'
 *                noise (an empirical Bayes prior: equal streams are drafted alike, not
 *                by their lucky verifies);
 *                counted apart are the drafts made while the MTP layer behind them had
 *                written every position of its window (a step that skips a layer leaves
 *                a hole in its cache: on the tiny model the first-position acceptance
 *                fell from 0.99 to 0.75 with holes), and those rates are the ones used
 *                while there are enough of them: the policy chooses by the rate a depth
 *                keeps once it runs, not by the transient after a switch or a probe;
 *   C_verify     the seconds of a decode step of B sequences and n tokens (forward pass and
 *                verification), measured per (B, n), interpolated along n and extended
 *                along the line through the measured n beyond the largest; below the
 *                fewest measured at B, lowered by what the tokens saved cost in the steps
 *                of any batch that ran that many (a verify of B sequences with K drafts
 *                each is a forward of B (K + 1) tokens: sixteen sequences that start at
 *                three drafts know what no drafts cost from four with three);
 *   C_draft      the seconds of MTP depth k for m sequences, measured per (k, m), and
 *                interpolated and extended along m the same way;
 *   C_rest       the rest of a step (scheduling, delivery), measured as the gap between
 *                decode steps;
 *   m_k          the sequences drafting at depth k (d_i > k).
 *
 * The sequences are ranked by their first-position acceptance; depth k goes to a prefix
 * of the ranking (nested sets), and every combination of prefix lengths m_1 >= m_2 >= m_3
 * is evaluated (a grid of them beyond SPEC_POLICY_FULL_SEARCH sequences).  A choice only
 * changes when it is better by SPEC_POLICY_HYSTERESIS, so noise does not flap it (a batch
 * that gains or loses a few sequences keeps the same share at each depth).  What
 * is never chosen is never measured, so every so often (per batch-size bucket, the gate's
 * below: an interval of decisions that doubles while probes confirm the choice, up to
 * SPEC_POLICY_PROBE_MAX when the neighbours are estimated 20 % or more behind; where the
 * confirmed choice runs no drafts (the gate's arm without them, or the model's own choice
 * with its neighbour SPEC_POLICY_BACKOFF_MARGIN or more behind) it doubles on up to
 * SPEC_POLICY_PROBE_BACKOFF (a probe there costs the gap and changes nothing), back at
 * SPEC_POLICY_PROBE_MIN once a probe changes the choice, and at most SPEC_POLICY_PROBE_MAX
 * after a probe confirms a choice that drafts; never shorter than the gate's own
 * exploration interval while the gate runs without drafts) a step probes: one
 * depth's frontier in the ranking moves by 1/SPEC_POLICY_PROBE_SHARE of the sequences (at
 * least one), giving them one draft more or one fewer, the move the model rates best in the direction whose turn it
 * is (at sixteen sequences four draft in a probe, not sixteen: the cost line through the
 * probe and the choice says what all would pay).  An MTP depth that did not run in the
 * step before is cold and its cost is not counted: a probe that runs one runs
 * SPEC_POLICY_PROBE_STEPS steps, the first only warms it.  Nor is work that starts within
 * 10 ms of an idle wait counted (the machine wakes up: the tiny model's first steps after
 * one took up to twice their time, and a configuration measured only there read dear
 * until it was chosen again, which it no longer was).  Fewer drafts than the fewest
 * measured are not assumed cheaper than the token curve says (C_verify): a new engine
 * starts at the maximum and learns down.
 * Greedy output never depends on the choice (the verify is exact), nor does the
 * distribution of sampled output (the rejection test), so every sequence's depth is chosen
 * but for those the caller marks keep_depth (spec.h): a sampled sequence with the client's
 * seed, since which tokens a seed gives depends on the drafts they were verified against,
 * and a seed must give the same tokens whatever the machine's load (their drafts still
 * count in the costs the others are chosen against).  A drawn seed promises no tokens: on
 * the tiny model at temperature 1 drafts lose under load (0.59 of K = 0 at concurrency 16
 * through `stepd serve` while sampled sequences kept their depth).
 *
 * Over the model sits a gate, measured rather than modelled: per batch-size bucket (log2 of
 * the decoding sequences) windows of engine cycles run in one of two arms, the depths
 * chosen above or none of them (only the model's probes draft there).  A window measures
 * what ran: drafting if the model drafted in at least half its cycles, no drafts if it
 * drafted in none (or ran in the second arm).  The evidence is paired: each window that
 * measured one arm right after one that measured the other gives the ratio of their
 * tokens per second of wall time, so that a machine whose speed wanders (a shared VM ran
 * the same steps 1.8 to 3.4 ms apart within seconds) moves both sides of a pair alike,
 * where comparing each arm's own last windows set a slow spell of one against a fast one
 * of the other; the median of the last pairs decides, and a tie runs without drafts.  The
 * arm that loses gets a window now and then (an interval that doubles while it confirms
 * the choice, and is longer the wider the gap: an exploring window costs the gap); a
 * window that drafts again after one without is not measured (the MTP caches have holes
 * there).  While the gate runs without drafts the model's choices are not run, so a model
 * whose estimates favour drafting (probes measure drafting warm, where a run of it pays
 * for the caches its draft layers take) drafts only in the gate's exploring windows.  A
 * bucket seen for the first time starts from the evidence of the nearest buckets that have
 * a pair (at any distance; of two, the ratio nearer to 1): it runs the arm their ratio
 * favours from its first cycle (a batch size where drafts pay next door drafts from the
 * start), and its first window judges that: where it ran without drafts and the model would
 * have drafted in most of its cycles, its next window drafts, and the pair that makes
 * decides from then on; where they agree it tries the other arm after the interval the gap
 * asks for.  A bucket whose first window found no such neighbour runs the model's arm,
 * then one without (its own first pair); if a neighbour's pair comes first, it takes that
 * ratio and tries the arm that loses after the interval their gap asks for (at most 16
 * windows).  The batch sizes a batch passes through as its requests finish are seen too
 * seldom to spend their first windows on an arm that is far behind next door.  The gate
 * also speaks the other way: where a bucket's own pairs measured the model's drafting
 * ahead of none by a factor f, and the model now chooses no drafts while it estimates its
 * last drafting choice there less than f behind, that drafting choice runs (scaled to the
 * candidates), so a model whose costs read drafting too dear is held to what the windows
 * measured.  It catches what the cost model misses (on the tiny model at
 * concurrency 16 it drafted where K = 0 was faster).
 * Fill-only chains (prompt chunks that keep the MTP caches complete) run as deep as the
 * deepest draft of the last decision (the whole chain before there is one): caches the
 * decode steps will not read are not filled.
 * Engine thread only (the engine's step).
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "clock.h"
#include "plan.h"
#include "spec.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SPEC_POLICY_FULL_SEARCH 24
#define SPEC_POLICY_HYSTERESIS 0.03
#define SPEC_POLICY_PROBE_MIN 8
#define SPEC_POLICY_PROBE_MAX 128
#define SPEC_POLICY_PROBE_BACKOFF 2048
#define SPEC_POLICY_BACKOFF_MARGIN 0.05
#define SPEC_POLICY_PROBE_STEPS 2
#define SPEC_POLICY_PROBE_SHARE 4

struct spec_policy;

/* A policy for up to max_seqs sequences per step and kmax drafts (0 .. SPEC_MAX_K) whose
 * MTP layers attend over `window` positions (0: all; then a cache counts as complete only
 * when it covers everything from position 0).  clock: the caller's time source, the one
 * its step_s and seconds are measured on (copied; NULL: the monotonic clock); the policy
 * reads no other (the gate's windows, the rest of a cycle, the wake-up after an idle
 * wait), so a caller that drives simulated time gets the same decisions on any machine.
 * -EINVAL, -ENOMEM. */
int spec_policy_new(enum spec_draft_policy mode, int max_seqs, int kmax, int window,
                    const struct clk_src *clock, struct spec_policy **ret);
void spec_policy_free(struct spec_policy *p);
/* The policy's clock now, in microseconds (p NULL: the monotonic clock): what the costs
 * reported to it are measured on. */
int64_t spec_policy_now_us(const struct spec_policy *p);

/* After the trunk step of plan p and the verification of its sequences (seqs[i] pairs
 * with p->seqs[i]; seqs[i].depth = the most drafts sequence i may get now, 0 for none):
 * records the step's cost (step_s: forward and verification, decode-only steps), then
 * lowers seqs[i].depth and p->seqs[i].mtp_depth to the policy's choice.  Returns whether
 * any sequence still runs the MTP chain (drafts or a fill). */
bool spec_policy_step(struct spec_policy *p, struct step_plan *plan, struct spec_seq *seqs, int n,
                      double step_s);

/* The engine had nothing to run and waited: the time until the next step is nobody's cost
 * (the gate's windows and the rest of a cycle are measured over busy time only). */
void spec_policy_idle(struct spec_policy *p);

/* spec_propose's report: MTP depth k took `seconds` for m sequences, `fill` if a fill-only
 * chain ran in it too (the cost is then not a draft's). */
void spec_policy_draft_cost(struct spec_policy *p, int k, int m, bool fill, double seconds);


/* What the adaptive policy did, per batch-size bucket b (the gate's: 2^b .. 2^(b+1) - 1
 * decoding sequences), counted over the decode steps it chose depths for: those in which
 * any sequence drafted (probes included), the probe steps, and the gate's measured
 * ratio of the two arms.  Load-independent in what it counts (decisions, not seconds):
 * with `better` the arm the bucket's own pairs measured faster, drafted / cycles (or its
 * complement) is the share of the steps run in the arm found better. */
#define SPEC_POLICY_BUCKETS 8
struct spec_policy_bucket {
    uint64_t cycles;            /* decode steps with candidates, in this bucket */
    uint64_t drafted;           /* ... in which some sequence drafted */
    uint64_t probe_steps;       /* ... that ran a probe's depths */
    uint32_t pairs;             /* adjacent window pairs measured (0: lq means nothing) */
    double lq;                  /* the median of the last pairs: log(rate without drafts /
                                   rate with); < 0: drafting measured faster */
};
struct spec_policy_stats {
    uint64_t decisions, probes, gate_switches;
    struct spec_policy_bucket b[SPEC_POLICY_BUCKETS];
};

/* The counts above (zeroes for NULL or the fixed policy). */
void spec_policy_stats(const struct spec_policy *p, struct spec_policy_stats *ret);

/* Diagnostics and tests: the policy's estimate of the next-step rate (tokens/s) of B
 * sequences that all get d drafts at first-position acceptance a (later positions at the
 * engine-wide rates); 0 when nothing is measured yet. */
double spec_policy_rate(const struct spec_policy *p, int B, int d);

#ifdef __cplusplus
}
#endif
