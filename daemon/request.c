/* request.c - struct request: life, and the gRPC door's conversion (see request.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "media.h"
#include "pb-util.h"
#include "request.h"
#include "stepd.pb-c.h"

const char *const request_names_grpc[_RN_MAX] = {
    [RN_REQUEST_ID] = "request_id",
    [RN_MODEL] = "model",
    [RN_TEXT] = "text",
    [RN_MESSAGES] = "chat.messages",
    [RN_TOOLS] = "chat.tools_json",
    [RN_CHAT_TEMPLATE_KWARGS] = "chat.chat_template_kwargs_json",
    [RN_REASONING_EFFORT] = "chat.reasoning_effort",
    [RN_TOKEN_IDS] = "token_ids.ids",
    [RN_TEMPERATURE] = "sampling_params.temperature",
    [RN_TOP_P] = "sampling_params.top_p",
    [RN_TOP_K] = "sampling_params.top_k",
    [RN_MIN_P] = "sampling_params.min_p",
    [RN_REPETITION_PENALTY] = "sampling_params.repetition_penalty",
    [RN_PRESENCE_PENALTY] = "sampling_params.presence_penalty",
    [RN_FREQUENCY_PENALTY] = "sampling_params.frequency_penalty",
    [RN_MAX_TOKENS] = "sampling_params.max_tokens",
    [RN_MIN_TOKENS] = "sampling_params.min_tokens",
    [RN_SEED] = "sampling_params.seed",
    [RN_LOGPROBS] = "sampling_params.logprobs",
    [RN_N] = "sampling_params.n",
    [RN_STOP] = "sampling_params.stop",
    [RN_STOP_TOKEN_IDS] = "sampling_params.stop_token_ids",
    [RN_LOGIT_BIAS] = "sampling_params.logit_bias",
    [RN_NUM_SPECULATIVE_TOKENS] = "num_speculative_tokens",
    [RN_CACHE_SALT] = "cache_salt",
    [RN_TOOL_CHOICE] = "tool_choice",
    [RN_INPUT] = "input: one of text, chat or token_ids",
};

struct request *request_new(const char *const *names)
{
    struct request *in = calloc(1, sizeof(*in));

    if (!in)
        return NULL;
    in->model = strdup("");
    in->cache_salt = strdup("");
    if (!in->model || !in->cache_salt) {
        free(in->model);
        free(in->cache_salt);
        free(in);
        return NULL;
    }
    in->add_generation_prompt = true;
    in->so_start = -1;
    in->names = names;
    in->refs = 1;
    return in;
}

void request_free(struct request *in)
{
    if (!in || --in->refs > 0)
        return;
    media_images_free(in);
    free(in->model);
    free(in->cache_salt);
    free(in->so_text);
    free(in->text);
    json_decref(in->messages);
    json_decref(in->tools);
    json_decref(in->chat_template_kwargs);
    free(in->reasoning_effort);
    free(in->tool_choice_name);
    free(in->token_ids);
    for (size_t i = 0; i < in->sp.n_stop; i++)
        free(in->sp.stop[i]);
    free(in->sp.stop);
    free(in->sp.stop_token_ids);
    free(in->sp.logit_bias);
    free(in);
}

/* Grow *arr (elements of size sz) to hold n + 1. */
static int grow(void *arr, size_t n, size_t sz)
{
    void **p = arr;
    void *np;

    if (n & (n - 1))        /* capacity is the next power of two above n */
        return 0;
    np = realloc(*p, (n ? 2 * n : 1) * sz);
    if (!np)
        return -ENOMEM;
    *p = np;
    return 0;
}

int request_add_stop(struct request_sampling *sp, const char *s, size_t len)
{
    char *c;

    if (grow(&sp->stop, sp->n_stop, sizeof(*sp->stop)) < 0 || !(c = strndup(s, len)))
        return -ENOMEM;
    sp->stop[sp->n_stop++] = c;
    return 0;
}

int request_add_stop_id(struct request_sampling *sp, int32_t id)
{
    if (grow(&sp->stop_token_ids, sp->n_stop_token_ids, sizeof(*sp->stop_token_ids)) < 0)
        return -ENOMEM;
    sp->stop_token_ids[sp->n_stop_token_ids++] = id;
    return 0;
}

