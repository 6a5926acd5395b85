#!/usr/bin/env python3
"""rel-grpc-bounds: gRPC core's HTTP/2 header bounds on stepd's public port (issue 41 item 6).

Cases, each on its own raw HTTP/2 connection (h2raw.py) while a health probe runs on
ANOTHER connection (a grpcio channel calling grpc.health.v1.Health/Check in a loop):
  continuation-flood  HEADERS without END_HEADERS, then CONTINUATION frames of fresh literal
                      header fields (4 KiB each) with no end.  gRPC 1.51 parses and drops
                      them for as long as they come (the header list is over
                      GRPC_ARG_MAX_METADATA_SIZE, but that only fails the stream once the
                      block ends); the bound is the public port's maximum connection age:
                      GOAWAY, then the connection closed after the grace.
  continuation-empty  the same with empty CONTINUATION frames (nothing grows).
                      Both floods must end with a GOAWAY and then the close.  (A raw client
                      that acknowledges the server's SETTINGS in the middle of its header
                      block is cut at once for that protocol error: that, not a bound, was
                      the "sometimes cut" of issue 41.)
  metadata-1mb        one request whose single header value is 1 MiB, in HEADERS plus
                      CONTINUATION frames of 16 KiB: the connection is closed by the server
                      (the list is over the 16 KiB metadata bound), never a call served.
The age is injected ($STEPD_GRPC_MAX_CONNECTION_AGE_MS=2000, _GRACE_MS=1000, the defaults
being 1 h and 15 min): the outcome is judged by events, not by time - a GOAWAY received and
the connection closed by the server (EOF or reset, not the client's own receive timeout)
before the client pushed CAP bytes; the health probe answered SERVING on its own
connection after every case with no failure, and stepd is the same process at the end with
a Generate served.
"""
import threading
import time

from rellib import h
import h2raw

pb = h.pb
CONTINUATION = 9
CAP = 256 << 20            # bytes a flooding client pushes before the test calls it absorbed
AGE_ENV = {"STEPD_GRPC_MAX_CONNECTION_AGE_MS": "2000", "STEPD_GRPC_MAX_CONNECTION_AGE_GRACE_MS": "1000"}


class Probe:
    """Health checks in a loop on a connection of its own; counts answers and failures."""

    def __init__(self, s):
        self.ch = h.grpc.insecure_channel(s.addr)
        self.stub = h.hpbg.HealthStub(self.ch)
        self.ok, self.fail, self.stop_ev = 0, [], threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop_ev.is_set():
            try:
                r = self.stub.Check(h.hpb.HealthCheckRequest(service=""), timeout=10)
                if r.status == h.SERVING:
                    self.ok += 1
                else:
                    self.fail.append(r.status)
            except h.grpc.RpcError as e:
                self.fail.append(e.code())
            self.stop_ev.wait(0.01)

    def answers_after(self, n):
        """Wait until the probe has answered n more times (event: answers counted)."""
        target = self.ok + n
        h.wait_until(lambda: self.ok >= target or self.fail, timeout=30, what="health answers")
        assert not self.fail, "health probe failed on its own connection: %s" % self.fail[:5]

    def stop(self):
        self.stop_ev.set()
        self.t.join()
        self.ch.close()
        return self.ok, self.fail


def push_until_cut(c, first, more, cap):
    """Send first, then more() (paced: a pause every 64 KiB) until the server closes the
    connection or cap bytes went out; returns the bytes sent.  A send that blocks for 10 s
    ends the push (then the reader tells whether the server closed)."""
    c.sock.settimeout(10)
    sent, batch = 0, 0
    if not c.send(first):
        return sent
    sent += len(first)
    while sent < cap and not c.closed:
        b = more()
        if not b or not c.send(b):
            break
        sent += len(b)
        batch += len(b)
        if batch >= 65536:
            batch = 0
            time.sleep(0.002)
    return sent


def wait_closed(c):
    """The reader thread saw EOF or a reset from the server (events; its 10 s receive
    timeout is not a cut)."""
    c.reader.join(30)
    return not c.reader.is_alive() and c.ended in ("eof", "reset")


