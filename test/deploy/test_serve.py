#!/usr/bin/env python3
"""test_serve.py - `stepd serve models/tiny-step --tensor-parallel-size 2` supervising its ranks.

  1. recovery: a request is served; rank 1 is killed with SIGKILL; stepd restarts it (a new
     pid, "restarted" in the log), the group re-forms (epoch + 1) and serves again.  Prints
     the time from the kill to readiness and to the first answered request.
  2. give-up: a stepd-worker that always crashes (a wrapper that kills rank 1 with SIGSEGV
     at start) is retried --worker-restart-limit times with growing delays, then not again;
     the reason is in the log, in /healthz (503 "not ready: ... not restarted ..."), in
     readiness (NOT_SERVING) and in Admin.GetGroups (the rank's message).
  3. SIGTERM: exit 0, every rank gone.
"""
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)
MODEL = os.path.join(ROOT, "models", "tiny-step")
STEPD = os.path.abspath(dl.build_binary("stepd"))
WORKER = os.path.abspath(dl.build_binary("stepd-worker"))


def start(d, extra):
    ports = [pl.free_port() for _ in range(5)]
    argv = [STEPD, "serve", MODEL, "--tensor-parallel-size", "2", "--threads", "1",
            "--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
            "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen", "127.0.0.1:%d" % ports[3],
            "--port", str(ports[4])] + extra
    env = dict(os.environ, TMPDIR=d)
    return pl.Proc("serve", argv, env, d), ports


def groups(adm):
    ch = pl.grpc.insecure_channel("127.0.0.1:%d" % adm)
    try:
        return pl.pbg.AdminStub(ch).GetGroups(pl.pb.GetGroupsRequest(), timeout=5).groups
    finally:
        ch.close()


def generate(pub):
    ch = pl.grpc.insecure_channel("127.0.0.1:%d" % pub)
    try:
        toks, _, finals, _ = pl.sh.collect(pl.pbg.InferenceStub(ch).Generate(pl.sh.gen_request(max_tokens=8),
                                                                             timeout=30))
        return len(toks) == 8 and bool(finals)
    except pl.grpc.RpcError:
        return False
    finally:
        ch.close()


def ready(pub):
    return pl.grpc_health("127.0.0.1:%d" % pub, "readiness") == pl.sh.SERVING


def stop(p):
    p.p.send_signal(signal.SIGTERM)
    rc = p.wait(60)
    assert rc == 0, "stepd serve exited %s:\n%s" % (rc, p.text()[-3000:])
    assert "every worker rank has exited" in p.text(), p.text()[-2000:]


def test_recovery(d):
    p, (pub, adm, _, _, _) = start(d, ["--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
                                    "--spec-log-interval", "1"])
    try:
        pl.wait_until(lambda: ready(pub), 60, "readiness")
        assert generate(pub), "first request"
        g = groups(adm)[0]
        pid1, epoch = g.ranks[1].pid, g.epoch
        t0 = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        pl.wait_until(lambda: not ready(pub), 10, "readiness NOT_SERVING after the kill", step=0.01)
        pl.wait_until(lambda: ready(pub), 60, "readiness after the restart", step=0.02)
        t_ready = time.monotonic() - t0
        pl.wait_until(lambda: generate(pub), 30, "a request after the restart", step=0.02)
        t_served = time.monotonic() - t0
        g = groups(adm)[0]
        assert g.ranks[1].pid != pid1 and g.epoch > epoch, (g.ranks[1].pid, pid1, g.epoch, epoch)
        log = p.text()
        assert re.search(r"group g0 rank 1 \(pid %d\) killed by signal 9" % pid1, log), log[-3000:]
        assert "group g0 rank 1 restarted" in log, log[-3000:]
        # the start-up signals: MTP detected and sharing the embedding, the plan per rank,
        # startup complete with the ports, and spec-decoding metrics once drafts ran
        for needle in ("MTP detected: 3 draft layers", "share the target's embedding", "load plan rank 0 of 2",
                       "load plan rank 1 of 2", "startup complete in"):
            assert needle in log, needle
        m = pl.wait_until(lambda: re.search(r"spec decode metrics: mean acceptance length ([\d.]+).*"
                                            r"per-position acceptance rate: ([\d., ]+)", p.text()), 10,
                          "spec-decoding metrics in the log")
        assert 1.0 <= float(m.group(1)) <= 3.0 and len(m.group(2).split(",")) == 2, m.group(0)
        print("   recovery after kill -9 of rank 1 (pid %d -> %d, epoch %d -> %d): ready again in %.2f s, "
              "first request answered %.2f s after the kill" % (pid1, g.ranks[1].pid, epoch, g.epoch, t_ready,
                                                                t_served))
        stop(p)
    finally:
        p.kill()


def test_give_up(d):
    wrapper = os.path.join(d, "crashing-worker")
    open(wrapper, "w").write("#!/bin/sh\n# rank 1 crashes at every start\n"
                             "case \" $* \" in *\" --rank 1 \"*) kill -SEGV $$ ;; esac\n"
                             "exec '%s' \"$@\"\n" % WORKER)
    os.chmod(wrapper, 0o755)
    limit = 3
    p, (pub, adm, _, met, _) = start(d, ["--worker-binary", wrapper, "--worker-restart-limit", str(limit),
                                      "--worker-backoff-ms", "200"])
    try:
        pl.wait_until(lambda: "given up" in p.text(), 60, "the group given up")
        log = p.text()
        starts = re.findall(r"group g0 rank 1 (?:started|restarted)", log)
        assert len(starts) == limit, "rank 1 started %d times, limit %d:\n%s" % (len(starts), limit, log[-3000:])
        delays = [float(x) for x in re.findall(r"group g0 rank 1 \(pid \d+\) killed by signal 11 "
                                               r"\([^)]*\); restarting in ([\d.]+) s", log)]
        assert delays == sorted(delays) and len(delays) == limit - 1 and delays[-1] > delays[0], delays
        assert re.search(r"group g0 given up: rank 1 failed %d times in a row" % limit, log), log
        time.sleep(1.5)
        assert len(re.findall(r"group g0 rank 1 (?:started|restarted)", p.text())) == limit, "retried after the limit"
        code, body = pl.http_get(met, "/healthz")
        assert code == 503 and "not restarted" in body and "rank 1 failed" in body, (code, body)
        assert pl.grpc_health("127.0.0.1:%d" % pub, "readiness") == pl.sh.NOT_SERVING
        g = groups(adm)[0]
        msg = g.ranks[1].message
        assert g.state == pl.pb.WORKER_STATE_FAILED and "not restarted" in msg, (g.state, msg)
        print("   crash loop: rank 1 started %d times (restart delays %s s), then given up; /healthz %d %r; "
              "GetGroups: %s" % (limit, delays, code, body.strip(), msg))
        stop(p)
    finally:
        p.kill()


def main():
    pl.run_cases((("kill -9 a rank: restart and recovery", test_recovery),
                  ("a rank that always crashes: given up", test_give_up)), "stepd-serve-", 5000)
    print("stepd serve supervision: all checks passed")


if __name__ == "__main__":
    main()
