#!/usr/bin/env python3
"""Coordinator integration tests over loopback with a real grpcio client.

Covers: unary and streaming calls, cancellation mid-stream (exactly one Abort),
deadlines, health Check/Watch, failover when a group dies and re-forms, the bad
input matrix (docs/RELIABILITY.md C8: INVALID_ARGUMENT naming the field, no engine
touched), admission overload (A2 in small), message size (C5), API key on every
RPC except health (E3), loopback default (E1), text/chat via the tokenizer,
metrics, and drain on SIGTERM (exit 0).
"""
import math
import os
import re
import signal
import subprocess
import threading
import time

import grpc

from stepd_harness import (MOCK_ARGS, NOT_SERVING, SERVING, STEPD_BIN, TOKENIZER, Stepd, collect, pbg,
                           expected_tokens, gen_request, hpb, pb, run_tests, sanitized, tokenizer_size,
                           wait_until)

OK = grpc.StatusCode.OK


def code_of(fn):
    try:
        fn()
        return OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


# ---------------------------------------------------------------- basics

def test_unary_and_stream():
    s = Stepd()
    eng = s.start_engine("g0", "--delay-ms", "2")
    s.wait_ready()
    info = s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2)
    assert info.role == "coordinator" and info.groups_ready == 1 and info.limits.max_queue == 1024, info
    mi = s.inf.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
    assert mi.vocab_size == 1000 and mi.max_model_len == 4096 and mi.model_name == "mock-step", mi
    loads = s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2)
    assert [l.group for l in loads.loads] == ["g0"], loads
    groups = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2)
    g = groups.groups[0]
    assert g.group == "g0" and g.state == pb.WORKER_STATE_READY and g.epoch == 1 and len(g.ranks) == 1, g

    ids = [5, 6, 7, 8]
    toks, _, finals, chunks = collect(s.inf.Generate(gen_request(ids, 12, request_id="r-basic"), timeout=10))
    assert toks == expected_tokens(ids, 12), toks
    assert len(finals) == 1, finals
    f = finals[0]
    assert f.finish_reason == pb.FINISH_REASON_LENGTH and f.usage.prompt_tokens == 4 and \
        f.usage.completion_tokens == 12, f
    assert f.group == "g0" and f.request_id == "r-basic", f
    assert f.timings.first_token_s > 0 and f.timings.e2e_s >= f.timings.first_token_s, f.timings
    assert f.mtp.num_drafts == 6 and list(f.mtp.accepted_per_position) == [6, 3, 1], f.mtp
    assert f.usage.cached_tokens == 0, f.usage
    # cache_salt reaches the engine (the mock reports its length as cached tokens)
    _, _, finals, _ = collect(s.inf.Generate(gen_request(ids, 2, cache_salt="tenant-7"), timeout=10))
    assert finals[0].usage.cached_tokens == 8, finals[0].usage
    # server-assigned id, continuous usage
    req = gen_request(ids, 3, stream_options=pb.StreamOptions(continuous_usage_stats=True))
    toks, _, finals, chunks = collect(s.inf.Generate(req, timeout=10))
    assert finals[0].request_id.startswith("stepd-"), finals[0]
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3], chunks
    # duplicate in-flight id
    st = s.inf.Generate(gen_request(ids, 200, request_id="dup"), timeout=10)
    next(st)
    c, d = code_of(lambda: collect(s.inf.Generate(gen_request(ids, 2, request_id="dup"), timeout=5)))
    assert c == grpc.StatusCode.ALREADY_EXISTS and "request_id" in d, (c, d)
    st.cancel()
    # Inference.Abort ends a stream with finish reason ABORT
    st = s.inf.Generate(gen_request(ids, 500, request_id="to-abort"), timeout=10)
    next(st)
    ab = s.inf.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]), timeout=2)
    assert ab.aborted == 1, ab
    _, _, finals, _ = collect(st)
    assert finals[0].finish_reason == pb.FINISH_REASON_ABORT, finals
    wait_until(lambda: eng.stats().get("abort", 0) >= 1, what="engine abort")
    # unknown method on the public port
    c, d = code_of(lambda: s.channel.unary_unary("/stepd.v1.Nope/X")(b"", timeout=2))
    assert c == grpc.StatusCode.UNIMPLEMENTED, (c, d)
    m = s.metrics()
    assert "stepd:time_to_first_token_seconds_bucket" in m and "stepd:spec_decode_num_accepted_tokens_per_pos_total" in m
    assert s.metric("stepd:generation_tokens_total") >= 15, m
    assert s.stop() == 0


def test_cancel_and_deadline():
    s = Stepd()
    eng = s.start_engine("g0", "--delay-ms", "5")
    s.wait_ready()
    # client cancels mid-stream -> exactly one Abort reaches the engine
    st = s.inf.Generate(gen_request([1, 2], 1000, request_id="c1"), timeout=30)
    got = 0
    for r in st:
        got += len(r.chunk.token_ids)
        if got >= 3:
            st.cancel()
            t_cancel = time.time()
            break
    wait_until(lambda: eng.stats().get("running", 1) == 0, step=0.005, what="engine stream closed")
    t_engine_free = time.time() - t_cancel
    time.sleep(0.3)
    stt = eng.stats()
    assert stt["abort"] == 1, stt
    assert s.metric("stepd:aborts_sent_total") == 1
    # deadline propagates: DEADLINE_EXCEEDED, engine stream stops, one more abort
    t0 = time.time()
    c, d = code_of(lambda: collect(s.inf.Generate(gen_request([3], 1000, request_id="d1"), timeout=0.3)))
    assert c == grpc.StatusCode.DEADLINE_EXCEEDED, (c, d)
    t_deadline = time.time() - t0   # reported, not asserted: the client's own gRPC timer
    wait_until(lambda: eng.stats().get("running", 1) == 0, what="engine stream stopped after deadline")
    time.sleep(0.2)
    assert eng.stats()["abort"] <= 2, eng.stats()
    groups = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2)
    assert groups.groups[0].counters.in_flight == 0, groups
    print("   cancel after 3 tokens: 1 Abort at the engine, its stream freed %.0f ms after the cancel; a 300 ms "
          "deadline ended DEADLINE_EXCEEDED after %.0f ms, %d Aborts in all" %
          (1000 * t_engine_free, 1000 * t_deadline, eng.stats()["abort"]))
    assert s.stop() == 0


# ---------------------------------------------------------------- engine output streams

