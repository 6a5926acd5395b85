#!/usr/bin/env python3
"""test_serve_images_group.py - images on a group of two ranks (issue 40): `stepd serve
--tensor-parallel-size 2` on the tiny model (attention TP by heads, the routed experts EP,
docs/ARCHITECTURE.md §2) answers a chat with two images with the single-rank group's greedy
tokens.  Rank 0 encodes; each step's image rows travel with the step plan (plan-wire.c,
version 2) and rank 1 splices them as rank 0 does.

  - one rank, K=0: the reference text of a chat with two images (a 40x30 PNG: the global view
    only; a 1000x600 one: 2 crops plus the global view), 16 greedy tokens;
  - two ranks: rank 0's log says "images served"; K=0 and K=3 (streamed too) give the
    reference text; the image counters say each image was encoded once
    (stepd:image_encodes_total stays 2 over the repeats, stepd:image_cache_hits_total grows)
    and the repeat's prompt comes from the prefix cache;
  - other images, same text: another answer and two more encodes (the rows that crossed the
    wire are the request's own).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import proclib as pl  # noqa: E402
import test_serve_images as si  # noqa: E402

SPEC = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']


def client(port):
    import openai

    return openai.OpenAI(base_url="http://127.0.0.1:%d/v1" % port, api_key="none", max_retries=0)


def chat(a, b):
    return [{"role": "user", "content": [{"type": "text", "text": "Compare"}, si.part(a),
                                         {"type": "text", "text": "with"}, si.part(b)]}]


A, B = si.data_url(si.png(40, 30)), si.data_url(si.png(1000, 600))
A2, B2 = si.data_url(si.png(41, 30)), si.data_url(si.png(900, 700))


def reference(d, out):
    p, port = si.serve(d, SPEC)
    try:
        c = client(port)
        out["ref"], u = si.ask_greedy(c, chat(A, B), 0)
        out["other"], _ = si.ask_greedy(c, chat(A2, B2), 0)
        print("   one rank: %d prompt tokens, %r" % (u.prompt_tokens, out["ref"]))
        assert u.prompt_tokens > 2 * 169 + 81 * 2 and len(out["ref"]) > 8, (u, out["ref"])
        assert out["other"] != out["ref"], out
        si.stop(p)
    finally:
        p.kill()


def two_ranks(d, out):
    p, port = si.serve(d, ["--tensor-parallel-size", "2"] + SPEC)
    mport = p.metrics_port
    try:
        logs = "".join(open(os.path.join(d, f), errors="replace").read() for f in os.listdir(d)
                       if f.endswith(".log"))
        assert "images served" in logs and "images are not served" not in logs, logs[-3000:]
        c = client(port)
        msgs = chat(A, B)
        text, u1 = si.ask_greedy(c, msgs, 0)
        print("   two ranks, K=0: %r" % text)
        assert text == out["ref"], (text, out["ref"])
        pl.wait_until(lambda: si.metric(mport, "stepd:image_encodes_total") == 2, 30, "2 image encodes")
        for k, stream in ((3, False), (3, True), (0, True)):
            text, u = si.ask_greedy(c, msgs, k, stream)
            assert text == out["ref"], (k, stream, text, out["ref"])
        print("   two ranks, K=3 and streamed: the same greedy text")
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        assert cached > 2 * 169, (u1, u)
        pl.wait_until(lambda: si.metric(mport, "stepd:image_cache_hits_total") > 0, 30, "encoder cache hits")
        assert si.metric(mport, "stepd:image_encodes_total") == 2
        print("   repeats: %d of %d prompt tokens cached, 2 encodes, %d encoder cache hits" %
              (cached, u.prompt_tokens, si.metric(mport, "stepd:image_cache_hits_total")))
        text, _ = si.ask_greedy(c, chat(A2, B2), 0)
        assert text == out["other"], (text, out["other"])
        pl.wait_until(lambda: si.metric(mport, "stepd:image_encodes_total") == 4, 30, "4 image encodes")
        print("   other images: the single rank's other answer, 4 encodes")
        si.text_ok(port)
        si.stop(p)
    finally:
        p.kill()


def main():
    out = {}
    pl.run_cases([("one rank: the reference", reference, out),
                  ("two ranks (TP 2, EP 2): the same greedy text, each image encoded once", two_ranks, out)],
                 "stepd-serve-images-group-", 5000)
    print("stepd serve, images on a group of two ranks: all checks passed")


if __name__ == "__main__":
    main()
