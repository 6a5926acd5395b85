"""Structured output through the OpenAI doors on the real CPU worker with the tiny model
(issue 39), checked with independent tools: the `openai` client and the `jsonschema`
validator.

  json_schema     response_format json_schema (strict) over nested objects, arrays, enums,
                  bounded numbers and required fields: every reply parses and validates;
                  chat and completions, streamed and not, K = 0 and K = 3 (MTP), greedy and
                  sampled, n = 3; greedy K = 3 equals K = 0; chat replies pass the reasoning first
                  (a bias on </think> ends it: the constraint starts after it)
  regex_choice    structured_outputs regex/choice and guided_regex/guided_choice: every
                  reply matches; json_object parses as an object; a Lark grammar matches
  lengths         a constraint that max_tokens cuts short ends with finish_reason "length"; a
                  constraint seen before is not compiled again (the metrics count)
  tools           tool_choice "required" and named: every reply is one call of a declared
                  function (the named one) with arguments valid against its schema, streamed
                  and not, K = 0 and K = 3; the Messages door's tool_choice any and tool too;
                  auto: a call the model opens (a bias on <tool_call>) is constrained the same way
  responses       the Responses door's text.format json_schema and json_object (a server without
                  the reasoning parser: the Responses API has no logit_bias to end the reasoning)
  no_engine       without llguidance (STEPD_LLGUIDANCE names a missing file) the daemon and
                  the worker start and serve free requests; a constrained one is a 503 saying
                  structured output needs llguidance
  grpc            GenerateRequest.structured_output: a regex and a choice constrain the text,
                  a bad regex is INVALID_ARGUMENT naming structured_output.text
  malformed       20 malformed schemas, regexes, choices and grammars: each a 400 naming the
                  field with the grammar engine's message; the server serves throughout
"""
import json
import re
import sys

import grpc

from stepd_harness import TOKENIZER, Stepd, collect, pb, run_tests

try:
    import jsonschema
    import openai
except ImportError as e:  # tools/dev/install-deps.sh installs them: their absence is a failure
    print("openai/jsonschema Python packages not importable: %s" % e)
    sys.exit(1)

THINK_END = 4
TOOL_CALL = 6

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}},
     "required": ["name", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "y": {"type": "integer", "minimum": -50, "maximum": 50}},
            "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
     "required": ["point", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9},
                "kind": {"enum": ["x", "y"]}},
            "required": ["id", "kind"], "additionalProperties": False}}},
     "required": ["ok", "items"], "additionalProperties": False},
]


def server(*args, env=None):
    s = Stepd("--tokenizer", TOKENIZER, *args, env=env)
    s.start_worker("g0", "--threads", "1", "--mtp", "3", env=env)
    s.wait_ready(1, timeout=120)
    return s


def oai(s):
    return openai.OpenAI(base_url=s.http + "/v1", api_key="none", max_retries=0, timeout=120)


def rf(schema, i):
    return {"type": "json_schema", "json_schema": {"name": "s%d" % i, "schema": schema, "strict": True}}


def chat_reply(c, schema, i, k, stream, temperature, max_tokens=120):
    """One chat reply under schema: its content, finish reason and reasoning."""
    kw = dict(model="tiny-step", messages=[{"role": "user", "content": "Describe item %d as JSON." % i}],
              max_tokens=max_tokens, temperature=temperature, seed=i, response_format=rf(schema, i),
              logit_bias={str(THINK_END): 100},
              extra_body={"num_speculative_tokens": k})
    if not stream:
        r = c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for ch in c.chat.completions.create(stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def completion_reply(c, schema, i, k, stream, temperature, max_tokens=120):
    kw = dict(model="tiny-step", prompt="Item %d as JSON:" % i, max_tokens=max_tokens, temperature=temperature,
              seed=i, extra_body={"num_speculative_tokens": k, "response_format": rf(schema, i)})
    if not stream:
        r = c.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, finish = "", None
    for ch in c.completions.create(stream=True, **kw):
        if ch.choices:
            text += ch.choices[0].text or ""
            finish = ch.choices[0].finish_reason or finish
    return text, finish


def test_json_schema():
    s = server()
    c = oai(s)
    n = 0
    greedy = {}
    for i in range(48):
        schema = SCHEMAS[i % len(SCHEMAS)]
        k = 3 if (i // 3) % 2 else 0
        stream = (i // 6) % 2 == 1
        temperature = 0 if (i // 12) % 2 == 0 else 1.0
        door = chat_reply if i < 24 else completion_reply
        text, finish = door(c, schema, i % 3, k, stream, temperature)
        assert finish == "stop", (i, finish, text)
        doc = json.loads(text)
        jsonschema.validate(doc, schema)
        if temperature == 0:
            greedy.setdefault((door.__name__, i % 3, stream), {})[k] = text
        n += 1
    # greedy K = 3 equals K = 0 under the same constraint (same prompt, schema and door)
    pairs = [v for v in greedy.values() if len(v) == 2]
    assert len(pairs) == 12, greedy
    for v in pairs:
        assert v[0] == v[3], v
    # n > 1: a matcher per choice (each choice is its own engine request, its own seed)
    r = c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "Two items"}], n=3,
                                  max_tokens=120, temperature=1.0, seed=7, response_format=rf(SCHEMAS[2], 0),
                                  logit_bias={str(THINK_END): 100}, extra_body={"num_speculative_tokens": 3})
    assert len(r.choices) == 3, r
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMAS[2])
    n += 3
    print("json_schema: %d replies valid, %d greedy K=3/K=0 pairs equal" % (n, len(pairs)))
    assert s.stop() == 0