def _run_parallel(s, reqs, timeout=30):
    out = [None] * len(reqs)

    def one(i):
        try:
            out[i] = (OK, collect(s.inf.Generate(reqs[i], timeout=timeout)), "")
        except grpc.RpcError as e:
            out[i] = (e.code(), None, e.details())
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def test_output_streams():
    # The coordinator submits to the engine's output stream (one OutputBatch per engine
    # step for all requests) and falls back to one Generate call per request for an
    # engine without it (coord-grpcio-generate-path runs this file with
    # --no-output-streams). Both give the same results.
    generate_path = "--no-output-streams" in MOCK_ARGS
    s = Stepd()
    eng = s.start_engine("g0", "--delay-ms", "5", "--break-output-streams-after-tokens", "300")
    s.wait_ready()
    # the coordinator opens the engine's output stream once the group is ready: a request
    # before that goes by Generate; count from the first one that went by Submit
    for _ in range(100):
        _run_parallel(s, [gen_request([1, 2], 1)])
        if generate_path or eng.stats().get("submit", 0) > 0:
            break
        time.sleep(0.05)
    st0 = eng.stats()
    prompts = [[i + 1, 2 * i + 3] for i in range(8)]
    res = _run_parallel(s, [gen_request(p, 20, request_id="os-%d" % i) for i, p in enumerate(prompts)])
    for p, (code, got, det) in zip(prompts, res):
        assert code == OK, (code, det)
        toks, _, finals, _ = got
        assert toks == expected_tokens(p, 20), (p, toks)
        assert len(finals) == 1 and finals[0].finish_reason == pb.FINISH_REASON_LENGTH, finals
    st = {k: v - st0[k] if isinstance(v, int) and k in st0 and k != "peak_running" else v
          for k, v in eng.stats().items()}
    assert st["generate"] == 8 and st["tokens"] == 160, st
    if generate_path:
        assert st["submit"] == 0 and st["batches"] == 0, st
    else:
        # 160 token chunks and 8 finals came in far fewer messages
        assert st["submit"] == 8 and 0 < st["batches"] <= 84, st
    print("   8 x 20 tokens: engine calls %d, by Submit %d, output batches %d"
          % (st["generate"], st["submit"], st["batches"]))

    # The engine's output streams fail (the engine stays up): what was on them ends
    # UNAVAILABLE naming the group, nothing is left in flight, and the next requests
    # are served (by Generate while the stream backs off, then on a new stream).
    n_open = len(re.findall(r"output stream \S+ open", s.read_log()))
    res = _run_parallel(s, [gen_request([5, i], 200, request_id="br-%d" % i) for i in range(4)])
    codes = sorted(set(r[0] for r in res), key=str)
    if generate_path:
        assert codes == [OK], res
    else:
        assert codes == [grpc.StatusCode.UNAVAILABLE], res
        for _, _, det in res:
            assert "g0" in det and "output stream" in det, det
    wait_until(lambda: s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0].counters.in_flight == 0,
               what="nothing in flight after the output streams broke")
    wait_until(lambda: eng.stats()["running"] == 0, what="engine idle")
    toks, _, finals, _ = collect(s.inf.Generate(gen_request([9, 9], 10), timeout=10))
    assert toks == expected_tokens([9, 9], 10) and len(finals) == 1
    n_submit = eng.stats()["submit"]
    if not generate_path:   # past the coordinator's back-off: it logs a new stream open
        wait_until(lambda: len(re.findall(r"output stream \S+ open", s.read_log())) > n_open,
                   timeout=30, what="a new output stream")
    toks, _, finals, _ = collect(s.inf.Generate(gen_request([9, 8], 10), timeout=10))
    assert toks == expected_tokens([9, 8], 10) and len(finals) == 1
    if not generate_path:
        assert eng.stats()["submit"] == n_submit + 1, eng.stats()
    assert s.stop() == 0


def test_engine_ignores_deadline():
    # An engine that stops answering (SIGSTOP, shorter than the worker timeout) must not
    # keep a request alive in the coordinator past its deadline: a Generate call has its
    # own gRPC deadline, a request on an output stream is swept about a second after it.
    # Told apart by its cause, not by a time: the worker timeout is an hour, so the group
    # stays up, and the release must be the sweep's (its log line; the sweep runs on the
    # heartbeat's tick) or, without output streams, the engine call's own deadline, not
    # the end of the engine's output stream (its channel's keepalive, 10 + 5 s); the
    # wait is a hang guard.
    s = Stepd("--worker-timeout-ms", "3600000")
    eng = s.start_engine("g0", "--delay-ms", "5")
    s.wait_ready()
    collect(s.inf.Generate(gen_request([1], 4), timeout=10))    # the output stream is open
    st = s.inf.Generate(gen_request([2], 2000), timeout=1.0)
    next(st)
    eng.proc.send_signal(signal.SIGSTOP)
    try:
        c, d = code_of(lambda: collect(st))
        assert c == grpc.StatusCode.DEADLINE_EXCEEDED, (c, d)
        t0 = time.time()
        wait_until(lambda: s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0].counters.in_flight == 0,
                   timeout=60, what="the request released while the engine is stopped")
        t_rel = time.time() - t0
        log = s.read_log()
        if "--no-output-streams" not in MOCK_ARGS:  # else its own Generate call's deadline ends it
            assert re.search(r"engine \S+ did not end the request \d+ ms after its deadline", log), log[-2000:]
        assert "keepalive" not in log and " is down" not in log, log[-2000:]
        g = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0]
        assert g.state == pb.WORKER_STATE_READY, g
        print("   request released by %s %.2f s after its deadline, engine still stopped" %
              ("its engine call's deadline" if "--no-output-streams" in MOCK_ARGS else "the deadline sweep", t_rel))
    finally:
        eng.proc.send_signal(signal.SIGCONT)
    assert s.stop() == 0


# ---------------------------------------------------------------- health and failover

def test_health_and_failover():
    # the worker timeout (the GetLoads watchdog and the control stream's keepalive) far past
    # every wait below: a dead group is found by its connections' resets, never by a timer,
    # so the waits are hang guards, not measurements
    s = Stepd("--worker-timeout-ms", "3600000")
    assert s.check("") == SERVING
    assert s.check("liveness") == SERVING
    assert s.check("stepd.v1.Inference") == NOT_SERVING
    assert s.check("readiness") == NOT_SERVING
    c, _ = code_of(lambda: s.check("nope"))
    assert c == grpc.StatusCode.NOT_FOUND, c
    c, d = code_of(lambda: collect(s.inf.Generate(gen_request(), timeout=2)))
    assert c == grpc.StatusCode.UNAVAILABLE and "no worker group" in d, (c, d)

    events = []
    watch = s.health.Watch(hpb.HealthCheckRequest(service="readiness"), timeout=30)

    def watcher():
        try:
            for r in watch:
                events.append((time.time(), r.status))
        except grpc.RpcError:
            pass
    th = threading.Thread(target=watcher, daemon=True)
    th.start()
    wait_until(lambda: events, what="first Watch message")
    assert events[0][1] == NOT_SERVING
    unknown = s.health.Watch(hpb.HealthCheckRequest(service="nope"), timeout=2)
    assert next(unknown).status == hpb.HealthCheckResponse.SERVICE_UNKNOWN
    unknown.cancel()

    g0 = s.start_engine("g0", "--delay-ms", "10")
    g1 = s.start_engine("g1", "--delay-ms", "10")
    s.wait_ready(2)
    wait_until(lambda: events[-1][1] == SERVING, what="Watch SERVING")
    assert s.check("readiness") == SERVING

    # 8 long streams spread over both groups; kill g1 mid-stream
    results = {}

    def run(i):
        toks = []
        try:
            for r in s.inf.Generate(gen_request([i + 1], 150, request_id="f%d" % i), timeout=30):
                if r.HasField("chunk"):
                    toks.extend(r.chunk.token_ids)
                else:
                    results[i] = ("OK", r.final.group, len(toks))
        except grpc.RpcError as e:
            results[i] = (e.code().name, e.details(), len(toks), time.time())
    ths = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in ths:
        t.start()
    wait_until(lambda: g1.stats().get("running", 0) > 0 and g0.stats().get("running", 0) > 0, what="both busy")
    time.sleep(0.1)
    t_kill = time.time()
    g1.kill()
    for t in ths:
        t.join(20)
    t_end = time.time()
    unavailable = [v for v in results.values() if v[0] == "UNAVAILABLE"]
    ok = [v for v in results.values() if v[0] == "OK"]
    assert len(results) == 8 and unavailable and ok, results
    assert all("g1" in v[1] for v in unavailable), unavailable
    # B1: never hang to the deadline (30 s): the streams on g1 end UNAVAILABLE naming it,
    # not DEADLINE_EXCEEDED (the time is reported, not asserted)
    fail_after = max(v[3] for v in unavailable) - t_kill
    assert all(v[1] == "g0" and v[2] == 150 for v in ok), ok
    assert s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).groups_ready == 1
    # new requests go to the healthy group
    _, _, finals, _ = collect(s.inf.Generate(gen_request([9], 3), timeout=10))
    assert finals[0].group == "g0"
    # g1 re-forms when its worker registers again
    g1b = s.start_engine("g1", "--delay-ms", "10")
    s.wait_ready(2)
    gg = {g.group: g for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}
    assert gg["g1"].epoch == 2 and gg["g1"].state == pb.WORKER_STATE_READY, gg["g1"]
    # both down -> readiness NOT_SERVING seen by Watch: found from the killed workers'
    # connections (the worker timeout is an hour), the time reported, not asserted
    t_k = time.time()
    g0.kill()
    g1b.kill()
    wait_until(lambda: events[-1][1] == NOT_SERVING and events[-1][0] > t_k, timeout=60,
               what="Watch NOT_SERVING (before the 1 h worker timeout)")
    t_watch = events[-1][0] - t_k
    assert s.check("") == SERVING        # liveness unaffected
    watch.cancel()
    print("   failover: %d UNAVAILABLE (naming g1) within %.3f s of kill -9, %d OK on g0 (all done %.2f s after); "
          "Watch NOT_SERVING %.3f s after both were killed"
          % (len(unavailable), fail_after, len(ok), t_end - t_kill, t_watch))
    assert s.stop() == 0


