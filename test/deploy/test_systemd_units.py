#!/usr/bin/env python3
"""test_systemd_units.py - the systemd units run as systemd would run them (this host has no
systemd as PID 1, so a notification-socket harness stands in for it).

The units and stepd.env are the ones `meson install` puts in place for this build (install
tag systemd, into a DESTDIR): paths as the build's prefix makes them.  Each process gets
exactly the installed unit's ExecStart= with systemd's word expansion, its Environment= and
EnvironmentFile=s in order (<sysconfdir>/stepd/ mapped to a temporary directory holding the
installed stepd.env plus the per-site files the units read:
worker-N.env, and for this host a stepd.env with free ports, the tiny model and the CPU
device), $CREDENTIALS_DIRECTORY for LoadCredential=, $NOTIFY_SOCKET and $WATCHDOG_USEC (from
WatchdogSec=, lowered by a drop-in to WATCHDOG_S so the test takes seconds).  The binaries
are the build's (<bindir>/X -> build/.../X).  Checked as systemd would:

  1. stepd.service + stepd-worker@0 + stepd-worker@1 (one group of 2 CPU ranks): the
     coordinator sends READY=1; each rank sends STATUS= lines and READY=1 only after its
     load (its "loading" STATUS comes first, and the coordinator reports the group ready by
     then); every process pings WATCHDOG=1 at most half of WatchdogSec apart (the interval
     it logs from $WATCHDOG_USEC; pings keep coming); a request is served;
     SIGTERM to the coordinator: STOPPING=1, drain, exit 0; the ranks get Shutdown, send
     STOPPING=1 and exit 0.
  2. stepd-serve.service (STEPD_TENSOR_PARALLEL_SIZE=2, STEPD_SERVE_DEVICE=cpu): READY=1
     once its group is ready, EXTEND_TIMEOUT_USEC before that, WATCHDOG=1, STATUS= naming the
     workers, a request served, SIGTERM: STOPPING=1, exit 0, no rank left behind.
"""
import os
import re
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402
import proclib as pl  # noqa: E402

WATCHDOG_S = 3
ROOT = os.path.abspath(dl.ROOT)
MODEL = os.path.join(ROOT, "models", "tiny-step")
INSTALLED = {}      # unit_dir, env, dirs: main() installs the build's systemd files


def binary_map(words):
    out = []
    for w in words:
        if w.startswith(INSTALLED["dirs"]["bindir"] + "/"):
            b = dl.build_binary(os.path.basename(w))
            assert b, "the build has no %s" % w
            w = os.path.abspath(b)
        out.append(w)
    return out


def site(d, env_over, worker_env):
    etc = os.path.join(d, "etc")
    os.makedirs(etc)
    text = open(INSTALLED["env"]).read()
    for k, v in env_over.items():
        text, n = re.subn(r"^%s=.*$" % k, "%s=%s" % (k, v), text, flags=re.M)
        assert n == 1, "the installed stepd.env has no %s" % k
    open(os.path.join(etc, "stepd.env"), "w").write(text)
    for i, extra in worker_env.items():
        open(os.path.join(etc, "worker-%s.env" % i), "w").write(
            "".join("%s=%s\n" % kv for kv in extra.items()))
    cred = os.path.join(d, "credentials")
    os.makedirs(cred)
    open(os.path.join(cred, "api-key"), "w").write("test-api-key-1234\n")
    open(os.path.join(cred, "control-key"), "w").write("test-control-key-5678\n")
    return etc, cred


def start_unit(d, unit_name, instance, etc, cred, name):
    u = dl.unit_parse(os.path.join(INSTALLED["unit_dir"], unit_name))
    svc = u["Service"]
    assert svc["Type"] == ["notify"], unit_name
    base = {k: v for k, v in os.environ.items() if k.startswith(("PATH", "LANG", "UCX_", "TMPDIR", "HOME"))}
    env = dl.unit_environment(u, instance, etc, base, INSTALLED["dirs"]["sysconfdir"])
    env["CREDENTIALS_DIRECTORY"] = cred
    rt = os.path.join(d, "run-" + name)
    os.makedirs(rt)
    env["RUNTIME_DIRECTORY"] = rt            # RuntimeDirectory=
    ns = pl.NotifySocket(d, name)
    env["NOTIFY_SOCKET"] = ns.path
    assert dl.seconds(svc["WatchdogSec"][0]) > WATCHDOG_S, "the drop-in lowers WatchdogSec"
    env["WATCHDOG_USEC"] = str(WATCHDOG_S * 1000000)
    argv = binary_map(dl.exec_expand(svc["ExecStart"][0], env, instance))
    print("   %s: %s" % (name, " ".join(argv)))
    return pl.Proc(name, argv, env, d), ns, u


