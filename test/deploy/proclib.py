"""proclib.py - processes for the deployment tests: a service manager's notification socket
(sd_notify datagrams collected with their arrival times), probes as the kubelet runs them
(gRPC health, HTTP GET), free ports, and the independent gRPC client of test/daemon.
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))
import stepd_harness as sh  # noqa: E402  (generates the Python stubs from proto/)

pb, pbg, hpb, hpbg = sh.pb, sh.pbg, sh.hpb, sh.hpbg
import grpc  # noqa: E402


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class NotifySocket:
    """An AF_UNIX datagram socket like systemd's $NOTIFY_SOCKET: every message kept as
    (time, {VAR: value})."""

    def __init__(self, d, name):
        self.path = os.path.join(d, name + ".notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.msgs = []
        self.lock = threading.Lock()
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            try:
                data = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            kv = {}
            for line in data.decode("utf-8", "replace").split("\n"):
                k, _, v = line.partition("=")
                if k:
                    kv[k] = v
            with self.lock:
                self.msgs.append((time.monotonic(), kv))

    def times(self, var, value=None):
        with self.lock:
            return [t for t, kv in self.msgs if var in kv and (value is None or kv[var] == value)]

    def values(self, var):
        with self.lock:
            return [kv[var] for t, kv in self.msgs if var in kv]

    def wait(self, var, value=None, timeout=60.0, after=0.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ts = [t for t in self.times(var, value) if t >= after]
            if ts:
                return ts[0]
            time.sleep(0.05)
        raise AssertionError("%s: no %s=%s within %.0f s (got %s)" % (self.path, var, value or "*", timeout,
                                                                    [kv for _, kv in self.msgs][-8:]))

    def close(self):
        self.stop = True
        self.t.join(1)
        self.sock.close()


def grpc_health(addr, service, timeout=2.0, creds=None):
    """The serving status a gRPC health probe sees (None when the call fails)."""
    ch = grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)
    try:
        r = hpbg.HealthStub(ch).Check(hpb.HealthCheckRequest(service=service), timeout=timeout)
        return r.status
    except grpc.RpcError:
        return None
    finally:
        ch.close()


def http_get(port, path, timeout=2.0, scheme="HTTP", ca=None, headers=None, host="127.0.0.1"):
    """(status, body) of GET http(s)://host:port/path; (None, error) when it fails.  HTTPS
    without ca: the certificate is not verified (as the kubelet's HTTPS probes); with ca:
    verified against it."""
    ctx = None
    if scheme == "HTTPS":
        import ssl
        ctx = ssl.create_default_context(cafile=ca) if ca else ssl._create_unverified_context()
    req = urllib.request.Request("%s://%s:%d%s" % (scheme.lower(), host, port, path), headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


def wait_until(fn, timeout, what, step=0.1):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(step)
    raise AssertionError("timed out after %.0f s waiting for %s (last: %r)" % (timeout, what, last))


class Proc:
    """A child with its output in a file (read back for assertions and on failure)."""

    def __init__(self, name, argv, env, d):
        self.name = name
        self.log = os.path.join(d, name + ".log")
        self.f = open(self.log, "w")
        self.p = subprocess.Popen(argv, env=env, stdout=self.f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def text(self):
        self.f.flush()
        return open(self.log, errors="replace").read()

    def wait(self, timeout):
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("%s did not exit within %.0f s:\n%s" % (self.name, timeout, self.text()[-3000:]))

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)


def tmpdir(prefix):
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("TMPDIR", "/tmp"))


def run_cases(cases, prefix, tail=4000):
    """Run each (title, fn, *args) of cases as fn(d, *args) in a temporary directory d of its
    own (removed afterwards); when an assertion fails, print the last tail characters of
    every *.log in d before passing the failure on."""
    for title, fn, *args in cases:
        d = tmpdir(prefix)
        print("== " + title)
        try:
            fn(d, *args)
        except AssertionError:
            for f in sorted(os.listdir(d)):
                if f.endswith(".log"):
                    print("---- %s\n%s" % (f, open(os.path.join(d, f), errors="replace").read()[-tail:]))
            raise
        finally:
            shutil.rmtree(d, True)
