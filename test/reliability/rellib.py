"""rellib.py - shared bits of the reliability tests (test/reliability/).

Imports test/daemon/stepd_harness.py (which generates the gRPC stubs and starts
stepd / mock engines); adds process-table helpers. Environment (set by meson):
STEPD_BIN, STEPD_WORKER_BIN, MOCK_ENGINE_BIN, PROTO_DIR, TINY_MODEL_DIR.
"""
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "daemon"))

import stepd_harness as h  # noqa: E402,F401  (exits 77 without grpcio)

WORKER_BIN = os.environ.get("STEPD_WORKER_BIN", "")
MODEL_DIR = os.environ.get("TINY_MODEL_DIR", os.path.join(HERE, "..", "..", "models", "tiny-step"))


def need_worker():
    if not WORKER_BIN or not os.path.exists(WORKER_BIN):
        print("SKIP: no stepd-worker binary (STEPD_WORKER_BIN)")
        sys.exit(77)


def need_model():
    if not os.path.exists(os.path.join(MODEL_DIR, "config.json")):
        print("SKIP: no tiny model at %r" % MODEL_DIR)
        sys.exit(77)


def crash_signal(rc):
    """The signal name when a process died of a crash-type signal, else None."""
    if rc is not None and rc < 0 and -rc in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE,
                                             signal.SIGILL, signal.SIGTRAP):
        return signal.Signals(-rc).name
    return None


def proc_status(pid, key):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def children_of(pid):
    """Direct children still in the process table (zombies included)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                st = f.read()
        except OSError:
            continue
        fields = st[st.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append((int(d), fields[0]))
    return out
