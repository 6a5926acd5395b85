#!/usr/bin/env python3
"""E8-E12: the inside of the cluster, tested as an attacker on the same host would.

An impostor worker (fakeworker.py, written from proto/control.proto alone, run as a process
of its own) and plain grpcio clients against `stepd` and real `stepd-worker --mock` ranks:

  e8-coordinator-needs-key      stepd started as a quick start would (no key) refuses to run;
                                --insecure-control is the explicit way to accept keyless workers
  e8-register-needs-key         the impostor's Session without the key, or with a wrong one, is
                                UNAUTHENTICATED and no group appears; with the key it is
                                registered, under an unguessable session id
  e8-claim-live-rank-refused    with the key, a claim on the rank of a serving group is refused
                                ALREADY_EXISTS: the group keeps its epoch, its rank its process,
                                requests are served
  e8-engine-needs-key           rank 0's Engine service, called directly: every method without
                                the key (or with a wrong one) UNAUTHENTICATED; with it, served
  e8-forged-report-refused      ReportState(FAILED) for guessed session ids: NOT_FOUND, the
                                group stays ready
  e9-registrations-pruned       3000 registrations that end: the coordinator keeps at most 16
                                groups without ranks and its RSS returns (the figure printed)
  e10-abort-scoped              a client's Abort of another connection's request id is a no-op
                                (aborted 0, the request completes); its own is aborted
  e11-log-injection             rejected request_id, model, role and reasoning_effort carrying
                                "\\n<3>stepd: forged ..." never start a line of stepd's log
  e12-contract                  top_k = -1 is "disabled", as stepd.proto says; tools_json that is
                                not a list of OpenAI tool definitions is INVALID_ARGUMENT

Environment (meson): STEPD_BIN, STEPD_WORKER_BIN, PROTO_DIR, TOKENIZER_JSON; the binaries may
be those of another build (the same flags) to show what an older stepd does.
"""
import json
import os
import re
import subprocess
import sys
import time

import rellib
from rellib import h

pb = h.pb
grpc = h.grpc
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fakeworker.py")
ROWS = {}


def fake(*args, key=None):
    cmd = [sys.executable, FAKE, *map(str, args)]
    if key:
        cmd += ["--key", key]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PROTO_DIR=h.PROTO_DIR))
    assert p.returncode == 0, "fakeworker %s: %s" % (args[0], p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def ctl_addr(s):
    return "127.0.0.1:%d" % s.ports["control"]


def start_mock_group(s, group="g0", extra=()):
    """A real one-rank stepd-worker --mock group, its engine on a unix socket."""
    sock = os.path.join(s.workdir, group + "-engine.sock")
    log = open(os.path.join(s.workdir, group + "-w0.log"), "a")
    what = [] if "--model" in extra else ["--mock"]
    p = subprocess.Popen([rellib.WORKER_BIN, "--coordinator", ctl_addr(s), "--group", group, "--rank", "0",
                          "--world-size", "1", *what, "--threads", "1", "--engine-listen", "unix:" + sock,
                          *s.key_args(), *extra], stdout=log, stderr=subprocess.STDOUT)
    p.logpath = log.name
    p.engine = "unix:" + sock
    h._procs.append(p)
    return p


def groups(s, md=None):
    return {g.group: g for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2, metadata=md).groups}


def generate_ok(s, md=None, **kw):
    toks, _, finals, _ = h.collect(s.inf.Generate(h.gen_request([1, 2, 3], 4, **kw), timeout=20, metadata=md))
    return bool(finals) and len(toks) >= 1


# ---------------------------------------------------------------- E8

