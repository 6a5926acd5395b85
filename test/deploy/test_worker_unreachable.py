#!/usr/bin/env python3
"""test_worker_unreachable.py - a rank given a coordinator address where nothing listens
says so on its first failed dial, not only at the rendezvous deadline: its first log line
names the address and "connection refused" (and the flag to check) at attempt 1; it keeps
dialling (more than one attempt) and, at the deadline, exits 3 with an error that says the
coordinator was never reached, how many attempts were made and the last failure.  Asserted
on the log's order and attempt counts, not on times.
"""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402


def main():
    port = pl.free_port()           # free: nothing listens there
    target = "127.0.0.1:%d" % port
    env = dict(os.environ, STEPD_CONTROL_KEY="unreachable-test-key-0123456789")
    env.pop("JOURNAL_STREAM", None)
    p = subprocess.run([dl.build_binary("stepd-worker"), "--coordinator", target, "--mock",
                        "--rendezvous-timeout", "2500"], env=env, capture_output=True, text=True,
                       timeout=60)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    print("   exit %d; log:\n     %s" % (p.returncode, "\n     ".join(lines)))
    assert p.returncode == 3, "exit %d, expected 3 (rendezvous)" % p.returncode
    first = lines[0]
    assert target in first and "connection refused" in first and "--control-listen" in first and \
        "1 attempt so far" in first, "the first line should report the refused dial: %r" % first
    last = lines[-1]
    m = re.search(r"the coordinator %s was never reached \((\d+) attempts, the last: "
                  r"UNAVAILABLE: connection refused\)" % re.escape(target), last)
    assert m, "the deadline's error should say the coordinator was never reached: %r" % last
    assert int(m.group(1)) >= 2, "the rank should keep dialling: %s attempts" % m.group(1)
    print("worker unreachable: all checks passed")


if __name__ == "__main__":
    main()
