#!/usr/bin/env python3
"""The OpenAI-compatible HTTP API of stepd, driven by clients nobody here wrote: the `openai`
Python package and `curl -N`, plus raw sockets for the abuse cases.

Against mock engines (deterministic tokens; --script makes one answer with chosen ids, e.g. a
tool call in the tiny tokenizer's ids):
  openai_client      chat and completions, streaming and not, usage, n > 1, models and
                     aliases, error types and statuses (400 naming the field, 404 model,
                     401 key, 429 queue full, 503 draining, 504 deadline)
  sse_framing        curl -N: "data: {...}\\n\\n" events, the role chunk first, deltas, the
                     finish chunk, the usage chunk, "data: [DONE]", chunked transfer
  tool_calls         tool_choice auto parses a scripted call (JSON-string arguments, a stable
                     "call_" id, finish_reason tool_calls), the round trip renders it back;
                     none leaves it as content; required/named open the call in the prompt
  disconnect         a streaming client that goes away: its request is aborted in the engine
  bad_inputs         docs/RELIABILITY.md C8 over HTTP: wrong types, negative and NaN numbers,
                     unknown role, invalid UTF-8, oversized body, missing model, 1 MB header,
                     a slow-loris client, image parts: each a 4xx naming the field or the
                     limit, the connection closed where it should be, RSS bounded, still serving
  endpoints          /tokenize, /detokenize, /health, /ready, /healthz, /metrics (API port and
                     metrics port), /v1/models
  tls_and_key        HTTPS with the API key; a non-loopback --host without TLS is refused
Against the real CPU worker on the tiny model:
  equality           the same greedy request over HTTP and over gRPC: the same tokens and text
                     (completions and chat), with MTP K=3 too
  reasoning_split    reasoning_content and content split at </think> as the gRPC stream's raw
                     text has it; reasoning tokens counted
  logprobs           logprobs/top_logprobs over HTTP equal the gRPC stream's
"""
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time

from stepd_harness import STEPD_BIN, TOKENIZER, Stepd, collect, pb, run_tests, tokenizer_size, wait_until

try:
    import openai
except ImportError as e:  # a test tool (tools/dev/install-deps.sh installs it): its absence is a failure
    print("openai Python package not importable: %s" % e)
    sys.exit(1)

VOCAB = 4000


def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TOKENIZER)


def client(s, key="none", **kw):
    return openai.OpenAI(base_url=s.http + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def mock_stepd(*args, mock_args=(), env=None):
    s = Stepd("--tokenizer", TOKENIZER, "--served-model-name", "tiny,tiny-alias", *args, env=env)
    s.start_engine("g0", "--vocab", str(VOCAB), *mock_args)
    s.wait_ready(1)
    return s


CLOSED = []     # raw(): whether the server closed the connection (last call)


def raw(port, data, timeout=10):
    """Send raw bytes, read the whole answer (until the server closes or timeout; CLOSED[-1]
    says which)."""
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    closed = False
    try:
        c.sendall(data)
    except OSError:
        pass        # the server may close before it has read everything
    try:
        while True:
            b = c.recv(65536)
            if not b:
                closed = True
                break
            out += b
    except socket.timeout:
        pass
    except OSError:
        closed = True
    c.close()
    CLOSED.append(closed)
    return out


def post(s, path, body, headers=None, raw_body=None):
    c = http.client.HTTPConnection("127.0.0.1", s.ports["http"], timeout=30)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=raw_body if raw_body is not None else json.dumps(body), headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data), r
    except ValueError:
        return r.status, data, r


def get(s, path, port=None):
    c = http.client.HTTPConnection("127.0.0.1", port or s.ports["http"], timeout=10)
    c.request("GET", path)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data, r


def still_serving(s):
    st, d, _ = post(s, "/v1/completions", {"model": "tiny", "prompt": "In the beginning", "max_tokens": 2})
    assert st == 200 and d["choices"][0]["finish_reason"] == "length", (st, d)


def chat_msgs(text="Who made the heaven and the earth?"):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


# ------------------------------------------------------------------ mock engine