int request_tool_choice_string(const json_t *tc, const char *named, struct request *in, char *msg, size_t len)
{
    static const char *const words[] = { [REQUEST_TOOLS_AUTO] = "auto", [REQUEST_TOOLS_NONE] = "none",
                                         [REQUEST_TOOLS_REQUIRED] = "required" };
    const char *s = json_string_value(tc);

    if (!s)
        return 0;
    for (size_t i = 0; i < sizeof(words) / sizeof(words[0]); i++)
        if (!strcmp(s, words[i])) {
            in->tool_choice = (enum request_tool_choice)i;
            return 1;
        }
    snprintf(msg, len, "tool_choice: must be \"none\", \"auto\", \"required\" or %s (got \"%.32s\")", named, s);
    return -EINVAL;
}

int request_add_logit_bias(struct request_sampling *sp, int32_t id, float bias)
{
    if (grow(&sp->logit_bias, sp->n_logit_bias, sizeof(*sp->logit_bias)) < 0)
        return -ENOMEM;
    sp->logit_bias[sp->n_logit_bias++] = (struct request_logit_bias){ id, bias };
    return 0;
}

/* The sampling scalars that are the same field in struct request_sampling and in the
 * proto's SamplingParams: X(presence bit, field). */
#define SAMPLING_SCALARS(X) \
    X(RO_TEMPERATURE, temperature) X(RO_TOP_P, top_p) X(RO_TOP_K, top_k) X(RO_MIN_P, min_p) \
    X(RO_REPETITION_PENALTY, repetition_penalty) X(RO_PRESENCE_PENALTY, presence_penalty) \
    X(RO_FREQUENCY_PENALTY, frequency_penalty) X(RO_MAX_TOKENS, max_tokens) \
    X(RO_MIN_TOKENS, min_tokens) X(RO_SEED, seed) X(RO_LOGPROBS, logprobs) \
    X(RO_IGNORE_EOS, ignore_eos) X(RO_N, n) X(RO_SKIP_SPECIAL_TOKENS, skip_special_tokens)

/* ------------------------------------------------------------------ to the engine */

int engine_sampling_build(const struct request_sampling *sp, struct engine_sampling *es,
                          Stepd__V1__SamplingParams *p)
{
    Stepd__V1__SamplingParams__LogitBiasEntry *ent = NULL, **pent = NULL;

    es->entries = es->pentries = NULL;
    stepd__v1__sampling_params__init(p);
#define OPT(o, f) if (REQUEST_HAS(sp, o)) PB_SET(p, f, sp->f);
    SAMPLING_SCALARS(OPT)
#undef OPT
    if (REQUEST_HAS(sp, RO_INCLUDE_STOP_STR))
        PB_SET(p, include_stop_str_in_output, sp->include_stop_str);
    p->n_stop_token_ids = sp->n_stop_token_ids;
    p->stop_token_ids = sp->stop_token_ids;
    if (sp->n_logit_bias) {
        ent = calloc(sp->n_logit_bias, sizeof(*ent));
        pent = calloc(sp->n_logit_bias, sizeof(*pent));
        if (!ent || !pent) {
            free(ent);
            free(pent);
            return -ENOMEM;
        }
        for (size_t i = 0; i < sp->n_logit_bias; i++) {
            stepd__v1__sampling_params__logit_bias_entry__init(&ent[i]);
            ent[i].key = sp->logit_bias[i].id;
            ent[i].value = sp->logit_bias[i].bias;
            pent[i] = &ent[i];
        }
        p->n_logit_bias = sp->n_logit_bias;
        p->logit_bias = pent;
    }
    es->entries = ent;
    es->pentries = (void **)pent;
    return 0;
}

void engine_sampling_done(struct engine_sampling *es)
{
    free(es->entries);
    free(es->pentries);
    es->entries = es->pentries = NULL;
}

/* ------------------------------------------------------------------ from the proto */

