#!/usr/bin/env python3
"""Images in (issue 40) where the model has image tokens but no worker group serves images
(the mock engine reports no supports_images), against a mock engine: a tokenizer that is the tiny one plus <im_start> <im_end> <patch_start>
<patch_end> <patch_newline> <im_patch> (ids 4000..4005, read from it by the coordinator).

  http_no_encoder   a chat with two good images (data URLs) -> 400 "2 image(s): no worker
                    group serves images", never an answer that dropped them;
                    mm_processor_kwargs / media_io_kwargs set -> 400 naming them
  grpc_images       GenerateRequest.images (encoded bytes in ImageInput.data): the engine
                    wire's fields set, bytes that are no image -> INVALID_ARGUMENT naming
                    images[i]; more than --limit-mm-per-prompt (not a flag of plain stepd, so
                    the default 16: images[16] named); token_ids input with images refused; a
                    good one -> INVALID_ARGUMENT "1 image(s): no worker group serves images"
  routing           a second group whose engine reports supports_images (mock --images):
                    image chats are answered (200) and every one is routed to it, never to
                    the text-only g0 (which would refuse them), text chats still answered;
                    so are gRPC text and chat requests with images, and images that do not
                    match their <im_patch> placeholders in number are INVALID_ARGUMENT naming
                    the first image without one (or the text with too many)
  text_parts        text-only content arrays render as before images were placed (POST
                    /tokenize): ["a", "b"] is "a\nb", ["", "Hi"] is "Hi"
  decode_off_loop   images are decoded on libuv's threadpool: with the test-only decode gate
                    (STEPD_TEST_DECODE_GATE, a FIFO each decode reads a byte from first) holding
                    a chat's first image, /health and a text chat on the same loop are answered;
                    released, the chat is answered with both images; a client that closes its
                    connection while its image is held is dropped, and the server serves on; the
                    same for a gRPC GenerateRequest's image (answered, or cancelled and dropped);
                    of 70 image chats at once 64 are held (queued or decoding) and 6 refused 503
  tokenize_images   POST /tokenize counts a chat's images as generation lays them out: its count
                    equals usage.prompt_tokens of the same chat (max_tokens 1) for one image, one
                    with crops, and two of different sizes
Each is followed by a text request that is answered.
"""
import base64
import json
import os
import socket
import threading
import struct
import tempfile
import urllib.request
import zlib

import grpc

from stepd_harness import TOKENIZER, Stepd, pb, run_tests, wait_until

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


def generate_error(s, images, text="hello <im_patch>", **kw):
    req = pb.GenerateRequest(images=images, sampling_params=pb.SamplingParams(max_tokens=2), **kw)
    if "token_ids" not in kw and "chat" not in kw:
        req.text = text
    try:
        for _ in s.inf.Generate(req, timeout=30):
            pass
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_grpc_images():
    s = stepd()
    view = pb.ImageView(width=2, height=2, rgb=bytes(12))
    good = pb.ImageInput(data=png(64, 48))
    cases = [
        ([pb.ImageInput(sha256=bytes(32), views=[view], token_ids=[1, 2], data=png(64, 48))], {},
         "images[0]: sha256, views, token_ids and token_position are the coordinator's wire to the engines; "
         "send the encoded image in data"),
        ([good, pb.ImageInput(data=b"GIF89a")], {}, "images[1]: corrupt or truncated GIF image"),
        ([good, pb.ImageInput(data=b"hello world")], {}, "images[1]: unsupported image type"),
        ([good] * 17, {}, "images[16]: more than 16 images in one prompt (--limit-mm-per-prompt)"),
        ([good], {"token_ids": pb.TokenIds(ids=[1, 2, 3])}, "images: take text or chat input"),
        ([good], {}, "images: 1 image(s): no worker group serves images (a vision tower on its rank 0)"),
    ]
    for images, kw, want in cases:
        code, details = generate_error(s, images, **kw)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(want), (code, details, want)
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
    # the gRPC door: a text and a chat with an image each, placed by their <im_patch>
    img = pb.ImageInput(data=png(64, 48))
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Look <im_patch> here")])
    for kw in ({"text": "Look <im_patch> here"}, {"chat": chat}):
        final = None
        for m in s.inf.Generate(pb.GenerateRequest(images=[img], sampling_params=pb.SamplingParams(max_tokens=3),
                                                   **kw), timeout=30):
            final = m.final if m.HasField("final") else final
        assert final is not None and final.usage.prompt_tokens > 169 and final.group == "g1", final
    assert routed(s)["g1"] - after["g1"] == 2 and routed(s)["g0"] == before["g0"], routed(s)
    print("   2 gRPC requests with images routed to g1")
    for images, text, want in (([img, img], "one <im_patch>", "images[1]: no <im_patch> placeholder in text"),
                               ([img], "<im_patch><im_patch>", "text: 2 <im_patch> placeholders for 1 image(s)")):
        code, details = generate_error(s, images, text)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(want), (code, details, want)
        print("   INVALID_ARGUMENT %s" % details)
    text_ok(s)


def gate_held(fifo):
    """A writer's fd on fifo once a decode waits at the gate (a reader has it open)."""
    def opened():
        try:
            return [os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)]     # fd 0 is a good one
        except OSError:
            return None
    return wait_until(opened, timeout=20, what="a decode at the gate")[0]


