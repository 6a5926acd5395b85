#!/usr/bin/env python3
"""The agent-harness doors of stepd, driven by the vendors' own clients: OpenAI's Responses API
(/v1/responses, the `openai` package's client.responses) and Anthropic's Messages API
(/v1/messages, the `anthropic` package's messages.create / messages.stream).

Against mock engines (--script replays a chosen model output in the tiny tokenizer's ids):
  plain_text         a text answer through both doors' clients, streamed and not: output_text,
                     the message item's events, text blocks, stop_reason end_turn/stop_sequence
  responses_tools    a two-turn tool round trip (reasoning, a function_call item, its
                     function_call_output, the answer), streamed and not, usage, the event
                     sequence, GET/DELETE of a stored response, a missing id -> 404 naming it
  messages_tools     the same with tool_use / tool_result blocks, thinking blocks (thinking
                     disabled: none returned, its tokens counted, the same prompt), stop_reason
                     tool_use, messages.stream's events, x-api-key
  four_doors         the same replayed output with two tool calls through gRPC, chat
                     completions, responses and messages, streamed and not: the same calls
  single_call        parallel_tool_calls false / tool_choice.disable_parallel_tool_use: the
                     first of two calls only, streamed and not, on both doors
  forced_choice      a named tool choice and required/any open the call in the prompt on both
                     doors (the replayed output holds only the rest of it); auto does not
  server_errors      429 (queue full) and 504 (deadline) in each door's shape; after the
                     stream began: response.failed / an error event
  store_bounds       --responses-store-size evicts the oldest; store 0 / store false keep none
  disconnect         a client of either door that goes away (streaming or not): one Abort
  bad_requests       at least 15 malformed requests per door -> 400 (404 for ids) in that
                     API's error shape naming the field; the server serves throughout
  http_errors        401 (no key, a wrong one), 403 (Host, Origin), 413, 415, framing 400 and
                     405, answered before a route runs: Anthropic's shape under /v1/messages,
                     OpenAI's on /v1/chat/completions
  mutated_requests   a full request per door with one value replaced or removed (seeded,
                     150 each, streamed and not): 200 or an error in the API's shape, no crash
Against the real CPU worker on the tiny model:
  tiny_model         plain text through both doors, streamed and not; reasoning returned;
                     usage; previous_response_id continues a conversation with its prompt
                     reported as cached; count_tokens equals the prompt's usage
"""
import http.client
import json
import os
import socket
import sys
import threading
import time

from stepd_harness import TOKENIZER, Stepd, collect, pb, run_tests, wait_until

try:
    import anthropic
    import openai
except ImportError as e:  # test tools (tools/dev/install-deps.sh installs them): their absence is a failure
    print("openai/anthropic Python packages not importable: %s" % e)
    sys.exit(1)

VOCAB = 4000


def tokenizer():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(TOKENIZER)


def ids_of(text):
    return tokenizer().encode(text, add_special_tokens=False).ids


def mock_stepd(*args, script=None, env=None):
    s = Stepd("--tokenizer", TOKENIZER, "--served-model-name", "tiny", *args, env=env)
    s.start_engine("g0", "--vocab", str(VOCAB), *(("--script", ",".join(map(str, script))) if script else ()))
    if env and "STEPD_API_KEY" in env:
        # GetServerInfo needs the key: the HTTP readiness probe does not
        end = time.time() + 10
        while request(s, "GET", "/ready")[0] != 200:
            assert time.time() < end, s.read_log()
            time.sleep(0.02)
    else:
        s.wait_ready(1)
    return s


def oai(s, key="none"):
    return openai.OpenAI(base_url=s.http + "/v1", api_key=key, max_retries=0, timeout=60)


def ant(s, key="none"):
    return anthropic.Anthropic(base_url=s.http, api_key=key, max_retries=0, timeout=60)


