/* sampler.h - token selection on rank 0: logits processors, seeded sampling and the
 * rejection-sampling verifier of speculative decoding.
 *
 * The processors run in a fixed order on a copy of one logits row: min-tokens ban, logit bias,
 * repetition penalty (prompt + output, HF/vLLM semantics), presence and frequency
 * penalties (output only, OpenAI semantics), the grammar's allowed-token mask, then temperature,
 * min-p, top-k and top-p turn it into a probability vector (on the unnormalised weights
 * expf((x - max) / T), normalised last, so that a row's candidates give the same draw:
 * sampler_sample_cands).  temperature == 0 is greedy: the processed argmax
 * (lowest id on ties).  Randomness is counter-based: every draw is a pure function of
 * (seed, output index, stream), so a request gives the same tokens whatever else is in
 * the batch, and after a preemption.
 */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct sampler_bias {
    int32_t token;
    float bias;
};

struct sampling_params {
    float temperature;        /* 0 = greedy */
    int top_k;                /* <= 0 = off */
    float top_p;              /* (0, 1]; 1 = off */
    float min_p;              /* [0, 1]; 0 = off */
    float repetition_penalty; /* > 0; 1 = off */
    float presence_penalty;   /* [-2, 2] */
    float frequency_penalty;  /* [-2, 2] */
    uint64_t seed;
    int n_logit_bias;
    const struct sampler_bias *logit_bias; /* borrowed; [n_logit_bias] */
    /* min_tokens: while fewer outputs than this exist, the ids in ban[] (EOS and stop
     * ids) get -inf, as vLLM's MinTokensLogitsProcessor does */
    int min_tokens;
    int n_ban;
    const int32_t *ban;                    /* borrowed; [n_ban] */
    /* structured output: a bitmask of the tokens the grammar allows now (bit t of word
     * t/32, vocab bits; NULL = all).  The others get -inf after every other processor,
     * greedy and sampled alike.  Set by spec_verify around each draw (spec.h). */
    const uint32_t *allow;
};

/* Defaults: greedy, every processor off, seed 0. */
void sampling_params_init(struct sampling_params *sp);
/* Validate ranges against vocab; on error returns -EINVAL and writes the bad field's
 * name (e.g. "top_p") to *ret_field. */
int sampling_params_check(const struct sampling_params *sp, int vocab, const char **ret_field);
static inline bool sampling_params_greedy(const struct sampling_params *sp)
{
    return sp->temperature <= 0.0f;
}

/* Scratch for one thread: vocab-sized buffers, reused by every call. */
struct sampler;
int sampler_new(int vocab, struct sampler **ret);
void sampler_free(struct sampler *s);

/* Token history seen by the penalties: prompt then output. */
struct sampler_hist {
    const int32_t *tokens;
    int n_prompt;
    int n_output;
};

/* Processed probability distribution for one row into probs[vocab] (greedy: a one-hot
 * on the argmax).  logits is not modified. */
void sampler_probs(struct sampler *s, const struct sampling_params *sp,
                   const struct sampler_hist *h, const float *logits, float *probs);
/* Log-probabilities of one row into out[vocab].  Raw (processed false): log_softmax of the
 * logits as the model gave them, before any processor (vLLM's raw_logprobs).  Processed: of
 * the distribution sampler_probs draws from (after the ban, bias, penalties, temperature and
 * top-k/top-p/min-p; -inf outside the kept set); greedy, which draws from none: of the
 * logits after the ban, bias and penalties.  logits is not modified. */
void sampler_logprobs(struct sampler *s, const struct sampling_params *sp,
                      const struct sampler_hist *h, const float *logits, bool processed, float *out);
/* Pick a token: greedy argmax, or a draw from the processed distribution with the
 * uniform u(seed, index, stream). */
int32_t sampler_sample(struct sampler *s, const struct sampling_params *sp,
                       const struct sampler_hist *h, const float *logits, uint64_t index,
                       uint32_t stream);
