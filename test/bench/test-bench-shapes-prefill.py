#!/usr/bin/env python3
"""bench-shapes --prefill on the tiny model (short prompts, small chunks): per thread count
both peaks and, per prompt length, the prefill line and its four pieces, with sane figures:
positive times and peaks (the dense piece, a difference, excepted), tok/s = tokens / time, a CPU share in (0, 1.5], the pieces' FLOPs
adding up to the prompt's, dense and expert FLOPs linear in the tokens, attention's faster.

usage: test-bench-shapes-prefill.py BENCH_SHAPES MODEL_DIR"""
import os
import re
import subprocess
import sys

bench, model = sys.argv[1], sys.argv[2]
lengths = (100, 300)
env = dict(os.environ, STEPD_BENCH_MB="64")
out = subprocess.run([bench, "--model", model, "--prefill", ",".join(map(str, lengths)),
                      "--prefill-chunk", "64", "--threads", "1,2", "--reps", "1"],
                     env=env, capture_output=True, text=True, timeout=120)
bad = []
if out.returncode != 0:
    bad.append("exit status %d: %s" % (out.returncode, out.stderr.strip()[-300:]))
num = r"([0-9.]+)"
blocks = re.split(r"\nthreads (\d+): prefill in chunks of 64 tokens", out.stdout)
seen = {}
for i in range(1, len(blocks) - 1, 2):
    seen[int(blocks[i])] = blocks[i + 1].split("\nthreads ")[0]
if sorted(seen) != [1, 2]:
    bad.append("prefill reports for threads %s, want 1 and 2" % sorted(seen))
for T, text in sorted(seen.items()):
    for what in ("routed experts", "BF16 GEMMs and attention"):
        m = re.search(r"peak, " + what + r": " + num + " GFLOP/s", text)
        if not m or not float(m.group(1)) > 0:
            bad.append("threads %d: no positive peak for %s" % (T, what))
    flops = {}
    for N in lengths:
        m = re.search(r"prefill %d tokens: +%s ms \(%s \.\. %s\) = %s tok/s  cpu %s  %s GFLOP  "
                      r"floor %s ms +%s %% of peak" % ((N,) + (num,) * 8), text)
        if not m:
            bad.append("threads %d: no prefill line for %d tokens" % (T, N))
            continue
        ms, lo, hi, toks, cpu, gf, fl, pct = map(float, m.groups())
        if not (0 < lo <= ms <= hi):
            bad.append("threads %d, %d tokens: time %g ms outside (0, %g .. %g)" % (T, N, ms, lo, hi))
        # the time is printed to 0.1 ms, the rate from the unrounded time: at a few ms the
        # rounding alone moves N / ms by more than 1 %
        t_lo, t_hi = N / ((ms + 0.05) / 1e3), N / (max(ms - 0.05, 1e-6) / 1e3)
        if not (0.99 * t_lo - 0.1 <= toks <= 1.01 * t_hi + 0.1):
            bad.append("threads %d, %d tokens: %g tok/s, not %d tokens / %g ms" % (T, N, toks, N, ms))
        if not 0 < cpu <= 1.5:
            bad.append("threads %d, %d tokens: cpu share %g outside (0, 1.5]" % (T, N, cpu))
        if not (0 < fl and 0 < pct < 1000):
            bad.append("threads %d, %d tokens: floor %g ms, %g %% of peak" % (T, N, fl, pct))
        rest = text[m.end():].split("\n  prefill ")[0]
        pieces = {}
        for name in ("attention", "routed experts", "dense", "lm_head"):
            # dense is the pass's time less the other pieces' re-runs: on the tiny model
            # noise can take it below 0
            p = re.search(r"\n    %s .*? (-?[0-9.]+) ms +%s GFLOP +(-?[0-9.]+) %% of peak" %
                          (name, num), rest)
            if not p:
                bad.append("threads %d, %d tokens: no %s piece" % (T, N, name))
                continue
            pieces[name] = float(p.group(2))
            if name != "dense" and not (float(p.group(1)) >= 0 and float(p.group(3)) >= 0):
                bad.append("threads %d, %d tokens: %s piece negative" % (T, N, name))
        if len(pieces) == 4:
            if abs(sum(pieces.values()) - gf) > 0.052:
                bad.append("threads %d, %d tokens: pieces %r GFLOP do not add up to %g" %
                           (T, N, pieces, gf))
            flops[N] = pieces
    if len(flops) == 2:
        a, b = flops[lengths[0]], flops[lengths[1]]
        k = lengths[1] / lengths[0]
        for name in ("routed experts", "dense"):
            if abs(b[name] / a[name] - k) > 0.02 * k:
                bad.append("threads %d: %s GFLOP %g -> %g, not x%g" % (T, name, a[name], b[name], k))
        if not b["attention"] / a["attention"] > k:
            bad.append("threads %d: attention GFLOP %g -> %g, not faster than the tokens" %
                       (T, a["attention"], b["attention"]))
if bad:
    # the findings after the bench's output: a suite prints only a failed test's last lines
    print(out.stdout)
for m in bad:
    print("test-bench-shapes-prefill: " + m)
sys.exit(1 if bad else 0)
