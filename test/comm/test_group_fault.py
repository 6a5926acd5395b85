#!/usr/bin/env python3
"""test_group_fault.py WORKER MODEL_DIR - failures of a stepd-worker group on the tiny model.

  1. a follower rank SIGKILLed mid-generation (N = 4): every other rank exits by itself
     with status 4 (collective failed); rank 0's in-flight requests end with
     finish=error, not a hang.  The collective deadline is 60 s, so the exit has to come
     from UCX's peer-failure detection; the time from the kill to each exit is printed;
  2. rank 0 SIGKILLed mid-generation (N = 2): the follower, idle-waiting for the next
     step plan without a deadline, exits with status 4;
  3. a rank that never joins (N = 4, rank 3 absent): ranks 0-2 exit with status 3 after
     the rendezvous timeout, with an error naming rank 3;
  4. a rank whose checkpoint fails to load (N = 2): it exits 1, and rank 0 exits 4 at
     once instead of waiting for its collective deadline;
  5. ranks started with different sizes (--max-seqs): every rank refuses to start (exit
     2) with a message naming the rank and the flag;
  6. a follower SIGKILLed while rank 0's engine serves (N = 2): a grpcio client of the
     Engine service (the cluster key in its metadata) has a Generate call and a request on
     an output stream in flight; both end UNAVAILABLE with a message naming the group and
     the lost rank - never status OK with a final of finish_reason ERROR - whichever of the
     step's collectives notices first.
Exit 77 when the model directory is absent."""
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouplib import SKIP, Group, parse_generate  # noqa: E402

EXIT_RENDEZVOUS = 3
EXIT_COMM = 4
HANG_GUARD_S = 30.0     # a rank still alive this long after the fault is a hang


def prompts(tmp, n=4):
    pf = os.path.join(tmp, "prompts.txt")
    with open(pf, "w") as f:
        for i in range(n):
            f.write(",".join(str(10 + i + j) for j in range(12)) + "\n")
    return pf


def fail(msg, g=None):
    if g:
        for r in g.procs:
            msg += "\n--- rank %d stderr ---\n%s" % (r, g.stderr(r))
    sys.exit("FAIL " + msg)


def killed_rank(worker, model, tmp, n, victim):
    out = os.path.join(tmp, "out-kill-%d-%d.txt" % (n, victim))
    g = Group(worker, model, n, "kill%d%d" % (n, victim),
              args=["--collective-timeout", "60000", "--max-model-len", "4096"],
              rank0_args=["--generate", prompts(tmp), "--max-tokens", "100000",
                          "--step-delay", "5", "--output", out],
              workdir=tmp)
    watch = 1 if victim == 0 else 0
    if not g.wait_log(1, "loaded:", 60):
        fail("rank 1 never loaded", g)
    time.sleep(0.5)        # well into generation
    for r, p in g.procs.items():
        if p.poll() is not None:
            fail("rank %d exited before the fault" % r, g)
    t_kill = g.kill(victim)
    rcs = g.wait(timeout=HANG_GUARD_S, t0=t_kill)
    for r, rc in rcs.items():
        if r == victim:
            continue
        if rc is None:
            fail("N=%d: rank %d still running %.0f s after rank %d was killed" %
                 (n, r, HANG_GUARD_S, victim), g)
        if rc != EXIT_COMM:
            fail("N=%d: rank %d exited %s, expected %d" % (n, r, rc, EXIT_COMM), g)
        print("N=%d, rank %d SIGKILLed mid-generation: rank %d exited with status %d after "
              "%.0f ms" % (n, victim, r, rc, g.t_exit[r] * 1000))
    if victim != 0:
        res = parse_generate(open(out).read())
        if not res:
            fail("rank 0 wrote no results", g)
        for i, (fin, ids, msg) in res.items():
            if fin != "error":
                fail("request %d finished %s after the fault, expected error" % (i, fin), g)
        print("  rank 0's %d in-flight requests ended with finish=error (%d..%d tokens out); "
              "message: %s" % (len(res), min(len(v[1]) for v in res.values()),
                               max(len(v[1]) for v in res.values()), res[0][2]))
    else:
        err = g.stderr(watch)
        if "rank 0" not in err:
            fail("follower's error does not name rank 0", g)


def never_joins(worker, model, tmp):
    g = Group(worker, model, 4, "nj", args=["--rendezvous-timeout", "1500"],
              rank0_args=["--generate", prompts(tmp)], workdir=tmp, skip_ranks=(3,))
    t0 = time.monotonic()
    rcs = g.wait(timeout=HANG_GUARD_S, t0=t0)
    for r, rc in rcs.items():
        if rc != EXIT_RENDEZVOUS:
            fail("rank %d exited %s, expected %d" % (r, rc, EXIT_RENDEZVOUS), g)
        err = g.stderr(r)
        if "rank 3 of 4 never joined" not in err:
            fail("rank %d's error does not name the missing rank" % r, g)
    print("rank 3 never joins: ranks 0-2 exit %d after %.0f ms; message: %s" %
          (EXIT_RENDEZVOUS, max(g.t_exit.values()) * 1000,
           g.stderr(0).strip().splitlines()[-1]))


