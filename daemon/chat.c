/* chat.c - a request's chat input rendered with the Step-3.7 chat template
 * (common/tok/chat.h, docs/MODEL.md §7); tool_choice "required" or a named function ends the
 * prompt with the reasoning closed and a tool call opened (coord_chat_forced_prefix), so
 * the model cannot answer otherwise.  The template's own variables come from the request
 * (reasoning_effort, add_generation_prompt) and from chat_template_kwargs, which may set
 * reasoning_effort, preserve_thinking and add_generation_prompt (over the operator's
 * --default-chat-template-kwargs); other keys are ignored, as an unused Jinja variable is.  Errors name the field as the client wrote it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* chat_template_kwargs' keys that the template reads, onto opts (`name`: the field as the
 * client, or the flag as the operator, wrote it; effort_set: the request's own
 * reasoning_effort, which wins). */
static int kwargs_apply(const json_t *kw, const char *name, bool effort_set, struct tok_chat_opts *opts,
                        char *msg, size_t len)
{
    const json_t *v;

    if (!kw)
        return 0;
    if (!json_is_object(kw))
        BAD("%s: must be a JSON object", name);
    if ((v = json_object_get(kw, "reasoning_effort")) && !json_is_null(v)) {
        if (!json_is_string(v))
            BAD("%s.reasoning_effort: must be a string", name);
        if (!effort_set)                /* the request's own field wins */
            opts->reasoning_effort = json_string_value(v);
    }
    if ((v = json_object_get(kw, "preserve_thinking")) && !json_is_null(v)) {
        if (!json_is_boolean(v))
            BAD("%s.preserve_thinking: must be true or false", name);
        opts->preserve_thinking = json_is_true(v);
    }
    if ((v = json_object_get(kw, "add_generation_prompt")) && !json_is_null(v)) {
        if (!json_is_boolean(v))
            BAD("%s.add_generation_prompt: must be true or false", name);
        opts->add_generation_prompt = json_is_true(v);
    }
    return 0;
}

int coord_chat_kwargs_check(const char *json, char *msg, size_t len)
{
    struct tok_chat_opts opts = { 0 };
    json_error_t je;
    json_t *kw = json_loads(json, 0, &je);
    int r;

    if (!kw) {
        snprintf(msg, len, "invalid JSON at column %d: %s", je.column, je.text);
        return -EINVAL;
    }
    r = kwargs_apply(kw, "the defaults", false, &opts, msg, len);
    json_decref(kw);
    return r;
}

size_t coord_chat_forced_prefix(const struct request *in, char *buf, size_t len)
{
    int n = 0;

    if (in->input != REQUEST_INPUT_CHAT)
        return 0;
    if (in->tool_choice == REQUEST_TOOLS_REQUIRED)
        n = snprintf(buf, len, "</think>\n<tool_call>\n<function=");
    else if (in->tool_choice == REQUEST_TOOLS_NAMED)
        n = snprintf(buf, len, "</think>\n<tool_call>\n<function=%s>\n", in->tool_choice_name);
    return n > 0 && (size_t)n < len ? (size_t)n : 0;
}

int coord_chat_render(struct coord *co, const struct request *in, char **ret, char *msg, size_t len)
{
    struct tok_chat_opts opts = { 0 };
    struct err_buf eb;
    int32_t bos = tok_bos_id(co->tok);
    /* --default-chat-template-kwargs (checked at start-up), under the request's own; held
     * until the template is rendered (opts points into it) */
    json_t *def = co->o.default_chat_template_kwargs ? json_loads(co->o.default_chat_template_kwargs, 0, NULL)
                                                     : NULL;
    int r;

    opts.bos_token = bos >= 0 ? tok_id_to_token(co->tok, bos) : NULL;
    opts.reasoning_effort = in->reasoning_effort;
    opts.add_generation_prompt = in->add_generation_prompt;
    r = kwargs_apply(def, "--default-chat-template-kwargs", in->reasoning_effort != NULL, &opts, msg, len);
    if (r >= 0)
        r = kwargs_apply(in->chat_template_kwargs, in->names[RN_CHAT_TEMPLATE_KWARGS], in->reasoning_effort != NULL,
                         &opts, msg, len);
    if (r < 0) {
        json_decref(def);
        return r;
    }
    r = tok_chat_render(in->messages, in->tools, &opts, ret, NULL, &eb);
    json_decref(def);
    if (r == 0 && opts.add_generation_prompt) {
        char pre[128];
        size_t pl = coord_chat_forced_prefix(in, pre, sizeof(pre));

        if (pl) {
            size_t n = strlen(*ret);
            char *p = realloc(*ret, n + pl + 1);

            if (!p) {
                free(*ret);
                *ret = NULL;
                snprintf(msg, len, "chat template: out of memory");
                return -ENOMEM;
            }
            memcpy(p + n, pre, pl + 1);
            *ret = p;
        }
    }
    if (r == -EINVAL)
        snprintf(msg, len, "%s: %.700s", in->names[RN_MESSAGES], eb.msg);
    else if (r < 0)
        snprintf(msg, len, "chat template: %s", err_str(r));
    return r;
}
