#!/usr/bin/env python3
"""D2 + D1 + B1 under chaos: exactly one terminal status per accepted Generate call.

Two rigs, each: a coordinator with a 2-rank group "tp2" and a 1-rank group "solo";
many concurrent Generate streams of four kinds (run to completion, client cancel after
a few tokens, short deadline, Inference.Abort by request id) while one rank of "tp2"
is SIGKILLed mid-way.  A client-side ledger checks for every call:
  - exactly one terminal status (a normal end with exactly one Final as the last
    message, or exactly one error status), reached well before the call deadline;
  - the status is one the kind allows (OK / CANCELLED / DEADLINE_EXCEEDED / finish ABORT,
    or UNAVAILABLE naming group tp2 for calls caught by the kill - never OK with a Final of
    finish ERROR - or RESOURCE_EXHAUSTED "queue is full" from a worker's own queue in large
    runs);
  - no token after the client cancelled or after the Final;
and on the server side: stepd:request_status_total{code="OK"} grew by exactly the client's
OKs, the total by the number of calls less at most those a client deadline/cancel may have
ended before stepd took them, nothing was rejected, every group's routed == completed +
failed, and after the group re-forms (epoch + 1) the Admin GetGroups
in_flight counters and the engines' GetLoads (num_running, kv_blocks_used,
num_requests_alive) are back to idle (D1), and a plain Generate works on both groups.

Rig 1: mock engines (test/daemon/mock-engine, paced tokens).
Rig 2: the real `stepd-worker --mock` (UCX between the two ranks of tp2).
Usage: test_d2_chaos.py [--streams N] [--rigs mock,worker]
"""
import argparse
import os
import random
import signal
import subprocess
import threading
import time

import rellib
from rellib import h

grpc = h.grpc
pb = h.pb
SC = grpc.StatusCode


def status_total(s):
    tot = 0.0
    for line in s.metrics().splitlines():
        if line.startswith("stepd:request_status_total{"):
            tot += float(line.split()[-1])
    return tot


def rejected_total(s):
    tot = 0.0
    for line in s.metrics().splitlines():
        if line.startswith("stepd:requests_rejected_total{"):
            tot += float(line.split()[-1])
    return tot


class Call:
    def __init__(self, i, kind, max_tokens):
        self.i, self.kind, self.max_tokens = i, kind, max_tokens
        self.rid = "chaos-%d-%s" % (i, kind)
        self.terminals = []          # ("ok", None) | ("error", code, details)
        self.finals = []
        self.tokens = 0
        self.after_cancel = 0
        self.after_final = 0
        self.t_end = None
        self.t0 = None


def run_call(s, c, abort_ready, rng):
    timeout = {"deadline": rng.uniform(0.15, 0.4)}.get(c.kind, 30.0)
    c.timeout = timeout
    c.t0 = time.time()
    cancelled = False
    try:
        st = s.inf.Generate(h.gen_request([c.i % 97 + 1, 2, 3], c.max_tokens, request_id=c.rid), timeout=timeout)
        cancel_at = rng.randint(1, 6)
        for r in st:
            if cancelled:
                c.after_cancel += 1
            if c.finals:
                c.after_final += 1
            if r.HasField("chunk"):
                c.tokens += len(r.chunk.token_ids)
                if c.kind == "abort" and c.tokens >= 2:
                    abort_ready.append(c.rid)
                if c.kind == "cancel" and c.tokens >= cancel_at and not cancelled:
                    cancelled = True
                    st.cancel()
            else:
                c.finals.append(r.final)
        c.terminals.append(("ok", None, ""))
    except grpc.RpcError as e:
        c.terminals.append(("error", e.code(), e.details() or ""))
    except Exception as e:  # noqa: BLE001  (ledger: anything else is a failure)
        c.terminals.append(("exception", None, repr(e)))
    c.t_end = time.time()