def test_openai_client():
    s = mock_stepd()
    c = client(s)
    models = [m.id for m in c.models.list().data]
    assert models == ["tiny", "tiny-alias"], models
    # chat, not streaming: reasoning split (the prompt opened <think>), usage
    r = c.chat.completions.create(model="tiny-alias", messages=chat_msgs(), max_tokens=6)
    ch = r.choices[0]
    assert r.object == "chat.completion" and r.model == "tiny-alias" and r.id.startswith("chatcmpl-"), r
    assert ch.finish_reason == "length" and ch.message.role == "assistant", ch
    text = (getattr(ch.message, "reasoning_content", None) or "") + (ch.message.content or "")
    assert text, ch
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens > 5 and u.total_tokens == u.prompt_tokens + 6, u
    assert u.prompt_tokens_details.cached_tokens == 0, u
    assert u.completion_tokens_details.reasoning_tokens == 6, u   # all of it inside the reasoning
    ext = r.model_extra["stepd"]["choices"][0]
    assert ext["group"] == "g0" and ext["mtp"]["num_drafts"] >= 1 and "e2e_s" in ext["timings"], ext
    # the same, streaming, with the usage chunk
    chunks = list(c.chat.completions.create(model="tiny", messages=chat_msgs(), max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant", chunks[0]
    streamed = "".join((getattr(k.choices[0].delta, "reasoning_content", None) or "") +
                       (k.choices[0].delta.content or "") for k in chunks if k.choices)
    assert streamed == text, (streamed, text)
    fin = [k for k in chunks if k.choices and k.choices[0].finish_reason]
    assert len(fin) == 1 and fin[0].choices[0].finish_reason == "length", fin
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6, chunks[-1]
    assert all(k.usage is None for k in chunks[:-1]), chunks
    # completions, both ways
    r = c.completions.create(model="tiny", prompt="In the beginning", max_tokens=5)
    assert r.object == "text_completion" and r.choices[0].text and r.usage.completion_tokens == 5, r
    parts = list(c.completions.create(model="tiny", prompt="In the beginning", max_tokens=5, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == r.choices[0].text, parts
    # token ids as the prompt; a stop string; seeds; n > 1
    r = c.completions.create(model="tiny", prompt=[10, 20, 30], max_tokens=4, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert ids == [(60 + 7 * i + 1) % VOCAB for i in range(4)], ids
    before = s.engines[0].stats().get("generate", 0)
    r = c.chat.completions.create(model="tiny", messages=chat_msgs(), max_tokens=3, n=3, seed=7)
    assert [x.index for x in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 9, r
    after = s.engines[0].stats().get("generate", 0)
    assert after - before == 3, (before, after)           # n engine requests sharing the prompt
    ids = [e["request_id"] for e in r.model_extra["stepd"]["choices"]]
    assert len(set(ids)) == 3 and all(i.endswith("-%d" % k) for k, i in enumerate(ids)), ids
    # errors: the type and status the client maps them to
    try:
        c.chat.completions.create(model="tiny", messages=chat_msgs(), temperature=-1)
        raise AssertionError("accepted temperature -1")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
        assert e.body["type"] == "invalid_request_error" and "temperature" in e.body["message"], e.body
    try:
        c.chat.completions.create(model="gpt-9", messages=chat_msgs())
        raise AssertionError("accepted an unknown model")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["param"] == "model" and "gpt-9" in e.body["message"], e.body
    try:
        c.chat.completions.create(model="tiny", messages=chat_msgs(), n=17)
        raise AssertionError("accepted n=17")
    except openai.BadRequestError as e:
        assert e.body["param"] == "n", e.body
    assert s.stop() == 0

    # 429: the queue is full (one running, none queued); 504: the request's deadline
    stall = os.path.join(tempfile.mkdtemp(prefix="stepd-http-stall-"), "stall")
    s = mock_stepd("--max-running", "1", "--max-queue", "0", "--request-timeout", "0.5",
                   mock_args=("--delay-ms", "100", "--stall-file", stall))
    c = client(s)
    hold = threading.Thread(target=lambda: c.completions.create(model="tiny", prompt="x", max_tokens=3))
    hold.start()
    wait_until(lambda: s.metric("stepd:num_requests_running") == 1, what="one running")
    try:
        c.completions.create(model="tiny", prompt="y", max_tokens=3)
        raise AssertionError("a full queue accepted a request")
    except openai.RateLimitError as e:
        assert e.status_code == 429 and e.response.headers.get("retry-after") == "1", e.response.headers
    hold.join()
    # the engine produces nothing while the stall file exists: only the deadline can answer
    # (the client's 60 s is a hang guard, not a measurement)
    open(stall, "w").close()
    try:
        c.completions.create(model="tiny", prompt="y", max_tokens=50)
        raise AssertionError("no deadline")
    except openai.APIStatusError as e:
        assert e.status_code == 504 and e.body["type"] == "timeout_error", e.body
    finally:
        os.unlink(stall)
        os.rmdir(os.path.dirname(stall))
    wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
    # 503 while draining (the request still in flight finishes)
    long = threading.Thread(target=lambda: c.completions.create(model="tiny", prompt="x", max_tokens=4))
    long.start()
    wait_until(lambda: s.metric("stepd:num_requests_running") == 1, what="one running")
    s.admin.Drain(pb.DrainRequest(exit_when_drained=True, timeout_ms=10000), timeout=5)
    try:
        c.completions.create(model="tiny", prompt="y", max_tokens=3)
        raise AssertionError("served while draining")
    except openai.APIStatusError as e:
        assert e.status_code in (503, 429) or isinstance(e, openai.InternalServerError), e
    long.join()
    assert s.proc.wait(15) == 0


def test_sse_framing():
    s = mock_stepd()
    body = json.dumps({"model": "tiny", "messages": chat_msgs(), "max_tokens": 4, "stream": True,
                       "stream_options": {"include_usage": True}})
    p = subprocess.run(["curl", "-sS", "-N", "-i", "--http1.1", "-H", "Content-Type: application/json", "-d", body,
                        s.http + "/v1/chat/completions"], capture_output=True, timeout=30)
    assert p.returncode == 0, p.stderr
    head, _, events = p.stdout.partition(b"\r\n\r\n")
    head = head.decode().lower()
    assert head.startswith("http/1.1 200") and "content-type: text/event-stream" in head, head
    assert "transfer-encoding: chunked" in head and "cache-control: no-cache" in head, head
    assert events.endswith(b"data: [DONE]\n\n"), events[-200:]
    frames = events.split(b"\n\n")
    assert frames[-1] == b"", frames[-1]
    frames = frames[:-1]
    assert all(f.startswith(b"data: ") and b"\n" not in f for f in frames), frames
    objs = [json.loads(f[6:]) for f in frames[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}, objs[0]
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == objs[0]["id"] for o in objs), objs
    fin = [o for o in objs if o["choices"] and o["choices"][0]["finish_reason"]]
    assert len(fin) == 1 and fin[0] is objs[-2] and fin[0]["choices"][0]["finish_reason"] == "length", objs
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 4, objs[-1]
    # completions: text deltas, no role chunk
    body = json.dumps({"model": "tiny", "prompt": "In the beginning", "max_tokens": 3, "stream": True})
    p = subprocess.run(["curl", "-sS", "-N", "-H", "Content-Type: application/json", "-d", body,
                        s.http + "/v1/completions"], capture_output=True, timeout=30)
    frames = p.stdout.split(b"\n\n")[:-1]
    assert frames[-1] == b"data: [DONE]", frames
    objs = [json.loads(f[6:]) for f in frames[:-1]]
    assert objs[0]["object"] == "text_completion" and objs[0]["choices"][0]["text"], objs
    # an error before any output is a plain HTTP error, not a stream
    body = json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "x"}], "stream": True})
    p = subprocess.run(["curl", "-sS", "-N", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d", body,
                        s.http + "/v1/chat/completions"], capture_output=True, timeout=30)
    out, code = p.stdout.rsplit(b"\n", 1)
    assert code == b"400" and json.loads(out)["error"]["param"] == "messages[0].role", p.stdout
    assert s.stop() == 0


def tool_call_ids(text):
    """The tiny tokenizer's ids of text (special tags as their added tokens)."""
    return tokenizer().encode(text, add_special_tokens=False).ids


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


def test_tool_calls():
    script = tool_call_ids("I will look it up.\n</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                           "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    s = mock_stepd(mock_args=("--script", ",".join(map(str, script))))
    c = client(s)
    msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, max_tokens=len(script) + 5)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.model_extra.get("reasoning_content") == "I will look it up.", ch.message
    tc = ch.message.tool_calls
    assert len(tc) == 1 and tc[0].type == "function" and tc[0].function.name == "get_weather", tc
    assert json.loads(tc[0].function.arguments) == {"city": "Paris", "days": 3}, tc[0].function.arguments
    assert tc[0].id.startswith("call_") and len(tc[0].id) == 29, tc[0].id
    # streaming: the same call in deltas, the id on the first one
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, stream=True,
                                            max_tokens=len(script) + 5))
    deltas = [d for k in chunks if k.choices for d in (k.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather", deltas
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris", "days": 3}
    assert [k for k in chunks if k.choices and k.choices[0].finish_reason][0].choices[0].finish_reason == "tool_calls"
    # the round trip: the call and its result in the history render (and are answered)
    hist = msgs + [{"role": "assistant", "content": None, "tool_calls": [tc[0].model_dump()]},
                   {"role": "tool", "tool_call_id": tc[0].id, "content": "{\"temp\": 21}"}]
    r2 = c.chat.completions.create(model="tiny", messages=hist, tools=WEATHER, max_tokens=3, tool_choice="none")
    assert r2.choices[0].message.tool_calls is None, r2
    st, tk, _ = post(s, "/tokenize", {"model": "tiny", "messages": hist, "tools": WEATHER})
    text = tokenizer().decode(tk["tokens"], skip_special_tokens=False)
    assert st == 200 and "<function=get_weather>" in text and "Paris" in text and "{\"temp\": 21}" in text, text
    # tool_choice none: the call stays text (the parser is off for it)
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, tool_choice="none",
                                  max_tokens=len(script) + 5)
    assert r.choices[0].message.tool_calls is None and "<function=get_weather>" in r.choices[0].message.content, r
    assert r.choices[0].finish_reason == "stop", r
    # a named choice of an unknown tool, a required choice without tools: 400 naming tool_choice
    for kw in ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"tool_choice": "required"}):
        try:
            c.chat.completions.create(model="tiny", messages=msgs, max_tokens=3, **kw)
            raise AssertionError("accepted %s" % kw)
        except openai.BadRequestError as e:
            assert e.body["param"].startswith("tool_choice"), e.body
    # bad history: arguments that are not JSON, an assistant tool call without a name
    bad = msgs + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                        "function": {"name": "get_weather", "arguments": "{oops"}}]}]
    st, d, _ = post(s, "/v1/chat/completions", {"model": "tiny", "messages": bad})
    assert st == 400 and d["error"]["param"] == "messages[1].tool_calls[0].function.arguments", d
    assert s.stop() == 0
    # named and required: the prompt opens the call, so the model cannot answer otherwise
    s = mock_stepd(mock_args=("--script", ",".join(map(str, tool_call_ids("\n<parameter=city>\nRome\n</parameter>\n"
                                                                         "</function>\n</tool_call>")))))
    c = client(s)
    r = c.chat.completions.create(model="tiny", messages=msgs, tools=WEATHER, max_tokens=30,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tc = r.choices[0].message.tool_calls
    assert tc and tc[0].function.name == "get_weather" and json.loads(tc[0].function.arguments) == {"city": "Rome"}, r
    st, tk, _ = post(s, "/tokenize", {"model": "tiny", "messages": msgs, "tools": WEATHER})
    assert s.stop() == 0


def test_disconnect():
    s = mock_stepd(mock_args=("--delay-ms", "20"))
    eng = s.engines[0]
    c = socket.create_connection(("127.0.0.1", s.ports["http"]))
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4000, "stream": True}).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d"
              b"\r\n\r\n%s" % (len(body), body))
    got = b""
    c.settimeout(10)
    while got.count(b"data: ") < 5:
        b = c.recv(4096)
        assert b and got.startswith(b"HTTP/1.1 200") or not got, got
        got += b
    c.close()
    t0 = time.time()
    wait_until(lambda: s.metric("stepd:aborts_sent_total") == 1, timeout=5, step=0.002, what="the Abort")
    print("   client gone -> Abort sent to the engine in %.0f ms (tokens every 20 ms)" % (1000 * (time.time() - t0)))
    wait_until(lambda: eng.stats().get("abort", 0) == 1, timeout=5, what="the engine's abort")
    wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
    # a client that goes away while its (non-streaming) request waits in the queue: it
    # leaves the queue on the close itself, while the running request ahead of it is held
    # by its stopped engine (SIGSTOP; the worker timeout and heartbeats an hour, so the
    # group stays up), not when a slot frees later; the waits are hang guards
    s2 = mock_stepd("--max-running", "1", "--worker-timeout-ms", "3600000", "--heartbeat-ms", "3600000",
                    mock_args=("--delay-ms", "50"))
    eng2 = s2.engines[0]
    busy = threading.Thread(target=lambda: post(s2, "/v1/completions", {"model": "tiny", "prompt": "x",
                                                                        "max_tokens": 20}))
    busy.start()
    wait_until(lambda: s2.metric("stepd:num_requests_running") == 1, timeout=30, what="one running")
    eng2.proc.send_signal(signal.SIGSTOP)
    try:
        c = socket.create_connection(("127.0.0.1", s2.ports["http"]))
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 50}).encode()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: s2.metric("stepd:num_requests_waiting") == 1, timeout=30, what="one queued")
        c.close()
        wait_until(lambda: s2.metric("stepd:num_requests_waiting") == 0, timeout=60,
                   what="the queued one gone while the running one is held")
        assert s2.metric("stepd:num_requests_running") == 1 and busy.is_alive(), s2.metrics()
    finally:
        eng2.proc.send_signal(signal.SIGCONT)
    busy.join()
    assert s2.metric('stepd:request_status_total{code="CANCELLED"}') == 1, s2.metrics()
    assert s.stop() == 0 and s2.stop() == 0


