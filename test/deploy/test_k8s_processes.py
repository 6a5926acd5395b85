#!/usr/bin/env python3
"""test_k8s_processes.py - the Kubernetes manifests' containers run as processes, and every
probe they declare must succeed against them.

For an overlay, rendered with kustomize: the coordinator's container and the rank pods of
one LeaderWorkerSet group, each with its command and args as written, $(VAR) expanded as
the kubelet does from the container's env (downward API: status.podIP -> 127.0.0.1, the pod's
labels, among them the group index label LWS puts on it) and the variables LeaderWorkerSet
sets (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX).  What a host without a cluster
must change, and nothing else: the image's paths (/usr/bin/X -> the build's X, /models,
/etc/stepd/{keys,tls}, /run/stepd -> temporary directories with the tiny model, generated
keys and a self-signed certificate), Service DNS names -> 127.0.0.1, --device=cuda:N ->
cpu, and, since the pods here share one network namespace (a private one, unshare -n, so
that the manifests' fixed ports cannot meet other tests'), rank i's health port 8081 -> 8081+i
(each pod has its own IP in a cluster), probed at that port, and the pod's interface
(--comm-net-devices=eth0) -> lo.

Then, as the kubelet: each startupProbe until it succeeds (within periodSeconds x
failureThreshold), then every readinessProbe and livenessProbe once (HTTPS probes without
verifying the certificate, as the kubelet); a request through the public gRPC port (TLS + API
key); GET /v1/models through the Service stepd-http (its targetPort on the coordinator's pod;
HTTPS verified, with the API key: 200 with the model list; without it: 401); the coordinator's preStop hook (stepctl drain), after which it
must exit 0 within terminationGracePeriodSeconds; the ranks then exit 0.

Overlays run: 1gpu (a group of 1) and 2node with the group cut to 2 ranks (the tiny model
has 4 KV heads, so 8 ranks cannot hold it; the rank pods' template is the same).
"""
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402

if os.environ.get("STEPD_K8S_NETNS") != "1":
    # a private network namespace: the manifests' fixed ports are ours alone
    cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable] + sys.argv
    env = dict(os.environ, STEPD_K8S_NETNS="1")
    try:
        sys.exit(subprocess.call(cmd, env=env))
    except FileNotFoundError:
        print("FAIL: unshare (util-linux) is missing")
        sys.exit(1)

import proclib as pl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)


def prepare(d):
    models = os.path.join(d, "models")
    os.makedirs(models)
    os.symlink(os.path.join(ROOT, "models", "tiny-step"), os.path.join(models, "step-3.7-flash"))
    keys = os.path.join(d, "keys")
    os.makedirs(keys)
    open(os.path.join(keys, "api-key"), "w").write("k8s-test-api-key\n")
    open(os.path.join(keys, "control-key"), "w").write("k8s-test-control-key\n")
    tls = os.path.join(d, "tls")
    os.makedirs(tls)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", os.path.join(tls, "tls.key"), "-out", os.path.join(tls, "tls.crt")],
                   check=True, capture_output=True)
    return {"/models": models, "/etc/stepd/keys": keys, "/etc/stepd/tls": tls}


def map_arg(a, paths, services, rundir):
    for k, v in paths.items():
        a = a.replace(k, v)
    a = a.replace("/run/stepd", rundir)
    for s in services:
        a = re.sub(r"(?<![\w.-])%s(\.[\w.-]+)?:" % re.escape(s), "127.0.0.1:", a)
    a = re.sub(r"^--device=cuda:\d+$", "--device=cpu", a)
    a = re.sub(r"^--comm-net-devices=.*$", "--comm-net-devices=lo", a)
    if a.startswith("/usr/bin/"):
        a = os.path.abspath(dl.build_binary(os.path.basename(a)))
    return a


def container_env(c, pod_labels, lws):
    env = dict(lws)
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
            continue
        fp = e["valueFrom"]["fieldRef"]["fieldPath"]
        if fp == "status.podIP":
            env[e["name"]] = "127.0.0.1"
        else:
            m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", fp)
            assert m, "unexpected fieldRef %s" % fp
            env[e["name"]] = pod_labels[m.group(1)]
    return env


def expand(a, env):
    return re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda m: env.get(m.group(1), m.group(0)), a)


