#!/usr/bin/env python3
"""bench-serve's summary: a finished request counts its tokens and E2E even when it streamed
no timed token (a model whose tokens have no text, asked without token ids), and only requests
with timed tokens give TTFT/TPOT; a streamed choice times a token when it carries text or
token ids (return_token_ids), not when it carries neither.  The final table gives, with several
rounds, each figure as the median over rounds of the round's own (not the last round's)."""
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
    (bs.chunk_has_tokens({"index": 0, "text": "", "token_ids": [4711]}),
     "a completions chunk with token ids and no text is not timed"),
    (bs.chunk_has_tokens({"index": 0, "delta": {"content": ""}, "token_ids": [9]}),
     "a chat chunk with token ids and no content is not timed"),
    (bs.chunk_has_tokens({"index": 0, "text": "a"}), "a chunk with text is not timed"),
    (not bs.chunk_has_tokens({"index": 0, "text": "", "token_ids": []}),
     "a chunk with neither text nor token ids is timed"),
    (not bs.chunk_has_tokens({"index": 0, "text": "", "finish_reason": "length"}),
     "the finish chunk without text is timed"),
]


def one_round(ttft, step, n_req, wall):
    """a round of n_req requests of 3 tokens: first token after ttft, then one every step"""
    rs = [dict(ok=True, error="", chunks=[1.0 + ttft, 1.0 + ttft + step, 1.0 + ttft + 2 * step], tokens=3,
               ext=None, t_start=1.0, t_end=1.0 + ttft + 2 * step) for _ in range(n_req)]
    return bs.summarize(rs, wall)


# three rounds of one cell; the last is not the median round
rounds = [one_round(0.2, 0.02, 4, 2.0), one_round(0.1, 0.01, 4, 4.0), one_round(0.3, 0.03, 4, 1.0)]
rows = [dict(cfg="0", threads=1, mix="greedy", conc=4, rate="inf", round=i, s=s_) for i, s_ in enumerate(rounds)]
line = bs.table(rows).splitlines()[-1].split()
checks += [
    (line[5] == "12", "requests %r, want 12 (3 rounds of 4)" % line[5]),
    (line[7] == "2.00", "req/s %r, want the median 2.00 (rounds 2.00, 1.00, 4.00)" % line[7]),
    (line[8:10] == ["6.0", "[3.0-12.0]"],
     "out tok/s %r, want 6.0 [3.0-12.0]" % line[8:10]),
    (line[10] == "200.0/200.0/200.0", "TTFT %r, want the median round's 200.0 ms at every percentile" % line[10]),
    (line[11] == "20.0/20.0/20.0", "TPOT %r, want 20.0 ms" % line[11]),
    (line[13] == "240.0/240.0/240.0", "E2E %r, want 240.0 ms" % line[13]),
]
bad = [m for ok, m in checks if not ok]
for m in bad:
    print("test-bench-serve-summary: " + m)
sys.exit(1 if bad else 0)