def test_bad_inputs():
    s = mock_stepd("--http-max-body-bytes", "65536", "--http-timeout", "2")
    eng = s.engines[0]
    base = {"model": "tiny", "messages": chat_msgs(), "max_tokens": 2}
    cases = [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"n": 0}, "n"),
        ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias[5]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"num_speculative_tokens": 9}, "num_speculative_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
         "messages[0].content[0].type"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"tools": {"a": 1}}, "tools"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"request_id": "has space"}, "request_id"),
        ({"model": None}, "model"),
        ({"model": 7}, "model"),
    ]
    for extra, field in cases:
        body = dict(base, **extra)
        if extra.get("model", 1) is None:
            body.pop("model")
        st, d, _ = post(s, "/v1/chat/completions", body)
        assert st == 400, (extra, st, d)
        assert d["error"]["param"] == field and d["error"]["message"].startswith(field), (extra, d)
    # NaN and Infinity are not JSON: the field is named all the same
    for tok in ("NaN", "Infinity", "-Infinity"):
        st, d, _ = post(s, "/v1/chat/completions", None,
                        raw_body='{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
                                 '"temperature": %s}' % tok)
        assert st == 400 and d["error"]["param"] == "temperature", (tok, d)
    # not JSON at all, not an object, invalid UTF-8 (in a string and as raw bytes)
    for b in (b"{not json", b"[1, 2]", b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}'):
        st, d, _ = post(s, "/v1/chat/completions", None, raw_body=b)
        assert st == 400 and d["error"]["type"] == "invalid_request_error", (b, d)
    # completions: one prompt, prompt types
    for p, field in ((["a", "b"], "prompt"), (5, "prompt"), ([1, "x"], "prompt[1]"), (None, "prompt")):
        st, d, _ = post(s, "/v1/completions", {"model": "tiny", "prompt": p} if p is not None else {"model": "tiny"})
        assert st == 400 and d["error"]["param"] == field, (p, d)
    assert eng.stats().get("generate", 0) == 0, eng.stats()      # nothing reached the engine
    rss0 = s.rss_kib()
    # oversized body: refused from its Content-Length, before it is read; the connection closed
    big = b"x" * (1 << 20)
    out = raw(s.ports["http"], b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(big)
              + big[:1000])
    assert out.startswith(b"HTTP/1.1 413") and b"65536 bytes" in out and b"request_too_large" in out, out[:300]
    assert CLOSED[-1], "the connection stayed open after a 413"
    # ... and one sent chunked, without a length: read and dropped, then 413
    chunk = b"%x\r\n%s\r\n" % (32768, b"y" * 32768)
    out = raw(s.ports["http"], b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n" +
              chunk * 4 + b"0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413"), out[:300]
    # a 1 MB header: 431, the connection closed
    out = raw(s.ports["http"], b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431") and CLOSED[-1], out[:300]
    # slow loris: headers a byte at a time, never complete; cut after --http-timeout (2 s)
    # with 408 or a close, while others are served.  An event wait: the server closes while
    # the header is still incomplete (a 1 MB header would take the loop > 60 s to send)
    lor = socket.create_connection(("127.0.0.1", s.ports["http"]))
    lor.settimeout(0.25)
    closed = False
    got = b""
    for k, ch in enumerate(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"z" * 240):
        try:
            lor.sendall(bytes([ch]))
        except OSError:
            closed = True
            break
        try:
            b = lor.recv(4096)
            got += b
            if not b:
                closed = True
                break
        except socket.timeout:
            pass
        if k % 4 == 3:
            still_serving(s)
    lor.close()
    assert closed, "a header sent a byte at a time for over a minute was never cut"
    assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
    # slowly sent body: the same deadline; the server closes before the body is complete
    body = json.dumps(dict(base, user="u" * 600)).encode()
    lor = socket.create_connection(("127.0.0.1", s.ports["http"]))
    lor.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
    lor.settimeout(0.1)
    out = b""
    sent = 0
    try:
        for k in range(len(body) - 1):
            lor.sendall(body[k:k + 1])
            sent = k + 1
            try:
                b = lor.recv(4096)
                out += b
                if not b:
                    break
            except socket.timeout:
                pass
    except OSError:
        pass
    lor.close()
    assert sent < len(body) - 1 and (out == b"" or out.startswith(b"HTTP/1.1 408")), (sent, len(body), out)
    # wrong method, unknown path
    st, d, _ = get(s, "/v1/chat/completions")
    assert st == 405, st
    st, d, _ = get(s, "/v2/everything")
    assert st == 404 and json.loads(d)["error"]["code"] == "not_found", d
    # memory stays bounded over a few hundred refusals of each kind
    for _ in range(100):
        post(s, "/v1/chat/completions", dict(base, temperature="x"))
        raw(s.ports["http"], b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 9999999\r\n\r\n")
        raw(s.ports["http"], b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n")
    rss1 = s.rss_kib()
    print("   RSS %d -> %d KiB over 300 refused requests" % (rss0, rss1))
    assert rss1 - rss0 < 16 * 1024, (rss0, rss1)
    still_serving(s)
    assert s.stop() == 0


def test_endpoints():
    s = mock_stepd()
    st, d, _ = post(s, "/tokenize", {"model": "tiny", "prompt": "In the beginning", "return_token_strs": True})
    want = tokenizer().encode("In the beginning").ids
    assert st == 200 and d["tokens"] == want and d["count"] == len(want) and d["max_model_len"] == 4096, d
    assert len(d["token_strs"]) == len(want), d
    st, d2, _ = post(s, "/detokenize", {"model": "tiny", "tokens": want})
    assert st == 200 and d2["prompt"] == tokenizer().decode(want), d2
    st, d3, _ = post(s, "/detokenize", {"tokens": [1, tokenizer_size()]})
    assert st == 400 and d3["error"]["param"] == "tokens[1]", d3
    st, d4, _ = post(s, "/tokenize", {"model": "tiny", "messages": chat_msgs()})
    gt = s.inf.Tokenize(pb.TokenizeRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role=m["role"],
                                                                                      content=m["content"])
                                                                         for m in chat_msgs()])), timeout=5)
    assert st == 200 and d4["tokens"] == list(gt.token_ids), (d4, gt)
    for port in (s.ports["http"], s.ports["metrics"]):
        st, body, _ = get(s, "/health", port)
        assert st == 200, st
        st, body, _ = get(s, "/ready", port)
        assert st == 200 and json.loads(body)["status"] == "ready", body
        st, body, _ = get(s, "/healthz", port)
        assert st == 200 and body == b"ready\n", body
        st, body, r = get(s, "/metrics", port)
        assert st == 200 and b"stepd:time_to_first_token_seconds_bucket" in body, body[:200]
        assert r.getheader("Content-Type").startswith("text/plain; version=0.0.4"), r.getheaders()
    # the metrics port serves only that
    st, _, _ = post(s, "/v1/completions", {"model": "tiny", "prompt": "x"}) if False else (None, None, None)
    c = http.client.HTTPConnection("127.0.0.1", s.ports["metrics"], timeout=5)
    c.request("POST", "/v1/completions", body="{}")
    assert c.getresponse().status == 404
    c.close()
    # readiness: 503 with the reason while no group is ready
    s.engines[0].kill()
    wait_until(lambda: get(s, "/ready")[0] == 503, what="not ready")
    st, body, _ = get(s, "/ready")
    assert "not ready: " in json.loads(body)["error"]["message"], body
    assert get(s, "/health")[0] == 200
    st, d, _ = post(s, "/v1/completions", {"model": "tiny", "prompt": "x"})
    assert st == 503 and d["error"]["type"] == "service_unavailable_error", d
    assert s.stop() == 0


