#!/usr/bin/env python3
"""Images in (issue 40) where the model has image tokens but no worker group serves images
(the mock engine reports no supports_images), against a mock engine: a tokenizer that is the tiny one plus <im_start> <im_end> <patch_start>
<patch_end> <patch_newline> <im_patch> (ids 4000..4005, read from it by the coordinator).

  http_no_encoder   a chat with two good images (data URLs) -> 400 "2 image(s): no worker
                    group serves images", never an answer that dropped them;
                    mm_processor_kwargs / media_io_kwargs set -> 400 naming them
  grpc_images       GenerateRequest.images: a 31-byte sha256 and a view whose bytes do not
                    match its size -> INVALID_ARGUMENT naming images[i]...; a well-formed one ->
                    INVALID_ARGUMENT "the gRPC door does not take images yet"; more than --limit-mm-per-prompt is not a
                    flag of plain stepd, so the default 16 applies (17 named)
  routing           a second group whose engine reports supports_images (mock --images):
                    image chats are answered (200) and every one is routed to it, never to
                    the text-only g0 (which would refuse them), text chats still answered
  text_parts        text-only content arrays render as before images were placed (POST
                    /tokenize): ["a", "b"] is "a\nb", ["", "Hi"] is "Hi"
Each is followed by a text request that is answered.
"""
import base64
import json
import os
import struct
import tempfile
import urllib.request
import zlib

import grpc

from stepd_harness import TOKENIZER, Stepd, pb, run_tests

IMAGE_TOKENS = ["<im_start>", "<im_end>", "<patch_start>", "<patch_end>", "<patch_newline>", "<im_patch>"]
VOCAB = 4006


def vision_tokenizer():
    t = json.load(open(TOKENIZER))
    base = len(t["model"]["vocab"])
    for i, s in enumerate(IMAGE_TOKENS):
        t["added_tokens"].append({"id": base + i, "content": s, "single_word": False, "lstrip": False,
                                  "rstrip": False, "normalized": False, "special": True})
    path = os.path.join(tempfile.mkdtemp(prefix="stepd-media-"), "tokenizer.json")
    json.dump(t, open(path, "w"))
    return path


def png(w, h):
    def chunk(t, data):
        return struct.pack(">I", len(data)) + t + data + struct.pack(">I", zlib.crc32(t + data))
    raw = b"".join(b"\0" + bytes((x + y) & 255 for x in range(w * 3)) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


S = None


def stepd():
    global S
    if S is None:
        S = Stepd("--tokenizer", vision_tokenizer(), "--served-model-name", "tiny")
        S.start_engine("g0", "--vocab", str(VOCAB))
        S.wait_ready(1)
    return S


def post(s, body):
    req = urllib.request.Request(s.http + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def text_ok(s):
    code, body = post(s, {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200, (code, body)


def test_http_no_encoder():
    s = stepd()
    url = "data:image/png;base64," + base64.b64encode(png(64, 48)).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]}]
    code, body = post(s, {"model": "tiny", "max_tokens": 3, "messages": msgs})
    assert code == 400 and body["error"]["message"] == \
        "messages: 2 image(s): no worker group serves images (a vision tower on its rank 0)", (code, body)
    # processor and loader kwargs would change the output: refused, not ignored
    for k, v in (("mm_processor_kwargs", {"max_crops": 2}), ("media_io_kwargs", {"image": {"mode": "L"}})):
        code, body = post(s, {"model": "tiny", "max_tokens": 3, "messages": msgs, k: v})
        assert code == 400 and body["error"]["message"].startswith(k), (k, code, body)
        print("   400 %s" % body["error"]["message"])
    text_ok(s)


def generate_error(s, images):
    try:
        for _ in s.inf.Generate(pb.GenerateRequest(text="hello", images=images,
                                                   sampling_params=pb.SamplingParams(max_tokens=2)), timeout=30):
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_grpc_images():
    s = stepd()
    view = pb.ImageView(width=2, height=2, rgb=bytes(12))
    good = pb.ImageInput(sha256=bytes(32), views=[view], token_ids=[1, 2], token_position=0)
    cases = [
        ([pb.ImageInput(sha256=bytes(31), views=[view])], "images[0].sha256: must be 32 bytes (got 31)"),
        ([good, pb.ImageInput(sha256=bytes(32), views=[pb.ImageView(width=2, height=2, rgb=bytes(11))])],
         "images[1].views[0]: 2x2 RGB needs 12 bytes (got 11)"),
        ([good] * 17, "images: 17 images, more than 16 in one prompt (--limit-mm-per-prompt)"),
        ([good], "images: 1 image(s): the gRPC door does not take images yet"),
    ]
    for images, want in cases:
        code, details = generate_error(s, images)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and want in details, (code, details, want)
        print("   INVALID_ARGUMENT %s" % details)
    code, details = generate_error(s, [])
    assert code == grpc.StatusCode.OK, (code, details)


def tokens(s, content):
    req = urllib.request.Request(s.http + "/tokenize", data=json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": content}]}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def test_text_parts():
    s = stepd()
    t = [{"type": "text", "text": x} for x in ("", "Hi", "a", "b")]
    assert tokens(s, [t[0], t[1]]) == tokens(s, "Hi")
    assert tokens(s, [t[2], t[3]]) == tokens(s, "a\nb") != tokens(s, "ab")
    print("   text parts joined by a newline, none after an empty one")
    text_ok(s)


def routed(s):
    return {g.group: g.counters.routed for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}


def test_routing():
    s = stepd()
    s.start_engine("g1", "--vocab", str(VOCAB), "--images")
    s.wait_ready(2)
    before = routed(s)
    url = "data:image/png;base64," + base64.b64encode(png(64, 48)).decode()
    for i in range(6):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Look %d" % i},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
        code, body = post(s, {"model": "tiny", "max_tokens": 3, "messages": msgs})
        assert code == 200 and body["usage"]["prompt_tokens"] > 169, (code, body)
    after = routed(s)
    assert after["g1"] - before.get("g1", 0) == 6 and after["g0"] == before["g0"], (before, after)
    print("   6 image chats routed to g1 (images served), none to g0")
    text_ok(s)


if __name__ == "__main__":
    run_tests([("http_no_encoder", test_http_no_encoder), ("grpc_images", test_grpc_images),
               ("routing", test_routing), ("text_parts", test_text_parts)])
