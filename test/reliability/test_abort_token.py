#!/usr/bin/env python3
"""test_abort_token.py - Abort ownership a client keeps across connections (issue 41 item 5).

Without an API key a request belongs to the gRPC connection that made it; the stream's first
message carries GenerateResponse.abort_token, and an Abort that lists it reaches the request
from any connection (a client that reconnected). Two connections of their own (no shared
subchannel), stepd with the mock engine (a token every 20 ms):
  - connection B: Abort(ids) alone -> aborted 0, a wrong token -> aborted 0, the stream goes on
  - connection B: Abort(ids, abort_tokens=[A's token]) -> aborted 1, A's stream ends ABORT
  - only the first message carries the token; the Final of a stream that ran out carries none
With an API key the key is the owner: connection B's Abort(ids) with the key -> aborted 1.
"""
import os
import sys
import time

from rellib import h

pb = h.pb
grpc = h.grpc
OWN = [("grpc.use_local_subchannel_pool", 1)]


def two_stubs(addr):
    a = grpc.insecure_channel(addr, options=OWN)
    b = grpc.insecure_channel(addr, options=OWN)
    return a, b, h.pbg.InferenceStub(a), h.pbg.InferenceStub(b)


def test_token_across_connections():
    s = h.Stepd()
    s.start_engine("g0", "--delay-ms", "20", env={"STEPD_CONTROL_KEY": s.control_key})
    s.wait_ready(1, timeout=60)
    a, b, ia, ib = two_stubs(s.addr)
    stream = ia.Generate(h.gen_request([5, 6, 7], 200, request_id="mine-1"), timeout=60)
    first = next(stream)
    token = first.abort_token
    assert first.HasField("chunk") and len(token) == 32, first
    second = next(stream)
    assert second.abort_token == "", "the token is sent in the first message only"
    got_none = ib.Abort(pb.AbortRequest(request_ids=["mine-1"]), timeout=5).aborted
    got_wrong = ib.Abort(pb.AbortRequest(request_ids=["mine-1"], abort_tokens=["0" * 32, token[:31]]),
                         timeout=5).aborted
    assert got_none == 0 and got_wrong == 0, (got_none, got_wrong)
    got = ib.Abort(pb.AbortRequest(request_ids=["mine-1"], abort_tokens=[token]), timeout=5).aborted
    fin = [r.final for r in stream if r.HasField("final")]
    assert got == 1 and fin and fin[0].finish_reason == pb.FINISH_REASON_ABORT, (got, fin)
    # a token is one request's: another request's id with it is not reached
    stream = ia.Generate(h.gen_request([5, 6, 7], 5, request_id="mine-2"), timeout=60)
    msgs = list(stream)
    t2 = msgs[0].abort_token
    assert len(t2) == 32 and t2 != token and all(m.abort_token == "" for m in msgs[1:]), msgs
    a.close()
    b.close()
    assert s.stop() == 0
    print("   another connection: Abort without the token aborted %d, with a wrong one %d, with the "
          "stream's token %d (finish ABORT)" % (got_none, got_wrong, got))


def test_api_key_owner():
    d = os.environ.get("TMPDIR", "/tmp")
    keyf = os.path.join(d, "stepd-test-abort-key-%d" % os.getpid())
    with open(keyf, "w") as f:
        f.write("abort-secret\n")
    os.chmod(keyf, 0o600)
    try:
        s = h.Stepd("--api-key-file", keyf)
        s.start_engine("g0", "--delay-ms", "20", env={"STEPD_CONTROL_KEY": s.control_key})
        md = [("authorization", "Bearer abort-secret")]
        end = time.time() + 60
        while s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=5, metadata=md).groups_ready < 1:
            assert time.time() < end, s.read_log()
            time.sleep(0.05)
        a, b, ia, ib = two_stubs(s.addr)
        stream = ia.Generate(h.gen_request([5, 6, 7], 200, request_id="keyed-1"), timeout=60, metadata=md)
        next(stream)
        got = ib.Abort(pb.AbortRequest(request_ids=["keyed-1"]), timeout=5, metadata=md).aborted
        fin = [r.final for r in stream if r.HasField("final")]
        assert got == 1 and fin and fin[0].finish_reason == pb.FINISH_REASON_ABORT, (got, fin)
        a.close()
        b.close()
        assert s.stop() == 0
        print("   with an API key: another connection's Abort with the key aborted %d" % got)
    finally:
        os.unlink(keyf)


TESTS = [
    ("abort-token-across-connections", test_token_across_connections),
    ("abort-api-key-owner", test_api_key_owner),
]

if __name__ == "__main__":
    h.run_tests(TESTS)
    sys.exit(0)
