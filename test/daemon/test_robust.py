#!/usr/bin/env python3
"""Coordinator robustness: no request, engine answer or client behaviour kills stepd.

  refusals         an engine that refuses a request with each gRPC status (mock engine,
                   --refuse-by-id), over output streams and over per-request Generate
                   calls: every such request ends with that status and a message naming it,
                   a stream running meanwhile is untouched, the coordinator keeps serving
  capacity         engines that report their capacity (mock, --max-seqs/--max-waiting): no
                   group is ever sent more than it admits, the rest waits in the coordinator
                   (and goes to the group with room), every request ends OK
  deadline_burst   thousands of Generate calls with 1-20 ms deadlines against the real CPU
                   group (tiny model): each ends OK or DEADLINE_EXCEEDED, exactly once
  reset_burst      thousands of calls cancelled (RST_STREAM) 0-10 ms after they were sent,
                   and a mix of both, against the real CPU group
  streams_2000     2000 concurrent streams against a CPU group whose engine admits 256: every
                   stream ends with exactly one terminal status (all OK: the coordinator
                   holds what the engine cannot take), and stepd's RSS, fds and threads
                   return to their baseline
After every burst: stepd is alive and SERVING, nothing is in flight in the coordinator or
in the engine, and a normal request is served.

ROBUST_BURST (calls per burst, default 3000) and ROBUST_STREAMS (default 2000) size the
runs; a sanitizer build of stepd (STEPD_BIN from build-asan) is run with smaller ones by
CI (.ci/run).
"""
import json
import os
import subprocess
import sys
import threading
import time

import grpc

from stepd_harness import (GRPC_POOL_SLACK, LOADGEN_BIN, STEPD_BIN, SERVING, Stepd, code_of, collect,
                           expected_tokens, gen_request, ledger_line, own_threads, pb, run_tests, sanitized,
                           wait_idle, wait_until)

BURST = int(os.environ.get("ROBUST_BURST", "3000"))
STREAMS = int(os.environ.get("ROBUST_STREAMS", "2000"))
CODES = {c.value[0]: c for c in grpc.StatusCode}


def loadgen(addr, streams, *args, timeout=600):
    cmd = [LOADGEN_BIN, "--addr", addr, "--streams", str(streams), *map(str, args)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("JSON "):
            r = json.loads(line[5:])
            r["by_name"] = {CODES[i].name: n for i, n in enumerate(r["codes"]) if n}
            return r
    raise RuntimeError("loadgen failed (%d):\n%s%s" % (p.returncode, p.stdout, p.stderr))


def in_flight(s):
    return sum(g.counters.in_flight for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups)


def assert_healthy(s, what, engine_alive=True):
    """stepd alive and serving, nothing left in flight anywhere, a request is served."""
    assert s.proc.poll() is None, "stepd died during %s:\n%s" % (what, s.read_log()[-3000:])
    assert s.check("readiness") == SERVING, what
    wait_until(lambda: in_flight(s) == 0, timeout=15, what="nothing in flight in the coordinator after " + what)
    info = wait_until(lambda: (lambda i: i if i.running == 0 and i.waiting == 0 else None)(
        s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2)), timeout=15, what="admission idle")
    assert info.groups_ready >= 1, info
    if engine_alive:
        # the engine's own count of live request states and KV blocks (GetLoads through stepd; D1)
        wait_idle(s, what)
    req = gen_request([5, 6, 7], 4)
    req.sampling_params.temperature = 0.0
    toks, _, finals, _ = collect(s.inf.Generate(req, timeout=30))
    assert len(toks) == 4 and len(finals) == 1 and finals[0].finish_reason == pb.FINISH_REASON_LENGTH, finals


def engine_created(s):
    return sum(l.requests_created for l in s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2).loads)


def cpu_group(s, *args, group="cpu0"):
    w = s.start_worker(group, "--threads", "1", *args)
    try:
        s.wait_ready(1, timeout=120)
    except AssertionError:
        print(open(w.logpath).read()[-3000:])
        raise
    return w


# ---------------------------------------------------------------- refusals (mock)

