#!/usr/bin/env python3
"""bench-shapes' decode sweep on the tiny model (batches 4 and 64, context 1k, 1 and 2 threads,
one round, --cpu-min-ms 0: every piece gets its cpu figures, however short): per thread count
the load line, and every piece but the attention rows with its cpu share and its % of floor per
CPU-second, sane figures (a positive per-CPU-second %, and that % equal to floor x the probe's
(or the peak's) share over time x the piece's share within rounding, i.e. the wall-clock %
scaled by the shares (the GEMM peak's share where the floor is compute)), and a share in
[0, 1.5] where the piece lasted 10 ms or more (the bench's default least: a shorter piece's share
is the scheduler tick's say).  Which piece lasts how long is the clock's say, so nothing here
depends on it but that range check, on the rows it applies to.

usage: test-bench-shapes-decode.py BENCH_SHAPES MODEL_DIR"""
import json
import os
import re
import subprocess
import sys

bench, model = sys.argv[1], sys.argv[2]
env = dict(os.environ, STEPD_BENCH_MB="64")
out = subprocess.run([bench, "--model", model, "--threads", "1,2", "--batches", "4,64",
                      "--contexts", "1024", "--reps", "1", "--draft-vocab", "0", "--cpu-min-ms", "0"],
                     env=env, capture_output=True, text=True, timeout=120)
bad = []
if out.returncode != 0:
    bad.append("exit status %d: %s" % (out.returncode, out.stderr.strip()[-300:]))
num = r"([0-9.]+)"
for T in (1, 2):
    m = re.search(r"\nthreads %d: load average at the rounds' starts: %s; the probe's cpu %s " %
                  (T, num, num), out.stdout)
    if not m:
        bad.append("threads %d: no load line" % T)
        continue
    probe_cpu = float(m.group(2))
    k = re.search(r"\nthreads %d: GEMM peak %s GFLOP/s .*; cpu %s\)" % (T, num, num), out.stdout)
    if not k:
        bad.append("threads %d: no GEMM peak line with its cpu share" % T)
        continue
    peak_cpu = float(k.group(2))
    if not 0 < probe_cpu <= 1.5:
        bad.append("threads %d: the probe's cpu share %g outside (0, 1.5]" % (T, probe_cpu))
    text = out.stdout.split("\nthreads %d: read bandwidth" % T)[1].split("\nthreads ")[0]
    rows = 0
    for line in text.splitlines():
        p = re.match(r"  +(\S.*?) +(?:1k +)?%s ms +%s MB +floor +%s ms +%s %% of (\S+)(.*)$" %
                     ((num,) * 4), line)
        if not p or "Step-3.7-Flash" in line:
            continue
        name, rest = p.group(1), p.group(7)
        if name.startswith("attention"):
            continue
        rows += 1
        c = re.match(r"  cpu %s, +%s %% per cpu-s$" % (num, num), rest)
        ms = float(p.group(2))
        if not c:
            bad.append("threads %d: %s (%g ms) has no cpu / per cpu-s figures" % (T, name, ms))
            continue
        pct, cpu, pcpu = float(p.group(5)), float(c.group(1)), float(c.group(2))
        # a piece preempted for most of its time can print a share of 0.00; one shorter than
        # 10 ms any share the tick gives it (up to 2-7), and then a per-CPU-second % that can
        # round to 0.0: only the arithmetic below holds for it
        if ms >= 10.0 and not 0 <= cpu <= 1.5:
            bad.append("threads %d: %s cpu share %g outside [0, 1.5]" % (T, name, cpu))
        if ms >= 10.0 and cpu >= 0.01 and not pcpu > 0:
            bad.append("threads %d: %s %g %% per cpu-s" % (T, name, pcpu))
        share = {"bw": probe_cpu, "peak": peak_cpu}.get(p.group(6))
        if share and cpu >= 0.1 and pct >= 0.1:
            # the printed figures' rounding (0.1 %, 0.01 of a share) bounds the difference
            want = pct * share / cpu
            if abs(pcpu - want) > want * (0.005 / share + 0.005 / cpu + 0.05 / pct) + 0.1:
                bad.append("threads %d: %s %g %% per cpu-s, want %g %% x %g / %g = %g" %
                           (T, name, pcpu, pct, share, cpu, want))
    if rows < 10:
        bad.append("threads %d: %d piece rows, want >= 10" % (T, rows))
# the real step's bytes count the experts its own routing reaches: one figure per batch
# and thread count, between top_k (one token) and the experts B tokens can reach
with open(os.path.join(model, "config.json")) as f:
    cfg = json.load(f)
cfg = cfg.get("text_config", cfg)
E, k = cfg["moe_num_experts"], cfg["moe_top_k"]
for T in (1, 2):
    text = out.stdout.split("\nthreads %d: read bandwidth" % T)[-1].split("\nthreads ")[0]
    for B in (4, 64):
        part = text.split("\n batch %d (" % B)[-1].split("\n batch ")[0]
        r = re.search(r"routing: .*, %s in the real step \(its own routing\)" % num, part)
        if not r:
            bad.append("threads %d batch %d: no real-step routing figure" % (T, B))
        elif not k <= float(r.group(1)) <= min(B * k, E):
            bad.append("threads %d batch %d: the real step reaches %s experts, outside "
                       "[%d, %d]" % (T, B, r.group(1), k, min(B * k, E)))
if bad:
    # the findings after the bench's output: a suite prints only a failed test's last lines
    print(out.stdout)
for m in bad:
    print("test-bench-shapes-decode: " + m)
sys.exit(1 if bad else 0)
