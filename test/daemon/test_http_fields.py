#!/usr/bin/env python3
"""The request fields of the OpenAI HTTP API and the replies they shape, against a mock engine
with the `openai` client:
  structured_output   no field that changes the output is silently ignored (docs/OPERATIONS.md
                      §12's field table): a GBNF guided_grammar, guided_decoding_backend other than
                      guidance, guided_whitespace_pattern, structural_tag, prompt_logprobs: 400
                      naming the field, on chat and completions (guided_json/regex/choice, Lark
                      grammars, structured_outputs and response_format json_object/json_schema
                      are served); a field stepd does not know: 400 naming it; the fields that
                      cannot change the output (user, metadata, store, ...) and the no-op values
                      of refused ones (use_beam_search false, modalities ["text"]): 200
  tool_reply_shape    a reply of tool calls only: content null (was the "\\n" of the model's
                      blank line after </think>), streaming (the role chunk's content null, no
                      content delta) and not; parallel_tool_calls false: one call (was two),
                      finish_reason tool_calls, streaming and not; content before a call and a
                      whitespace-only answer without a call are kept byte for byte
"""
import json
import sys

from stepd_harness import TOKENIZER, Stepd, run_tests

try:
    import openai
except ImportError as e:  # a test tool (tools/dev/install-deps.sh installs it): its absence is a failure
    print("openai Python package not importable: %s" % e)
    sys.exit(1)

VOCAB = 4000
MSGS = [{"role": "user", "content": "Weather in Paris and Rome?"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def ids(text):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TOKENIZER).encode(text, add_special_tokens=False).ids


def mock_stepd(script=None):
    s = Stepd("--tokenizer", TOKENIZER, "--served-model-name", "tiny")
    s.start_engine("g0", "--vocab", str(VOCAB), *(("--script", ",".join(map(str, script))) if script else ()))
    s.wait_ready(1)
    return s


def client(s):
    return openai.OpenAI(base_url=s.http + "/v1", api_key="none", max_retries=0, timeout=60)


def refused(fn, field, **kw):
    try:
        r = fn(**kw)
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == field, (field, e.body)
        assert e.body["message"].startswith(field + ": "), e.body
        return e.body["message"]
    raise AssertionError("%s accepted: %s" % (field, r))


def test_structured_output():
    s = mock_stepd()
    c = client(s)
    chat = lambda **kw: c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, **kw)  # noqa: E731
    comp = lambda **kw: c.completions.create(model="tiny", prompt="In the beginning", max_tokens=4, **kw)  # noqa: E731
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    asks = {
        "guided_grammar": "root ::= \"yes\"",        # GBNF: the grammar is Lark (llguidance)
        "guided_decoding_backend": "xgrammar",
        "guided_whitespace_pattern": " *",
        "structural_tag": "{}",
        "prompt_logprobs": 1,
    }
    # structured output is served (test_structured.py checks the replies on the real worker)
    served = [{"guided_json": schema}, {"guided_regex": "[0-9]+"}, {"guided_choice": ["yes", "no"]},
              {"guided_grammar": 'start: "yes"'}, {"structured_outputs": {"json": schema}},
              {"response_format": {"type": "json_object"}},
              {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}]
    for door in (chat, comp):
        for field, value in asks.items():
            msg = refused(door, field, extra_body={field: value})
            print("   %s: %s" % (field, msg))
        for extra in served:
            r = door(extra_body=extra)
            assert r.choices[0].finish_reason == "length", (extra, r)
        refused(door, "response_format.type", extra_body={"response_format": {"type": "yaml"}})
        # a field nobody defined is refused, never ignored
        refused(door, "frobnicate", extra_body={"frobnicate": 1})
        # what cannot change the output, and the no-op values of refused fields
        r = door(user="u1", extra_body={"metadata": {"k": "v"}, "service_tier": "auto", "use_beam_search": False,
                                        "guided_json": None, "response_format": {"type": "text"}})
        assert r.choices[0].finish_reason == "length", r
        refused(door, "use_beam_search", extra_body={"use_beam_search": True})
    r = chat(store=False, extra_body={"modalities": ["text"], "parallel_tool_calls": True})
    assert r.choices[0].finish_reason == "length", r
    refused(chat, "modalities", extra_body={"modalities": ["text", "audio"]})
    refused(chat, "chat_template", extra_body={"chat_template": "{{ messages }}"})
    refused(chat, "include_reasoning", extra_body={"include_reasoning": False})
    # a field of the other endpoint
    msg = refused(comp, "messages", extra_body={"messages": MSGS})
    assert "/v1/completions" in msg, msg
    refused(chat, "suffix", extra_body={"suffix": "x"})
    assert s.stop() == 0