def bad_load(worker, model, tmp):
    g = Group(worker, model, 2, "badload", args=["--collective-timeout", "60000"],
              rank0_args=["--generate", prompts(tmp)],
              rank_env={}, workdir=tmp)
    # rank 1 gets a directory without a checkpoint: restart it that way
    g.procs[1].kill()
    g.procs[1].wait()
    os.makedirs(os.path.join(tmp, "empty-model"), exist_ok=True)
    g2 = Group(worker, os.path.join(tmp, "empty-model"), 2, "badload",
               args=["--collective-timeout", "60000"], workdir=tmp, skip_ranks=(0,))
    g.procs[1] = g2.procs[1]
    g.errs[1] = g2.errs[1]
    t0 = time.monotonic()
    rcs = g.wait(timeout=HANG_GUARD_S, t0=t0)
    if rcs[1] != 1:
        fail("rank 1 with no checkpoint exited %s, expected 1" % rcs[1], g)
    if rcs[0] not in (EXIT_COMM, EXIT_RENDEZVOUS):
        fail("rank 0 exited %s after its peer failed to load" % rcs[0], g)
    print("rank 1 fails to load: it exits 1, rank 0 exits %d after %.0f ms" %
          (rcs[0], g.t_exit[0] * 1000))


def mismatched(worker, model, tmp):
    g = Group(worker, model, 2, "mismatch", rank_env={},
              rank0_args=["--generate", prompts(tmp)], workdir=tmp, skip_ranks=(1,))
    g2 = Group(worker, model, 2, "mismatch", args=["--max-seqs", "4"], workdir=tmp,
               skip_ranks=(0,))
    g.procs[1], g.errs[1] = g2.procs[1], g2.errs[1]
    rcs = g.wait(timeout=HANG_GUARD_S)
    for r in (0, 1):
        if rcs[r] != 2 or "rank 1 runs with --max-seqs 4, rank 0 with 8" not in g.stderr(r):
            fail("mismatched --max-seqs: rank %d exited %s" % (r, rcs[r]), g)
    print("ranks with different --max-seqs: both exit 2: %s" %
          g.stderr(0).strip().splitlines()[-1])


def served_follower_lost(worker, model, tmp):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "daemon"))
    import grpc
    import stepd_harness as h         # the stubs (exits 77 without grpcio)
    pb, pbg = h.pb, h.pbg
    sock = os.path.join(tmp, "served-engine.sock")
    g = Group(worker, model, 2, "served", args=["--collective-timeout", "60000", "--max-model-len", "4096"],
              rank0_args=["--engine-listen", "unix:" + sock], workdir=tmp)
    if not g.wait_log(0, "rank 0 ready", 60):
        fail("rank 0 never served", g)
    md = [("authorization", "Bearer " + g.key)]
    ch = grpc.insecure_channel("unix:" + sock)
    eng = pbg.EngineStub(ch)
    req = lambda rid: pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=[5, 6, 7, 8]),  # noqa: E731
                                         sampling_params=pb.SamplingParams(max_tokens=4000, temperature=0.0))
    outs = eng.OpenOutputs(pb.OpenOutputsRequest(stream_id="fault-stream"), metadata=md, timeout=120)
    next(outs)                                          # the stream is open
    try:
        eng.Submit(pb.SubmitRequest(stream_id="fault-stream", request=req("on-stream")), metadata=md, timeout=10)
    except grpc.RpcError as e:
        fail("Submit on the open stream: %s: %s" % (e.code(), e.details()), g)
    call = eng.Generate(req("on-call"), metadata=md, timeout=120)
    first = next(call)
    if not first.HasField("chunk"):
        fail("Generate: no chunk first: %s" % first, g)
    time.sleep(0.3)
    g.kill(1)
    ends = {}
    try:
        for r in call:
            if r.HasField("final"):
                ends["on-call"] = ("OK", "final finish_reason %s: %s" % (
                    pb.FinishReason.Name(r.final.finish_reason), r.final.message))
        ends.setdefault("on-call", ("OK", "no final"))
    except grpc.RpcError as e:
        ends["on-call"] = (e.code().name, e.details())
    try:
        for b in outs:
            for o in b.outputs:
                if o.request_id != "on-stream":
                    continue
                if o.HasField("final"):
                    ends["on-stream"] = ("OK", "final finish_reason %s: %s" % (
                        pb.FinishReason.Name(o.final.finish_reason), o.final.message))
                elif o.HasField("status"):
                    ends["on-stream"] = (grpc.StatusCode(next(c for c in grpc.StatusCode
                                                              if c.value[0] == o.status.code)).name,
                                         o.status.message)
            if "on-stream" in ends:
                break
    except grpc.RpcError as e:
        ends.setdefault("on-stream", ("stream " + e.code().name, e.details()))
    outs.cancel()
    ch.close()
    for k in ("on-call", "on-stream"):
        code, msg = ends.get(k, ("none", ""))
        if code != "UNAVAILABLE" or "served" not in msg or "rank 1" not in msg:
            fail("%s request after rank 1 was lost: %s %s (expected UNAVAILABLE naming group served and "
                 "rank 1)" % (k, code, msg), g)
    print("rank 1 SIGKILLed under a serving engine: the Generate call and the output-stream request end "
          "UNAVAILABLE: %s" % ends["on-call"][1])
    for r, p in g.procs.items():
        if p.poll() is None:
            p.kill()
        p.wait()


def main():
    worker, model = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(model, "config.json")):
        print("no model at %s: skipped" % model)
        return SKIP
    tmp = tempfile.mkdtemp(prefix="stepd-test-fault-")
    killed_rank(worker, model, tmp, 4, 2)
    killed_rank(worker, model, tmp, 2, 0)
    never_joins(worker, model, tmp)
    bad_load(worker, model, tmp)
    mismatched(worker, model, tmp)
    served_follower_lost(worker, model, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
