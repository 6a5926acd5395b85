#!/usr/bin/env python3
"""test_group_netns.py WORKER MODEL_DIR - a worker group split over two "nodes".

Creates two network namespaces joined by a veth pair (10.201.X.1/24 and .2/24), runs
ranks 0..N/2-1 in the first and N/2..N-1 in the second (UCX over TCP on the veth; each
rank's UCX_NET_DEVICES names its own end), and checks:
  * greedy output for N = 2 and N = 4, with MTP K = 0 and K = 3, identical to N = 1
    (run in the default namespace; exact MXFP4 path, see test_group.py);
  * a rank of the second node SIGKILLed mid-generation: every other rank, on both nodes,
    exits with status 4 (the time is printed) and rank 0's requests end with an error.
The namespaces are torn down at the end, whatever happens.  Exit 77 with a message
where namespaces cannot be created (not root, no `ip`, no CAP_NET_ADMIN)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouplib import SKIP, Group, parse_generate  # noqa: E402

EXIT_COMM = 4


class Netns:
    def __init__(self):
        tag = "%d" % (os.getpid() % 100000)
        self.ns = ["stepd-%s-a" % tag, "stepd-%s-b" % tag]
        self.dev = ["sd%sa" % tag, "sd%sb" % tag]
        sub = os.getpid() % 250 + 1
        self.ip = ["10.201.%d.1" % sub, "10.201.%d.2" % sub]
        self.made = []

    def sh(self, *cmd):
        subprocess.run(list(cmd), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def up(self):
        for ns in self.ns:
            self.sh("ip", "netns", "add", ns)
            self.made.append(ns)
        self.sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for i in range(2):
            self.sh("ip", "link", "set", self.dev[i], "netns", self.ns[i])
            self.sh("ip", "-n", self.ns[i], "addr", "add", self.ip[i] + "/24", "dev", self.dev[i])
            self.sh("ip", "-n", self.ns[i], "link", "set", self.dev[i], "up")
            self.sh("ip", "-n", self.ns[i], "link", "set", "lo", "up")

    def down(self):
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        self.made = []


def placement(net, n):
    node = {r: (0 if r < n // 2 else 1) for r in range(n)}
    prefix = {r: ["ip", "netns", "exec", net.ns[node[r]]] for r in range(n)}
    # within a node: shared memory (same host id); between nodes: TCP on the veth (the
    # peer-failure-handling endpoints UCX 1.13 gives only to network transports)
    env = {r: {"UCX_NET_DEVICES": net.dev[node[r]]} for r in range(n)}
    return prefix, env


def write_prompts(tmp):
    pf = os.path.join(tmp, "prompts.txt")
    with open(pf, "w") as f:
        f.write("1,2,3,4,5,6,7,8\n100,200,300\n" + ",".join(str(x) for x in range(30, 110)) + "\n")
    return pf


def generate(worker, model, n, k, tmp, tag, net=None):
    prefix, env = placement(net, n) if net else (None, None)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k, "draft_policy": "fixed"})
    g = Group(worker, model, n, tag, args=["--speculative-config", spec, "--exact"],
              rank0_args=["--generate", write_prompts(tmp), "--max-tokens", "24"],
              prefix=prefix, rank_env=env, workdir=tmp)
    out = g.stdout0()
    rcs = g.wait(timeout=240)
    for r, rc in rcs.items():
        if rc != 0:
            sys.exit("FAIL %s: rank %d exited %s\n%s" % (tag, r, rc, g.stderr(r)))
    return parse_generate(out)


def fault(worker, model, tmp, net):
    n = 4
    prefix, env = placement(net, n)
    out = os.path.join(tmp, "out-fault.txt")
    g = Group(worker, model, n, "nsfault",
              args=["--collective-timeout", "60000", "--max-model-len", "4096"],
              rank0_args=["--generate", write_prompts(tmp), "--max-tokens", "100000",
                          "--step-delay", "5", "--output", out],
              prefix=prefix, rank_env=env, workdir=tmp)
    if not g.wait_log(3, "loaded:", 60):
        sys.exit("FAIL: rank 3 never loaded\n" + g.stderr(3))
    time.sleep(0.5)
    t = g.kill(3)
    rcs = g.wait(timeout=30, t0=t)
    for r in (0, 1, 2):
        if rcs[r] != EXIT_COMM:
            sys.exit("FAIL: after rank 3 (node b) was killed, rank %d exited %s\n%s" %
                     (r, rcs[r], g.stderr(r)))
        print("two nodes, N=4: rank 3 (node b) SIGKILLed: rank %d (node %s) exited %d after "
              "%.0f ms" % (r, "a" if r < 2 else "b", rcs[r], g.t_exit[r] * 1000))
    res = parse_generate(open(out).read())
    if not res or any(v[0] != "error" for v in res.values()):
        sys.exit("FAIL: rank 0's requests did not end with an error: %s" % res)
    print("  rank 0's %d requests ended with finish=error" % len(res))


def main():
    worker, model = sys.argv[1], sys.argv[2]
    if not os.path.exists(os.path.join(model, "config.json")):
        print("no model at %s: skipped" % model)
        return SKIP
    if os.geteuid() != 0 or not shutil.which("ip"):
        print("network namespaces need root and iproute2 (`ip`): skipped")
        return SKIP
    net = Netns()
    try:
        try:
            net.up()
        except (subprocess.CalledProcessError, OSError) as e:
            msg = e.stderr.decode().strip() if getattr(e, "stderr", None) else str(e)
            print("cannot create network namespaces (%s): skipped" % msg)
            return SKIP
        tmp = tempfile.mkdtemp(prefix="stepd-test-netns-")
        for k in (0, 3):
            ref = generate(worker, model, 1, k, tmp, "ref%d" % k)
            for n in (2, 4):
                res = generate(worker, model, n, k, tmp, "ns%d%d" % (n, k), net)
                if len(res) != len(ref):
                    sys.exit("FAIL N=%d K=%d: %d results, expected %d" % (n, k, len(res), len(ref)))
                for i in ref:
                    if res[i][1] != ref[i][1]:
                        sys.exit("FAIL N=%d K=%d over two namespaces: request %d differs from N=1"
                                 "\n %s\n %s" % (n, k, i, res[i][1], ref[i][1]))
                print("two nodes (netns %s | %s, UCX over TCP on veth): N=%d K=%d greedy output "
                      "identical to N=1" % (net.ns[0], net.ns[1], n, k))
        fault(worker, model, tmp, net)
    finally:
        net.down()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    if any(ns in left for ns in net.ns):
        sys.exit("FAIL: namespaces left behind: " + left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
