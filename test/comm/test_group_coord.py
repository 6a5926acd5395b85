#!/usr/bin/env python3
"""test_group_coord.py - a worker group brought up through the real coordinator.

`stepd` (coordinator) + stepd-worker ranks registering on its control service
(stepd.ctl.v1.Control/Session), rendezvous data handed out by the coordinator, rank 0
serving stepd.v1.Engine; a Python grpcio client (stubs generated from proto/ at test time,
test/daemon/stepd_harness.py) calls stepd.v1.Inference/Generate:
  1. N = 2 and N = 4: the group becomes ready and greedy output equals the N = 1 offline
     run of the same prompt;
  2. a follower SIGKILLed while a long Generate is streaming: the stream ends with an
     error (status or finish=error) instead of hanging, every surviving rank exits by
     itself, the coordinator stays up; the times are printed;
  3. a rank that never joins: rank 0 gives up after --rendezvous-timeout (exit 3);
  4. the coordinator SIGKILLed and restarted under a ready group: the ranks survive it (the
     same PIDs, no reload), the new coordinator re-adopts the group, requests are served
     again; the time to ready is printed (B3).
Environment: STEPD_BIN, STEPD_WORKER_BIN, PROTO_DIR, MODEL_DIR.  Exit 77 without the
model or grpcio."""
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))

MODEL = os.environ.get("MODEL_DIR", "")
WORKER = os.environ.get("STEPD_WORKER_BIN", "")
if not os.path.exists(os.path.join(MODEL, "config.json")):
    print("no model at %r: skipped" % MODEL)
    sys.exit(77)

import grpc  # noqa: E402
import stepd_harness as h  # noqa: E402  (exits 77 without grpcio)
from grouplib import Group, parse_generate  # noqa: E402

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
procs = []


def start_rank(s, tmp, group, rank, n, *extra):
    log = open(os.path.join(tmp, "%s-r%d.log" % (group, rank)), "w")
    cmd = [WORKER, "--coordinator", "127.0.0.1:%d" % s.ports["control"], "--group", group,
           "--rank", str(rank), "--world-size", str(n), "--model", MODEL, "--threads", "1",
           "--engine-listen", "unix:%s/%s-engine.sock" % (tmp, group), *s.key_args(), *extra]
    env = dict(os.environ)
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    p.logpath = log.name
    procs.append(p)
    return p


def offline_reference(tmp, n_tokens):
    pf = os.path.join(tmp, "ref-prompt.txt")
    with open(pf, "w") as f:
        f.write(",".join(map(str, PROMPT)) + "\n")
    g = Group(WORKER, MODEL, 1, "ref", args=["--exact"],
              rank0_args=["--generate", pf, "--max-tokens", str(n_tokens)], workdir=tmp)
    out = g.stdout0()
    assert g.wait(60)[0] == 0, g.stderr(0)
    return parse_generate(out)[0][1]


def generate(s, n_tokens, timeout=60):
    req = h.gen_request(PROMPT, max_tokens=n_tokens)
    req.sampling_params.temperature = 0.0
    toks, _, finals, _ = h.collect(s.inf.Generate(req, timeout=timeout))
    return toks, finals


def test_ready_and_equal(s, tmp, ref, n):
    group = "eq%d" % n
    ranks = [start_rank(s, tmp, group, r, n, "--exact") for r in range(n)]
    t0 = time.time()
    s.wait_ready(groups=1, timeout=60)
    print("N=%d: group %s ready through the coordinator in %.2f s" % (n, group, time.time() - t0))
    toks, finals = generate(s, len(ref))
    assert toks == ref, "N=%d via coordinator: %s != %s" % (n, toks, ref)
    assert finals and finals[0].finish_reason == h.pb.FINISH_REASON_LENGTH, finals
    print("N=%d: Generate through stepd == offline N=1 output (%d tokens)" % (n, len(toks)))
    for p in ranks:          # take the group down before the next case
        p.terminate()
    for p in ranks:
        p.wait(30)
    h.wait_until(lambda: s.inf.GetServerInfo(h.pb.GetServerInfoRequest(), timeout=1).groups_ready == 0,
                 timeout=10, what="group gone")