def test_hung_worker():
    s = Stepd("--worker-timeout-ms", "1000")
    eng = s.start_engine("g0", "--delay-ms", "10")
    s.wait_ready()
    st = s.inf.Generate(gen_request([2], 3000), timeout=30)
    next(st)
    t0 = time.time()
    eng.proc.send_signal(signal.SIGSTOP)
    c, d = code_of(lambda: collect(st))
    dt = time.time() - t0
    # the coordinator found the group down (its GetLoads watchdog or the control stream) and
    # ended the stream: a hang would end DEADLINE_EXCEEDED at the request's 30 s; the time
    # is reported, not asserted
    assert c == grpc.StatusCode.UNAVAILABLE and "g0" in d, (c, d)
    assert re.search(r"group g0 \(epoch \d+\) is down", s.read_log()), s.read_log()[-2000:]
    assert s.check("readiness") == NOT_SERVING
    print("   SIGSTOPped engine: stream ended UNAVAILABLE after %.2f s (worker timeout 1 s): %s" % (dt, d))
    eng.proc.send_signal(signal.SIGCONT)
    eng.kill()
    assert s.stop() == 0


def test_group_of_two_ranks():
    s = Stepd()
    r1 = s.start_engine("tp2", rank=1, world=2)
    time.sleep(0.3)
    gg = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0]
    assert gg.state != pb.WORKER_STATE_READY and gg.world_size == 2
    r0 = s.start_engine("tp2", "--delay-ms", "2", rank=0, world=2)
    s.wait_ready(1)
    _, _, finals, _ = collect(s.inf.Generate(gen_request([4], 4), timeout=10))
    assert finals[0].group == "tp2"
    # losing rank 1 takes the whole group down; rank 0 is told to re-form and registers again
    r1.kill()
    wait_until(lambda: s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).groups_ready == 0,
               what="group down")
    r1b = s.start_engine("tp2", rank=1, world=2)
    s.wait_ready(1)
    gg = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0]
    assert gg.epoch == 2, gg
    assert s.stop() == 0
    del r0, r1b


def test_readopt():
    """Ranks that register as already serving their group (serving_epoch: a coordinator that
    restarted under them) are re-adopted at that epoch without a rendezvous; claims that do
    not fit (a rank started afresh, two epochs) get GroupAbort and the group forms anew."""
    s = Stepd()
    s.start_engine("old", "--delay-ms", "2", "--serving-epoch", "7")
    s.wait_ready(1)
    gg = {g.group: g for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}
    assert gg["old"].epoch == 7 and gg["old"].state == pb.WORKER_STATE_READY, gg["old"]
    assert "group old re-adopted at epoch 7" in s.read_log()
    toks, _, finals, _ = collect(s.inf.Generate(gen_request([4, 5], 5), timeout=10))
    assert toks == expected_tokens([4, 5], 5) and finals[0].group == "old", (toks, finals)
    # a claimant and a fresh rank of one group: the claimant is told to re-form
    a0 = s.start_engine("mix", "--delay-ms", "2", "--serving-epoch", "3", rank=0, world=2)
    wait_until(lambda: "group mix rank 0/2 registered" in s.read_log(), what="claimant registered")
    s.start_engine("mix", rank=1, world=2)
    s.wait_ready(2)
    gg = {g.group: g for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}
    assert gg["mix"].epoch == 1, gg["mix"]
    assert "rank 1 registered afresh while rank 0 waited to be re-adopted at epoch 3" in s.read_log()
    # two epochs: the second claimant is refused at once, then both come back fresh
    s.start_engine("two", "--delay-ms", "2", "--serving-epoch", "5", rank=0, world=2)
    wait_until(lambda: "group two rank 0/2 registered" in s.read_log(), what="claimant registered")
    s.start_engine("two", "--serving-epoch", "6", rank=1, world=2)
    s.wait_ready(3)
    gg = {g.group: g for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}
    assert gg["two"].epoch == 1 and gg["two"].state == pb.WORKER_STATE_READY, gg["two"]
    assert "rank 1 serves epoch 6, but another rank serves another epoch (epoch 5)" in s.read_log()
    for g in ("old", "mix", "two"):
        _, _, finals, _ = collect(s.inf.Generate(gen_request([7], 2), timeout=10))
        assert finals
    del a0
    assert s.stop() == 0


def test_prefix_affinity_and_stepctl():
    s = Stepd("--prefix-affinity", "4")
    for g in ("a", "b", "c"):
        s.start_engine(g, "--delay-ms", "1")
    s.wait_ready(3)
    seen = {}
    for p in range(6):
        groups = set()
        for _ in range(3):
            _, _, finals, _ = collect(s.inf.Generate(gen_request([p * 10 + 1, 2, 3, 4, 9 + _], 2), timeout=5))
            groups.add(finals[0].group)
        assert len(groups) == 1, (p, groups)   # same 4-token prefix -> same group
        seen[p] = groups.pop()
    assert len(set(seen.values())) >= 2, seen  # different prefixes spread over groups
    # stepctl against the same server
    ctl = os.environ.get("STEPCTL_BIN", "")
    if ctl and os.path.exists(ctl):
        env = dict(os.environ, STEPD_ADDR=s.addr, STEPD_ADMIN_ADDR="127.0.0.1:%d" % s.ports["admin"])
        run = lambda *a: subprocess.run([ctl, *a], capture_output=True, text=True, timeout=20, env=env)  # noqa: E731
        r = run("health", "readiness")
        assert r.returncode == 0 and "SERVING" in r.stdout, r
        r = run("generate", "--ids", "--max-tokens", "4", "5,6,7")
        assert r.returncode == 0 and r.stdout.split() == [str(t) for t in expected_tokens([5, 6, 7], 4)], r
        assert "finish=length" in r.stderr, r.stderr
        r = run("groups")
        assert r.returncode == 0 and "group a: ready" in r.stdout, r
        r = run("health", "nope")
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r
        r = run("generate", "--ids", "--max-tokens", "0", "5")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "max_tokens" in r.stderr, r
        r = run("drain")
        assert r.returncode == 0 and "draining" in r.stdout, r
        assert s.proc.wait(10) == 0
    else:
        assert s.stop() == 0