def ledger_check(calls, killed_group):
    bad = []
    summary = {}
    error_finals = []
    for c in calls:
        key = c.kind + ":" + ("OK" if not c.terminals or c.terminals[0][1] is None else c.terminals[0][1].name)
        if c.terminals and c.terminals[0][0] == "ok" and c.finals:
            key = c.kind + ":OK/" + pb.FinishReason.Name(c.finals[-1].finish_reason).replace("FINISH_REASON_", "")
        summary[key] = summary.get(key, 0) + 1
        if len(c.terminals) != 1:
            bad.append((c.rid, "terminals", c.terminals))
            continue
        what, code, details = c.terminals[0]
        if c.after_cancel or c.after_final:
            bad.append((c.rid, "message after cancel/final", c.after_cancel, c.after_final))
        if what == "exception":
            bad.append((c.rid, details))
            continue
        if what == "ok":
            if len(c.finals) != 1:
                bad.append((c.rid, "OK with %d finals" % len(c.finals)))
                continue
            f = c.finals[0]
            if f.finish_reason == pb.FINISH_REASON_ERROR:
                # a lost rank ends its group's requests UNAVAILABLE: never OK with finish ERROR
                bad.append((c.rid, "OK with a Final of finish ERROR", f.group, f.message))
                error_finals.append(f.message)
                continue
            if c.kind == "abort":
                if f.finish_reason != pb.FINISH_REASON_ABORT and c.tokens < c.max_tokens:
                    bad.append((c.rid, "abort kind ended with", f.finish_reason))
            elif c.kind in ("normal", "long"):
                if f.finish_reason != pb.FINISH_REASON_LENGTH or f.usage.completion_tokens != c.tokens:
                    bad.append((c.rid, "normal ended with", f.finish_reason, c.tokens))
            elif c.kind == "deadline":
                bad.append((c.rid, "deadline call finished OK", c.tokens))   # 1000 tokens cannot fit
            elif c.kind == "cancel":
                bad.append((c.rid, "cancelled call finished OK"))
            continue
        if c.finals:
            # a Final that reached the client just before its own deadline fired: gRPC reports the
            # deadline (the status is what counts); anything else after a Final is a violation
            if code == SC.DEADLINE_EXCEEDED and c.t_end - c.t0 >= 0.9 * c.timeout:
                summary["race:Final-then-DEADLINE_EXCEEDED"] = summary.get("race:Final-then-DEADLINE_EXCEEDED", 0) + 1
                continue
            bad.append((c.rid, "error after a Final", code, details, c.finals[-1].finish_reason,
                        round(c.t_end - c.t0, 3), c.timeout))
            continue
        allowed = {"cancel": SC.CANCELLED, "deadline": SC.DEADLINE_EXCEEDED}.get(c.kind)
        if code == allowed:
            continue
        if code == SC.UNAVAILABLE and killed_group in details:
            continue
        if code == SC.RESOURCE_EXHAUSTED and "queue is full" in details:
            continue            # backpressure of a worker's own waiting queue (large runs): a clean terminal status
        bad.append((c.rid, c.kind, code, details))
    if error_finals:
        summary["(finish ERROR sample)"] = error_finals[0][:160]
    return bad, summary




class MockRig:
    name = "mock-engines"

    def __init__(self, s):
        self.s = s
        self.ranks = {}
        self.solo = s.start_engine("solo", "--delay-ms", "4")
        self.ranks[1] = s.start_engine("tp2", rank=1, world=2)
        self.ranks[0] = s.start_engine("tp2", "--delay-ms", "4", rank=0, world=2)

    def kill_rank1(self):
        self.ranks[1].kill(signal.SIGKILL)

    def reform(self):
        self.ranks[1] = self.s.start_engine("tp2", rank=1, world=2)


