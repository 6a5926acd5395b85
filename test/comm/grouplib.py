"""grouplib.py - start a stepd-worker group on this machine for the integration tests.

Every rank is a real stepd-worker process; they meet through a file rendezvous in a
temporary directory (or through the coordinator when one is given).  Optional
per-rank command prefixes (e.g. `ip netns exec NS`) place ranks in network namespaces.
"""
import json
import os
import signal
import subprocess
import tempfile
import time

SKIP = 77


class Group:
    def __init__(self, worker, model, n, group, args=(), rank0_args=(), env=None, prefix=None,
                 rank_env=None, workdir=None, skip_ranks=()):
        self.n = n
        self.dir = workdir or tempfile.mkdtemp(prefix="stepd-group-")
        self.rdv = os.path.join(self.dir, "rdv-" + group)
        os.makedirs(self.rdv, exist_ok=True)
        self.procs = {}
        self.t_exit = {}
        self.errs = {}
        # the cluster key every rank needs to serve (rank 0's engine requires it of callers)
        self.key_file = os.path.join(self.dir, "control-key-" + group)
        self.key = os.urandom(32).hex()
        with os.fdopen(os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self.key + "\n")
        base_env = dict(os.environ)
        base_env.setdefault("UCX_NET_DEVICES", "lo")
        base_env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        base_env.update(env or {})
        for r in range(n):
            if r in skip_ranks:
                continue
            e = dict(base_env)
            e.update((rank_env or {}).get(r, {}))
            cmd = list((prefix or {}).get(r, [])) + [
                worker, "--rendezvous-dir", self.rdv, "--group", group, "--rank", str(r),
                "--world-size", str(n), "--threads", "1", "--control-key-file", self.key_file]
            if model:
                cmd += ["--model", model]
            cmd += list(args)
            if r == 0:
                cmd += list(rank0_args)
            self.errs[r] = os.path.join(self.dir, "%s.rank%d.err" % (group, r))
            self.procs[r] = subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE,
                                             stderr=open(self.errs[r], "w"))

    def stderr(self, r):
        with open(self.errs[r]) as f:
            return f.read()

    def wait_log(self, r, text, timeout=30.0):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if text in self.stderr(r):
                return True
            if self.procs[r].poll() is not None:
                return text in self.stderr(r)
            time.sleep(0.02)
        return False

    def kill(self, r):
        self.procs[r].send_signal(signal.SIGKILL)
        return time.monotonic()

    def wait(self, timeout=120.0, t0=None):
        """Wait for every rank; returns {rank: returncode}; {rank: None} if it hung."""
        t0 = t0 if t0 is not None else time.monotonic()
        rcs = {}
        while len(rcs) < len(self.procs) and time.monotonic() - t0 < timeout:
            for r, p in self.procs.items():
                if r not in rcs and p.poll() is not None:
                    rcs[r] = p.returncode
                    self.t_exit[r] = time.monotonic() - t0
            time.sleep(0.005)
        for r, p in self.procs.items():
            if r not in rcs:
                p.kill()
                p.wait()
                rcs[r] = None
        return rcs

    def stdout0(self):
        return self.procs[0].stdout.read().decode() if 0 in self.procs else ""


def parse_generate(text):
    """'i finish=F n=K ids=a,b,c [message="..."]' lines -> {i: (finish, [ids], message)}"""
    out = {}
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        i = int(parts[0])
        finish = parts[1].split("=", 1)[1]
        rest = parts[3]
        ids_part, _, msg = rest.partition(" message=")
        ids = ids_part.split("=", 1)[1]
        out[i] = (finish, [int(x) for x in ids.split(",") if x], msg.strip('"'))
    return out


def _check_ranks(g, what, timeout):
    rcs = g.wait(timeout=timeout)
    for r, rc in rcs.items():
        if rc != 0:
            raise SystemExit("FAIL %s: rank %d exited %s\n%s" % (what, r, rc, g.stderr(r)))


def run_generate(worker, model, n, k, tmp, tag, prompts, n_out, draft_quant=None, timeout=240):
    """Greedy decode of `prompts` (n_out tokens each, on the exact path, FP32 KV) on an n-rank group
    with MTP depth k (draft_quant: the speculative config's "draft_quantization", None for
    the default): ({i: (finish, [ids], message)}, [per-rank --report records])."""
    pf = os.path.join(tmp, "prompts-%s.txt" % tag)
    with open(pf, "w") as f:
        for p in prompts:
            f.write(",".join(map(str, p)) + "\n")
    rep = os.path.join(tmp, "report-%s.jsonl" % tag)
    # exactly k drafts a step: the verify path and the MTP repair run at every depth (the
    # adaptive default may draft none on a model whose drafts do not pay)
    sc = {"method": "mtp", "num_speculative_tokens": k, "draft_policy": "fixed"}
    if draft_quant:
        sc["draft_quantization"] = draft_quant
    spec = ["--speculative-config", json.dumps(sc)]
    g = Group(worker, model, n, tag, args=spec + ["--report", rep, "--exact", "--kv-cache-dtype", "fp32"],
              rank0_args=["--generate", pf, "--max-tokens", str(n_out)], workdir=tmp)
    out = g.stdout0()
    what = "N=%d K=%d" % (n, k)
    _check_ranks(g, what, timeout)
    res = parse_generate(out)
    if len(res) != len(prompts):
        raise SystemExit("FAIL %s: %d results in\n%s" % (what, len(res), out))
    for i, (fin, ids, msg) in res.items():
        if fin != "length" or len(ids) != n_out:
            raise SystemExit("FAIL %s: request %d finished %s with %d tokens (%s)" %
                             (what, i, fin, len(ids), msg))
    return res, [json.loads(line) for line in open(rep)]


def run_logits(worker, model, n, tmp, prompt, timeout=120):
    """The logits of every position of one prefill of `prompt` on an n-rank group (exact
    path, FP32 KV), as a [len(prompt), vocab] float32 numpy array."""
    import numpy as np
    lf = os.path.join(tmp, "logits-%d.bin" % n)
    ids = ",".join(str(x) for x in prompt)
    g = Group(worker, model, n, "logits%d" % n, args=["--exact", "--kv-cache-dtype", "fp32"],
              rank0_args=["--dump-logits", lf, "--prompt-ids", ids], workdir=tmp)
    _check_ranks(g, "logits N=%d" % n, timeout)
    return np.fromfile(lf, dtype=np.float32).reshape(len(prompt), -1)
