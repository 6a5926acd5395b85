"""test_http_framing.py - HTTP/1.1 message framing by the book (issue 41 item 3, RFC 9112).

Raw bytes to stepd's HTTP API port (a mock engine behind it): each request whose framing a
front proxy could read otherwise than stepd does is answered 400 naming the problem, and the
connection is closed after that one answer, so that nothing hidden in its body or after it
is served as a request of its own:
  cl_te           Content-Length together with Transfer-Encoding: chunked, a second request
                  (a chat) smuggled in the body
  cl_twice        Content-Length twice (equal and different values)
  cl_invalid      Content-Length not a plain decimal ("abc", "+5", "-1", "5 5", "0x10")
  te_other        Transfer-Encoding other than chunked, and on an HTTP/1.0 request
  nul_path        "/v1/chat/completions%00junk" and %01, %0a, %7f in the path or a query
  ctl_header      a control byte in a header value
Plus the control: two well-framed requests, one after the other on one connection, are both
served, and nothing refused reached the engine.
  not_utf8        bytes that are not UTF-8 in a path (404), a Host (403) or an Origin (403):
                  each answered with its status and a JSON error ('?' for those bytes), and
                  stepd still serves a chat (found by test/daemon/fuzz-http: the error body
                  could not be made, and stepd crashed on a NULL route)
"""
import json
import socket
import sys
import time

from rellib import h

VOCAB = 4000
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


def raw(port, data, timeout=10):
    """Send data, read until the server closes (or timeout). (bytes read, closed?)"""
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    closed = False
    try:
        c.sendall(data)
        end = time.time() + timeout
        while time.time() < end:
            try:
                b = c.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                closed = True
                break
            if not b:
                closed = True
                break
            out += b
    finally:
        c.close()
    return out, closed