def generate(addr, key):
    ch = pl.grpc.insecure_channel(addr)
    try:
        st = pl.pbg.InferenceStub(ch)
        toks, _, finals, _ = pl.sh.collect(st.Generate(pl.sh.gen_request(max_tokens=8), timeout=60,
                                                       metadata=[("authorization", "Bearer " + key)]))
        assert finals and len(toks) == 8, (toks, finals)
        return toks
    finally:
        ch.close()


def check_watchdog(ns, proc, t0, name):
    """WATCHDOG=1 within WatchdogSec, without measuring gaps on the real clock (a loaded
    machine stretches them, systemd is not part of the test): the interval the process took
    from $WATCHDOG_USEC (its log line) is at most half of WatchdogSec, and its pings keep
    coming (an event wait for three after t0; 60 s is a hang guard)."""
    m = re.search(r"systemd watchdog: WATCHDOG=1 every (\d+) ms.*\(WatchdogSec (\d+) ms\)", proc.text())
    assert m, "%s: no watchdog interval in its log:\n%s" % (name, proc.text()[-2000:])
    every, limit = int(m.group(1)), int(m.group(2))
    assert limit == WATCHDOG_S * 1000 and 2 * every <= limit, "%s: WATCHDOG=1 every %d ms for WatchdogSec %d ms" % (
        name, every, limit)
    pl.wait_until(lambda: len([t for t in ns.times("WATCHDOG", "1") if t > t0]) >= 3, 60,
                  "%s: three WATCHDOG=1 pings" % name)
    print("   %s: WATCHDOG=1 every %d ms (WatchdogSec %d s), pinging" % (name, every, WATCHDOG_S))


def test_split_units(d):
    pub, adm, ctl, met, eng, web = (pl.free_port() for _ in range(6))
    etc, cred = site(d, {
        "STEPD_LISTEN": "127.0.0.1:%d" % pub, "STEPD_ADMIN_LISTEN": "127.0.0.1:%d" % adm,
        "STEPD_HTTP_PORT": str(web),
        "STEPD_CONTROL_LISTEN": "127.0.0.1:%d" % ctl, "STEPD_METRICS_LISTEN": "127.0.0.1:%d" % met,
        "STEPD_MODEL_DIR": MODEL, "STEPD_CONTROL_ADDR": "127.0.0.1:%d" % ctl, "STEPD_WORLD_SIZE": "2",
        "STEPD_ENGINE_LISTEN": "127.0.0.1:%d" % eng,
    }, {i: {"STEPD_DEVICE": "cpu", "STEPD_WORKER_EXTRA_ARGS": "--threads 1"} for i in (0, 1)})
    co, cns, _ = start_unit(d, "stepd.service", "", etc, cred, "stepd")
    procs = [co]
    try:
        t_ready = cns.wait("READY", "1", 30)
        ws = [start_unit(d, "stepd-worker@.service", str(i), etc, cred, "worker%d" % i) for i in (0, 1)]
        procs += [w[0] for w in ws]
        t_up = time.monotonic()
        for i, (p, ns, _) in enumerate(ws):
            r = ns.wait("READY", "1", 120)
            loading = [t for t, kv in ns.msgs if kv.get("STATUS", "").startswith("loading")]
            assert loading and loading[0] < r, "worker%d: READY=1 before its load (%s)" % (i, ns.values("STATUS"))
            print("   worker%d: READY=1 after %.2f s; STATUS: %s" % (i, r - t_up, " | ".join(ns.values("STATUS"))))
        pl.wait_until(lambda: pl.grpc_health("127.0.0.1:%d" % pub, "readiness") == pl.sh.SERVING, 30,
                      "coordinator readiness")
        # READY=1 of a rank means its group has formed: the coordinator knows it ready by now
        toks = generate("127.0.0.1:%d" % pub, "test-api-key-1234")
        print("   served a request: %s" % toks)
        t0 = max(ns.wait("READY", "1") for _, ns, _ in ws)
        check_watchdog(cns, co, t_ready, "stepd")
        for i, (p, ns, _) in enumerate(ws):
            check_watchdog(ns, p, t0, "worker%d" % i)
        # systemctl stop stepd: SIGTERM (KillMode=mixed: the main process first)
        co.p.send_signal(signal.SIGTERM)
        cns.wait("STOPPING", "1", 10)
        rc = co.wait(60)
        assert rc == 0, "stepd exited %s:\n%s" % (rc, co.text()[-2000:])
        for i, (p, ns, _) in enumerate(ws):
            wrc = p.wait(30)
            assert wrc == 0, "worker%d exited %s:\n%s" % (i, wrc, p.text()[-2000:])
            ns.wait("STOPPING", "1", 5)
        print("   SIGTERM: stepd STOPPING=1, drained, exit 0; both ranks STOPPING=1, exit 0")
    finally:
        for p in procs:
            p.kill()