def test_coordinator_needs_key():
    e = dict(os.environ)
    e.pop("STEPD_CONTROL_KEY", None)
    base = [h.STEPD_BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--control-listen",
            "127.0.0.1:0", "--metrics-listen", ""]
    p = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
    try:
        out, _ = p.communicate(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError("stepd without a control key is running (it accepts any worker): %s" % out[-500:])
    assert p.returncode != 0 and "no control key" in out, (p.returncode, out)
    s = h.Stepd(control_key=False)          # --insecure-control: the explicit choice
    assert "--insecure-control" in s.read_log(), s.read_log()
    assert s.stop() == 0
    ROWS["E8"] = "stepd without a key: exit %d (\"no control key\"); --insecure-control starts" % p.returncode
    print("   " + ROWS["E8"])


def test_register_needs_key():
    s = h.Stepd()
    for key in (None, "wrong-key", s.control_key[:-1], s.control_key.upper()):
        r = fake("register", ctl_addr(s), "evil", 0, 1, key=key)
        assert r["status"] == "UNAUTHENTICATED" and r["event"] is None, (key, r)
    assert not groups(s), groups(s)
    ids = [fake("register", ctl_addr(s), "fair", 0, 1, key=s.control_key) for _ in range(2)]
    assert all(r["event"] == "registered" for r in ids), ids
    tails = [r["session_id"].rsplit("/", 1)[1] for r in ids]
    assert all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tails) and tails[0] != tails[1], ids
    assert s.stop() == 0
    print("   no key, a wrong, a truncated and an upper-cased key: UNAUTHENTICATED, no group; the key: "
          "registered as %s" % ids[0]["session_id"])


def test_claim_live_rank_refused():
    s = h.Stepd()
    w = start_mock_group(s)
    s.wait_ready(1, timeout=60)
    g0 = groups(s)["g0"]
    r = fake("register", ctl_addr(s), "g0", 0, 1)
    assert r["status"] == "UNAUTHENTICATED", r
    r = fake("register", ctl_addr(s), "g0", 0, 1, key=s.control_key, **{})
    assert r["status"] == "ALREADY_EXISTS" and "held by a live session" in r["details"], r
    time.sleep(0.5)
    g1 = groups(s)["g0"]
    assert g1.state == pb.WORKER_STATE_READY and g1.epoch == g0.epoch, (g0, g1)
    assert w.poll() is None, "the real rank 0 exited %s" % w.returncode
    assert generate_ok(s)
    assert s.stop() == 0
    ROWS["E8-claim"] = "claim on g0 rank 0: %s without the key, %s with it; epoch %d kept" % (
        "UNAUTHENTICATED", r["status"], g1.epoch)
    print("   " + ROWS["E8-claim"])


def test_engine_needs_key():
    s = h.Stepd()
    w = start_mock_group(s)
    s.wait_ready(1, timeout=60)
    methods = ("Generate", "GetLoads", "GetModelInfo", "Abort", "Submit", "OpenOutputs")
    for key in (None, "wrong-key"):
        r = fake("engine", w.engine, key=key)
        bad = {m: r[m] for m in methods if r[m] != "UNAUTHENTICATED"}
        assert not bad, "rank 0's engine served without the key (%s): %s" % (key, bad)
    r = fake("engine", w.engine, key=s.control_key)
    assert all(r[m] == "OK" for m in ("Generate", "GetLoads", "GetModelInfo", "Abort", "OpenOutputs")), r
    assert generate_ok(s), "the coordinator's own calls to the engine (it sends the key)"
    assert s.stop() == 0
    print("   Engine without the key / a wrong key: %d of %d methods UNAUTHENTICATED each; with the key: %s" %
          (len(methods), len(methods), ", ".join("%s %s" % (m, r[m]) for m in methods)))


def test_forged_report_refused():
    s = h.Stepd()
    start_mock_group(s)
    s.wait_ready(1, timeout=60)
    epoch = groups(s)["g0"].epoch
    codes = {}
    sids = [sid for n in range(1, 21) for sid in ("g0/0/%d" % n, "g0/0/%x" % n)]
    for c in fake("report", ctl_addr(s), *sids, key=s.control_key)["statuses"]:
        codes[c] = codes.get(c, 0) + 1
    g = groups(s)["g0"]
    assert codes == {"NOT_FOUND": 40} and g.state == pb.WORKER_STATE_READY and g.epoch == epoch, (codes, g)
    assert generate_ok(s)
    assert s.stop() == 0
    print("   40 ReportState(FAILED) with guessed session ids: %s; g0 still ready at epoch %d" % (codes, epoch))


