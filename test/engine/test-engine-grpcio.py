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
            assert f.timings.first_token_s > 0 and f.timings.e2e_s >= f.timings.first_token_s
            assert f.group == "g-mock"
            outs.append(toks)
        assert outs[0] == outs[1]

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
        ch.close()
    finally:
        proc.stdin.close()
        rc = proc.wait(timeout=30)
        err = proc.stderr.read()
    sys.stderr.write(err)
    assert rc == 0, f"server exit {rc}"
    assert "invariant ok" in err
    print("engine-grpcio: ok")


if __name__ == "__main__":
    main()
