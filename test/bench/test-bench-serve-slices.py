#!/usr/bin/env python3
"""bench-serve --slices: each run's prompts are cut into slices that the configurations take in
turns, the order rotating by slice and round; each configuration's row is the sum of its slices
(every prompt once, tokens over the summed wall time); client seeds follow the prompt's place in
the run, not in its slice; a concurrency that leaves a slice fewer prompts than itself takes
fewer slices.  The two stepd servers are fake-serve.py (a test double of stepd serve's OpenAI API),
which logs every request with the port it came to, so no model runs."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FAKE = os.path.join(HERE, "fake-serve.py")
IN, OUT, N, SLICES, SEED = 6, 3, 6, 3, 40
CONCS = (1, 2, 4)           # 3, 3 and 1 slices of 6 prompts (4 leaves a slice of 2 < 4)
MIXES = ("greedy", "sampled")
bad = []


def check(ok, msg):
    if not ok:
        bad.append(msg)
    return ok


with tempfile.TemporaryDirectory() as tmp:
    js, logf = os.path.join(tmp, "runs.json"), os.path.join(tmp, "fake.log")
    env = dict(os.environ, STEPD_BIN=FAKE, STEPD_WORKER_BIN=os.path.join(tmp, "none"), FAKE_SERVE_LOG=logf)
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench-serve"), "--model-dir",
                        os.path.join(ROOT, "models", "tiny-step"), "--mtp", "0,2:fixed", "--threads", "1",
                        "--max-concurrency", ",".join(map(str, CONCS)), "--num-prompts", str(N),
                        "--input-len", str(IN), "--output-len", str(OUT), "--rounds", "2",
                        "--slices", str(SLICES), "--mix", ",".join(MIXES), "--client-seed", "--seed", str(SEED),
                        "--json", js], env=env, capture_output=True, text=True, timeout=120)
    log = [json.loads(x) for x in open(logf)] if os.path.exists(logf) else []
    if not check(p.returncode == 0, "bench-serve exited %d:\n%s%s" % (p.returncode, p.stdout[-3000:], p.stderr[-2000:])):
        log = []
    # the servers in the order they started (the --mtp entries' order), by port
    cfgs = {}
    for x in log:
        if "argv" in x:
            a = x["argv"]
            k = json.loads(a[a.index("--speculative-config") + 1])["num_speculative_tokens"]
            cfgs[int(a[a.index("--port") + 1])] = "0" if k == 0 else "%d fixed" % k
    order = list(cfgs.values())
    if log:
        check(order == ["0", "2 fixed"], "servers %s, want K=0 and 2 fixed" % order)
    reqs = [x for x in log if "body" in x]
    reqs = reqs[4 * len(cfgs):]            # each server's 4 warm-up requests first
    pos = 0
    for rd in range(2 if len(order) == 2 else 0):
        for mix in MIXES:
            for conc in CONCS:
                ns = min(SLICES, N // conc)
                cut = [N * j // ns for j in range(ns + 1)]
                seen = {c: [] for c in order}
                for j in range(ns):
                    for i in range(len(order)):
                        cfg = order[(i + rd + j) % len(order)]
                        block = reqs[pos:pos + cut[j + 1] - cut[j]]
                        pos += len(block)
                        where = "round %d %s conc %d slice %d (%s)" % (rd, mix, conc, j, cfg)
                        if not check(block and all(cfgs.get(x["port"]) == cfg for x in block),
                                     "%s: requests went to %s, want %d to %s" % (
                                         where, [cfgs.get(x["port"]) for x in block], cut[j + 1] - cut[j], cfg)):
                            continue
                        seen[cfg] += [x["body"] for x in block]
                for cfg in order:
                    bodies = seen[cfg]
                    seeds = sorted(b.get("seed", -1) for b in bodies)
                    want = list(range(SEED, SEED + N)) if mix == "sampled" else [-1] * N
                    check(len(bodies) == N and seeds == want, "round %d %s conc %d %s: %d requests, seeds %s, "
                          "want %d with %s" % (rd, mix, conc, cfg, len(bodies), seeds, N, want))
                # both configurations got the same prompts
                ps = [sorted(map(str, (b["prompt"] for b in seen[c]))) for c in order]
                check(ps[0] == ps[-1], "round %d %s conc %d: the configurations got other prompts" % (rd, mix, conc))
    check(pos == len(reqs), "%d requests after the runs' own, want none" % (len(reqs) - pos))
    # each row sums its slices: every prompt once, its tokens over the summed wall times
    rows = json.load(open(js)) if os.path.exists(js) else []
    check(len(rows) == 2 * len(MIXES) * len(CONCS) * 2, "%d rows, want %d" % (len(rows), 2 * len(MIXES) * len(CONCS) * 2))
    for r in rows:
        check(r["n"] == r["ok"] == N and abs(r["tok_s"] * r["wall"] - N * OUT) < 1e-6,
              "row %r: want %d requests of %d tokens over the slices' wall" % (r, N, OUT))
    lines = [x for x in p.stdout.splitlines() if x.startswith("round ")]
    check(len(lines) == len(rows) and all((" (3 slices)" in x) == ("concurrency 4" not in x) for x in lines),
          "run lines without their slice counts:\n" + "\n".join(lines))

for m in bad:
    print("test-bench-serve-slices: " + m)
sys.exit(1 if bad else 0)