def test_prefix_affinity_longest():
    """Prefix-affine routing by the prefix chain (blocks of 16): a family of requests that
    share a prefix stays on one group; families spread over the groups; and the table wins
    over the first block's hash: a family served by another group while its hash's home was
    down goes on to that group (which holds its prefix) after the home is back.  Off with
    --prefix-affinity 0."""
    s = Stepd()
    engines = {g: s.start_engine(g, "--delay-ms", "1") for g in ("a", "b", "c", "d")}
    s.wait_ready(4)
    fam = lambda f, v: ([(100 + 37 * f + 3 * i) % 997 for i in range(48)] +  # noqa: E731
                        [(500 + 31 * v + i) % 997 for i in range(16)])
    route = lambda ids: collect(s.inf.Generate(gen_request(ids, 2), timeout=5))[2][0].group  # noqa: E731
    homes = {}
    for f in range(12):
        groups = {route(fam(f, v)) for v in range(3)}
        assert len(groups) == 1, (f, groups)    # one family, one group
        homes[f] = groups.pop()
    assert len(set(homes.values())) >= 3, homes  # families spread over the groups
    # family 20's home (by its first block's hash) goes down; it is served elsewhere
    probe = 20
    home = route(fam(probe, 0))
    engines[home].proc.kill()
    engines[home].proc.wait()
    t0 = time.time()
    while s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=1).groups_ready > 3:
        assert time.time() - t0 < 10, "group %s still ready after its engine died" % home
        time.sleep(0.02)
    other = route(fam(probe, 1))
    assert other != home, (other, home)
    engines[home] = s.start_engine(home, "--delay-ms", "1")
    s.wait_ready(4)
    # the home is back and idle; the table says `other` holds the family's 3 blocks
    for v in range(2, 6):
        assert route(fam(probe, v)) == other, (v, other, home)
    assert s.metric("stepd:prefix_affinity_entries") >= 12 * 3
    assert s.stop() == 0
    s = Stepd("--prefix-affinity", "0")
    s.start_engine("a", "--delay-ms", "1")
    s.wait_ready(1)
    route = lambda ids: collect(s.inf.Generate(gen_request(ids, 2), timeout=5))[2][0].group  # noqa: E731
    route(fam(1, 1))
    assert s.metric("stepd:prefix_affinity_entries") == 0
    assert s.stop() == 0


# ---------------------------------------------------------------- bad input (C8)

def bad_cases():
    SP = pb.SamplingParams
    T = lambda ids=(1, 2, 3): pb.TokenIds(ids=list(ids))  # noqa: E731
    big = 2 ** 31
    return [
        ("text empty", pb.GenerateRequest(text=""), "text"),
        ("text whitespace", pb.GenerateRequest(text="   \n\t"), "text"),
        ("no input", pb.GenerateRequest(), "input"),
        ("token_ids empty", pb.GenerateRequest(token_ids=T(())), "token_ids"),
        ("token id >= vocab", pb.GenerateRequest(token_ids=T((1, 1000))), "token_ids.ids[1]"),
        ("token id negative", pb.GenerateRequest(token_ids=T((-1,))), "token_ids.ids[0]"),
        ("prompt too long", pb.GenerateRequest(token_ids=T([1] * 5000)), "token_ids"),
        ("prompt+max_tokens > ctx", pb.GenerateRequest(token_ids=T([1] * 4000), sampling_params=SP(max_tokens=200)),
         "max_tokens"),
        ("max_tokens 0", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=0)), "max_tokens"),
        ("max_tokens -1", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=-1)), "max_tokens"),
        ("max_tokens over cap", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=40000)), "max_tokens"),
        ("max_tokens 2^31", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=big)), "max_tokens"),
        ("max_tokens 2^63-1", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=2 ** 63 - 1)),
         "max_tokens"),
        ("min_tokens negative", pb.GenerateRequest(token_ids=T(), sampling_params=SP(min_tokens=-5)), "min_tokens"),
        ("min_tokens > max", pb.GenerateRequest(token_ids=T(), sampling_params=SP(max_tokens=4, min_tokens=9)),
         "min_tokens"),
        ("n 0", pb.GenerateRequest(token_ids=T(), sampling_params=SP(n=0)), "sampling_params.n"),
        ("n above cap", pb.GenerateRequest(token_ids=T(), sampling_params=SP(n=5)), "sampling_params.n"),
        ("temperature NaN", pb.GenerateRequest(token_ids=T(), sampling_params=SP(temperature=math.nan)),
         "temperature"),
        ("temperature +Inf", pb.GenerateRequest(token_ids=T(), sampling_params=SP(temperature=math.inf)),
         "temperature"),
        ("temperature -Inf", pb.GenerateRequest(token_ids=T(), sampling_params=SP(temperature=-math.inf)),
         "temperature"),
        ("temperature negative", pb.GenerateRequest(token_ids=T(), sampling_params=SP(temperature=-0.5)),
         "temperature"),
        ("top_p 0", pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_p=0.0)), "top_p"),
        ("top_p > 1", pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_p=1.5)), "top_p"),
        ("top_k negative", pb.GenerateRequest(token_ids=T(), sampling_params=SP(top_k=-3)), "top_k"),
        ("min_p > 1", pb.GenerateRequest(token_ids=T(), sampling_params=SP(min_p=2.0)), "min_p"),
        ("repetition_penalty 0", pb.GenerateRequest(token_ids=T(), sampling_params=SP(repetition_penalty=0.0)),
         "repetition_penalty"),
        ("repetition_penalty neg", pb.GenerateRequest(token_ids=T(), sampling_params=SP(repetition_penalty=-1)),
         "repetition_penalty"),
        ("frequency_penalty 3", pb.GenerateRequest(token_ids=T(), sampling_params=SP(frequency_penalty=3.0)),
         "frequency_penalty"),
        ("presence_penalty -2.5", pb.GenerateRequest(token_ids=T(), sampling_params=SP(presence_penalty=-2.5)),
         "presence_penalty"),
        ("too many stops", pb.GenerateRequest(text="hi", sampling_params=SP(stop=["x%d" % i for i in range(17)])),
         "stop"),
        ("stop too long", pb.GenerateRequest(text="hi", sampling_params=SP(stop=["y" * 300])), "stop[0]"),
        ("stop empty string", pb.GenerateRequest(text="hi", sampling_params=SP(stop=[""])), "stop[0]"),
        ("seed negative", pb.GenerateRequest(token_ids=T(), sampling_params=SP(seed=-1)), "seed"),
        ("logprobs over cap", pb.GenerateRequest(token_ids=T(), sampling_params=SP(logprobs=21)), "logprobs"),
        ("logprobs negative", pb.GenerateRequest(token_ids=T(), sampling_params=SP(logprobs=-1)), "logprobs"),
        ("stop_token_id >= vocab", pb.GenerateRequest(token_ids=T(), sampling_params=SP(stop_token_ids=[5000])),
         "stop_token_ids[0]"),
        ("logit_bias key", pb.GenerateRequest(token_ids=T(), sampling_params=SP(logit_bias={99999: 1.0})),
         "logit_bias"),
        ("logit_bias value", pb.GenerateRequest(token_ids=T(), sampling_params=SP(logit_bias={3: 500.0})),
         "logit_bias"),
        ("num_speculative_tokens 4", pb.GenerateRequest(token_ids=T(), num_speculative_tokens=4),
         "num_speculative_tokens"),
        ("num_speculative_tokens -1", pb.GenerateRequest(token_ids=T(), num_speculative_tokens=-1),
         "num_speculative_tokens"),
        ("request_id too long", pb.GenerateRequest(token_ids=T(), request_id="x" * 200), "request_id"),
        ("request_id spaces", pb.GenerateRequest(token_ids=T(), request_id="a b"), "request_id"),
        ("chat no messages", pb.GenerateRequest(chat=pb.ChatInput()), "chat.messages"),
        ("chat bad role", pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="wizard")])),
         "chat.messages[0].role"),
        ("chat bad effort", pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")],
                                                                 reasoning_effort="extreme")),
         "reasoning_effort"),
        ("chat tools not array", pb.GenerateRequest(chat=pb.ChatInput(
            messages=[pb.ChatMessage(role="user", content="x")], tools_json='{"a":1}')), "tools_json"),
        ("model mismatch", pb.GenerateRequest(token_ids=T(), model="other-model"), "model"),
        ("stop strings with token input", pb.GenerateRequest(token_ids=T(), sampling_params=SP(stop=["x"])),
         "stop"),
    ]


