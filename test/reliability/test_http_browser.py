"""test_http_browser.py - a local server closed to web pages (issue 41 item 4).

A keyless stepd on 127.0.0.1 (a mock engine behind it), raw HTTP/1.1:
  defaults        a browser's "simple" cross-origin POST (text/plain, a form, no
                  Content-Type) is 415, and with its Origin header 403; a foreign Host (DNS
                  rebinding: evil.example, localhost.evil.example) is 403 on the API and the
                  metrics ports; application/json from localhost, 127.0.0.1 and [::1] is
                  served; CORS is off (a preflight is 403, no Access-Control-* header)
  allowed         --allowed-hosts stepd.internal and --allowed-origins '["http://app.example"]':
                  that Host served, a preflight from that origin 204 with the CORS headers, its
                  POST answered with Access-Control-Allow-Origin, another origin still 403
  bad_flag        --allowed-origins '[1]' stops stepd at start with a message naming the flag
Nothing refused reaches the engine.
"""
import json
import os
import subprocess
import sys

from rellib import h
from test_http_framing import CHAT, VOCAB, raw, responses


def req(method, path, headers, body=b""):
    hs = b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers)
    if body:
        hs += b"Content-Length: %d\r\n" % len(body)
    return b"%s %s HTTP/1.1\r\n%sConnection: close\r\n\r\n%s" % (method, path, hs, body)


def answer(port, data):
    out, _ = raw(port, data, timeout=10)
    st = responses(out)
    assert len(st) == 1, out[:600]
    head, body = out.split(b"\r\n\r\n", 1)
    return st[0], head.decode("latin-1").lower(), body


def generates(s):
    return s.engines[0].stats().get("generate", 0)


def start(*args):
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny", *args)
    s.start_engine("g0", "--vocab", str(VOCAB))
    s.wait_ready(1)
    return s


def test_defaults():
    s = start()
    try:
        port, host = s.ports["http"], b"127.0.0.1:%d" % s.ports["http"]
        n0 = generates(s)
        for ct in (None, b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
                   b"application/jsonx", b"text/json"):
            hs = [(b"Host", host)] + ([(b"Content-Type", ct)] if ct else [])
            st, _, body = answer(port, req(b"POST", b"/v1/chat/completions", hs, CHAT))
            assert st == "415" and b"application/json" in body, (ct, st, body)
            # what a web page's form or fetch() sends: an Origin as well
            st, head, body = answer(port, req(b"POST", b"/v1/chat/completions",
                                              hs + [(b"Origin", b"http://evil.example")], CHAT))
            assert st == "403" and b"--allowed-origins" in body and "access-control" not in head, (ct, st, body)
        # DNS rebinding: the page's own name in Host
        for bad in (b"evil.example", b"evil.example:%d" % port, b"localhost.evil.example", b"127.0.0.1.nip.io"):
            for p, path in ((port, b"/v1/chat/completions"), (port, b"/health"), (s.ports["metrics"], b"/metrics")):
                method = b"POST" if path.startswith(b"/v1") else b"GET"
                st, _, body = answer(p, req(method, path, [(b"Host", bad), (b"Content-Type", b"application/json")],
                                            CHAT if method == b"POST" else b""))
                assert st == "403" and b"--allowed-hosts" in body, (bad, path, st, body)
        # CORS off: a preflight is refused, nothing says Access-Control
        st, head, _ = answer(port, req(b"OPTIONS", b"/v1/chat/completions",
                                       [(b"Host", host), (b"Origin", b"http://evil.example"),
                                        (b"Access-Control-Request-Method", b"POST")]))
        assert st == "403" and "access-control" not in head, (st, head)
        # served: application/json (with a charset) from the names of this host
        for good in (host, b"localhost:%d" % port, b"LOCALHOST", b"[::1]:%d" % port):
            st, head, body = answer(port, req(b"POST", b"/v1/chat/completions",
                                              [(b"Host", good), (b"Content-Type", b"application/json; charset=utf-8")],
                                              CHAT))
            assert st == "200" and json.loads(body)["choices"], (good, st, body)
            assert "access-control" not in head, head
        assert generates(s) - n0 == 4, "the engine saw %d calls, want the 4 served" % (generates(s) - n0)
    finally:
        assert s.stop() == 0


def test_allowed():
    s = start("--allowed-hosts", "stepd.internal, other.internal", "--allowed-origins", '["http://app.example"]')
    try:
        port = s.ports["http"]
        hs = [(b"Host", b"stepd.internal:%d" % port), (b"Content-Type", b"application/json")]
        st, head, _ = answer(port, req(b"POST", b"/v1/chat/completions", hs, CHAT))
        assert st == "200" and "access-control" not in head, (st, head)
        st, _, _ = answer(port, req(b"GET", b"/health", [(b"Host", b"evil.example")]))
        assert st == "403", st
        # the allowed origin: preflight, then the POST with its CORS header
        st, head, _ = answer(port, req(b"OPTIONS", b"/v1/chat/completions",
                                       [(b"Host", b"stepd.internal"), (b"Origin", b"http://app.example"),
                                        (b"Access-Control-Request-Method", b"POST"),
                                        (b"Access-Control-Request-Headers", b"authorization, content-type")]))
        assert st == "204", (st, head)
        assert "access-control-allow-origin: http://app.example" in head, head
        assert "access-control-allow-methods: get, post, options" in head, head
        assert "access-control-allow-headers: authorization, content-type" in head, head
        st, head, body = answer(port, req(b"POST", b"/v1/chat/completions",
                                          hs + [(b"Origin", b"http://app.example")], CHAT))
        assert st == "200" and "access-control-allow-origin: http://app.example" in head and "vary: origin" in head, head
        st, head, body = answer(port, req(b"POST", b"/v1/chat/completions",
                                          hs + [(b"Origin", b"http://other.example")], CHAT))
        assert st == "403" and "access-control" not in head, (st, head)
        # a preflight for an unknown path
        st, _, _ = answer(port, req(b"OPTIONS", b"/nowhere", [(b"Host", b"stepd.internal"),
                                                            (b"Origin", b"http://app.example")]))
        assert st == "404", st
    finally:
        assert s.stop() == 0


def test_bad_flag():
    for flag, val in (("--allowed-origins", "[1]"), ("--allowed-hosts", "[\"a\"")):
        p = subprocess.run([h.STEPD_BIN, "--port", "0", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                            "--control-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                            "--insecure-control", flag, val], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, STEPD_LOG_LEVEL="info"))
        assert p.returncode != 0 and flag in p.stdout + p.stderr, (flag, p.returncode, p.stdout, p.stderr)


if __name__ == "__main__":
    h.run_tests([("defaults", test_defaults), ("allowed", test_allowed), ("bad_flag", test_bad_flag)])
    sys.exit(0)
