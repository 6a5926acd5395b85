"""stepd_harness.py - shared helpers for the coordinator integration tests.

Generates Python gRPC stubs from proto/*.proto with grpcio-tools into a temp dir
at import time (an independent client: nothing here shares code with the C side),
starts `stepd` and `mock-engine` processes on loopback, and offers small helpers.

The cluster key: a Stepd gets a random control key in a 0600 file of its work directory
(unless the test gives one, with --control-key-file or $STEPD_CONTROL_KEY, or asks for
none with control_key=False: --insecure-control), and hands it to the engines and workers
it starts, as `stepd serve` does.

Environment (set by meson): STEPD_BIN, MOCK_ENGINE_BIN, PROTO_DIR, TOKENIZER_JSON.
"""
import atexit
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

try:
    import grpc
    from grpc_tools import protoc
except ImportError as _e:  # the client library is a test dependency (pip grpcio grpcio-tools)
    print("SKIP: python grpcio/grpcio-tools not importable: %s" % _e)
    sys.exit(77)

PROTO_DIR = os.environ.get("PROTO_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "proto"))
STEPD_BIN = os.environ.get("STEPD_BIN", "build/daemon/stepd")
MOCK_BIN = os.environ.get("MOCK_ENGINE_BIN", "build/test/daemon/mock-engine")
# extra mock-engine flags for a whole run (coord-grpcio-generate-path: --no-output-streams)
MOCK_ARGS = shlex.split(os.environ.get("MOCK_ENGINE_ARGS", ""))
TOKENIZER = os.environ.get("TOKENIZER_JSON", "")
WORKER_BIN = os.environ.get("STEPD_WORKER_BIN", "build/worker/stepd-worker")
TINY_MODEL = os.environ.get("TINY_MODEL_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "models",
                                                           "tiny-step"))
LOADGEN_BIN = os.environ.get("LOADGEN_BIN", "build/test/daemon/loadgen")

_stub_dir = tempfile.mkdtemp(prefix="stepd-stubs-")
atexit.register(shutil.rmtree, _stub_dir, True)
_includes = ["-I" + PROTO_DIR]
try:
    import grpc_tools
    _includes.append("-I" + os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))
except Exception:
    pass
_rc = protoc.main(["grpc_tools.protoc", *_includes, "--python_out=" + _stub_dir, "--grpc_python_out=" + _stub_dir,
                   *[os.path.join(PROTO_DIR, p) for p in ("stepd.proto", "control.proto", "health.proto")]])
if _rc != 0:
    raise SystemExit("protoc failed generating Python stubs from %s" % PROTO_DIR)
sys.path.insert(0, _stub_dir)

import stepd_pb2 as pb  # noqa: E402
import stepd_pb2_grpc as pbg  # noqa: E402
import health_pb2 as hpb  # noqa: E402
import health_pb2_grpc as hpbg  # noqa: E402

SERVING = hpb.HealthCheckResponse.SERVING
NOT_SERVING = hpb.HealthCheckResponse.NOT_SERVING

_procs = []
_workdirs = []


def _cleanup():
    for p in _procs:
        if p.poll() is None:
            p.kill()
            p.wait()


atexit.register(_cleanup)


def write_key(path, key=None):
    """A 0600 key file holding key (default: 32 random bytes in hex); returns the key."""
    key = key or os.urandom(32).hex()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