def request(s, method, path, body=None, headers=None, raw_body=None):
    c = http.client.HTTPConnection("127.0.0.1", s.ports["http"], timeout=30)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request(method, path, body=raw_body if raw_body is not None else (None if body is None else json.dumps(body)),
              headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data


def sse(s, path, body):
    """A streamed answer's events: [(event, data)]."""
    st, data = request(s, "POST", path, dict(body, stream=True))
    assert st == 200, (st, data)
    out = []
    for block in data.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


TWO_CALLS = ("Two calls.\n</think>\nLet me check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
             "Paris\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
             "Rome\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
CALL = ("I will look it up.\n</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def still_serving(s):
    st, d = request(s, "POST", "/v1/completions", {"model": "tiny", "prompt": "In the beginning", "max_tokens": 2})
    assert st == 200 and d["choices"][0]["finish_reason"] == "length", (st, d)


# ------------------------------------------------------------------ mock engine


def test_responses_tools():
    s = mock_stepd(script=ids_of(CALL))
    c = oai(s)
    tools = [dict(WEATHER, type="function")]
    r = c.responses.create(model="tiny", input="Weather in Paris for 3 days?", tools=tools, max_output_tokens=80)
    assert r.status == "completed", r
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert r.output[0].content[0].text == "I will look it up.", r.output[0]
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris", "days": 3}, fc
    assert fc.call_id.startswith("call_"), fc
    assert r.usage.output_tokens == len(ids_of(CALL)) and r.usage.input_tokens > 0, r.usage
    assert r.usage.output_tokens_details.reasoning_tokens > 0, r.usage
    # streamed: the semantic events, the same items
    ev = list(c.responses.create(model="tiny", input="Weather in Paris for 3 days?", tools=tools,
                                 max_output_tokens=80, stream=True))
    types = [e.type for e in ev]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed", types
    for t in ("response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
              "response.function_call_arguments.delta", "response.function_call_arguments.done",
              "response.output_item.done"):
        assert t in types, (t, types)
    assert [e.sequence_number for e in ev] == list(range(len(ev))), ev
    args = "".join(e.delta for e in ev if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris", "days": 3}, args
    done = ev[-1].response
    assert [o.type for o in done.output] == kinds and done.output[1].arguments == args, done
    # the second turn: the call's output -> the answer (the mock replays the same ids: the
    # point is the history the template renders, checked through /tokenize's text below)
    hist = [{"role": "user", "content": "Weather in Paris for 3 days?"},
            {"type": "reasoning", "id": r.output[0].id, "summary": [],
             "content": [{"type": "reasoning_text", "text": "I will look it up."}]},
            {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
            {"type": "function_call_output", "call_id": fc.call_id, "output": "{\"temp\": 21}"}]
    r2 = c.responses.create(model="tiny", input=hist, tools=tools, tool_choice="none", max_output_tokens=80)
    assert r2.status == "completed" and r2.output[-1].type == "message", r2
    assert "<function=get_weather>" in r2.output_text, r2.output_text      # tool_choice none: text
    assert r2.usage.input_tokens > r.usage.input_tokens, (r.usage, r2.usage)
    # previous_response_id: the same history, by id
    r3 = c.responses.create(model="tiny", previous_response_id=r.id, tool_choice="none", tools=tools,
                            input=[{"type": "function_call_output", "call_id": fc.call_id,
                                    "output": "{\"temp\": 21}"}], max_output_tokens=80)
    assert r3.usage.input_tokens == r2.usage.input_tokens, (r2.usage, r3.usage)
    # GET and DELETE; a missing id: 404 naming it
    g = c.responses.retrieve(r.id)
    assert g.id == r.id and g.output[1].arguments == fc.arguments, g
    st, d = request(s, "DELETE", "/v1/responses/" + r.id)
    assert st == 200 and d["deleted"] is True, d
    for method in ("GET", "DELETE"):
        st, d = request(s, method, "/v1/responses/" + r.id)
        assert st == 404 and r.id in d["error"]["message"], (st, d)
    try:
        c.responses.create(model="tiny", previous_response_id=r.id, input="again", max_output_tokens=4)
        raise AssertionError("a deleted previous_response_id was accepted")
    except openai.NotFoundError as e:
        assert e.body["param"] == "previous_response_id" and r.id in e.body["message"], e.body
    still_serving(s)
    assert s.stop() == 0


def test_messages_tools():
    s = mock_stepd(script=ids_of(CALL), env={"STEPD_API_KEY": "sekrit"})
    a = ant(s, key="sekrit")
    tools = [{"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}]
    msgs = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    m = a.messages.create(model="tiny", max_tokens=80, messages=msgs, tools=tools)
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["thinking", "tool_use"], m.content
    # anthropic 0.34.2 predates thinking blocks: the block's fields arrive as extras
    assert m.content[0].model_extra["thinking"] == "I will look it up.", m.content[0]
    tu = m.content[1]
    assert tu.name == "get_weather" and tu.input == {"city": "Paris", "days": 3} and tu.id.startswith("call_"), tu
    assert m.usage.output_tokens == len(ids_of(CALL)) and m.usage.input_tokens > 0, m.usage
    # messages.stream: the events, the same blocks
    with a.messages.stream(model="tiny", max_tokens=80, messages=msgs, tools=tools) as st:
        events = list(st)
        final = st.get_final_message()
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types, types
    # the prompt's length is known when the stream starts
    assert events[0].message.usage.input_tokens > 0, events[0].message.usage
    assert final.stop_reason == "tool_use" and final.content[1].input == {"city": "Paris", "days": 3}, final
    thinking = "".join(e.delta.model_extra.get("thinking", "") for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
    assert thinking == "I will look it up.", thinking
    assert final.usage.output_tokens == m.usage.output_tokens, final.usage
    # the round trip: tool_use and tool_result blocks in the history
    hist = msgs + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "I will look it up.",
                                                      "signature": ""},
                                                     {"type": "tool_use", "id": tu.id, "name": tu.name,
                                                      "input": tu.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id,
                                                 "content": "{\"temp\": 21}"}]}]
    m2 = a.messages.create(model="tiny", max_tokens=80, messages=hist, tools=tools, tool_choice={"type": "none"})
    assert m2.stop_reason == "end_turn" and m2.content[-1].type == "text", m2
    assert "<function=get_weather>" in m2.content[-1].text, m2          # tool_choice none: text
    n = a.messages.count_tokens(model="tiny", messages=hist, tools=tools) if hasattr(a.messages, "count_tokens") \
        else None
    st, d = request(s, "POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": hist, "tools": tools},
                    headers={"x-api-key": "sekrit"})
    assert st == 200 and d["input_tokens"] == m2.usage.input_tokens + m2.usage.cache_read_input_tokens, (d, m2.usage)
    assert n is None or n.input_tokens == d["input_tokens"]
    # thinking disabled: no thinking blocks
    m3 = a.messages.create(model="tiny", max_tokens=80, messages=msgs, tools=tools, extra_body={
        "thinking": {"type": "disabled"}})
    assert [b.type for b in m3.content] == ["tool_use"], m3.content
    # ... the model still thinks (the template has no switch): its tokens are counted and
    # streamed as no event; the prompt is the one without a thinking field
    assert m3.usage.output_tokens == m.usage.output_tokens and m3.usage.input_tokens + \
        m3.usage.cache_read_input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens, m3.usage
    body = {"model": "tiny", "messages": msgs, "tools": tools}
    with a.messages.stream(model="tiny", max_tokens=80, messages=msgs, tools=tools,
                           extra_body={"thinking": {"type": "disabled"}}) as st:
        events = list(st)
    assert not [e for e in events if e.type == "content_block_start" and e.content_block.type != "tool_use"], events
    assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"], events
    for extra in ({}, {"thinking": {"type": "disabled"}}):
        st_, d = request(s, "POST", "/v1/messages/count_tokens", dict(body, **extra), headers={"x-api-key": "sekrit"})
        assert st_ == 200 and d["input_tokens"] == m.usage.input_tokens + m.usage.cache_read_input_tokens, (extra, d)
    # cut while it thinks: no block at all
    st_, d = request(s, "POST", "/v1/messages", dict(body, max_tokens=3, thinking={"type": "disabled"}),
                     headers={"x-api-key": "sekrit"})
    assert st_ == 200 and d["content"] == [] and d["stop_reason"] == "max_tokens" and \
        d["usage"]["output_tokens"] == 3, (st_, d)
    # the key: x-api-key as the Bearer key; a wrong one is 401
    try:
        ant(s, key="wrong").messages.create(model="tiny", max_tokens=4, messages=msgs)
        raise AssertionError("a wrong x-api-key was accepted")
    except anthropic.AuthenticationError:
        pass
    st, d = request(s, "POST", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": msgs},
                    headers={"Authorization": "Bearer sekrit"})
    assert st == 200 and d["type"] == "message", (st, d)
    assert s.stop() == 0


def test_plain_text():
    s = mock_stepd(script=ids_of("Short.\n</think>\nIn the beginning was the word."))
    c, a = oai(s), ant(s)
    r = c.responses.create(model="tiny", input="How did it begin?", max_output_tokens=40)
    assert r.status == "completed" and r.output_text == "In the beginning was the word.", r
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output[1].role == "assistant", r.output
    ev = list(c.responses.create(model="tiny", input="How did it begin?", max_output_tokens=40, stream=True))
    types = [e.type for e in ev]
    i = types.index("response.output_text.delta")
    assert types[i - 2:i] == ["response.output_item.added", "response.content_part.added"], types
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], types
    assert "".join(e.delta for e in ev if e.type == "response.output_text.delta") == r.output_text
    assert ev[-1].response.usage.output_tokens == r.usage.output_tokens, ev[-1].response.usage
    msgs = [{"role": "user", "content": "How did it begin?"}]
    m = a.messages.create(model="tiny", max_tokens=40, messages=msgs)
    assert m.stop_reason == "end_turn" and m.content[-1].text == "In the beginning was the word.", m
    with a.messages.stream(model="tiny", max_tokens=40, messages=msgs) as st:
        text = "".join(st.text_stream)
        final = st.get_final_message()
    assert text == m.content[-1].text and final.stop_reason == "end_turn", (text, final)
    assert final.usage.output_tokens == m.usage.output_tokens and final.usage.input_tokens == m.usage.input_tokens
    # a stop sequence: stop_reason stop_sequence, the sequence named
    m = a.messages.create(model="tiny", max_tokens=40, messages=msgs, stop_sequences=["was"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "was", m
    assert m.content[-1].text == "In the beginning ", m
    assert s.stop() == 0


def test_disconnect():
    s = Stepd("--tokenizer", TOKENIZER, "--served-model-name", "tiny")
    s.start_engine("g0", "--vocab", str(VOCAB), "--delay-ms", "20")
    s.wait_ready(1)
    eng = s.engines[0]
    msgs = [{"role": "user", "content": "x"}]
    n = 0
    for path, body in (("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 4000}),
                       ("/v1/messages", {"model": "tiny", "max_tokens": 4000, "messages": msgs})):
        for stream in (True, False):
            c = socket.create_connection(("127.0.0.1", s.ports["http"]))
            data = json.dumps(dict(body, stream=stream)).encode()
            c.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d"
                      b"\r\n\r\n%s" % (path.encode(), len(data), data))
            if stream:
                got = b""
                c.settimeout(10)
                while got.count(b"event: ") < 6:
                    b = c.recv(4096)
                    assert b, got
                    got += b
            else:
                wait_until(lambda: s.metric("stepd:num_requests_running") == 1, what="running")
            c.close()
            n += 1
            wait_until(lambda: s.metric("stepd:aborts_sent_total") == n, timeout=5, what="the Abort of %s" % path)
            wait_until(lambda: eng.stats().get("abort", 0) == n, timeout=5, what="the engine's abort")
            wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
    still_serving(s)
    assert s.stop() == 0


def calls_of_chat(r):
    m = r.choices[0].message
    return (m.model_extra.get("reasoning_content") or "", m.content or "",
            [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []])


def test_four_doors():
    script = ids_of(TWO_CALLS)
    s = mock_stepd(script=script)
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    tools = [{"type": "function", "function": WEATHER}]
    want = ("Two calls.", "Let me check both.",
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})])
    n = len(script) + 5
    # gRPC: the stream is the only form
    _, _, fin, chunks = collect(s.inf.Generate(pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=msgs[0]["content"])],
                          tools_json=json.dumps(tools)),
        sampling_params=pb.SamplingParams(max_tokens=n)), timeout=60))
    calls = {}
    for k in chunks:
        for t in k.tool_calls:
            c = calls.setdefault(t.index, [t.name, ""])
            c[1] += t.arguments_delta
    got = ("".join(k.reasoning_delta for k in chunks), "".join(k.content_delta for k in chunks),
           [(v[0], json.loads(v[1])) for _, v in sorted(calls.items())])
    assert got[0] == want[0] and got[1].strip() == want[1] and got[2] == want[2], got
    want = got      # every door: exactly what the pipeline made
    # chat completions
    c = oai(s)
    assert calls_of_chat(c.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=n)) == want
    parts = list(c.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=n, stream=True))
    calls, reasoning, content = {}, "", ""
    for p in parts:
        if not p.choices:
            continue
        d = p.choices[0].delta
        reasoning += d.model_extra.get("reasoning_content") or ""
        content += d.content or ""
        for t in d.tool_calls or []:
            cc = calls.setdefault(t.index, ["", ""])
            cc[0] += t.function.name or ""
            cc[1] += t.function.arguments or ""
    assert (reasoning, content, [(v[0], json.loads(v[1])) for _, v in sorted(calls.items())]) == want
    # responses
    rtools = [dict(WEATHER, type="function")]

    def of_output(output):
        return ("".join(o.content[0].text for o in output if o.type == "reasoning"),
                "".join(o.content[0].text for o in output if o.type == "message"),
                [(o.name, json.loads(o.arguments)) for o in output if o.type == "function_call"])
    r = c.responses.create(model="tiny", input=msgs, tools=rtools, max_output_tokens=n)
    assert of_output(r.output) == want, r.output
    ev = list(c.responses.create(model="tiny", input=msgs, tools=rtools, max_output_tokens=n, stream=True))
    added = {e.output_index: e.item for e in ev if e.type == "response.output_item.added"}
    deltas = {}
    for e in ev:
        if e.type.endswith(".delta"):
            deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
    streamed = ("".join(deltas[i] for i, it in added.items() if it.type == "reasoning"),
                "".join(deltas[i] for i, it in added.items() if it.type == "message"),
                [(it.name, json.loads(deltas[i])) for i, it in sorted(added.items()) if it.type == "function_call"])
    assert streamed == want, streamed
    assert of_output(ev[-1].response.output) == want
    # messages
    a = ant(s)
    atools = [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}]

    def of_blocks(content):
        return ("".join(b.model_extra["thinking"] for b in content if b.type == "thinking"),
                "".join(b.text for b in content if b.type == "text"),
                [(b.name, b.input) for b in content if b.type == "tool_use"])
    m = a.messages.create(model="tiny", max_tokens=n, messages=msgs, tools=atools)
    assert of_blocks(m.content) == want and m.stop_reason == "tool_use", m
    starts, parts = {}, {}
    for name, d in sse(s, "/v1/messages", {"model": "tiny", "max_tokens": n, "messages": msgs, "tools": atools}):
        if name == "content_block_start":
            starts[d["index"]] = d["content_block"]
        elif name == "content_block_delta":
            dd = d["delta"]
            parts[d["index"]] = parts.get(d["index"], "") + dd.get("text", dd.get("thinking", dd.get("partial_json",
                                                                                                        "")))
    streamed = ("".join(parts[i] for i, b in starts.items() if b["type"] == "thinking"),
                "".join(parts[i] for i, b in starts.items() if b["type"] == "text"),
                [(b["name"], json.loads(parts[i])) for i, b in sorted(starts.items()) if b["type"] == "tool_use"])
    assert streamed == want, streamed
    assert s.stop() == 0