def test_regex_choice():
    s = server()
    c = oai(s)
    rx = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    choices = ["red apple", "green pear", "blue (berry)"]
    for i in range(6):
        k = 3 if i % 2 else 0
        r = c.completions.create(model="tiny-step", prompt="Name %d:" % i, max_tokens=40, temperature=1.0, seed=i,
                                 extra_body={"structured_outputs": {"regex": rx}, "num_speculative_tokens": k})
        assert re.fullmatch(rx, r.choices[0].text), r.choices[0].text
        r = c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "Pick %d" % i}],
                                      max_tokens=40, temperature=1.0, seed=i, logit_bias={str(THINK_END): 100},
                                      extra_body={"guided_choice": choices, "num_speculative_tokens": k})
        assert r.choices[0].message.content in choices, r.choices[0].message
        r = c.completions.create(model="tiny-step", prompt="Pick %d:" % i, max_tokens=40, temperature=1.0, seed=i,
                                 extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices, r.choices[0].text
        r = c.completions.create(model="tiny-step", prompt="Id %d:" % i, max_tokens=40, temperature=1.0, seed=i,
                                 extra_body={"guided_regex": r"(ab|cd)[0-9]{2}"})
        assert re.fullmatch(r"(ab|cd)[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = c.completions.create(model="tiny-step", prompt="Object:", max_tokens=60, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "length" or isinstance(json.loads(r.choices[0].text), dict), r
    g = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'
    r = c.completions.create(model="tiny-step", prompt="Answer:", max_tokens=20, temperature=1.0, seed=3,
                             extra_body={"structured_outputs": {"grammar": g}})
    assert re.fullmatch(r"yes|no|maybe [0-9]", r.choices[0].text), r.choices[0].text
    # without the bias the tiny model reasons to max_tokens: the constraint never started and
    # the reasoning is free text
    r = c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "Pick"}], max_tokens=12,
                                  temperature=0, extra_body={"guided_choice": choices})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.model_extra["reasoning_content"], r
    assert s.stop() == 0


def test_lengths():
    s = server()
    c = oai(s)
    # a constraint compiled once is known good: the same regex again is not compiled again
    req0, comp0 = s.metric("stepd:structured_output_requests_total"), s.metric("stepd:structured_output_compiles_total")
    for rx in ("[0-9]{3}", "[0-9]{3}", "[a-z]{3}", "[0-9]{3}"):
        r = c.completions.create(model="tiny-step", prompt="x", max_tokens=8, temperature=0,
                                 extra_body={"guided_regex": rx})
        assert re.fullmatch(rx, r.choices[0].text), r
    assert s.metric("stepd:structured_output_requests_total") - req0 == 4
    assert s.metric("stepd:structured_output_compiles_total") - comp0 == 2
    r = c.completions.create(model="tiny-step", prompt="x", max_tokens=3, temperature=0,
                             extra_body={"guided_regex": "a{30}"})
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == "a" * len(r.choices[0].text), r
    assert s.stop() == 0


