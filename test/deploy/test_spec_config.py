#!/usr/bin/env python3
"""test_spec_config.py - both callers of the one --speculative-config parser
(common/specconf.c) give each configuration the same verdict and, when they refuse it, the same
sentence: `stepd serve` (which checks it before it starts any rank) and stepd-worker (which
parses it into its options; `--check-device cpu` after it ends the run once the flags are
parsed).  A K out of range is refused in one place (spec_k_check) whether it comes as
num_speculative_tokens or as stepd-worker --mtp.

`stepd serve` is ended by a KV budget below one sequence (--kv-cache-memory 64KiB, checked
after the speculative config), so that an accepted configuration never starts a rank.
"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)
MODEL = os.path.join(ROOT, "models", "tiny-step")
STEPD = os.path.abspath(dl.build_binary("stepd"))
WORKER = os.path.abspath(dl.build_binary("stepd-worker"))
KV_REFUSAL = r"--kv-cache-memory \(rank 0\): KV cache: .* need at least"

# (configuration, None when accepted or the sentence both callers refuse it with; "...": its
# beginning)
CASES = [
    ('{"method": "mtp", "num_speculative_tokens": 3}', None),
    ('{"method": "mtp"}', None),
    ('{"method": "mtp", "num_speculative_tokens": 0, "draft_policy": "fixed", '
     '"draft_quantization": "mxfp4", "draft_vocab": 64}', None),
    ('{"method": "mtp", "num_speculative_tokens": 1, "model": null, "draft_policy": null}', None),
    ('{"method": "mtp", "num_speculative_tokens": 4}',
     "--speculative-config: num_speculative_tokens: 4 is not in 0..3"),
    ('{"method": "mtp", "num_speculative_tokens": -1}',
     "--speculative-config: num_speculative_tokens: -1 is not in 0..3"),
    ('{"method": "mtp", "num_speculative_tokens": "2"}',
     "--speculative-config: num_speculative_tokens: must be an integer in 0..3"),
    ('{"num_speculative_tokens": 2}', '--speculative-config: method: missing (expected "mtp")'),
    ('{"method": "ngram", "num_speculative_tokens": 2}', '--speculative-config: method: only "mtp" is supported'),
    ('{"method": "mtp", "k": 2}', '--speculative-config: unknown key "k" (stepd takes method, '
     'num_speculative_tokens, model, draft_quantization, draft_policy, draft_vocab)'),
    ('{"method": "mtp", "draft_policy": "sometimes"}',
     '--speculative-config: draft_policy: expected null, "adaptive" or "fixed"'),
    ('{"method": "mtp", "draft_quantization": "fp8"}',
     '--speculative-config: draft_quantization: expected null, "auto", "none" or "mxfp4"'),
    ('{"method": "mtp", "draft_vocab": 100}',
     "--speculative-config: draft_vocab: expected null or a multiple of 64 (0: the whole vocabulary)"),
    ('[1]', "--speculative-config: expected a JSON object"),
    ('{"method": "mtp", "method": "mtp"}', "--speculative-config: invalid JSON at column ..."),
    ('{"method": ', "--speculative-config: invalid JSON at column ..."),
]


def worker_verdict(args):
    """None when stepd-worker takes the flags, else its one-line reason"""
    r = subprocess.run([WORKER] + args + ["--check-device", "cpu"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    if r.returncode == 0:
        assert r.stdout.strip() == "cpu: available", r.stdout
        return None
    assert r.returncode == 2, "stepd-worker %s: exit %d\n%s" % (args, r.returncode, r.stdout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("stepd-worker: ")]
    assert len(lines) == 1, "stepd-worker %s: expected one reason:\n%s" % (args, r.stdout)
    return lines[0][len("stepd-worker: "):]


def serve_verdict(spec, tmp):
    """None when `stepd serve` takes the configuration, else its reason"""
    ports = [pl.free_port() for _ in range(5)]
    args = [STEPD, "serve", MODEL, "--device", "cpu", "--speculative-config", spec, "--kv-cache-memory", "64KiB",
            "--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
            "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen", "127.0.0.1:%d" % ports[3],
            "--port", str(ports[4])]
    r = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60,
                       env=dict(os.environ, TMPDIR=tmp))
    assert r.returncode == 2, "stepd serve %s: exit %d\n%s" % (spec, r.returncode, r.stdout)
    assert "started: pid" not in r.stdout, "a rank was started:\n" + r.stdout
    spec_lines = [re.sub(r"^(<\d>)?(\S+ )*?(?=--speculative-config: )", "", ln) for ln in r.stdout.splitlines()
                  if "--speculative-config: " in ln]
    if not spec_lines:
        assert re.search(KV_REFUSAL, r.stdout), "stepd serve %s: neither refused nor at the KV check:\n%s" % (
            spec, r.stdout)
        return None
    assert len(spec_lines) == 1, r.stdout
    return spec_lines[0]


def main():
    with tempfile.TemporaryDirectory(prefix="stepd-spec-config-") as tmp:
        for spec, want in CASES:
            w = worker_verdict(["--speculative-config", spec])
            s = serve_verdict(spec, tmp)
            assert w == s, "--speculative-config %s: stepd-worker says %r, stepd serve %r" % (spec, w, s)
            ok = w == want or (want and w and want.endswith("...") and w.startswith(want[:-3]))
            assert ok, "--speculative-config %s: %r, expected %r" % (spec, w, want)
            print("  %-100s %s" % (spec, "accepted by both" if want is None else "refused by both"))
    # stepd-worker --mtp K: the same range check as num_speculative_tokens
    for k, want in (("0", None), ("3", None), ("4", "--mtp: 4 is not in 0..3"), ("-1", "--mtp: -1 is not in 0..3")):
        got = worker_verdict(["--mtp", k])
        assert got == want, "stepd-worker --mtp %s: %r, expected %r" % (k, got, want)
    print("spec-config: %d configurations, the same verdict from stepd serve and stepd-worker; --mtp checked "
          "as num_speculative_tokens" % len(CASES))


if __name__ == "__main__":
    main()
