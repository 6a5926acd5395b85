#!/usr/bin/env python3
"""lint_deploy.py - docs/RELIABILITY.md E5/E6/B11: the shipped deployment files checked
without a service manager, a cluster or a container engine.

systemd (systemd/*.in as this build installs them): `systemd-analyze verify` with no complaint at all (it exits 0 on unknown
keys and bad values, so any output fails), `systemd-analyze security --offline=yes
--threshold=25` (exposure at most 2.5), Type=notify with NotifyAccess=main and WatchdogSec,
non-root User, KillMode=mixed, NoNewPrivileges, stop timeouts ordered (B11: TimeoutStopSec
above the drain timeout; for stepd serve above drain + twice the ranks' stop timeout), GPU
units with a device allow-list instead of PrivateDevices, no key on a command line, every
variable ExecStart uses defined (Environment=, stepd.env or systemd itself), every flag a
flag of the program (its --help), the worker units grouped by stepd-workers.target, every
file of systemd/ installed by meson.

Kubernetes (deploy/kubernetes/): every overlay rendered with kustomize (kubectl kustomize);
every object validated against the Kubernetes schemas of the kubernetes-validate package
(strict: unknown fields fail), LeaderWorkerSets against the CRD schema kept in
deploy/kubernetes/crd/ (strict as well); pod security (restricted); every probe's port is
one the container's command line listens on off loopback, with the right protocol (gRPC
health on a plaintext gRPC port that serves grpc.health.v1, with a known service name;
HTTP on a path that listener serves); every $(VAR) set by the container's env (earlier in
the list), by LeaderWorkerSet (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX) or by
Kubernetes (service links); terminationGracePeriodSeconds above the drain timeout the args
give, with a preStop drain on the coordinator; RecreateGroupOnPodRestart; memory-backed
/dev/shm, read-only model volume and GPU limits on GPU ranks; an engine address the
coordinator's pod can reach; multi-rank CUDA groups marked as needing NCCL; HTTPS probes
on TLS ports and plain HTTP ones elsewhere; the examples of deploy/kubernetes/examples/
against the schemas and the restricted pod security standard;
Services whose target ports exist; scrape annotations naming the metrics listener; images
built by deploy/container/Containerfile.

Container (deploy/container/Containerfile): two stages (CUDA devel -> CUDA runtime of the
same version), the portable build (-Dnative=false, no -march=native), a non-root numeric
USER equal to the manifests' runAsUser, every package a package of the archive (apt-cache)
and every build dependency of tools/dev/install-deps.sh among them, every path copied from
the build stage one that `meson install` produces (meson introspect --installed), every
binary the manifests run copied into the image.

Usage: lint_deploy.py [--k8s-file FILE]... [--unit FILE]...  (default: the shipped files;
with files, only those are checked: the defect tests run it on the files issue 23 replaced).
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402

try:
    import yaml
    import jsonschema
    import kubernetes_validate
    import kubernetes_validate.utils as kvu
    from referencing import Registry, Resource
except ImportError as e:
    print("FAIL: a test tool is missing (tools/dev/install-deps.sh installs it): %s" % e)
    sys.exit(1)

ROOT = dl.ROOT
K8S_VERSION = "1.30.0"
errors = []


def err(msg):
    errors.append(msg)
    print("FAIL", msg)


def note(msg):
    print("   " + msg)


# ================================================================ systemd

SYSTEMD_SETS = {"CREDENTIALS_DIRECTORY", "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "MAINPID",
                "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "INVOCATION_ID"}
UNIT_PROGRAMS = {"stepd": "stepd", "stepd-worker": "stepd-worker"}


def check_unit(path, env_path):
    name = os.path.basename(path)
    u = dl.unit_parse(path)
    svc = u.get("Service", {})
    env = dl.env_file_parse(env_path) if os.path.exists(env_path) else {}
    drain = int(env.get("STEPD_DRAIN_TIMEOUT", "30"))
    first = lambda k, d=None: svc.get(k, [d])[0]  # noqa: E731
    if first("Type") != "notify":
        err("%s: Type=notify required" % name)
    if first("NotifyAccess") != "main":
        err("%s: NotifyAccess=main required (READY/WATCHDOG from the main process only)" % name)
    if not first("WatchdogSec"):
        err("%s: WatchdogSec missing" % name)
    if first("User", "root") in ("root", "0"):
        err("%s: runs as root" % name)
    if first("KillMode") != "mixed":
        err("%s: KillMode=mixed expected" % name)
    if first("NoNewPrivileges") != "yes":
        err("%s: NoNewPrivileges=yes expected" % name)
    exec_line = first("ExecStart", "")
    words = dl.exec_expand(exec_line, {})
    prog = os.path.basename(words[0]) if words else ""
    serve = len(words) > 1 and prog == "stepd" and words[1] == "serve"
    stop = dl.seconds(first("TimeoutStopSec", "90"))
    need = drain
    if serve:
        wst = int(env.get("STEPD_WORKER_STOP_TIMEOUT", "15"))
        need = drain + 2 * wst + 1
    if stop is None or stop <= need:
        err("%s: TimeoutStopSec (%s) must exceed %s (%d s; RELIABILITY.md B11)" %
            (name, stop, "drain + twice the ranks' stop timeout" if serve else "the drain timeout", need))
    gpu = prog == "stepd-worker" or serve
    if gpu:
        if first("PrivateDevices") == "yes":
            err("%s: PrivateDevices=yes hides /dev/nvidia*" % name)
        allow = " ".join(svc.get("DeviceAllow", []))
        if "nvidia" not in allow or first("DevicePolicy") != "closed":
            err("%s: DevicePolicy=closed with DeviceAllow= for the NVIDIA devices expected" % name)
    if re.search(r"--(api|control)-key[ =]", exec_line):
        err("%s: a key on the command line (visible in ps)" % name)
    # every variable the command line uses is defined
    defined = set(env) | SYSTEMD_SETS
    for e in svc.get("Environment", []):
        for w in dl.split_words(e):
            defined.add(w.partition("=")[0])
    for v in dl.exec_referenced(exec_line):
        if v not in defined:
            err("%s: ExecStart uses $%s, which neither the unit nor %s defines" %
                (name, v, os.path.basename(env_path)))
    # every flag is one of the program's
    binary = dl.build_binary(UNIT_PROGRAMS.get(prog, prog))
    if not binary:
        err("%s: ExecStart runs %s, which this build does not produce" % (name, words[0] if words else "?"))
    else:
        known = dl.help_flags(binary)
        for w in words[1:]:
            fl = w.split("=")[0]
            if fl.startswith("--") and fl not in known:
                err("%s: %s has no flag %s (its --help)" % (name, prog, fl))
    if prog == "stepd-worker":
        if "stepd-workers.target" not in " ".join(u.get("Install", {}).get("WantedBy", [])) or \
                "stepd-workers.target" not in " ".join(u.get("Unit", {}).get("PartOf", [])):
            err("%s: WantedBy= and PartOf= stepd-workers.target expected (a node's ranks as one target)" % name)
    return u


def systemd_analyze(unit_paths, bindirs):
    sa = shutil.which("systemd-analyze")
    if not sa:
        err("systemd-analyze is missing (Debian package systemd; tools/dev/install-deps.sh)")
        return
    tmp = tempfile.mkdtemp(prefix="stepd-lint-")
    try:
        names = []
        for p in unit_paths:
            text = open(p).read()
            # verify checks that ExecStart= programs exist: the build's, at their install path
            for prog in ("stepd-worker", "stepd"):
                b = dl.build_binary(prog)
                if b:
                    for bindir in bindirs:
                        text = text.replace("%s/%s " % (bindir, prog), "%s " % b)
            n = os.path.basename(p)
            open(os.path.join(tmp, n), "w").write(text)
            if n.endswith("@.service"):
                n = n.replace("@.service", "@0.service")
                open(os.path.join(tmp, n), "w").write(text)
            names.append(n)
        v = subprocess.run([sa, "verify", "--man=no"] + names, cwd=tmp, capture_output=True, text=True)
        out = (v.stdout + v.stderr).strip()
        if v.returncode != 0 or out:
            err("systemd-analyze verify: %s" % (out or "exit %d" % v.returncode))
        else:
            note("systemd-analyze verify: %s: no complaint" % ", ".join(names))
        for n in names:
            if not n.endswith(".service") or n.endswith("@.service"):
                continue
            s = subprocess.run([sa, "security", "--offline=yes", "--threshold=25", n], cwd=tmp,
                               capture_output=True, text=True)
            m = re.search(r"Overall exposure level for \S+: ([\d.]+)", s.stdout + s.stderr)
            note("%s: systemd-analyze security exposure %s (threshold 2.5)" % (n, m.group(1) if m else "?"))
            if s.returncode != 0 or not m:
                err("%s: systemd-analyze security above threshold 2.5:\n%s" % (n, s.stdout[-1500:]))
    finally:
        shutil.rmtree(tmp, True)


def check_systemd(unit_paths=None):
    """The units as this build installs them (systemd/*.in configured by systemd/meson.build),
    or the unit files given."""
    d = os.path.join(ROOT, "systemd")
    shipped = unit_paths is None
    dest = tempfile.mkdtemp(prefix="stepd-lint-install-")
    try:
        try:
            unit_dir, dirs = dl.installed_units(dl.BUILD, dest)
        except (RuntimeError, KeyError) as e:
            err("the build's systemd files could not be installed: %s" % e)
            return
        env_path = dest + os.path.join(dirs["sysconfdir"], "stepd", "stepd.env")
        if not os.path.exists(env_path):
            err("meson install puts no stepd.env in %s/stepd" % dirs["sysconfdir"])
        if shipped:
            unit_paths = [os.path.join(unit_dir, f) for f in sorted(os.listdir(unit_dir))
                          if f.endswith(".service")]
        for p in unit_paths:
            check_unit(p, env_path)
        if shipped:
            target = os.path.join(unit_dir, "stepd-workers.target")
            if not os.path.exists(target):
                err("systemd/stepd-workers.target missing")
            systemd_analyze(unit_paths + [target], [dirs["bindir"]])
            mb = open(os.path.join(d, "meson.build")).read()
            for f in sorted(os.listdir(d)):
                if f == "meson.build":
                    continue
                if "'%s'" % re.sub(r"\.in$", "", f) not in mb and "'%s'" % f not in mb:
                    err("systemd/%s is not installed by meson (systemd/meson.build)" % f)
        else:
            systemd_analyze(unit_paths, [dirs["bindir"], "/usr/bin"])
    finally:
        shutil.rmtree(dest, True)


# ================================================================ container

def containerfile():
    path = os.path.join(ROOT, "deploy", "container", "Containerfile")
    if not os.path.exists(path):
        return None
    lines, cont = [], ""
    for raw in open(path):
        s = raw.rstrip("\n")
        if s.lstrip().startswith("#"):
            continue
        if s.endswith("\\"):
            cont += s[:-1] + " "
            continue
        s = cont + s
        cont = ""
        if s.strip():
            lines.append(s.strip())
    return path, lines


def image_name():
    """The image the Containerfile builds (its '-t NAME:TAG' usage line)."""
    path = os.path.join(ROOT, "deploy", "container", "Containerfile")
    if not os.path.exists(path):
        return None
    m = re.search(r"build -f deploy/container/Containerfile -t ([a-z0-9./-]+):", open(path).read())
    return m.group(1) if m else None


def installed_paths():
    p = subprocess.run(["meson", "introspect", dl.BUILD, "--installed"], capture_output=True, text=True)
    if p.returncode != 0:
        return None
    prefix = json.loads(subprocess.run(["meson", "introspect", dl.BUILD, "--buildoptions"],
                                       capture_output=True, text=True).stdout or "[]")
    pre = next((o["value"] for o in prefix if o["name"] == "prefix"), "/usr/local")
    libdir = next((o["value"] for o in prefix if o["name"] == "libdir"), "lib")
    out = set()
    for dest in json.loads(p.stdout).values():
        # as the Containerfile configures it: --prefix=/usr --libdir=lib/x86_64-linux-gnu
        rel = os.path.relpath(dest, pre)
        rel = re.sub(r"^%s/" % re.escape(libdir), "lib/x86_64-linux-gnu/", rel)
        out.add("/usr/" + rel)
    return out


GLIBC = {"debian12": (2, 36), "ubuntu22.04": (2, 35), "ubuntu24.04": (2, 39)}
NVIDIA_PKG = re.compile(r"cuda-[a-z0-9-]+-\d+-\d+|libcublas(-dev)?-\d+-\d+|libnccl2|libnccl-dev|cuda-keyring")


def cuda_plugin_declared():
    """Where the Containerfile's build (--libdir=lib/x86_64-linux-gnu) installs the CUDA
    plugin, from its declaration in kernels/cuda/meson.build: a build without nvcc
    (-Dcuda=disabled, no /usr/local/cuda) does not configure that directory, so meson
    introspect cannot list it there."""
    mb = open(os.path.join(ROOT, "kernels", "cuda", "meson.build")).read()
    m = re.search(r"shared_module\('([\w-]+)'.*?install_dir: get_option\('libdir'\) / '([\w-]+)'\)", mb, re.S)
    if not m:
        return None
    return "/usr/lib/x86_64-linux-gnu/%s/lib%s.so" % (m.group(2), m.group(1))


def check_container(k8s_binaries, run_as_users):
    cf = containerfile()
    if not cf:
        err("deploy/container/Containerfile missing: nothing builds the image the manifests run")
        return
    path, lines = cf
    args = {}
    stages = []
    for s in lines:
        if s.startswith("ARG "):
            k, eq, v = s[4:].partition("=")
            if eq or k.strip() not in args:     # `ARG NAME` in a stage keeps the global default
                args[k.strip()] = v.strip()
        elif s.startswith("FROM "):
            img = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), s.split()[1])
            stages.append({"image": img, "name": s.split()[-1] if " AS " in s else None, "lines": []})
        elif stages:
            stages[-1]["lines"].append(s)
    if len(stages) < 2:
        err("Containerfile: multi-stage expected (a build stage and a runtime stage)")
        return
    b, r = stages[0], stages[-1]
    # build: Debian 12 with CUDA from NVIDIA's debian12 repository (the tested toolchain);
    # runtime: NVIDIA's CUDA runtime image of the same CUDA major.minor, whose glibc is not
    # older than the build's (the programs and bundled libraries need the build's)
    mb = re.fullmatch(r"docker\.io/library/debian:(12)(?:\.\d+)?(?:-slim)?", b["image"])
    mr = re.fullmatch(r"docker\.io/nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-(ubuntu[\d.]+)", r["image"])
    if not mb or not mr:
        err("Containerfile: build FROM docker.io/library/debian:12 (the tested toolchain), runtime FROM "
            "docker.io/nvidia/cuda:X.Y.Z-runtime-ubuntuNN.NN expected (got %s, %s)" % (b["image"], r["image"]))
    elif GLIBC.get(mr.group(3), (0, 0)) < GLIBC["debian12"]:
        err("Containerfile: the runtime base %s has glibc %s, older than Debian 12's %s, which built "
            "the programs" % (mr.group(3), GLIBC.get(mr.group(3)), GLIBC["debian12"]))
    text = "\n".join(b["lines"])
    if "-march=native" in text or "-Dnative=true" in text or "-Dnative=false" not in text:
        err("Containerfile: the portable build (-Dnative=false, no -march=native) expected")
    # packages: in the archive (Debian's here, apt-cache) or NVIDIA's CUDA repository for
    # debian12 (named by the CUDA release the runtime image carries), and every build
    # dependency of install-deps.sh among them
    pkgs = []
    for s in b["lines"] + r["lines"]:
        s = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), s)
        for m in re.finditer(r"apt-get install (.*?)(?=&&|$)", s):
            pkgs += [w for w in m.group(1).split() if not w.startswith("-")]
    nvidia = [p for p in pkgs if NVIDIA_PKG.fullmatch(p)]
    archive = [p for p in pkgs if p not in nvidia]
    # one apt-cache for all of them (each call reads the whole package cache: ~0.6 s, 20 s
    # over the list): a package is in the archive when its own stanza is in the output
    q = subprocess.run(["apt-cache", "show", "--no-all-versions"] + archive, capture_output=True,
                       text=True) if archive else None
    shown = set(re.findall(r"^Package: (\S+)$", q.stdout, re.M)) if q else set()
    for p in archive:
        if p not in shown:
            err("Containerfile: package %s is not in the archive (apt-cache show)" % p)
    if nvidia:
        if "cuda-keyring" not in text or "repos/debian12/x86_64" not in text:
            err("Containerfile: %s come from NVIDIA's debian12 repository, which the build stage does not "
                "add (cuda-keyring)" % ", ".join(nvidia))
        want = "%s-%s" % (mr.group(1), mr.group(2)) if mr else None
        for p in nvidia:
            m = re.search(r"-(\d+-\d+)$", p)
            if m and want and m.group(1) != want:
                err("Containerfile: %s is CUDA %s, the runtime image CUDA %s" % (p, m.group(1), want))
        note("Containerfile: %d packages from NVIDIA's debian12 CUDA repository (not in this host's "
             "archive): %s" % (len(nvidia), " ".join(nvidia)))
    deps = open(os.path.join(ROOT, "tools", "dev", "install-deps.sh")).read()
    for p in re.findall(r"\b(lib[a-z0-9-]+-dev|protobuf-c-compiler|meson|ninja-build)\b", deps):
        if p in ("libclang-rt-14-dev",):
            continue            # fuzzing only
        if p not in pkgs:
            err("Containerfile: build dependency %s (tools/dev/install-deps.sh) not installed" % p)
    # the runtime stage's file list: only what meson installs (/opt/stepd = DESTDIR) and the
    # bundle of libraries (bundle-libs.sh's destination), and all of it that a server needs:
    # every installed program, the CUDA plugin, the docs
    inst = installed_paths()
    bm = re.search(r"bundle-libs\.sh (\S+)", text)
    bundle_dir = bm.group(1).rstrip("/") + "/" if bm else None
    copied, copied_src = [], []
    for s in r["lines"]:
        if s.startswith("COPY ") and not s.startswith("COPY --from=build "):
            err("Containerfile: the runtime stage copies from the build context (%s): only the build "
                "stage's install belongs there" % s)
        if s.startswith("COPY --from=build "):
            parts = s.split()[2:]
            dst = parts[-1]
            for src in parts[:-1]:
                copied_src.append(src)
                if bundle_dir and src.rstrip("/") + "/" == bundle_dir:
                    continue
                if not src.startswith("/opt/stepd/"):
                    err("Containerfile: the runtime stage copies %s from the build stage: neither meson's "
                        "install (/opt/stepd) nor the library bundle (%s)" % (src, bundle_dir))
                    continue
                rel = src[len("/opt/stepd"):]
                copied.append(os.path.join(dst, os.path.basename(rel)) if dst.endswith("/") else dst)
                if inst is None:
                    continue
                if rel.endswith("/"):
                    if not any(i.startswith(rel) for i in inst):
                        err("Containerfile: %s: meson installs nothing under %s" % (src, rel))
                elif rel not in inst:
                    plugin = cuda_plugin_declared()
                    if rel == plugin and not any("libstepd-cuda" in i for i in inst):
                        note("Containerfile: %s: this build has no CUDA plugin; checked against its "
                             "declaration in kernels/cuda/meson.build" % src)
                    else:
                        err("Containerfile: %s is not a file meson installs (meson introspect "
                            "--installed)" % src)
    if inst is None:
        err("meson introspect %s --installed failed: cannot check the Containerfile's paths" % dl.BUILD)
    else:
        need = sorted(i for i in inst if i.startswith("/usr/bin/")) + [cuda_plugin_declared()]
        for n in need:
            if "/opt/stepd" + n not in copied_src:
                err("Containerfile: the runtime stage lacks %s (meson installs it)" % n)
        if not any(c.startswith("/opt/stepd/usr/share/doc/stepd") for c in copied_src):
            err("Containerfile: the runtime stage lacks the docs (/usr/share/doc/stepd)")
        if bundle_dir and bundle_dir not in [c.rstrip("/") + "/" for c in copied_src]:
            err("Containerfile: the runtime stage lacks the library bundle %s" % bundle_dir)
        note("Containerfile: runtime file list: %d programs, the CUDA plugin, the docs, the library "
             "bundle; nothing else from the build stage" % (len(need) - 1))
    for binary in sorted(k8s_binaries):
        if binary not in copied:
            err("Containerfile: the manifests run %s, which the image does not contain" % binary)
    user = [s.split()[1] for s in r["lines"] if s.startswith("USER ")]
    if not user or not re.fullmatch(r"[1-9]\d*(:\d+)?", user[-1]):
        err("Containerfile: a numeric non-root USER expected in the runtime stage")
    else:
        uid = int(user[-1].split(":")[0])
        for u in run_as_users:
            if u != uid:
                err("Containerfile: USER %d but the manifests run as %d" % (uid, u))
    check_bundle(text)
    check_context()
    note("%s: %d stages, %d packages, %d files copied from the build" % (os.path.relpath(path, ROOT),
                                                                      len(stages), len(pkgs), len(copied)))


# docs/GPU.md §9: the image's size budget, the parts checked here
BUNDLE_BUDGET = 80 * 1000 * 1000        # bundle-libs.sh's output for every program and the plugin
CONTEXT_BUDGET = 40 * 1000 * 1000       # the build context the ignore file leaves
RUNTIME_BASE_LIBS = re.compile(r"lib(c|m|dl|rt|pthread|resolv|stdc\+\+|gcc_s|cuda|cudart|nccl|cublas|cublasLt|"
                               r"nvrtc[\w-]*|nvJitLink)\.so|ld-linux")


def cuda_lib(name):
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/targets/x86_64-linux/lib"):
        if os.path.exists(os.path.join(d, name)):
            return d
    return None


def check_bundle(text):
    """bundle-libs.sh on this build's programs (and, where a CUDA toolkit is here, a stand-in
    for the plugin that links cuBLASLt as it does): the programs' libraries, none that the
    runtime base has (glibc, libstdc++, CUDA runtime, cuBLAS/cuBLASLt, NCCL), within budget."""
    bundle = os.path.join(ROOT, "deploy", "container", "bundle-libs.sh")
    progs = [dl.build_binary(p) for p in ("stepd", "stepd-worker", "stepctl", "stepd-inspect", "stepd-run",
                                          "stepd-mkmodel")]
    if "bundle-libs.sh" not in text or not os.path.exists(bundle) or not all(progs):
        err("bundle-libs.sh: not run by the build stage, or the build lacks a program")
        return
    tmp = tempfile.mkdtemp(prefix="stepd-bundle-")
    try:
        cublas = cuda_lib("libcublasLt.so")
        if cublas:
            stub = os.path.join(tmp, "libstepd-cuda.so")
            src = os.path.join(tmp, "stub.c")
            open(src, "w").write("int stepd_stub(void) { return 0; }\n")
            q = subprocess.run(["cc", "-shared", "-fPIC", "-o", stub, src, "-L" + cublas, "-Wl,-rpath," + cublas,
                                "-Wl,--no-as-needed", "-lcublasLt", "-lstdc++"], capture_output=True, text=True)
            if q.returncode == 0:
                progs.append(stub)
            else:
                note("bundle-libs.sh: no stand-in plugin (%s)" % q.stderr.strip()[:200])
        out = os.path.join(tmp, "bundle")
        q = subprocess.run(["sh", bundle, out] + progs, capture_output=True, text=True)
        got = set(os.listdir(out)) if os.path.isdir(out) else set()
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
        base = sorted(g for g in got if RUNTIME_BASE_LIBS.match(g))
        if q.returncode != 0 or not any(g.startswith("libgrpc") for g in got):
            err("bundle-libs.sh: expected the programs' libraries (libgrpc...): %s %s" % (sorted(got), q.stderr))
        elif base:
            err("bundle-libs.sh: bundles %s, which the runtime base has" % ", ".join(base))
        elif size > BUNDLE_BUDGET:
            err("bundle-libs.sh: %.1f MB, over the budget of %.0f MB (docs/GPU.md §9)" %
                (size / 1e6, BUNDLE_BUDGET / 1e6))
        else:
            note("bundle-libs.sh: %d libraries, %.1f MB (budget %.0f MB) for the 6 programs%s%s" %
                 (len(got), size / 1e6, BUNDLE_BUDGET / 1e6,
                  " and a stand-in plugin linking cuBLASLt (not bundled)" if len(progs) > 6 else
                  " (no CUDA toolkit here: the plugin's cuBLASLt not tried)", ", with UCX's modules" if "ucx" in got else ""))
    finally:
        shutil.rmtree(tmp, True)


def check_context():
    """The build context: .containerignore (and .dockerignore, the same file) keeps build
    outputs, virtual environments, the VCS and the test models out; its size within budget."""
    ci = os.path.join(ROOT, ".containerignore")
    if not os.path.exists(ci):
        err(".containerignore missing: `COPY . /src` would send build/, .venv/ and .git")
        return
    di = os.path.join(ROOT, ".dockerignore")
    if not os.path.exists(di) or os.path.realpath(di) != os.path.realpath(ci):
        err(".dockerignore should be a link to .containerignore (docker reads only it)")
    pats = dl.ignore_patterns(ci)
    for must in (".git", "build", "build-cuda", ".venv", "models/tiny-step", "common/x.o",
                 "test/__pycache__/x.pyc"):
        if not dl.context_ignored(must, pats):
            err(".containerignore does not exclude %s" % must)
    for keep in ("meson.build", "common/loader.c", "deploy/container/bundle-libs.sh", "docs/GPU.md",
                 "test/meson.build"):
        if dl.context_ignored(keep, pats):
            err(".containerignore excludes %s, which the build needs" % keep)
    size, files = dl.context_size(ROOT, pats)
    full, nfull = dl.context_size(ROOT)
    if size > CONTEXT_BUDGET:
        err("the build context is %.1f MB, over the budget of %.0f MB (docs/GPU.md §9)" %
            (size / 1e6, CONTEXT_BUDGET / 1e6))
    note("build context: %.1f MB in %d files with .containerignore (%.1f MB in %d files without)" %
         (size / 1e6, files, full / 1e6, nfull))


# ================================================================ Kubernetes

def k8s_registry():
    defs = kvu.schema_contents("kubernetes-json-schema/v%s-local-strict/_definitions.json" % K8S_VERSION,
                               K8S_VERSION)
    return Resource.from_contents(defs) @ Registry()


def lws_schema():
    crd = yaml.safe_load(open(os.path.join(ROOT, "deploy", "kubernetes", "crd",
                                           "leaderworkerset.x-k8s.io_leaderworkersets.yaml")))
    s = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def conv(n):
        if not isinstance(n, dict):
            return n
        if "x-stepd-schema-ref" in n:
            ref = n["x-stepd-schema-ref"]
            return {"$ref": "https://kubernetes.io/api/_definitions.json#/$defs/%s" % ref}
        out = {k: conv(v) for k, v in n.items() if not k.startswith("x-kubernetes") and k != "default"}
        if "properties" in out:
            out["properties"] = {k: conv(v) for k, v in n["properties"].items()}
            out.setdefault("additionalProperties", False)      # strict: unknown fields fail
        if "items" in n:
            out["items"] = conv(n["items"])
        if "anyOf" in n:
            out["anyOf"] = [conv(x) for x in n["anyOf"]]
        return out
    js = conv(s)
    js["properties"]["metadata"] = {"$ref": "https://kubernetes.io/api/_definitions.json#/$defs/"
                                            "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    js["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return js


def validate_schemas(docs, where):
    reg = None
    for d in docs:
        kn = "%s/%s" % (d.get("kind"), d.get("metadata", {}).get("name"))
        if d.get("kind") == "LeaderWorkerSet":
            if d.get("apiVersion") != "leaderworkerset.x-k8s.io/v1":
                err("%s: %s: apiVersion leaderworkerset.x-k8s.io/v1 expected" % (where, kn))
                continue
            reg = reg or k8s_registry()
            v = jsonschema.Draft202012Validator(lws_schema(), registry=reg)
            for e in sorted(v.iter_errors(d), key=lambda e: list(e.path)):
                err("%s: %s does not match the LeaderWorkerSet CRD schema: %s: %s" %
                    (where, kn, ".".join(str(p) for p in e.path), e.message[:300]))
            continue
        try:
            kvu.validate(d, K8S_VERSION, strict=True)
        except kvu.ValidationError as e:
            err("%s: %s does not validate against Kubernetes %s: %s: %s" %
                (where, kn, K8S_VERSION, ".".join(str(p) for p in e.path), e.message[:300]))
        except kvu.SchemaNotFoundError as e:
            err("%s: %s: %s" % (where, kn, e.message))


def service_env(docs):
    """The variables Kubernetes' service links set in every pod of the namespace."""
    out = set()
    for d in docs:
        if d.get("kind") == "Service":
            n = d["metadata"]["name"].upper().replace("-", "_")
            out |= {n + "_SERVICE_HOST", n + "_SERVICE_PORT", n + "_PORT"}
            for p in d["spec"].get("ports", []):
                out.add("%s_SERVICE_PORT_%s" % (n, p.get("name", "").upper().replace("-", "_")))
                out.add("%s_PORT_%d_TCP" % (n, p["port"]))
    return out


def port_of(probe_port, container):
    if isinstance(probe_port, int):
        return probe_port
    for p in container.get("ports", []):
        if p.get("name") == probe_port:
            return p["containerPort"]
    return None


def check_probe(cn, kind, probe, argv, container, image_bins):
    ls = dl.listeners(argv)
    if "grpc" in probe:
        port, svc = probe["grpc"].get("port"), probe["grpc"].get("service", "")
        lis = [l for l in ls if l["port"] == port]
        if not lis:
            err("%s: %s: gRPC probe on port %s, which %s does not listen on" % (cn, kind, port, argv[0]))
            return
        l = lis[0]
        if l["proto"] != "grpc" or l["health"] is None:
            err("%s: %s: gRPC health probe on port %d (%s), which serves no grpc.health.v1" %
                (cn, kind, port, l["flag"]))
        elif l["tls"]:
            err("%s: %s: gRPC probe on port %d (%s), a TLS port (kubelet's gRPC probes speak plaintext)" %
                (cn, kind, port, l["flag"]))
        elif svc not in l["health"]:
            err("%s: %s: health service '%s' is not one stepd serves %s" % (cn, kind, svc, sorted(l["health"])))
        if dl.is_loopback(l["host"]):
            err("%s: %s: port %d listens on loopback (%s): the kubelet probes the pod IP" %
                (cn, kind, port, l["host"]))
    elif "httpGet" in probe:
        port = port_of(probe["httpGet"].get("port"), container)
        path = probe["httpGet"].get("path", "/")
        lis = [l for l in ls if l["port"] == port]
        if not lis:
            err("%s: %s: HTTP probe on port %s, which %s does not listen on" % (cn, kind, port, argv[0]))
        elif lis[0]["proto"] != "http" or path not in lis[0]["paths"]:
            err("%s: %s: GET %s on port %s (%s), which serves %s" % (cn, kind, path, port, lis[0]["flag"],
                                                                    sorted(lis[0]["paths"]) or "no HTTP"))
        elif (probe["httpGet"].get("scheme", "HTTP") == "HTTPS") != bool(lis[0]["tls"]):
            err("%s: %s: scheme %s on port %s (%s), which speaks %s" % (
                cn, kind, probe["httpGet"].get("scheme", "HTTP"), port, lis[0]["flag"],
                "HTTPS (--tls-cert)" if lis[0]["tls"] else "plain HTTP"))
        elif dl.is_loopback(lis[0]["host"]):
            err("%s: %s: port %s listens on loopback: the kubelet probes the pod IP" % (cn, kind, port))
    elif "exec" in probe:
        c = probe["exec"].get("command", [])
        if not c or c[0] not in image_bins:
            err("%s: %s: exec probe runs %s, which the image does not contain" % (cn, kind, c[:1]))
    elif "tcpSocket" in probe:
        port = port_of(probe["tcpSocket"].get("port"), container)
        if not any(l["port"] == port and not dl.is_loopback(l["host"]) for l in ls):
            err("%s: %s: TCP probe on port %s, which nothing listens on off loopback" % (cn, kind, port))


def expand_refs(s, env):
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), s)


def check_k8s_docs(docs, where, image_bins):
    pods, run_as, binaries = 0, set(), set()
    svc_env = service_env(docs)
    img = image_name()
    cf_bins = set(image_bins)
    pod_by_labels = []
    for doc in docs:
        kind = doc.get("kind")
        if kind == "Namespace":
            if doc["metadata"].get("labels", {}).get("pod-security.kubernetes.io/enforce") != "restricted":
                err("%s: namespace does not enforce the restricted pod security standard" % where)
        if kind == "LeaderWorkerSet":
            t = doc["spec"]["leaderWorkerTemplate"]
            if t.get("restartPolicy") != "RecreateGroupOnPodRestart":
                err("%s: %s: restartPolicy RecreateGroupOnPodRestart expected (a lost rank re-forms its "
                    "group)" % (where, doc["metadata"]["name"]))
        for name, tmpl, is_lws in dl.pod_templates(doc):
            pods += 1
            spec = tmpl.get("spec", {})
            labels = tmpl.get("metadata", {}).get("labels", {})
            ann = tmpl.get("metadata", {}).get("annotations", {})
            pod_by_labels.append((labels, spec))
            sc = spec.get("securityContext", {})
            if not sc.get("runAsNonRoot") or sc.get("runAsUser", 0) == 0:
                err("%s: %s: runAsNonRoot with a non-zero runAsUser required" % (where, name))
            else:
                run_as.add(sc["runAsUser"])
            if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                err("%s: %s: seccompProfile RuntimeDefault required" % (where, name))
            for h in ("hostNetwork", "hostPID", "hostIPC"):
                if spec.get(h):
                    err("%s: %s: %s set" % (where, name, h))
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            grace = spec.get("terminationGracePeriodSeconds", 30)
            for c in spec.get("containers", []):
                cn = "%s: %s/%s" % (where, name, c["name"])
                if not c.get("command"):
                    # the image's CMD is `stepd --help`: args alone do not start a server;
                    # checked further as the stepd command line they were written for
                    err("%s: no command: the image's default is not a server" % cn)
                    c = dict(c, command=["/usr/bin/stepd"])
                argv = list(c.get("command", [])) + list(c.get("args", []))
                binaries.add(c["command"][0])
                repo = c.get("image", "").rsplit(":", 1)[0] if "@" not in c.get("image", "") else c["image"]
                if img is None or repo != img:
                    err("%s: image %s, which deploy/container/Containerfile does not build (it builds %s)" %
                        (cn, c.get("image"), img))
                cs = c.get("securityContext", {})
                if cs.get("allowPrivilegeEscalation") is not False:
                    err("%s: allowPrivilegeEscalation must be false" % cn)
                if "ALL" not in cs.get("capabilities", {}).get("drop", []):
                    err("%s: capabilities.drop [ALL] required" % cn)
                if cs.get("readOnlyRootFilesystem") is not True:
                    err("%s: readOnlyRootFilesystem required" % cn)
                if cs.get("privileged"):
                    err("%s: privileged" % cn)
                # variables: $(VAR) must be set; ${VAR} is not expanded by Kubernetes
                defined = set(svc_env) | (set(dl.LWS_VARS) if is_lws else set())
                for e in c.get("env", []):
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                        if ref not in defined:
                            err("%s: env %s refers to $(%s), not set before it" % (cn, e["name"], ref))
                    defined.add(e["name"])
                for a in argv:
                    for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", a):
                        if ref not in defined:
                            err("%s: '%s' refers to $(%s), which neither the container's env, "
                                "LeaderWorkerSet (%s) nor Kubernetes sets" % (cn, a, ref, ", ".join(dl.LWS_VARS)))
                    if "${" in a:
                        err("%s: '%s': Kubernetes expands $(VAR), not ${VAR}" % (cn, a))
                # flags: every one a flag of the program
                prog = os.path.basename(c["command"][0])
                b = dl.build_binary(prog)
                if b:
                    known = dl.help_flags(b)
                    for a in argv[1:]:
                        if a.startswith("--") and a.split("=")[0] not in known:
                            err("%s: %s has no flag %s" % (cn, prog, a.split("=")[0]))
                probes = {p: c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")}
                for p, v in probes.items():
                    if not v:
                        err("%s: %s missing" % (cn, p))
                    else:
                        check_probe(cn, p, v, argv, c, cf_bins)
                rp, lp = probes["readinessProbe"] or {}, probes["livenessProbe"] or {}
                if json.dumps(rp.get("grpc") or rp.get("httpGet"), sort_keys=True) == \
                        json.dumps(lp.get("grpc") or lp.get("httpGet"), sort_keys=True):
                    err("%s: readiness and liveness probe the same thing" % cn)
                f = dl.flags(argv)
                # B11: the grace period covers the drain
                if prog == "stepd":
                    drain = float(f.get("--drain-timeout", 30))
                    if grace <= drain:
                        err("%s: terminationGracePeriodSeconds %s must exceed --drain-timeout %s (B11)" %
                            (cn, grace, drain))
                    pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
                    if not pre or os.path.basename(pre[0]) != "stepctl" or "drain" not in pre:
                        err("%s: a preStop `stepctl drain` expected" % cn)
                    elif pre[0] not in cf_bins:
                        err("%s: preStop runs %s, which the image does not contain" % (cn, pre[0]))
                    ml = [l for l in dl.listeners(argv) if l["flag"] == "--metrics-listen"]
                    if ann.get("prometheus.io/scrape") != "true" or not ml or \
                            str(ml[0]["port"]) != ann.get("prometheus.io/port") or dl.is_loopback(ml[0]["host"]):
                        err("%s: prometheus.io/scrape and prometheus.io/port must name a non-loopback "
                            "--metrics-listen" % cn)
                    if ml and not dl.is_loopback(ml[0]["host"]) and "--insecure-listen" not in f:
                        err("%s: a non-loopback --metrics-listen needs --insecure-listen (stepd refuses it)" % cn)
                elif grace <= 30:
                    err("%s: terminationGracePeriodSeconds %s must exceed the drain timeout (30 s)" % (cn, grace))
                if prog == "stepd-worker":
                    coord = str(f.get("--coordinator", ""))
                    eng = str(f.get("--engine-listen", "127.0.0.1:20061"))
                    if coord and not dl.is_loopback(dl.hostport(coord)[0]) and dl.is_loopback(dl.hostport(eng)[0]):
                        err("%s: --engine-listen %s is loopback, but the coordinator (%s) is in another pod" %
                            (cn, eng, coord))
                    if not dl.is_loopback(dl.hostport(eng)[0]) and "--control-key-file" not in f and \
                            "--insecure-listen" not in f:
                        err("%s: a non-loopback --engine-listen needs the cluster key (--control-key-file; "
                            "stepd-worker refuses it otherwise)" % cn)
                    nd = str(f.get("--comm-net-devices", ""))
                    if not nd or nd == "lo":
                        err("%s: the ranks of a group are in different pods: --comm-net-devices must name "
                            "the pod's interface (UCX binds loopback only without it)" % cn)
                    dev = str(f.get("--device", "cpu"))
                    lim = c.get("resources", {}).get("limits", {})
                    if dev.startswith("cuda"):
                        if "nvidia.com/gpu" not in lim:
                            err("%s: --device %s without resources.limits nvidia.com/gpu" % (cn, dev))
                        shm = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
                        if not shm or vols.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") != "Memory":
                            err("%s: /dev/shm must be a memory-backed emptyDir (NCCL, CUDA)" % cn)
                    if "nvidia.com/gpu" in c.get("resources", {}).get("requests", {}) and "nvidia.com/gpu" not in lim:
                        err("%s: GPUs must be requested through resources.limits" % cn)
                    if is_lws and dev.startswith("cuda") and doc["spec"]["leaderWorkerTemplate"].get("size", 1) > 1:
                        need = doc.get("metadata", {}).get("annotations", {}).get("stepd.io/requires")
                        if need != "multi-rank-cuda":
                            err("%s: a %d-rank CUDA group, whose ranks join NCCL (the image's CUDA plugin "
                                "built with nccl.h, libnccl at run time); mark the LeaderWorkerSet with "
                                "the annotation stepd.io/requires: multi-rank-cuda" %
                                (cn, doc["spec"]["leaderWorkerTemplate"]["size"]))
                for vm in c.get("volumeMounts", []):
                    v = vols.get(vm["name"], {})
                    if vm["name"] in ("models", "keys", "tls") and not vm.get("readOnly"):
                        err("%s: %s must be mounted read-only" % (cn, vm["name"]))
                    if vm["name"] == "models" and not v.get("persistentVolumeClaim", {}).get("readOnly", True):
                        err("%s: the model volume must be read-only" % cn)
    # Services: their target ports exist on the pods they select
    for doc in docs:
        if doc.get("kind") != "Service":
            continue
        sel = doc["spec"].get("selector", {})
        targets = [sp for lab, sp in pod_by_labels if all(lab.get(k) == v for k, v in sel.items())]
        if not targets:
            err("%s: Service %s selects no pod template" % (where, doc["metadata"]["name"]))
        for p in doc["spec"].get("ports", []):
            tp = p.get("targetPort", p["port"])
            ok = any(any(cp.get("name") == tp or cp.get("containerPort") == tp for c in sp.get("containers", [])
                         for cp in c.get("ports", [])) for sp in targets)
            if not ok:
                err("%s: Service %s: targetPort %s is no container port of the pods it selects" %
                    (where, doc["metadata"]["name"], tp))
    if pods == 0:
        err("%s: no pod templates found" % where)
    note("%s: %d objects, %d pod templates checked" % (where, len(docs), pods))
    return run_as, binaries


def check_example_pods(docs, where):
    """An example's pods must be admitted in the namespace (restricted pod security) too."""
    for d in docs:
        if d.get("kind") != "Pod":
            continue
        spec = d["spec"]
        sc = spec.get("securityContext", {})
        if d["metadata"].get("namespace") != "stepd":
            err("%s: Pod %s: namespace stepd expected" % (where, d["metadata"]["name"]))
        if not sc.get("runAsNonRoot") or sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            err("%s: Pod %s: runAsNonRoot and seccompProfile RuntimeDefault required (restricted)" %
                (where, d["metadata"]["name"]))
        for c in spec.get("containers", []):
            cs = c.get("securityContext", {})
            if cs.get("allowPrivilegeEscalation") is not False or "ALL" not in cs.get("capabilities", {}).get("drop", []):
                err("%s: Pod %s/%s: allowPrivilegeEscalation false and capabilities.drop [ALL] required "
                    "(restricted)" % (where, d["metadata"]["name"], c["name"]))


def image_binaries():
    cf = containerfile()
    out = set()
    if not cf:
        return out
    for s in cf[1]:
        if s.startswith("COPY --from=build "):
            parts = s.split()[2:]
            if parts[-1].endswith("/"):
                out |= {parts[-1] + os.path.basename(x) for x in parts[:-1]}
    return out


def check_kubernetes(files=None):
    bins = image_binaries()
    run_as, binaries = set(), set()
    if files:
        sets = [(f, [d for d in yaml.safe_load_all(open(f)) if d]) for f in files]
    else:
        old = os.path.join(ROOT, "deploy", "k8s")
        if os.path.isdir(old):
            err("deploy/k8s/ is replaced by deploy/kubernetes/ (kustomize)")
        sets = []
        for o in dl.overlays():
            try:
                sets.append((os.path.relpath(o, ROOT), dl.render(o)))
            except RuntimeError as e:
                err(str(e))
    if not files:
        # the examples the walk-through applies (deploy/kubernetes/README.md): schemas only
        ex = os.path.join(ROOT, "deploy", "kubernetes", "examples")
        for f in sorted(os.listdir(ex)) if os.path.isdir(ex) else []:
            if f.endswith(".yaml"):
                docs = [d for d in yaml.safe_load_all(open(os.path.join(ex, f))) if d]
                validate_schemas(docs, os.path.relpath(os.path.join(ex, f), ROOT))
                check_example_pods(docs, os.path.relpath(os.path.join(ex, f), ROOT))
    for where, docs in sets:
        validate_schemas(docs, where)
        r, b = check_k8s_docs(docs, where, bins)
        run_as |= r
        binaries |= b
    return run_as, binaries


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k8s-file", action="append")
    ap.add_argument("--unit", action="append")
    a = ap.parse_args()
    if a.k8s_file or a.unit:
        if a.unit:
            check_systemd(a.unit)
        if a.k8s_file:
            check_kubernetes(a.k8s_file)
    else:
        check_systemd()
        run_as, binaries = check_kubernetes()
        check_container(binaries, run_as)
    if errors:
        print("%d problems" % len(errors))
        sys.exit(1)
    print("deploy lint: all checks passed")


if __name__ == "__main__":
    main()