def one_response(c):
    """Read one response with a Content-Length off socket c: (status, body)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        b = c.recv(65536)
        assert b, "closed before a response head: %r" % buf
        buf += b
    head_, body = buf.split(b"\r\n\r\n", 1)
    n = int([ln.split(b":", 1)[1] for ln in head_.split(b"\r\n") if ln.lower().startswith(b"content-length:")][0])
    while len(body) < n:
        b = c.recv(65536)
        assert b, "closed in a response body"
        body += b
    return head_.split(b" ")[1].decode(), body


def responses(out):
    """The status lines in out."""
    return [line.split(b" ")[1].decode() for line in out.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def refused(s, data, what, expect_in=None, mhd=False, status="400"):
    """data is answered 400 (naming expect_in), then the connection is closed.  mhd: the
    refusal may be libmicrohttpd's own (a Content-Length it cannot parse), whose 0.9.75
    writes its status line and headers twice before the one body."""
    out, closed = raw(s.ports["http"], data, timeout=5)
    st = responses(out)
    ok = st == [status] or (mhd and st == [status] * 2 and b"Content-Length" in out)
    assert ok, "%s: answers %s (want one %s):\n%r" % (what, st, status, out[:600])
    assert closed, "%s: connection left open after the %s" % (what, status)
    body = out.split(b"\r\n\r\n")[-1]
    if expect_in:
        assert expect_in.encode() in body, "%s: %r does not name %r" % (what, body, expect_in)
    return body


def head(method, path, headers, body=b"", version=b"HTTP/1.1"):
    hs = b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers)
    return b"%s %s %s\r\nHost: localhost\r\n%s\r\n%s" % (method, path, version, hs, body)


def chat_req(path=b"/v1/chat/completions"):
    return head(b"POST", path, [(b"Content-Type", b"application/json"),
                                (b"Content-Length", b"%d" % len(CHAT))], CHAT)


def test_framing():
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny")
    try:
        s.start_engine("g0", "--vocab", str(VOCAB))
        s.wait_ready(1)
        before = s.engines[0].stats().get("generate", 0)

        # the control: two well-framed requests, one after the other on one connection
        c = socket.create_connection(("127.0.0.1", s.ports["http"]), timeout=10)
        for _ in range(2):
            c.sendall(chat_req())
            assert one_response(c)[0] == "200"
        c.close()

        # CL + TE with a request smuggled in the chunked body
        smuggled = chat_req()
        chunk = b"%x\r\n%s\r\n0\r\n\r\n" % (len(CHAT), CHAT)
        refused(s, head(b"POST", b"/v1/chat/completions",
                        [(b"Content-Type", b"application/json"), (b"Content-Length", b"%d" % len(chunk)),
                         (b"Transfer-Encoding", b"chunked")], chunk) + smuggled,
                "Content-Length + Transfer-Encoding", "Content-Length together with Transfer-Encoding")
        refused(s, head(b"POST", b"/v1/chat/completions",
                        [(b"Transfer-Encoding", b"chunked"), (b"Content-Type", b"application/json"),
                         (b"Content-Length", b"4")], chunk) + smuggled,
                "Transfer-Encoding + Content-Length", "Content-Length together with Transfer-Encoding")
        for a, b in ((b"%d" % len(CHAT), b"%d" % len(CHAT)), (b"%d" % len(CHAT), b"1")):
            refused(s, head(b"POST", b"/v1/chat/completions",
                            [(b"Content-Type", b"application/json"), (b"Content-Length", a),
                             (b"Content-Length", b)], CHAT) + smuggled, "Content-Length %s, %s" % (a, b))
        for v in (b"abc", b"+5", b"-1", b"5 5", b"0x10", b"99999999999999999999999"):
            refused(s, head(b"POST", b"/v1/chat/completions",
                            [(b"Content-Type", b"application/json"), (b"Content-Length", v)], CHAT) + smuggled,
                    "Content-Length %r" % v, mhd=True, status="413" if len(v) > 19 else "400")
        refused(s, head(b"POST", b"/v1/chat/completions",
                        [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"gzip, chunked")],
                        chunk) + smuggled, "Transfer-Encoding gzip, chunked", "transfer coding")
        refused(s, head(b"POST", b"/v1/chat/completions",
                        [(b"Content-Type", b"application/json"), (b"Transfer-Encoding", b"chunked")],
                        chunk, version=b"HTTP/1.0") + smuggled, "Transfer-Encoding on HTTP/1.0")
        for p in (b"/v1/chat/completions%00junk", b"/v1/chat/completions%00", b"/v1/chat/completions%01",
                  b"/v1/chat/completions%0a", b"/v1/chat/completions%7F", b"/v1/chat/completions?x=%00"):
            refused(s, chat_req(p) + smuggled, "path %s" % p.decode(), "NUL or control byte")
        refused(s, head(b"GET", b"/v1/models", [(b"X-Note", b"a\x01b")]) + head(b"GET", b"/v1/models", []),
                "control byte in a header", "X-Note")

        # nothing refused reached the engine: only the control's two chats
        after = s.engines[0].stats().get("generate", 0)
        assert after - before == 2, "the engine saw %d generate calls, want the control's 2" % (after - before)
        log = s.read_log()
        assert "bad request framing" in log, log[-2000:]
        # and the server still serves on a fresh connection
        out, _ = raw(s.ports["http"], chat_req(), timeout=5)
        assert responses(out) == ["200"], out[:600]
    finally:
        assert s.stop() == 0


def test_not_utf8():
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny")
    try:
        s.start_engine("g0", "--vocab", str(VOCAB))
        s.wait_ready(1)
        cases = [(b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: localhost\r\n\r\n", "404"),
                 (b"GET /v1/models HTTP/1.1\r\nHost: 127.0\xd2.0.1\r\n\r\n", "403"),
                 (b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nOrigin: http://\xc3(\r\n\r\n", "403")]
        for data, status in cases:
            c = socket.create_connection(("127.0.0.1", s.ports["http"]), timeout=10)
            c.sendall(data)
            st, body = one_response(c)
            c.close()
            err = json.loads(body)["error"]
            assert st == status and "?" in err["message"], (data, st, body)
        out, _ = raw(s.ports["http"], chat_req(), timeout=5)
        assert responses(out) == ["200"], out[:600]
        print("   a path, a Host and an Origin that are not UTF-8: 404, 403, 403 with JSON errors; "
              "a chat served after them")
    finally:
        assert s.stop() == 0


if __name__ == "__main__":
    h.run_tests([("framing", test_framing), ("not_utf8", test_not_utf8)])
    sys.exit(0)