def test_bad_inputs():
    s = Stepd()
    eng = s.start_engine("g0")
    s.wait_ready()
    before = eng.stats()["generate"]
    cases = bad_cases()
    for name, req, field in cases:
        c, d = code_of(lambda: collect(s.inf.Generate(req, timeout=5)))
        assert c == grpc.StatusCode.INVALID_ARGUMENT, (name, c, d)
        assert field in d, (name, field, d)
        assert "/" not in d.split(":")[0], (name, d)   # no paths in details (D5)
    # invalid UTF-8 in a string field (raw bytes, bypassing the Python encoder)
    raw = bytes([0x12, 0x03]) + b"a\xff\xfe"         # field 2 (text), 3 bytes, invalid UTF-8
    gen = s.channel.unary_stream("/stepd.v1.Inference/Generate")
    c, d = code_of(lambda: list(gen(raw, timeout=5)))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "text" in d, (c, d)
    # garbage bytes that are not a GenerateRequest
    c, d = code_of(lambda: list(gen(b"\xff\xff\xff\xff", timeout=5)))
    assert c == grpc.StatusCode.INVALID_ARGUMENT, (c, d)
    # a repeated field with 10^7 elements is caught by the 4 MiB message cap (C5), then the channel still works
    c, d = code_of(lambda: collect(s.inf.Generate(gen_request([999] * 2_200_000), timeout=10)))
    assert c == grpc.StatusCode.RESOURCE_EXHAUSTED, (c, d)
    c, d = code_of(lambda: collect(s.inf.Generate(pb.GenerateRequest(text="x" * (4 << 20)), timeout=10)))
    assert c == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in d.lower() or "exceed" in d.lower(), (c, d)
    # oversized metadata (C6): a 1 MiB header value, 10,000 headers, a 1 MiB authorization value
    for md in ([("x-big", "a" * (1 << 20))], [("x-h%d" % i, "v") for i in range(10000)],
               [("authorization", "Bearer " + "k" * (1 << 20))]):
        c, d = code_of(lambda: collect(s.inf.Generate(gen_request(), timeout=5, metadata=md)))
        assert c in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE,
                     grpc.StatusCode.CANCELLED), (c, d)
    # the server may close that connection (allowed); it stays up and the channel reconnects
    wait_until(lambda: code_of(lambda: s.check(""))[0] == OK, timeout=5, what="server up after metadata abuse")
    # none of the bad requests reached the engine
    b = eng.stats()
    assert b["generate"] == before, (before, b)
    # a 0.1 ms deadline: expired on arrival when the coordinator looks at it later than 0.1 ms
    # after receipt (the common case); if it looked sooner, the request may reach the engine,
    # and must then be aborted there.  Either way DEADLINE_EXCEEDED, and nothing left running.
    c, d = code_of(lambda: collect(s.inf.Generate(gen_request(), timeout=0.0001)))
    assert c == grpc.StatusCode.DEADLINE_EXCEEDED, (c, d)
    wait_until(lambda: eng.stats()["generate"] - b["generate"] == eng.stats()["abort"] - b["abort"] and
               eng.stats()["running"] == 0, timeout=5, what="an expired request reaching the engine aborted there")
    after_expired = eng.stats()["generate"]
    assert after_expired - b["generate"] <= 1, (b, eng.stats())
    _, _, finals, _ = collect(s.inf.Generate(gen_request(), timeout=5))
    assert finals and eng.stats()["generate"] == after_expired + 1, (after_expired, eng.stats())
    assert s.check("") == SERVING
    print("   %d bad-input cases + UTF-8, garbage, 4 MiB cap, expired deadline: engine untouched" % len(cases))
    assert s.stop() == 0


# ---------------------------------------------------------------- admission

