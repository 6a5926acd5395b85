/* chat.c - a request's chat input rendered with the Step-3.7 chat template
 * (common/tok/chat.h, docs/MODEL.md §7); tool_choice "required" or a named function ends the
 * prompt with the reasoning closed and a tool call opened (coord_chat_forced_prefix), so
 * the model cannot answer otherwise.  The template's own variables come from the request
 * (reasoning_effort, add_generation_prompt) and from chat_template_kwargs, which may set
 * reasoning_effort, preserve_thinking and add_generation_prompt; other keys are ignored,
 * as an unused Jinja variable is.  Errors name the field as the client wrote it. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "coord-int.h"

#define BAD(...) do { snprintf(msg, len, __VA_ARGS__); return -EINVAL; } while (0)

/* chat_template_kwargs' keys that the template reads, onto opts. */
static int kwargs_apply(const struct request *in, struct tok_chat_opts *opts, char *msg, size_t len)
{
    const json_t *kw = in->chat_template_kwargs, *v;

    if (!kw)
        return 0;
    if ((v = json_object_get(kw, "reasoning_effort")) && !json_is_null(v)) {
        if (!json_is_string(v))
            BAD("%s.reasoning_effort: must be a string", in->names[RN_CHAT_TEMPLATE_KWARGS]);
        if (!in->reasoning_effort)      /* the request's own field wins */
            opts->reasoning_effort = json_string_value(v);
    }
    if ((v = json_object_get(kw, "preserve_thinking")) && !json_is_null(v)) {
        if (!json_is_boolean(v))
            BAD("%s.preserve_thinking: must be true or false", in->names[RN_CHAT_TEMPLATE_KWARGS]);
        opts->preserve_thinking = json_is_true(v);
    }
    if ((v = json_object_get(kw, "add_generation_prompt")) && !json_is_null(v)) {
        if (!json_is_boolean(v))
            BAD("%s.add_generation_prompt: must be true or false",
                in->names[RN_CHAT_TEMPLATE_KWARGS]);
        opts->add_generation_prompt = json_is_true(v);
    }
    return 0;
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
    int r;

    opts.bos_token = bos >= 0 ? tok_id_to_token(co->tok, bos) : NULL;
    opts.reasoning_effort = in->reasoning_effort;
    opts.add_generation_prompt = in->add_generation_prompt;
    r = kwargs_apply(in, &opts, msg, len);
    if (r < 0)
        return r;
    r = tok_chat_render(in->messages, in->tools, &opts, ret, NULL, &eb);
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