class Stepd:
    """A running coordinator. Ports are chosen by the kernel and read from its log."""

    def __init__(self, *args, env=None, workdir=None, control_key=True):
        self.workdir = workdir or tempfile.mkdtemp(prefix="stepd-it-")
        _workdirs.append(self.workdir)
        self.logpath = os.path.join(self.workdir, "stepd.log")
        self.log = open(self.logpath, "w+")
        args = list(args)
        e = dict(os.environ)
        e.pop("STEPD_CONTROL_KEY", None)
        e.setdefault("STEPD_LOG_LEVEL", "info")
        if env:
            e.update(env)
        # the cluster key (None: no key, --insecure-control)
        self.key_file = None
        if "--control-key-file" in args:
            self.key_file = args[args.index("--control-key-file") + 1]
            self.control_key = open(self.key_file).read().strip()
        elif e.get("STEPD_CONTROL_KEY"):
            self.control_key = e["STEPD_CONTROL_KEY"]
        elif control_key:
            self.key_file = os.path.join(self.workdir, "control-key")
            self.control_key = write_key(self.key_file, control_key if isinstance(control_key, str) else None)
            args += ["--control-key-file", self.key_file]
        else:
            self.control_key = None
            if "--insecure-control" not in args:
                args.append("--insecure-control")
        cmd = [STEPD_BIN, "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
               "--control-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
               "--heartbeat-ms", "200", "--loads-poll-ms", "100", *args]
        if "--port" not in args:
            cmd[1:1] = ["--port", "0"]     # the OpenAI HTTP API on a free port
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        _procs.append(self.proc)
        self.ports = self._wait_ports()
        self.addr = "127.0.0.1:%d" % self.ports["public"]
        self.http = "http://127.0.0.1:%d" % self.ports["http"]     # the OpenAI API
        self.channel = grpc.insecure_channel(self.addr)
        self.admin_channel = grpc.insecure_channel("127.0.0.1:%d" % self.ports["admin"])
        self.inf = pbg.InferenceStub(self.channel)
        self.admin = pbg.AdminStub(self.admin_channel)
        self.health = hpbg.HealthStub(self.channel)
        self.engines = []

    def key_args(self, env=None):
        """The flags that hand this coordinator's key to a worker or mock engine (none when
        the test sets $STEPD_CONTROL_KEY for it)."""
        if env and "STEPD_CONTROL_KEY" in env:
            return []
        if self.control_key is None:
            return ["--insecure-control"]
        if not self.key_file:
            self.key_file = os.path.join(self.workdir, "control-key")
            write_key(self.key_file, self.control_key)
        return ["--control-key-file", self.key_file]

    def key_md(self):
        """Call metadata carrying the cluster key (an engine's callers need it)."""
        return [("authorization", "Bearer " + self.control_key)] if self.control_key else []

    def _wait_ports(self):
        end = time.time() + 10
        while time.time() < end:
            txt = open(self.logpath).read()
            m = re.search(r"public \S+ \(port (\d+).*admin \S+ \(port (\d+)\), control \S+ \(port (\d+)\), "
                          r"metrics \S+ \(port (\d+)\)", txt)
            if m:
                hm = re.search(r"http \S+ \(port (\d+)", txt)
                return dict(public=int(m.group(1)), admin=int(m.group(2)), control=int(m.group(3)),
                            metrics=int(m.group(4)), http=int(hm.group(1)) if hm else 0)
            if self.proc.poll() is not None:
                raise RuntimeError("stepd exited early (%d):\n%s" % (self.proc.returncode, txt))
            time.sleep(0.02)
        raise RuntimeError("stepd did not report its ports:\n" + open(self.logpath).read())

    def start_engine(self, group, *args, rank=0, world=1, env=None):
        stats = os.path.join(self.workdir, "%s-r%d.stats" % (group, rank))
        log = open(os.path.join(self.workdir, "%s-r%d.log" % (group, rank)), "w")
        cmd = [MOCK_BIN, "--coordinator", "127.0.0.1:%d" % self.ports["control"], "--group", group,
               "--rank", str(rank), "--world", str(world), "--stats-file", stats, *self.key_args(env),
               *MOCK_ARGS, *args]
        e = dict(os.environ)
        e.pop("STEPD_CONTROL_KEY", None)
        if env:
            e.update(env)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e)
        _procs.append(p)
        eng = Engine(p, stats)
        self.engines.append(eng)
        return eng

    def start_worker(self, group, *args, rank=0, world=1, env=None, log_name=None):
        """A real stepd-worker rank (CPU, the bundled tiny model unless --model is in args)
        registering with this coordinator; rank 0 serves its engine on a unix socket.
        The Popen gets .logpath."""
        log = open(os.path.join(self.workdir, log_name or "%s-w%d.log" % (group, rank)), "a")
        cmd = [WORKER_BIN, "--coordinator", "127.0.0.1:%d" % self.ports["control"], "--group", group,
               "--rank", str(rank), "--world-size", str(world), "--device", "cpu"]
        if "--model" not in args:
            cmd += ["--model", TINY_MODEL]
        if rank == 0 and "--engine-listen" not in args:
            cmd += ["--engine-listen", "unix:%s/%s-engine.sock" % (self.workdir, group)]
        cmd += self.key_args(env) + list(args)
        e = dict(os.environ)
        e.pop("STEPD_CONTROL_KEY", None)
        e.setdefault("UCX_NET_DEVICES", "lo")
        e["UCX_WARN_UNUSED_ENV_VARS"] = "n"
        if env:
            e.update(env)
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=e)
        p.logpath = log.name
        _procs.append(p)
        return p

    def check(self, service, timeout=2.0):
        return self.health.Check(hpb.HealthCheckRequest(service=service), timeout=timeout).status

    def wait_ready(self, groups=1, timeout=10.0):
        end = time.time() + timeout
        while time.time() < end:
            try:
                info = self.inf.GetServerInfo(pb.GetServerInfoRequest(), timeout=1)
                if info.groups_ready >= groups:
                    return info
            except grpc.RpcError:
                pass
            time.sleep(0.02)
        raise AssertionError("stepd not ready with %d groups:\n%s" % (groups, self.read_log()))

    def read_log(self):
        self.log.flush()
        return open(self.logpath).read()

    def metrics(self):
        import urllib.request
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.ports["metrics"], timeout=2) as r:
            return r.read().decode()

    def metric(self, name):
        for line in self.metrics().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if line.split(" ")[0] == name or name.endswith("}"):
                    return float(line.split(" ")[-1])
        for line in self.metrics().splitlines():
            if line.startswith(name):
                return float(line.split(" ")[-1])
        return None

    def rss_kib(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def fds(self):
        return len(os.listdir("/proc/%d/fd" % self.proc.pid))

    def threads(self):
        return len(os.listdir("/proc/%d/task" % self.proc.pid))

    def stop(self, sig=signal.SIGTERM, timeout=15):
        self.channel.close()
        self.admin_channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
            raise AssertionError("stepd did not exit after signal %d" % sig)
        for e in self.engines:
            e.wait_exit(10)
        if rc == 0 and not os.environ.get("STEPD_KEEP_LOGS"):
            shutil.rmtree(self.workdir, True)   # logs are kept when something failed
        return rc


class Engine:
    def __init__(self, proc, stats):
        self.proc = proc
        self.stats_path = stats

    def stats(self):
        # the mock rewrites the file in place (same length): read until two reads agree
        prev = None
        for _ in range(100):
            try:
                with open(self.stats_path) as f:
                    text = f.read()
            except FileNotFoundError:
                return {}
            if text == prev:
                break
            prev = text
        return {k: int(v) for k, v in (line.strip().split("=") for line in prev.splitlines() if "=" in line)}

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait()

    def wait_exit(self, timeout):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def tokenizer_size(path=None):
    """The first token id the tokenizer file does not define (its vocabulary and added tokens):
    the daemon's first invalid id at /detokenize, derived so that new special tokens move it."""
    import json
    with open(path or TOKENIZER, encoding="utf-8") as f:
        t = json.load(f)
    ids = list(t["model"]["vocab"].values()) + [a["id"] for a in t.get("added_tokens", [])]
    return max(ids) + 1


def gen_request(ids=(10, 20, 30), max_tokens=8, **kw):
    sp = kw.pop("sampling", None) or pb.SamplingParams(max_tokens=max_tokens)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(ids)), sampling_params=sp, **kw)


