"""test_http_starve.py - HTTP ports that idle clients cannot starve (issue 41 item 2).

Against stepd with a mock engine, raw sockets:
  idle_flood      --idle N silent TCP connections to the API port and N to the metrics port
                  (64 connections), plus --slow N clients sending a request head a byte at a
                  time: /health on the API port and /metrics on the metrics port answer, and a
                  chat completes (each within a generous event timeout; the times are printed,
                  not judged).  Past a limit the oldest idle connection is closed to make room.
  header_timeout  --http-header-timeout 1 with --http-timeout 30: a connection that sends no
                  complete request head is closed long before --http-timeout; one mid-body is not
  busy_refusals   connections that are all busy (streams in progress): one more from the same
                  address is answered 429 (--http-max-connections-per-ip), past the total 503
                  (--http-max-connections), each with Retry-After and closed; the port serves
                  again once the streams end
--idle 2000 --slow 200 measures the issue's figures by hand (the CI run holds 300 and 100);
--hold raises stepd's limits above the flood, so that the server holds every API connection.
"""
import argparse
import json
import socket
import sys
import time

from rellib import h
from test_http_framing import CHAT, VOCAB, one_response

HOST = b"Host: localhost\r\n"


def start(*args, mock_args=()):
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--served-model-name", "tiny", *args)
    s.start_engine("g0", "--vocab", str(VOCAB), *mock_args)
    s.wait_ready(1)
    return s


def connect_many(port, n):
    socks = []
    for _ in range(n):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        socks.append(c)
    return socks


def closed_by_server(socks):
    """How many of socks the server has closed (EOF or reset)."""
    n = 0
    for c in socks:
        try:
            if c.recv(4096) == b"":
                n += 1
        except BlockingIOError:
            pass
        except OSError:
            n += 1
    return n


def timed(port, data, timeout):
    """One request on a fresh connection: (status, body, seconds)."""
    t0 = time.time()
    c = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        c.sendall(data)
        st, body = one_response(c)
    finally:
        c.close()
    return st, body, time.time() - t0


def chat():
    return (b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT))


def get(path):
    return b"GET %s HTTP/1.1\r\n%s\r\n" % (path, HOST)


def test_idle_flood(n_idle, n_slow, hold=False):
    """hold: limits above the flood (the server keeps every API connection open)."""
    s = start(*(("--http-max-connections", "8192", "--http-max-connections-per-ip", "0") if hold else ()))
    try:
        api, met = s.ports["http"], s.ports["metrics"]
        t0 = time.time()
        idle_api, idle_met = connect_many(api, n_idle), connect_many(met, n_idle)
        slow = connect_many(api, n_slow)
        time.sleep(0.5)      # let the connects complete (not a judgement)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: "
        for c in slow:
            try:
                c.send(head[:10])
            except OSError:
                pass
        print("   %d idle connections on each port and %d slow-header clients opened in %.1f s" %
              (n_idle, n_slow, time.time() - t0))
        res = {}
        for what, port, data in (("API /health", api, get(b"/health")), ("metrics /metrics", met, get(b"/metrics")),
                                 ("API chat", api, chat()), ("metrics /health", met, get(b"/health"))):
            st, body, dt = timed(port, data, timeout=30)
            assert st == "200", (what, st, body[:300])
            res[what] = dt
        # the slow clients keep dribbling; the API still answers
        for c in slow:
            try:
                c.send(head[10:12])
            except OSError:
                pass
        st, body, dt = timed(api, chat(), timeout=30)
        assert st == "200" and json.loads(body)["choices"], (st, body[:300])
        res["API chat (after more slow bytes)"] = dt
        print("   " + ", ".join("%s %.0f ms" % (k, 1000 * v) for k, v in res.items()))
        # room was made by closing idle connections, not by leaving new ones in the backlog:
        # at most 256 of one address on the API port (the default), 64 on the metrics port
        # (connects past the listen backlog arrive late: waited for, not timed)
        def made_room():
            ca, cs, cm = closed_by_server(idle_api), closed_by_server(slow), closed_by_server(idle_met)
            ok = (ca + cs == 0 if hold else ca + cs >= n_idle + n_slow - 256) and cm >= n_idle - 64
            return (ca, cs, cm) if ok else None
        try:
            # within the listen backlog (511) every connect is in at once; past it, SYN retries
            h.wait_until(made_room, timeout=5 if n_idle + n_slow <= 500 else 60, step=0.2,
                         what="idle connections closed to make room")
        finally:
            ca, cs, cm = closed_by_server(idle_api), closed_by_server(slow), closed_by_server(idle_met)
        print("   closed by the server to make room: API %d of %d idle, %d of %d slow; metrics %d of %d idle" %
              (ca, n_idle, cs, n_slow, cm, n_idle))
        for c in idle_api + idle_met + slow:
            c.close()
        assert s.proc.poll() is None
    finally:
        assert s.stop() == 0