def test_tls_and_key():
    from test_coord import make_pki
    d = tempfile.mkdtemp(prefix="stepd-http-pki-")
    make_pki(d)
    p = lambda n: os.path.join(d, n)  # noqa: E731
    # a non-loopback --host needs TLS and a key (or --insecure-listen)
    r = subprocess.run([STEPD_BIN, "--host", "0.0.0.0", "--port", "0",
                        "--metrics-listen", ""], capture_output=True, text=True, timeout=10)
    assert r.returncode != 0 and "refusing to serve HTTP on non-loopback 0.0.0.0" in r.stderr, r.stderr
    key = "http-key-42"
    s = Stepd("--tokenizer", TOKENIZER, "--host", "0.0.0.0", "--tls-cert", p("server.crt"), "--tls-key",
              p("server.key"), env={"STEPD_API_KEY": key})
    s.start_engine("g0", "--vocab", str(VOCAB))
    ctx = ssl.create_default_context(cafile=p("ca.crt"))

    def ready():
        c = http.client.HTTPSConnection("localhost", s.ports["http"], context=ctx, timeout=5)
        c.request("GET", "/ready")
        st = c.getresponse().status
        c.close()
        return st == 200
    wait_until(ready, timeout=10, what="ready over HTTPS")
    try:
        import httpx2 as httpx      # what this openai release is built on
    except ImportError:
        import httpx
    url = "https://localhost:%d/v1" % s.ports["http"]
    good = openai.OpenAI(base_url=url, api_key=key, max_retries=0, http_client=httpx.Client(verify=ctx))
    r = good.completions.create(model="mock-step", prompt="In the beginning", max_tokens=3)
    assert r.usage.completion_tokens == 3, r
    for bad in ("wrong", ""):
        cl = openai.OpenAI(base_url=url, api_key=bad or "x", max_retries=0, http_client=httpx.Client(
            verify=ctx, headers={} if bad else {"Authorization": ""}))
        try:
            cl.models.list()
            raise AssertionError("served without the key")
        except openai.AuthenticationError as e:
            assert e.status_code == 401 and e.body["code"] == "invalid_api_key", e.body
    # probes need no key
    c = http.client.HTTPSConnection("localhost", s.ports["http"], context=ctx, timeout=5)
    c.request("GET", "/health")
    assert c.getresponse().status == 200
    c.close()
    # plaintext to the TLS port gets nowhere
    out = raw(s.ports["http"], b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n", timeout=3)
    assert not out.startswith(b"HTTP/1.1 200"), out
    assert s.stop() == 0


# ------------------------------------------------------------------ the real worker


def real_stepd(*args, worker_args=()):
    s = Stepd("--tokenizer", TOKENIZER, *args)
    s.start_worker("g0", "--threads", "1", *worker_args)
    s.wait_ready(1, timeout=120)
    return s


def grpc_generate(s, **kw):
    toks, text, finals, chunks = collect(s.inf.Generate(pb.GenerateRequest(**kw), timeout=120))
    return toks, text, finals[0], chunks


def test_equality():
    # K = 3 drafting every step (draft_policy fixed: the adaptive default may draft none here)
    for wargs in ((), ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 3,
                                                           "draft_policy": "fixed"}))):
        s = real_stepd(worker_args=wargs)
        c = client(s)
        # completions: text prompt, greedy
        r = c.completions.create(model="tiny-step", prompt="In the beginning God", max_tokens=40, temperature=0,
                                 extra_body={"return_token_ids": True})
        toks, text, fin, _ = grpc_generate(s, text="In the beginning God", sampling_params=pb.SamplingParams(
            max_tokens=40, temperature=0), stream_options=pb.StreamOptions(include_token_ids=True))
        assert r.choices[0].model_extra["token_ids"] == toks and r.choices[0].text == text, (r, toks, text)
        # streamed the same
        parts = list(c.completions.create(model="tiny-step", prompt="In the beginning God", max_tokens=40,
                                          temperature=0, stream=True, extra_body={"return_token_ids": True}))
        assert [t for p in parts if p.choices for t in p.choices[0].model_extra.get("token_ids", [])] == toks
        assert "".join(p.choices[0].text for p in parts if p.choices) == text
        # chat: the template, the parsers
        msgs = chat_msgs()
        r = c.chat.completions.create(model="tiny-step", messages=msgs, max_tokens=40, temperature=0,
                                      extra_body={"return_token_ids": True})
        toks, text, fin, chunks = grpc_generate(
            s, chat=pb.ChatInput(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs]),
            sampling_params=pb.SamplingParams(max_tokens=40, temperature=0),
            stream_options=pb.StreamOptions(include_token_ids=True))
        m = r.choices[0].message
        assert r.choices[0].model_extra["token_ids"] == toks, (r, toks)
        assert (m.model_extra.get("reasoning_content") or "") == "".join(k.reasoning_delta for k in chunks)
        assert (m.content or "") == "".join(k.content_delta for k in chunks)
        assert r.usage.completion_tokens == fin.usage.completion_tokens == 40
        if wargs:
            assert r.model_extra["stepd"]["choices"][0]["mtp"]["num_drafts"] > 0, r.model_extra
        assert s.stop() == 0