class WorkerRig:
    name = "stepd-worker --mock"

    def __init__(self, s):
        self.s = s
        self.env = dict(os.environ, UCX_NET_DEVICES="lo", UCX_WARN_UNUSED_ENV_VARS="n")
        self.procs = {}
        self.start("solo", 0, 1)
        self.start("tp2", 0, 2)
        self.start("tp2", 1, 2)

    def start(self, group, rank, world):
        log = open(os.path.join(self.s.workdir, "w-%s-%d.log" % (group, rank)), "a")
        p = subprocess.Popen([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:%d" % self.s.ports["control"],
                              "--group", group, "--rank", str(rank), "--world-size", str(world), "--mock",
                              "--threads", "1", "--engine-listen", "unix:%s/%s.sock" % (self.s.workdir, group),
                              *self.s.key_args()],
                             stdout=log, stderr=subprocess.STDOUT, env=self.env)
        h._procs.append(p)
        self.procs[(group, rank)] = p

    def kill_rank1(self):
        p = self.procs[("tp2", 1)]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def reform(self):
        # the surviving rank 0 leaves the group and registers again by itself, keeping its
        # process; only the lost rank is restarted (as systemd or stepd serve would)
        p0 = self.procs[("tp2", 0)]
        log = os.path.join(self.s.workdir, "w-tp2-0.log")
        h.wait_until(lambda: "registering again with the weights kept" in open(log).read(), timeout=15,
                     what="tp2 rank 0 leaving the group to register again")
        assert p0.poll() is None, "tp2 rank 0 exited (%s) after its peer was killed" % p0.returncode
        self.start("tp2", 1, 2)

    def stop(self):
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                raise AssertionError("a worker did not exit after the coordinator stopped")