def case(s, probe, name, first, more, need_goaway=True):
    c = h2raw.Conn(s.ports["public"])
    # nothing but CONTINUATION may follow an open header block (RFC 9113 6.10): the
    # server's SETTINGS must be acknowledged before it starts
    h.wait_until(lambda: c.settings_acked or c.closed, timeout=10, what="the server's SETTINGS")
    sent = push_until_cut(c, first, more, CAP)
    cut = wait_closed(c)
    goaway = [h2raw.GOAWAY_NAMES.get(x, x) for x in c.goaway]
    data_frames = c.frames.get(h2raw.DATA, 0)
    c.close()
    probe.answers_after(3)
    print("   %s: %d bytes pushed; connection %s, GOAWAY %s, %d DATA frames back; health probe %d answers on "
          "its own connection, %d failures" % (name, sent, "closed by the server (%s)" % c.ended if cut else
                                                "NOT closed (reader %s)" % c.ended, goaway or "none", data_frames,
                                                probe.ok, len(probe.fail)))
    assert cut, "%s: the server did not close the connection (%d bytes pushed)" % (name, sent)
    assert sent < CAP, "%s: the server absorbed %d bytes" % (name, sent)
    assert goaway or not need_goaway, "%s: the connection was closed without a GOAWAY" % name
    assert data_frames == 0, "%s: a call was served" % name


def header_block(extra):
    """The header block of a Generate call with extra fields."""
    return h2raw.hpack_literal([(":method", "POST"), (":scheme", "http"), (":path", "/stepd.v1.Inference/Generate"),
                                 (":authority", "127.0.0.1"), ("content-type", "application/grpc"),
                                 ("te", "trailers")] + extra)


def test_continuation_flood(s, probe):
    sid, n = 1, [0]

    def more():
        n[0] += 1
        return h2raw.frame(CONTINUATION, 0, sid, h2raw.hpack_literal([("x-flood-%d" % n[0], "v" * 4096)]))
    case(s, probe, "continuation-flood", h2raw.frame(h2raw.HEADERS, 0, sid, header_block([])), more)


def test_continuation_empty(s, probe):
    sid = 1
    empty = h2raw.frame(CONTINUATION, 0, sid) * 256
    case(s, probe, "continuation-empty", h2raw.frame(h2raw.HEADERS, 0, sid, header_block([])), lambda: empty)


def test_metadata_1mb(s, probe):
    sid, step = 1, 16384
    block = header_block([("x-big", "b" * (1 << 20))])
    frames = [h2raw.frame(CONTINUATION, h2raw.END_HEADERS if off + step >= len(block) else 0, sid,
                          block[off:off + step]) for off in range(step, len(block), step)]
    it = iter(frames)
    # the whole block may go out before the parser reaches the bound: then the cut follows
    case(s, probe, "metadata-1mb", h2raw.frame(h2raw.HEADERS, 0, sid, block[:step]), lambda: next(it, b""),
         need_goaway=False)


def run():
    s = h.Stepd(env=AGE_ENV)
    s.start_engine("g0", "--delay-ms", "1")
    s.wait_ready()
    pid0 = s.proc.pid
    probe = Probe(s)
    probe.answers_after(3)
    test_continuation_flood(s, probe)
    test_continuation_empty(s, probe)
    test_metadata_1mb(s, probe)
    ok, fail = probe.stop()
    assert not fail, fail
    assert s.proc.poll() is None and s.proc.pid == pid0, "stepd died:\n" + s.read_log()[-3000:]
    toks, _, finals, _ = h.collect(s.inf.Generate(h.gen_request([4, 5, 6], 8), timeout=10))
    assert toks == h.expected_tokens([4, 5, 6], 8) and len(finals) == 1, (toks, finals)
    print("   health probe: %d answers, 0 failures, across the three cases; stepd pid unchanged, a Generate "
          "served after" % ok)
    assert s.stop() == 0


def bad_age():
    """A value that is not a positive number of milliseconds stops the start, naming it."""
    for v in ("abc", "0", "-5", "99999999999"):
        try:
            s = h.Stepd(env={"STEPD_GRPC_MAX_CONNECTION_AGE_MS": v})
        except RuntimeError as e:
            assert "STEPD_GRPC_MAX_CONNECTION_AGE_MS: %s is not a positive number of milliseconds" % v in str(e), e
            continue
        s.stop()
        raise AssertionError("stepd started with STEPD_GRPC_MAX_CONNECTION_AGE_MS=%s" % v)
    print("   STEPD_GRPC_MAX_CONNECTION_AGE_MS abc, 0, -5, 99999999999: each refused at start, naming it")


if __name__ == "__main__":
    h.run_tests([("grpc-bounds", run), ("grpc-bounds-bad-age", bad_age)])