MALFORMED = [
    ("response_format.json_schema.schema", {"response_format": rf({"type": "nonsense"}, 0)}),
    ("response_format.json_schema.schema", {"response_format": rf({"type": "integer", "minimum": 5,
                                                                  "maximum": 1}, 0)}),
    ("response_format.json_schema.schema", {"response_format": rf({"type": "object", "required": 3}, 0)}),
    ("response_format.json_schema.schema", {"response_format": rf({"$ref": "#/nowhere"}, 0)}),
    ("response_format.json_schema.schema", {"response_format": rf({"type": "string", "pattern": "(["}, 0)}),
    ("response_format.json_schema", {"response_format": {"type": "json_schema"}}),
    ("response_format.json_schema.schema", {"response_format": {"type": "json_schema", "json_schema": {}}}),
    ("response_format.type", {"response_format": {"type": "xml"}}),
    ("structured_outputs.json", {"structured_outputs": {"json": "{not json"}}),
    ("structured_outputs.json", {"structured_outputs": {"json": 7}}),
    ("structured_outputs.regex", {"structured_outputs": {"regex": "(unclosed"}}),
    ("structured_outputs.regex", {"structured_outputs": {"regex": "a{5,2}"}}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": []}}),
    ("structured_outputs.choice", {"structured_outputs": {"choice": ["a", 1]}}),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": "start: undefined_rule"}}),
    ("structured_outputs.grammar", {"structured_outputs": {"grammar": "start: (\"a\""}}),
    ("structured_outputs.frob", {"structured_outputs": {"frob": "x"}}),
    ("guided_json", {"guided_json": {"type": "object", "properties": {"a": {"type": "wrong"}}}}),
    ("guided_regex", {"guided_regex": "[z-a]"}),
    ("guided_grammar", {"guided_grammar": "start: ::= nonsense"}),
    ("guided_regex", {"guided_json": {"type": "object"}, "guided_regex": "a"}),
]


def test_malformed():
    s = server()
    c = oai(s)
    for field, extra in MALFORMED:
        for door in ("chat", "completions"):
            try:
                if door == "chat":
                    c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, extra_body=extra)
                else:
                    c.completions.create(model="tiny-step", prompt="hi", max_tokens=4, extra_body=extra)
            except openai.BadRequestError as e:
                msg = e.body["message"] if isinstance(e.body, dict) else str(e)
                assert msg.startswith(field + ":") or msg.startswith(field + "["), (field, msg)
            else:
                raise AssertionError("accepted: %s" % extra)
        # the server serves throughout
        r = c.completions.create(model="tiny-step", prompt="hi", max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason == "length", r
    print("malformed: %d refused with the field named (each through both doors)" % len(MALFORMED))
    assert s.stop() == 0


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email", "parameters": {
        "type": "object", "properties": {
            "to": {"type": "string"},
            "urgent": {"type": "boolean"},
            "cc": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}},
        "required": ["to", "urgent"]}}},
]


