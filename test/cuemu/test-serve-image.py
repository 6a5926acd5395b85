#!/usr/bin/env python3
"""test-serve-image.py - an image served end to end by stepd-worker on the emulated CUDA
backend (issue 40; docs/GPU.md §11): `stepd serve --device cuda` on the tiny model, whose
worker loads the host emulator's build of the plugin (test/cuemu: $STEPD_PLUGIN_DIR, clang's
AddressSanitizer runtime preloaded, as run.sh runs the tests of test/gpu), plans the vision
encoder at load and serves images; a request with one image (a 14x14 view, the smallest: 1
image row of the tiny tower) sent to its engine service gives the 2 greedy tokens and their
logprobs of the same request to a `stepd serve --device cpu` worker (where another image
moves the logprobs past 4 times the tolerance).  The CUDA worker logs the encoder's memory
plan, no "not planned" workspace growth, no sanitizer report, and exits cleanly on SIGTERM.

The request goes to the worker's engine service (the coordinator's wire: preprocessed
views), not through the OpenAI door: the door's processor makes a 728x728 global view of
every image (common/image/image.h), 2704 patches, whose encoding on the emulator did not end
within 300 s here.

usage: test-serve-image.py PLUGIN ASAN_RT   (the paths meson gives; BUILD_ROOT, SRC_ROOT set)
"""
import hashlib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "deploy"))
import proclib as pl  # noqa: E402
import test_serve_images as si  # noqa: E402

TOKENS = 2          # greedy tokens compared: few, each decode step is emulated
SIDE = 14           # the smallest view: 1 patch, 1 image token
IMAGE_ROWS = 1
IMAGE_TOKEN = 4000  # models/tiny-step/config.json image_token_id
# the chosen tokens' logprobs, CUDA (BF16 activations into the GEMMs) against the CPU
LP_TOL = 0.05


def serve(d, device, env):
    ports = [pl.free_port() for _ in range(5)]
    argv = [si.STEPD, "serve", si.MODEL, "--device", device, "--threads", "1",
            "--max-model-len", "512", "--max-num-seqs", "2", "--kv-cache-memory", "16MiB",
            "--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
            "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen", "127.0.0.1:%d" % ports[3],
            "--port", str(ports[4])]
    p = pl.Proc("serve-" + device, argv, dict(os.environ, TMPDIR=d, **env), d)
    pl.wait_until(lambda: "startup complete in" in p.text() or p.p.poll() is not None, 300,
                  "startup complete", step=0.05)
    assert p.p.poll() is None, p.text()[-4000:]
    return p


def engine_of(p):
    """the worker's engine socket and the control key, from the serve log"""
    log = p.text()
    sock = re.search(r"engine service listening on unix:(\S+)", log).group(1)
    key = open(re.search(r"control key in (\S+)", log).group(1)).read().strip()
    return sock, key


def ask(p, k=7):
    """TOKENS greedy tokens of a prompt with one image of a SIDE x SIDE view (IMAGE_ROWS
    <im_patch> rows of the tiny tower) sent to the worker's engine service: the coordinator's wire, whose views
    are the preprocessed ones (`stepd serve` would send the 728 global view of any image,
    which the emulator takes minutes to encode)"""
    import grpc
    sock, key = engine_of(p)
    rgb = bytes((x * k + y * 13 + c * 50) % 256 for y in range(SIDE) for x in range(SIDE) for c in range(3))
    img = [IMAGE_TOKEN] * IMAGE_ROWS
    ids = [5, 6, 7] + img + [8, 9]
    req = pl.pb.GenerateRequest(
        request_id="img%d" % k, token_ids=pl.pb.TokenIds(ids=ids),
        sampling_params=pl.pb.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=1),
        images=[pl.pb.ImageInput(sha256=hashlib.sha256(rgb).digest(), token_ids=img, token_position=3,
                                 views=[pl.pb.ImageView(width=SIDE, height=SIDE, rgb=rgb)])])
    eng = pl.pbg.EngineStub(grpc.insecure_channel("unix:" + sock))
    toks, lps, final = [], [], None
    for m in eng.Generate(req, metadata=[("authorization", "Bearer " + key)], timeout=600):
        if m.HasField("chunk"):
            toks.extend(m.chunk.token_ids)
            lps.extend(lp.logprob for lp in m.chunk.logprobs)
        if m.HasField("final"):
            final = m.final
    assert final is not None and len(toks) == TOKENS and len(lps) == TOKENS, (toks, lps, final)
    return toks, lps


def served(d, plugin, asan_rt):
    p = serve(d, "cpu", {})
    try:
        ref = ask(p)
        other = ask(p, 3)
        si.stop(p)
    finally:
        p.kill()
    moved = max(abs(a - b) for a, b in zip(ref[1], other[1]))
    print("   cpu: tokens %r, logprobs %s; another image moves them by up to %.3f" %
          (ref[0], " ".join("%.4f" % x for x in ref[1]), moved))
    assert moved > 4 * LP_TOL, "another image moves the logprobs by %g only: the comparison would not see it" % moved

    plugdir = os.path.join(d, "plugin")
    os.mkdir(plugdir)
    os.symlink(plugin, os.path.join(plugdir, "libstepd-cuda.so"))
    env = {"STEPD_PLUGIN_DIR": plugdir, "LD_PRELOAD": asan_rt, "STEPD_TEST_EMULATED": "1",
           "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0",
           "CUEMU_MEM_BYTES": str(2 << 30)}
    p = serve(d, "cuda", env)
    try:
        got = ask(p)
        diff = max(abs(a - b) for a, b in zip(ref[1], got[1]))
        print("   cuda (emulated): tokens %r, logprobs %s: max difference %.2g (tolerance %g)" %
              (got[0], " ".join("%.4f" % x for x in got[1]), diff, LP_TOL))
        assert got[0] == ref[0] and diff <= LP_TOL, (got, ref)
        log = p.text()
        assert "images served" in log and "bytes of device memory planned" in log, log[-4000:]
        assert "not planned" not in log, log[-4000:]
        si.stop(p)
    finally:
        p.kill()
    print("   the emulated CUDA worker: the CPU worker's tokens, the encoder planned, nothing grew")


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    pl.run_cases([("one image through stepd-worker on the emulated CUDA backend", served,
                   os.path.abspath(sys.argv[1]), sys.argv[2])], "stepd-cuemu-serve-", 6000)
    print("an image served on the emulated CUDA backend: the CPU worker's tokens")


if __name__ == "__main__":
    main()