# the model's blank line after </think> (one newline is the tag's, the other was content: "\n")
TWO_CALLS = ("Both cities.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
             "</function>\n</tool_call>")


def stream(c, **kw):
    chunks = list(c.chat.completions.create(model="tiny", messages=MSGS, stream=True, **kw))
    deltas = [k.choices[0].delta for k in chunks if k.choices]
    content = [d.content for d in deltas if d.content is not None]
    calls = {}
    for d in deltas:
        for t in d.tool_calls or []:
            calls.setdefault(t.index, {"name": None, "args": ""})
            if t.function.name:
                calls[t.index]["name"] = t.function.name
            calls[t.index]["args"] += t.function.arguments or ""
    finish = [k.choices[0].finish_reason for k in chunks if k.choices and k.choices[0].finish_reason]
    return deltas, content, calls, finish


def test_tool_reply_shape():
    script = ids(TWO_CALLS)
    s = mock_stepd(script)
    c = client(s)
    n = len(script) + 5
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=WEATHER, max_tokens=n)
    m = r.choices[0].message
    assert [json.loads(t.function.arguments)["city"] for t in m.tool_calls] == ["Paris", "Rome"], m
    assert m.content is None, "content of a reply of tool calls only: %r" % m.content  # was "\n"
    assert r.choices[0].finish_reason == "tool_calls", r
    deltas, content, calls, finish = stream(c, tools=WEATHER, max_tokens=n)
    assert deltas[0].role == "assistant" and deltas[0].content is None, deltas[0]
    assert "".join(content) == "", content
    assert [json.loads(calls[i]["args"])["city"] for i in sorted(calls)] == ["Paris", "Rome"], calls
    assert finish == ["tool_calls"], finish
    # parallel_tool_calls false: the first call only, the output ends there
    r = c.chat.completions.create(model="tiny", messages=MSGS, tools=WEATHER, max_tokens=n, parallel_tool_calls=False)
    m = r.choices[0].message
    assert len(m.tool_calls) == 1 and json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}, m
    assert m.content is None and r.choices[0].finish_reason == "tool_calls", r
    assert r.usage.completion_tokens < len(script), r.usage
    deltas, content, calls, finish = stream(c, tools=WEATHER, max_tokens=n, parallel_tool_calls=False)
    assert list(calls) == [0] and json.loads(calls[0]["args"]) == {"city": "Paris"}, calls
    assert "".join(content) == "" and finish == ["tool_calls"], (content, finish)
    assert s.stop() == 0
    # an answer, no call: its text kept byte for byte (the whitespace before it too)
    for text, want in (("Sunny.\n</think>\n\nParis is sunny.\n", "\nParis is sunny.\n"),
                       ("Hmm.\n</think>\n\n\n", "\n\n")):
        s = mock_stepd(ids(text))
        c = client(s)
        r = c.chat.completions.create(model="tiny", messages=MSGS, tools=WEATHER, max_tokens=40)
        assert r.choices[0].message.content == want and not r.choices[0].message.tool_calls, (text, r)
        _, content, calls, _ = stream(c, tools=WEATHER, max_tokens=40)
        assert "".join(content) == want and not calls, (text, content)
        assert s.stop() == 0


if __name__ == "__main__":
    run_tests([
        ("structured_output", test_structured_output),
        ("tool_reply_shape", test_tool_reply_shape),
    ])
