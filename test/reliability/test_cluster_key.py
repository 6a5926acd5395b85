"""test_cluster_key.py - a refused cluster key is called a cluster key (issue 41 item 5).

stepd with a cluster key (STEPD_CONTROL_KEY) and an API key: a call to the control port
without the cluster key, or with a wrong one, ends UNAUTHENTICATED "missing or invalid
cluster key", and a mock engine registering with a wrong key logs that; a call to the
public port without the API key still says "API key".
"""
import os
import sys

import grpc

from rellib import h


def details(addr, method, md):
    ch = grpc.insecure_channel(addr)
    try:
        ch.unary_unary(method)(b"", timeout=5, metadata=md)
    except grpc.RpcError as e:
        return e.code(), e.details()
    finally:
        ch.close()
    raise AssertionError("%s answered without a key" % method)


def test_cluster_key():
    d = os.environ.get("TMPDIR", "/tmp")
    keyf = os.path.join(d, "stepd-test-api-key-%d" % os.getpid())
    with open(keyf, "w") as f:
        f.write("api-secret\n")
    os.chmod(keyf, 0o600)
    s = h.Stepd("--api-key-file", keyf, env={"STEPD_CONTROL_KEY": "ctl-secret"})
    try:
        ctl = "127.0.0.1:%d" % s.ports["control"]
        for md in ([], [("authorization", "Bearer wrong")], [("authorization", "Bearer api-secret")]):
            code, msg = details(ctl, "/stepd.ctl.v1.Control/ReportState", md)
            assert code == grpc.StatusCode.UNAUTHENTICATED and msg == "missing or invalid cluster key", (md, code, msg)
        code, msg = details(s.addr, "/stepd.v1.Inference/GetServerInfo", [])
        assert code == grpc.StatusCode.UNAUTHENTICATED and msg == "missing or invalid API key", (code, msg)
        bad = s.start_engine("g0", env={"STEPD_CONTROL_KEY": "wrong"})
        assert bad.proc.wait(10) == 0
        log = open(bad.stats_path.replace(".stats", ".log")).read()
        assert "cluster key" in log and "API key" not in log, log
    finally:
        os.unlink(keyf)
        assert s.stop() == 0


if __name__ == "__main__":
    h.run_tests([("cluster_key", test_cluster_key)])
    sys.exit(0)
