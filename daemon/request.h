/* request.h - a generation request as the coordinator serves it, whichever front door it
 * came through: built once at the door (request_from_proto for Inference.Generate; the
 * HTTP API builds the same struct from JSON), validated once (validate.c), then owned by
 * the live request (struct req, req.c) until it ends.
 *
 * Chat input is kept as OpenAI-style JSON (an array of {role, content, reasoning_content,
 * tool_calls, tool_call_id, name} objects, the tools array, the template kwargs object):
 * the form the chat template renders from (common/tok/chat.h).  Sampling scalars are
 * optional: a field counts only where its bit is set in `set` (unset = server default).
 * Error messages name fields as the client wrote them: `names` is the door's table.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

/* The fields validation and the pipeline can name in a message. */
enum request_name {
    RN_REQUEST_ID,
    RN_MODEL,
    RN_TEXT,
    RN_MESSAGES,            /* prefix of "<messages>[i].role" etc. */
    RN_TOOLS,
    RN_CHAT_TEMPLATE_KWARGS,
    RN_REASONING_EFFORT,
    RN_TOKEN_IDS,
    RN_TEMPERATURE,
    RN_TOP_P,
    RN_TOP_K,
    RN_MIN_P,
    RN_REPETITION_PENALTY,
    RN_PRESENCE_PENALTY,
    RN_FREQUENCY_PENALTY,
    RN_MAX_TOKENS,
    RN_MIN_TOKENS,
    RN_SEED,
    RN_LOGPROBS,
    RN_N,
    RN_STOP,
    RN_STOP_TOKEN_IDS,
    RN_LOGIT_BIAS,
    RN_NUM_SPECULATIVE_TOKENS,
    RN_CACHE_SALT,
    RN_TOOL_CHOICE,
    RN_INPUT,               /* "one of ... is required" */
    _RN_MAX,
};

/* Presence bits of struct request_sampling (1u << f). */
enum request_opt {
    RO_TEMPERATURE,
    RO_TOP_P,
    RO_TOP_K,
    RO_MIN_P,
    RO_REPETITION_PENALTY,
    RO_PRESENCE_PENALTY,
    RO_FREQUENCY_PENALTY,
    RO_MAX_TOKENS,
    RO_MIN_TOKENS,
    RO_SEED,
    RO_LOGPROBS,
    RO_IGNORE_EOS,
    RO_N,
    RO_SKIP_SPECIAL_TOKENS,
    RO_INCLUDE_STOP_STR,
    _RO_MAX,
};

#define REQUEST_HAS(sp, o) (((sp)->set >> (o)) & 1u)
#define REQUEST_SET(sp, o, field, v) do { (sp)->field = (v); (sp)->set |= 1u << (o); } while (0)

struct request_logit_bias {
    int32_t id;
    float bias;
};

struct request_sampling {
    uint32_t set;                   /* 1u << enum request_opt */
    float temperature, top_p, min_p;
    float repetition_penalty, presence_penalty, frequency_penalty;
    int32_t top_k;                  /* 0 or -1 = disabled */
    int32_t logprobs;               /* set: the sampled token's logprob and the top-N */
    int32_t n;
    int64_t max_tokens, min_tokens, seed;
    bool ignore_eos, skip_special_tokens, include_stop_str;
    char **stop;                    /* stop strings (text and chat input) */
    size_t n_stop;
    int32_t *stop_token_ids;
    size_t n_stop_token_ids;
    struct request_logit_bias *logit_bias;
    size_t n_logit_bias;
};

/* What the model may do with the tools (OpenAI's tool_choice; the gRPC door: AUTO). */
enum request_tool_choice {
    REQUEST_TOOLS_AUTO,             /* the model decides; calls are parsed */
    REQUEST_TOOLS_NONE,             /* no calls parsed: the output is content */
    REQUEST_TOOLS_REQUIRED,         /* the prompt opens a call; the model names the function */
    REQUEST_TOOLS_NAMED,            /* the prompt opens a call of tool_choice_name */
};

enum request_input {
    REQUEST_INPUT_NONE,
    REQUEST_INPUT_TEXT,
    REQUEST_INPUT_CHAT,
    REQUEST_INPUT_TOKENS,
};