def test_serve_unit(d):
    pub, adm, ctl, met, web = (pl.free_port() for _ in range(5))
    etc, cred = site(d, {
        "STEPD_LISTEN": "127.0.0.1:%d" % pub, "STEPD_ADMIN_LISTEN": "127.0.0.1:%d" % adm,
        "STEPD_HTTP_PORT": str(web),
        "STEPD_CONTROL_LISTEN": "127.0.0.1:%d" % ctl, "STEPD_METRICS_LISTEN": "127.0.0.1:%d" % met,
        "STEPD_MODEL_DIR": MODEL, "STEPD_TENSOR_PARALLEL_SIZE": "2", "STEPD_SERVE_DEVICE": "cpu",
        "STEPD_SERVE_EXTRA_ARGS": "--threads 1",
    }, {})
    p, ns, _ = start_unit(d, "stepd-serve.service", "", etc, cred, "serve")
    try:
        t_start = time.monotonic()
        r = ns.wait("READY", "1", 120)
        assert pl.grpc_health("127.0.0.1:%d" % pub, "readiness") == pl.sh.SERVING, "READY=1 before readiness"
        ext = [t for t in ns.times("EXTEND_TIMEOUT_USEC") if t < r]
        print("   serve: READY=1 after %.2f s (%d EXTEND_TIMEOUT_USEC before it); STATUS: %s" %
              (r - t_start, len(ext), ns.values("STATUS")[-1]))
        assert "workers 2/2 running" in ns.values("STATUS")[-1], ns.values("STATUS")[-1]
        generate("127.0.0.1:%d" % pub, "test-api-key-1234")
        check_watchdog(ns, p, r, "serve")
        pids = [int(x) for x in re.findall(r"rank \d started: pid (\d+)", p.text())]
        assert len(pids) == 2, p.text()
        p.p.send_signal(signal.SIGTERM)
        ns.wait("STOPPING", "1", 10)
        rc = p.wait(60)
        assert rc == 0, "stepd serve exited %s:\n%s" % (rc, p.text()[-2000:])
        for pid in pids:
            assert not os.path.exists("/proc/%d" % pid) or \
                open("/proc/%d/stat" % pid).read().split()[2] == "Z", "rank pid %d left running" % pid
        assert "every worker rank has exited" in p.text()
        print("   serve: SIGTERM: STOPPING=1, drain, ranks stopped, exit 0")
    finally:
        p.kill()


def main():
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    dest = tempfile.mkdtemp(prefix="stepd-units-install-")
    try:
        INSTALLED["unit_dir"], INSTALLED["dirs"] = dl.installed_units(dl.BUILD, dest)
        INSTALLED["env"] = dest + os.path.join(INSTALLED["dirs"]["sysconfdir"], "stepd", "stepd.env")
        print("   installed units: %s (bindir %s, sysconfdir %s)" % (
            INSTALLED["unit_dir"], INSTALLED["dirs"]["bindir"], INSTALLED["dirs"]["sysconfdir"]))
        run(dest)
    finally:
        shutil.rmtree(dest, True)


def run(dest):
    pl.run_cases((("split units (stepd + stepd-worker@0,1)", test_split_units),
                  ("stepd-serve.service", test_serve_unit)), "stepd-units-")
    print("systemd units: all checks passed")


if __name__ == "__main__":
    main()
