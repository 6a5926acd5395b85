#!/usr/bin/env python3
"""test_prefix_mtp_http.py - the prefix cache under MTP with the default draft policy, over HTTP.

`stepd serve models/tiny-step --speculative-config '{"method":"mtp","num_speculative_tokens":3}'`
(the default "draft_policy": "adaptive"), a 5-turn chat, greedy: every turn after the first
reports usage.prompt_tokens_details.cached_tokens >= 90 % of the previous turn's prompt, and
the answers equal those of the same conversation on a server with the prefix cache off
(`--no-enable-prefix-caching`, a worker flag).  Before, a drafting greedy request reused only
blocks whose MTP KV was final, which the adaptive policy leaves out wherever it drafted
nothing: 0 cached tokens.  Sampled conversations (temperature 0.8, no seed) reuse >= 90 %
too, under the default policy and under "fixed" (docs/ARCHITECTURE.md §6.3: only a client's
seed under "fixed" keeps to blocks whose MTP KV is final).

Usage: test_prefix_mtp_http.py STEPD_BINARY MODEL_DIR
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy"))
import proclib as pl  # noqa: E402  (free ports)

TURNS = 5
SPEC = '{"method":"mtp","num_speculative_tokens":3}'
# an agent's long system prompt: the conversation's prompts run from about 400 tokens up, as
# the did (330-590), so that whole 16-token blocks make up most of each one
SYSTEM = " ".join([
    "You are a careful travel guide for the northern plains.",
    "Answer in plain words, name the places you mean, and say when you are not sure.",
    "The region has three great rivers, the Amber, the Slate and the Willow, which meet near",
    "the old market town of Ferrow before they run east to the sea through a wide delta.",
    "Along their banks lie farms, mills, ferries and small harbours; the roads follow the",
    "higher ground between the valleys, and the bridges are few and old.",
] * 5)
QUESTIONS = [
    "Tell me about the rivers of the northern plains and the towns along them.",
    "Which of those towns is the oldest, and why did people settle there?",
    "Describe the bridges that cross the widest river, one by one.",
    "What do the farmers grow in the valleys between the rivers?",
    "Summarise everything so far in a few sentences for a traveller.",
]


def http(port, path, body=None, timeout=120.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


class Server:
    def __init__(self, stepd, model, d, name, extra, spec=SPEC):
        # a free port can be taken by a test running beside this one before stepd binds it:
        # then (and only then) start again on other ports
        for attempt in range(3):
            try:
                return self.start(stepd, model, d, name, extra, spec)
            except AssertionError as e:
                if attempt == 2 or "in use" not in str(e):
                    raise
                self.f.close()

    def start(self, stepd, model, d, name, extra, spec):
        ports = [pl.free_port() for _ in range(5)]
        self.port = ports[4]
        self.log = os.path.join(d, name + ".log")
        argv = [stepd, "serve", model, "--threads", "1", "--speculative-config", spec,
                "--listen", "127.0.0.1:%d" % ports[0], "--admin-listen", "127.0.0.1:%d" % ports[1],
                "--control-listen", "127.0.0.1:%d" % ports[2],
                "--metrics-listen", "127.0.0.1:%d" % ports[3], "--port", str(ports[4])] + extra
        self.f = open(self.log, "w")
        self.p = subprocess.Popen(argv, stdout=self.f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=dict(os.environ, TMPDIR=d))
        end = time.monotonic() + 120
        while time.monotonic() < end:     # a wait for an event (readiness), not a measurement
            if self.p.poll() is not None:
                raise AssertionError("%s exited %s:\n%s" % (name, self.p.returncode, self.text()))
            st, _ = http(self.port, "/healthz", timeout=2)
            if st == 200:
                return
            time.sleep(0.2)
        raise AssertionError("%s not ready within 120 s:\n%s" % (name, self.text()))

    def text(self):
        self.f.flush()
        return open(self.log, errors="replace").read()[-4000:]

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.f.close()


def conversation(srv, sampling=None):
    """The 5 turns: (prompt_tokens, cached_tokens, the answer as the API returned it);
    greedy unless sampling (request fields) says otherwise."""
    msgs, turns = [{"role": "system", "content": SYSTEM}], []
    for q in QUESTIONS[:TURNS]:
        msgs.append({"role": "user", "content": q})
        st, body = http(srv.port, "/v1/chat/completions",
                        dict({"model": "tiny-step", "messages": msgs, "max_tokens": 40, "temperature": 0},
                             **(sampling or {})))
        assert st == 200, "chat: %s %s\n%s" % (st, body, srv.text())
        r = json.loads(body)
        m = r["choices"][0]["message"]
        u = r["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append((u["prompt_tokens"], cached, m))
        reply = {"role": "assistant", "content": m.get("content") or ""}
        if m.get("reasoning_content"):
            reply["reasoning_content"] = m["reasoning_content"]
        msgs.append(reply)
    return turns


def main():
    stepd, model = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    if not os.path.exists(os.path.join(model, "config.json")):
        print("SKIP: no checkpoint in %s" % model)
        return 77
    d = tempfile.mkdtemp(prefix="prefix-mtp-http-")
    try:
        res = {}
        for name, extra in (("cache-on", []), ("cache-off", ["--worker-arg", "--no-enable-prefix-caching"]),
                            ("fixed", [])):
            srv = Server(stepd, model, d, name, extra,
                         SPEC[:-1] + ',"draft_policy":"fixed"}' if name == "fixed" else SPEC)
            try:
                if name != "fixed":
                    res[name] = conversation(srv)
                # sampled: exact in distribution whatever the drafts, so the trunk's prefix is
                # reused under either policy; "fixed" with no seed (the worker draws one)
                if name != "cache-off":
                    res[name + " sampled"] = conversation(srv, {"temperature": 0.8, "top_p": 0.95})
            finally:
                srv.stop()
        on, off = res["cache-on"], res["cache-off"]
        for t in range(TURNS):
            print("turn %d: prompt %d tokens, cached %d (cache off: %d)" % (t + 1, on[t][0], on[t][1], off[t][1]))
        for t in range(TURNS):
            assert on[t][0] == off[t][0], "turn %d: prompt %d vs %d tokens" % (t + 1, on[t][0], off[t][0])
            assert on[t][2] == off[t][2], "turn %d: the answer differs with the cache off:\n%r\n%r" % (
                t + 1, on[t][2], off[t][2])
            assert off[t][1] == 0, "turn %d: %d cached tokens with the cache off" % (t + 1, off[t][1])
            if t > 0:
                prev = on[t - 1][0]
                assert on[t][1] * 10 >= prev * 9, "turn %d: %d cached tokens, under 90 %% of the previous " \
                    "prompt's %d" % (t + 1, on[t][1], prev)
        for name in ("cache-on sampled", "fixed sampled"):
            t = res[name]
            print("%s: cached %s of previous prompts %s" % (name, [x[1] for x in t[1:]], [x[0] for x in t[:-1]]))
            for i in range(1, TURNS):
                assert t[i][1] * 10 >= t[i - 1][0] * 9, "%s, turn %d: %d cached tokens, under 90 %% of the " \
                    "previous prompt's %d" % (name, i + 1, t[i][1], t[i - 1][0])
                # the trunk's prefix: every whole block (16 tokens, the worker's default) of the
                # previous prompt, not one block less as where the MTP KV must be final (the
                # worker drew the seed, so the tokens need not reproduce one)
                whole = t[i - 1][0] // 16 * 16
                assert t[i][1] >= whole, "%s, turn %d: %d cached tokens, the previous prompt's whole blocks " \
                    "are %d" % (name, i + 1, t[i][1], whole)
        print("prefix cache under MTP (adaptive and fixed policies) over HTTP: ok")
        return 0
    except AssertionError:
        for f in sorted(os.listdir(d)):
            if f.endswith(".log"):
                print("---- %s\n%s" % (f, open(os.path.join(d, f), errors="replace").read()[-3000:]))
        raise
    finally:
        shutil.rmtree(d, True)


if __name__ == "__main__":
    sys.exit(main())
