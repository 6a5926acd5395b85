/* chat.c - adapter from the proto ChatInput to common/tok's Step-3.7 chat template
 * (tok_chat_render, MODEL.md §7): builds the OpenAI-style JSON messages and tools
 * the renderer takes. Errors name the proto field. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "chat.h"
#include "coord-int.h"
#include "pb-util.h"

static json_t *message_json(const Stepd__V1__ChatMessage *m, size_t mi, char *msg, size_t len)
{
    json_t *o = json_object();
    if (!o)
        return NULL;
    json_object_set_new(o, "role", json_string(m->role));
    json_object_set_new(o, "content", json_string(m->content));
    if (m->reasoning_content[0])
        json_object_set_new(o, "reasoning_content", json_string(m->reasoning_content));
    if (m->name[0])
        json_object_set_new(o, "name", json_string(m->name));
    if (m->tool_call_id[0])
        json_object_set_new(o, "tool_call_id", json_string(m->tool_call_id));
    if (m->n_tool_calls) {
        json_t *arr = json_array();
        for (size_t k = 0; k < m->n_tool_calls; k++) {
            const Stepd__V1__ToolCall *tc = m->tool_calls[k];
            json_t *args;
            if (tc->arguments_json[0]) {
                json_error_t je;
                args = json_loads(tc->arguments_json, JSON_REJECT_DUPLICATES, &je);
                if (!args || !json_is_object(args)) {
                    json_decref(args);
                    json_decref(arr);
                    json_decref(o);
                    snprintf(msg, len, "chat.messages[%zu].tool_calls[%zu].arguments_json: not a JSON object (%s)",
                             mi, k, je.text);
                    return NULL;
                }
            } else {
                args = json_object();
            }
            if (!tc->name[0]) {
                json_decref(args);
                json_decref(arr);
                json_decref(o);
                snprintf(msg, len, "chat.messages[%zu].tool_calls[%zu].name: required", mi, k);
                return NULL;
            }
            json_t *fn = json_pack("{s:s, s:o}", "name", tc->name, "arguments", args);
            json_t *call = json_pack("{s:s, s:s, s:o}", "id", tc->id, "type", tc->type[0] ? tc->type : "function",
                                     "function", fn);
            json_array_append_new(arr, call);
        }
        json_object_set_new(o, "tool_calls", arr);
    }
    return o;
}

int coord_chat_render(struct coord *co, const Stepd__V1__ChatInput *chat, char **ret, char *msg, size_t len)
{
    json_t *msgs = json_array(), *tools = NULL;
    struct tok_chat_opts opts = { 0 };
    struct err_buf eb;
    int r = -EINVAL;

    if (!msgs) {
        snprintf(msg, len, "chat: out of memory");
        return -ENOMEM;
    }
    if (chat->n_messages == 0) {
        snprintf(msg, len, "chat.messages: at least one message is required");
        goto cleanup;
    }
    for (size_t i = 0; i < chat->n_messages; i++) {
        json_t *m = message_json(chat->messages[i], i, msg, len);
        if (!m)
            goto cleanup;
        json_array_append_new(msgs, m);
    }
    if (chat->tools_json[0]) {
        json_error_t je;
        tools = json_loads(chat->tools_json, JSON_REJECT_DUPLICATES, &je);
        if (!tools || !json_is_array(tools)) {
            snprintf(msg, len, "chat.tools_json: not a JSON array (%s)", tools ? "wrong type" : je.text);
            goto cleanup;
        }
    }
    int32_t bos = co->tok ? tok_bos_id(co->tok) : -1;
    opts.bos_token = bos >= 0 ? tok_id_to_token(co->tok, bos) : NULL;
    opts.reasoning_effort = PB_HAS(chat, reasoning_effort) ? chat->reasoning_effort : NULL;
    opts.add_generation_prompt = !PB_HAS(chat, add_generation_prompt) || chat->add_generation_prompt;
    r = tok_chat_render(msgs, tools, &opts, ret, NULL, &eb);
    if (r < 0)
        snprintf(msg, len, "chat: %.700s", eb.msg);
cleanup:
    json_decref(msgs);
    json_decref(tools);
    return r;
}
