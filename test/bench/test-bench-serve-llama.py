#!/usr/bin/env python3
"""bench-serve --llama-server: llama-server is one more configuration beside stepd's, sent the
same requests in the same rounds, its streamed tokens counted one a chunk, and the side-by-side
table's ratios are those of the runs' own figures.  Both servers are fake-serve.py (a test double
of stepd serve's OpenAI API and of llama-server's /completion), so no llama.cpp and no model run.
A llama-server stream of two tokens a chunk, or one token short, fails its requests; --agreement
counts the leading and the equal greedy tokens of the two servers."""
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
FAKE = os.path.join(HERE, "fake-serve.py")
IN, OUT, CONCS = 8, 5, (1, 2)
bad = []


def check(ok, msg):
    if not ok:
        bad.append(msg)
    return ok


def run(tmp, name, *extra, **env):
    js, log = os.path.join(tmp, name + ".json"), os.path.join(tmp, name + ".log")
    e = dict(os.environ, STEPD_BIN=FAKE, STEPD_WORKER_BIN=os.path.join(tmp, "none"), FAKE_SERVE_LOG=log, **env)
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench-serve"), "--model-dir",
                        os.path.join(ROOT, "models", "tiny-step"), "--mtp", "0", "--threads", "1",
                        "--max-concurrency", ",".join(map(str, CONCS)), "--num-prompts", "3", "--input-len", str(IN),
                        "--output-len", str(OUT), "--rounds", "2", "--llama-server", FAKE, "--gguf", "model.gguf",
                        "--json", js, *extra], env=e, capture_output=True, text=True, timeout=120)
    rows = json.load(open(js)) if os.path.exists(js) else []
    return p, rows, [json.loads(x) for x in open(log)] if os.path.exists(log) else []


def ratio(xs):
    return "%.2f [%.2f-%.2f]" % (statistics.median(xs), min(xs), max(xs))


with tempfile.TemporaryDirectory() as tmp:
    p, rows, log = run(tmp, "good")
    out = p.stdout
    if check(p.returncode == 0, "bench-serve exited %d:\n%s%s" % (p.returncode, out, p.stderr)):
        # llama-server's command line: slots for the largest concurrency, context for one request a slot
        argv = [x["argv"] for x in log if "argv" in x and x["argv"][:1] != ["serve"]]
        check(len(argv) == 1, "llama-server started %d times, want once" % len(argv))
        a = argv[0] if argv else []
        for flag, val in (("--model", "model.gguf"), ("--parallel", "2"), ("--ctx-size", str(2 * (IN + OUT + 64))),
                          ("--threads", "1"), ("--threads-batch", "1")):
            check(flag in a and a[a.index(flag) + 1] == val, "llama-server without %s %s: %s" % (flag, val, a))
        check("--no-webui" in a and "--cont-batching" in a, "llama-server without --no-webui --cont-batching: %s" % a)
        # the same requests: every prompt stepd got, llama-server got (and no other)
        reqs = {s: [x["body"] for x in log if x.get("server") == s] for s in ("stepd", "llama")}
        check(sorted(map(str, (b["prompt"] for b in reqs["stepd"]))) ==
              sorted(map(str, (b["prompt"] for b in reqs["llama"]))), "the two servers got different prompts")
        check(len(reqs["llama"]) == 4 + 2 * (3 + 3), "llama-server got %d requests, want 4 warm-up + 2 rounds x 6"
              % len(reqs["llama"]))
        b = reqs["llama"][-1] if reqs["llama"] else {}
        check(len(b.get("prompt", [])) == IN and all(isinstance(t, int) for t in b["prompt"]) and
              b.get("n_predict") == OUT and b.get("ignore_eos") is True and b.get("return_tokens") is True and
              b.get("stream") is True and b.get("temperature") == 0, "llama-server request %r" % b)
        # its rows: every request ok, OUT tokens each
        lrows = [r for r in rows if r["config"] == "llama-server"]
        check(len(lrows) == 2 * len(CONCS), "%d llama-server runs, want %d" % (len(lrows), 2 * len(CONCS)))
        for r in lrows:
            check(r["ok"] == r["n"] == 3 and abs(r["tok_s"] * r["wall"] - 3 * OUT) < 1e-6,
                  "llama-server run %r: want 3 requests of %d tokens" % (r, OUT))
        check(any(line.split()[:1] == ["llama-server"] for line in out.splitlines()),
              "no llama-server row in the table:\n" + out)
        # the side-by-side table: per concurrency the per-round ratios of the JSON's figures
        head = "stepd beside llama-server (model.gguf)"
        check(head in out, "no side-by-side table:\n" + out)
        sbs = out.split(head, 1)[-1].splitlines()[3:3 + len(CONCS)]
        fig = {(r["config"], r["conc"], r["round"]): r for r in rows}
        for conc, line in zip(CONCS, sbs):
            cells = [c.strip() for c in line.split("  ") if c.strip()]
            want = ["1", "greedy", str(conc), "K=0"]
            for key, f in (("tok_s", 1), ("tpot_p50", 1000), ("ttft_p50", 1000)):
                sv = [fig[("0", conc, rd)][key] for rd in (0, 1)]
                lv = [fig[("llama-server", conc, rd)][key] for rd in (0, 1)]
                want += ["%.1f" % (f * statistics.median(sv)), "%.1f" % (f * statistics.median(lv)),
                         ratio([u / v for u, v in zip(sv, lv)])]
            check(cells == want, "side-by-side line at concurrency %d:\n  %s\nwant\n  %s" % (conc, cells, want))
    for name, env, what in (("chunk", {"FAKE_LLAMA_CHUNK": "2"}, "in 3 chunks (want one token a chunk)"),
                            ("short", {"FAKE_LLAMA_SHORT": "1"}, "streamed 4 tokens, predicted 4, want 5")):
        p, rows, _ = run(tmp, name, **env)
        lrows = [r for r in rows if r["config"] == "llama-server"]
        check(p.returncode == 1 and lrows and all(r["failed"] == r["n"] for r in lrows) and what in p.stdout,
              "a llama-server stream %s: exit %d, want 1 with every llama-server request failed (%r):\n%s%s" % (
                  name, p.returncode, what, p.stdout[-3000:], p.stderr[-2000:]))

    # greedy agreement: token 3 of each llama-server stream differs, so 3 leading tokens agree a prompt
    p, _, _ = run(tmp, "agree", "--agreement", "6", "--agreement-prompts", "2", FAKE_LLAMA_FLIP="3")
    check(p.returncode == 0 and "greedy agreement, K=0 vs llama-server, first 6 tokens of 2 prompts: leading 6/12, "
          "equal positions 10/12" in p.stdout, "agreement:\n%s%s" % (p.stdout[-3000:], p.stderr[-2000:]))

for m in bad:
    print("test-bench-serve-llama: " + m)
sys.exit(1 if bad else 0)
