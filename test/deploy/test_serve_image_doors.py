#!/usr/bin/env python3
"""test_serve_image_doors.py - images in on the Responses and Anthropic Messages doors of a
running `stepd serve` (issue 40: "images in, on every door").

Served end to end on the tiny model's vision tower (helpers from test_serve_images.py):
  - the same two images and text (a 40x30 PNG: the global view only; a 1000x600 one: 2 crops
    plus the global view) as chat completions `image_url` parts, as Responses `input_image`
    parts (the `openai` client's responses.create) and as Messages `image` blocks with base64
    sources (the `anthropic` client): the same prompt token count and the same greedy text
    (reasoning and answer), streamed and not;
  - Messages count_tokens counts each image's token layout (equal to chat's prompt_tokens);
  - a Responses follow-up turn with previous_response_id carries the stored turn's images;
  - an image in a Responses function_call_output and in a Messages tool_result is taken.
Refused with a 400 naming the part and the problem, the server answering after each:
  a truncated PNG (on both doors), Responses file_id, detail "high", a URL that is not a
  data URL, an image in an assistant turn; Messages a media_type outside PNG/JPEG/WebP/GIF,
  an http URL source outside --allowed-media-domains, a document block, an image in an
  assistant turn or in system.
Fetched (--allowed-media-domains 127.0.0.1; test_serve_images.py's http.server on 127.0.0.1),
as the chat door fetches: a Responses input_image http URL and a Messages url source give the
same greedy text (streamed and not) and token count as the same image sent as data; a 404 and
a host not allowed are a 400 naming the door's part; a follow-up with previous_response_id
fetches the stored turn's URL again; a client gone during its fetch on either door: the fetch
stopped, the request dropped, the server serving on.
"""
import base64
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proclib as pl  # noqa: E402
import test_serve_images as si  # noqa: E402

MAX = 16


def post(port, path, body):
    return si.post(port, body, path=path)


def refused(port, path, body, at, needle):
    code, r = post(port, path, body)
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else str(r)
    assert code == 400 and msg.startswith(at) and needle in msg, (code, r, at, needle)
    print("   400 %s" % msg)
    served(port)


def served(port):
    """the server still answers a text request on both doors"""
    code, r = post(port, "/v1/responses", {"model": "tiny-step", "input": "Hello", "max_output_tokens": 4})
    assert code == 200 and r["status"] in ("completed", "incomplete"), (code, r)
    code, r = post(port, "/v1/messages", {"model": "tiny-step", "max_tokens": 4,
                                          "messages": [{"role": "user", "content": "Hello"}]})
    assert code == 200 and r["type"] == "message", (code, r)


def b64(data):
    return base64.b64encode(data).decode()


def resp_parts(a, b):
    return [{"type": "input_text", "text": "Compare"}, {"type": "input_image", "image_url": a, "detail": "auto"},
            {"type": "input_text", "text": "with"}, {"type": "input_image", "image_url": b}]


def msg_image(data, mime="image/png"):
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": b64(data)}}


def resp_text(r):
    """a Responses answer's reasoning and text joined by "|" """
    return ("".join(c.text for it in r.output if it.type == "reasoning" for c in (it.content or [])) + "|" +
            "".join(c.text for it in r.output if it.type == "message" for c in it.content))


def resp_stream_text(oc, **kw):
    ev, parts = None, ["", ""]
    for ev in oc.responses.create(stream=True, **kw):
        if ev.type == "response.reasoning_text.delta":
            parts[0] += ev.delta
        elif ev.type == "response.output_text.delta":
            parts[1] += ev.delta
    assert ev.type in ("response.completed", "response.incomplete"), ev
    return "|".join(parts)


def msg_text(mr):
    return ("".join(c.thinking for c in mr.content if c.type == "thinking") + "|" +
            "".join(c.text for c in mr.content if c.type == "text"))


