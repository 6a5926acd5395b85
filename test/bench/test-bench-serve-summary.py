#!/usr/bin/env python3
"""bench-serve's summary: a finished request counts its tokens and E2E even when it streamed
no text (a model whose tokens have none), and only requests with text give TTFT/TPOT."""
import importlib.machinery
import importlib.util
import os
import sys

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench-serve")
loader = importlib.machinery.SourceFileLoader("bench_serve", path)
spec = importlib.util.spec_from_loader("bench_serve", loader)
bs = importlib.util.module_from_spec(spec)
loader.exec_module(bs)

text = dict(ok=True, error="", chunks=[1.5, 2.0, 2.5], tokens=3, ext=None, t_start=1.0, t_end=2.5)
empty = dict(ok=True, error="", chunks=[], tokens=16, ext=None, t_start=1.0, t_end=5.0)
failed = dict(ok=False, error="boom", chunks=[], tokens=0, ext=None, t_start=1.0, t_end=1.1)
s = bs.summarize([text, empty, failed], 10.0)
checks = [
    (s["tok_s"] == 1.9, "output tok/s %r, want 1.9 (3 + 16 tokens in 10 s)" % s["tok_s"]),
    (s["req_s"] == 0.2, "req/s %r, want 0.2" % s["req_s"]),
    (sorted(s["e2e"]) == [1.5, 4.0], "E2E %r, want [1.5, 4.0]" % s["e2e"]),
    (s["ttft"] == [0.5], "TTFT %r, want [0.5] (the request with text only)" % s["ttft"]),
    (s["tpot"] == [0.5], "TPOT %r, want [0.5]" % s["tpot"]),
    (s["failed"] == 1, "failed %r, want 1" % s["failed"]),
]
bad = [m for ok, m in checks if not ok]
for m in bad:
    print("test-bench-serve-summary: " + m)
sys.exit(1 if bad else 0)