def refusals_on(generate_path):
    s = Stepd()
    args = ["--refuse-by-id", "--delay-ms", "5"] + (["--no-output-streams"] if generate_path else [])
    eng = s.start_engine("g0", *args)
    s.wait_ready()
    # a stream that runs through all of it
    long_out = {}

    def long_stream():
        try:
            long_out["r"] = collect(s.inf.Generate(gen_request([3, 4], 400, request_id="long"), timeout=60))
        except grpc.RpcError as e:
            long_out["e"] = (e.code(), e.details())
    th = threading.Thread(target=long_stream)
    th.start()
    wait_until(lambda: eng.stats().get("running", 0) >= 1, what="long stream running")
    for code in range(1, 17):
        want = CODES[code]
        for k in range(3):
            c, d = code_of(lambda: collect(s.inf.Generate(gen_request([9, code], 8,
                                                                      request_id="refuse-%d-%d" % (code, k)),
                                                          timeout=10)))
            assert c == want, (code, c, d)
            assert want.name in d and "g0" in d and "refused" in d, (code, d)
        # in between, ordinary requests are served
        toks, _, finals, _ = collect(s.inf.Generate(gen_request([code, 1], 3), timeout=10))
        assert toks == expected_tokens([code, 1], 3) and len(finals) == 1, (code, toks, finals)
    th.join(60)
    assert "r" in long_out, long_out
    toks, _, finals, _ = long_out["r"]
    assert toks == expected_tokens([3, 4], 400) and len(finals) == 1, (len(toks), finals)
    assert eng.stats()["refused"] == 48, eng.stats()
    gg = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0]
    assert gg.state == pb.WORKER_STATE_READY and gg.epoch == 1 and gg.counters.in_flight == 0, gg
    assert s.proc.poll() is None
    assert s.stop() == 0
    print("   %s: 16 statuses x 3 refusals, each ended with its status naming it; a 400-token stream "
          "meanwhile OK" % ("per-request Generate" if generate_path else "output streams"))


def test_refusals():
    refusals_on(False)
    refusals_on(True)


# ---------------------------------------------------------------- capacity (mock)

def test_capacity():
    s = Stepd()
    a = s.start_engine("a", "--delay-ms", "5", "--max-seqs", "4", "--max-waiting", "4")
    b = s.start_engine("b", "--delay-ms", "5", "--max-seqs", "2", "--max-waiting", "2")
    s.wait_ready(2)
    wait_until(lambda: "admits 8 requests at once" in s.read_log() and "admits 4 requests" in s.read_log(),
               what="capacity learned")
    r = loadgen(s.addr, 300, "--tokens", "20")
    assert r["ok"] == 300 and r["violations"] == 0, r
    sa, sb = a.stats(), b.stats()
    assert sa["over_capacity"] == 0 and sb["over_capacity"] == 0, (sa, sb)
    assert sa["peak_running"] <= 8 and sb["peak_running"] <= 4, (sa, sb)
    assert sa["generate"] + sb["generate"] == 300 and sb["generate"] > 0, (sa, sb)
    # over the Generate fallback too
    s2 = Stepd()
    c = s2.start_engine("c", "--delay-ms", "2", "--max-seqs", "3", "--max-waiting", "2", "--no-output-streams")
    s2.wait_ready(1)
    r2 = loadgen(s2.addr, 100, "--tokens", "10")
    assert r2["ok"] == 100 and c.stats()["over_capacity"] == 0 and c.stats()["peak_running"] <= 5, (r2, c.stats())
    print("   300 streams over engines admitting 8 and 4: all OK, peaks %d and %d, no engine refusal; "
          "Generate path: peak %d of 5" % (sa["peak_running"], sb["peak_running"], c.stats()["peak_running"]))
    assert s.stop() == 0 and s2.stop() == 0


# ---------------------------------------------------------------- bursts (real CPU group)

def test_deadline_burst():
    s = Stepd("--heartbeat-ms", "200")
    w = cpu_group(s)
    r = loadgen(s.addr, BURST, "--tokens", "2", "--deadline-ms", "1,20", "--concurrency", "12")
    ledger_line("deadline burst", BURST, BURST - r["violations"])
    assert r["violations"] == 0, r
    assert set(r["by_name"]) <= {"OK", "DEADLINE_EXCEEDED"}, r["by_name"]
    assert_healthy(s, "the deadline burst")
    # many of them got as far as the engine before their deadline passed (the share depends
    # on the machine's speed: ~85 % here, 20-45 % under ASan)
    created = engine_created(s)
    assert created > BURST // 10, created
    print("   %d calls with 1-20 ms deadlines: %s; %d reached the engine" % (BURST, r["by_name"], created))
    assert s.stop() == 0
    assert w.wait(20) == 0