def run_probe(probe, c, tls_ca):
    if "grpc" in probe:
        st = pl.grpc_health("127.0.0.1:%d" % probe["grpc"]["port"], probe["grpc"].get("service", ""),
                            timeout=probe.get("timeoutSeconds", 1))
        return st == pl.sh.SERVING, "gRPC health %s" % st
    if "httpGet" in probe:
        port = probe["httpGet"]["port"]
        if not isinstance(port, int):
            port = [p["containerPort"] for p in c["ports"] if p["name"] == port][0]
        scheme = probe["httpGet"].get("scheme", "HTTP")
        code, body = pl.http_get(port, probe["httpGet"]["path"], timeout=probe.get("timeoutSeconds", 1),
                                 scheme=scheme)
        return code is not None and 200 <= code < 400, "%s %s %s" % (scheme, code, body.strip()[:120])
    raise AssertionError("probe kind not run by this test: %s" % probe)


def startup(name, c, tls_ca):
    p = c["startupProbe"]
    limit = min(p.get("periodSeconds", 10) * p.get("failureThreshold", 3), 180)
    t0 = time.monotonic()
    while True:
        ok, what = run_probe(p, c, tls_ca)
        if ok:
            print("   %s: startupProbe succeeded after %.1f s (%s)" % (name, time.monotonic() - t0, what))
            return
        if time.monotonic() - t0 > limit:
            raise AssertionError("%s: startupProbe failing for %d s: %s" % (name, limit, what))
        time.sleep(0.2)