def test_overload():
    R, Q, N = 4, 4, 32
    s = Stepd("--max-running", str(R), "--max-queue", str(Q))
    eng = s.start_engine("g0", "--delay-ms", "20")
    s.wait_ready()
    results = []
    lock = threading.Lock()

    def run(i):
        t0 = time.time()
        try:
            call = s.inf.Generate(gen_request([i], 20), timeout=30)
            toks, _, finals, _ = collect(call)
            r = ("OK", time.time() - t0, None)
        except grpc.RpcError as e:
            md = dict(e.trailing_metadata() or ())
            r = (e.code().name, time.time() - t0, md.get("grpc-retry-pushback-ms"), e.details())
        with lock:
            results.append(r)
    ths = [threading.Thread(target=run, args=(i,)) for i in range(N)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    ok = [r for r in results if r[0] == "OK"]
    rej = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(rej) == N, results
    assert len(ok) == R + Q, (len(ok), results)
    assert all(r[2] == "100" and "overloaded" in r[3] for r in rej), rej
    time.sleep(0.2)
    assert eng.stats()["generate"] == R + Q, eng.stats()
    # rejections answered on the CQ thread (without the loop) are counted like the loop's
    assert s.metric('stepd:requests_rejected_total{reason="queue_full"}') == N - R - Q
    assert s.metric('stepd:request_status_total{code="RESOURCE_EXHAUSTED"}') == N - R - Q
    assert s.metric("stepd:requests_accepted_total") == R + Q
    # the admission reservation of every admitted call was given back: a new call runs
    wait_until(lambda: s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).running == 0, timeout=10,
               what="idle after the burst")
    assert len(collect(s.inf.Generate(gen_request([1], 2), timeout=10))[0]) == 2
    lat = sorted(r[1] for r in rej)
    print("   admitted %d, rejected %d; rejection latency p50 %.1f ms max %.1f ms (client-side, Python)"
          % (len(ok), len(rej), 1000 * lat[len(lat) // 2], 1000 * lat[-1]))
    assert s.stop() == 0


def test_slow_consumer():
    """A6: a client that never reads is cut when its per-stream buffer cap is hit; the
    engine gets one Abort, other streams are unaffected, memory stays bounded."""
    slow = os.environ.get("SLOW_CLIENT_BIN", "")
    if not slow or not os.path.exists(slow):
        print("   (no slow-client; skipped)")
        return
    s = Stepd("--stream-buffer-bytes", "4096")
    eng = s.start_engine("g0", "--delay-ms", "1")
    s.wait_ready()
    rss0 = s.rss_kib()
    p = subprocess.Popen([slow, s.addr, "4000", "8"], stdout=subprocess.PIPE, text=True)
    toks, _, finals, _ = collect(s.inf.Generate(gen_request([1], 500), timeout=20))   # a normal stream meanwhile
    assert len(toks) == 500 and finals, finals
    wait_until(lambda: "client is not reading its stream" in s.read_log(), timeout=15, what="slow stream cut")
    wait_until(lambda: eng.stats().get("abort", 0) == 1 and eng.stats().get("running", 1) == 0, timeout=5,
               what="engine abort for the slow stream")
    cut_at = eng.stats()["tokens"] - 500
    rss1 = s.rss_kib()
    p.kill()
    p.wait()
    assert s.metric('stepd:request_status_total{code="RESOURCE_EXHAUSTED"}') == 1
    print("   slow reader cut after %d tokens; RSS %d -> %d KiB" % (cut_at, rss0, rss1))
    assert rss1 - rss0 < 16 * 1024, (rss0, rss1)
    assert s.stop() == 0


# ---------------------------------------------------------------- security

def test_api_key_every_rpc():
    key = "Key-0123456789abcdef"
    s = Stepd(env={"STEPD_API_KEY": key})
    s.start_engine("g0")
    s.wait_ready_with_key = None
    # route coverage: every method of Inference and Admin, from the service descriptors
    svc = {"Inference": s.channel, "Admin": s.admin_channel}
    seen = 0
    for sname, ch in svc.items():
        desc = pb.DESCRIPTOR.services_by_name[sname]
        for m in desc.methods:
            path = "/stepd.v1.%s/%s" % (sname, m.name)
            req = b""
            for md in (None, [("authorization", "Bearer " + key.lower())], [("authorization", key)],
                       [("authorization", "Bearer " + key[:-1])]):
                if m.server_streaming:
                    fn = lambda: list(ch.unary_stream(path)(req, timeout=3, metadata=md))  # noqa: E731
                else:
                    fn = lambda: ch.unary_unary(path)(req, timeout=3, metadata=md)  # noqa: E731
                c, d = code_of(fn)
                assert c == grpc.StatusCode.UNAUTHENTICATED, (path, md, c, d)
            seen += 1
    assert seen == 9, seen
    print("   every Inference and Admin method (%d) x 4 bad keys (none, lower-cased, no Bearer, truncated): "
          "UNAUTHENTICATED; health without a key SERVING" % seen)
    # health needs no key; the right key works
    assert s.check("") == SERVING
    md = [("authorization", "Bearer " + key)]
    end = time.time() + 10
    while time.time() < end:
        if s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2, metadata=md).groups_ready:
            break
        time.sleep(0.05)
    _, _, finals, _ = collect(s.inf.Generate(gen_request(), timeout=5, metadata=md))
    assert finals
    assert s.stop() == 0


def test_control_key():
    s = Stepd(env={"STEPD_CONTROL_KEY": "ctl-secret"})
    bad = s.start_engine("g0", env={"STEPD_CONTROL_KEY": "wrong"})
    assert bad.proc.wait(10) == 0                  # refused registration: the worker gives up
    assert "UNAUTHENTICATED" in open(bad.stats_path.replace(".stats", ".log")).read()
    assert s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).groups_total == 0
    s.start_engine("g0", env={"STEPD_CONTROL_KEY": "ctl-secret"})
    s.wait_ready()
    assert s.stop() == 0
    # the real worker's control client: a wrong key is a refusal (no dialling again), the
    # right one registers
    worker = os.environ.get("STEPD_WORKER_BIN", "")
    if worker and os.path.exists(worker):
        s = Stepd(env={"STEPD_CONTROL_KEY": "ctl-secret"})
        w = s.start_worker("w0", "--threads", "1", env={"STEPD_CONTROL_KEY": "wrong"})
        assert w.wait(20) == 3, open(w.logpath).read()
        log = open(w.logpath).read()
        assert "control session refused: UNAUTHENTICATED" in log, log
        w = s.start_worker("w0", "--threads", "1", env={"STEPD_CONTROL_KEY": "ctl-secret"})
        s.wait_ready(1, timeout=60)
        assert s.stop() == 0
        assert w.wait(20) == 0


def test_listen_policy():
    p = subprocess.run([STEPD_BIN, "--listen", "0.0.0.0:0", "--admin-listen", "127.0.0.1:0",
                        "--control-listen", "127.0.0.1:0", "--metrics-listen", ""],
                       capture_output=True, text=True, timeout=10)
    assert p.returncode != 0 and "refusing to listen on non-loopback" in p.stderr, (p.returncode, p.stderr)
    p = subprocess.run([STEPD_BIN, "--api-key", "secret"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 2 and "never taken from the command line" in p.stderr, p.stderr
    p = subprocess.run([STEPD_BIN, "--max-queue", "-3"], capture_output=True, text=True, timeout=10)
    assert p.returncode == 2 and "--max-queue" in p.stderr, p.stderr
    # explicit override starts (then drains on SIGTERM)
    s = Stepd("--listen", "0.0.0.0:0", "--insecure-listen")
    assert "without TLS and API key (--insecure-listen)" in s.read_log()
    assert s.stop() == 0


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d):
    """CA + server cert (localhost / 127.0.0.1) + client cert, and a second, foreign CA + client."""
    for ca in ("ca", "evil"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=%s-root" % ca,
                 "-keyout", ca + ".key", "-out", ca + ".crt", cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, ca in (("server", "ca"), ("client", "ca"), ("evilclient", "evil")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", name + ".key",
                 "-out", name + ".csr", cwd=d)
        extra = ["-extfile", "san.ext"] if name == "server" else []
        _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".crt", "-CAkey", ca + ".key", "-CAcreateserial",
                 "-days", "2", "-out", name + ".crt", *extra, cwd=d)
    rd = lambda n: open(os.path.join(d, n), "rb").read()  # noqa: E731
    return rd


def test_tls_mtls():
    import shutil
    import tempfile
    if not shutil.which("openssl"):
        print("   (no openssl; skipped)")
        return
    d = tempfile.mkdtemp(prefix="stepd-pki-")
    rd = make_pki(d)
    p = lambda n: os.path.join(d, n)  # noqa: E731
    # refused: require client cert without a CA bundle (the force_client_auth pitfall)
    r = subprocess.run([STEPD_BIN, "--tls-cert", p("server.crt"), "--tls-key", p("server.key"),
                        "--tls-require-client-cert", "--metrics-listen", ""], capture_output=True, text=True, timeout=10)
    assert r.returncode != 0 and "--tls-client-ca" in r.stderr, r.stderr
    # TLS + API key on a non-loopback address is allowed without --insecure-listen
    key = "tls-key-123"
    s = Stepd("--listen", "0.0.0.0:0", "--tls-cert", p("server.crt"), "--tls-key", p("server.key"),
              "--tls-client-ca", p("ca.crt"), "--tls-require-client-cert", env={"STEPD_API_KEY": key})
    target = "localhost:%d" % s.ports["public"]

    def check(creds):
        ch = grpc.secure_channel(target, creds)
        try:
            return hpb_stub(ch).Check(hpb.HealthCheckRequest(service=""), timeout=3).status
        finally:
            ch.close()
    good = grpc.ssl_channel_credentials(rd("ca.crt"), rd("client.key"), rd("client.crt"))
    assert check(good) == SERVING
    c, _ = code_of(lambda: check(grpc.ssl_channel_credentials(rd("ca.crt"))))            # no client cert
    assert c == grpc.StatusCode.UNAVAILABLE, c
    c, _ = code_of(lambda: check(grpc.ssl_channel_credentials(rd("ca.crt"), rd("evilclient.key"),
                                                                rd("evilclient.crt"))))  # foreign CA
    assert c == grpc.StatusCode.UNAVAILABLE, c
    ch = grpc.insecure_channel(target)                                                    # plaintext
    c, _ = code_of(lambda: hpb_stub(ch).Check(hpb.HealthCheckRequest(service=""), timeout=3))
    ch.close()
    assert c == grpc.StatusCode.UNAVAILABLE, c
    # the API key is still required over mTLS
    ch = grpc.secure_channel(target, good)
    inf = pb_stub(ch)
    c, _ = code_of(lambda: inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=3))
    assert c == grpc.StatusCode.UNAUTHENTICATED, c
    info = inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=3, metadata=[("authorization", "Bearer " + key)])
    assert info.role == "coordinator"
    ch.close()
    print("   mTLS: no client certificate, another CA's and plaintext refused (UNAVAILABLE), a valid one "
          "SERVING; without the API key UNAUTHENTICATED; require-client-cert without a CA refused at start")
    assert s.stop() == 0
    shutil.rmtree(d, True)


def hpb_stub(ch):
    from stepd_harness import hpbg
    return hpbg.HealthStub(ch)


def pb_stub(ch):
    from stepd_harness import pbg
    return pbg.InferenceStub(ch)


# ---------------------------------------------------------------- text pipeline

