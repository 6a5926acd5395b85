#!/usr/bin/env python3
"""E1/E2: listen audit with `ss` inside a private network namespace.

The script re-runs itself under `unshare -n` (skip 77 when that is not permitted), brings
up lo and a veth pair with a non-loopback address (10.99.0.1), then starts, with DEFAULT
listen flags (and nothing set for UCX: no UCX_NET_DEVICES, no UCX_TLS; STEPD_UCX_SHM=0
puts the group on UCX's TCP transport, whose listeners are the ones at stake) and the
cluster key every process needs: `stepd`, a 2-rank group (UCX between the ranks) and a
1-rank `stepd-worker` on the tiny model (engine on another loopback port).  Once the
groups are ready, `ss -ltnpH` / `ss -lunpH` must show every listening TCP/UDP socket of
these processes on 127.0.0.1 / ::ffff:127.0.0.1 / ::1 only - none on 0.0.0.0, ::, * or
10.99.0.1 - and the default ports (stepd's, the engine's) outside Linux's ephemeral range
32768-60999.  Listening unix sockets are listed (printed).  Also: stepd refuses each
non-loopback --listen/--admin-listen/--control-listen/--host without TLS + key (exit != 0,
message naming the address).

E2 part (argument `engine-any`): stepd-worker --engine-listen on a non-loopback address
without the cluster key must refuse to start (without --insecure-listen); with the key it
serves, and a caller without the key gets UNAUTHENTICATED: it never serves the
unauthenticated stepd.v1.Engine there.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import rellib
from rellib import h

pb = h.pb
OURS = ("stepd", "stepd-worker")
NONLOOP = "10.99.0.1"


def reexec_in_netns():
    if os.environ.get("REL_IN_NETNS") == "1":
        return
    if not shutil.which("unshare") or not shutil.which("ss") or not shutil.which("ip"):
        print("SKIP: needs unshare, ip and ss (util-linux, iproute2)")
        sys.exit(77)
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        print("SKIP: unshare -n not permitted here: %s" % probe.stderr.decode().strip())
        sys.exit(77)
    env = dict(os.environ, REL_IN_NETNS="1")
    os.execvpe("unshare", ["unshare", "-n", "--", sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)


def setup_links():
    for cmd in (["ip", "link", "set", "lo", "up"],
                ["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                ["ip", "addr", "add", NONLOOP + "/24", "dev", "v0"],
                ["ip", "link", "set", "v0", "up"], ["ip", "link", "set", "v1", "up"]):
        subprocess.run(cmd, check=True, capture_output=True)


def listening(kind):
    out = subprocess.run(["ss", kind, "-H"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.search(r'users:\(\("([^"]+)",pid=(\d+)', line)
        if not m or m.group(1) not in OURS:
            continue
        cols = line.split()
        local = cols[3] if kind != "-lxpH" else cols[4]
        rows.append((m.group(1), int(m.group(2)), local))
    return rows


def is_loopback(local):
    host = local.rsplit(":", 1)[0]
    return host in ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]") or host.startswith("127.")


def start(cmd, log, env=None):
    p = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    h._procs.append(p)
    return p


def wait_groups(stub, n, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            if stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=1).groups_ready >= n:
                return
        except h.grpc.RpcError:
            pass
        time.sleep(0.05)
    raise AssertionError("groups not ready")


def test_defaults():
    wd = os.environ.get("TMPDIR", "/tmp")
    import tempfile
    wd = tempfile.mkdtemp(prefix="rel-e1-")
    key = os.path.join(wd, "control-key")
    h.write_key(key)
    s = start([h.STEPD_BIN, "--heartbeat-ms", "200", "--control-key-file", key], os.path.join(wd, "stepd.log"))
    env = dict(os.environ)
    env.pop("UCX_NET_DEVICES", None)          # defaults: nothing set for UCX either
    env.pop("UCX_TLS", None)
    env["STEPD_UCX_SHM"] = "0"                # the group on UCX's TCP transport (its listeners)
    procs = [s]
    time.sleep(0.3)
    have_model = os.path.exists(os.path.join(rellib.MODEL_DIR, "config.json"))
    # every group under one coordinator must serve the same model (stepd refuses a mismatch)
    what = ["--model", rellib.MODEL_DIR] if have_model else ["--mock"]
    for r in range(2):
        procs.append(start([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:20052", "--group", "tp2", "--rank",
                            str(r), "--world-size", "2", *what, "--threads", "1", "--control-key-file", key],
                           os.path.join(wd, "tp2-%d.log" % r), env))
    if have_model:
        procs.append(start([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:20052", "--group", "tiny", "--rank", "0",
                            "--world-size", "1", "--threads", "1", "--model", rellib.MODEL_DIR,
                            "--engine-listen", "127.0.0.1:20062", "--control-key-file", key],
                           os.path.join(wd, "tiny.log"), env))
    ch = h.grpc.insecure_channel("127.0.0.1:20051")
    stub = h.pbg.InferenceStub(ch)
    wait_groups(stub, 2 if have_model else 1)
    tcp, udp, unx = listening("-ltnpH"), listening("-lunpH"), listening("-lxpH")
    pids = {p.pid for p in procs}
    for name, pid, local in tcp + udp:
        print("   %-6s %-13s pid %-7d %s" % ("tcp" if (name, pid, local) in tcp else "udp", name, pid, local))
    for name, pid, local in unx:
        print("   unix   %-13s pid %-7d %s" % (name, pid, local))
    seen = {pid for _, pid, _ in tcp}
    assert s.pid in seen and procs[1].pid in seen, "ss did not show our listeners: %s" % tcp
    bad = [(n, pid, l) for n, pid, l in tcp + udp if pid in pids and not is_loopback(l)]
    assert not bad, "non-loopback listeners with default flags: %s" % bad
    ports = sorted(int(l.rsplit(":", 1)[1]) for n, pid, l in tcp if pid == s.pid)
    assert ports == [8000, 9464, 20051, 20052, 20053], ports     # the OpenAI HTTP API on 8000
    eports = {int(l.rsplit(":", 1)[1]) for n, pid, l in tcp if pid == procs[1].pid}
    assert 20061 in eports, "rank 0's engine is not on its default port 20061: %s" % sorted(eports)
    ucx = sorted((pid, l) for n, pid, l in tcp if pid in (procs[1].pid, procs[2].pid) and
                 int(l.rsplit(":", 1)[1]) != 20061)
    assert ucx, "no UCX TCP listener of the 2-rank group seen (STEPD_UCX_SHM=0): %s" % tcp
    inside = [p for p in ports + [20061] if 32768 <= p <= 60999]
    assert not inside, "default ports inside the ephemeral range 32768-60999: %s" % inside
    print("   default ports %s and the engine's 20061, outside 32768-60999; the group's UCX TCP listeners: %s"
          % (ports, ", ".join(l for _, l in ucx)))
    print("   %d TCP + %d UDP listeners of stepd/stepd-worker, all loopback; %d unix sockets" %
          (len(tcp), len(udp), len(unx)))
    ch.close()
    s.terminate()
    assert s.wait(30) == 0
    for p in procs[1:]:
        assert p.wait(30) is not None
    shutil.rmtree(wd, True)


def test_refusals():
    for flag in ("--listen", "--admin-listen", "--control-listen"):
        for addr in (NONLOOP + ":0", "0.0.0.0:0", "[::]:0"):
            args = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0",
                    "--metrics-listen", ""]
            args[args.index(flag) + 1] = addr
            e = dict(os.environ)
            e.pop("STEPD_API_KEY", None)
            e.pop("STEPD_CONTROL_KEY", None)
            p = subprocess.run([h.STEPD_BIN, *args], capture_output=True, text=True, timeout=10, env=e)
            assert p.returncode != 0 and "refusing" in p.stderr and addr in p.stderr, (flag, addr, p.returncode,
                                                                                   p.stderr)
    # the OpenAI HTTP API: the same rule for --host
    for host in (NONLOOP, "0.0.0.0", "::"):
        e = dict(os.environ)
        e.pop("STEPD_API_KEY", None)
        p = subprocess.run([h.STEPD_BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--control-listen",
                            "127.0.0.1:0", "--metrics-listen", "", "--host", host, "--port", "0"],
                           capture_output=True, text=True, timeout=10, env=e)
        assert p.returncode != 0 and "refusing to serve HTTP on non-loopback " + host in p.stderr, (host, p.stderr)
    print("   stepd refused 12 non-loopback listens (public/admin/control/HTTP x 10.99.0.1, 0.0.0.0, [::])")


def engine_loads(addr, md=None):
    ch = h.grpc.insecure_channel(addr)
    try:
        h.pbg.EngineStub(ch).GetLoads(pb.GetLoadsRequest(), timeout=3, metadata=md)
        return h.grpc.StatusCode.OK
    except h.grpc.RpcError as e:
        return e.code()
    finally:
        ch.close()


def test_engine_any():
    """The worker's Engine service off loopback: refused without the key, authenticated with it."""
    import tempfile
    wd = tempfile.mkdtemp(prefix="rel-e2-")
    key_file = os.path.join(wd, "control-key")
    key = h.write_key(key_file)
    s = start([h.STEPD_BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--control-listen",
               "127.0.0.1:20052", "--metrics-listen", "", "--control-key-file", key_file],
              os.path.join(wd, "stepd.log"))
    time.sleep(0.3)
    results = {}
    for name, extra in (("no key", ["--insecure-control"]), ("key", ["--control-key-file", key_file])):
        w = start([rellib.WORKER_BIN, "--coordinator", "127.0.0.1:20052", "--group", "g", "--rank", "0",
                   "--world-size", "1", "--mock", "--engine-listen", NONLOOP + ":20061", *extra],
                  os.path.join(wd, "w.log"))
        try:
            w.wait(3)   # a refusal ends it at once (no key: no 3-s sleep); a serving worker runs on
        except subprocess.TimeoutExpired:
            pass
        refused = w.poll() is not None and w.returncode != 0
        codes = None
        if not refused:
            codes = (engine_loads(NONLOOP + ":20061"), engine_loads(NONLOOP + ":20061", [("authorization",
                                                                                           "Bearer " + key)]))
        print("   worker --engine-listen %s:20061 (%s): refused=%s, GetLoads from outside without/with the "
              "key -> %s" % (NONLOOP, name, refused, codes))
        results[name] = (refused, codes)
        if w.poll() is None:
            w.terminate()
        w.wait(30)
    s.terminate()
    s.wait(30)
    assert results["no key"][0], "stepd-worker serves the unauthenticated Engine on non-loopback %s: %s" % (
        NONLOOP, results["no key"])
    assert results["key"] == (False, (h.grpc.StatusCode.UNAUTHENTICATED, h.grpc.StatusCode.OK)), results["key"]


def main():
    reexec_in_netns()
    setup_links()
    rellib.need_worker()
    if sys.argv[1:] == ["engine-any"]:
        h.run_tests([("e2-worker-engine-listen-refused", test_engine_any)])
    h.run_tests([("e1-default-listen-loopback-only", test_defaults), ("e1-nonloopback-refused", test_refusals)])


if __name__ == "__main__":
    main()