def test_single_call():
    # parallel_tool_calls false (Responses) and tool_choice.disable_parallel_tool_use (Messages):
    # the first call only, the output ends where the second would start, streamed and not
    script = ids_of(TWO_CALLS)
    s = mock_stepd(script=script)
    c, a = oai(s), ant(s)
    msgs = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    rtools = [dict(WEATHER, type="function")]
    n = len(script) + 5
    r = c.responses.create(model="tiny", input=msgs, tools=rtools, max_output_tokens=n)
    assert [o.type for o in r.output].count("function_call") == 2, r.output     # the default: both
    r = c.responses.create(model="tiny", input=msgs, tools=rtools, max_output_tokens=n, parallel_tool_calls=False)
    fc = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(fc) == 1 and json.loads(fc[0].arguments) == {"city": "Paris"}, r.output
    assert r.parallel_tool_calls is False and r.usage.output_tokens < len(script), r
    ev = list(c.responses.create(model="tiny", input=msgs, tools=rtools, max_output_tokens=n,
                                 parallel_tool_calls=False, stream=True))
    added = [e.item for e in ev if e.type == "response.output_item.added" and e.item.type == "function_call"]
    args = "".join(e.delta for e in ev if e.type == "response.function_call_arguments.delta")
    assert len(added) == 1 and json.loads(args) == {"city": "Paris"}, [e.type for e in ev]
    assert ev[-1].type == "response.completed" and [o.arguments for o in ev[-1].response.output
                                                    if o.type == "function_call"] == [fc[0].arguments], ev[-1]
    atools = [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}]
    for choice in ({"type": "auto", "disable_parallel_tool_use": True}, {"type": "any", "disable_parallel_tool_use": True}):
        body = {"model": "tiny", "max_tokens": n, "messages": msgs, "tools": atools, "tool_choice": choice}
        if choice["type"] == "any":     # the call opened in the prompt: the replayed output starts inside it
            s.stop()
            s = mock_stepd(script=ids_of(TWO_CALLS.split("<function=", 1)[1]))
            a = ant(s)
        m = a.messages.create(**body)
        tu = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(tu) == 1 and tu[0].input == {"city": "Paris"}, (choice, m)
        assert m.usage.output_tokens < len(script), m.usage
        starts, parts = {}, {}
        for name, d in sse(s, "/v1/messages", body):
            if name == "content_block_start":
                starts[d["index"]] = d["content_block"]
            elif name == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
                parts[d["index"]] = parts.get(d["index"], "") + d["delta"]["partial_json"]
            elif name == "message_delta":
                assert d["delta"]["stop_reason"] == "tool_use", d
        calls = [(b["name"], json.loads(parts[i])) for i, b in sorted(starts.items()) if b["type"] == "tool_use"]
        assert calls == [("get_weather", {"city": "Paris"})], (choice, calls)
        m = a.messages.create(**dict(body, tool_choice=dict(choice, disable_parallel_tool_use=False)))
        assert [b.type for b in m.content].count("tool_use") == 2, (choice, m.content)
    assert s.stop() == 0


