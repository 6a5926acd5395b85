#!/usr/bin/env python3
"""test_serve_grpc_images.py - images in on the public gRPC door of a running `stepd serve`
(issue 40): GenerateRequest.images carry encoded image bytes (ImageInput.data), placed by one
"<im_patch>" each in the chat messages or the prompt text; the coordinator decodes, checks,
preprocesses and hashes them as the chat door does.

One `stepd serve` on the tiny model (its vision tower; MTP K=3 configured,
--limit-mm-per-prompt '{"image": 2}'), a python gRPC client with stubs made from
proto/stepd.proto:
  - a chat with two PNG images (40x30: the global view only; 1000x600: 2 crops plus the global
    view) gives the same greedy text as the OpenAI chat door with the same images, with K=0
    and K=3, and the same prompt token count;
  - the same images placed in a prompt text: K=0 and K=3 give the same greedy text, the prompt
    holds both layouts, the second request is served from cached KV and one with another first
    image (the same layout) is not; only <im_patch> is matched in the text ("<im_start>" stays
    text);
  - bad bytes, a truncated PNG, too many images, images and placeholders that do not match in
    number, the engine wire's fields set, token_ids input with images: INVALID_ARGUMENT naming
    images[i] (or the field) and the reason;
  - the server still answers a text request after each of them, and exits cleanly.
"""
import json
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))
import proclib as pl  # noqa: E402
from stepd_harness import grpc, pb, pbg  # noqa: E402
from test_serve_images import data_url, part, png, post, serve, stop  # noqa: E402

MARK = "<im_patch>"


def generate(stub, req):
    """(reasoning|content, raw text, final) of a GenerateRequest, or raise grpc.RpcError"""
    reasoning, content, text, final = "", "", "", None
    for m in stub.Generate(req, timeout=120):
        if m.HasField("chunk"):
            reasoning += m.chunk.reasoning_delta
            content += m.chunk.content_delta
            text += m.chunk.text
        else:
            final = m.final
    return reasoning + "|" + content, text, final


def sampling():
    return pb.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def chat_req(content, images, k):
    return pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=content)]),
                              images=[pb.ImageInput(data=b) for b in images], sampling_params=sampling(),
                              num_speculative_tokens=k)


def text_req(text, images, k=0, **kw):
    return pb.GenerateRequest(text=text, images=[pb.ImageInput(data=b) for b in images], sampling_params=sampling(),
                              num_speculative_tokens=k, **kw)


def refused(stub, req, want):
    try:
        generate(stub, req)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(want), \
            (e.code(), e.details(), want)
        print("   INVALID_ARGUMENT %s" % e.details())
        return
    raise AssertionError("answered, expected INVALID_ARGUMENT %s" % want)


def text_ok(stub):
    _, text, final = generate(stub, pb.GenerateRequest(text="Hello", sampling_params=pb.SamplingParams(max_tokens=4)))
    assert final is not None and final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP), final