# ---------------------------------------------------------------- E9

def idle_trim(s, n):
    """Wait for an idle heap trim counted after n (stepd:idle_trims_total: the coordinator
    gives freed heap back once more is free than after its last trim), instead of sleeping
    past it; 60 s is a hang guard."""
    h.wait_until(lambda: s.metric("stepd:idle_trims_total") > n, timeout=60, step=0.1, what="an idle trim")


def test_registrations_pruned(n=3000):
    s = h.Stepd()
    fake("churn", ctl_addr(s), 50, key=s.control_key)         # warm-up: gRPC's own first allocations
    idle_trim(s, s.metric("stepd:idle_trims_total"))
    rss0 = s.rss_kib()
    r = fake("churn", ctl_addr(s), n, key=s.control_key)
    assert r["registered"] == n, r
    idle_trim(s, s.metric("stepd:idle_trims_total"))
    rss1 = s.rss_kib()
    gs = groups(s)
    grow = (rss1 - rss0) / 1024.0
    assert len(gs) <= 16, "%d groups kept after %d ended registrations" % (len(gs), n)
    # a sanitizer build keeps freed memory in quarantine: its RSS is only reported
    assert grow < 4.0 or h.sanitized(h.STEPD_BIN), "RSS grew %.1f MiB over %d ended registrations" % (grow, n)
    assert s.stop() == 0
    ROWS["E9"] = "%d registrations ended (%.1f s): %d groups kept, RSS %+.1f MiB" % (n, r["seconds"], len(gs),
                                                                                  grow)
    print("   " + ROWS["E9"])


# ---------------------------------------------------------------- E10

def test_abort_scoped():
    s = h.Stepd()
    # the mock engine (a token every 20 ms); the key through its environment
    s.start_engine("g0", "--delay-ms", "20", env={"STEPD_CONTROL_KEY": s.control_key})
    s.wait_ready(1, timeout=60)
    own = [("grpc.use_local_subchannel_pool", 1)]
    a = grpc.insecure_channel(s.addr, options=own)
    b = grpc.insecure_channel(s.addr, options=own)
    ia, ib = h.pbg.InferenceStub(a), h.pbg.InferenceStub(b)
    stream = ia.Generate(h.gen_request([5, 6, 7], 60, request_id="victim-1"), timeout=60)
    first = next(stream)
    assert first.HasField("chunk"), first
    got_b = ib.Abort(pb.AbortRequest(request_ids=["victim-1"]), timeout=5).aborted
    rest = list(stream)
    fin = [r.final for r in rest if r.HasField("final")]
    assert got_b == 0 and fin and fin[0].finish_reason == pb.FINISH_REASON_LENGTH, (got_b, fin)
    stream = ia.Generate(h.gen_request([5, 6, 7], 60, request_id="victim-2"), timeout=60)
    next(stream)
    got_a = ia.Abort(pb.AbortRequest(request_ids=["victim-2"]), timeout=5).aborted
    fin = [r.final for r in stream if r.HasField("final")]
    assert got_a == 1 and fin and fin[0].finish_reason == pb.FINISH_REASON_ABORT, (got_a, fin)
    a.close()
    b.close()
    assert s.stop() == 0
    ROWS["E10"] = "another connection's Abort: aborted %d, the stream ran to LENGTH; its creator's: aborted %d" % (
        got_b, got_a)
    print("   " + ROWS["E10"])


# ---------------------------------------------------------------- E11