def test_forced_choice():
    # a named choice ends the prompt with the call opened and named, required/any with the call
    # opened: the model writes the rest (the replayed outputs start there)
    args = "\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    q = "Weather in Rome?"
    rtools = [dict(WEATHER, type="function")]
    atools = [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}]
    for script, rchoice, achoice in ((args, {"type": "function", "name": "get_weather"},
                                      {"type": "tool", "name": "get_weather"}),
                                     ("get_weather>" + args, "required", {"type": "any"})):
        s = mock_stepd(script=ids_of(script))
        c, a = oai(s), ant(s)
        r = c.responses.create(model="tiny", input=q, tools=rtools, tool_choice=rchoice, max_output_tokens=60)
        fc = [o for o in r.output if o.type == "function_call"]
        assert len(fc) == 1 and fc[0].name == "get_weather" and json.loads(fc[0].arguments) == {"city": "Rome"}, r
        m = a.messages.create(model="tiny", max_tokens=60, messages=[{"role": "user", "content": q}], tools=atools,
                              tool_choice=achoice)
        assert m.stop_reason == "tool_use" and m.content[-1].input == {"city": "Rome"}, m
        # auto: the same output is no call (none was opened)
        r = c.responses.create(model="tiny", input=q, tools=rtools, max_output_tokens=60)
        assert not [o for o in r.output if o.type == "function_call"], r.output
        m = a.messages.create(model="tiny", max_tokens=60, messages=[{"role": "user", "content": q}], tools=atools)
        assert m.stop_reason == "end_turn" and "tool_use" not in [b.type for b in m.content], m
        assert s.stop() == 0