def test_kill_follower(s, tmp, ref, n=2):
    """Rank 1 SIGKILLed mid-Generate: the stream ends UNAVAILABLE naming the group and the
    rank (never OK, never a final with finish_reason ERROR); the survivors keep running
    (same PIDs, their weights: one "loaded:" line each) and register again; a new rank 1
    (what its supervisor would start) re-forms the group at the next epoch, and greedy
    output is what it was."""
    group = "kill%d" % n
    ranks = [start_rank(s, tmp, group, r, n, "--collective-timeout", "60000", "--exact",
                        "--max-model-len", "4096") for r in range(n)]
    s.wait_ready(groups=1, timeout=60)
    epoch = [g for g in s.admin.GetGroups(h.pb.GetGroupsRequest(), timeout=2).groups if g.group == group][0].epoch
    result = {}

    def run():
        req = h.gen_request(PROMPT, max_tokens=3000)
        req.sampling_params.temperature = 0.0
        got = []
        try:
            for r in s.inf.Generate(req, timeout=120):
                if r.HasField("chunk"):
                    got.extend(r.chunk.token_ids)
                    result["first"] = True
                else:
                    result["final"] = r.final
            result["status"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            result["status"] = e.code()
            result["details"] = e.details()
        result["tokens"] = len(got)
        result["t_end"] = time.monotonic()

    th = threading.Thread(target=run)
    th.start()
    h.wait_until(lambda: result.get("first"), timeout=30, what="first tokens")
    time.sleep(0.3)
    t_kill = time.monotonic()
    ranks[1].kill()
    th.join(60)
    assert not th.is_alive(), "Generate still streaming 60 s after rank 1 was killed"
    assert result.get("status") == grpc.StatusCode.UNAVAILABLE, "stream ended %s" % result
    assert "final" not in result, result
    assert group in result["details"] and "rank" in result["details"], result
    print("N=%d: rank 1 SIGKILLed mid-Generate: stream ended after %.0f ms UNAVAILABLE (%d tokens "
          "streamed): %s" % (n, (result["t_end"] - t_kill) * 1000, result["tokens"], result["details"]))
    survivors = [p for r, p in enumerate(ranks) if r != 1]
    for p in survivors:
        h.wait_until(lambda: count_lines(p.logpath, "registering again with the weights kept"), timeout=30,
                     what="a survivor leaving the group to register again")
    time.sleep(0.5)
    assert all(p.poll() is None for p in survivors), [p.poll() for p in survivors]
    t_new = time.monotonic()
    ranks[1] = start_rank(s, tmp, group, 1, n, "--collective-timeout", "60000", "--exact", "--max-model-len",
                          "4096")
    h.wait_until(lambda: s.inf.GetServerInfo(h.pb.GetServerInfoRequest(), timeout=1).groups_ready >= 1,
                 timeout=60, what="the group re-formed")
    t_ready = time.monotonic() - t_new
    g = [g for g in s.admin.GetGroups(h.pb.GetGroupsRequest(), timeout=2).groups if g.group == group][0]
    assert g.epoch == epoch + 1, (g.epoch, epoch)
    toks, _ = generate(s, 24)
    assert toks == ref, (toks, ref)
    h.ledger_line("lost rank of %s" % group, 2, 2)    # the stream caught by the kill, and the one after
    h.wait_idle(s, "group %s re-formed after its lost rank" % group)
    loads = [count_lines(p.logpath, "loaded: ") for p in survivors]
    assert loads == [1] * len(survivors), loads
    print("  survivors kept their PIDs and weights (%s \"loaded:\" lines); the group re-formed at epoch %d "
          "%.2f s after the new rank 1 started; greedy output unchanged" % (loads, g.epoch, t_ready))
    for p in ranks:
        p.kill()
        p.wait(30)
    h.wait_until(lambda: s.inf.GetServerInfo(h.pb.GetServerInfoRequest(), timeout=1).groups_ready == 0,
                 timeout=10, what="group gone")
    assert s.proc.poll() is None, "the coordinator died"


def test_never_joins(s, tmp):
    p = start_rank(s, tmp, "nj", 0, 2, "--rendezvous-timeout", "1500")
    rc = p.wait(30)
    log = open(p.logpath).read()
    assert rc == 3, "rank 0 alone exited %d:\n%s" % (rc, log)
    assert "timed out" in log, log
    print("rank 1 never joins: rank 0 exits 3 after its rendezvous timeout: %s" %
          log.strip().splitlines()[-1])


def count_lines(path, needle):
    return sum(needle in line for line in open(path))


def test_coordinator_restarted(s, tmp):
    """The coordinator SIGKILLed and restarted while a 2-rank CPU group (UCX) serves: the
    ranks keep running (same PIDs), fail the request in flight UNAVAILABLE, keep their
    weights (one "loaded:" line each), dial again, and the new coordinator re-adopts the
    group (no rendezvous, epoch kept): readiness returns and requests are served again."""
    ranks = [start_rank(s, tmp, "ck", r, 2, "--exact") for r in range(2)]
    s.wait_ready(groups=1, timeout=60)
    pids = [p.pid for p in ranks]
    ref, _ = generate(s, 16)
    epoch = s.admin.GetGroups(h.pb.GetGroupsRequest(), timeout=2).groups[0].epoch
    result = {}

    def run():
        req = h.gen_request(PROMPT, max_tokens=1000)
        req.sampling_params.temperature = 0.0
        try:
            for r in s.inf.Generate(req, timeout=120):
                result["first"] = True
        except grpc.RpcError as e:
            result["status"] = e.code()
    th = threading.Thread(target=run)
    th.start()
    h.wait_until(lambda: result.get("first"), timeout=30, what="first tokens")
    port = s.ports["control"]
    t_kill = time.monotonic()
    s.proc.kill()
    s.proc.wait()
    th.join(30)
    assert result.get("status") == grpc.StatusCode.UNAVAILABLE, result
    for p in ranks:
        h.wait_until(lambda: count_lines(p.logpath, "control session lost"), timeout=10,
                     what="rank log: session lost")
    h.wait_until(lambda: count_lines(ranks[0].logpath, "in-flight requests failed UNAVAILABLE"), timeout=10,
                 what="rank 0 failing its in-flight requests")
    time.sleep(1.0)
    assert all(p.poll() is None for p in ranks), [p.poll() for p in ranks]
    tmp2 = tempfile.mkdtemp(prefix="stepd-test-coord-restart-")
    t_start = time.monotonic()
    s2 = h.Stepd("--vocab-size", "4096", "--control-listen", "127.0.0.1:%d" % port, "--control-key-file",
                 s.key_file, workdir=tmp2)
    try:
        s2.wait_ready(groups=1, timeout=30)
        t_ready = time.monotonic() - t_start
        assert [p.pid for p in ranks] == pids and all(p.poll() is None for p in ranks)
        log = s2.read_log()
        assert "re-adopted at epoch %d" % epoch in log and "rendezvous sent" not in log, log
        g = s2.admin.GetGroups(h.pb.GetGroupsRequest(), timeout=2).groups[0]
        assert g.epoch == epoch and g.state == h.pb.WORKER_STATE_READY, g
        toks, finals = generate(s2, 16)
        assert toks == ref, (toks, ref)
        loads = [count_lines(p.logpath, "loaded: ") for p in ranks]
        assert loads == [1, 1], loads
        print("coordinator SIGKILLed under a 2-rank group and restarted %.1f s later: the same PIDs %s, "
              "no reload (%s \"loaded:\" lines), re-adopted at epoch %d, ready %.2f s after the restart "
              "(%.2f s after the kill); output unchanged" % (t_start - t_kill, pids, loads, epoch, t_ready,
                                                            t_start - t_kill + t_ready))
    finally:
        rc = s2.stop()
    assert rc == 0
    for r, p in enumerate(ranks):
        assert p.wait(30) == 0, "rank %d after the coordinator's Shutdown" % r


def main():
    tmp = tempfile.mkdtemp(prefix="stepd-test-coord-group-")
    ref = offline_reference(tmp, 24)
    s = h.Stepd("--vocab-size", "4096", workdir=tmp)
    try:
        test_ready_and_equal(s, tmp, ref, 2)
        test_ready_and_equal(s, tmp, ref, 4)
        test_kill_follower(s, tmp, ref)
        test_never_joins(s, tmp)
        test_coordinator_restarted(s, tmp)
    except AssertionError:
        print(s.read_log()[-4000:])
        for p in procs:
            print("--- %s ---\n%s" % (p.logpath, open(p.logpath).read()[-2000:]))
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
