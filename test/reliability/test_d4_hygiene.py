#!/usr/bin/env python3
"""D4: fd, thread and RSS hygiene of stepd (and of a real stepd-worker) after bursts.

Rig 1: stepd + a mock engine.  Rig 2: stepd + a real `stepd-worker` on the tiny model
(CPU forward).  For each: baseline fds (/proc/PID/fd), threads (/proc/PID/task) and VmRSS
after a warm-up call; then BURSTS bursts of STREAMS concurrent Generate streams (every 5th
cancelled after its first token, every 7th with a 50 ms deadline) on fresh client
channels; after each burst the fd count of stepd (and of the worker) must return to
baseline, the threads outside gRPC core's own on-demand pools (see GRPC_POOLS) to theirs,
and the total may exceed the baseline by at most GRPC_POOL_SLACK (gRPC's timer pool
keeps the threads it adds) (waited for, bounded); the engines must be idle (D1); RSS growth over the
whole run must stay under 32 MiB and, between the second and the last burst (after the
allocator has warmed), under 8 MiB.  Figures are printed.
Usage: test_d4_hygiene.py [--streams N] [--bursts B] [--rigs mock,worker]
"""
import argparse
import os
import subprocess
import threading
import time

import rellib
from rellib import h

grpc = h.grpc
pb = h.pb


def counts(pid):
    return (len(os.listdir("/proc/%d/fd" % pid)), len(os.listdir("/proc/%d/task" % pid)),
            rellib.proc_status(pid, "VmRSS"))


def burst(s, n, max_tokens, channels=4):
    chans = [grpc.insecure_channel(s.addr) for _ in range(channels)]
    stubs = [h.pbg.InferenceStub(c) for c in chans]
    codes = {}
    lock = threading.Lock()

    def one(i):
        stub = stubs[i % channels]
        timeout = 0.05 if i % 7 == 6 else 60
        code = "OK"
        try:
            st = stub.Generate(h.gen_request([i % 50 + 1, 2, 3], max_tokens), timeout=timeout)
            for r in st:
                if i % 5 == 4 and r.HasField("chunk"):
                    st.cancel()
        except grpc.RpcError as e:
            code = e.code().name
        with lock:
            codes[code] = codes.get(code, 0) + 1
    ths = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in ths]
    [t.join(120) for t in ths]
    for c in chans:
        c.close()
    assert sum(codes.values()) == n, codes
    # RESOURCE_EXHAUSTED: the worker's own waiting queue (256) is full in the large variant - clean backpressure
    bad = {k: v for k, v in codes.items() if k not in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")}
    assert not bad, codes
    return codes


GRPC_POOL_SLACK = h.GRPC_POOL_SLACK
thread_names = h.thread_names
own_threads = h.own_threads


def back_to(pid, base, own0, max_threads, what, timeout=30):
    """fds back to the baseline; threads outside gRPC's pools back to theirs; total <= max_threads."""
    t0 = time.time()
    h.wait_until(lambda: counts(pid)[0] <= base[0] and own_threads(pid) <= own0 and counts(pid)[1] <= max_threads,
                 timeout=timeout, step=0.1,
                 what="%s fds/threads back to %s/%d own/%d total (now %s, %s)" %
                 (what, base[0], own0, max_threads, counts(pid)[:2], thread_names(pid)))
    return time.time() - t0


def run(rig, streams, bursts):
    s = h.Stepd()
    worker = None
    if rig == "mock":
        eng = s.start_engine("g0", "--delay-ms", "2")
        max_tokens = 32
    else:
        worker = subprocess.Popen([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:%d" % s.ports["control"], "--group",
                                   "tiny", "--rank", "0", "--world-size", "1", "--threads", "1", "--model",
                                   rellib.MODEL_DIR, "--engine-listen", "unix:%s/engine.sock" % s.workdir,
                                   *s.key_args()],
                                  stdout=open(os.path.join(s.workdir, "worker.log"), "w"), stderr=subprocess.STDOUT)
        h._procs.append(worker)
        max_tokens = 8
    s.wait_ready(1, timeout=60)
    h.collect(s.inf.Generate(h.gen_request([1, 2], 4), timeout=30))
    s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2)      # the admin channel's connection is in the baseline
    s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2)
    time.sleep(0.5)
    base = counts(s.proc.pid)
    wbase = counts(worker.pid) if worker else None
    own0 = own_threads(s.proc.pid)
    wown0 = own_threads(worker.pid) if worker else None
    # gRPC core's pools may add a few threads at any time (bounded by gRPC); allow GRPC_POOL_SLACK
    max_t = base[1] + GRPC_POOL_SLACK
    wmax_t = wbase[1] + GRPC_POOL_SLACK if worker else None
    rss = [base[2]]
    t_all = time.time()
    for b in range(bursts):
        t0 = time.time()
        codes = burst(s, streams, max_tokens)
        wall = time.time() - t0
        settle = back_to(s.proc.pid, base, own0, max_t, "stepd")
        if worker:
            back_to(worker.pid, wbase, wown0, wmax_t, "stepd-worker")
        h.wait_until(lambda: s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups[0].counters.in_flight == 0 and
                     all(l.num_running == 0 and l.kv_blocks_used == 0 and l.num_requests_alive == 0
                         for l in s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2).loads),
                     timeout=15, what="idle engines")
        c = counts(s.proc.pid)
        rss.append(c[2])
        wc = counts(worker.pid) if worker else None
        print("   %s burst %d: %d streams %s in %.2fs; stepd fds %d threads %d RSS %d KiB (settled in %.2fs)%s" %
              (rig, b + 1, streams, dict(sorted(codes.items())), wall, c[0], c[1], c[2], settle,
               "; worker fds %d threads %d RSS %d KiB" % wc if wc else ""))
    grow_all, grow_late = rss[-1] - rss[0], rss[-1] - rss[min(2, len(rss) - 1)]
    print("   %s: stepd threads by name at the end %s" % (rig, thread_names(s.proc.pid)))
    if worker:
        print("   %s: worker threads by name at the end %s" % (rig, thread_names(worker.pid)))
    print("   %s: baseline fds %d threads %d RSS %d KiB%s; RSS growth %+d KiB overall, %+d KiB since burst 2; %.1fs" %
          (rig, base[0], base[1], base[2], " (worker fds %d threads %d RSS %d KiB)" % wbase if wbase else "",
           grow_all, grow_late, time.time() - t_all))
    assert grow_all < 32 * 1024, rss
    assert grow_late < 8 * 1024, rss
    assert s.stop() == 0
    if worker:
        assert worker.wait(20) == 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--rigs", default="mock,worker")
    a = ap.parse_args()
    tests = []
    for r in a.rigs.split(","):
        if r == "worker" and not (rellib.WORKER_BIN and os.path.exists(rellib.WORKER_BIN) and
                                  os.path.exists(os.path.join(rellib.MODEL_DIR, "config.json"))):
            print("   (no stepd-worker or tiny model: worker rig skipped)")
            continue
        tests.append(("d4-hygiene-" + r, lambda r=r: run(r, a.streams, a.bursts)))
    h.run_tests(tests)


if __name__ == "__main__":
    main()