def test_server_errors():
    # 429 (the queue is full: one running, none queued) and 504 (the request's deadline) in
    # each door's shape, streamed and not
    s = Stepd("--tokenizer", TOKENIZER, "--served-model-name", "tiny", "--max-running", "1", "--max-queue", "0",
              "--request-timeout", "0.5")
    s.start_engine("g0", "--vocab", str(VOCAB), "--delay-ms", "100")
    s.wait_ready(1)
    q = [{"role": "user", "content": "x"}]
    doors = (("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": 50}),
             ("/v1/messages", {"model": "tiny", "max_tokens": 50, "messages": q}))
    for path, body in doors:
        wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
        st, d = request(s, "POST", path, body)
        assert st == 504, (path, st, d)
        if path == "/v1/responses":
            assert d["error"]["type"] == "timeout_error", d
        else:
            assert d["type"] == "error" and d["error"]["type"] == "api_error" and "deadline" in d["error"]["message"], d
        # (the slot is free once the engine has let the request go, just after the answer)
        wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
        ev = sse(s, path, body)             # the stream began: the failure is its last event
        if path == "/v1/responses":
            assert ev[-1][0] == "response.failed" and ev[-1][1]["response"]["status"] == "failed", ev[-1]
            assert "deadline" in ev[-1][1]["response"]["error"]["message"], ev[-1]
        else:
            assert ev[-1][0] == "error" and ev[-1][1]["error"]["type"] == "api_error", ev[-1]
        wait_until(lambda: s.metric("stepd:num_requests_running") == 0, what="idle")
        hold = threading.Thread(target=lambda: request(s, "POST", path, body))
        hold.start()
        wait_until(lambda: s.metric("stepd:num_requests_running") == 1, what="one running")
        st, d = request(s, "POST", path, dict(body, max_tokens=2) if "messages" in body else body)
        assert st == 429, (path, st, d)
        assert (d["error"]["type"] == "rate_limit_error"), d
        hold.join()
    assert s.stop() == 0