def test_text_and_chat():
    if not TOKENIZER or not os.path.exists(TOKENIZER):
        print("   (no tokenizer; skipped)")
        return
    s = Stepd("--tokenizer", TOKENIZER)
    s.start_engine("g0", "--delay-ms", "1", "--vocab", "4000")
    s.wait_ready()
    tk = s.inf.Tokenize(pb.TokenizeRequest(text="Hello world"), timeout=5)
    assert tk.count == len(tk.token_ids) > 0
    dt = s.inf.Detokenize(pb.DetokenizeRequest(token_ids=tk.token_ids), timeout=5)
    assert "Hello world" in dt.text, dt.text
    c, d = code_of(lambda: s.inf.Detokenize(pb.DetokenizeRequest(token_ids=[tokenizer_size()]), timeout=5))
    assert c == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in d, (c, d)
    # text in, text out: the streamed text equals Detokenize of the streamed ids
    req = pb.GenerateRequest(text="Hello world", sampling_params=pb.SamplingParams(max_tokens=20),
                             stream_options=pb.StreamOptions(include_token_ids=True))
    toks, text, finals, _ = collect(s.inf.Generate(req, timeout=10))
    assert len(toks) == 20 and finals[0].usage.prompt_tokens == tk.count, (toks, finals)
    ref = s.inf.Detokenize(pb.DetokenizeRequest(token_ids=[t for t in toks if t not in (2, 5)]), timeout=5).text
    assert text == ref, (text, ref)
    # stop string cut: take a piece of the reference output as stop string
    if len(ref) > 8:
        stop = ref[4:8]
        req = pb.GenerateRequest(text="Hello world", sampling_params=pb.SamplingParams(max_tokens=20, stop=[stop]))
        _, text2, finals, _ = collect(s.inf.Generate(req, timeout=10))
        assert finals[0].finish_reason == pb.FINISH_REASON_STOP and finals[0].stop_string == stop, finals
        assert text2 == ref[:ref.index(stop)], (text2, ref, stop)
    # chat renders and streams
    chat = pb.ChatInput(messages=[pb.ChatMessage(role="system", content="Be brief."),
                                  pb.ChatMessage(role="user", content="Hi!")], reasoning_effort="low")
    tk2 = s.inf.Tokenize(pb.TokenizeRequest(chat=chat), timeout=5)
    toks, text, finals, chunks = collect(s.inf.Generate(pb.GenerateRequest(chat=chat,
                                         sampling_params=pb.SamplingParams(max_tokens=10)), timeout=10))
    assert finals[0].usage.prompt_tokens == tk2.count and finals[0].usage.completion_tokens == 10, finals
    parsed = "".join(c.reasoning_delta + c.content_delta for c in chunks)
    assert parsed.replace("\n", "") or text == "", (parsed, text)
    assert s.stop() == 0


# ---------------------------------------------------------------- real worker

def test_real_worker():
    """stepd + the real stepd-worker (CPU, bundled tiny model), when both are built."""
    worker = os.environ.get("STEPD_WORKER_BIN", "")
    model = os.environ.get("TINY_MODEL_DIR", "")
    if not worker or not os.path.exists(worker) or not os.path.isdir(model):
        print("   (no stepd-worker or tiny model; skipped)")
        return
    import socket
    so = socket.socket()
    so.bind(("127.0.0.1", 0))
    eport = so.getsockname()[1]
    so.close()
    s = Stepd("--tokenizer", os.path.join(model, "tokenizer.json"))
    # a KV budget below one sequence of --max-model-len: start-up fails, saying how much is
    # needed and how much there is
    small = subprocess.run([worker, "--rendezvous-dir", s.workdir, "--group", "kv0", "--rank", "0",
                            "--world-size", "1", "--model", model, "--max-model-len", "8192",
                            "--allow-long-max-model-len", "--kv-cache-memory", "1MiB", "--generate", "/dev/null"],
                           capture_output=True, text=True, timeout=60)
    assert small.returncode == 1 and "need at least" in small.stderr and \
        "the budget is 1.00 MiB" in small.stderr, small.stderr
    log = open(os.path.join(s.workdir, "worker.log"), "w")
    cmd = [worker, "--coordinator", "127.0.0.1:%d" % s.ports["control"], "--group", "cpu0", "--rank", "0",
           "--world-size", "1", "--device", "cpu", "--model", model, "--engine-listen", "127.0.0.1:%d" % eport,
           "--max-model-len", "8192", "--allow-long-max-model-len", "--kv-cache-memory", "32MiB", *s.key_args()]
    w = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        s.wait_ready(1, timeout=120)
        wait_until(lambda: code_of(lambda: s.inf.GetModelInfo(pb.GetModelInfoRequest(), timeout=2))[0] == OK,
                   what="model info")
        mi = s.inf.GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
        assert mi.vocab_size >= 4000 and "/" not in mi.model_name, mi
        req = pb.GenerateRequest(text="The capital of France is", sampling_params=pb.SamplingParams(
            max_tokens=12, temperature=0.0), stream_options=pb.StreamOptions(include_token_ids=True))
        toks, text, finals, _ = collect(s.inf.Generate(req, timeout=60))
        assert finals and finals[0].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP), finals
        assert len(toks) == finals[0].usage.completion_tokens and len(toks) >= 1
        toks2, text2, _, _ = collect(s.inf.Generate(req, timeout=60))
        assert toks2 == toks, (toks, toks2)           # greedy is deterministic
        # a prompt of a few blocks, twice: the second reuses the cached ones, same output
        long_req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[(i * 37 + 11) % 4000 for i in range(50)]),
                                      sampling_params=pb.SamplingParams(max_tokens=8, temperature=0.0))
        la, _, fa, _ = collect(s.inf.Generate(long_req, timeout=60))
        lb, _, fb, _ = collect(s.inf.Generate(long_req, timeout=60))
        assert la == lb and fa[0].usage.cached_tokens == 0 and fb[0].usage.cached_tokens == 48, (fa, fb)
        chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hi")], reasoning_effort="low")
        _, _, finals, _ = collect(s.inf.Generate(pb.GenerateRequest(chat=chat, sampling_params=pb.SamplingParams(
            max_tokens=8)), timeout=60))
        assert finals and finals[0].group == "cpu0"
        # the engine's counters as the coordinator reports them (GetLoads, GetGroups): request
        # states created and freed (5 requests, all ended), the prefix cache (48 tokens hit of
        # the second long prompt), both KV pools; the engine reports them too
        def loads():
            return s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2).loads[0]
        wait_until(lambda: loads().requests_freed >= 5, what="the engine's counters at the coordinator")
        ld = loads()
        eng = pbg.EngineStub(grpc.insecure_channel("127.0.0.1:%d" % eport)).GetLoads(
            pb.GetLoadsRequest(), timeout=2, metadata=s.key_md()).loads[0]
        assert ld.requests_created == ld.requests_freed == eng.requests_created >= 5, (ld, eng)
        assert ld.num_requests_alive == 0, ld
        assert ld.prefix_cache_hits >= 48 and ld.prefix_cache_queries > ld.prefix_cache_hits, ld
        assert ld.prefix_cache_hits == eng.prefix_cache_hits, (ld, eng)
        assert sorted(p.kind for p in ld.kv_pools) == ["full_attention", "sliding_window"], ld
        assert [(p.kind, p.blocks_total) for p in ld.kv_pools] == [(p.kind, p.blocks_total) for p in eng.kv_pools]
        gl = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0].load
        assert gl.requests_created == ld.requests_created and len(gl.kv_pools) == 2, gl
        print("   real worker: %d tokens, text %r; the coordinator's GetLoads: %d request states created "
              "and freed, prefix cache %d/%d tokens hit, KV pools %s" %
              (len(toks), text[:60], ld.requests_created, ld.prefix_cache_hits, ld.prefix_cache_queries,
               ", ".join("%s %d blocks" % (p.kind, p.blocks_total) for p in ld.kv_pools)))
        assert s.stop() == 0
        assert w.wait(20) == 0                        # the worker leaves when the coordinator does
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()


