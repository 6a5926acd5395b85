#!/usr/bin/env python3
"""test_lint_defects.py - the deploy lint finds every defect of the deployment files that
issue 23 replaced (kept in test/deploy/fixtures/ as shipped before it), and nothing on
today's files: a lint that passed on those is not a check.

Defects of the old deploy/k8s/stepd.yaml: worker probes on grpc.health.v1 on a port no worker
serves health on; multi-rank CUDA groups not marked as needing the NCCL worker; the engine on
loopback while the coordinator is another pod; $(LWS_GROUP_INDEX), which LeaderWorkerSet
does not set; coordinator probes on the TLS port; an image no Containerfile builds.  Of the
old systemd/stepd-worker@.service: a variable ($STEPD_RANK) no environment file defines.
"""
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
LINT = os.path.join(HERE, "lint_deploy.py")

EXPECTED_K8S = [
    # the engine's default port was 50061 when this manifest was written (20061 now): its probes
    # hit a port the worker does not listen on at all
    ("worker probes hit a port without grpc.health.v1", "gRPC probe on port 50061, which /usr/bin/stepd-worker "
                                                         "does not listen on"),
    ("multi-rank CUDA not marked", "4-rank CUDA group"),
    ("engine on loopback, coordinator in another pod", "is loopback, but the coordinator"),
    ("$(LWS_GROUP_INDEX) is not set by LeaderWorkerSet", "refers to $(LWS_GROUP_INDEX)"),
    ("coordinator probes on the TLS port", "a TLS port (kubelet's gRPC probes speak plaintext)"),
    ("image without a Containerfile", "image ghcr.io/example/stepd:0.1.0, which deploy/container/Containerfile"),
    ("metrics off loopback without --insecure-listen", "needs --insecure-listen"),
]
EXPECTED_UNIT = [
    ("ExecStart variable nobody defines", "uses $STEPD_RANK"),
]


def run(args):
    p = subprocess.run([sys.executable, LINT] + args, capture_output=True, text=True, timeout=280)
    return p.returncode, p.stdout + p.stderr


def main():
    failed = 0
    rc, out = run(["--k8s-file", os.path.join(FIX, "k8s-stepd-before-issue23.yaml")])
    for what, needle in EXPECTED_K8S:
        ok = needle in out
        failed += not ok
        print("%s %s" % ("ok  " if ok else "MISS", what))
    if rc == 0:
        print("MISS the lint passed the old manifest")
        failed += 1
    d = tempfile.mkdtemp(prefix="stepd-oldunit-")
    try:
        unit = os.path.join(d, "stepd-worker@.service")
        shutil.copy(os.path.join(FIX, "stepd-worker@.service-before-issue23"), unit)
        rc2, out2 = run(["--unit", unit])
    finally:
        shutil.rmtree(d, True)
    for what, needle in EXPECTED_UNIT:
        ok = needle in out2
        failed += not ok
        print("%s %s" % ("ok  " if ok else "MISS", what))
    if failed:
        print(out[-6000:])
        print(out2[-3000:])
        print("%d defects not found" % failed)
        sys.exit(1)
    print("the lint finds every defect of the replaced files")


if __name__ == "__main__":
    main()