def test_store_bounds():
    s = mock_stepd("--responses-store-size", "2")
    c = oai(s)
    ids = [c.responses.create(model="tiny", input="x%d" % i, max_output_tokens=2).id for i in range(3)]
    st, d = request(s, "GET", "/v1/responses/" + ids[0])
    assert st == 404, (st, d)                       # the oldest went
    for i in ids[1:]:
        assert c.responses.retrieve(i).id == i
    r = c.responses.create(model="tiny", input="y", max_output_tokens=2, store=False)
    st, d = request(s, "GET", "/v1/responses/" + r.id)
    assert st == 404 and r.store is False, (st, d)
    assert s.stop() == 0
    s = mock_stepd("--responses-store-size", "0")
    c = oai(s)
    r = c.responses.create(model="tiny", input="x", max_output_tokens=2)
    st, d = request(s, "GET", "/v1/responses/" + r.id)
    assert st == 404, (st, d)
    try:
        c.responses.create(model="tiny", input="x", max_output_tokens=2, previous_response_id=r.id)
        raise AssertionError("previous_response_id accepted without a store")
    except openai.BadRequestError as e:
        assert e.body["param"] == "previous_response_id", e.body
    assert s.stop() == 0


RESPONSES_BAD = [
    # (body or raw bytes, expected param)
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"input": "hi"}, "model"),
    ({"model": 7, "input": "hi"}, "model"),
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": 42}, "input"),
    ({"model": "tiny", "input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"model": "tiny", "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),
    ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_video"}]}]}, "input[0].content[0].type"),
    ({"model": "tiny", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments"),
    ({"model": "tiny", "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"model": "tiny", "input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "hm"}]}]}, "input[1]"),
    ({"model": "tiny", "input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]},
     "input[0].content[0]"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"model": "tiny", "input": "hi", "tools": [dict(WEATHER, type="function")],
      "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"model": "tiny", "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"model": "tiny", "input": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "input": "hi", "temperature": -1}, "temperature"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "tiny", "input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"model": "tiny", "input": "hi", "frobnicate": 1}, "frobnicate"),
    ({"model": "tiny", "input": "hi", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"model": "tiny", "input": "hi", "stream": "yes"}, "stream"),
    ({"model": "tiny", "input": "hi", "truncation": "auto"}, "truncation"),
]

MESSAGES_BAD = [
    (b"{not json", None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "tiny", "max_tokens": 4}, "messages"),
    ({"model": "tiny", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages.0.content.0"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]}, "messages.0.content.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": "[]"}]}]}, "messages.0.content.0.input"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, "tool_choice.disable_parallel_tool_use"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice"),
    ({"model": "tiny", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "stop_sequences": "x"}, "stop_sequences"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
      "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_k": -5}, "top_k"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     "frobnicate"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "system": 5}, "system"),
]


def test_bad_requests():
    s = mock_stepd()
    assert len(RESPONSES_BAD) >= 15 and len(MESSAGES_BAD) >= 15
    for body, param in RESPONSES_BAD:
        st, d = request(s, "POST", "/v1/responses", raw_body=body if isinstance(body, bytes) else json.dumps(body))
        assert st == 400, (body, st, d)
        e = d["error"]
        assert set(e) >= {"message", "type", "param", "code"} and e["type"] == "invalid_request_error", (body, d)
        assert e["param"] == param and (param is None or e["message"].startswith(param + ":")), (body, d)
        still_serving(s)
    st, d = request(s, "GET", "/v1/responses/resp_nope")
    assert st == 404 and "resp_nope" in d["error"]["message"], (st, d)
    for body, field in MESSAGES_BAD:
        st, d = request(s, "POST", "/v1/messages", raw_body=body if isinstance(body, bytes) else json.dumps(body))
        assert st == 400, (body, st, d)
        assert d["type"] == "error" and d["error"]["type"] == "invalid_request_error", (body, d)
        assert field is None or d["error"]["message"].startswith(field + ":"), (body, d)
        still_serving(s)
    # the same through the clients: their exception classes
    try:
        ant(s).messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [{"type": "x"}]}])
        raise AssertionError("accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["message"].startswith("messages.0.content.0.type:"), e.body
    try:
        ant(s).messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("accepted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    assert s.stop() == 0


def raw(s, data):
    """Raw bytes to the HTTP port; the answer's status and JSON body (the server closes or
    keeps the connection: the body is read by its Content-Length)."""
    c = socket.create_connection(("127.0.0.1", s.ports["http"]), timeout=10)
    c.sendall(data)
    got = b""
    while b"\r\n\r\n" not in got:
        b = c.recv(65536)
        assert b, got
        got += b
    head, body = got.split(b"\r\n\r\n", 1)
    n = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0])
    while len(body) < n:
        b = c.recv(65536)
        assert b, (head, body)
        body += b
    c.close()
    return int(head.split(b" ")[1]), json.loads(body)