def test_sd_notify():
    """READY=1 once listening, STATUS= with group readiness, WATCHDOG=1 from the loop,
    STOPPING=1 on drain - read from a fake $NOTIFY_SOCKET."""
    import socket
    import tempfile
    d = tempfile.mkdtemp(prefix="stepd-notify-")
    path = os.path.join(d, "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    s = Stepd(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
    msgs = []

    def drain_sock(until):
        end = time.time() + 5
        while time.time() < end:
            try:
                msgs.append(sock.recv(4096).decode())
            except socket.timeout:
                pass
            if until(msgs):
                return
        raise AssertionError("notify messages so far: %r" % msgs)
    drain_sock(lambda m: any("READY=1" in x for x in m) and sum("WATCHDOG=1" in x for x in m) >= 3)
    s.start_engine("g0")
    s.wait_ready()
    drain_sock(lambda m: any("groups ready 1/1" in x for x in m))
    s.proc.send_signal(signal.SIGTERM)
    drain_sock(lambda m: any("STOPPING=1" in x for x in m))
    assert s.proc.wait(10) == 0
    sock.close()
    import shutil
    shutil.rmtree(d, True)
    status = [x for x in msgs if x.startswith("STATUS=")]
    print("   notify: %d messages, e.g. %r" % (len(msgs), status[-1] if status else None))


def test_malloc_settings():
    """stepd runs itself again with glibc's per-thread malloc caches off and one arena
    (RSS back to baseline after a load, docs/RELIABILITY.md A1), keeps its name, serves, and
    leaves both alone when the operator chose (STEPD_MALLOC_TUNE=0, GLIBC_TUNABLES)."""
    def arenas(pid):
        # a glibc per-thread arena: 64 MiB of anonymous memory reserved at a 64 MiB
        # boundary, the used part rw-p and the rest ---p
        maps = []
        for line in open("/proc/%d/maps" % pid):
            f = line.split()
            if len(f) == 5:
                lo, hi = (int(x, 16) for x in f[0].split("-"))
                maps.append((lo, hi, f[1]))
        n = 0
        for i, (lo, hi, perm) in enumerate(maps):
            if lo % (64 << 20) == 0 and perm == "rw-p":
                end = hi
                if i + 1 < len(maps) and maps[i + 1][0] == hi and maps[i + 1][2] == "---p":
                    end = maps[i + 1][1]
                n += end - lo == 64 << 20
        return n

    def check(env, want_tuned):
        s = Stepd(env=env)
        s.start_engine("g0")
        s.wait_ready()
        toks, _, finals, _ = collect(s.inf.Generate(gen_request([5, 6], 8), timeout=20))
        assert len(toks) == 8 and finals
        pid = s.proc.pid
        with open("/proc/%d/comm" % pid) as f:
            comm = f.read().strip()
        with open("/proc/%d/environ" % pid, "rb") as f:
            environ = f.read()
        n = arenas(pid)
        assert s.stop() == 0
        assert comm == "stepd", comm
        tuned = b"glibc.malloc.tcache_count=0" in environ and b"glibc.malloc.arena_max=1" in environ
        assert tuned == want_tuned, (env, environ)
        assert (n == 0) == want_tuned, "%d thread arenas with %r" % (n, env)
        return n
    if sanitized(STEPD_BIN):
        print("   sanitizer build: its own allocator, no malloc settings to check")
        return
    check({}, True)
    n = check({"STEPD_MALLOC_TUNE": "0"}, False)
    check({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, False)
    print("   malloc settings applied by default; %d thread arenas with STEPD_MALLOC_TUNE=0" % n)


# ---------------------------------------------------------------- drain

def test_drain_sigterm():
    # The stream in flight is held by stopping its engine (SIGSTOP), not by its length in
    # real time: the drain cannot complete before the checks below however slow the host,
    # and the timers that could end it are far past them (drain timeout 10 min, worker
    # timeout and control heartbeats 1 h: a stopped engine is not declared down meanwhile).
    # The periodic tick that republishes health (the GetLoads poll) is an hour too:
    # readiness must flip on the signal itself, not on a later tick.
    s = Stepd("--drain-timeout", "600", "--worker-timeout-ms", "3600000", "--heartbeat-ms", "3600000",
              "--loads-poll-ms", "3600000")
    eng = s.start_engine("g0", "--delay-ms", "10")
    s.wait_ready()
    out = {}
    got = []

    def run():
        try:
            for r in s.inf.Generate(gen_request([3], 60), timeout=600):
                if r.HasField("chunk"):
                    got.extend(r.chunk.token_ids)
            out["r"] = ("OK", len(got))
        except grpc.RpcError as e:
            out["r"] = (e.code().name, e.details())
    th = threading.Thread(target=run)
    th.start()
    wait_until(lambda: got, timeout=30, what="the stream's first tokens")
    eng.proc.send_signal(signal.SIGSTOP)
    try:
        s.proc.send_signal(signal.SIGTERM)
        t_term = time.time()
        wait_until(lambda: s.check("readiness") == NOT_SERVING, timeout=60, what="readiness NOT_SERVING")
        assert s.check("") == SERVING
        c, d = code_of(lambda: collect(s.inf.Generate(gen_request(), timeout=30)))
        assert c == grpc.StatusCode.UNAVAILABLE and "draining" in d, (c, d)
        # still draining: the held stream has not ended, stepd has not exited
        assert "r" not in out and s.proc.poll() is None, (out, s.proc.poll())
    finally:
        eng.proc.send_signal(signal.SIGCONT)
    th.join(60)
    assert out["r"] == ("OK", 60), out
    rc = s.proc.wait(60)
    assert rc == 0, rc
    assert "drain complete" in s.read_log()
    print("   SIGTERM: readiness NOT_SERVING, new calls UNAVAILABLE \"draining\" while the stream in flight "
          "was held (engine stopped); released, it ended OK with 60 tokens, exit %d %.2f s after the signal" %
          (rc, time.time() - t_term))
    eng.wait_exit(10)
    assert eng.proc.returncode == 0     # the worker exits by itself when the coordinator goes (B3)


def test_drain_admin_and_timeout():
    s = Stepd("--drain-timeout", "0.5")
    s.start_engine("g0", "--delay-ms", "50")
    s.wait_ready()
    st = s.inf.Generate(gen_request([3], 1000), timeout=30)
    next(st)
    r = s.admin.Drain(pb.DrainRequest(exit_when_drained=True, timeout_ms=300), timeout=5)
    assert r.in_flight == 1, r
    # Check is answered on the CQ thread from published state: once Drain has answered,
    # readiness is already NOT_SERVING (no waiting), liveness still SERVING
    assert s.check("readiness") == NOT_SERVING
    assert s.check("") == SERVING
    c, d = code_of(lambda: collect(st))
    assert c == grpc.StatusCode.UNAVAILABLE and "drain timeout" in d, (c, d)
    assert s.proc.wait(10) == 0


if __name__ == "__main__":
    run_tests([
        ("unary_and_stream", test_unary_and_stream),
        ("cancel_and_deadline", test_cancel_and_deadline),
        ("output_streams", test_output_streams),
        ("engine_ignores_deadline", test_engine_ignores_deadline),
        ("health_and_failover", test_health_and_failover),
        ("group_of_two_ranks", test_group_of_two_ranks),
        ("readopt", test_readopt),
        ("hung_worker", test_hung_worker),
        ("prefix_affinity_and_stepctl", test_prefix_affinity_and_stepctl),
        ("prefix_affinity_longest", test_prefix_affinity_longest),
        ("bad_inputs", test_bad_inputs),
        ("overload", test_overload),
        ("slow_consumer", test_slow_consumer),
        ("api_key_every_rpc", test_api_key_every_rpc),
        ("control_key", test_control_key),
        ("listen_policy", test_listen_policy),
        ("tls_mtls", test_tls_mtls),
        ("text_and_chat", test_text_and_chat),
        ("real_worker", test_real_worker),
        ("sd_notify", test_sd_notify),
        ("malloc_settings", test_malloc_settings),
        ("drain_sigterm", test_drain_sigterm),
        ("drain_admin_and_timeout", test_drain_admin_and_timeout),
    ])
