#!/usr/bin/env python3
"""fakeworker.py - an impostor worker written from proto/control.proto alone.

It knows nothing of stepd's code or test harness: it compiles proto/control.proto (and
proto/stepd.proto, for rank 0's Engine service) with grpcio-tools into a directory of its
own and speaks the protocol as the .proto files describe it, with or without a key
(`authorization: Bearer KEY`).  One action per run, one JSON object on stdout:

  register ADDR GROUP RANK WORLD [--key K] [--hold S] [--engine-address A]
      open Control/Session(RegisterRequest); report the first event (registered, with its
      session id) or the status the stream ended with; keep the session open S seconds
  churn ADDR N [--key K]
      N registrations of distinct one-rank groups, each closed once Registered came:
      {"registered": n, "codes": {status: count}, "seconds": t}
  report ADDR SESSION_ID... [--key K]
      ReportState(session_id, RANK_STATE_FAILED) for each id in turn, a channel each:
      {"statuses": [status, ...]} in the ids' order (one process for all of them: each run
      of this script compiles the .proto files, ~0.3 s)
  engine ADDR [--key K]
      every stepd.v1.Engine method once (Generate, Submit, OpenOutputs, Abort, GetLoads,
      GetModelInfo): {method: status}

Environment: PROTO_DIR (default: ../../proto next to this file).
"""
import json
import os
import shutil
import socket
import sys
import tempfile
import time

import grpc
from grpc_tools import protoc

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_DIR = os.environ.get("PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))


def load_stubs():
    out = tempfile.mkdtemp(prefix="fakeworker-stubs-")
    inc = ["-I" + PROTO_DIR]
    import grpc_tools
    inc.append("-I" + os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))
    rc = protoc.main(["grpc_tools.protoc", *inc, "--python_out=" + out, "--grpc_python_out=" + out,
                      os.path.join(PROTO_DIR, "control.proto"), os.path.join(PROTO_DIR, "stepd.proto")])
    if rc != 0:
        raise SystemExit("protoc failed on %s" % PROTO_DIR)
    sys.path.insert(0, out)
    import control_pb2
    import control_pb2_grpc
    import stepd_pb2
    import stepd_pb2_grpc
    return out, control_pb2, control_pb2_grpc, stepd_pb2, stepd_pb2_grpc


STUBS, cpb, cpbg, spb, spbg = load_stubs()


def md(key):
    return [("authorization", "Bearer " + key)] if key else None


def code_name(e):
    return e.code().name if isinstance(e, grpc.RpcError) else "OK"


def register(addr, group, rank, world, key=None, hold=0.0, engine_address=None):
    ch = grpc.insecure_channel(addr)
    stub = cpbg.ControlStub(ch)
    req = cpb.RegisterRequest(group=group, rank=rank, world_size=world, device="cpu", pid=os.getpid(),
                              hostname=socket.gethostname()[:60], incarnation=int(time.time() * 1e6))
    if rank == 0:
        req.engine_address = engine_address or "127.0.0.1:1"
    res = {"status": "OK", "details": "", "event": None}
    stream = stub.Session(req, metadata=md(key), timeout=max(10.0, hold + 10.0))
    try:
        ev = next(stream)
        res["event"] = ev.WhichOneof("event")
        if res["event"] == "registered":
            res["session_id"] = ev.registered.session_id
        end = time.time() + hold
        while time.time() < end:
            ev = next(stream)
            if ev.WhichOneof("event") != "heartbeat":
                res.setdefault("later", []).append(ev.WhichOneof("event"))
    except StopIteration:
        pass
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED or res["event"] is None:
            res["status"], res["details"] = code_name(e), e.details()
    stream.cancel()
    ch.close()
    return res


def churn(addr, n, key=None):
    ch = grpc.insecure_channel(addr)
    stub = cpbg.ControlStub(ch)
    codes, ok, t0 = {}, 0, time.time()
    tag = "%x" % (os.getpid() & 0xffff)
    for i in range(n):
        req = cpb.RegisterRequest(group="churn-%s-%d" % (tag, i), rank=0, world_size=1, device="cpu",
                                  engine_address="127.0.0.1:1", pid=os.getpid(), hostname="fake",
                                  incarnation=i + 1)
        stream = stub.Session(req, metadata=md(key), timeout=10)
        try:
            ev = next(stream)
            if ev.WhichOneof("event") == "registered":
                ok += 1
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[code_name(e)] = codes.get(code_name(e), 0) + 1
        stream.cancel()
    ch.close()
    return {"registered": ok, "codes": codes, "seconds": round(time.time() - t0, 2)}


def report(addr, session_id, key=None):
    ch = grpc.insecure_channel(addr)
    try:
        cpbg.ControlStub(ch).ReportState(cpb.StateReport(session_id=session_id, state=cpb.RANK_STATE_FAILED,
                                                         message="forged failure"), metadata=md(key), timeout=5)
        return {"status": "OK"}
    except grpc.RpcError as e:
        return {"status": code_name(e), "details": e.details()}
    finally:
        ch.close()


def engine(addr, key=None):
    ch = grpc.insecure_channel(addr)
    stub = spbg.EngineStub(ch)
    out = {}
    gen = spb.GenerateRequest(request_id="fake-1", token_ids=spb.TokenIds(ids=[1, 2, 3]),
                              sampling_params=spb.SamplingParams(max_tokens=2))

    def call(name, fn):
        try:
            fn()
            out[name] = "OK"
        except grpc.RpcError as e:
            out[name] = code_name(e)
            out[name + ".details"] = e.details()

    call("Generate", lambda: list(stub.Generate(gen, metadata=md(key), timeout=10)))
    call("GetLoads", lambda: stub.GetLoads(spb.GetLoadsRequest(), metadata=md(key), timeout=5))
    call("GetModelInfo", lambda: stub.GetModelInfo(spb.GetModelInfoRequest(), metadata=md(key), timeout=5))
    call("Abort", lambda: stub.Abort(spb.AbortRequest(request_ids=["fake-1"]), metadata=md(key), timeout=5))
    call("Submit", lambda: stub.Submit(spb.SubmitRequest(stream_id="fake-stream", request=gen), metadata=md(key),
                                       timeout=5))

    def outputs():
        s = stub.OpenOutputs(spb.OpenOutputsRequest(stream_id="fake-stream"), metadata=md(key), timeout=5)
        next(s)                         # the first (empty) batch: the stream is open
        s.cancel()
    call("OpenOutputs", outputs)
    ch.close()
    return out


def main(argv):
    args, opts = [], {}
    i = 0
    while i < len(argv):
        if argv[i].startswith("--"):
            opts[argv[i][2:]] = argv[i + 1]
            i += 2
        else:
            args.append(argv[i])
            i += 1
    key = opts.get("key")
    act = args[0]
    if act == "register":
        res = register(args[1], args[2], int(args[3]), int(args[4]), key, float(opts.get("hold", 0)),
                       opts.get("engine-address"))
    elif act == "churn":
        res = churn(args[1], int(args[2]), key)
    elif act == "report":
        res = {"statuses": [report(args[1], sid, key)["status"] for sid in args[2:]]}
    elif act == "engine":
        res = engine(args[1], key)
    else:
        raise SystemExit(__doc__)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    finally:
        shutil.rmtree(STUBS, True)