static int sampling_from_proto(const Stepd__V1__SamplingParams *p, struct request_sampling *sp)
{
    if (!p)
        return 0;
#define OPT(o, f) if (PB_HAS(p, f)) REQUEST_SET(sp, o, f, p->f);
    SAMPLING_SCALARS(OPT)
#undef OPT
    if (PB_HAS(p, include_stop_str_in_output))
        REQUEST_SET(sp, RO_INCLUDE_STOP_STR, include_stop_str, p->include_stop_str_in_output);
    for (size_t i = 0; i < p->n_stop; i++)
        if (request_add_stop(sp, p->stop[i], strlen(p->stop[i])) < 0)
            return -ENOMEM;
    for (size_t i = 0; i < p->n_stop_token_ids; i++)
        if (request_add_stop_id(sp, p->stop_token_ids[i]) < 0)
            return -ENOMEM;
    for (size_t i = 0; i < p->n_logit_bias; i++)
        if (request_add_logit_bias(sp, p->logit_bias[i]->key, p->logit_bias[i]->value) < 0)
            return -ENOMEM;
    return 0;
}

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

static int set_str(json_t *o, const char *key, const char *v)
{
    return json_object_set_new(o, key, json_string(v)) < 0 ? -ENOMEM : 0;
}

/* One proto ChatMessage as its OpenAI-style JSON object. */
static int message_from_proto(const Stepd__V1__ChatMessage *m, size_t mi, json_t **ret, char *msg,
                              size_t len)
{
    json_t *o = json_object();
    int r = o ? 0 : -ENOMEM;

    r = r ? r : set_str(o, "role", m->role);
    r = r ? r : set_str(o, "content", m->content);
    if (!r && m->reasoning_content[0])
        r = set_str(o, "reasoning_content", m->reasoning_content);
    if (!r && m->name[0])
        r = set_str(o, "name", m->name);
    if (!r && m->tool_call_id[0])
        r = set_str(o, "tool_call_id", m->tool_call_id);
    if (!r && m->n_tool_calls) {
        json_t *arr = json_array();

        r = arr && json_object_set_new(o, "tool_calls", arr) == 0 ? 0 : -ENOMEM;
        for (size_t k = 0; k < m->n_tool_calls && !r; k++) {
            const Stepd__V1__ToolCall *tc = m->tool_calls[k];
            json_t *args = tc->arguments_json[0] ? json_loads(tc->arguments_json, JSON_REJECT_DUPLICATES, NULL)
                                                  : json_object();
            json_t *call;

            if (!args || !json_is_object(args)) {
                json_decref(args);
                json_decref(o);
                BAD("chat.messages[%zu].tool_calls[%zu].arguments_json: must be a JSON object", mi, k);
            }
            call = json_pack("{s:s, s:s, s:{s:s, s:o}}", "id", tc->id,
                             "type", tc->type[0] ? tc->type : "function", "function",
                             "name", tc->name, "arguments", args);
            r = call && json_array_append_new(arr, call) == 0 ? 0 : -ENOMEM;
        }
    }
    if (r < 0) {
        json_decref(o);
        snprintf(msg, len, "chat.messages[%zu]: out of memory", mi);
        return r;
    }
    *ret = o;
    return 0;
}

/* A JSON document given as text in a proto string field: NULL for "", else parsed (kind
 * checked by validate.c, which names the field). */
static int json_field(const char *text, const char *field, json_t **ret, char *msg, size_t len)
{
    json_error_t je;

    *ret = NULL;
    if (!text[0])
        return 0;
    *ret = json_loads(text, JSON_REJECT_DUPLICATES, &je);
    if (!*ret)
        BAD("%s: not valid JSON (%s at offset %d)", field, je.text, je.position);
    return 0;
}

