#!/usr/bin/env python3
"""C7: HTTP/2 abuse against stepd's public port (bounded, loopback).

Parts (argument selects; default all that can run):
  h2load  - `h2load` (Debian nghttp2-client) bursts: many connections x concurrent streams
            of unary GetServerInfo and of short Generate calls; exit 77 when h2load is missing.
  raw     - a raw HTTP/2 client (h2raw.py): Rapid Reset (HEADERS + DATA of a valid
            GenerateRequest + RST_STREAM(CANCEL) at once, thousands per connection),
            a PING flood and a SETTINGS flood.
  idle    - 500 idle TCP connections (no preface) + 100 that sent the preface and stay
            silent; a normal call works while they are open, and fds return afterwards.
After each part: stepd is alive (same pid), its peak RSS stays under baseline + 100 MiB,
the engine is idle again (in_flight 0, engine running 0) and a legitimate Generate
succeeds.  Latency of a legitimate client during the attack is printed (no threshold).
Usage: test_c7_h2_abuse.py [h2load|raw|idle ...] [--scale K]
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import rellib
from rellib import h
import h2raw

pb = h.pb
RSS_BOUND_KIB = 100 * 1024
RR_PER_CONN = 150      # reset streams per connection and method (x 10 connections)
RR_ROUNDS = 1
PING_FRAMES = 2000     # PING frames per connection
PING_CONNS = 1


class RssSampler:
    def __init__(self, s):
        self.s, self.peak, self.stop_ev = s, s.rss_kib(), threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop_ev.is_set():
            try:
                self.peak = max(self.peak, self.s.rss_kib())
            except OSError:
                return
            time.sleep(0.02)

    def stop(self):
        self.stop_ev.set()
        self.t.join()
        return self.peak


class LatencyProbe:
    """A legitimate client calling GetServerInfo in a loop; records latencies and failures."""

    def __init__(self, s):
        self.s, self.lat, self.fail, self.stop_ev = s, [], [], threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        ch = h.grpc.insecure_channel(self.s.addr)
        stub = h.pbg.InferenceStub(ch)
        while not self.stop_ev.is_set():
            t0 = time.perf_counter()
            try:
                stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
                self.lat.append(time.perf_counter() - t0)
            except h.grpc.RpcError as e:
                self.fail.append(e.code())
            time.sleep(0.01)
        ch.close()

    def stop(self):
        self.stop_ev.set()
        self.t.join()
        lat = sorted(self.lat)
        p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: float("nan"))
        return len(lat), p(0.5), p(0.99), self.fail


def start():
    s = h.Stepd()
    eng = s.start_engine("g0", "--delay-ms", "1")
    s.wait_ready()
    h.collect(s.inf.Generate(h.gen_request([1, 2], 4), timeout=10))     # warm
    time.sleep(0.2)
    return s, eng


def after(s, eng, pid0, rss0, peak, what):
    assert s.proc.poll() is None and s.proc.pid == pid0, "stepd died during %s:\n%s" % (what, s.read_log()[-3000:])
    assert peak - rss0 < RSS_BOUND_KIB, "%s: RSS %d -> peak %d KiB" % (what, rss0, peak)

    def idle():
        g = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0]
        return g.counters.in_flight == 0 and eng.stats().get("running", 0) == 0
    h.wait_until(idle, timeout=20, step=0.1, what="idle after " + what)
    toks, _, finals, _ = h.collect(s.inf.Generate(h.gen_request([4, 5, 6], 8), timeout=10))
    assert toks == h.expected_tokens([4, 5, 6], 8) and len(finals) == 1, (toks, finals)
    assert s.check("readiness") == h.SERVING


def part_h2load(scale):
    exe = shutil.which("h2load")
    if not exe:
        print("SKIP: h2load not installed (apt-get install nghttp2-client)")
        sys.exit(77)
    s, eng = start()
    pid0, rss0 = s.proc.pid, s.rss_kib()
    d = tempfile.mkdtemp(prefix="rel-h2load-")
    unary = os.path.join(d, "info.bin")
    with open(unary, "wb") as f:
        f.write(h2raw.grpc_message(pb.GetServerInfoRequest().SerializeToString()))
    gen = os.path.join(d, "gen.bin")
    with open(gen, "wb") as f:
        f.write(h2raw.grpc_message(h.gen_request([1, 2, 3], 4).SerializeToString()))
    base = "http://127.0.0.1:%d" % s.ports["public"]
    hdrs = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
    rss = RssSampler(s)
    probe = LatencyProbe(s)
    results = []
    for name, path, body, n, c, m in [
            ("unary burst", "/stepd.v1.Inference/GetServerInfo", unary, 20000 * scale, 20 * scale, 50),
            ("generate burst", "/stepd.v1.Inference/Generate", gen, 2000 * scale, 20, 50),
            ("many connections", "/stepd.v1.Inference/GetServerInfo", unary, 2000 * scale, 400, 1)]:
        t0 = time.time()
        p = subprocess.run([exe, "-n", str(n), "-c", str(c), "-m", str(m), "-d", body, *hdrs, base + path],
                           capture_output=True, text=True, timeout=120)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("requests:")]
        st = [ln for ln in p.stdout.splitlines() if ln.startswith("status codes:")]
        results.append((name, time.time() - t0, line[0] if line else p.stdout[-300:], st[0] if st else "",
                        rss.peak))
        assert s.proc.poll() is None, "stepd died in h2load %s" % name
    n_ok, p50, p99, fails = probe.stop()
    peak = rss.stop()
    for r in results:
        print("   h2load %-16s %.2fs  %s; %s; stepd RSS peak so far %d KiB" % r)
    print("   legit client during h2load: %d calls, p50 %.2f ms, p99 %.2f ms, failures %s; "
          "RSS %d -> peak %d KiB (+%.1f MiB)" % (n_ok, p50, p99, fails, rss0, peak, (peak - rss0) / 1024))
    for name, _, line, _, _ in results:
        assert " 0 failed" in line and " 0 errored" in line, (name, line)
    assert not fails, fails
    after(s, eng, pid0, rss0, peak, "h2load")
    assert s.stop() == 0
    shutil.rmtree(d, True)


def part_raw(scale):
    s, eng = start()
    pid0, rss0, fd0 = s.proc.pid, s.rss_kib(), s.fds()
    port = s.ports["public"]
    auth = "127.0.0.1:%d" % port
    # baseline latency of the legitimate client
    probe = LatencyProbe(s)
    time.sleep(1.0)
    base = probe.stop()
    rss = RssSampler(s)
    probe = LatencyProbe(s)
    # Rapid Reset: HEADERS + DATA(request, END_STREAM) + RST_STREAM(CANCEL), pipelined; both an
    # expensive method (Generate) and a cheap one (GetServerInfo), RR_ROUNDS rounds
    bodies = {"/stepd.v1.Inference/Generate": h2raw.grpc_message(h.gen_request([9, 9, 9], 64).SerializeToString()),
              "/stepd.v1.Inference/GetServerInfo": h2raw.grpc_message(b"")}
    n_conn, per_conn = 10, RR_PER_CONN * scale
    t0 = time.time()
    sent = 0
    rr_goaway, rr_closed = set(), 0
    for _ in range(RR_ROUNDS):
        for path, body in bodies.items():
            conns = [h2raw.Conn(port) for _ in range(n_conn)]
            for i in range(max(1, per_conn // 50)):
                for c in conns:
                    batch = bytearray()
                    for _ in range(50):
                        sid, hf = c.headers(path, auth)
                        batch += hf + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, sid, body) + \
                            h2raw.frame(h2raw.RST_STREAM, 0, sid, (h2raw.CANCEL).to_bytes(4, "big"))
                    if c.send(bytes(batch)):
                        sent += 50
            time.sleep(0.3)
            rr_goaway |= {h2raw.GOAWAY_NAMES.get(x, x) for c in conns for x in c.goaway}
            rr_closed += sum(c.closed for c in conns)
            for c in conns:
                c.close()
    rr_wall = time.time() - t0
    rr_goaway = sorted(rr_goaway)
    h.wait_until(lambda: s.fds() <= fd0, timeout=30, step=0.1, what="fds back after rapid reset")
    rr_drain = time.time() - t0 - rr_wall
    # PING flood (PING_CONNS connections at once) and a SETTINGS flood (one connection)
    floods = {}
    for name, fr, n_frames, n_c in (("ping", h2raw.frame(h2raw.PING, 0, 0, b"12345678"), PING_FRAMES, PING_CONNS),
                                    ("settings", h2raw.frame(h2raw.SETTINGS, 0, 0, b"\x00\x03\x00\x00\x00\x64"),
                                     10000, 1)):
        cs = [h2raw.Conn(port) for _ in range(n_c)]
        n = 0
        for _ in range(max(1, n_frames // 500)):
            for c in cs:
                if c.send(fr * 500):
                    n += 500
        time.sleep(0.5)
        kind = h2raw.PING if name == "ping" else h2raw.SETTINGS
        floods[name] = (n, n_c, sorted({h2raw.GOAWAY_NAMES.get(x, x) for c in cs for x in c.goaway}),
                        sum(c.closed for c in cs), sum(c.frames.get(kind, 0) for c in cs))
        for c in cs:
            c.close()
    n_ok, p50, p99, fails = probe.stop()
    peak = rss.stop()
    st = eng.stats()
    print("   rapid reset: %d HEADERS+DATA+RST_STREAM (Generate and GetServerInfo) on %d connections x %d in "
          "%.2fs (%.0f/s); stepd fds back to %d %.2fs after the last close; GOAWAY %s; %d connections closed "
          "by the server; engine saw %s" % (sent, n_conn, 2 * RR_ROUNDS, rr_wall, sent / max(rr_wall, 1e-9), fd0,
                                           rr_drain, rr_goaway or "none", rr_closed, st))
    for name, (n, n_c, ga, closed, answered) in floods.items():
        print("   %s flood: %d frames sent on %d connection(s), %d answered, GOAWAY %s, %d closed by the server" %
              (name, n, n_c, answered, ga or "none", closed))
    print("   legit client: baseline p50 %.2f ms p99 %.2f ms (%d calls); during attack p50 %.2f ms p99 %.2f ms "
          "(%d calls, failures %s), p99 ratio %.2f" % (base[1], base[2], base[0], p50, p99, n_ok, fails,
                                                       p99 / base[2] if base[2] else float("nan")))
    print("   RSS %d -> peak %d KiB (+%.1f MiB)" % (rss0, peak, (peak - rss0) / 1024))
    assert not fails, fails
    after(s, eng, pid0, rss0, peak, "rapid reset / floods")
    rss1 = s.rss_kib()
    print("   after: RSS %d KiB, fds %d, threads %d" % (rss1, s.fds(), s.threads()))
    assert s.stop() == 0


def part_idle(scale):
    s, eng = start()
    pid0, rss0 = s.proc.pid, s.rss_kib()
    fd0 = s.fds()
    port = s.ports["public"]
    n_tcp, n_h2 = 500, 100
    socks = []
    t0 = time.time()
    for _ in range(n_tcp):
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    h2c = [h2raw.Conn(port) for _ in range(n_h2)]
    h.wait_until(lambda: s.fds() >= fd0 + n_tcp + n_h2, timeout=10, what="stepd accepted the idle connections")
    fd_peak = s.fds()
    rss_mid = s.rss_kib()
    t1 = time.time()
    toks, _, finals, _ = h.collect(s.inf.Generate(h.gen_request([4, 5, 6], 8), timeout=10))
    call_s = time.time() - t1
    assert toks == h.expected_tokens([4, 5, 6], 8), toks
    assert s.check("readiness") == h.SERVING
    for x in socks:
        x.close()
    for c in h2c:
        c.close()
    h.wait_until(lambda: s.fds() <= fd0 + 2, timeout=15, what="fds back after closing idle connections")
    print("   %d idle TCP + %d silent HTTP/2 connections opened in %.2fs; stepd fds %d -> %d -> %d; "
          "RSS %d -> %d KiB; a Generate during them took %.1f ms" %
          (n_tcp, n_h2, t1 - t0, fd0, fd_peak, s.fds(), rss0, rss_mid, call_s * 1e3))
    after(s, eng, pid0, rss0, max(rss_mid, s.rss_kib()), "idle connections")
    assert s.stop() == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("parts", nargs="*", default=["raw", "idle"])
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--rr-per-conn", type=int, default=RR_PER_CONN)
    ap.add_argument("--rr-rounds", type=int, default=RR_ROUNDS)
    ap.add_argument("--ping-frames", type=int, default=PING_FRAMES)
    ap.add_argument("--ping-conns", type=int, default=PING_CONNS)
    a = ap.parse_args()
    globals().update(RR_PER_CONN=a.rr_per_conn, RR_ROUNDS=a.rr_rounds, PING_FRAMES=a.ping_frames,
                     PING_CONNS=a.ping_conns)
    fns = {"h2load": part_h2load, "raw": part_raw, "idle": part_idle}
    if "h2load" in a.parts and not shutil.which("h2load"):
        print("SKIP: h2load not installed (apt-get install nghttp2-client)")
        sys.exit(77)
    h.run_tests([("c7-" + p, (lambda p=p: fns[p](a.scale))) for p in a.parts])


if __name__ == "__main__":
    main()