struct request {
    char id[136];                   /* the client's request_id ("" = server assigns) */
    char *model;                    /* "" = unset */
    enum request_input input;
    char *text;                     /* TEXT */
    json_t *messages;               /* CHAT: array (owned) */
    json_t *tools;                  /* CHAT: array or NULL (owned) */
    json_t *chat_template_kwargs;   /* CHAT: object or NULL (owned) */
    char *reasoning_effort;         /* CHAT: NULL = unset */
    bool add_generation_prompt;     /* CHAT: default true */
    enum request_tool_choice tool_choice;   /* CHAT */
    char *tool_choice_name;         /* CHAT, REQUEST_TOOLS_NAMED */
    bool single_tool_call;          /* CHAT: at most one tool call (parallel_tool_calls false) */
    int32_t *token_ids;             /* TOKENS */
    size_t n_token_ids;
    struct request_sampling sp;
    int32_t priority;               /* lower = earlier */
    bool has_num_speculative_tokens;
    int32_t num_speculative_tokens; /* MTP drafts for this request (0..3), when has_ */
    char *cache_salt;               /* prefix-cache isolation ("" = the deployment's only) */
    /* structured output (daemon/structured.c): NULL = free text; else "json_schema",
     * "json_object", "regex" or "lark" with its text, named so_field in messages */
    const char *so_kind;
    char *so_text;
    const char *so_field;
    int32_t so_start;               /* >= 0: constrained from the token after this id (a tool
                                       call the model opens under tool_choice auto) */
    bool continuous_usage_stats;
    bool include_token_ids;
    bool text_output;               /* TOKENS: detokenize the output too (the HTTP door) */
    struct image_prep *images;      /* CHAT: the prompt's images in order (daemon/media.c) */
    size_t n_images;
    const char *const *names;       /* [_RN_MAX]: the door's field names */
    unsigned refs;                  /* the n requests of one n > 1 ask share it */
};

/* The gRPC door's field names ("sampling_params.temperature", "chat.messages", ...). */
extern const char *const request_names_grpc[_RN_MAX];

struct request *request_new(const char *const *names);
/* Drop a reference (the last one frees). */
void request_free(struct request *in);
static inline struct request *request_ref(struct request *in)
{
    in->refs++;
    return in;
}
/* Add a stop string / stop id / bias entry (copied): 0 or -ENOMEM. */
int request_add_stop(struct request_sampling *sp, const char *s, size_t len);
int request_add_stop_id(struct request_sampling *sp, int32_t id);
int request_add_logit_bias(struct request_sampling *sp, int32_t id, float bias);
/* A door's tool_choice when it is a string: 1 with in->tool_choice set ("none", "auto",
 * "required"), -EINVAL with msg (named: the door's shape of a named choice, for the message),
 * or 0 when tc is no string (the door's to read). */
int request_tool_choice_string(const json_t *tc, const char *named, struct request *in, char *msg, size_t len);

/* The engine's SamplingParams for sp, in *ret (stop strings left out: the coordinator
 * applies them to the text).  es holds the arrays ret points into until
 * engine_sampling_done(es).  0 or -ENOMEM. */
struct engine_sampling {
    void *entries;                  /* the logit-bias map entries */
    void **pentries;
};
struct Stepd__V1__SamplingParams;
int engine_sampling_build(const struct request_sampling *sp, struct engine_sampling *es,
                          struct Stepd__V1__SamplingParams *ret);
void engine_sampling_done(struct engine_sampling *es);

/* Inference.Generate's message as a request (its strings and arrays copied; the chat
 * messages turned into their JSON form).  0, -ENOMEM, or -EINVAL with the field named in
 * msg (a tool call's arguments_json that is not a JSON object, ...). */
struct Stepd__V1__GenerateRequest;
int request_from_proto(const struct Stepd__V1__GenerateRequest *pb, struct request **ret,
                       char *msg, size_t len);
/* GenerateRequest.structured_output onto in (daemon/structured.c): 0 or -EINVAL naming the
 * field. */
struct Stepd__V1__StructuredOutput;
int request_structured_from_proto(const struct Stepd__V1__StructuredOutput *so, struct request *in,
                                  char *msg, size_t len);
/* A chat-only request from a proto ChatInput (Inference.Tokenize), the same way. */
struct Stepd__V1__ChatInput;
int request_from_proto_chat(const struct Stepd__V1__ChatInput *chat, struct request **ret,
                            char *msg, size_t len);
