"""test_tool_schema.py - a tool's parameters held to JSON Schema's meta-rules (issue 41 item 5).

Over both doors (HTTP chat with "tools", gRPC Generate with chat.tools_json), against a mock
engine: each malformed schema below is refused INVALID_ARGUMENT / 400 with a message that
names the tool and the JSON pointer in its schema (param tools[0].function.parameters over
HTTP), and nothing reaches the engine; the well-formed ones are served.  Where the Python
`jsonschema` package is importable, every case is first checked against it
(Draft202012Validator.check_schema), so that the C rules agree with a real validator.
"""
import http.client
import json
import sys

import grpc

from rellib import h
from test_http_framing import VOCAB

BAD = [
    ({"type": "bogus", "properties": 7}, "/type"),
    ({"type": "object", "properties": 7}, "/properties"),
    ({"type": "object", "properties": {"loc": {"type": "strin"}}}, "/properties/loc/type"),
    ({"type": ["string", "string"]}, "/type"),
    ({"type": "object", "required": ["a", "a"]}, "/required"),
    ({"type": "object", "required": "a"}, "/required"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}, "/properties/a/pattern"),
    ({"type": "object", "patternProperties": {"([": {}}}, "/patternProperties/(["),
    ({"type": "object", "properties": {"a/b": {"anyOf": []}}}, "/properties/a~1b/anyOf"),
    ({"type": "object", "properties": {"n": {"type": "string", "minLength": -1}}}, "/properties/n/minLength"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0}}}, "/properties/n/multipleOf"),
    ({"type": "object", "properties": {"n": {"type": "number", "maximum": "10"}}}, "/properties/n/maximum"),
    ({"type": "object", "properties": {"n": 5}}, "/properties/n"),
    ({"type": "object", "additionalProperties": "no"}, "/additionalProperties"),
    ({"type": "array", "items": {"enum": 3}}, "/items/enum"),
    ({"type": "object", "description": 7}, "/description"),
    ({"type": "object", "dependentRequired": {"a": [1]}}, "/dependentRequired/a"),
]
GOOD = [
    {"type": "object", "properties": {"location": {"type": "string", "description": "city"},
                                      "unit": {"enum": ["c", "f"]}}, "required": ["location"],
     "additionalProperties": False},
    {"type": "object", "properties": {"q": {"type": ["string", "null"], "pattern": "^[a-z]+$", "minLength": 1},
                                      "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10.5},
                                      "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
     "$defs": {"x": True}, "x-vendor": {"anything": 1}},
    {},
]


def cross_check():
    try:
        import jsonschema
    except ImportError:
        print("   (Python jsonschema not importable: no cross-check)")
        return
    v = jsonschema.Draft202012Validator
    for sc, _ in BAD:
        try:
            v.check_schema(sc)
            raise AssertionError("jsonschema takes %r, which the test calls malformed" % sc)
        except jsonschema.SchemaError:
            pass
    for sc in GOOD:
        v.check_schema(sc)
    print("   Python jsonschema (Draft 2020-12 meta-schema) agrees on all %d cases" % (len(BAD) + len(GOOD)))


def tools(sc):
    return [{"type": "function", "function": {"name": "get_weather", "parameters": sc}}]


def http_chat(s, sc):
    c = http.client.HTTPConnection("127.0.0.1", s.ports["http"], timeout=10)
    c.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
              body=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": tools(sc),
                               "max_tokens": 2}))
    r = c.getresponse()
    d = json.loads(r.read())
    c.close()
    return r.status, d


def grpc_chat(s, sc):
    req = h.pb.GenerateRequest(chat=h.pb.ChatInput(messages=[h.pb.ChatMessage(role="user", content="hi")],
                                                   tools_json=json.dumps(tools(sc))),
                               sampling_params=h.pb.SamplingParams(max_tokens=2))
    try:
        h.collect(s.inf.Generate(req, timeout=10))
        return None
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_tool_schema():
    cross_check()
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny")
    try:
        s.start_engine("g0", "--vocab", str(VOCAB))
        s.wait_ready(1)
        for sc, ptr in BAD:
            st, d = http_chat(s, sc)
            m = d["error"]["message"]
            assert st == 400 and d["error"]["param"] == "tools[0].function.parameters", (sc, d)
            assert "JSON Schema: %s " % ptr in m and '"get_weather"' in m, (sc, m)
            code, det = grpc_chat(s, sc)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "JSON Schema: %s " % ptr in det, (sc, code, det)
        assert s.engines[0].stats().get("generate", 0) == 0, s.engines[0].stats()
        for sc in GOOD:
            st, d = http_chat(s, sc)
            assert st == 200 and d["choices"], (sc, d)
            assert grpc_chat(s, sc) is None, sc
    finally:
        assert s.stop() == 0


if __name__ == "__main__":
    h.run_tests([("tool_schema", test_tool_schema)])
    sys.exit(0)