def run_overlay(d, overlay, size=None):
    docs = dl.render(os.path.join(ROOT, "deploy", "kubernetes", "overlays", overlay))
    paths = prepare(d)
    services = [x["metadata"]["name"] for x in docs if x["kind"] == "Service"]
    ns = [x for x in docs if x["kind"] == "Namespace"][0]["metadata"]["name"]
    dep = [x for x in docs if x["kind"] == "Deployment"][0]
    lws = [x for x in docs if x["kind"] == "LeaderWorkerSet"][0]
    t = lws["spec"]["leaderWorkerTemplate"]
    n = size or t.get("size", 1)
    procs = []

    def start(name, tmpl, lwsvars, shift=0):
        c = tmpl["spec"]["containers"][0]
        if shift:
            # one network namespace for every pod here: rank i's health port moves by i
            c = dict(c, args=[re.sub(r"^(--health-listen=.*:)(\d+)$", lambda m: m.group(1) + str(int(m.group(2)) + shift), a)
                              for a in c.get("args", [])])
            for k in ("startupProbe", "readinessProbe", "livenessProbe"):
                pr = dict(c[k])
                pr["httpGet"] = dict(pr["httpGet"], port=pr["httpGet"]["port"] + shift)
                c[k] = pr
        rundir = os.path.join(d, "run-" + name)
        os.makedirs(rundir)
        env = container_env(c, tmpl["metadata"].get("labels", {}), lwsvars)
        argv = [map_arg(expand(a, env), paths, services, rundir) for a in c["command"] + c.get("args", [])]
        penv = dict(os.environ, **{k: v for k, v in env.items()})
        print("   %s: %s" % (name, " ".join(argv)))
        procs.append(pl.Proc(name, argv, penv, d))
        return c, tmpl

    try:
        cc, ctmpl = start("coordinator", dep["spec"]["template"], {})
        startup("coordinator", cc, None)
        ranks = []
        for i in range(n):
            tmpl = t.get("leaderTemplate") if i == 0 and t.get("leaderTemplate") else t["workerTemplate"]
            labels = dict(tmpl["metadata"].get("labels", {}))
            # what LeaderWorkerSet adds to each pod of group 0 (pod_utils.go AddLWSVariables)
            labels.update({"leaderworkerset.sigs.k8s.io/group-index": "0",
                           "leaderworkerset.sigs.k8s.io/worker-index": str(i)})
            tmpl = dict(tmpl, metadata=dict(tmpl["metadata"], labels=labels))
            lv = {"LWS_LEADER_ADDRESS": "%s-0.%s.%s" % (lws["metadata"]["name"], lws["metadata"]["name"], ns),
                  "LWS_GROUP_SIZE": str(n), "LWS_WORKER_INDEX": str(i)}
            ranks.append(start("rank%d" % i, tmpl, lv, shift=i))
        for i, (c, _) in enumerate(ranks):
            startup("rank%d" % i, c, None)
        for name, (c, _) in [("coordinator", (cc, ctmpl))] + [("rank%d" % i, r) for i, r in enumerate(ranks)]:
            for kind in ("readinessProbe", "livenessProbe"):
                ok, what = run_probe(c[kind], c, None)
                assert ok, "%s: %s failed: %s" % (name, kind, what)
                print("   %s: %s ok (%s)" % (name, kind, what))
        # a request through the public Service port: TLS and the API key
        st = subprocess.run([os.path.abspath(dl.build_binary("stepctl")), "--addr", "localhost:20051", "--tls-ca",
                             os.path.join(paths["/etc/stepd/tls"], "tls.crt"), "--api-key-file",
                             os.path.join(paths["/etc/stepd/keys"], "api-key"), "generate", "--max-tokens", "8",
                             "In the beginning"], capture_output=True, text=True, timeout=60)
        assert st.returncode == 0, "request over TLS failed: %s %s" % (st.stdout, st.stderr)
        print("   request over TLS with the API key: %r" % st.stdout.strip()[:80])
        # the OpenAI API through its Service (stepd-http: port -> targetPort on the pod):
        # HTTPS verified against the certificate, the API key, GET /v1/models
        svc = [x for x in docs if x["kind"] == "Service" and x["metadata"]["name"] == "stepd-http"]
        assert svc, "no Service stepd-http exposes the OpenAI API"
        sp = svc[0]["spec"]["ports"][0]
        tp = sp.get("targetPort", sp["port"])
        cport = tp if isinstance(tp, int) else [p["containerPort"] for p in cc["ports"] if p["name"] == tp][0]
        key = open(os.path.join(paths["/etc/stepd/keys"], "api-key")).read().strip()
        code, body = pl.http_get(cport, "/v1/models", timeout=10, scheme="HTTPS", host="localhost",
                                 ca=os.path.join(paths["/etc/stepd/tls"], "tls.crt"),
                                 headers={"Authorization": "Bearer " + key})
        assert code == 200 and '"object":"list"' in body.replace(" ", ""), \
            "GET /v1/models through Service stepd-http (port %s -> %s): %s %s" % (sp["port"], cport, code, body[:300])
        print("   Service stepd-http port %d -> container port %d: GET /v1/models 200 %s" %
              (sp["port"], cport, body.strip()[:100]))
        code, _ = pl.http_get(cport, "/v1/models", timeout=10, scheme="HTTPS", host="localhost",
                              ca=os.path.join(paths["/etc/stepd/tls"], "tls.crt"))
        assert code == 401, "GET /v1/models without the API key: %s, expected 401" % code
        # termination: preStop, then SIGTERM; the coordinator exits 0 within the grace period
        pre = cc["lifecycle"]["preStop"]["exec"]["command"]
        pre = [map_arg(a, paths, services, d) for a in pre]
        r = subprocess.run(pre, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, "preStop %s: %s %s" % (pre, r.stdout, r.stderr)
        procs[0].p.send_signal(signal.SIGTERM)
        grace = dep["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        t0 = time.monotonic()
        rc = procs[0].wait(grace)
        print("   coordinator: preStop `%s`, SIGTERM: exit %d after %.1f s (grace %d s)" %
              (" ".join(os.path.basename(x) for x in pre[:1]) + " drain", rc, time.monotonic() - t0, grace))
        assert rc == 0, procs[0].text()[-2000:]
        for i, p in enumerate(procs[1:]):
            wrc = p.wait(t["workerTemplate"]["spec"].get("terminationGracePeriodSeconds", 30))
            assert wrc == 0, "rank%d exited %s:\n%s" % (i, wrc, p.text()[-2000:])
        print("   every rank exited 0 after the coordinator's Shutdown")
    finally:
        for p in procs:
            p.kill()


def main():
    os.environ["UCX_NET_DEVICES"] = "lo"
    pl.run_cases([("overlay %s%s" % (overlay, " (group cut to %d ranks)" % size if size else ""),
                   run_overlay, overlay, size) for overlay, size in (("1gpu", None), ("2node", 2))],
                 "stepd-k8s-")
    print("Kubernetes containers as processes: every probe succeeded")


if __name__ == "__main__":
    main()
