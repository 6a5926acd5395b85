#!/usr/bin/env python3
"""report.py [--profile P] [--duration S] [--only ID,ID] [--json FILE] - the reliability table of
docs/RELIABILITY.md §4 as a command: one line per row (ID, PASS/FAIL, the measured figure),
then one summary line (profile soak: soak.py's table).

It runs the tests that hold the rows - the fault, overload, bad-input, nothing-lost and
security rows - on this machine's CPU, on loopback and in network namespaces, with the mock
engine where a row says so and the tiny model elsewhere, and reads each row's result and
figure from what they print: a harness subtest's PASS/FAIL line and the figure it printed
last, or a script's exit status and a line it printed.  Nothing is measured twice and no
row has a threshold of its own: the tests judge, the report collects.

Nothing lost, across all the chaos rows: every run that puts calls through faults prints a
"LEDGER what: calls=N one_terminal=M" line (the client's ledger: calls made, and those that
ended with exactly one terminal status) and an "INVARIANTS what: ..." line once the engine's
request states and KV blocks are back to idle (test/daemon/stepd_harness.py wait_idle); D2
and D1 are their sums over the whole report.

Profiles: quick (the suite and CI: bursts of 300, 100 chaos streams, E3 by test-secret-equal
without a clock, a couple of minutes), full (by hand: the default sizes of the tests and more,
E3's timing over loopback), and soak (soak.py: mixed traffic on both doors for --duration
seconds while ranks and the coordinator are killed and restarted; its own table - requests
per outcome, terminal statuses per request, RSS/fds/threads of every process, sanitizer
lines - and its exit status).
Environment: what meson gives the reliability tests (STEPD_BIN, STEPD_WORKER_BIN,
MOCK_ENGINE_BIN, LOADGEN_BIN, PROTO_DIR, TINY_MODEL_DIR, TOKENIZER_JSON, ...), and BUILD
for the fuzz-corpus replays (default: the build directory beside STEPD_BIN).
Exit status: 0 when every row passed, 1 otherwise.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TEST = os.path.dirname(HERE)
PY = sys.executable

# sizes per profile: {name: (quick, full)}
SIZES = {
    "burst": ("300", "3000"),
    "streams": ("300", "2000"),
    "chaos": ("100", "1000"),
    "hygiene": (("200", "3"), ("1000", "5")),
    "trials": (None, "20000"),         # the full profile's E3 timing measurement only
}

# Each run: (name, script, args, env, rows).  A row: (ID, what, selector) with selector
# ("sub", NAME): the harness subtest NAME; ("line", REGEX): the script's exit status and the
# last line matching REGEX (its figure).
def runs(profile):
    q = profile == "quick"
    pick = lambda k: SIZES[k][0 if q else 1]  # noqa: E731
    streams, bursts = pick("hygiene")
    coord_only = ["health_and_failover", "hung_worker", "cancel_and_deadline", "engine_ignores_deadline",
                  "overload", "slow_consumer", "bad_inputs", "drain_sigterm", "api_key_every_rpc", "tls_mtls",
                  "real_worker"]
    robust_only = ["refusals", "capacity", "deadline_burst", "reset_burst"] + ([] if q else ["streams_2000"])
    return [
        ("coordinator", "daemon/test_coord.py", [], {"STEPD_TEST_ONLY": ",".join(coord_only)}, [
            ("B1", "kill -9 of a group mid-stream (mock engines)", ("sub", "health_and_failover")),
            ("B4", "a hung worker (SIGSTOP)", ("sub", "hung_worker")),
            ("B8", "client disconnect mid-stream: one Abort", ("sub", "cancel_and_deadline")),
            ("B9", "deadlines, also on an output stream whose engine stopped", ("sub", "engine_ignores_deadline")),
            ("B10", "SIGTERM drain", ("sub", "drain_sigterm")),
            ("A2", "overload: R + Q admitted, the rest RESOURCE_EXHAUSTED", ("sub", "overload")),
            ("A6", "a client that stops reading", ("sub", "slow_consumer")),
            ("C8", "validation matrix, message and metadata caps (C5, C6)", ("sub", "bad_inputs")),
            ("E3", "the API key on every RPC", ("sub", "api_key_every_rpc")),
            ("E4", "TLS and mTLS", ("sub", "tls_mtls")),
            ("D1", "the engine's counters through the coordinator", ("sub", "real_worker")),
        ]),
        ("robust", "daemon/test_robust.py", [], {"STEPD_TEST_ONLY": ",".join(robust_only),
                                                 "ROBUST_BURST": pick("burst"), "ROBUST_STREAMS": pick("streams")}, [
            ("B15", "an engine refuses a request (16 statuses)", ("sub", "refusals")),
            ("A8", "more streams than an engine admits", ("sub", "capacity")),
            ("B16", "a burst of 1-20 ms deadlines (tiny model)", ("sub", "deadline_burst")),
            ("B16", "a burst of resets 0-10 ms after sending (tiny model)", ("sub", "reset_burst")),
        ] + ([] if q else [("A8", "2000 streams over an engine admitting 256", ("sub", "streams_2000"))])),
        ("chaos", "reliability/test_d2_chaos.py", ["--streams", pick("chaos")], {}, [
            ("D2", "mixed streams while a rank is SIGKILLed (mock engines)", ("sub", "d2-chaos-mock-engines")),
            ("D2", "mixed streams while a rank is SIGKILLed (stepd-worker, UCX)", ("sub", "d2-chaos-stepd-worker-tp2")),
        ]),
        ("group-coordinator", "comm/test_group_coord.py", [], {"MODEL_DIR": os.environ.get("TINY_MODEL_DIR", "")}, [
            ("B5", "a rank lost under a 2-rank tiny group: UNAVAILABLE, survivors re-register", ("line", r"rank 1 SIGKILLed mid-Generate")),
            ("B17", "the group re-forms with only the lost rank restarted", ("line", r"survivors kept their PIDs")),
            ("B3", "kill -9 of the coordinator: re-adopted without a reload", ("line", r"coordinator SIGKILLed under")),
        ]),
        ("group-faults", "comm/test_group_fault.py", [os.environ.get("STEPD_WORKER_BIN", ""),
                                                     os.environ.get("TINY_MODEL_DIR", "")], {}, [
            ("B5", "collective faults: a peer killed, never joins, fails to load", ("line", r"rank 1 fails to load")),
            ("B5", "a follower lost under a serving engine: UNAVAILABLE naming group and rank", ("line", r"under a serving engine")),
        ]),
        ("bad-checkpoints", "reliability/test_c1_malformed.py", [], {}, [
            ("C1", "malformed checkpoints through the loader", ("sub", "c1-offline-malformed")),
            ("B12", "a bad checkpoint under a coordinator", ("sub", "c1-coordinator-stays-not-serving")),
        ]),
        ("hygiene", "reliability/test_d4_hygiene.py", ["--streams", streams, "--bursts", bursts], {}, [
            ("D4", "fds, threads and RSS after bursts (mock engine)", ("sub", "d4-hygiene-mock")),
            ("D4", "fds, threads and RSS after bursts (tiny model)", ("sub", "d4-hygiene-worker")),
        ]),
        ("h2-abuse", "reliability/test_c7_h2_abuse.py", ["raw", "idle"], {}, [
            ("C7", "bounded Rapid Reset, PING and SETTINGS floods", ("sub", "c7-raw")),
            ("C7", "idle TCP and silent HTTP/2 connections", ("sub", "c7-idle")),
        ]),
        ("listen-audit", "reliability/test_e1_listen_audit.py", [], {}, [
            ("E1", "default listeners loopback only (UCX too), ports outside 32768-60999", ("sub", "e1-default-listen-loopback-only")),
            ("E1", "non-loopback listens refused", ("sub", "e1-nonloopback-refused")),
        ]),
        ("engine-listen", "reliability/test_e1_listen_audit.py", ["engine-any"], {}, [
            ("E2", "rank 0's engine off loopback: the key or nothing", ("sub", "e2-worker-engine-listen-refused")),
        ]),
        ("cluster-secret", "reliability/test_e8_secure.py", [], {}, [
            ("E8", "a coordinator without the cluster key refuses to start", ("sub", "e8-coordinator-needs-key")),
            ("E8", "an impostor worker without the key", ("sub", "e8-register-needs-key")),
            ("E8", "a keyed claim on a live rank", ("sub", "e8-claim-live-rank-refused")),
            ("E8", "rank 0's engine called directly", ("sub", "e8-engine-needs-key")),
            ("E8", "ReportState for guessed session ids", ("sub", "e8-forged-report-refused")),
            ("E9", "ended registrations pruned", ("sub", "e9-registrations-pruned")),
            ("E10", "Abort only of the caller's own requests", ("sub", "e10-abort-scoped")),
            ("E11", "no journal line forged through a rejected field", ("sub", "e11-log-injection")),
            ("E12", "the request contract (top_k = -1, tool definitions)", ("sub", "e12-contract")),
        ]),
    ] + ([] if q else [
        # E3 on the wall clock over loopback (a measurement: it resolves microseconds, not
        # an early exit's nanoseconds); the quick profile has test-secret-equal's row only
        ("key-timing", "reliability/test_e3_key_timing.py", ["--trials", pick("trials")], {}, [
            ("E3", "API key comparison: no timing difference over loopback", ("sub", "e3-api-key-timing")),
        ]),
    ])


def secret_rows(build):
    """E3: rpc_secret_equal single-stepped, one instruction path for every key of the
    secret's length (test-secret-equal; no clock)."""
    path = os.path.join(build, "test/rpc/test-secret-equal")
    if not os.path.exists(path):
        return [("E3", "API key comparison in constant time", False, "test/rpc/test-secret-equal not built")]
    p = subprocess.run([path], capture_output=True, text=True, timeout=60)
    last = [l.strip() for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    return [("E3", "API key comparison in constant time", p.returncode == 0,
             last[-1][:300] if last else "(nothing printed; exit %d)" % p.returncode)]


def fuzz_rows(build):
    """C2, C10, C11: the committed corpora through every fuzz target (the replays)."""
    rows = []
    for rid, what, exe, corpus in (
            ("C2", "safetensors header corpus", "test/fuzz/fuzz-replay-header", "fuzz/corpus/header"),
            ("C2", "shard index corpus", "test/fuzz/fuzz-replay-index", "fuzz/corpus/index"),
            ("C2", "config.json corpus", "test/fuzz/fuzz-replay-config", "fuzz/corpus/config"),
            ("C10", "GenerateRequest decode -> validate corpus", "test/daemon/fuzz-replay-request",
             "daemon/corpus/request"),
            ("C10", "tokenizer, chat template and parsers corpus", "test/tok/fuzz/tok-fuzz-replay", "tok/fuzz/corpus"),
            ("C11", "step-plan decoder corpus", "test/comm/fuzz-replay-plan-wire", "comm/corpus/plan-wire")):
        path, cdir = os.path.join(build, exe), os.path.join(TEST, corpus)
        n = len(os.listdir(cdir)) if os.path.isdir(cdir) else 0
        if not os.path.exists(path):
            rows.append((rid, what, False, "%s not built" % exe))
            continue
        t0 = time.time()
        p = subprocess.run([path, cdir], capture_output=True, text=True, timeout=300)
        rows.append((rid, what, p.returncode == 0, "%d inputs replayed in %.2f s, %s" % (
            n, time.time() - t0, "no crash, no sanitizer report" if p.returncode == 0 else
            (p.stdout + p.stderr).strip()[-200:])))
    return rows


def run_one(script, args, env, timeout):
    e = dict(os.environ)
    e.update(env)
    e.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    t0 = time.time()
    try:
        p = subprocess.run([PY, os.path.join(TEST, script), *args], capture_output=True, text=True, env=e,
                           timeout=timeout, cwd=os.path.dirname(os.path.join(TEST, script)))
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as x:
        out, rc = ((x.stdout or b"").decode() if isinstance(x.stdout, bytes) else (x.stdout or "")) + \
            "\n(timed out after %d s)" % timeout, -1
    return out, rc, time.time() - t0


def figure_of_sub(out, name):
    """(passed, figure) of harness subtest name: its PASS/FAIL line, and the last figure
    line ("   ...") it printed since the previous subtest's line."""
    last, lines = None, out.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r"(PASS|FAIL) (\S+)\s*(.*)", ln)
        if not m:
            continue
        if m.group(2) == name:
            section = lines[last + 1 if last is not None else 0:i]
            figs = [l.strip() for l in section if l.startswith("   ") and not l.startswith("    ")]
            if m.group(1) == "FAIL":
                return False, m.group(3).strip()[:300]
            return True, figs[-1] if figs else "(no figure printed)"
        last = i
    return False, "did not run (no PASS/FAIL line)"


