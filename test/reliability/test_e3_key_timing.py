#!/usr/bin/env python3
"""E3: statistical timing test of the API-key comparison over loopback.

stepd runs with a 32-character API key (from $STEPD_API_KEY).  Two kinds of wrong key of
the same length are sent, interleaved in a random order, on the same channel:
  A: every character right except the last (a prefix match of 31/32),
  B: random characters (first character already wrong).
A comparison that stops at the first differing byte makes A slower than B.  Each call is a
unary GetServerInfo that must end UNAUTHENTICATED; its wall time is measured with
perf_counter_ns.  The samples are trimmed to their 1st-99th percentiles (loopback noise),
and a two-sided Welch t-test compares the means (normal approximation to t: the degrees of
freedom are in the thousands).  Pass criterion (robust on a noisy shared box): the test
fails only when p < ALPHA = 1e-4 AND the medians differ by more than 2 %.  Also checked:
the right key works, a case change of the right key fails.

Usage: test_e3_key_timing.py [--trials N]   (N per kind; default 20000, bench 100000)
"""
import argparse
import math
import random
import string
import time

import numpy as np

import rellib  # noqa: F401
from rellib import h

grpc = h.grpc
pb = h.pb
ALPHA = 1e-4
MEDIAN_REL = 0.02


def welch(a, b):
    ma, mb = a.mean(), b.mean()
    va, vb = a.var(ddof=1), b.var(ddof=1)
    se = math.sqrt(va / len(a) + vb / len(b))
    t = (ma - mb) / se if se > 0 else 0.0
    df = (va / len(a) + vb / len(b)) ** 2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    p = math.erfc(abs(t) / math.sqrt(2))          # two-sided, normal approximation (df >> 30)
    return t, df, p


def trim(x):
    lo, hi = np.percentile(x, [1, 99])
    return x[(x >= lo) & (x <= hi)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20000)
    a = ap.parse_args()
    rng = random.Random(12345)
    alphabet = string.ascii_letters + string.digits
    key = "".join(rng.choice(alphabet) for _ in range(32))
    s = h.Stepd(env={"STEPD_API_KEY": key})
    call = s.channel.unary_unary("/stepd.v1.Inference/GetServerInfo",
                                 request_serializer=pb.GetServerInfoRequest.SerializeToString,
                                 response_deserializer=pb.GetServerInfoResponse.FromString)
    req = pb.GetServerInfoRequest()

    def code(k):
        try:
            call(req, timeout=5, metadata=[("authorization", "Bearer " + k)])
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    assert code(key) == grpc.StatusCode.OK
    assert code(key.swapcase()) == grpc.StatusCode.UNAUTHENTICATED
    prefix_key = key[:-1] + ("A" if key[-1] != "A" else "B")

    def random_key():
        while True:
            k = "".join(rng.choice(alphabet) for _ in range(32))
            if k[0] != key[0]:
                return k
    random_keys = [random_key() for _ in range(64)]
    order = [0] * a.trials + [1] * a.trials
    rng.shuffle(order)
    for _ in range(500):                                   # warm-up
        code(prefix_key)
        code(random_keys[0])
    ta, tb = [], []
    pc = time.perf_counter_ns
    t_all = time.time()
    for i, kind in enumerate(order):
        k = prefix_key if kind == 0 else random_keys[i % 64]
        md = [("authorization", "Bearer " + k)]
        t0 = pc()
        try:
            call(req, timeout=5, metadata=md)
            raise AssertionError("wrong key accepted: %r" % k)
        except grpc.RpcError as e:
            t1 = pc()
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise AssertionError("wrong key: %s %s" % (e.code(), e.details()))
        (ta if kind == 0 else tb).append(t1 - t0)
    wall = time.time() - t_all
    A, B = trim(np.array(ta, dtype=np.float64)), trim(np.array(tb, dtype=np.float64))
    t, df, p = welch(A, B)
    medA, medB = float(np.median(ta)), float(np.median(tb))
    rel = abs(medA - medB) / min(medA, medB)
    se = math.sqrt(A.var(ddof=1) / len(A) + B.var(ddof=1) / len(B))
    print("   %d + %d calls in %.1fs; prefix-match: median %.1f us mean %.1f us; random: median %.1f us mean %.1f us"
          % (a.trials, a.trials, wall, medA / 1e3, A.mean() / 1e3, medB / 1e3, B.mean() / 1e3))
    print("   Welch t = %.3f (df %.0f), two-sided p = %.3g; median difference %.2f %% "
          "(fail only if p < %g and difference > %.0f %%); "
          "smallest mean difference this run resolves at p < %g: %.2f us" % (t, df, p, rel * 100, ALPHA, MEDIAN_REL * 100,
                                                                             ALPHA, 3.89 * se / 1e3))
    assert s.stop() == 0
    assert not (p < ALPHA and rel > MEDIAN_REL), "key comparison timing differs: p=%g, medians %.0f vs %.0f ns" % (
        p, medA, medB)


h.run_tests([("e3-api-key-timing", main)])