def expected_tokens(ids, n, vocab=1000):
    s = sum(ids)
    return [(s + 7 * i + 1) % vocab for i in range(n)]


def wait_idle(s, what, timeout=15.0):
    """D1 after a run: nothing in flight anywhere.  The coordinator: every group's in_flight
    0 and routed == completed + failed (each routed call ended exactly once).  Every engine,
    as the coordinator's GetLoads reports it: nothing running or waiting, no request state
    alive, as many freed as created, no KV block held in any pool (the engines of ready
    groups: a group that is down reports its last engine's totals).  Prints one line
    "INVARIANTS what: ..." (test/chaos/report counts them); returns (groups, loads)."""
    def idle():
        gg = s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2).groups
        ready = {g.group for g in gg if g.state == pb.WORKER_STATE_READY}
        loads = [l for l in s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2).loads if l.group in ready]
        if any(g.counters.in_flight or g.counters.routed != g.counters.completed + g.counters.failed for g in gg):
            return None
        if any(l.num_running or l.num_waiting or l.kv_blocks_used or l.num_requests_alive or
               l.requests_created != l.requests_freed or any(p.blocks_used for p in l.kv_pools) for l in loads):
            return None
        return gg, loads
    try:
        gg, loads = wait_until(idle, timeout=timeout, step=0.1, what="idle counters")
    except AssertionError:
        raise AssertionError("not idle after %s:\n%s\n%s" % (what, s.admin.GetGroups(pb.GetGroupsRequest(), timeout=2),
                                                              s.inf.GetLoads(pb.GetLoadsRequest(), timeout=2)))
    print("INVARIANTS %s: %d groups idle (routed = completed + failed), engines: 0 alive, created = freed "
          "(%s), 0 KV blocks held" % (what, len(gg), ", ".join(str(l.requests_created) for l in loads)), flush=True)
    return gg, loads