/* Whether sampler_sample's choice for a row is the row's raw argmax (sampler_argmax): greedy
 * with no logit bias, no penalty, no min_tokens ban in force after n_output outputs (nor
 * after more) and no grammar mask (sp->allow).  Such a row's token can be chosen where the
 * logits are (forward.h, step_argmax) without copying the row. */
bool sampler_takes_argmax(const struct sampling_params *sp, int n_output);
/* The sampled form of a step (forward.h, step_topk): a row reduced where it was computed to
 * its k best logits, in backend_argmax's order (decreasing value, equal values by
 * increasing id; ids[j] = -1 past the row's non-NaN elements), and sum, the row's
 * sum over every id in id order of expf((x - vals[0]) / temperature) in double, as
 * sampler_probs adds its weights (read only when top_p < 1).  At most SAMPLER_CANDS_MAX. */
#define SAMPLER_CANDS_MAX 64
struct sampler_cands {
    int k;
    const float *vals;      /* [k] */
    const int32_t *ids;     /* [k] */
    double sum;
};
/* Whether sampler_sample's choice for a row can be made from its k_max best logits with
 * the same result (sampler_sample_cands): sampler_takes_argmax, or sampled with top_k in
 * 1 .. k_max (and below vocab) and no processor before the distribution (logit bias,
 * penalties, a min_tokens ban in force after n_output outputs, a grammar mask): those act
 * on every logit before the truncation, so such a row needs its whole row.  Temperature,
 * top_p and min_p act after the softmax on what top-k keeps (top_p on the whole row's
 * mass: sampler_cands.sum). */
bool sampler_takes_cands(const struct sampling_params *sp, int n_output, int vocab, int k_max);
/* sampler_sample of a row that sampler_takes_cands from its candidates c (c->k >= top_k):
 * the same token for the same (seed, index, stream), the same arithmetic on the same
 * values (sampler_probs ranks by the logit, then the id, as the candidates come). */
int32_t sampler_sample_cands(const struct sampling_params *sp, const struct sampler_cands *c,
                             uint64_t index, uint32_t stream);
/* The k best of x[0 .. n) in backend_argmax's order (kernels/backend.h: larger value first,
 * equal values by lower index, -0.0 equal to +0.0, NaN never; places past the non-NaN
 * elements id -1 and NaN, an all-NaN row's place 0 id 0), on the host. */
void sampler_top_k(const float *x, int n, int k, int32_t *ids, float *vals);
/* Lowest index of the largest value (greedy choice on raw logits). */
int32_t sampler_argmax(const float *x, int n);
/* Draw from an explicit distribution (probs sum to ~1) with uniform u in [0, 1). */
int32_t sampler_draw(const float *probs, int vocab, double u);
/* The counter-based uniform in [0, 1). */
double sampler_uniform(uint64_t seed, uint64_t index, uint32_t stream);

/* Rejection-sampling verification of n_draft draft tokens (Leviathan et al. 2023).
 * p[i] (i = 0 .. n_draft) are the target distributions after each prefix, q[i]
 * (i < n_draft) the distributions the drafts were drawn from.  Accept draft i with
 * probability min(1, p_i(d)/q_i(d)); at the first rejection draw the replacement from
 * norm(max(0, p_i - q_i)); if all are accepted draw a bonus token from p[n_draft].
 * Uniforms come from (seed, index0 + i, stream).  Returns the number accepted and the
 * token that follows them in *ret_next.  The emitted tokens are distributed exactly as
 * if drawn from p one by one.  tmp is vocab floats of scratch. */
int sampler_verify(const float *const *p, const float *const *q, const int32_t *drafts,
                   int n_draft, int vocab, uint64_t seed, uint64_t index0, float *tmp,
                   int32_t *ret_next);

/* Streams for sampler_uniform. */
enum sampler_stream {
    SAMPLER_STREAM_TOKEN = 0,   /* plain sampling of the next token */
    SAMPLER_STREAM_ACCEPT = 1,  /* accept/reject coin of a draft */
    SAMPLER_STREAM_RESID = 2,   /* residual or bonus draw after verification */
    SAMPLER_STREAM_DRAFT = 3,   /* draft proposal (index + depth) */
};

#ifdef __cplusplus
}
#endif
