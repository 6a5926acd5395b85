#!/usr/bin/env python3
"""test_serve_vllm.py - `stepd serve` with vLLM's command lines for Step-3.7-Flash.

  1. the seed's line: the command line that ships with the Step-3.7-Flash MXFP4 checkpoint,
     word for word (only the model path changed, `--device cpu` and the test's ports added)
     on the tiny model; a chat over HTTP with tools and reasoning; the verification signs in
     the log and in /metrics: start-up complete, the MTP layers detected and sharing the
     target's embedding, every flag without a meaning for stepd logged once with what stepd
     does instead, spec-decode metrics with a mean acceptance length.  The tiny model's
     config.json says max_position_embeddings 4096 where the checkpoint says 262144, so the
     line runs on a copy of it whose config says 262144 (the same weights),
     and the unchanged tiny model refuses the line's --max-model-len 8192 naming its limit.
  2. the 8-way recipe line (--tensor-parallel-size 8 --enable-expert-parallel) likewise on
     stepd-mkmodel's narrow8 model, 8 CPU ranks over UCX on the loopback.
  3. the four settings that can never serve (a bad key in --speculative-config, a bad
     draft_policy, --device cuda on a machine without a GPU or the CUDA plugin, a KV budget
     below one sequence) end `stepd serve` with exit status 2 and the reason before any
     rank starts (the time to exit is printed, not asserted); an unknown flag names the
     nearest one in one line; --port-offset moves every port; `stepctl wait-ready` says why
     the server is not ready and stops waiting when every group was given up.

  test_serve_vllm.py [--only seed,recipe8,refusals]
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)
MODEL = os.path.join(ROOT, "models", "tiny-step")
STEPD = os.path.abspath(dl.build_binary("stepd"))
WORKER = os.path.abspath(dl.build_binary("stepd-worker"))
MKMODEL = os.path.abspath(dl.build_binary("stepd-mkmodel"))
STEPCTL = os.path.abspath(dl.build_binary("stepctl"))

SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'
# the checkpoint's own command line (after `stepd serve MODEL`), word for word
SEED = ["--served-model-name", "step3p7-flash", "--tensor-parallel-size", "1", "--disable-cascade-attn",
        "--reasoning-parser", "step3p5", "--enable-auto-tool-choice", "--tool-call-parser", "step3p5",
        "--speculative_config", SPEC, "--gpu-memory-utilization", "0.97", "--enforce-eager",
        "--max-model-len", "8192", "--max-num-batched-tokens", "2048", "--linear-backend", "marlin",
        "--trust-remote-code"]
# vLLM's recipe for Step-3.7-Flash on 8 GPUs
RECIPE8 = ["--served-model-name", "step3p7-flash", "--tensor-parallel-size", "8", "--enable-expert-parallel",
           "--disable-cascade-attn", "--reasoning-parser", "step3p5", "--tool-call-parser", "step3p5",
           "--enable-auto-tool-choice", "--speculative-config", SPEC, "--trust-remote-code"]
# the flags with no meaning for stepd, each accepted with one log line
NOTES = {"--disable-cascade-attn": "no cascade attention",
         "--enforce-eager": "replay CUDA graphs for decode and verify steps",
         "--linear-backend marlin": "picks its own matmul kernels", "--trust-remote-code": "runs no code"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def ports_args():
    ports = [pl.free_port() for _ in range(5)]
    return ports, ["--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
                   "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen",
                   "127.0.0.1:%d" % ports[3], "--port", str(ports[4])]


def post(port, path, body, timeout=120):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text, name):
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else None


def long_context_copy(src, d):
    """The model's files, its config.json saying max_position_embeddings 262144 (as the
    Step-3.7-Flash checkpoint's does)."""
    dst = os.path.join(d, os.path.basename(src.rstrip("/")))
    os.mkdir(dst)
    for f in os.listdir(src):
        if f != "config.json":
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))     # the loader refuses links out
    cfg = json.load(open(os.path.join(src, "config.json")))

    def raise_len(o):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("max_position_embeddings", "max_seq_len") and isinstance(v, int):
                    o[k] = 262144
                else:
                    raise_len(v)
    raise_len(cfg)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    return dst


