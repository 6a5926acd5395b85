/* chat.h - the Step-3.7 chat template rendered in C, and Python-compatible JSON text.
 *
 * tok_chat_render() produces byte for byte what the Step-3.7 Jinja template (llama.cpp
 * models/templates/StepFun3.7-Flash.jinja, docs/MODEL.md §7; a copy is test/tok/data/
 * step37_chat_template.jinja) renders under transformers' chat-template environment
 * (trim_blocks, lstrip_blocks, tojson = json.dumps(ensure_ascii=False)) with a fromjson filter
 * (json.loads).  test/tok/check_template.py proves it on the conversation table.
 *
 * Messages are OpenAI-style JSON objects: role (system|user|assistant|tool), content (string,
 * null, {"text"|"value"}, or a list of {"type":"text"|"image",...} parts), name, and for
 * assistants reasoning_content and tool_calls ([{"function":{"name","arguments"}}], arguments
 * an object or a JSON string).  Roles the template does not know are skipped, as it does.
 */
#pragma once

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

struct tok_chat_opts {
    const char *bos_token;          /* rendered first; NULL renders nothing */
    const char *reasoning_effort;   /* "low"/"medium"/"high"...; NULL = not defined */
    bool add_generation_prompt;     /* end with "<|im_start|>assistant\n<think>\n" */
    bool preserve_thinking;         /* keep <think> blocks of older assistant turns */
};

/* Render messages (array) and tools (array or NULL).  Returns 0 and a malloc'd NUL-terminated
 * string in *ret_text (length in *ret_len if non-NULL), or -EINVAL with a message in e naming
 * the offending message or field, or -ENOMEM. */
int tok_chat_render(const json_t *messages, const json_t *tools, const struct tok_chat_opts *o,
                    char **ret_text, size_t *ret_len, struct err_buf *e);

/* json.dumps(v, ensure_ascii=False) text of v (Python separators ", " and ": ", keys in
 * insertion order, floats as Python repr), malloc'd.  -EINVAL for NaN/Infinity-free JSON
 * that cannot occur, -ENOMEM. */
int tok_json_dumps_py(const json_t *v, char **ret_text);

#ifdef __cplusplus
}
#endif
