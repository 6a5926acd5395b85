#!/usr/bin/env python3
"""test_serve_images.py - images in on the OpenAI door of a running `stepd serve` (issue 40):
every bad image_url part is a 400 naming messages[i].content[k] and the problem, and the
server keeps answering a text chat afterwards.

  - a decompression bomb (a PNG whose header declares 100000x100000), a truncated PNG, a
    corrupt one, an unsupported type (BMP), an empty image, base64 that does not decode, a
    non-image media type, a non-base64 data URL;
  - more images than --limit-mm-per-prompt '{"image": 2}' (the third part named), and with
    '{"image": 0}' a text-only server that names the flag;
  - http(s) URLs: a domain outside --allowed-media-domains named, a subdomain of an allowed one
    too (exact host names); detail "high" refused (one resolution policy);
  - a text part holding "<im_patch>" beside an image: 400 (the placeholder count does not match);
  - the daemon still serves a text chat (200) after all of them.
Served end to end (the tiny model's vision tower, the `openai` client, MTP K=3 configured):
  - a chat with two images (a 40x30 PNG: the global view only; a 1000x600 one: 2 crops plus
    the global view) gives the same greedy text streamed and not, with K=0 and K=3
    (num_speculative_tokens per request);
  - its second turn (the same images) reports the first turn's prompt as cached
    (usage.prompt_tokens_details.cached_tokens) and stepd:image_encodes_total does not move
    (the engine's encoder cache: stepd:image_cache_hits_total does);
  - the same text with other images: a different answer, and two more encodes.
Fetched (--allowed-media-domains 127.0.0.1,localhost; an http.server here on 127.0.0.1):
  - a PNG by URL (and through an allowed redirect) gives the same greedy text as the same PNG
    as a data URL;
  - a 404, a body over --image-max-bytes (with a Content-Length, and without one: cut while
    it downloads), a handler that never answers (--media-fetch-timeout 0.5: "timed out"; no
    duration is measured), a redirect to a host not allowed, a closed port, a subdomain, a
    corrupt body, a decompression bomb: each a 400 naming the part and the reason;
  - a client that hangs up while its image is fetched (--media-fetch-timeout 300, a handler that
    never answers): the fetch stops, the request is dropped (logged), the server goes on serving.
The images are made here (PNG by hand with zlib: the test's Python has no PIL).
"""
import base64
import json
import os
import signal
import struct
import sys
import urllib.parse
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


def post(port, body, timeout=120, path="/v1/chat/completions"):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
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
    p.metrics_port = ports[3]
    p.grpc_port = ports[0]
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
        refused(port, "domain 'cdn.images.example.org' is not allowed",
                [part("https://cdn.images.example.org/cat.png")])
        refused(port, "detail: only \"auto\" is supported", [part(data_url(good), detail="high")])
        refused(port, "must be a data: URL", [part("file:///etc/passwd")])
        refused(port, "the prompt holds 2 <im_patch> tokens for 1 image(s)",
                [part(data_url(good)), {"type": "text", "text": "and <im_patch>"}], at="messages:")
        # good images, two messages: served (the tiny model has a vision tower)
        code, body = chat(port, [part(data_url(good), detail="auto")], [part(data_url(png(700, 300)))])
        assert code == 200 and body["usage"]["prompt_tokens"] > 2 * 169, (code, body)
        text_ok(port)
        print("   a text chat still answers 200")
        stop(p)
    finally:
        p.kill()


