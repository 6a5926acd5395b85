/* chunk.h - what a request's output looks like to every front door (req.c produces it):
 * the door-neutral chunk (one engine message's worth of output, through the text pipeline)
 * and the final (how the request ended, with its usage, timings and MTP statistics).  The
 * gRPC door (grpc-door.c) renders them as GenerateResponse messages, the HTTP doors
 * (openai-render.c, door.c) as JSON; none of them sees the engine's message types.
 *
 * Everything a chunk or final points to is borrowed for the duration of the door's call
 * (struct req_client_ops). */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One tool call's delta: the first names the call (id "call_...", the function), the
 * others carry only arguments (id and name ""). */
struct chunk_tool {
    uint32_t index;                 /* the call's index within the request */
    const char *id;
    const char *name;
    const char *arguments;          /* the arguments' JSON text to append */
};

struct chunk_top {
    int32_t token_id;
    float logprob;
};

/* One output token's logprob and the top alternatives (as many as the request asked). */
struct chunk_logprob {
    int32_t token_id;
    float logprob;
    size_t n_top;
    const struct chunk_top *top;
};

struct chunk {
    const int32_t *token_ids;       /* the new tokens (token input, or ids asked for) */
    size_t n_token_ids;
    const char *text;               /* new detokenized text ("" when none) */
    const char *reasoning;          /* parsed reasoning text (chat) */
    const char *content;            /* parsed answer text (chat) */
    const struct chunk_tool *tools;
    size_t n_tools;
    const struct chunk_logprob *logprobs;
    size_t n_logprobs;
    bool has_usage;                 /* continuous usage statistics asked for */
    uint32_t prompt_tokens, completion_tokens;  /* has_usage: so far */
};

/* How a request ended (the same numbers as the protocol's FinishReason). */
enum chunk_finish {
    CHUNK_FINISH_UNSPECIFIED = 0,
    CHUNK_FINISH_STOP = 1,          /* end of turn, a stop token or string */
    CHUNK_FINISH_LENGTH = 2,        /* the token limit */
    CHUNK_FINISH_ABORT = 3,
    CHUNK_FINISH_ERROR = 4,
};

enum chunk_stop {
    CHUNK_STOP_NONE,
    CHUNK_STOP_TOKEN,               /* stop_token_id ended it */
    CHUNK_STOP_STRING,              /* stop_string ended it */
};

/* The usage and timing fields of a chunk_final, named alike in the wire's Usage and Timings
 * (X(name) each: a door copies them field by field). */
#define CHUNK_USAGE_FIELDS(X) X(prompt_tokens) X(completion_tokens) X(cached_tokens) X(reasoning_tokens)
#define CHUNK_TIMING_FIELDS(X) X(queue_s) X(prefill_s) X(first_token_s) X(decode_s) X(mean_inter_token_s) X(e2e_s)
#define CHUNK_MTP_FIELDS(X) X(num_drafts) X(num_draft_tokens) X(num_accepted_tokens)

struct chunk_final {
    enum chunk_finish finish;
    const char *message;            /* the engine's detail ("" when none) */
    enum chunk_stop stop;
    int32_t stop_token_id;
    const char *stop_string;
    uint32_t prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens;   /* CHUNK_USAGE_FIELDS */
    /* timings, seconds (CHUNK_TIMING_FIELDS) */
    double queue_s, prefill_s, first_token_s, decode_s, mean_inter_token_s, e2e_s;
    /* MTP: verification steps with drafts, drafts, accepted; per draft position, and the
     * decode steps by the number of drafts they verified */
    uint32_t num_drafts, num_draft_tokens, num_accepted_tokens;
    const uint32_t *accepted_per_position;
    size_t n_accepted_per_position;
    const uint32_t *steps_by_num_drafts;
    size_t n_steps_by_num_drafts;
    const char *group;              /* the worker group that served it */
    const char *request_id;
};