def test_http_errors():
    # what http.c answers before a route runs, in the shape of the path's API: Anthropic's under
    # /v1/messages, OpenAI's elsewhere
    s = mock_stepd("--http-max-body-bytes", "65536", env={"STEPD_API_KEY": "sekrit"})
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}).encode()
    key = b"x-api-key: sekrit\r\n"
    cases = [  # (status, Anthropic's error type, the request's head lines after the request line)
        (401, "authentication_error", b"Content-Type: application/json\r\n"),
        (401, "authentication_error", b"x-api-key: wrong\r\nContent-Type: application/json\r\n"),
        (403, "permission_error", b"Host: evil.example\r\n" + key),
        (403, "permission_error", b"Origin: http://evil.example\r\n" + key),
        (413, "request_too_large", key + b"Content-Type: application/json\r\nContent-Length: 100000\r\n"),
        (415, "invalid_request_error", key + b"Content-Type: text/plain\r\n"),
        (400, "invalid_request_error", key + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"),
    ]
    for path in (b"/v1/messages", b"/v1/messages/count_tokens", b"/v1/chat/completions"):
        for status, etype, head in cases:
            if b"Host:" not in head:
                head = b"Host: localhost\r\n" + head
            if b"Content-Length" not in head:
                head += b"Content-Length: %d\r\n" % len(body)
            st, d = raw(s, b"POST " + path + b" HTTP/1.1\r\n" + head + b"\r\n" + (b"" if b"100000" in head else body))
            assert st == status, (path, head, st, d)
            if path.startswith(b"/v1/messages"):
                assert d["type"] == "error" and d["error"]["type"] == etype and d["error"]["message"], (path, head, d)
            else:
                assert set(d) == {"error"} and d["error"]["message"] and "param" in d["error"], (path, head, d)
        still_serving_keyed = request(s, "POST", "/v1/messages", json.loads(body), headers={"x-api-key": "sekrit"})
        assert still_serving_keyed[0] == 200, still_serving_keyed
    # a method the path does not serve: 405 in the path's shape too
    st, d = request(s, "GET", "/v1/messages", headers={"x-api-key": "sekrit"})
    assert st == 405 and d["type"] == "error" and d["error"]["type"] == "invalid_request_error", (st, d)
    # through the anthropic client: its exception classes
    try:
        ant(s, key="wrong").messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was accepted")
    except anthropic.AuthenticationError as e:
        assert e.body["type"] == "error" and e.body["error"]["type"] == "authentication_error", e.body
    assert s.stop() == 0


def mutations(body, rnd, n):
    """n bodies like body with one value somewhere replaced by a value of another kind."""
    odd = [None, True, -1, 0, 2 ** 40, 1.5e308, "", "x" * 300, [], {}, [None], {"type": None}, "\u00e9\ud7ff"]

    def paths(v, p=()):
        yield p
        if isinstance(v, dict):
            for k, x in v.items():
                yield from paths(x, p + (k,))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                yield from paths(x, p + (i,))
    all_paths = [p for p in paths(body) if p]
    for _ in range(n):
        b = json.loads(json.dumps(body))
        p = rnd.choice(all_paths)
        o = b
        for k in p[:-1]:
            o = o[k]
        if isinstance(o, dict) and rnd.random() < 0.2:
            del o[p[-1]]
        else:
            o[p[-1]] = rnd.choice(odd)
        yield b


def test_mutated_requests():
    import random
    rnd = random.Random(44)
    s = mock_stepd(script=ids_of(CALL))
    rtools = [dict(WEATHER, type="function")]
    atools = [{"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}]
    bodies = {
        "/v1/responses": {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 8, "tools": rtools,
                          "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {"effort": "low"},
                          "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]},
                                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                     "arguments": "{\"city\": \"Paris\"}"},
                                    {"type": "function_call_output", "call_id": "c1", "output": "21"}]},
        "/v1/messages": {"model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
                         "tools": atools, "tool_choice": {"type": "tool", "name": "get_weather"},
                         "stop_sequences": ["zz"], "temperature": 0.5, "top_k": 5,
                         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                      {"role": "assistant", "content": [
                                          {"type": "thinking", "thinking": "t", "signature": ""},
                                          {"type": "tool_use", "id": "c1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
                                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                                    "content": [{"type": "text", "text": "21"}]}]}]},
    }
    seen = {}
    for path, body in bodies.items():
        st, d = request(s, "POST", path, body)
        assert st == 200, (path, d)
        for b in mutations(body, rnd, 150):
            for stream in (False, True):
                st, d = request(s, "POST", path, dict(b, stream=True) if stream else b)
                assert st in (200, 400, 404), (path, b, st, d)
                if st != 200:
                    assert ("error" in d and "message" in d["error"]), (path, b, d)
                seen[st] = seen.get(st, 0) + 1
    print("   300 mutated bodies per door, streamed and not: statuses %s" % sorted(seen.items()))
    still_serving(s)
    assert s.stop() == 0


