"""test_stop_abort.py - ranks stopped while their group aborts (issue 41 item 1).

A stepd coordinator and GROUPS two-rank groups of stepd-worker (--mock forward, UCX over
loopback).  Each round starts every group, waits until all serve, then stops each group one
of three ways at once, so that a rank is in its teardown when the coordinator tells it that
its group re-forms (GroupAbort runs the control thread's abort hook on the communicator):
  term0     SIGTERM to rank 0 (it stops rank 1; the coordinator sees rank 0 leave),
  term0kill1  SIGTERM to rank 0 and SIGKILL to rank 1 (rank 0 is told the group aborts),
  term1term0  SIGTERM to rank 1 (a follower: it exits at once), then to rank 0 a few ms later.
Every rank must exit without a crash signal and without a sanitizer report in its log.
Under ASan this caught a heap-use-after-free (comm_interrupt on a freed communicator) in
about one group stop in four; the normal build is silent, so the CI sanitizer stage
(tools/dev/test-asan.sh) runs it.  --rounds R --groups G: R*G group stops.
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import time

import rellib
from rellib import h

SAN_MARKS = ("AddressSanitizer", "LeakSanitizer", "runtime error:", "ThreadSanitizer")


def start_group(s, name, rnd):
    args = ["--mock", "--collective-timeout", "5000", "--rendezvous-timeout", "20000",
            "--max-seqs", "4", "--max-model-len", "64"]
    log = "%s-round%d-w%%d.log" % (name, rnd)
    return [s.start_worker(name, *args, rank=r, world=2, log_name=log % r) for r in (0, 1)]


def stop_group(ranks, how, rng):
    r0, r1 = ranks
    if how == "term0":
        r0.send_signal(signal.SIGTERM)
    elif how == "term0kill1":
        r0.send_signal(signal.SIGTERM)
        r1.send_signal(signal.SIGKILL)
    else:
        r1.send_signal(signal.SIGTERM)
        time.sleep(rng.uniform(0, 0.02))
        r0.send_signal(signal.SIGTERM)


def check_rank(p, what):
    """None, or what went wrong with the rank (a crash signal, a sanitizer report)."""
    try:
        rc = p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "%s did not exit within 60 s of its stop; log %s" % (what, p.logpath)
    text = open(p.logpath, errors="replace").read()
    marks = [m for m in SAN_MARKS if m in text]
    sig = rellib.crash_signal(rc)
    if marks or sig:
        return "%s: %s%s; log %s:\n%s" % (what, "died of %s " % sig if sig else "",
                                           "sanitizer report" if marks else "", p.logpath, text[-6000:])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--seed", type=int, default=41)
    a = ap.parse_args()
    rellib.need_worker()
    rng = random.Random(a.seed)
    s = h.Stepd()
    ways = ("term0", "term0kill1", "term1term0")
    counts = {w: 0 for w in ways}
    failed = []
    t0 = time.time()
    try:
        for rnd in range(a.rounds):
            groups = {"g%d" % g: start_group(s, "g%d" % g, rnd) for g in range(a.groups)}
            s.wait_ready(a.groups, timeout=120)
            hows = {}
            for i, (name, ranks) in enumerate(groups.items()):
                hows[name] = ways[(rnd + i) % len(ways)]
                counts[hows[name]] += 1
                stop_group(ranks, hows[name], rng)
            for name, ranks in groups.items():
                bad = [check_rank(p, "round %d group %s rank %d" % (rnd, name, r)) for r, p in enumerate(ranks)]
                bad = [b for b in bad if b]
                if bad:
                    failed.append((hows[name], bad[0]))
            # the coordinator has seen every rank leave before the next round registers
            h.wait_until(lambda: s.inf.GetServerInfo(h.pb.GetServerInfoRequest(), timeout=2)
                         .groups_ready == 0, timeout=30, what="all groups down")
        n = sum(counts.values())
        if failed:
            print(failed[0][1])
            raise AssertionError("%d of %d group stops crashed or had a sanitizer report (%s)" % (
                len(failed), n, ", ".join("%s %d of %d" % (w, sum(f[0] == w for f in failed), counts[w])
                                         for w in ways)))
        print("%d group stops (%s) in %d rounds, %.1f s: no crash, no sanitizer report" %
              (n, ", ".join("%s %d" % kv for kv in counts.items()), a.rounds,
               time.time() - t0))
    finally:
        rc = s.stop()
    assert rc == 0, "stepd exited %d" % rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