def test_decode_off_loop():
    fifo = os.path.join(tempfile.mkdtemp(prefix="stepd-gate-"), "gate")
    os.mkfifo(fifo)
    s = Stepd("--tokenizer", vision_tokenizer(), "--served-model-name", "tiny", env={"STEPD_TEST_DECODE_GATE": fifo})
    try:
        s.start_engine("g0", "--vocab", str(VOCAB), "--images")
        s.wait_ready(1)
        urls = ["data:image/png;base64," + base64.b64encode(png(w, h)).decode() for w, h in ((64, 48), (48, 30))]
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Compare"}] +
                 [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]
        got = {}
        t = threading.Thread(target=lambda: got.update(r=post(s, {"model": "tiny", "max_tokens": 3,
                                                                 "messages": msgs})))
        t.start()
        fd = gate_held(fifo)
        try:
            # the first image's decode waits at the gate: the loop serves meanwhile
            with urllib.request.urlopen(s.http + "/health", timeout=10) as r:
                assert r.status == 200
            text_ok(s)
            assert t.is_alive() and not got, got
            print("   /health and a text chat answered while a decode is held")
            os.write(fd, b"xx")         # one byte per image
            t.join(30)
        finally:
            os.close(fd)
        code, body = got["r"]
        assert code == 200 and body["usage"]["prompt_tokens"] > 2 * 169, (code, body)
        print("   released: answered, %d prompt tokens" % body["usage"]["prompt_tokens"])
        # a client gone while its image is held: dropped, nothing served, the server serves on
        req = json.dumps({"model": "tiny", "max_tokens": 3, "messages": msgs[:1]}).encode()
        c = socket.create_connection(("127.0.0.1", int(s.http.rsplit(":", 1)[1])))
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(req) + req)
        fd = gate_held(fifo)
        c.close()
        wait_until(lambda: "cancelling: the client went away" in s.read_log(), timeout=20, what="the close")
        os.write(fd, b"x")          # the first image: the job stops there, cancelled
        wait_until(lambda: "dropped: the client went away" in s.read_log(), timeout=20, what="the drop")
        os.close(fd)
        text_ok(s)
        print("   a client gone while its image was held: dropped, the server serves on")
        # the gRPC door: a GenerateRequest's image decoded off the loop too
        req = pb.GenerateRequest(images=[pb.ImageInput(data=png(64, 48))], text="Look <im_patch>",
                                 sampling_params=pb.SamplingParams(max_tokens=2))
        it = s.inf.Generate(req, timeout=60)
        got = {}
        t = threading.Thread(target=lambda: got.update(m=list(it)))
        t.start()
        fd = gate_held(fifo)
        with urllib.request.urlopen(s.http + "/health", timeout=10) as r:
            assert r.status == 200
        assert t.is_alive() and not got, got
        os.write(fd, b"x")
        t.join(30)
        os.close(fd)
        final = [m.final for m in got["m"] if m.HasField("final")]
        assert final and final[0].usage.prompt_tokens > 169, got
        print("   gRPC: /health answered while its image decode is held; released: %d prompt tokens"
              % final[0].usage.prompt_tokens)
        it = s.inf.Generate(req, timeout=60)
        fd = gate_held(fifo)
        it.cancel()
        wait_until(lambda: "cancelling: the client went away while its images were decoded" in s.read_log(),
                   timeout=20, what="the cancel")
        os.write(fd, b"x")
        wait_until(lambda: "dropped: the client went away while its images were decoded" in s.read_log(),
                   timeout=20, what="the drop")
        os.close(fd)
        text_ok(s)
        print("   gRPC: a call cancelled while its image was held: dropped, the server serves on")
        # bounded: 64 requests' images queued or decoding at once (MEDIA_MAX_JOBS), more are 503
        one = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": urls[0]}}]}]}
        res = []
        threads = [threading.Thread(target=lambda: res.append(post(s, one))) for _ in range(70)]
        for t in threads:
            t.start()
        fd = gate_held(fifo)
        wait_until(lambda: len(res) == 6, timeout=30, what="6 refusals")
        assert all(c == 503 and b["error"]["message"] == "too many requests' images are being decoded (64 at "
                   "once); retry later" for c, b in res), res
        os.write(fd, b"x" * 64)
        for t in threads:
            t.join(60)
        os.close(fd)
        codes = sorted(c for c, _ in res)
        assert codes == [200] * 64 + [503] * 6, codes
        print("   70 image chats at once: 64 held (queued or decoding), 6 refused 503; released: 64 answered")
    finally:
        s.stop()


def test_tokenize_images():
    s = Stepd("--tokenizer", vision_tokenizer(), "--served-model-name", "tiny")
    try:
        s.start_engine("g0", "--vocab", str(VOCAB), "--images")
        s.wait_ready(1)
        url = {wh: "data:image/png;base64," + base64.b64encode(png(*wh)).decode() for wh in ((64, 48), (900, 300))}
        for sizes in (((64, 48),), ((900, 300),), ((64, 48), (900, 300))):
            content = [{"type": "text", "text": "Describe"}] + \
                [{"type": "image_url", "image_url": {"url": url[wh]}} for wh in sizes]
            msgs = [{"role": "user", "content": content}]
            req = urllib.request.Request(s.http + "/tokenize", data=json.dumps(
                {"model": "tiny", "messages": msgs}).encode(), headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                count = json.loads(r.read())["count"]
            code, body = post(s, {"model": "tiny", "max_tokens": 1, "messages": msgs})
            assert code == 200, (code, body)
            assert count == body["usage"]["prompt_tokens"] > 169 * len(sizes), (sizes, count, body["usage"])
            print("   %s: /tokenize %d = prompt_tokens %d" % (sizes, count, body["usage"]["prompt_tokens"]))
        text_ok(s)
    finally:
        s.stop()


if __name__ == "__main__":
    run_tests([("http_no_encoder", test_http_no_encoder), ("grpc_images", test_grpc_images),
               ("routing", test_routing), ("text_parts", test_text_parts),
               ("decode_off_loop", test_decode_off_loop), ("tokenize_images", test_tokenize_images)])