def chaos(rig_cls, n_streams, seed):
    rng = random.Random(seed)
    s = h.Stepd("--max-running", "4096", "--max-queue", "4096")
    rig = rig_cls(s)
    s.wait_ready(2, timeout=60)
    epoch0 = {g.group: g.epoch for g in s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups}
    base_status, base_rej = status_total(s), rejected_total(s)
    base_ok = 0.0
    for line in s.metrics().splitlines():
        if line.startswith('stepd:request_status_total{code="OK"}'):
            base_ok = float(line.split()[-1])
    fd0, th0, rss0 = s.fds(), s.threads(), s.rss_kib()
    worker_rig = rig_cls is WorkerRig
    kinds = ["normal"] * 4 + ["cancel"] * 3 + ["deadline"] * 2 + ["abort"] * 1 + ["long"]
    calls = []
    for i in range(n_streams):
        k = kinds[i % len(kinds)]
        mt = {"normal": rng.randint(5, 60) if not worker_rig else rng.randint(50, 900),
              "long": 300 if not worker_rig else 1000}.get(k, 1000 if worker_rig else 2000)
        calls.append(Call(i, k, min(mt, 1000) if worker_rig else mt))
    abort_ready = []
    threads = [threading.Thread(target=run_call, args=(s, c, abort_ready, random.Random(seed + c.i)))
               for c in calls]
    t0 = time.time()
    for i, t in enumerate(threads):
        t.start()
        if i % 10 == 9:
            time.sleep(0.005)
    # abort by id whoever is streaming; kill one rank of tp2 mid-way
    killed_at = None
    aborted = 0
    end = time.time() + 45
    while any(t.is_alive() for t in threads) and time.time() < end:
        if abort_ready:
            ids = list(set(abort_ready))
            abort_ready.clear()
            aborted += s.inf.Abort(pb.AbortRequest(request_ids=ids), timeout=2).aborted
        if killed_at is None and (time.time() - t0 > 0.2 or sum(1 for c in calls if c.t_end) > n_streams // 4):
            rig.kill_rank1()
            killed_at = time.time() - t0
        time.sleep(0.01)
    for t in threads:
        t.join(max(0.1, end - time.time()))
    hung = [c.rid for c in calls if c.t_end is None]
    assert not hung, "calls without a terminal status after 45 s: %s" % hung[:10]
    assert killed_at is not None
    wall = time.time() - t0
    bad, summary = ledger_check(calls, "tp2")
    h.ledger_line("d2-" + rig.name, len(calls), sum(1 for c in calls if len(c.terminals) == 1))
    assert not bad, "ledger violations (%d): %s" % (len(bad), bad[:10])
    hit = sum(v for k, v in summary.items() if k.endswith("UNAVAILABLE") or k.endswith("/ERROR"))
    assert hit > 0, "the kill caught no call in flight: %s" % summary
    late = [c.rid for c in calls if c.kind != "deadline" and c.t_end - c.t0 > 20]
    assert not late, late
    # server-side ledger: stepd's status counter never counts more calls than were made, counts
    # every client OK, and misses only calls that may never have reached it (a client
    # deadline or cancel that fired before the server took the call)
    client_ok = sum(1 for c in calls if c.terminals[0][0] == "ok")
    client_local = sum(1 for c in calls if c.terminals[0][1] in (SC.DEADLINE_EXCEEDED, SC.CANCELLED))

    def server_ledger():
        ok = 0.0
        for line in s.metrics().splitlines():
            if line.startswith('stepd:request_status_total{code="OK"}'):
                ok = float(line.split()[-1])
        return status_total(s) - base_status, ok - base_ok
    end = time.time() + 10
    while time.time() < end and server_ledger()[0] < n_streams:
        time.sleep(0.1)
    d_status, d_ok = server_ledger()
    d_rej = rejected_total(s) - base_rej
    # OK on the server but DEADLINE_EXCEEDED/CANCELLED on the client is a legal race: the
    # server finished the call while the client's own deadline or cancel fired (gRPC then
    # reports the local status), so the server's OKs lie in [client OK, client OK + local]
    assert n_streams - client_local <= d_status <= n_streams and \
        client_ok <= d_ok <= client_ok + client_local and d_rej == 0, \
        "server ledger: status_total +%d (OK +%d) for %d calls (client OK %d, client-side deadline/cancel %d), " \
        "rejected +%d" % (d_status, d_ok, n_streams, client_ok, client_local, d_rej)
    # the group re-forms (epoch + 1); everything back to idle
    rig.reform()
    s.wait_ready(2, timeout=60)
    h.wait_until(lambda: all(g.state == pb.WORKER_STATE_READY for g in
                             s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups), timeout=30,
                 what="both groups ready")
    gg, loads = h.wait_idle(s, "d2-%s after the kill and the re-form" % rig.name)
    ep = {g.group: g.epoch for g in gg}
    assert ep["tp2"] > epoch0["tp2"] and ep["solo"] == epoch0["solo"], (epoch0, ep)
    # both groups serve again: concurrent streams spread over the two groups
    seen = set()
    for _ in range(5):
        res = []
        ths = [threading.Thread(target=lambda: res.append(h.collect(s.inf.Generate(
            h.gen_request([7, 8], 200 if worker_rig else 30), timeout=20))[2][0].group)) for _ in range(8)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        seen.update(res)
        if seen >= {"tp2", "solo"}:
            break
    assert seen >= {"tp2", "solo"}, seen
    h.wait_idle(s, "d2-%s at the end" % rig.name)
    print("   %s: %d calls in %.2fs, rank 1 of tp2 SIGKILLed at %.2fs, %d aborted by id; ledger %s; "
          "status_total +%d, rejected +%d; epochs %s -> %s; coordinator fds %d->%d threads %d->%d RSS %d->%d KiB" %
          (rig.name, n_streams, wall, killed_at, aborted, dict(sorted(summary.items())), d_status, d_rej,
           epoch0, ep, fd0, s.fds(), th0, s.threads(), rss0, s.rss_kib()))
    assert s.stop() == 0
    if worker_rig:
        rig.stop()
    assert not [c for c in rellib.children_of(os.getpid()) if c[1] == "Z"], rellib.children_of(os.getpid())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--rigs", default="mock,worker")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    tests = []
    for r in a.rigs.split(","):
        if r == "mock":
            tests.append(("d2-chaos-mock-engines", lambda: chaos(MockRig, a.streams, a.seed)))
        elif r == "worker":
            if rellib.WORKER_BIN and os.path.exists(rellib.WORKER_BIN):
                tests.append(("d2-chaos-stepd-worker-tp2", lambda: chaos(WorkerRig, a.streams, a.seed + 1)))
            else:
                print("   (no stepd-worker: worker rig skipped)")
    h.run_tests(tests)


if __name__ == "__main__":
    main()
