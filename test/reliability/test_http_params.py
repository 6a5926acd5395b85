"""test_http_params.py - every 400 names its field (issue 41 item 5).

Over the HTTP API (a mock engine behind stepd): bodies that jansson cannot take because a
value is an integer past 64 bits or a string holds an escaped NUL are 400 with `param` the
path of that value (max_tokens, seed, messages[0].content, tools[0].function.description,
logit_bias.5); an error about max_completion_tokens names max_completion_tokens, and the
same error about max_tokens names max_tokens.  Nothing reaches the engine.
"""
import http.client
import json
import sys

from rellib import h
from test_http_framing import VOCAB

MSG = '{"role":"user","content":"hi"}'
CASES = [
    ('"messages":[%s],"max_tokens":99999999999999999999' % MSG, "max_tokens", "64 bits"),
    ('"messages":[%s],"seed":-99999999999999999999' % MSG, "seed", "64 bits"),
    ('"messages":[%s],"logit_bias":{"5":1,"7":18446744073709551616}' % MSG, "logit_bias.7", "64 bits"),
    ('"messages":[{"role":"user","content":"a\\u0000b"}]', "messages[0].content", "NUL"),
    ('"messages":[%s,{"role":"assistant","content":"x"},{"role":"user","content":"\\u0000"}]' % MSG,
     "messages[2].content", "NUL"),
    ('"messages":[%s],"tools":[{"type":"function","function":{"name":"f","description":"x\\u0000"}}]' % MSG,
     "tools[0].function.description", "NUL"),
    ('"messages":[%s],"max_completion_tokens":0' % MSG, "max_completion_tokens", ">= 1"),
    ('"messages":[%s],"max_completion_tokens":100000000' % MSG, "max_completion_tokens", "<="),
    ('"messages":[%s],"max_tokens":0' % MSG, "max_tokens", ">= 1"),
]


def test_params():
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny")
    try:
        s.start_engine("g0", "--vocab", str(VOCAB))
        s.wait_ready(1)
        for fields, param, words in CASES:
            c = http.client.HTTPConnection("127.0.0.1", s.ports["http"], timeout=10)
            c.request("POST", "/v1/chat/completions", body='{"model":"tiny",%s}' % fields,
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            d = json.loads(r.read())
            c.close()
            assert r.status == 400 and d["error"]["param"] == param and words in d["error"]["message"], (fields, d)
        # the completions door: its prompt
        c = http.client.HTTPConnection("127.0.0.1", s.ports["http"], timeout=10)
        c.request("POST", "/v1/completions", body='{"model":"tiny","prompt":"x\\u0000"}',
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        d = json.loads(r.read())
        assert r.status == 400 and d["error"]["param"] == "prompt", d
        assert s.engines[0].stats().get("generate", 0) == 0, s.engines[0].stats()
    finally:
        assert s.stop() == 0


if __name__ == "__main__":
    h.run_tests([("params", test_params)])
    sys.exit(0)