def test_reset_burst():
    s = Stepd()
    w = cpu_group(s)
    r = loadgen(s.addr, BURST, "--tokens", "64", "--cancel-after-ms", "0,10", "--concurrency", "64")
    ledger_line("reset burst", BURST, BURST - r["violations"])
    assert r["violations"] == 0, r
    assert set(r["by_name"]) <= {"OK", "CANCELLED"}, r["by_name"]
    assert r["by_name"].get("CANCELLED", 0) > BURST // 2, r["by_name"]
    assert_healthy(s, "the reset burst")
    created = engine_created(s)
    # some of the burst reached the engine: ~20 % here, 7-35 % under ASan, 1.97 % once on a
    # loaded 2-core CI run
    assert created > BURST // 200, created
    # both at once, sampled, with logprobs (more work per token on every path)
    r2 = loadgen(s.addr, BURST, "--tokens", "32", "--cancel-after-ms", "0,10", "--deadline-ms", "1,20",
                 "--concurrency", "128", "--temperature", "0.8", "--logprobs", "3")
    ledger_line("mixed burst", BURST, BURST - r2["violations"])
    assert r2["violations"] == 0 and r2["bad_logprobs"] == 0, r2
    assert set(r2["by_name"]) <= {"OK", "CANCELLED", "DEADLINE_EXCEEDED"}, r2["by_name"]
    assert_healthy(s, "the mixed burst")
    print("   %d calls reset 0-10 ms after sending: %s (%d reached the engine); %d with resets and "
          "deadlines: %s" % (BURST, r["by_name"], created, BURST, r2["by_name"]))
    assert s.stop() == 0
    assert w.wait(20) == 0


def snapshot(s):
    return dict(rss_kib=s.rss_kib(), fds=s.fds(), threads=s.threads(), own_threads=own_threads(s.proc.pid))


def idle_trim(s):
    """Wait for the idle coordinator's next heap trim (stepd:idle_trims_total), instead of
    sleeping past it: its first comes 1 s after the last request ended.  Then until the
    metrics scrapes' connections are closed on stepd's side too (its fd count back)."""
    fds = s.fds()
    n = s.metric("stepd:idle_trims_total")
    wait_until(lambda: s.metric("stepd:idle_trims_total") > n, timeout=60, step=0.1, what="an idle trim")
    wait_until(lambda: s.fds() <= fds, timeout=60, what="the metrics connections closed")


def test_streams_2000():
    s = Stepd("--max-running", "1024", "--max-queue", "1024", "--max-concurrent-streams", "4096")
    # the engine admits 8 running + 248 waiting = 256 at once
    w = cpu_group(s, "--max-seqs", "8", "--max-waiting", "248")
    wait_until(lambda: "admits 256 requests at once" in s.read_log(), what="capacity learned")
    warm = loadgen(s.addr, 300, "--tokens", "4")         # channels, arenas, thread pools
    assert warm["ok"] == 300, warm
    wait_until(lambda: in_flight(s) == 0, what="idle after the warm-up")
    idle_trim(s)
    before = snapshot(s)
    t0 = time.time()
    r = loadgen(s.addr, STREAMS, "--tokens", "8", "--deadline-s", "300")
    wall = time.time() - t0
    ledger_line("%d streams" % STREAMS, STREAMS, STREAMS - r["violations"])
    assert r["violations"] == 0, r
    # all of them: the coordinator holds what the engine cannot take (never its RESOURCE_EXHAUSTED)
    assert r["ok"] == STREAMS and r["short_ok"] == 0, r
    assert "engine is at capacity" not in s.read_log(), s.read_log()[-2000:]
    # back to the baseline
    asan = sanitized(STEPD_BIN)
    t1 = time.time()
    wait_until(lambda: in_flight(s) == 0, what="idle after the load")
    idle_trim(s)
    after = snapshot(s)
    # an event wait (gRPC core frees connections' buffers some time after the last call; more
    # trims follow): 60 s is a hang guard, not a measurement
    while time.time() - t1 < 60 and (after["fds"] != before["fds"] or after["own_threads"] != before["own_threads"] or
                                     (not asan and after["rss_kib"] > 1.05 * before["rss_kib"])):
        time.sleep(0.2)
        after = snapshot(s)
    print("   %d concurrent streams x 8 tokens over an engine admitting 256: all OK in %.1f s; before %s, "
          "after %.1f s idle %s (RSS x%.3f)" % (STREAMS, wall, before, time.time() - t1, after,
                                                after["rss_kib"] / before["rss_kib"]))
    # threads: stepd's own back to theirs; gRPC core's pools grow on demand and keep a few
    assert after["fds"] == before["fds"] and after["own_threads"] == before["own_threads"], (before, after)
    assert after["threads"] <= before["threads"] + GRPC_POOL_SLACK, (before, after)
    # a sanitizer build keeps freed memory in quarantine: its RSS is only reported
    assert asan or after["rss_kib"] <= 1.12 * before["rss_kib"], (before, after)
    assert_healthy(s, "2000 streams")
    assert s.stop() == 0
    assert w.wait(20) == 0


if __name__ == "__main__":
    run_tests([
        ("refusals", test_refusals),
        ("capacity", test_capacity),
        ("deadline_burst", test_deadline_burst),
        ("reset_burst", test_reset_burst),
        ("streams_2000", test_streams_2000),
    ])