def serve_line(d, model, line, ranks, mtp_layers, timeout):
    """Run `stepd serve MODEL LINE --device cpu` + ports; chat with tools and reasoning; the
    verification signs."""
    ports, pargs = ports_args()
    pub, adm, _, met, http = ports
    argv = [STEPD, "serve", model] + line + ["--device", "cpu"] + pargs
    print("   " + " ".join(a if " " not in a else "'%s'" % a for a in argv[1:]))
    p = pl.Proc("serve", argv, dict(os.environ, TMPDIR=d), d)
    try:
        t0 = time.monotonic()
        pl.wait_until(lambda: "startup complete in" in p.text() or p.p.poll() is not None, timeout,
                      "startup complete", step=0.05)
        assert p.p.poll() is None, "stepd serve exited %s:\n%s" % (p.p.returncode, p.text()[-3000:])
        t_up = time.monotonic() - t0
        code, models = pl.http_get(http, "/v1/models")
        assert code == 200 and '"step3p7-flash"' in models, (code, models)
        answers = []
        for q in ("What is the weather in Paris? Think first.", "And in Berlin, step by step?",
                  "Tell me about Rome's weather."):
            code, body = post(http, "/v1/chat/completions", {
                "model": "step3p7-flash", "messages": [{"role": "user", "content": q}], "tools": TOOLS,
                "tool_choice": "auto", "reasoning_effort": "high", "max_tokens": 48, "temperature": 0})
            assert code == 200, (code, body)
            msg = body["choices"][0]["message"]
            # the reasoning parser splits the think block off the content (the tiny model
            # rarely closes it): the reply carries reasoning_content
            assert isinstance(msg.get("reasoning_content"), str) and msg["reasoning_content"], msg
            assert body["usage"]["completion_tokens"] > 0, body
            answers.append(msg)
        log = p.text()
        for needle in ("startup complete in", "MTP detected: %d draft layer" % mtp_layers,
                       "Detected MTP model. Sharing target model embedding weights with the draft model",
                       "load plan rank %d of %d" % (ranks - 1, ranks)):
            assert needle in log, "%r not in the log:\n%s" % (needle, log[-3000:])
        for flag, what in NOTES.items():
            if flag.split()[0] in line:
                lines = [ln for ln in log.splitlines() if ("%s: " % flag) in ln]
                assert len(lines) == 1 and what in lines[0], (flag, lines)
        assert "unrecognized option" not in log and "unknown flag" not in log, log[-2000:]
        code, text = pl.http_get(met, "/metrics")
        assert code == 200, (code, text)
        drafts = metric(text, "stepd:spec_decode_num_drafts_total")
        mal = metric(text, "stepd:spec_decode_mean_acceptance_length")
        assert drafts and drafts > 0, "no drafts verified:\n" + text
        assert mal is not None and 1.0 <= mal <= 4.0, mal
        print("   started in %.1f s; 3 chats with tools and reasoning answered (reasoning %d/%d/%d chars); "
              "spec decode: %d drafts, mean acceptance length %.2f (/metrics)" %
              (t_up, *[len(a["reasoning_content"]) for a in answers], drafts, mal))
        p.p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
        assert rc == 0, "stepd serve exited %s:\n%s" % (rc, p.text()[-3000:])
    finally:
        p.kill()


def test_seed(d):
    # the unchanged tiny model: its 4096 positions refuse the line's --max-model-len 8192
    t0 = time.monotonic()
    r = subprocess.run([STEPD, "serve", MODEL] + SEED + ["--device", "cpu"] + ports_args()[1], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60, env=dict(os.environ, TMPDIR=d))
    assert r.returncode == 2 and "--max-model-len 8192 is above the model's max_position_embeddings 4096" \
        in r.stdout and "--allow-long-max-model-len" in r.stdout, (r.returncode, r.stdout)
    print("   tiny-step (4096 positions): exit %d in %.2f s: %s" % (
        r.returncode, time.monotonic() - t0, [ln for ln in r.stdout.splitlines() if "max_position" in ln][0]))
    serve_line(d, long_context_copy(MODEL, d), SEED, 1, 3, 120)


