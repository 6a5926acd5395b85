#!/usr/bin/env python3
"""soak.py --duration SECONDS [--seed N] [--clients N] [--json FILE] - the soak profile of
test/chaos/report (docs/RELIABILITY.md "Soak"): mixed traffic on both doors while worker
ranks are killed and restarted and the coordinator is restarted, then one table.

The rig: one stepd (fixed ports, so that it can be restarted in place) with the tokenizer
of the tiny model, and two groups of the real stepd-worker on the CPU with the bundled tiny
model: "solo" (one rank) and "tp2" (two ranks over UCX).

Traffic (--clients threads, each drawing a kind at random until the duration has passed;
the duration bounds the traffic, nothing is asserted about time):
  gRPC door  g-stream (to the end), g-cancel (client cancel after a token or two),
             g-deadline (a deadline of 20-300 ms), g-abort (Inference.Abort by id while
             streaming), g-prefix (a shared 48-token prefix: prefix-cache hits, counted from
             the Final's usage.cached_tokens), g-logprobs
             (top 3), g-tools (chat input with a tool definition), g-malformed (fields out
             of range, or random bytes as the request message);
  HTTP door  h-chat, h-stream, h-cancel (the client closes mid-stream), h-tools,
             h-logprobs (streamed, top_logprobs 3), h-prefix, h-malformed (bad JSON, bad
             fields, a wrong content type, an unknown model).
Faults, one every --fault-every seconds (duration / 6 within 3..30): SIGKILL of tp2 rank 1
(rank 0 registers again by itself; rank 1 restarted), SIGTERM of the coordinator (it drains
and its ranks shut down; all restarted on the same ports), SIGTERM of tp2 rank 0 while its
group serves (both ranks restarted), SIGKILL of the coordinator (the ranks keep their
processes and are adopted).  Each kind once first, then cycles of eight (rank 1, rank 0,
rank 1, coordinator SIGKILL, rank 1, rank 0, rank 1, coordinator SIGTERM): in a long run a
coordinator lives four slices and the solo rank eight.

The ledger: every request the server accepted (a gRPC call; an HTTP request answered with
a status line) must end with exactly ONE terminal status: a gRPC call one Final then OK, or
one error status (DEADLINE_EXCEEDED just after a Final is the known race of the client's
own deadline; the 60 s deadline of the other kinds firing means the call was lost); an
HTTP answer its response, a stream exactly one "data: [DONE]".  Counted
per request id; 0 (lost) or 2+ (duplicated) fails the run.  An HTTP connection reset is the
terminal status of a request caught by a coordinator SIGKILL (outside such a window it is
a failure; gRPC's client turns the same into UNAVAILABLE itself); a call that never got a
connection (refused while the coordinator is down, or failed fast by a gRPC channel backing
off from reconnecting) is "not accepted".

Processes: RSS, open fds and threads (from /proc) of every process at its start (once its
groups are ready), at its warm-up point (the first fault boundary it lived through: a whole slice of traffic served)
and at its end (the last sample before it was stopped, or the end of the run).  Growth from
the warm-up point to the end, for processes that lived past it: more than FD_SLACK fds or
RSS over warm-up x 1.25 + RSS_SLACK_MIB fails the run (a sanitized build: + ASan's
quarantine).  Sanitizer reports: every process's log (stderr) is scanned for ASan, LSan,
UBSan and TSan lines after it exited (LSan reports at exit).
Exit status: 0 when the ledger holds, no growth threshold is crossed, no sanitizer line
was found and every logprobs request served carried logprobs; 1 otherwise.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))

import stepd_harness as h  # noqa: E402  (exits 77 without grpcio)

grpc, pb = h.grpc, h.pb
SC = grpc.StatusCode
FD_SLACK = 16
RSS_SLACK_MIB = 32
ASAN_QUARANTINE_MIB = 256
SANITIZER = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer)|WARNING: ThreadSanitizer|runtime error: |"
                       r"SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer|ThreadSanitizer)")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
PREFIX_IDS = [(7 * i + 11) % 3000 + 5 for i in range(48)]
PREFIX_TEXT = "You are a careful assistant. Answer in one short sentence, and keep every answer plain. " * 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sample(pid):
    """(RSS KiB, open fds, threads) of pid from /proc, or None when it is gone."""
    try:
        rss, state = 0, ""
        with open("/proc/%d/status" % pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("State:"):
                    state = line.split()[1]
        if state in ("Z", "X") or not rss:
            return None          # exiting: its memory is already being torn down
        return rss, len(os.listdir("/proc/%d/fd" % pid)), len(os.listdir("/proc/%d/task" % pid))
    except OSError:
        return None


class Proc:
    """A process of the rig: its samples, log and end."""

    def __init__(self, role, popen, log):
        self.role, self.p, self.log = role, popen, log
        self.start = None       # once its groups are ready (Rig.wait_groups)
        self.warm = None
        self.end = None
        self.exit = None

    def take(self, boundary):
        v = sample(self.p.pid) if self.p.poll() is None else None
        if v is None:
            return
        if boundary and self.warm is None:
            self.warm = v
        self.end = v


class Rig:
    def __init__(self, workdir):
        self.dir = workdir
        self.ports = {k: free_port() for k in ("public", "admin", "control", "metrics", "http")}
        self.key_file = os.path.join(workdir, "control-key")
        h.write_key(self.key_file)
        self.procs = []          # every Proc ever started
        self.coord = None
        self.s = None            # the harness's view of the live coordinator (channels, stubs)
        self.ranks = {}          # (group, rank) -> Proc
        self.down = threading.Event()      # the coordinator is stopping or starting
        self.killed_at = []                # coordinator SIGKILL windows: [t0, t1]
        self.lock = threading.Lock()
        self.n_coord = 0
        self.start_coordinator()
        self.start_rank("solo", 0, 1)
        self.start_rank("tp2", 0, 2)
        self.start_rank("tp2", 1, 2)
        self.wait_groups()

    def start_coordinator(self):
        self.n_coord += 1
        wd = os.path.join(self.dir, "coord-%d" % self.n_coord)
        os.makedirs(wd)
        p = self.ports
        self.s = h.Stepd("--port", str(p["http"]), "--listen", "127.0.0.1:%d" % p["public"],
                         "--admin-listen", "127.0.0.1:%d" % p["admin"],
                         "--control-listen", "127.0.0.1:%d" % p["control"],
                         "--metrics-listen", "127.0.0.1:%d" % p["metrics"],
                         "--control-key-file", self.key_file, "--tokenizer", h.TOKENIZER,
                         "--served-model-name", "tiny", "--max-running", "256", "--max-queue", "256",
                         workdir=wd)
        self.coord = Proc("stepd #%d" % self.n_coord, self.s.proc, self.s.logpath)
        self.procs.append(self.coord)

    def start_rank(self, group, rank, world):
        n = sum(1 for x in self.procs if x.role.startswith("%s rank %d" % (group, rank))) + 1
        log = os.path.join(self.dir, "%s-r%d-%d.log" % (group, rank, n))
        args = ["--threads", "1"]
        if rank == 0:
            args += ["--engine-listen", "unix:%s/%s-%d.sock" % (self.dir, group, n)]
        p = self.s.start_worker(group, *args, rank=rank, world=world, log_name=os.path.relpath(log, self.s.workdir))
        pr = Proc("%s rank %d #%d" % (group, rank, n), p, p.logpath)
        self.procs.append(pr)
        self.ranks[(group, rank)] = pr
        return pr

    def wait_groups(self, timeout=120):
        def ready():
            try:
                gg = self.s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups
            except grpc.RpcError:
                return False
            return {g.group for g in gg if g.state == pb.WORKER_STATE_READY} >= {"solo", "tp2"}
        h.wait_until(ready, timeout=timeout, step=0.1, what="groups solo and tp2 ready")
        for pr in self.procs:
            if pr.start is None and pr.exit is None and pr.p.poll() is None:
                pr.start = pr.end = sample(pr.p.pid)

    def stop_proc(self, pr, sig, timeout=60, last_sample=True):
        if last_sample:
            pr.take(False)
        if pr.p.poll() is None:
            pr.p.send_signal(sig)
        try:
            pr.exit = pr.p.wait(timeout)
        except subprocess.TimeoutExpired:
            pr.p.kill()
            pr.exit = pr.p.wait()
            pr.exit = "did not exit after %s in %d s" % (signal.Signals(sig).name, timeout)

    # the faults
    def kill_rank1(self):
        self.stop_proc(self.ranks[("tp2", 1)], signal.SIGKILL)
        r0 = self.ranks[("tp2", 0)]
        h.wait_until(lambda: "registering again with the weights kept" in open(r0.log).read() or
                     r0.p.poll() is not None, timeout=30, what="tp2 rank 0 registering again")
        if r0.p.poll() is not None:
            r0.exit = r0.p.returncode
            self.start_rank("tp2", 0, 2)
        self.start_rank("tp2", 1, 2)
        self.wait_groups()

    def stop_rank0(self):
        self.ranks[("tp2", 1)].take(False)
        self.stop_proc(self.ranks[("tp2", 0)], signal.SIGTERM)
        r1 = self.ranks[("tp2", 1)]
        # rank 1 loses its group: it leaves (exits or registers again); restart what exited
        time.sleep(0.5)
        if r1.p.poll() is None:
            self.stop_proc(r1, signal.SIGTERM, last_sample=False)
        else:
            r1.take(False)
            r1.exit = r1.p.returncode
        self.start_rank("tp2", 0, 2)
        self.start_rank("tp2", 1, 2)
        self.wait_groups()

    def restart_coordinator(self, sig):
        """SIGTERM: the coordinator drains and tells its ranks to shut down (they exit, as
        under `stepd serve`), and all of them are started again; SIGKILL: the ranks keep
        their processes and the new coordinator adopts them."""
        self.down.set()
        t0 = time.time()
        for pr in self.ranks.values():
            pr.take(False)          # before the coordinator's end tells them to go
        self.s.channel.close()
        self.s.admin_channel.close()
        self.stop_proc(self.coord, sig)
        if sig != signal.SIGKILL:
            for pr in list(self.ranks.values()):
                self.stop_proc(pr, signal.SIGTERM, last_sample=False)
        self.start_coordinator()
        if sig != signal.SIGKILL:
            self.start_rank("solo", 0, 1)
            self.start_rank("tp2", 0, 2)
            self.start_rank("tp2", 1, 2)
        self.wait_groups()
        if sig == signal.SIGKILL:
            self.killed_at.append((t0, time.time()))
        self.down.clear()

    def boundary(self):
        for pr in self.procs:
            if pr.exit is None:
                pr.take(True)

    def shutdown(self):
        for pr in self.procs:
            if pr.exit is None:
                pr.take(False)
        self.s.channel.close()
        self.s.admin_channel.close()
        self.stop_proc(self.coord, signal.SIGTERM)
        for pr in self.procs:        # the ranks leave once their coordinator is gone
            if pr.exit is None:
                self.stop_proc(pr, signal.SIGTERM, last_sample=False)


# ------------------------------------------------------------------ traffic

class Ledger:
    def __init__(self):
        self.lock = threading.Lock()
        self.reqs = {}      # id -> dict(kind, terminals, outcome, t0, t1, accepted)
        self.n = 0

    def new(self, kind):
        with self.lock:
            self.n += 1
            rid = "soak-%d-%s" % (self.n, kind)
            self.reqs[rid] = dict(kind=kind, terminals=0, outcome=None, accepted=True, t0=time.time(), t1=None)
            return rid

    def end(self, rid, terminals, outcome, accepted=True):
        with self.lock:
            r = self.reqs[rid]
            r["terminals"] += terminals
            r["outcome"] = outcome
            r["accepted"] = accepted
            r["t1"] = time.time()


class Traffic:
    def __init__(self, rig, ledger, seed):
        self.rig, self.ledger, self.seed = rig, ledger, seed
        # one channel for the whole run: it reconnects to the restarted coordinator itself
        self.channel = grpc.insecure_channel("127.0.0.1:%d" % rig.ports["public"], options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self.inf = h.pbg.InferenceStub(self.channel)
        self.raw_generate = self.channel.unary_stream("/stepd.v1.Inference/Generate", request_serializer=None,
                                                      response_deserializer=pb.GenerateResponse.FromString)

    def in_kill_window(self, t0, t1):
        return any(a <= t1 and t0 <= b + 1.0 for a, b in self.rig.killed_at) or self.rig.down.is_set()

    # gRPC
    def grpc_call(self, kind, rng):
        """One Generate call of kind; returns True when it was served (OK)."""
        rid = self.ledger.new(kind)
        sp = pb.SamplingParams(max_tokens=rng.randint(4, 16))
        req = dict(request_id=rid)
        timeout = 60.0
        if kind == "g-deadline":
            sp.max_tokens, timeout = 400, rng.uniform(0.02, 0.3)
        elif kind in ("g-cancel", "g-abort"):
            sp.max_tokens = 400
        elif kind == "g-logprobs":
            sp.logprobs = 3
        elif kind == "g-malformed":
            bad = rng.randrange(4)
            if bad == 0:
                sp.temperature = -1.0
            elif bad == 1:
                sp.logprobs = 1000
            elif bad == 2:
                sp.top_p = 7.0
            else:
                req["raw"] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        if "raw" in req:
            pass
        elif kind == "g-tools":
            req["chat"] = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
                                       tools_json=json.dumps([WEATHER]))
        elif kind == "g-prefix":
            req["token_ids"] = pb.TokenIds(ids=PREFIX_IDS + [rng.randint(5, 3000) for _ in range(4)])
        else:
            req["token_ids"] = pb.TokenIds(ids=[rng.randint(5, 3000) for _ in range(rng.randint(3, 24))])
        finals, tokens, lp, t0 = 0, 0, 0, time.time()
        try:
            if "raw" in req:    # bytes that may not decode as a GenerateRequest at all
                st = self.raw_generate(req["raw"], timeout=timeout)
            else:
                st = self.inf.Generate(pb.GenerateRequest(sampling_params=sp, **req), timeout=timeout)
            stop_at = rng.randint(1, 2)
            for r in st:
                if r.HasField("chunk"):
                    tokens += len(r.chunk.token_ids)
                    lp += len(r.chunk.logprobs)
                    if kind == "g-cancel" and tokens >= stop_at:
                        st.cancel()
                    elif kind == "g-abort" and tokens >= stop_at and tokens - len(r.chunk.token_ids) < stop_at:
                        try:    # the Generate call's own end is what the ledger counts
                            self.inf.Abort(pb.AbortRequest(request_ids=[rid]), timeout=5)
                        except grpc.RpcError:
                            pass
                else:
                    finals += 1
                    last = r.final
            out = "OK/" + (pb.FinishReason.Name(last.finish_reason).replace("FINISH_REASON_", "") if finals
                           else "no Final")
            if finals and kind == "g-logprobs":
                out += " with logprobs" if lp else " WITHOUT logprobs"
            if finals and kind == "g-prefix":
                out += " prefix hit" if last.usage.cached_tokens else " no prefix hit"
            self.ledger.end(rid, finals, out)
            return True
        except grpc.RpcError as e:
            code, det = e.code(), e.details() or ""
            if finals and code == SC.DEADLINE_EXCEEDED:
                self.ledger.end(rid, 1, "race:Final-then-DEADLINE_EXCEEDED")
            elif code == SC.DEADLINE_EXCEEDED and kind != "g-deadline":
                # the client's 60 s bound, not the server's answer: the call was lost
                self.ledger.end(rid, finals, "no end within the client's %.0f s deadline" % timeout)
            elif code == SC.UNAVAILABLE and finals == 0 and not tokens and \
                    re.search(r"failed to connect|Connection refused|connections to all backends failed", det):
                # no connection: no server saw the call (the channel also fails fast while it
                # backs off reconnecting after a restart)
                self.ledger.end(rid, 0, "not accepted (no connection)", accepted=False)
            elif code == SC.UNAVAILABLE and finals == 1 and self.in_kill_window(t0, time.time()):
                self.ledger.end(rid, 1, "race:Final-then-coordinator-killed")
            else:
                self.ledger.end(rid, finals + 1, code.name if not finals else "%s after a Final" % code.name)
        except Exception as e:  # noqa: BLE001  (the ledger: anything else is a failure)
            self.ledger.end(rid, 0, "client exception %r" % e)
        return False

    # HTTP
    def http_call(self, kind, rng):
        """One chat completion of kind; returns True when it was answered 200."""
        rid = self.ledger.new(kind)
        port = self.rig.ports["http"]
        body = {"model": "tiny", "max_tokens": rng.randint(4, 16),
                "messages": [{"role": "user", "content": "Say something about the number %d." % rng.randint(1, 999)}]}
        ctype, raw = "application/json", None
        stream = kind in ("h-stream", "h-cancel", "h-logprobs")
        if kind == "h-tools":
            body["tools"] = [WEATHER]
            body["messages"][0]["content"] = "What is the weather in Paris?"
        elif kind == "h-logprobs":
            body.update(logprobs=True, top_logprobs=3)
        elif kind == "h-prefix":
            body["messages"] = [{"role": "system", "content": PREFIX_TEXT}, body["messages"][0]]
        elif kind == "h-cancel":
            body["max_tokens"] = 400
        elif kind == "h-malformed":
            bad = rng.randrange(4)
            if bad == 0:
                raw = b'{"model":"tiny","messages":[{"role":"user","content":"x"}'
            elif bad == 1:
                body["temperature"] = -3
            elif bad == 2:
                ctype = "text/plain"
            else:
                body["model"] = "no-such-model"
        if stream:
            body["stream"] = True
        data = raw if raw is not None else json.dumps(body).encode()
        t0 = time.time()
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            c.request("POST", "/v1/chat/completions", body=data,
                      headers={"Content-Type": ctype, "X-Request-Id": rid})
        except OSError:
            self.ledger.end(rid, 0, "not accepted (no connection)", accepted=False)
            c.close()
            return False
        try:
            r = c.getresponse()
        except (OSError, http.client.HTTPException) as e:
            ok = self.in_kill_window(t0, time.time())
            self.ledger.end(rid, 0, "not accepted (coordinator down)" if ok else "no status line: %r" % e,
                            accepted=not ok)
            c.close()
            return False
        try:
            if r.status != 200 or not stream:
                payload = r.read()
                json.loads(payload)       # a whole answer: one terminal status
                self.ledger.end(rid, 1, "HTTP %d" % r.status)
                return r.status == 200
            done, errors, chunks, lp = 0, 0, 0, 0
            while True:
                line = r.fp.readline()
                if not line:
                    break
                line = line.strip()
                if line == b"data: [DONE]":
                    done += 1
                elif line.startswith(b"data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        errors += 1
                    else:
                        chunks += 1
                        lp += sum(1 for c in ev.get("choices", []) if c.get("logprobs"))
                    if kind == "h-cancel" and chunks >= 2:
                        break
            if kind == "h-cancel" and not done:
                self.ledger.end(rid, 1, "client closed mid-stream")
            elif done == 0 and self.in_kill_window(t0, time.time()):
                self.ledger.end(rid, 1, "stream cut by the coordinator's SIGKILL")
            else:
                self.ledger.end(rid, done, "stream [DONE]%s%s" % (
                    " after an error event" if errors else "",
                    (" with logprobs" if lp else " WITHOUT logprobs") if kind == "h-logprobs" else "")
                    if done else "stream ended without [DONE]")
            return done == 1 and not errors
        except (OSError, http.client.HTTPException, ValueError) as e:
            if self.in_kill_window(t0, time.time()):
                self.ledger.end(rid, 1, "cut by the coordinator's SIGKILL")
            else:
                self.ledger.end(rid, 0, "broken answer: %r" % e)
            return False
        finally:
            c.close()

    def client(self, i, deadline):
        rng = random.Random(self.seed * 1000 + i)
        kinds = ["g-stream", "g-cancel", "g-deadline", "g-abort", "g-prefix", "g-logprobs", "g-tools",
                 "g-malformed", "h-chat", "h-stream", "h-cancel", "h-tools", "h-logprobs", "h-prefix",
                 "h-malformed"]
        while time.time() < deadline:
            k = rng.choice(kinds)
            served = self.grpc_call(k, rng) if k.startswith("g-") else self.http_call(k, rng)
            if not served:
                time.sleep(0.05)     # pacing: a refused client does not spin


# ------------------------------------------------------------------ the report

def growth_failures(procs, sanitized):
    bad = []
    slack = RSS_SLACK_MIB + (ASAN_QUARANTINE_MIB if sanitized else 0)
    for pr in procs:
        if pr.warm is None or pr.end is None or pr.end is pr.warm:
            continue
        if pr.end[1] > pr.warm[1] + FD_SLACK:
            bad.append("%s: fds %d at warm-up -> %d at the end (> +%d)" % (pr.role, pr.warm[1], pr.end[1], FD_SLACK))
        if pr.end[0] > pr.warm[0] * 1.25 + slack * 1024:
            bad.append("%s: RSS %d KiB at warm-up -> %d KiB at the end (> x1.25 + %d MiB)" %
                       (pr.role, pr.warm[0], pr.end[0], slack))
    return bad


def sanitizer_lines(procs):
    out = []
    for pr in procs:
        try:
            with open(pr.log, errors="replace") as f:
                for line in f:
                    if SANITIZER.search(line):
                        out.append("%s: %s" % (pr.role, line.strip()[:200]))
        except OSError:
            pass
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of traffic")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--fault-every", type=float, default=0.0,
                    help="seconds between faults (default: duration / 6, within 3..30)")
    ap.add_argument("--json", default="", help="also write the table as JSON to this file")
    a = ap.parse_args()
    if not os.path.exists(h.WORKER_BIN) or not os.path.exists(os.path.join(h.TINY_MODEL, "config.json")):
        print("SKIP: no stepd-worker (%s) or tiny model (%s)" % (h.WORKER_BIN, h.TINY_MODEL))
        return 77
    sanitized = h.sanitized(h.STEPD_BIN)
    workdir = tempfile.mkdtemp(prefix="stepd-soak-")
    t_start = time.time()
    rig = Rig(workdir)
    ledger = Ledger()
    traffic = Traffic(rig, ledger, a.seed)
    every = a.fault_every or min(30.0, max(3.0, a.duration / 6))
    r1 = ("SIGKILL of tp2 rank 1", rig.kill_rank1)
    r0 = ("SIGTERM of tp2 rank 0", rig.stop_rank0)
    c_term = ("SIGTERM of the coordinator", lambda: rig.restart_coordinator(signal.SIGTERM))
    c_kill = ("SIGKILL of the coordinator", lambda: rig.restart_coordinator(signal.SIGKILL))
    # every kind once first (short runs), then cycles of 8 where the coordinator restarts
    # twice, so that in long runs processes live through several slices after warm-up
    cycle = [r1, r0, r1, c_kill, r1, r0, r1, c_term]
    faults = [r1, c_term, r0, c_kill]
    t_traffic = time.time()
    deadline = t_traffic + a.duration
    clients = [threading.Thread(target=traffic.client, args=(i, deadline), daemon=True) for i in range(a.clients)]
    for t in clients:
        t.start()
    done_faults, fault_errors = [], []
    i = 0
    next_fault = time.time() + every
    while time.time() < deadline:
        time.sleep(min(0.2, max(0.0, next_fault - time.time())))
        if time.time() >= next_fault and time.time() < deadline:
            rig.boundary()
            name, fn = faults[i] if i < len(faults) else cycle[(i - len(faults)) % len(cycle)]
            i += 1
            try:
                fn()
                done_faults.append(name)
            except Exception as e:  # noqa: BLE001
                fault_errors.append("%s: %s" % (name, e))
                break
            next_fault = time.time() + every
    for t in clients:
        t.join(120)
    traffic.channel.close()
    hung = [rid for rid, r in ledger.reqs.items() if r["t1"] is None]
    rig.boundary()
    traffic_s = time.time() - t_traffic
    rig.shutdown()
    # the table
    per_outcome = {}
    lost, dup = [], []
    accepted = 0
    for rid, r in sorted(ledger.reqs.items()):
        key = "%s %s" % (r["kind"], r["outcome"])
        per_outcome[key] = per_outcome.get(key, 0) + 1
        if not r["accepted"]:
            continue
        accepted += 1
        if r["terminals"] == 0:
            lost.append("%s (%s)" % (rid, r["outcome"]))
        elif r["terminals"] > 1:
            dup.append("%s (%d: %s)" % (rid, r["terminals"], r["outcome"]))
    lost += ["%s (no end: hung)" % x for x in hung]
    growth = growth_failures(rig.procs, sanitized)
    san = sanitizer_lines(rig.procs)
    crashed = [pr.role for pr in rig.procs if isinstance(pr.exit, int) and pr.exit < 0 and
               -pr.exit in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)]
    stuck = ["%s %s" % (pr.role, pr.exit) for pr in rig.procs if isinstance(pr.exit, str)]
    print("soak: %.0f s of traffic (--duration %g; %.0f s with the rig's start), %d clients, %d requests "
          "(%d accepted), faults: %s" % (traffic_s, a.duration, time.time() - t_start, a.clients, len(ledger.reqs), accepted,
           ", ".join(done_faults) or "none"))
    print("requests per outcome:")
    for k, v in sorted(per_outcome.items()):
        print("  %6d  %s" % (v, k))
    print("terminal statuses per accepted request: %d with exactly one, %d with none (lost), %d with two or more "
          "(duplicated)" % (accepted - len(lost) - len(dup), len(lost), len(dup)))
    print("processes (RSS KiB / fds / threads):  start  ->  warm-up  ->  end  (exit)")
    fmt = lambda v: "-" if v is None else "%d/%d/%d" % v  # noqa: E731
    for pr in rig.procs:
        print("  %-22s %-16s %-16s %-16s %s" % (pr.role, fmt(pr.start), fmt(pr.warm), fmt(pr.end), pr.exit))
    print("sanitizer reports: %d%s" % (len(san), "" if sanitized else " (this build is not sanitized)"))
    for x in san[:20]:
        print("  " + x)
    fails = []
    if lost:
        fails.append("%d accepted requests without a terminal status: %s" % (len(lost), lost[:8]))
    if dup:
        fails.append("%d requests with 2+ terminal statuses: %s" % (len(dup), dup[:8]))
    fails += growth
    if san:
        fails.append("%d sanitizer lines" % len(san))
    if crashed:
        fails.append("crashed: %s" % crashed)
    if stuck:
        fails.append("did not stop: %s" % stuck)
    if fault_errors:
        fails.append("a fault step failed: %s" % fault_errors)
    if accepted == 0:
        fails.append("no request was accepted")
    no_lp = sum(v for k, v in per_outcome.items() if "WITHOUT logprobs" in k)
    if no_lp:
        fails.append("%d logprobs requests served without logprobs" % no_lp)
    for f in fails:
        print("FAIL " + f)
    print("soak %s: %d requests, one terminal status each: %s; growth over threshold: %d; sanitizer lines: %d" %
          ("PASS" if not fails else "FAIL", accepted, "yes" if not lost and not dup else "NO", len(growth), len(san)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(duration=a.duration, traffic_s=traffic_s, faults=done_faults, requests=len(ledger.reqs),
                           accepted=accepted, per_outcome=per_outcome, lost=lost, duplicated=dup,
                           processes=[dict(role=pr.role, start=pr.start, warm=pr.warm, end=pr.end,
                                           exit=pr.exit) for pr in rig.procs],
                           growth=growth, sanitizer=san, failures=fails, ok=not fails), f, indent=1)
    if fails:
        print("logs kept in " + workdir)
    else:
        subprocess.run(["rm", "-rf", workdir])
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