def collect(out):
    ledgers = [(m.group(1), int(m.group(2)), int(m.group(3)))
               for m in re.finditer(r"^LEDGER (.+?): calls=(\d+) one_terminal=(\d+)", out, re.M)]
    inv = re.findall(r"^INVARIANTS (.+?):", out, re.M)
    return ledgers, inv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=("quick", "full", "soak"), default="quick")
    ap.add_argument("--duration", type=float, default=300.0, help="soak: seconds of traffic (default 300)")
    ap.add_argument("--only", default="", help="comma-separated run names (coordinator, robust, chaos, ...)")
    ap.add_argument("--json", default="", help="also write the rows as JSON to this file")
    a = ap.parse_args()
    if a.profile == "soak":
        e = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        return subprocess.run([PY, os.path.join(HERE, "soak.py"), "--duration", str(a.duration)] +
                              (["--json", a.json] if a.json else []), env=e).returncode
    only = [x for x in a.only.split(",") if x]
    build = os.environ.get("BUILD") or os.path.dirname(os.path.dirname(os.path.abspath(
        os.environ.get("STEPD_BIN", "build/daemon/stepd"))))
    rows, ledgers, invariants, t_all = [], [], [], time.time()
    timeout = 600 if a.profile == "quick" else 3600
    for name, script, args, env, specs in runs(a.profile):
        if only and name not in only:
            continue
        out, rc, dt = run_one(script, args, env, timeout)
        lg, inv = collect(out)
        ledgers += lg
        invariants += inv
        for rid, what, (kind, sel) in specs:
            if rc == 77 and "SKIP" in out:
                ok, fig = False, "skipped: " + next((l for l in out.splitlines() if "SKIP" in l), "")[:200]
            elif kind == "sub":
                ok, fig = figure_of_sub(out, sel)
            else:
                hits = [l.strip() for l in out.splitlines() if re.search(sel, l)]
                ok, fig = rc == 0 and bool(hits), hits[-1] if hits else "(line not printed; exit %d)" % rc
            if not ok and rc not in (0, 77):
                tail = [l for l in out.splitlines() if l.strip()][-3:]
                fig += "  [%s exit %d: %s]" % (name, rc, " | ".join(t.strip()[:120] for t in tail))
            rows.append((rid, what, ok, fig))
            print("%-4s %-4s %s: %s" % (rid, "PASS" if ok else "FAIL", what, fig), flush=True)
        print("     (%s: %.1f s)" % (name, dt), flush=True)
    if not only or "secret-equal" in only:
        for r in secret_rows(build):
            rows.append(r)
            print("%-4s %-4s %s: %s" % (r[0], "PASS" if r[2] else "FAIL", r[1], r[3]), flush=True)
    if not only or "fuzz" in only:
        for r in fuzz_rows(build):
            rows.append(r)
            print("%-4s %-4s %s: %s" % (r[0], "PASS" if r[2] else "FAIL", r[1], r[3]), flush=True)
    calls = sum(c for _, c, _ in ledgers)
    once = sum(o for _, _, o in ledgers)
    d2 = calls > 0 and calls == once
    rows.append(("D2", "across every chaos run: one terminal status per accepted call", d2,
                 "%d calls in %d runs, %d with exactly one terminal status" % (calls, len(ledgers), once)))
    rows.append(("D1", "engine request states and KV blocks back to idle after each chaos run",
                 len(invariants) > 0 and len(invariants) >= len(ledgers),
                 "held %d times (after each of the %d ledgered runs and more)" % (len(invariants), len(ledgers))))
    for r in rows[-2:]:
        print("%-4s %-4s %s: %s" % (r[0], "PASS" if r[2] else "FAIL", r[1], r[3]), flush=True)
    n_ok = sum(1 for r in rows if r[2])
    print("report (%s): %d rows, %d pass, %d fail; %d calls through faults, each one terminal status: %s; "
          "%.0f s" % (a.profile, len(rows), n_ok, len(rows) - n_ok, calls, "yes" if d2 else "NO",
                      time.time() - t_all), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dict(id=r[0], what=r[1], ok=r[2], figure=r[3]) for r in rows], f, indent=1)
    return 0 if n_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