static int chat_from_proto(const Stepd__V1__ChatInput *c, struct request *in, char *msg, size_t len)
{
    int r;

    in->messages = json_array();
    if (!in->messages)
        return -ENOMEM;
    for (size_t i = 0; i < c->n_messages; i++) {
        json_t *m;

        r = message_from_proto(c->messages[i], i, &m, msg, len);
        if (r < 0)
            return r;
        if (json_array_append_new(in->messages, m) < 0)
            return -ENOMEM;
    }
    if ((r = json_field(c->tools_json, "chat.tools_json", &in->tools, msg, len)) < 0 ||
        (r = json_field(c->chat_template_kwargs_json, "chat.chat_template_kwargs_json",
                        &in->chat_template_kwargs, msg, len)) < 0)
        return r;
    if (PB_HAS(c, reasoning_effort) && !(in->reasoning_effort = strdup(c->reasoning_effort)))
        return -ENOMEM;
    if (PB_HAS(c, add_generation_prompt))
        in->add_generation_prompt = c->add_generation_prompt;
    return 0;
}

/* The end of a conversion from protobuf: r == 0 hands in to *ret; otherwise in is freed and
 * r returned (msg says "out of memory" for -ENOMEM, else the conversion has written it). */
static int request_conv_end(struct request *in, int r, struct request **ret, char *msg,
                            size_t len)
{
    if (r < 0) {
        if (r == -ENOMEM)
            snprintf(msg, len, "out of memory");
        request_free(in);
        return r;
    }
    *ret = in;
    return 0;
}

int request_from_proto_chat(const Stepd__V1__ChatInput *chat, struct request **ret, char *msg,
                            size_t len)
{
    struct request *in = request_new(request_names_grpc);
    int r = in ? 0 : -ENOMEM;

    if (r == 0) {
        in->input = REQUEST_INPUT_CHAT;
        r = chat_from_proto(chat, in, msg, len);
    }
    return request_conv_end(in, r, ret, msg, len);
}

int request_from_proto(const Stepd__V1__GenerateRequest *pb, struct request **ret, char *msg,
                       size_t len)
{
    struct request *in = request_new(request_names_grpc);
    int r = in ? 0 : -ENOMEM;

    if (r == 0 && strlen(pb->request_id) >= sizeof(in->id)) {
        snprintf(msg, len, "request_id: at most 128 printable ASCII characters without spaces");
        r = -EINVAL;
    }
    if (r == 0) {
        snprintf(in->id, sizeof(in->id), "%s", pb->request_id);
        free(in->model);
        in->model = strdup(pb->model);
        r = in->model ? 0 : -ENOMEM;
    }
    if (r == 0) {
        switch (pb->input_case) {
        case STEPD__V1__GENERATE_REQUEST__INPUT_TEXT:
            in->input = REQUEST_INPUT_TEXT;
            in->text = strdup(pb->text);
            r = in->text ? 0 : -ENOMEM;
            break;
        case STEPD__V1__GENERATE_REQUEST__INPUT_CHAT:
            in->input = REQUEST_INPUT_CHAT;
            r = chat_from_proto(pb->chat, in, msg, len);
            break;
        case STEPD__V1__GENERATE_REQUEST__INPUT_TOKEN_IDS:
            in->input = REQUEST_INPUT_TOKENS;
            in->n_token_ids = pb->token_ids->n_ids;
            in->token_ids = malloc((in->n_token_ids ? in->n_token_ids : 1) * sizeof(int32_t));
            if (!in->token_ids)
                r = -ENOMEM;
            else if (in->n_token_ids)
                memcpy(in->token_ids, pb->token_ids->ids, in->n_token_ids * sizeof(int32_t));
            break;
        default:
            in->input = REQUEST_INPUT_NONE;
            break;
        }
    }
    r = r ? r : sampling_from_proto(pb->sampling_params, &in->sp);
    if (r == 0) {
        in->priority = pb->priority;
        in->has_num_speculative_tokens = PB_HAS(pb, num_speculative_tokens);
        in->num_speculative_tokens = pb->num_speculative_tokens;
        free(in->cache_salt);
        in->cache_salt = strdup(pb->cache_salt);
        if (!in->cache_salt)
            r = -ENOMEM;
        in->continuous_usage_stats = pb->stream_options && pb->stream_options->continuous_usage_stats;
        in->include_token_ids = pb->stream_options && pb->stream_options->include_token_ids;
    }
    if (r == 0 && (r = request_structured_from_proto(pb->structured_output, in, msg, len)) < 0) {
        request_free(in);
        return r;
    }
    return request_conv_end(in, r, ret, msg, len);
}
