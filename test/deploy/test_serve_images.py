#!/usr/bin/env python3
"""test_serve_images.py - images in on the OpenAI door of a running `stepd serve` (issue 40):
every bad image_url part is a 400 naming messages[i].content[k] and the problem, and the
server keeps answering a text chat afterwards.

  - a decompression bomb (a PNG whose header declares 100000x100000), a truncated PNG, a
    corrupt one, an unsupported type (BMP), an empty image, base64 that does not decode, a
    non-image media type, a non-base64 data URL;
  - more images than --limit-mm-per-prompt '{"image": 2}' (the third part named), and with
    '{"image": 0}' a text-only server that names the flag;
  - http(s) URLs: a domain outside --allowed-media-domains named; an allowed one refused
    with "only data URLs" (stepd does not fetch); detail "high" refused (one resolution policy);
  - a good image (several, over two messages): the tiny model's tokenizer has no image tokens,
    so "model has no vision tower", never a silently dropped image;
  - the daemon still serves a text chat (200) after all of them.
The images are made here (PNG by hand with zlib: the test's Python has no PIL).
"""
import base64
import json
import os
import signal
import struct
import sys
import urllib.request
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)
MODEL = os.path.join(ROOT, "models", "tiny-step")
STEPD = os.path.abspath(dl.build_binary("stepd"))


def png(w, h):
    def chunk(t, data):
        return struct.pack(">I", len(data)) + t + data + struct.pack(">I", zlib.crc32(t + data))
    raw = b"".join(b"\0" + bytes((x * 7 + y * 3) & 255 for x in range(w * 3)) for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def png_with_size(data, w, h):
    ihdr = bytearray(data[8:33])
    ihdr[8:16] = struct.pack(">II", w, h)
    ihdr[21:25] = struct.pack(">I", zlib.crc32(bytes(ihdr[4:21])))
    return data[:8] + bytes(ihdr) + data[33:]


def data_url(b, mime="image/png"):
    return "data:%s;base64,%s" % (mime, base64.b64encode(b).decode())


def part(url, **kw):
    return {"type": "image_url", "image_url": dict(url=url, **kw)}


def post(port, body, timeout=120):
    req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def chat(port, *contents):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}] + list(c)} for c in contents]
    return post(port, {"model": "tiny-step", "messages": msgs, "max_tokens": 4})


def serve(d, extra):
    ports = [pl.free_port() for _ in range(5)]
    argv = [STEPD, "serve", MODEL, "--device", "cpu", "--threads", "1",
            "--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
            "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen", "127.0.0.1:%d" % ports[3],
            "--port", str(ports[4])] + extra
    p = pl.Proc("serve", argv, dict(os.environ, TMPDIR=d), d)
    pl.wait_until(lambda: "startup complete in" in p.text() or p.p.poll() is not None, 120, "startup complete",
                  step=0.05)
    assert p.p.poll() is None, p.text()[-3000:]
    return p, ports[4]


def stop(p):
    """SIGTERM: a clean exit (0), no sanitizer report in an ASan build's log"""
    p.p.send_signal(signal.SIGTERM)
    p.wait(60)
    log = p.text()
    assert p.p.returncode == 0 and "Sanitizer" not in log, (p.p.returncode, log[-3000:])


def refused(port, needle, *contents, at="messages[0].content[1]"):
    code, body = chat(port, *contents)
    msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
    assert code == 400 and msg.startswith(at) and needle in msg, (code, body, needle)
    print("   400 %s" % msg)


def text_ok(port):
    code, body = post(port, {"model": "tiny-step", "max_tokens": 4,
                             "messages": [{"role": "user", "content": "Hello"}]})
    assert code == 200 and body["choices"][0]["message"] is not None, (code, body)


def test_limits(d):
    p, port = serve(d, ["--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "images.example.org",
                        "--image-max-pixels", "1000000"])
    try:
        good = png(40, 30)
        refused(port, "PNG image declares 100000x100000 pixels, more than the limit of 16384 per side",
                [part(data_url(png_with_size(good, 100000, 100000)))])
        refused(port, "PNG image declares 2000x2000 = 4000000 pixels, more than the limit of 1000000",
                [part(data_url(png_with_size(good, 2000, 2000)))])
        refused(port, "corrupt or truncated PNG image", [part(data_url(good[:len(good) // 2]))])
        bad = bytearray(good)
        bad[60] ^= 0xFF
        refused(port, "corrupt or truncated PNG image", [part(data_url(bytes(bad)))])
        refused(port, "unsupported image type: not PNG, JPEG, WebP or GIF",
                [part(data_url(b"BM" + bytes(60), "image/bmp"))])
        refused(port, "the image is empty", [part("data:image/png;base64,")])
        refused(port, "base64 does not decode", [part("data:image/png;base64,@@@@")])
        refused(port, "media type must be image/", [part("data:text/plain;base64,aGVsbG8=")])
        refused(port, "only base64 data URLs", [part("data:image/png,rawbytes")])
        refused(port, "more than 2 images in one prompt (--limit-mm-per-prompt)",
                [part(data_url(good)), part(data_url(good))], [part(data_url(good))], at="messages[1].content[1]")
        refused(port, "domain 'evil.example.com' is not allowed (--allowed-media-domains)",
                [part("https://evil.example.com/cat.png")])
        refused(port, "only data URLs are supported", [part("https://images.example.org/cat.png")])
        refused(port, "detail: only \"auto\" is supported", [part(data_url(good), detail="high")])
        refused(port, "must be a data: URL", [part("file:///etc/passwd")])
        # good images, two messages: the tiny model has no image tokens
        code, body = chat(port, [part(data_url(good), detail="auto")], [part(data_url(png(700, 300)))])
        assert code == 400 and "2 image(s): the model has no vision tower" in body["error"]["message"], (code, body)
        print("   400 %s" % body["error"]["message"])
        text_ok(port)
        print("   a text chat still answers 200")
        stop(p)
    finally:
        p.kill()


def test_text_only(d):
    p, port = serve(d, ["--limit-mm-per-prompt", '{"image": 0}'])
    try:
        refused(port, "this server serves text only (--limit-mm-per-prompt '{\"image\": 0}')",
                [part(data_url(png(8, 8)))])
        text_ok(port)
        stop(p)
    finally:
        p.kill()


def main():
    pl.run_cases([("bad image parts: 400 naming the part, the server keeps serving", test_limits),
                  ("--limit-mm-per-prompt '{\"image\": 0}': text only", test_text_only)], "stepd-serve-images-", 5000)
    print("stepd serve, images in: all checks passed")


if __name__ == "__main__":
    main()
