#!/usr/bin/env python3
"""logprobs / top_logprobs end to end: stepd + the real stepd-worker (CPU, the bundled tiny
model, the exact MXFP4 path), checked against the model's own logits computed here.

For each request the reference is one teacher-forced prefill of prompt + output
(stepd-worker --dump-logits: every position's logits), turned into log-probabilities here
with numpy in float64.  Every streamed token's logprob and its top N must agree with the
reference to 1e-4, and the top N must be the reference's N most likely tokens:
  raw (the default, vLLM's raw_logprobs): the target model's distribution before any
      sampling transform, for greedy and sampled requests, without MTP and with MTP K=3
      (the drafted tokens report the target's logprobs, not the drafts');
  processed_logprobs (--logprobs-mode): the distribution the sampler drew from - after the
      repetition penalty for a greedy request, after temperature and top-k for a sampled one.
Also: logprobs 0 (the sampled token only), 20 (the cap), and 21 refused by stepd naming the
field; text input carries logprobs too.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from stepd_harness import TINY_MODEL, WORKER_BIN, Stepd, code_of, pb, run_tests, wait_until

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3]
TOL = 1e-4
tmp = tempfile.mkdtemp(prefix="stepd-logprobs-")


def reference_logits(ids):
    """Logits of every position of ids, from one prefill on the exact path."""
    out = os.path.join(tmp, "logits.bin")
    r = subprocess.run([WORKER_BIN, "--model", TINY_MODEL, "--world-size", "1", "--exact", "--threads", "1",
                        "--dump-logits", out, "--prompt-ids", ",".join(map(str, ids))],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    x = np.fromfile(out, dtype=np.float32).astype(np.float64)
    return x.reshape(len(ids), -1)


def log_softmax(x):
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def generate(s, sampling, ids=PROMPT, **kw):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=sampling, **kw)
    toks, lps = [], []
    for r in s.inf.Generate(req, timeout=60):
        if r.HasField("chunk"):
            assert len(r.chunk.logprobs) == len(r.chunk.token_ids), r.chunk
            toks.extend(r.chunk.token_ids)
            lps.extend(r.chunk.logprobs)
    return toks, lps


def check(toks, lps, n_top, ref_of_row, what):
    """ref_of_row(j, ids) -> the reference log-probabilities of output token j."""
    assert toks and len(toks) == len(lps), (what, toks, lps)
    logits = reference_logits(PROMPT + toks[:-1])
    worst = 0.0
    for j, (t, lp) in enumerate(zip(toks, lps)):
        ref = ref_of_row(j, logits[len(PROMPT) - 1 + j], PROMPT + toks[:j])
        assert lp.token_id == t, (what, j, lp.token_id, t)
        assert len(lp.top) == n_top, (what, j, len(lp.top))
        worst = max(worst, abs(lp.logprob - ref[t]))
        assert abs(lp.logprob - ref[t]) <= TOL, (what, j, t, lp.logprob, ref[t])
        finite = np.isfinite(ref)
        order = np.argsort(-ref, kind="stable")
        for k, top in enumerate(lp.top):
            want = ref[order[k]]
            if not np.isfinite(want):
                assert top.logprob == -np.inf, (what, j, k, top)
                continue
            assert abs(top.logprob - ref[top.token_id]) <= TOL, (what, j, k, top, ref[top.token_id])
            # the k-th most likely (a near-tie may swap neighbours)
            assert abs(top.logprob - want) <= TOL, (what, j, k, top, order[:n_top], ref[order[:n_top]])
            worst = max(worst, abs(top.logprob - ref[top.token_id]))
        assert finite[t], (what, j, t)
    return worst


def raw(j, row, hist):
    return log_softmax(row)


def start_group(s, name, *args):
    w = s.start_worker(name, "--exact", "--threads", "1", *args)
    s.wait_ready(1, timeout=120)
    return w


def stop_group(s, w):
    w.terminate()
    assert w.wait(20) == 0
    wait_until(lambda: s.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=2).groups_ready == 0,
               timeout=10, what="group gone")


def test_raw():
    s = Stepd()
    greedy = pb.SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
    sampled = pb.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=5, ignore_eos=True)
    for mtp in (0, 3):
        # exactly K drafts a step (the adaptive default may draft none on this host)
        w = start_group(s, "lp%d" % mtp, "--speculative-config",
                        json.dumps({"method": "mtp", "num_speculative_tokens": mtp, "draft_policy": "fixed"}))
        for name, sp in (("greedy", greedy), ("sampled", sampled)):
            toks, lps = generate(s, sp)
            worst = check(toks, lps, 5, raw, "%s mtp=%d" % (name, mtp))
            print("   raw, %s, MTP K=%d: %d tokens, top 5 each, max |delta| %.2e" % (name, mtp, len(toks), worst))
        # MTP actually drafted: the Final says how many were accepted
        if mtp:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling_params=greedy)
            fin = [r.final for r in s.inf.Generate(req, timeout=60) if r.HasField("final")][0]
            assert fin.mtp.num_drafts > 0, fin
        stop_group(s, w)
    assert s.stop() == 0


def test_processed():
    s = Stepd("--tokenizer", os.path.join(TINY_MODEL, "tokenizer.json"))
    start_group(s, "lpp", "--logprobs-mode", "processed_logprobs", "--speculative-config",
                json.dumps({"method": "mtp", "num_speculative_tokens": 3, "draft_policy": "fixed"}))
    # greedy: after the repetition penalty (prompt + output so far), no temperature
    sp = pb.SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, logprobs=4, ignore_eos=True)

    def penalised(j, row, hist):
        x = row.copy()
        for t in set(hist):
            x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
        return log_softmax(x)
    toks, lps = generate(s, sp)
    worst = check(toks, lps, 4, penalised, "processed greedy")
    print("   processed, greedy with repetition_penalty 1.3: %d tokens, max |delta| %.2e" % (len(toks), worst))
    # sampled: temperature 0.7 then top-k 8, renormalised; the rest -inf
    sp = pb.SamplingParams(max_tokens=10, temperature=0.7, top_k=8, seed=3, logprobs=10, ignore_eos=True)

    def topk(j, row, hist):
        x = log_softmax(row / 0.7)
        keep = np.argsort(-x, kind="stable")[:8]
        out = np.full_like(x, -np.inf)
        out[keep] = x[keep] - np.log(np.exp(x[keep]).sum())
        return out
    toks, lps = generate(s, sp)
    worst = check(toks, lps, 10, topk, "processed top-k")
    print("   processed, temperature 0.7 + top-k 8, top 10 (2 of them -inf): max |delta| %.2e" % worst)
    # the sampled token only, the cap, over the cap
    toks, lps = generate(s, pb.SamplingParams(max_tokens=3, temperature=0.0, logprobs=0))
    assert len(lps) == 3 and all(len(lp.top) == 0 for lp in lps), lps
    toks, lps = generate(s, pb.SamplingParams(max_tokens=2, temperature=0.0, logprobs=20))
    assert all(len(lp.top) == 20 for lp in lps), lps
    c, d = code_of(lambda: generate(s, pb.SamplingParams(max_tokens=2, logprobs=21)))
    assert c.name == "INVALID_ARGUMENT" and "sampling_params.logprobs" in d, (c, d)
    # text input: the chunks carry the logprobs of their tokens
    req = pb.GenerateRequest(text="In the beginning", sampling_params=pb.SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=2), stream_options=pb.StreamOptions(include_token_ids=True))
    n_tok = n_lp = 0
    for r in s.inf.Generate(req, timeout=60):
        if r.HasField("chunk"):
            n_tok += len(r.chunk.token_ids)
            n_lp += len(r.chunk.logprobs)
    assert n_tok == 6 and n_lp == 6, (n_tok, n_lp)
    assert s.stop() == 0


if __name__ == "__main__":
    if not os.path.exists(WORKER_BIN) or not os.path.isdir(TINY_MODEL):
        print("no stepd-worker or tiny model")
        sys.exit(1)
    run_tests([
        ("raw", test_raw),
        ("processed", test_processed),
    ])