def test_reasoning_split():
    s = real_stepd()
    c = client(s)
    msgs = [{"role": "user", "content": "Who made the heaven and the earth?"}]
    # greedy, the tiny model thinks the whole time: everything is reasoning
    r = c.chat.completions.create(model="tiny-step", messages=msgs, max_tokens=24, temperature=0)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and not m.content, m
    assert r.usage.completion_tokens_details.reasoning_tokens == 24, r.usage
    # with </think> made likely it closes its thinking after a few tokens: the split, at the tag
    bias = {"4": 12}      # </think>
    r = c.chat.completions.create(model="tiny-step", messages=msgs, max_tokens=24, temperature=0, logit_bias=bias,
                                  extra_body={"return_token_ids": True})
    m = r.choices[0].message
    ids = r.choices[0].model_extra["token_ids"]
    _, raw_text, _, chunks = grpc_generate(
        s, chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=msgs[0]["content"])]),
        sampling_params=pb.SamplingParams(max_tokens=24, temperature=0, logit_bias={4: 12}))
    before, tag, after = raw_text.partition("</think>")
    assert tag and m.model_extra["reasoning_content"] == before.rstrip("\n"), (raw_text, m)
    assert m.content == after.lstrip("\n") and m.content, (raw_text, m)
    assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(4), (ids, r.usage)
    # streamed: the reasoning deltas, then content deltas
    chunks = list(c.chat.completions.create(model="tiny-step", messages=msgs, max_tokens=24, temperature=0,
                                            logit_bias=bias, stream=True))
    kinds = [("r" if k.choices[0].delta.model_extra.get("reasoning_content") else "c")
             for k in chunks if k.choices and (k.choices[0].delta.content or
                                               k.choices[0].delta.model_extra.get("reasoning_content"))]
    assert kinds == sorted(kinds, reverse=True) and "r" in kinds and "c" in kinds, kinds
    assert s.stop() == 0