def test_grpc_images(d):
    p, port = serve(d, ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
                        "--limit-mm-per-prompt", '{"image": 2}'])
    try:
        ch = grpc.insecure_channel("127.0.0.1:%d" % p.grpc_port)
        stub = pbg.InferenceStub(ch)
        a, b = png(40, 30), png(1000, 600)

        # the OpenAI chat door's answer for the same images is the reference
        q = [{"type": "text", "text": "Compare"}, part(data_url(a)), {"type": "text", "text": "with"},
             part(data_url(b))]
        code, body = post(port, {"model": "tiny-step", "messages": [{"role": "user", "content": q}],
                                 "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                                 "num_speculative_tokens": 0})
        assert code == 200, (code, body)
        m = body["choices"][0]["message"]
        ref = (m.get("reasoning_content") or "") + "|" + (m.get("content") or "")
        print("   chat door: %d prompt tokens, %r" % (body["usage"]["prompt_tokens"], ref))
        assert body["usage"]["prompt_tokens"] > 2 * 169 + 2 * 81 and len(ref) > 8, body

        # the chat door renders an image part as one <im_patch> where it stands, no separator
        for k in (0, 3):
            got, _, final = generate(stub, chat_req("Compare%swith%s" % (MARK, MARK), [a, b], k))
            assert got == ref and final.usage.prompt_tokens == body["usage"]["prompt_tokens"], (k, got, ref, final)
        print("   gRPC chat with two images, K=0 and K=3: the chat door's greedy text")

        # a prompt text: the same placeholders, no template
        _, t0, f0 = generate(stub, text_req("Compare%swith%s" % (MARK, MARK), [a, b], 0))
        _, t3, f3 = generate(stub, text_req("Compare%swith%s" % (MARK, MARK), [a, b], 3))
        _, plain, fp = generate(stub, text_req("Comparewith", []))
        print("   gRPC text with two images: %d prompt tokens, %r" % (f0.usage.prompt_tokens, t0))
        assert t0 == t3 and len(t0) > 8, (t0, t3)
        # both layouts placed: 169 + 1 + 2 x 81 + ... tokens beyond the text's own
        assert f0.usage.prompt_tokens - fp.usage.prompt_tokens > 2 * 169 + 2 * 81, (f0.usage, fp.usage)
        # the images are the prompt's: the same ones are served from cached KV, another first image
        # (of the same layout) shares nothing past the text before it
        assert f3.usage.cached_tokens > 2 * 169, f3.usage
        _, _, fo = generate(stub, text_req("Compare%swith%s" % (MARK, MARK), [png(41, 30), b]))
        assert fo.usage.prompt_tokens == f0.usage.prompt_tokens and fo.usage.cached_tokens < 169, fo.usage
        print("   K=0 and K=3 the same (%d cached); another first image: %d cached" %
              (f3.usage.cached_tokens, fo.usage.cached_tokens))

        # only <im_patch> is matched in a prompt text: "<im_start>" stays text (many tokens), and the
        # placeholder becomes the 40x30 image's layout (<im_start> 169 x <im_patch> <im_end>)
        _, _, fs = generate(stub, text_req("<im_start>Look" + MARK, [a]))
        _, _, ft = generate(stub, text_req("<im_start>Look", []))
        assert ft.usage.prompt_tokens > 3 and fs.usage.prompt_tokens == ft.usage.prompt_tokens + 171, (fs.usage,
                                                                                                        ft.usage)
        print("   other special tokens stay text: %d + 171 prompt tokens" % ft.usage.prompt_tokens)

        bad = png(40, 30)
        cases = [
            (text_req("x" + MARK, [b"not an image at all"]), "images[0]: unsupported image type"),
            (text_req(MARK + MARK, [a, bad[:len(bad) // 2]]), "images[1]: corrupt or truncated PNG image"),
            (text_req(MARK * 3, [a, a, a]), "images[2]: more than 2 images in one prompt (--limit-mm-per-prompt)"),
            (text_req("one " + MARK, [a, b]), "images[1]: no <im_patch> placeholder in text places it"),
            (chat_req("none", [a], 0), "images[0]: no <im_patch> placeholder in chat.messages places it"),
            (text_req(MARK + MARK, [a]), "text: 2 <im_patch> placeholders for 1 image(s)"),
            (text_req(MARK, []), None),
            (pb.GenerateRequest(text=MARK, images=[pb.ImageInput(data=a, sha256=bytes(32))]),
             "images[0]: sha256, views, token_ids and token_position are the coordinator's wire"),
            (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), images=[pb.ImageInput(data=a)]),
             "images: take text or chat input"),
        ]
        for req, want in cases:
            if want is None:    # a text prompt without images: the placeholder is plain text
                _, _, f = generate(stub, req)
                assert f.usage.prompt_tokens > 1, f
                continue
            refused(stub, req, want)
            text_ok(stub)
        print("   a text request answered after each")
        ch.close()
        stop(p)
    finally:
        p.kill()


def main():
    pl.run_cases([("gRPC GenerateRequest with image bytes: the chat door's answer; bad images named",
                   test_grpc_images)], "stepd-serve-grpc-images-", 5000)
    print("stepd serve, gRPC images in: all checks passed")


if __name__ == "__main__":
    main()