def test_tools():
    s = server()
    c = oai(s)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    n = 0
    for i in range(12):
        choice = "required" if i < 8 else {"type": "function", "function": {"name": TOOLS[i % 2]["function"]["name"]}}
        kw = dict(model="tiny-step", messages=[{"role": "user", "content": "Task %d: weather or mail?" % i}],
                  tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0 if i % 4 == 0 else 1.0, seed=i,
                  extra_body={"num_speculative_tokens": 3 if i % 2 else 0})
        if i % 3 == 2:
            calls, finish = {}, None
            for ch in c.chat.completions.create(stream=True, **kw):
                for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    e["name"] += d.function.name or ""
                    e["arguments"] += d.function.arguments or ""
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
            got = list(calls.values())
        else:
            r = c.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            got = [{"name": t.function.name, "arguments": t.function.arguments}
                   for t in r.choices[0].message.tool_calls or []]
        assert finish == "tool_calls" and len(got) == 1, (i, finish, got)
        name = got[0]["name"]
        assert name in schemas, got
        if isinstance(choice, dict):
            assert name == choice["function"]["name"], got
        jsonschema.validate(json.loads(got[0]["arguments"]), schemas[name])
        n += 1
    # auto: free until the model opens a call (a bias on <tool_call> makes it), then the call
    # is constrained; parallel_tool_calls false ends the reply where a second call would start
    for i in range(4):
        r = c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "Auto %d" % i}],
                                      tools=TOOLS, tool_choice="auto", max_tokens=200, parallel_tool_calls=False,
                                      temperature=1.0, seed=i, logit_bias={str(TOOL_CALL): 100},
                                      extra_body={"num_speculative_tokens": 3 if i % 2 else 0})
        got = r.choices[0].message.tool_calls or []
        assert r.choices[0].finish_reason == "tool_calls" and len(got) == 1, r
        assert got[0].function.name in schemas, got
        jsonschema.validate(json.loads(got[0].function.arguments), schemas[got[0].function.name])
        n += 1
    # the Messages door: tool_choice any / tool
    import anthropic
    a = anthropic.Anthropic(base_url=s.http, api_key="none", max_retries=0, timeout=120)
    atools = [{"name": t["function"]["name"], "description": t["function"]["description"],
               "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for i, tc in enumerate(({"type": "any"}, {"type": "tool", "name": "send_email"})):
        m = a.messages.create(model="tiny-step", max_tokens=200, temperature=1.0, tools=atools, tool_choice=tc,
                              messages=[{"role": "user", "content": "Task %d" % i}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1, m
        assert uses[0].name in schemas and (tc["type"] == "any" or uses[0].name == tc["name"]), uses
        jsonschema.validate(uses[0].input, schemas[uses[0].name])
        n += 1
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}}]
    try:
        c.chat.completions.create(model="tiny-step", messages=[{"role": "user", "content": "x"}], tools=bad,
                                  tool_choice="required", max_tokens=8)
    except openai.BadRequestError as e:
        assert e.body["message"].startswith("tools: "), e.body
    else:
        raise AssertionError("an unsatisfiable tool schema was accepted")
    print("tools: %d calls valid" % n)
    assert s.stop() == 0


def test_responses():
    s = server("--reasoning-parser", "none")
    c = oai(s)
    for i in range(6):
        schema = SCHEMAS[i % len(SCHEMAS)]
        r = c.responses.create(model="tiny-step", input="Item %d as JSON" % i, max_output_tokens=120,
                               temperature=0 if i < 3 else 1.0,
                               text={"format": {"type": "json_schema", "name": "s%d" % i, "schema": schema,
                                                "strict": True}})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), schema)
    r = c.responses.create(model="tiny-step", input="Any object", max_output_tokens=120, temperature=0,
                           text={"format": {"type": "json_object"}})
    assert r.status == "incomplete" or isinstance(json.loads(r.output_text), dict), r
    assert s.stop() == 0


def test_no_engine():
    s = server(env={"STEPD_LLGUIDANCE": "/nonexistent/_lib.abi3.so"})
    c = oai(s)
    r = c.completions.create(model="tiny-step", prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length", r
    try:
        c.completions.create(model="tiny-step", prompt="hi", max_tokens=3, extra_body={"guided_regex": "a+"})
    except openai.APIStatusError as e:
        assert e.status_code == 503 and "structured output needs llguidance" in str(e.body), (e.status_code, e.body)
    else:
        raise AssertionError("a constrained request was served without the grammar engine")
    r = c.completions.create(model="tiny-step", prompt="hi", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length", r
    assert s.stop() == 0


def test_grpc():
    s = server()
    for i, (so, rx) in enumerate(((pb.StructuredOutput(kind="regex", text="[a-z]{3}-[0-9]"), r"[a-z]{3}-[0-9]"),
                                  (pb.StructuredOutput(kind="choice", text='["north", "south"]'), r"north|south"),
                                  (pb.StructuredOutput(kind="json_schema", text=json.dumps(SCHEMAS[0])), None))):
        req = pb.GenerateRequest(text="Direction %d:" % i, structured_output=so, num_speculative_tokens=3,
                                 sampling_params=pb.SamplingParams(max_tokens=60, temperature=1.0, seed=i))
        toks, text, finals, chunks = collect(s.inf.Generate(req, timeout=120))
        assert finals[-1].finish_reason == pb.FINISH_REASON_STOP, finals
        if rx:
            assert re.fullmatch(rx, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMAS[0])
    for so in (pb.StructuredOutput(kind="regex", text="(x"), pb.StructuredOutput(kind="choice", text="[1]"),
               pb.StructuredOutput(kind="yaml", text="a: 1")):
        try:
            list(s.inf.Generate(pb.GenerateRequest(text="x", structured_output=so), timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert e.details().startswith("structured_output."), e.details()
        else:
            raise AssertionError("accepted: %s" % so)
    assert s.stop() == 0


if __name__ == "__main__":
    run_tests([
        ("json_schema", test_json_schema),
        ("regex_choice", test_regex_choice),
        ("lengths", test_lengths),
        ("tools", test_tools),
        ("responses", test_responses),
        ("no_engine", test_no_engine),
        ("grpc", test_grpc),
        ("malformed", test_malformed),
    ])