def test_header_timeout():
    s = start("--http-header-timeout", "1", "--http-timeout", "30")
    try:
        port = s.ports["http"]
        silent = socket.create_connection(("127.0.0.1", port), timeout=15)
        partial = socket.create_connection(("127.0.0.1", port), timeout=15)
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")     # no blank line
        mid_body = socket.create_connection(("127.0.0.1", port), timeout=3)
        mid_body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT[:5]))
        t0 = time.time()
        for c, what in ((silent, "a silent connection"), (partial, "a partial request head")):
            out = b""
            while True:     # until the server closes it; socket timeout 15 s (half --http-timeout)
                b = c.recv(4096)
                if not b:
                    break
                out += b
            assert out == b"" or out.startswith(b"HTTP/1.1 408"), (what, out)
            c.close()
        print("   no request head: closed after %.1f s (--http-header-timeout 1, --http-timeout 30)" % (time.time() - t0))
        # the head arrived: the request (body) deadline is --http-timeout, not the header one
        try:
            b = mid_body.recv(4096)
            raise AssertionError("a request mid-body was answered or closed: %r" % b)
        except socket.timeout:
            pass
        mid_body.sendall(CHAT[5:])
        mid_body.settimeout(30)
        st, body = one_response(mid_body)
        assert st == "200", (st, body[:300])
        mid_body.close()
        assert "did not send its request head within 1000 ms" in s.read_log()
    finally:
        assert s.stop() == 0


def stream_open(port):
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000,
                       "stream": True}).encode()
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n" + HOST + b"Content-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"data: " not in got:
        b = c.recv(4096)
        assert b, got
        got += b
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return c


def refused_with(port, status):
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    out = b""
    while True:     # answered at accept: nothing to send first
        b = c.recv(4096)
        if not b:
            break
        out += b
    c.close()
    assert out.startswith(b"HTTP/1.1 %s " % status.encode()), out[:300]
    assert b"\r\nRetry-After: 1\r\n" in out and b"Connection: close" in out, out[:300]
    body = json.loads(out.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"], body
    return body


def test_busy_refusals():
    for args, status in ((("--http-max-connections-per-ip", "3"), "429"),
                         (("--http-max-connections", "3", "--http-max-connections-per-ip", "0"), "503")):
        s = start(*args, "--max-running", "8", mock_args=("--delay-ms", "20"))
        try:
            port = s.ports["http"]
            streams = [stream_open(port) for _ in range(3)]
            body = refused_with(port, status)
            assert "busy" in body["error"]["message"], body
            for c in streams:
                c.close()
            h.wait_until(lambda: s.metric("stepd:num_requests_running") == 0, timeout=30, what="streams cancelled")
            st, body, _ = timed(port, chat(), timeout=30)
            assert st == "200", (st, body[:300])
            assert "refused %s" % status in s.read_log()
        finally:
            assert s.stop() == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=300)
    ap.add_argument("--slow", type=int, default=100)
    ap.add_argument("--hold", action="store_true", help="limits above the flood: every API connection held")
    a = ap.parse_args()
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * a.idle + a.slow + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    h.run_tests([("idle_flood", lambda: test_idle_flood(a.idle, a.slow, a.hold)), ("header_timeout", test_header_timeout),
                 ("busy_refusals", test_busy_refusals)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