def test_log_injection():
    if not h.TOKENIZER:
        raise AssertionError("TOKENIZER_JSON is not set")
    s = h.Stepd("--tokenizer", h.TOKENIZER, "--model-name", "tiny")
    start_mock_group(s)
    s.wait_ready(1, timeout=60)
    forged = "\n<3>stepd: forged %s line\n"
    chat = lambda **kw: pb.ChatInput(messages=[pb.ChatMessage(role=kw.get("role", "user"), content="hi")],  # noqa
                                     reasoning_effort=kw.get("effort", ""))
    cases = [
        ("request_id", h.gen_request([1, 2], 2, request_id="id" + forged % "request_id")),
        ("model", h.gen_request([1, 2], 2, model="m" + forged % "model")),
        ("role", pb.GenerateRequest(chat=chat(role="user" + forged % "role"),
                                    sampling_params=pb.SamplingParams(max_tokens=2))),
        ("reasoning_effort", pb.GenerateRequest(chat=chat(effort="low" + forged % "reasoning_effort"),
                                                sampling_params=pb.SamplingParams(max_tokens=2))),
    ]
    for field, req in cases:
        code, details = h.code_of(lambda: h.collect(s.inf.Generate(req, timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
    time.sleep(0.3)
    log = s.read_log()
    lines = [ln for ln in log.splitlines() if ln.startswith("<3>stepd: forged")]
    assert not lines, "forged journal lines in stepd's log: %s" % lines
    escaped = sum(1 for ln in log.splitlines() if "\\x0a<3>stepd: forged" in ln)
    assert escaped == len(cases), "the rejected values should be logged escaped:\n" + log[-3000:]
    assert s.stop() == 0
    ROWS["E11"] = "%d rejected fields with newlines: 0 forged lines, %d logged escaped" % (len(cases), escaped)
    print("   " + ROWS["E11"])


# ---------------------------------------------------------------- E12

def test_contract():
    if not h.TOKENIZER:
        raise AssertionError("TOKENIZER_JSON is not set")
    rellib.need_model()
    s = h.Stepd("--tokenizer", h.TOKENIZER)
    start_mock_group(s, extra=["--model", rellib.MODEL_DIR])     # the tokenizer's model: chat served
    s.wait_ready(1, timeout=60)
    assert generate_ok(s, sampling=pb.SamplingParams(max_tokens=4, top_k=-1)), "top_k = -1 refused"
    bad_tools = ['[1,2]', '[{}]', '[{"type":"function","function":{"name":5}}]',
                 '[{"type":"function","function":{}}]', '[{"type":"retrieval"}]']
    for t in bad_tools:
        req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")], tools_json=t),
                                 sampling_params=pb.SamplingParams(max_tokens=2))
        code, details = h.code_of(lambda: h.collect(s.inf.Generate(req, timeout=10)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "tools" in details, (t, code, details)
    good = ('[{"type":"function","function":{"name":"get_weather","description":"d",'
            '"parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]')
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")], tools_json=good),
                             sampling_params=pb.SamplingParams(max_tokens=2))
    code, details = h.code_of(lambda: h.collect(s.inf.Generate(req, timeout=10)))
    assert code == grpc.StatusCode.OK, (code, details)
    assert s.stop() == 0
    print("   top_k = -1 served; %d malformed tool lists INVALID_ARGUMENT naming tools_json; a valid one served" %
          len(bad_tools))


TESTS = [
    ("e8-coordinator-needs-key", test_coordinator_needs_key),
    ("e8-register-needs-key", test_register_needs_key),
    ("e8-claim-live-rank-refused", test_claim_live_rank_refused),
    ("e8-engine-needs-key", test_engine_needs_key),
    ("e8-forged-report-refused", test_forged_report_refused),
    ("e9-registrations-pruned", test_registrations_pruned),
    ("e10-abort-scoped", test_abort_scoped),
    ("e11-log-injection", test_log_injection),
    ("e12-contract", test_contract),
]

if __name__ == "__main__":
    rellib.need_worker()
    h.run_tests(TESTS)