def test_recipe8(d):
    model = os.path.join(d, "narrow8")
    gen = subprocess.run([MKMODEL, "--preset", "narrow8", "--mtp", "1", "--tokenizer", MODEL, "--out", model],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert gen.returncode == 0, gen.stdout
    serve_line(d, model, RECIPE8, 8, 1, 240)
    log = open(os.path.join(d, "serve.log"), errors="replace").read()
    assert "num_speculative_tokens 3, but the checkpoint has 1 usable MTP layer: speculating 1 token" in log


def refused(d, extra, needle, what):
    ports, pargs = ports_args()
    t0 = time.monotonic()
    r = subprocess.run([STEPD, "serve", MODEL, "--device", "cpu"] + extra + pargs, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=60, env=dict(os.environ, TMPDIR=d))
    dt = time.monotonic() - t0
    assert r.returncode == 2, "%s: exit %d:\n%s" % (what, r.returncode, r.stdout)
    assert re.search(needle, r.stdout), "%s: %r not in:\n%s" % (what, needle, r.stdout)
    assert "group g0" not in r.stdout and "started: pid" not in r.stdout, "a rank was started:\n" + r.stdout
    line = [ln for ln in r.stdout.splitlines() if re.search(needle, ln)][0]
    print("   %-34s exit %d in %.2f s: %s" % (what + ":", r.returncode, dt, re.sub(r"^<\d>", "", line)))


def test_refusals(d):
    # docs/OPERATIONS.md carries the table the declarations make
    doc = open(os.path.join(ROOT, "docs", "OPERATIONS.md")).read()
    m = re.search(r"<!-- stepd --help-vllm-flags -->\n(.*?)<!-- end of stepd --help-vllm-flags -->", doc, re.S)
    table = subprocess.run([STEPD, "--help-vllm-flags"], stdout=subprocess.PIPE, text=True).stdout
    assert m and m.group(1) == table, "docs/OPERATIONS.md §1.1 differs from stepd --help-vllm-flags:\n" + table
    for flag in ("--disable-cascade-attn", "--speculative-config", "--kv-cache-dtype", "--limit-mm-per-prompt",
                 "--enable-eplb", "--async-scheduling", "--default-chat-template-kwargs", "--kv-cache-memory"):
        assert "| `%s" % flag in table, flag
    refused(d, ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3, "k": 2}'],
            r'--speculative-config: unknown key "k"', "bad key in --speculative-config")
    refused(d, ["--speculative-config", '{"method": "mtp", "draft_policy": "sometimes"}'],
            r"--speculative-config: draft_policy: expected", "bad draft_policy")
    chk = subprocess.run([WORKER, "--check-device", "cuda:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    if chk.returncode == 0:
        print("   --device cuda: this machine has a CUDA device (%s): not a refusal here" % chk.stdout.strip())
    else:
        refused(d, ["--device", "cuda"], r"--device cuda: rank 0 of 1 needs cuda:0: ", "--device cuda without a GPU")
    refused(d, ["--kv-cache-memory", "64KiB"], r"--kv-cache-memory \(rank 0\): KV cache: .* need at least",
            "a KV budget below one sequence")
    refused(d, ["--speculative_config={\"num_speculative_tokens\": 2}"], r"--speculative-config: method: missing",
            "no method (--a_b=value spelling)")
    refused(d, ["--speculative-config", '{"method": "mtp", "draft_vocab": 8192}'],
            r"--speculative-config: draft_vocab: 8192 is above the model's vocabulary \(4096 tokens\)",
            "draft_vocab above the vocabulary")
    refused(d, ["--worker-arg", "--no-such-flag"], r"a rank would refuse its flags: unrecognized option "
            r"'--no-such-flag'", "a worker flag the ranks refuse")
    refused(d, ["--worker-arg", "--max-seqs", "--worker-arg", "0"], r"a rank would refuse its flags: --max-seqs '0'",
            "a worker value the ranks refuse")
    refused(d, ["--kv-cache-dtype", "fp8"], r"--kv-cache-dtype 'fp8': stepd stores the KV cache as auto",
            "a KV dtype stepd lacks")
    refused(d, ["--quantization", "awq"], r"--quantization awq: stepd serves the checkpoint's own weights",
            "a quantization stepd lacks")
    refused(d, ["--limit-mm-per-prompt", '{"audio": 1}'], r"--limit-mm-per-prompt: audio: stepd takes images only",
            "audio > 0")
    refused(d, ["--media-fetch-timeout", "0"], r"--media-fetch-timeout: at least 0.001 seconds",
            "no time for an image URL's fetch")
    refused(d, ["--media-fetch-timeout", "10s"],
            r"--media-fetch-timeout: expected seconds in \[0, 86400\], got '10s'", "a fetch timeout not a number")
    refused(d, ["--enable-prefix-cachin"], r"unknown flag --enable-prefix-cachin: did you mean "
            r"--enable-prefix-caching\?", "an unknown flag")
    r = subprocess.run([STEPD, "serve", MODEL, "--enable-prefix-cachin"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    assert len(r.stdout.strip().splitlines()) == 1, "more than one line for an unknown flag:\n" + r.stdout


def test_worker_settings(d):
    """The worker settings the docs name, given to `stepd serve` directly (no --worker-arg)."""
    ports, pargs = ports_args()
    extra = ["--kv-cache-dtype", "fp32", "--kv-cache-memory", "64MiB", "--no_enable_prefix_caching",
             "--logprobs-mode=processed_logprobs", "--max-waiting", "7", "--block-size", "32", "--exact",
             "--default-chat-template-kwargs", '{"reasoning_effort": "low"}']
    p = pl.Proc("serve", [STEPD, "serve", MODEL, "--device", "cpu", "--threads", "1"] + extra + pargs,
                dict(os.environ, TMPDIR=d), d)
    try:
        pl.wait_until(lambda: "startup complete in" in p.text() or p.p.poll() is not None, 120, "startup complete",
                      step=0.05)
        log = p.text()
        assert p.p.poll() is None, log[-3000:]
        pid = int(re.search(r"group g0 rank 0 started: pid (\d+)", log).group(1))
        argv = open("/proc/%d/cmdline" % pid).read().split("\0")
        for a, b in (("--kv-cache-dtype", "fp32"), ("--kv-cache-memory", str(64 << 20)), ("--max-waiting", "7"),
                     ("--logprobs-mode", "processed_logprobs"), ("--block-size", "32")):
            assert a in argv and argv[argv.index(a) + 1] == b, (a, b, argv)
        assert "--no-enable-prefix-caching" in argv and "--exact" in argv, argv
        assert re.search(r"KV cache \(FP32, --kv-cache-memory\)", log), log[-3000:]
        assert "(8 running + 7 waiting)" in log, log[-3000:]
        print("   rank 0 runs with %s" % " ".join(argv[argv.index("--kv-cache-dtype"):]))
        # --default-chat-template-kwargs: under a request's own chat_template_kwargs
        msgs = [{"role": "user", "content": "Hello there"}]

        def toks(**kw):
            code, body = post(ports[4], "/tokenize", dict(model="tiny-step", messages=msgs, **kw))
            assert code == 200, (code, body)
            return body["tokens"]
        dflt, low = toks(), toks(chat_template_kwargs={"reasoning_effort": "low"})
        high = toks(chat_template_kwargs={"reasoning_effort": "high"})
        assert dflt == low and dflt != high, (dflt, low, high)
        print("   --default-chat-template-kwargs: a chat without kwargs renders as reasoning_effort low "
              "(%d tokens), a request's own \"high\" wins" % len(dflt))
        p.p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        p.kill()


def test_port_in_use(d):
    """A port another process holds: one line naming the flag that sets it, no gRPC error dump."""
    import socket
    for flag in ("--listen", "--admin-listen", "--control-listen", "--metrics-listen", "--port"):
        ports, pargs = ports_args()
        i = ["--listen", "--admin-listen", "--control-listen", "--metrics-listen", "--port"].index(flag)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", ports[i]))
        s.listen()
        try:
            t0 = time.monotonic()
            r = subprocess.run([STEPD, "serve", MODEL, "--device", "cpu"] + pargs, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, timeout=60, env=dict(os.environ, TMPDIR=d))
        finally:
            s.close()
        name = "--host/--port" if flag == "--port" else flag
        assert r.returncode == 1, (flag, r.returncode, r.stdout)
        assert re.search(r"%s .*%d: address in use \(another stepd\? --port-offset N moves every port" %
                         (re.escape(name), ports[i]), r.stdout), (flag, r.stdout)
        # one line names the port (no gRPC-core dump); the others are the start-up's info lines
        lines = r.stdout.splitlines()
        errors = [ln for ln in lines if "address in use" in ln or "rror" in ln]
        assert "chttp2" not in r.stdout and len(errors) == 1 and len(lines) <= 8, r.stdout
        assert "started: pid" not in r.stdout, "a rank was started:\n" + r.stdout
        print("   %-16s in use: exit 1 in %.2f s: %s" % (flag, time.monotonic() - t0, errors[0]))


def test_port_offset(d):
    off = 3
    # free ports once moved: the flags name them less the offset
    ports = [pl.free_port() - off for _ in range(5)]
    pargs = ["--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
             "--control-listen", "127.0.0.1:%d" % ports[2], "--metrics-listen", "127.0.0.1:%d" % ports[3],
             "--port", str(ports[4])]
    argv = [STEPD, "--insecure-control", "--port-offset", str(off)] + pargs
    p = pl.Proc("stepd", argv, dict(os.environ, TMPDIR=d), d)
    try:
        pl.wait_until(lambda: "listening: " in p.text() or p.p.poll() is not None, 30,
                      "the coordinator listening", step=0.05)
        log = p.text()
        assert p.p.poll() is None, "stepd exited %s:\n%s" % (p.p.returncode, log[-2000:])
        code, _ = pl.wait_until(lambda: (lambda r: r if r[0] else None)(pl.http_get(ports[3] + off, "/healthz")),
                                30, "/healthz on --metrics-listen + offset", step=0.05)
        code2, _ = pl.wait_until(lambda: (lambda r: r if r[0] else None)(pl.http_get(ports[4] + off, "/health")),
                                 30, "/health on --port + offset", step=0.05)
        for port in ports[:3]:
            assert ":%d" % (port + off) in log, (port + off, log[-2000:])
        print("   --port-offset %d: metrics on %d (%d), HTTP on %d (%d), gRPC %s" %
              (off, ports[3] + off, code, ports[4] + off, code2, [x + off for x in ports[:3]]))
        p.p.send_signal(signal.SIGTERM)
        p.wait(30)
    finally:
        p.kill()


def wait_ready(pub, adm, timeout):
    t0 = time.monotonic()
    r = subprocess.run([STEPCTL, "--addr", "127.0.0.1:%d" % pub, "--admin-addr", "127.0.0.1:%d" % adm, "wait-ready",
                        "--timeout", str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=timeout + 30)
    return r, time.monotonic() - t0


def test_wait_ready(d):
    # a rank that exits 2 at every start (a worker that passes stepd serve's check of its
    # flags, then refuses to run): the group is given up; wait-ready says why and does not
    # wait out its timeout
    wrapper = os.path.join(d, "refusing-worker")
    open(wrapper, "w").write("#!/bin/sh\ncase \" $* \" in *\" --check-device \"*) exec '%s' \"$@\" ;; esac\n"
                             "echo 'stepd-worker: refused at start' >&2\nexit 2\n" % WORKER)
    os.chmod(wrapper, 0o755)
    ports, pargs = ports_args()
    p = pl.Proc("serve", [STEPD, "serve", MODEL, "--device", "cpu", "--worker-binary", wrapper] + pargs,
                dict(os.environ, TMPDIR=d), d)
    try:
        r, dt = wait_ready(ports[0], ports[1], 60)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        assert re.search(r"not ready and will not be: group g0: failed \(not restarted: rank 0 .*exited with "
                         r"status 2", r.stderr), r.stderr
        print("   given up: wait-ready exit %d after %.2f s: %s" % (r.returncode, dt, r.stderr.strip().splitlines()[-1]))
    finally:
        p.kill()
    # nothing listening: the reason names the address
    r, dt = wait_ready(ports[0], ports[1], 1)
    assert r.returncode == 1 and "cannot reach 127.0.0.1:%d" % ports[0] in r.stderr, r.stderr
    # a server that comes up: "ready"
    ports, pargs = ports_args()
    p = pl.Proc("serve2", [STEPD, "serve", MODEL, "--device", "cpu"] + pargs, dict(os.environ, TMPDIR=d), d)
    try:
        r, dt = wait_ready(ports[0], ports[1], 60)
        assert r.returncode == 0 and r.stdout.strip() == "ready", (r.returncode, r.stdout, r.stderr)
        print("   a starting server: ready after %.2f s; on the way: %s" % (dt, r.stderr.strip().replace("\n", " | ")))
        p.p.send_signal(signal.SIGTERM)
        p.wait(60)
    finally:
        p.kill()


def main():
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    cases = (("the seed's command line on the tiny model", test_seed, "seed"),
             ("the 8-way recipe line on narrow8", test_recipe8, "recipe8"),
             ("settings that can never serve, flags", test_refusals, "refusals"),
             ("--port-offset", test_port_offset, "refusals"),
             ("a port in use names its flag", test_port_in_use, "refusals"),
             ("the worker's settings directly", test_worker_settings, "refusals"),
             ("stepctl wait-ready says why", test_wait_ready, "refusals"))
    pl.run_cases([(t, fn) for t, fn, k in cases if not only or k in only], "stepd-serve-vllm-", 5000)
    print("stepd serve with vLLM's command lines: all checks passed")


if __name__ == "__main__":
    main()