class ImageServer:
    """http.server on 127.0.0.1 (a thread): the PNGs and the bad answers of test_fetch"""

    def __init__(self, files, max_bytes):
        import http.server
        import threading

        self.release = threading.Event()
        srv = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def send(self, code, body, length=True, headers=()):
                self.send_response(code)
                self.send_header("content-type", "image/png")
                for k, v in headers:
                    self.send_header(k, v)
                if length:
                    self.send_header("content-length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass        # stepd stopped reading: the answer was too large

            def do_GET(self):
                path = self.path.split("?")[0]
                if path in files:
                    self.send(200, files[path])
                elif path == "/big.png":
                    self.send(200, bytes(max_bytes + 1))
                elif path == "/big-unsized.png":
                    self.send(200, bytes(4 * max_bytes), length=False)     # HTTP/1.0: ends at close
                elif path == "/stall.png":
                    srv.release.wait(3600)      # never answers while the test runs
                elif path == "/redirect":
                    to = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["to"][0]
                    self.send(302, b"", headers=[("location", to)])
                else:
                    self.send(404, b"not found")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path, host="127.0.0.1"):
        return "http://%s:%d%s" % (host, self.port, path)

    def redirect(self, to):
        return self.url("/redirect?" + urllib.parse.urlencode({"to": to}))

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def greedy(port, url):
    code, body = post(port, {"model": "tiny-step", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                             "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                        part(url)]}]})
    assert code == 200, (code, body)
    m = body["choices"][0]["message"]
    return (m.get("reasoning_content") or "") + "|" + (m.get("content") or ""), body["usage"]["prompt_tokens"]


def test_fetch(d):
    max_bytes = 200000
    img, other = png(700, 300), png(40, 30)
    assert len(img) < max_bytes
    srv = ImageServer({"/cat.png": img, "/corrupt.png": img[:len(img) // 2],
                       "/bomb.png": png_with_size(other, 100000, 100000)}, max_bytes)
    closed = pl.free_port()
    p, port = serve(d, ["--allowed-media-domains", "127.0.0.1,LocalHost", "--media-fetch-timeout", "0.5",
                        "--image-max-bytes", str(max_bytes)])
    try:
        ref = greedy(port, data_url(img))
        assert ref[1] > 169 and greedy(port, data_url(other))[0] != ref[0], ref
        got = greedy(port, srv.url("/cat.png"))
        print("   by URL: %r, %d prompt tokens (the data URL's: the same)" % got)
        assert got == ref, (got, ref)
        # a redirect to the other allowed host (localhost), and an upper-case host name
        assert greedy(port, srv.redirect(srv.url("/cat.png", host="localhost"))) == ref
        assert greedy(port, srv.url("/cat.png", host="LOCALHOST")) == ref
        print("   an allowed redirect and an upper-case host: the same")
        refused(port, "the image URL answered HTTP status 404", [part(srv.url("/missing.png"))])
        refused(port, "larger than the limit of 200000 bytes (--image-max-bytes)", [part(srv.url("/big.png"))])
        refused(port, "larger than the limit of 200000 bytes (--image-max-bytes)",
                [part(srv.url("/big-unsized.png"))])
        refused(port, "timed out after 0.5 s (--media-fetch-timeout)", [part(srv.url("/stall.png"))])
        refused(port, "redirects to 'evil.example.com', which is not an http(s) URL of an allowed domain",
                [part(srv.redirect("http://evil.example.com/cat.png"))])
        refused(port, "could not connect to the image URL's host",
                [part("http://127.0.0.1:%d/cat.png" % closed)])
        refused(port, "domain 'img.localhost' is not allowed (--allowed-media-domains)",
                [part(srv.url("/cat.png", host="img.localhost"))])
        refused(port, "corrupt or truncated PNG image", [part(srv.url("/corrupt.png"))])
        refused(port, "PNG image declares 100000x100000 pixels, more than the limit of 16384 per side",
                [part(srv.url("/bomb.png"))])
        # the first bad part is named: a good URL, then a 404 in the second message
        refused(port, "HTTP status 404", [part(srv.url("/cat.png"))], [part(srv.url("/gone.png"))],
                at="messages[1].content[1]")
        text_ok(port)
        stop(p)
    finally:
        p.kill()
        srv.close()


def test_fetch_cancel(d):
    """--media-fetch-timeout 300: only the cancellation can end the stalled fetch within the wait"""
    srv = ImageServer({"/cat.png": png(40, 30)}, 1 << 20)
    p, port = serve(d, ["--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "300"])
    try:
        req = urllib.request.Request("http://127.0.0.1:%d/v1/chat/completions" % port, data=json.dumps(
            {"model": "tiny-step", "max_tokens": 4, "messages": [{"role": "user", "content": [
                part(srv.url("/stall.png"))]}]}).encode(), headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=0.5)
            raise AssertionError("a stalled fetch answered")
        except OSError:
            pass        # the client hangs up
        pl.wait_until(lambda: "dropped: the client went away while its images were fetched and decoded" in p.text(), 30,
                      "the request of the client gone dropped")
        text_ok(port)
        code, body = chat(port, [part(srv.url("/cat.png"))])
        assert code == 200, (code, body)
        print("   a client gone during its fetch: the fetch stopped, the server goes on serving")
        stop(p)
    finally:
        p.kill()
        srv.close()


def test_text_only(d):
    p, port = serve(d, ["--limit-mm-per-prompt", '{"image": 0}'])
    try:
        refused(port, "this server serves text only (--limit-mm-per-prompt '{\"image\": 0}')",
                [part(data_url(png(8, 8)))])
        text_ok(port)
        stop(p)
    finally:
        p.kill()


def metric(mport, name):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % mport, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError("no metric %s" % name)


def ask_greedy(c, msgs, k, stream=False):
    """16 greedy tokens of a chat through the openai client c at K=k: the tiny model's text,
    reasoning and content joined by "|", and the usage"""
    kw = dict(model="tiny-step", messages=msgs, max_tokens=16, temperature=0,
              extra_body={"num_speculative_tokens": k, "ignore_eos": True})

    def text_of(m):
        return (getattr(m, "reasoning_content", None) or "") + "|" + (m.content or "")
    if not stream:
        r = c.chat.completions.create(**kw)
        return text_of(r.choices[0].message), r.usage
    text, usage = ["", ""], None
    for ch in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if ch.choices:
            text[0] += getattr(ch.choices[0].delta, "reasoning_content", None) or ""
            text[1] += ch.choices[0].delta.content or ""
        usage = ch.usage or usage
    return "|".join(text), usage


def test_served(d):
    import openai

    p, port = serve(d, ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'])
    mport = p.metrics_port
    try:
        c = openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="none", max_retries=0)
        a, b = data_url(png(40, 30)), data_url(png(1000, 600))
        q = [{"type": "text", "text": "Compare"}, part(a), {"type": "text", "text": "with"}, part(b)]

        def ask(msgs, k, stream):
            return ask_greedy(c, msgs, k, stream)

        msgs = [{"role": "user", "content": q}]
        ref, u1 = ask(msgs, 0, False)
        print("   two images: %d prompt tokens, %r" % (u1.prompt_tokens, ref))
        assert u1.prompt_tokens > 2 * 169 + 81 * 2 and len(ref) > 8, (u1, ref)
        for k in (0, 3):
            for stream in (False, True):
                text, _ = ask(msgs, k, stream)
                assert text == ref, (k, stream, text, ref)
        print("   K=0 and K=3, streamed and not: the same greedy text")
        pl.wait_until(lambda: metric(mport, "stepd:image_encodes_total") == 2, 30, "2 image encodes")
        turn2 = msgs + [{"role": "assistant", "content": "Two images."}, {"role": "user", "content": "And now?"}]
        for k in (0, 3):
            _, u2 = ask(turn2, k, False)
            cached = u2.prompt_tokens_details.cached_tokens
            print("   second turn K=%d: %d prompt tokens, %d cached" % (k, u2.prompt_tokens, cached))
            assert cached >= u1.prompt_tokens - 32 and cached > 2 * 169, (u1, u2)
        pl.wait_until(lambda: metric(mport, "stepd:image_cache_hits_total") > 0, 30, "encoder cache hits")
        assert metric(mport, "stepd:image_encodes_total") == 2
        other = [{"role": "user", "content": [q[0], part(data_url(png(41, 30))), q[2], part(data_url(png(900, 700)))]}]
        text, u3 = ask(other, 0, False)
        print("   other images: %r" % text)
        assert text != ref and u3.prompt_tokens_details.cached_tokens < u1.prompt_tokens - 32, (text, u3)
        pl.wait_until(lambda: metric(mport, "stepd:image_encodes_total") == 4, 30, "4 image encodes")
        text_ok(port)
        stop(p)
    finally:
        p.kill()


def main():
    pl.run_cases([("bad image parts: 400 naming the part, the server keeps serving", test_limits),
                  ("--limit-mm-per-prompt '{\"image\": 0}': text only", test_text_only),
                  ("http(s) image URLs of allowed hosts fetched; bad ones refused", test_fetch),
                  ("a client gone while its image URL is fetched: the fetch stops", test_fetch_cancel),
                  ("two images served: K=0/K=3, streamed or not, cached next turn", test_served)],
                 "stepd-serve-images-", 5000)
    print("stepd serve, images in: all checks passed")


if __name__ == "__main__":
    main()
