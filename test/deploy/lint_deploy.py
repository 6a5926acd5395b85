#!/usr/bin/env python3
"""lint_deploy.py - docs/RELIABILITY.md E5/E6/B11: check the systemd units and the
Kubernetes manifests without a cluster.

systemd: Type=notify, WatchdogSec, non-root User, TimeoutStopSec > drain timeout,
KillMode=mixed, no PrivateDevices on the GPU worker (DeviceAllow instead), and
`systemd-analyze security --offline=yes --threshold=45` when systemd-analyze exists.
Kubernetes: every pod runAsNonRoot with a non-zero uid, seccomp RuntimeDefault, no
hostNetwork/hostPID/hostIPC; every container allowPrivilegeEscalation=false,
capabilities drop ALL, readOnlyRootFilesystem, not privileged; gRPC startup,
readiness and liveness probes with distinct services; GPUs only via
resources.limits nvidia.com/gpu; terminationGracePeriodSeconds > drain timeout.
"""
import os
import re
import shutil
import subprocess
import sys

try:
    import yaml
except ImportError:
    print("SKIP: PyYAML not importable")
    sys.exit(77)

ROOT = os.environ.get("SRC_ROOT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
errors = []


def err(msg):
    errors.append(msg)
    print("FAIL", msg)


def unit_keys(path):
    keys = {}
    cont = ""
    for line in open(path):
        line = line.rstrip("\n")
        if cont:
            line = cont + line.strip()
            cont = ""
        if line.endswith("\\"):
            cont = line[:-1]
            continue
        if not line or line.startswith("#") or line.startswith("["):
            continue
        k, _, v = line.partition("=")
        keys.setdefault(k.strip(), []).append(v.strip())
    return keys


def seconds(v):
    m = re.fullmatch(r"(\d+)(s|min)?", v)
    if not m:
        return None
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def check_unit(name, gpu):
    path = os.path.join(ROOT, "systemd", name)
    k = unit_keys(path)
    env = unit_keys(os.path.join(ROOT, "systemd", "stepd.env"))
    drain = int(env.get("STEPD_DRAIN_TIMEOUT", ["30"])[0])
    if k.get("Type") != ["notify"]:
        err("%s: Type=notify required" % name)
    if "WatchdogSec" not in k:
        err("%s: WatchdogSec missing" % name)
    user = k.get("User", ["root"])[0]
    if user in ("root", "0"):
        err("%s: runs as root" % name)
    stop = seconds(k.get("TimeoutStopSec", ["90"])[0])
    if stop is None or stop <= drain:
        err("%s: TimeoutStopSec (%s) must exceed the drain timeout (%d s)" % (name, stop, drain))
    if k.get("KillMode") != ["mixed"]:
        err("%s: KillMode=mixed expected" % name)
    if k.get("NoNewPrivileges") != ["yes"]:
        err("%s: NoNewPrivileges=yes expected" % name)
    if gpu:
        if k.get("PrivateDevices") == ["yes"]:
            err("%s: PrivateDevices=yes hides /dev/nvidia*" % name)
        allow = " ".join(k.get("DeviceAllow", []))
        if "/dev/nvidiactl" not in allow or k.get("DevicePolicy") != ["closed"]:
            err("%s: DevicePolicy=closed with DeviceAllow=/dev/nvidia* expected" % name)
    for a in k.get("ExecStart", []):
        if "--api-key " in a or "--api-key=" in a:
            err("%s: API key on the command line" % name)
    if shutil.which("systemd-analyze"):
        import tempfile
        tmp = tempfile.mkdtemp(prefix="stepd-lint-")
        src = path
        if "@" in name:
            src = os.path.join(tmp, name.replace("@", "@0"))
            shutil.copy(path, src)
        p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=45", src],
                           capture_output=True, text=True)
        shutil.rmtree(tmp, True)
        m = re.search(r"Overall exposure level for \S+: ([\d.]+)", p.stdout + p.stderr)
        print("   %s: systemd-analyze exposure %s" % (name, m.group(1) if m else "?"))
        if p.returncode != 0:
            err("%s: systemd-analyze security above threshold 4.5:\n%s" % (name, p.stdout[-2000:]))


def walk_pods(doc):
    """Yield (name, pod spec) for Deployments and LeaderWorkerSets."""
    kind = doc.get("kind")
    name = doc.get("metadata", {}).get("name")
    if kind == "Deployment":
        yield name, doc["spec"]["template"]["spec"]
    elif kind == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        yield name + "/leader", t["leaderTemplate"]["spec"]
        yield name + "/worker", t["workerTemplate"]["spec"]


def check_k8s(path, drain):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    pods = 0
    for doc in docs:
        if doc.get("kind") == "Namespace":
            if doc["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted":
                err("%s: namespace does not enforce the restricted pod security standard" % path)
        for name, spec in walk_pods(doc):
            pods += 1
            sc = spec.get("securityContext", {})
            if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
                err("%s: runAsNonRoot with a non-zero runAsUser required" % name)
            if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                err("%s: seccompProfile RuntimeDefault required" % name)
            for h in ("hostNetwork", "hostPID", "hostIPC"):
                if spec.get(h):
                    err("%s: %s set" % (name, h))
            if spec.get("terminationGracePeriodSeconds", 30) <= drain:
                err("%s: terminationGracePeriodSeconds must exceed the drain timeout %d" % (name, drain))
            for c in spec.get("containers", []):
                cs = c.get("securityContext", {})
                cn = "%s/%s" % (name, c["name"])
                if cs.get("allowPrivilegeEscalation") is not False:
                    err("%s: allowPrivilegeEscalation must be false" % cn)
                if "ALL" not in cs.get("capabilities", {}).get("drop", []):
                    err("%s: capabilities.drop [ALL] required" % cn)
                if cs.get("readOnlyRootFilesystem") is not True:
                    err("%s: readOnlyRootFilesystem required" % cn)
                if cs.get("privileged"):
                    err("%s: privileged" % cn)
                probes = {p: c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")}
                for p, v in probes.items():
                    if not v or "grpc" not in v:
                        err("%s: %s must be a gRPC probe" % (cn, p))
                rs = (probes["readinessProbe"] or {}).get("grpc", {}).get("service")
                ls = (probes["livenessProbe"] or {}).get("grpc", {}).get("service")
                if not rs or not ls or rs == ls:
                    err("%s: readiness and liveness probes need distinct health services (%s, %s)" % (cn, rs, ls))
                req = c.get("resources", {}).get("requests", {})
                if "nvidia.com/gpu" in req and "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}):
                    err("%s: GPUs must be requested through resources.limits" % cn)
                for vm in c.get("volumeMounts", []):
                    if vm["name"] in ("models", "keys", "tls") and not vm.get("readOnly"):
                        err("%s: %s must be mounted read-only" % (cn, vm["name"]))
    if pods == 0:
        err("%s: no pod templates found" % path)
    print("   %s: %d pod templates checked" % (os.path.relpath(path, ROOT), pods))


def main():
    check_unit("stepd.service", gpu=False)
    check_unit("stepd-worker@.service", gpu=True)
    for f in sorted(os.listdir(os.path.join(ROOT, "deploy", "k8s"))):
        if f.endswith(".yaml"):
            check_k8s(os.path.join(ROOT, "deploy", "k8s", f), drain=30)
    if errors:
        print("%d problems" % len(errors))
        sys.exit(1)
    print("deploy lint: all checks passed")


if __name__ == "__main__":
    main()