# ------------------------------------------------------------------ the real worker


def test_tiny_model():
    s = Stepd("--tokenizer", TOKENIZER)
    s.start_worker("g0", "--threads", "1")
    s.wait_ready(1, timeout=120)
    c = oai(s)
    # greedy, the tiny model thinks the whole time: everything is reasoning; </think> made likely
    # by a bias is out of these doors' fields, so the text part is checked on the mock above
    r = c.responses.create(model="tiny-step", input="Who made the heaven and the earth?", max_output_tokens=16,
                           temperature=0, instructions="Be brief.", reasoning={"effort": "low"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text, r.output
    assert r.usage.output_tokens == 16 and r.usage.output_tokens_details.reasoning_tokens == 16, r.usage
    ev = list(c.responses.create(model="tiny-step", input="Who made the heaven and the earth?",
                                 max_output_tokens=16, temperature=0, instructions="Be brief.",
                                 reasoning={"effort": "low"}, stream=True))
    assert ev[-1].type == "response.incomplete", [e.type for e in ev]
    assert "".join(e.delta for e in ev if e.type == "response.reasoning_text.delta") == r.output[0].content[0].text
    # the same request through chat completions: the same reasoning (one prompt, one pipeline)
    cc = c.chat.completions.create(model="tiny-step", max_tokens=16, temperature=0, reasoning_effort="low",
                                   messages=[{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Who made the heaven and the earth?"}])
    assert cc.choices[0].message.model_extra["reasoning_content"] == r.output[0].content[0].text, cc
    assert cc.usage.prompt_tokens == r.usage.input_tokens, (cc.usage, r.usage)
    # previous_response_id: the conversation continues, its prompt served from the prefix cache
    # (instructions are not carried over, as in OpenAI's API: the same ones again, the same prefix)
    r2 = c.responses.create(model="tiny-step", previous_response_id=r.id, input="And then?", max_output_tokens=4,
                            temperature=0, instructions="Be brief.", reasoning={"effort": "low"})
    assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens, r2.usage
    assert r2.usage.input_tokens_details.cached_tokens > 0, r2.usage
    # messages: thinking and usage, against chat completions without a reasoning effort
    q = [{"role": "user", "content": "Who made the heaven and the earth?"}]
    cc0 = c.chat.completions.create(model="tiny-step", max_tokens=16, temperature=0,
                                    messages=[{"role": "system", "content": "Be brief."}] + q)
    a = ant(s)
    m = a.messages.create(model="tiny-step", max_tokens=16, temperature=0, system="Be brief.", messages=q)
    assert m.stop_reason == "max_tokens" and m.content[0].type == "thinking", m
    assert m.content[0].model_extra["thinking"] == cc0.choices[0].message.model_extra["reasoning_content"], m
    assert m.usage.output_tokens == 16 and m.usage.input_tokens + m.usage.cache_read_input_tokens == \
        cc0.usage.prompt_tokens and m.usage.cache_read_input_tokens > 0, m.usage     # cc0's prompt, cached
    with a.messages.stream(model="tiny-step", max_tokens=16, temperature=0, system="Be brief.", messages=q) as st:
        events = list(st)
        final = st.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 16, final
    assert "".join(e.delta.model_extra["thinking"] for e in events
                   if e.type == "content_block_delta" and e.delta.type == "thinking_delta") == \
        m.content[0].model_extra["thinking"]
    # count_tokens: the prompt as served; a thinking budget up to 4096 is the template's "low"
    for extra, want in (({}, cc0.usage.prompt_tokens),
                        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, cc.usage.prompt_tokens)):
        st_, d = request(s, "POST", "/v1/messages/count_tokens", dict(extra, model="tiny-step", system="Be brief.",
                                                                      messages=q))
        assert st_ == 200 and d["input_tokens"] == want, (extra, d, want)
    assert s.stop() == 0


if __name__ == "__main__":
    run_tests([
        ("plain_text", test_plain_text),
        ("responses_tools", test_responses_tools),
        ("messages_tools", test_messages_tools),
        ("four_doors", test_four_doors),
        ("single_call", test_single_call),
        ("forced_choice", test_forced_choice),
        ("server_errors", test_server_errors),
        ("store_bounds", test_store_bounds),
        ("disconnect", test_disconnect),
        ("bad_requests", test_bad_requests),
        ("http_errors", test_http_errors),
        ("mutated_requests", test_mutated_requests),
        ("tiny_model", test_tiny_model),
    ])