def test_logprobs():
    s = real_stepd()
    c = client(s)
    r = c.chat.completions.create(model="tiny-step", messages=chat_msgs(), max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True})
    lp = r.choices[0].logprobs.content
    ids = r.choices[0].model_extra["token_ids"]
    _, _, _, chunks = grpc_generate(
        s, chat=pb.ChatInput(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in chat_msgs()]),
        sampling_params=pb.SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    g = [x for k in chunks for x in k.logprobs]
    assert len(lp) == len(g) == len(ids) == 8, (len(lp), len(g))
    tok = tokenizer()
    for a, b, i in zip(lp, g, ids):
        assert b.token_id == i and abs(a.logprob - b.logprob) < 1e-5, (a, b)
        assert bytes(a.bytes) == tok.decode([i], skip_special_tokens=False).encode() or a.bytes, a
        assert len(a.top_logprobs) == 3 and abs(a.top_logprobs[0].logprob - b.top[0].logprob) < 1e-5, (a, b)
        assert a.top_logprobs[0].logprob >= a.top_logprobs[1].logprob >= a.top_logprobs[2].logprob
    # completions' shape: the parallel arrays
    r = c.completions.create(model="tiny-step", prompt="In the beginning", max_tokens=5, temperature=0, logprobs=2)
    l2 = r.choices[0].logprobs
    assert len(l2.tokens) == len(l2.token_logprobs) == len(l2.top_logprobs) == len(l2.text_offset) == 5, l2
    assert "".join(l2.tokens) == r.choices[0].text and l2.text_offset[0] == 0, l2
    assert all(len(t) == 2 for t in l2.top_logprobs), l2
    assert s.stop() == 0


if __name__ == "__main__":
    run_tests([
        ("openai_client", test_openai_client),
        ("sse_framing", test_sse_framing),
        ("tool_calls", test_tool_calls),
        ("disconnect", test_disconnect),
        ("bad_inputs", test_bad_inputs),
        ("endpoints", test_endpoints),
        ("tls_and_key", test_tls_and_key),
        ("equality", test_equality),
        ("reasoning_split", test_reasoning_split),
        ("logprobs", test_logprobs),
    ])