def msg_stream_text(ac, **kw):
    parts = ["", ""]
    with ac.messages.stream(**kw) as st:
        for e in st:
            if e.type == "content_block_delta" and e.delta.type == "thinking_delta":
                parts[0] += e.delta.thinking
            elif e.type == "content_block_delta" and e.delta.type == "text_delta":
                parts[1] += e.delta.text
    return "|".join(parts)


def test_doors(d):
    import anthropic
    import openai

    p, port = si.serve(d, ["--allowed-media-domains", "images.example.org"])
    try:
        base = "http://127.0.0.1:%d" % port
        oc = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        ac = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        pa, pb = si.png(40, 30), si.png(1000, 600)
        a, b = si.data_url(pa), si.data_url(pb)

        # the chat door's greedy text: the reference
        chat = oc.chat.completions.create(
            model="tiny-step", max_tokens=MAX, temperature=0,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Compare"}, si.part(a),
                                                   {"type": "text", "text": "with"}, si.part(b)]}])
        m = chat.choices[0].message
        ref = (getattr(m, "reasoning_content", None) or "") + "|" + (m.content or "")
        n_prompt = chat.usage.prompt_tokens
        print("   chat: %d prompt tokens, %r" % (n_prompt, ref))
        assert n_prompt > 2 * 169 + 2 * 81 and len(ref) > 8, (chat.usage, ref)

        # Responses: input_image parts
        rin = [{"role": "user", "content": resp_parts(a, b)}]
        r = oc.responses.create(model="tiny-step", input=rin, max_output_tokens=MAX, temperature=0)
        assert r.usage.input_tokens == n_prompt and resp_text(r) == ref, (r, ref)
        got = resp_stream_text(oc, model="tiny-step", input=rin, max_output_tokens=MAX, temperature=0)
        assert got == ref, (got, ref)
        print("   responses, streamed and not: %d input tokens, the chat door's text" % n_prompt)
        # the stored turn's images come with it into the next
        r2 = oc.responses.create(model="tiny-step", previous_response_id=r.id, input="And now?",
                                 max_output_tokens=4, temperature=0)
        assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > n_prompt, r2
        print("   previous_response_id: %d input tokens, %d cached" % (
            r2.usage.input_tokens, r2.usage.input_tokens_details.cached_tokens))

        # an image in a function_call_output
        code, fr = post(port, "/v1/responses", {"model": "tiny-step", "max_output_tokens": 4, "input": [
            {"role": "user", "content": "Look"},
            {"type": "function_call", "call_id": "c1", "name": "see", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": a}]}]})
        assert code == 200 and fr["usage"]["input_tokens"] > 169, (code, fr)
        print("   an image in a function_call_output: %d input tokens" % fr["usage"]["input_tokens"])

        # Messages: image blocks
        mmsgs = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, msg_image(pa),
                                              {"type": "text", "text": "with"}, msg_image(pb)]}]
        mr = ac.messages.create(model="tiny-step", max_tokens=MAX, temperature=0, messages=mmsgs)
        # Anthropic's input_tokens leave out what was read from the (prefix) cache
        assert (mr.usage.input_tokens + (mr.usage.cache_read_input_tokens or 0) == n_prompt and
                msg_text(mr) == ref), (mr, ref)
        got = msg_stream_text(ac, model="tiny-step", max_tokens=MAX, temperature=0, messages=mmsgs)
        assert got == ref, (got, ref)
        code, ct = post(port, "/v1/messages/count_tokens", {"model": "tiny-step", "messages": mmsgs})
        assert code == 200 and ct["input_tokens"] == n_prompt, (code, ct, n_prompt)
        print("   messages, streamed and not: %d input tokens (count_tokens too), the chat door's text" % n_prompt)
        code, tr = post(port, "/v1/messages", {"model": "tiny-step", "max_tokens": 4, "messages": [
            {"role": "user", "content": "Look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "see", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "here"}, msg_image(pa)]}]}]})
        n_tr = tr["usage"]["input_tokens"] + tr["usage"].get("cache_read_input_tokens", 0) if code == 200 else 0
        assert code == 200 and n_tr > 169, (code, tr)
        print("   an image in a tool_result: %d input tokens" % n_tr)

        # bad parts: a 400 naming each, the server serving on
        short = pb[:len(pb) // 2]
        R, M = "/v1/responses", "/v1/messages"

        def rbody(*content, role="user"):
            return {"model": "tiny-step", "max_output_tokens": 4, "input": [{"role": role, "content": list(content)}]}

        def mbody(*content, role="user", **kw):
            return dict(model="tiny-step", max_tokens=4, messages=[{"role": role, "content": list(content)}], **kw)

        txt, rtxt = {"type": "text", "text": "Look"}, {"type": "input_text", "text": "Look"}
        refused(port, R, {"model": "tiny-step", "input": [{"role": "user", "content": resp_parts(a, si.data_url(short))}]},
                "input[0].content[3]", "corrupt or truncated PNG image")
        refused(port, R, rbody(rtxt, {"type": "input_image", "file_id": "file-123"}),
                "input[0].content[1].file_id", "file_id images are not supported: send image_url")
        refused(port, R, rbody(rtxt, {"type": "input_image", "image_url": a, "detail": "high"}),
                "input[0].content[1].detail", "only \"auto\" is supported")
        refused(port, R, rbody(rtxt, {"type": "input_image", "image_url": "ftp://images.example.org/x.png"}),
                "input[0].content[1].image_url", "must be a data: URL")
        refused(port, R, rbody({"type": "input_image", "image_url": "https://evil.example.com/x.png"}),
                "input[0].content[0]", "domain 'evil.example.com' is not allowed")
        refused(port, R, rbody({"type": "input_image", "image_url": a}, role="assistant"),
                "input[0].content[0].type", "taken in user, system and developer messages")
        refused(port, M, mbody(txt, msg_image(pa), txt, msg_image(short)),
                "messages.0.content.3", "corrupt or truncated PNG image")
        refused(port, M, mbody(txt, msg_image(pa, "image/bmp")),
                "messages.0.content.1.source.media_type", "must be \"image/png\"")
        refused(port, M, mbody(txt, {"type": "image", "source": {"type": "url", "url": "https://evil.example.com/a.png"}}),
                "messages.0.content.1", "domain 'evil.example.com' is not allowed")
        refused(port, M, mbody(txt, {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                    "data": "hi"}}),
                "messages.0.content.1.type", "\"document\" blocks are not supported")
        refused(port, M, mbody(msg_image(pa), role="assistant"),
                "messages.0.content.0.type", "taken in user messages and tool_result content")
        refused(port, M, mbody(txt, system=[{"type": "text", "text": "Be brief"}, msg_image(pa)]),
                "system.1.type", "taken in user messages and tool_result content")
        si.stop(p)
    finally:
        p.kill()


def hang_up(port, path, body):
    """a request whose fetch stalls, the client hanging up after 0.5 s"""
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=0.5)
        raise AssertionError("a stalled fetch answered on " + path)
    except OSError:
        pass


def test_fetch(d):
    import anthropic
    import openai

    img = si.png(700, 300)
    srv = si.ImageServer({"/cat.png": img}, 1 << 20)
    # --media-fetch-timeout 300: only the cancellation can end a stalled fetch within the wait
    p, port = si.serve(d, ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "300"])
    try:
        base = "http://127.0.0.1:%d" % port
        oc = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        ac = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        url, data = srv.url("/cat.png"), si.data_url(img)
        rtxt = {"type": "input_text", "text": "What is this?"}

        # Responses: the image by URL and as a data URL
        def rin(u):
            return [{"role": "user", "content": [rtxt, {"type": "input_image", "image_url": u}]}]
        kw = dict(model="tiny-step", max_output_tokens=MAX, temperature=0)
        ref = oc.responses.create(input=rin(data), **kw)
        got = oc.responses.create(input=rin(url), **kw)
        print("   responses by URL: %r, %d input tokens" % (resp_text(got), got.usage.input_tokens))
        assert ref.usage.input_tokens > 169 and len(resp_text(ref)) > 8, ref
        assert resp_text(got) == resp_text(ref) and got.usage.input_tokens == ref.usage.input_tokens, (got, ref)
        assert resp_stream_text(oc, input=rin(url), **kw) == resp_text(ref)
        # the stored turn's URL is fetched again for the next
        r2 = oc.responses.create(previous_response_id=got.id, input="And now?", max_output_tokens=4, temperature=0,
                                 model="tiny-step")
        assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > ref.usage.input_tokens, r2
        print("   responses by URL, streamed and not, and a follow-up: the data URL's text")

        # Messages: a url source and a base64 one
        def mmsgs(src):
            return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image", "source": src}]}]
        usrc = {"type": "url", "url": url}
        bsrc = {"type": "base64", "media_type": "image/png", "data": b64(img)}
        kw = dict(model="tiny-step", max_tokens=MAX, temperature=0)
        mref = ac.messages.create(messages=mmsgs(bsrc), **kw)
        mgot = ac.messages.create(messages=mmsgs(usrc), **kw)
        print("   messages by URL: %r" % msg_text(mgot))
        assert len(msg_text(mref)) > 8 and msg_text(mgot) == msg_text(mref), (mgot, mref)
        assert msg_stream_text(ac, messages=mmsgs(usrc), **kw) == msg_text(mref)
        code, ct = post(port, "/v1/messages/count_tokens", {"model": "tiny-step", "messages": mmsgs(usrc)})
        code2, ct2 = post(port, "/v1/messages/count_tokens", {"model": "tiny-step", "messages": mmsgs(bsrc)})
        assert code == code2 == 200 and ct == ct2 and ct["input_tokens"] > 169, (code, ct, code2, ct2)
        print("   messages by URL, streamed and not, count_tokens (%d): the base64 source's" % ct["input_tokens"])

        # a 404 and a host not allowed: a 400 naming the part
        R, M = "/v1/responses", "/v1/messages"

        def rbody(u):
            return {"model": "tiny-step", "max_output_tokens": 4, "input": rin(u)}

        def mbody(u):
            return {"model": "tiny-step", "max_tokens": 4, "messages": mmsgs({"type": "url", "url": u})}
        missing, other = srv.url("/missing.png"), srv.url("/cat.png", host="localhost")
        refused(port, R, rbody(missing), "input[0].content[1]", "the image URL answered HTTP status 404")
        refused(port, R, rbody(other), "input[0].content[1]", "domain 'localhost' is not allowed")
        refused(port, M, mbody(missing), "messages.0.content.1", "the image URL answered HTTP status 404")
        refused(port, M, mbody(other), "messages.0.content.1", "domain 'localhost' is not allowed")
        code, ct = post(port, "/v1/messages/count_tokens", {"model": "tiny-step", "messages": mmsgs(
            {"type": "url", "url": missing})})
        assert code == 400 and ct["error"]["message"].startswith("messages.0.content.1"), (code, ct)

        # the client gone during its fetch, on each door: dropped, the server serving on
        drop = "dropped: the client went away while its images were fetched and decoded"
        stall = srv.url("/stall.png")
        hang_up(port, R, rbody(stall))
        pl.wait_until(lambda: p.text().count(drop) == 1, 30, "the Responses request of the client gone dropped")
        hang_up(port, M, mbody(stall))
        pl.wait_until(lambda: p.text().count(drop) == 2, 30, "the Messages request of the client gone dropped")
        served(port)
        assert resp_text(oc.responses.create(input=rin(url), model="tiny-step", max_output_tokens=MAX,
                                             temperature=0)) == resp_text(ref)
        print("   a client gone during its fetch on each door: the fetch stopped, the server goes on serving")
        si.stop(p)
    finally:
        p.kill()
        srv.close()


def main():
    pl.run_cases([("two images on the Responses and Messages doors: the chat door's text; bad parts a 400",
                   test_doors),
                  ("http(s) image URLs fetched on the Responses and Messages doors as on the chat door",
                   test_fetch)], "stepd-serve-image-doors-", 5000)
    print("stepd serve, images on the Responses and Messages doors: all checks passed")


if __name__ == "__main__":
    main()
