#!/usr/bin/env python3
"""test-engine-grpcio.py - the engine service as seen by a real grpcio client.

Stubs are generated at run time from proto/stepd.proto with grpc_tools.  Checks:
Generate streams chunks of token ids then exactly one Final (usage == streamed count,
MTP stats with one entry per draft position, timings); greedy requests are
reproducible; seeded sampled requests are reproducible; text input is
INVALID_ARGUMENT naming token_ids; Abort ends a stream with finish reason ABORT; a
client-side cancel and a deadline are handled; GetLoads reports one group;
GetModelInfo reports the vocab; overload is RESOURCE_EXHAUSTED with a
grpc-retry-pushback-ms trailer; the server exits with the KV invariant intact.

Output streams (OpenOutputs + Submit): mixed greedy requests give the same token ids,
finish reasons and usage as Generate, and batches carry outputs of several requests;
continuous usage rides on chunks; Submit validates request_id, request and stream_id
(FAILED_PRECONDITION for an unknown stream), OpenOutputs stream_id (INVALID_ARGUMENT,
ALREADY_EXISTS); Abort ends a request with a Final ABORT on its stream; a short Submit
deadline ends it with status DEADLINE_EXCEEDED; cancelling the stream aborts its
requests (GetLoads idle, KV blocks free) and frees its id; server shutdown ends an open
stream with UNAVAILABLE; a stream whose client stops reading ends RESOURCE_EXHAUSTED once
its queued bytes pass the cap, and its requests are aborted.

usage: test-engine-grpcio.py SERVER_BINARY PROTO_DIR   (exit 77 when grpcio is missing)
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

try:
    import grpc
    from grpc_tools import protoc
except ImportError:
    print("SKIP: grpcio / grpcio-tools not installed")
    sys.exit(77)


def gen_stubs(proto_dir, out):
    rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={out}",
                      f"--grpc_python_out={out}", os.path.join(proto_dir, "stepd.proto")])
    if rc != 0:
        raise SystemExit(f"protoc failed ({rc})")
    sys.path.insert(0, out)


class OutputReader:
    """One OpenOutputs stream read on a thread: outputs per request id, in order."""

    def __init__(self, stub, pb, stream_id):
        self.call = stub.OpenOutputs(pb.OpenOutputsRequest(stream_id=stream_id))
        ack = next(self.call)
        assert len(ack.outputs) == 0, ack
        self.cv = threading.Condition()
        self.outs = {}          # request id -> [EngineOutput]
        self.batches = []       # request ids of each batch
        self.error = None
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            for b in self.call:
                with self.cv:
                    self.batches.append([o.request_id for o in b.outputs])
                    for o in b.outputs:
                        self.outs.setdefault(o.request_id, []).append(o)
                    self.cv.notify_all()
        except grpc.RpcError as e:
            self.error = e
        with self.cv:
            self.done = True
            self.cv.notify_all()

    def wait(self, pred, timeout=20):
        with self.cv:
            assert self.cv.wait_for(pred, timeout), "output stream: timed out"

    def ended(self, rid):
        o = self.outs.get(rid)
        return bool(o) and o[-1].WhichOneof("kind") in ("final", "status")

    def result(self, rid):
        """(token ids, the ending EngineOutput); checks nothing follows the end."""
        self.wait(lambda: self.ended(rid))
        outs = self.outs[rid]
        assert all(o.WhichOneof("kind") == "chunk" for o in outs[:-1]), outs
        return [t for o in outs[:-1] for t in o.chunk.token_ids], outs[-1]


def wait_engine_idle(stub, pb, what):
    """Within 5 s: nothing running, waiting or alive, every KV block free."""
    for _ in range(500):
        ld = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        if (ld.num_running, ld.num_waiting, ld.num_requests_alive, ld.kv_blocks_used) == (0, 0, 0, 0):
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} still alive: {ld}")


def expect_error(fn, code, words=()):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, e
        for w in words:
            assert w in e.details(), e.details()
        return e
    raise AssertionError(f"no {code}")


def check_output_streams(stub, pb, gen):
    long_req = dict(temperature=1.0, max_tokens=450, ignore_eos=True)
    rd = OutputReader(stub, pb, "s1")

    # mixed greedy requests: exactly Generate's outputs, batched
    specs = [([1, 2, 3, 4], 40), ([5, 6, 7], 7), ([9, 8, 7, 6, 5], 64), ([2, 2], 64),
             ([11, 12, 13], 1), ([4, 3, 2, 1], 33), ([7], 50), ([3, 1, 4, 1, 5], 60)]
    ref = []
    for i, (p, n) in enumerate(specs):
        toks, fin = [], None
        for m in stub.Generate(gen(f"ref{i}", p, temperature=0.0, max_tokens=n)):
            if m.HasField("chunk"):
                toks.extend(m.chunk.token_ids)
            else:
                fin = m.final
        ref.append((toks, fin))
    futs = []
    for i, (p, n) in enumerate(specs):
        req = gen(f"m{i}", p, temperature=0.0, max_tokens=n)
        if i == 2:
            req.stream_options.continuous_usage_stats = True
        futs.append(stub.Submit.future(pb.SubmitRequest(stream_id="s1", request=req)))
    for f in futs:
        assert isinstance(f.result(timeout=20), pb.SubmitResponse)
    for i in range(len(specs)):
        toks, end = rd.result(f"m{i}")
        assert end.WhichOneof("kind") == "final", end
        f, (rtoks, rf) = end.final, ref[i]
        assert toks == rtoks, (i, toks, rtoks)
        assert f.finish_reason == rf.finish_reason and f.request_id == f"m{i}", (f, rf)
        assert f.usage.completion_tokens == len(toks) and f.usage.prompt_tokens == len(specs[i][0])
        assert f.stop_token_id == rf.stop_token_id and f.group == "g-mock"
        assert len(f.mtp.accepted_per_position) == 3 and f.timings.e2e_s > 0
    reasons = {ref[i][1].finish_reason for i in range(len(specs))}
    assert pb.FINISH_REASON_LENGTH in reasons, reasons
    n = 0
    for o in rd.outs["m2"][:-1]:
        n += len(o.chunk.token_ids)
        assert o.chunk.HasField("usage") and o.chunk.usage.completion_tokens == n
    assert not rd.outs["m0"][0].chunk.HasField("usage")
    assert any(len(set(b)) > 1 for b in rd.batches), "no batch carries several requests"
    n_out = sum(len(o) for o in rd.outs.values())
    assert len(rd.batches) < n_out, (len(rd.batches), n_out)

    # Submit and OpenOutputs validation
    ok_req = gen("v1", [1, 2], temperature=0.0, max_tokens=4)
    expect_error(lambda: stub.Submit(pb.SubmitRequest(stream_id="nope", request=ok_req)),
                 grpc.StatusCode.FAILED_PRECONDITION, ["stream_id", "nope"])
    expect_error(lambda: stub.Submit(pb.SubmitRequest(stream_id="s1", request=gen("", [1, 2]))),
                 grpc.StatusCode.INVALID_ARGUMENT, ["request.request_id"])
    expect_error(lambda: stub.Submit(pb.SubmitRequest(stream_id="s1")),
                 grpc.StatusCode.INVALID_ARGUMENT, ["request"])
    expect_error(lambda: stub.Submit(pb.SubmitRequest(
                     stream_id="s1", request=pb.GenerateRequest(request_id="tx", text="hi"))),
                 grpc.StatusCode.INVALID_ARGUMENT, ["request.input", "token_ids"])
    expect_error(lambda: next(stub.OpenOutputs(pb.OpenOutputsRequest(stream_id=""))),
                 grpc.StatusCode.INVALID_ARGUMENT, ["stream_id"])
    expect_error(lambda: next(stub.OpenOutputs(pb.OpenOutputsRequest(stream_id="x" * 129))),
                 grpc.StatusCode.INVALID_ARGUMENT, ["stream_id"])
    OutputReader(stub, pb, "y" * 128).call.cancel()
    expect_error(lambda: next(stub.OpenOutputs(pb.OpenOutputsRequest(stream_id="s1"))),
                 grpc.StatusCode.ALREADY_EXISTS, ["stream_id"])

    # Abort mid-stream: a Final ABORT on the stream; a duplicate id is ALREADY_EXISTS
    stub.Submit(pb.SubmitRequest(stream_id="s1", request=gen("ab", [9, 9], **long_req)))
    rd.wait(lambda: "ab" in rd.outs)
    expect_error(lambda: stub.Submit(pb.SubmitRequest(stream_id="s1",
                                                      request=gen("ab", [9, 9], **long_req))),
                 grpc.StatusCode.ALREADY_EXISTS, ["request.request_id"])
    assert stub.Abort(pb.AbortRequest(request_ids=["ab"])).aborted == 1
    toks, end = rd.result("ab")
    assert end.WhichOneof("kind") == "final", end
    assert end.final.finish_reason == pb.FINISH_REASON_ABORT and len(toks) < 450

    # the Submit call's deadline is the request's.  480 tokens cannot end sooner than 120
    # steps (at most 1 + 3 drafts a step) of the mock's 300 us each, slept on the real
    # clock: 36 ms, however fast the host (56-91 ms measured).  So every try's deadline
    # stays at 30 ms, below that floor; a longer one would let the request finish first
    # (60 ms: 14 of 20 finished), making the outcome the host's speed.
    for attempt in range(20):
        rid = f"dl{attempt}"
        try:
            stub.Submit(pb.SubmitRequest(stream_id="s1", request=gen(rid, [4, 4], temperature=1.0,
                                                                     max_tokens=480,
                                                                     ignore_eos=True)),
                        timeout=0.03)
            break
        except grpc.RpcError as e:     # the Submit itself was too slow (a loaded host): again
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
            rd.wait(lambda: rid not in rd.outs or rd.ended(rid))
    toks, end = rd.result(rid)
    assert end.WhichOneof("kind") == "status", end
    assert end.status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], end
    assert len(toks) < 480

    # cancelling the stream aborts its requests and frees the id
    rc = OutputReader(stub, pb, "s2")
    for i in range(4):
        stub.Submit(pb.SubmitRequest(stream_id="s2", request=gen(f"x{i}", [3, 3], **long_req)))
    rc.wait(lambda: all(f"x{i}" in rc.outs for i in range(4)))
    rc.call.cancel()
    rc.thread.join(20)
    assert rc.error is not None and rc.error.code() == grpc.StatusCode.CANCELLED, rc.error
    wait_engine_idle(stub, pb, "requests of a cancelled stream")
    assert not any(rd.ended(f"x{i}") or f"x{i}" in rd.outs for i in range(4))
    expect_error(lambda: stub.Submit(pb.SubmitRequest(stream_id="s2", request=ok_req)),
                 grpc.StatusCode.FAILED_PRECONDITION, ["s2"])
    OutputReader(stub, pb, "s2").call.cancel()
    return rd


def check_unread_stream(server, pb, pbg):
    """An output stream whose client stops reading: once its queued bytes pass the cap
    (--output-stream-buffer, 64 KiB here; 64 MiB in stepd-worker) the engine ends it
    RESOURCE_EXHAUSTED naming the cause and aborts its requests; Submit to it is then
    FAILED_PRECONDITION, and the engine ends idle with every KV block free."""
    proc = subprocess.Popen([server, "--output-stream-buffer", "65536"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        # without BDP probing the client's window stays at 64 KiB (with it, grpcio takes in
        # megabytes its reader never asked for, and the cap is reached ~15 s later)
        ch = grpc.insecure_channel(f"127.0.0.1:{int(line.split()[1])}", options=[("grpc.http2.bdp_probe", 0)])
        stub = pbg.EngineStub(ch)
        call = stub.OpenOutputs(pb.OpenOutputsRequest(stream_id="u1"))
        assert len(next(call).outputs) == 0          # registered; nothing is read from here on
        sp = pb.SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
        submitted, ended, t0 = 0, None, time.time()
        while ended is None and time.time() - t0 < 60:
            req = pb.GenerateRequest(request_id=f"u{submitted}", token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                     sampling_params=sp)
            try:
                stub.Submit(pb.SubmitRequest(stream_id="u1", request=req), timeout=10)
                submitted += 1
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:     # the waiting queue is full
                    time.sleep(0.005)
                elif e.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the stream is gone
                    ended = e
                else:
                    raise
        assert ended is not None, f"stream not ended after {submitted} unread requests"
        assert "u1" in ended.details(), ended.details()
        t_end = time.time() - t0
        # reading again: what the transport had taken in, then the status and its cause
        n = 0
        try:
            for _ in call:
                n += 1
            raise AssertionError("unread stream ended OK")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            assert "not reading" in e.details(), e.details()
        wait_engine_idle(stub, pb, "requests of the ended stream")
        print(f"engine-grpcio: unread output stream ended RESOURCE_EXHAUSTED after {submitted} requests"
              f" ({t_end:.1f} s; {n} batches were still in the client's buffers)")
        ch.close()
    finally:
        proc.stdin.close()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    assert rc == 0, f"server exit {rc}: {err}"
    assert "invariant ok" in err, err


def main():
    server, proto_dir = sys.argv[1], sys.argv[2]
    tmp = tempfile.mkdtemp()
    gen_stubs(proto_dir, tmp)
    import stepd_pb2 as pb
    import stepd_pb2_grpc as pbg

    proc = subprocess.Popen([server], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        port = int(line.split()[1])
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pbg.EngineStub(ch)

        def gen(rid, ids, **sp):
            req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=ids),
                                     sampling_params=pb.SamplingParams(**sp))
            return req

        # greedy: chunks then one Final; reproducible
        outs = []
        for rid in ("a", "b"):
            toks, finals = [], []
            for msg in stub.Generate(gen(rid, [1, 2, 3, 4], temperature=0.0, max_tokens=40,
                                         ignore_eos=True)):
                assert msg.request_id == rid
                if msg.HasField("chunk"):
                    assert not finals, "chunk after final"
                    toks.extend(msg.chunk.token_ids)
                else:
                    finals.append(msg.final)
            assert len(finals) == 1
            f = finals[0]
            assert f.finish_reason == pb.FINISH_REASON_LENGTH, f
            assert f.usage.prompt_tokens == 4 and f.usage.completion_tokens == len(toks) == 40
            assert f.mtp.num_draft_tokens > 0 and len(f.mtp.accepted_per_position) == 3
            # decode steps by drafts verified: every verify step, with drafts or without
            assert len(f.mtp.steps_by_num_drafts) == 4, f.mtp
            assert sum(f.mtp.steps_by_num_drafts[1:]) == f.mtp.num_drafts, f.mtp
            assert sum(k * n for k, n in enumerate(f.mtp.steps_by_num_drafts)) == \
                f.mtp.num_draft_tokens, f.mtp
            assert f.timings.first_token_s > 0 and f.timings.e2e_s >= f.timings.first_token_s
            assert f.group == "g-mock"
            outs.append(toks)
        assert outs[0] == outs[1]

        # images (issue 40): decoded and checked, then refused by an engine without an encoder
        def img_req(rid, sha=b"\x01" * 32, w=2, h=2, rgb=None, toks=(7, 7), at=1, data=b""):
            r = gen(rid, [1, 7, 7, 2], max_tokens=4)
            r.images.append(pb.ImageInput(sha256=sha, token_ids=list(toks), token_position=at, data=data,
                                          views=[pb.ImageView(width=w, height=h,
                                                              rgb=rgb if rgb is not None else bytes(w * h * 3))]))
            return r
        INV = grpc.StatusCode.INVALID_ARGUMENT
        for rid, req, words in (
                ("i1", img_req("i1"), ("images: this model has no vision encoder",)),
                ("i2", img_req("i2", sha=b"x" * 31), ("images[0].sha256: 31 bytes",)),
                ("i3", img_req("i3", rgb=b"x" * 11), ("images[0].views[0]: 2x2 with 11 rgb bytes",)),
                ("i4", img_req("i4", at=2), ("images[0].token_ids: not the prompt's tokens at position 2",)),
                # encoded bytes are the public door's (the coordinator decodes them): never ignored here
                ("i5", img_req("i5", data=b"\x89PNG"), ("images[0].data: the engine service takes preprocessed",))):
            expect_error(lambda: list(stub.Generate(req)), INV, words)
        ld = stub.GetLoads(pb.GetLoadsRequest()).loads[0]
        assert ld.image_encodes == 0 and ld.image_cache_hits == 0, ld  # refused: nothing encoded

        # seeded sampling is reproducible, different seeds differ
        def sampled(seed):
            return [t for m in stub.Generate(gen(f"s{seed}-{time.time_ns()}", [5, 6, 7],
                                                 temperature=1.0, seed=seed, max_tokens=30,
                                                 ignore_eos=True))
                    if m.HasField("chunk") for t in m.chunk.token_ids]
        assert sampled(11) == sampled(11)
        assert sampled(11) != sampled(12)

        # text input is refused, naming the field
        try:
            list(stub.Generate(pb.GenerateRequest(request_id="t", text="hello")))
            raise AssertionError("text accepted")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert "token_ids" in e.details()

        # Abort by id
        it = stub.Generate(gen("long", [9, 9], temperature=1.0, max_tokens=450, ignore_eos=True))
        first = next(it)
        assert first.HasField("chunk")
        assert stub.Abort(pb.AbortRequest(request_ids=["long", "nope"])).aborted == 1
        final = [m.final for m in it if m.HasField("final")]
        assert final and final[0].finish_reason == pb.FINISH_REASON_ABORT

        # client cancel, and a deadline shorter than the generation
        it = stub.Generate(gen("cancel", [3, 3], temperature=1.0, max_tokens=450, ignore_eos=True))
        next(it)
        it.cancel()
        try:
            list(stub.Generate(gen("dl", [4, 4], temperature=1.0, max_tokens=450,
                                   ignore_eos=True), timeout=0.01))
            raise AssertionError("deadline not enforced")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e

        # concurrent streams from threads
        res = {}

        def worker(i):
            res[i] = [t for m in stub.Generate(gen(f"c{i}", [1, 2, 3, 4], temperature=0.0,
                                                   max_tokens=40, ignore_eos=True))
                      if m.HasField("chunk") for t in m.chunk.token_ids]
        th = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in th:
            t.start()
        for t in th:
            t.join()
        assert all(res[i] == outs[0] for i in range(8)), "batched output differs from solo"

        # overload: 8 running + 8 waiting fit; the rest are RESOURCE_EXHAUSTED with a
        # retry pushback trailer
        its = [stub.Generate(gen(f"o{i}", [1, 2], temperature=1.0, max_tokens=450,
                                 ignore_eos=True)) for i in range(24)]
        exhausted, live = 0, []
        for it in its:
            try:
                next(it)
                live.append(it)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                md = dict(e.trailing_metadata() or ())
                assert md.get("grpc-retry-pushback-ms") == "100", md
                exhausted += 1
        assert exhausted >= 24 - 16, exhausted
        stub.Abort(pb.AbortRequest(request_ids=[f"o{i}" for i in range(24)]))
        for it in live:
            fin = [m.final for m in it if m.HasField("final")]
            # queued ones only stream once earlier ones finish, so some end by length
            assert fin and fin[0].finish_reason in (pb.FINISH_REASON_ABORT,
                                                    pb.FINISH_REASON_LENGTH), fin

        loads = stub.GetLoads(pb.GetLoadsRequest())
        assert len(loads.loads) == 1 and loads.loads[0].group == "g-mock"
        assert loads.loads[0].kv_blocks_total > 0
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert info.vocab_size == 256 and info.max_model_len == 512
        assert not info.supports_text

        rd = check_output_streams(stub, pb, gen)
        # the server stops with the stream open and a request in flight: UNAVAILABLE
        stub.Submit(pb.SubmitRequest(stream_id="s1", request=gen("last", [5, 5], temperature=1.0,
                                                                 max_tokens=450, ignore_eos=True)))
        rd.wait(lambda: "last" in rd.outs)
        proc.stdin.close()
        rd.thread.join(20)
        assert rd.done and rd.error is not None, "stream not ended by the shutdown"
        assert rd.error.code() == grpc.StatusCode.UNAVAILABLE, rd.error
        ch.close()
    finally:
        proc.stdin.close()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    sys.stderr.write(err)
    assert rc == 0, f"server exit {rc}"
    assert "invariant ok" in err
    check_unread_stream(server, pb, pbg)
    print("engine-grpcio: ok")


if __name__ == "__main__":
    main()