def ledger_line(what, calls, one_terminal):
    """The client ledger of a run: calls made, and how many ended with exactly one terminal
    status (test/chaos/report sums these lines)."""
    print("LEDGER %s: calls=%d one_terminal=%d" % (what, calls, one_terminal), flush=True)


def collect(stream):
    """Drain a Generate stream: (tokens, text, finals, chunks)."""
    toks, text, finals, chunks = [], [], [], []
    for r in stream:
        if r.HasField("chunk"):
            chunks.append(r.chunk)
            toks.extend(r.chunk.token_ids)
            text.append(r.chunk.text)
        else:
            finals.append(r.final)
    return toks, "".join(text), finals, chunks


def code_of(fn):
    """Run fn: (grpc.StatusCode.OK, "") or the status and details of the RpcError it raised."""
    try:
        fn()
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def wait_until(fn, timeout=5.0, step=0.02, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = fn()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("timed out waiting for " + what)


# gRPC core's own pools grow on demand up to a fixed cap and stay (the timer manager in
# 1.51 keeps its extra "grpc_global_timer" threads): they may add at most GRPC_POOL_SLACK.
GRPC_POOL_SLACK = 6
GRPC_POOLS = ("grpc_global_tim", "default-executo", "event_engine", "resolver-execut", "timer_manager")


def thread_names(pid):
    """{thread name: count} of process pid."""
    out = {}
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                n = f.read().strip()
        except OSError:
            continue
        out[n] = out.get(n, 0) + 1
    return out


def own_threads(pid):
    """The threads of pid outside gRPC core's on-demand pools."""
    return sum(v for k, v in thread_names(pid).items() if k not in GRPC_POOLS)


def sanitized(path):
    """True for an ASan/TSan build of the program at path."""
    with open(path, "rb") as f:
        data = f.read()
    return b"__asan_init" in data or b"__tsan_init" in data


def run_tests(tests):
    """Run (name, fn) pairs; print one line each; exit 1 on any failure.
    STEPD_TEST_ONLY=name,name runs only those."""
    only = [n for n in os.environ.get("STEPD_TEST_ONLY", "").split(",") if n]
    if only:
        tests = [t for t in tests if t[0] in only]
    failed = 0
    t_all = time.time()
    for name, fn in tests:
        t0 = time.time()
        try:
            fn()
            print("PASS %-40s %.2fs" % (name, time.time() - t0), flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            import traceback
            traceback.print_exc()
            print("FAIL %-40s %s" % (name, e), flush=True)
    print("%d/%d passed in %.1fs" % (len(tests) - failed, len(tests), time.time() - t_all))
    _cleanup()
    if not failed and not os.environ.get("STEPD_KEEP_LOGS"):
        for d in _workdirs:
            shutil.rmtree(d, True)
    elif failed:
        print("logs kept in: " + " ".join(d for d in _workdirs if os.path.isdir(d)))
    sys.exit(1 if failed else 0)
