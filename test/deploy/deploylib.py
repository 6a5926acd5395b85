"""deploylib.py - what the deploy lint and the deployment tests share: systemd unit and
environment-file parsing with systemd's own word expansion, kustomize rendering, and what a
stepd / stepd-worker command line listens on (so that probes can be checked against it).
"""
import json
import os
import re
import shutil
import subprocess

import yaml

ROOT = os.environ.get("SRC_ROOT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BUILD = os.environ.get("BUILD_ROOT", os.path.join(ROOT, "build"))

# ---------------------------------------------------------------- systemd


def unit_parse(path):
    """{section: {key: [values]}} with backslash continuations joined, as systemd reads it."""
    out, sec, cont = {}, None, ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if cont:
            line = cont + " " + line.strip()
            cont = ""
        if line.endswith("\\"):
            cont = line[:-1].rstrip()
            continue
        s = line.strip()
        if not s or s[0] in "#;":
            continue
        if s.startswith("[") and s.endswith("]"):
            sec = s[1:-1]
            out.setdefault(sec, {})
            continue
        k, _, v = s.partition("=")
        out.setdefault(sec, {}).setdefault(k.strip(), []).append(v.strip())
    return out


def env_file_parse(path):
    """An EnvironmentFile= (KEY=VALUE lines, # comments, optional quotes)."""
    env = {}
    for raw in open(path):
        s = raw.strip()
        if not s or s[0] in "#;":
            continue
        k, _, v = s.partition("=")
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def specifiers(s, instance):
    return s.replace("%i", instance).replace("%I", instance).replace("%%", "%")


def unit_environment(unit, instance, etc_dir, base_env=None, sysconfdir="/etc"):
    """The environment systemd gives the service: Environment= first, then the
    EnvironmentFile=s in order ('-' = optional), <sysconfdir>/stepd mapped to etc_dir."""
    svc = unit.get("Service", {})
    env = dict(base_env or {})
    for e in svc.get("Environment", []):
        for word in split_words(specifiers(e, instance)):
            k, _, v = word.partition("=")
            env[k] = v
    for f in svc.get("EnvironmentFile", []):
        optional = f.startswith("-")
        f = specifiers(f.lstrip("-"), instance)
        conf = sysconfdir.rstrip("/") + "/stepd/"
        if f.startswith(conf):
            f = os.path.join(etc_dir, f[len(conf):])
        if not os.path.exists(f):
            if optional:
                continue
            raise FileNotFoundError(f)
        env.update(env_file_parse(f))
    return env


def split_words(s):
    """systemd's word splitting: whitespace, double and single quotes, backslash escapes."""
    words, cur, q, have = [], "", None, False
    i = 0
    while i < len(s):
        c = s[i]
        if q:
            if c == q:
                q = None
            elif c == "\\" and i + 1 < len(s):
                i += 1
                cur += s[i]
            else:
                cur += c
        elif c in "'\"":
            q, have = c, True
        elif c.isspace():
            if cur or have:
                words.append(cur)
            cur, have = "", False
        elif c == "\\" and i + 1 < len(s):
            i += 1
            cur += s[i]
        else:
            cur += c
        i += 1
    if cur or have:
        words.append(cur)
    return words


VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def exec_referenced(line):
    """The variables an ExecStart= line refers to ($VAR and ${VAR})."""
    return [a or b for a, b in VAR_RE.findall(line)]


def exec_expand(line, env, instance=""):
    """ExecStart= as systemd runs it: specifiers, then per word: a word that is exactly $VAR
    becomes the variable's value split at whitespace (no word when empty), ${VAR} inside a
    word is replaced in place (one word).  Unknown variables are empty, as in systemd."""
    out = []
    for w in split_words(specifiers(line, instance)):
        m = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", w)
        if m:
            out.extend(env.get(m.group(1), "").split())
            continue
        out.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), ""), w))
    return out


def seconds(v):
    m = re.fullmatch(r"(\d+)(s|min)?", v.strip())
    if not m:
        return None
    return int(m.group(1)) * (60 if m.group(2) == "min" else 1)


def meson_dirs(build):
    """{prefix, bindir, sysconfdir, libdir, datadir} of a configured build, absolute (as
    meson install places files and systemd/meson.build writes them into the units)."""
    p = subprocess.run(["meson", "introspect", build, "--buildoptions"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("meson introspect %s --buildoptions: %s" % (build, p.stderr.strip()))
    opts = {o["name"]: o["value"] for o in json.loads(p.stdout)}
    pre = opts["prefix"]
    return {k: os.path.join(pre, opts[k]) if k != "prefix" else pre
            for k in ("prefix", "bindir", "sysconfdir", "libdir", "datadir")}


def meson_install(build, destdir, tags=None):
    """`meson install --no-rebuild` of a build into destdir (only the install tags given);
    returns destdir."""
    cmd = ["meson", "install", "-C", build, "--no-rebuild", "--quiet", "--destdir", destdir]
    if tags:
        cmd += ["--tags", ",".join(tags)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(cmd), (p.stdout + p.stderr).strip()[-2000:]))
    return destdir


def installed_units(build, destdir):
    """Install the build's systemd files (install tag 'systemd') into destdir; returns
    (unit directory in destdir, meson_dirs)."""
    meson_install(build, destdir, ["systemd"])
    dirs = meson_dirs(build)
    return destdir + os.path.join(dirs["prefix"], "lib", "systemd", "system"), dirs


# ---------------------------------------------------------------- container build context


def ignore_patterns(path):
    """The patterns of a .containerignore / .dockerignore: (regex, exclude) in order, the last
    match deciding (a '!' pattern re-includes).  Go filepath.Match syntax as the container
    engines read it: '*' and '?' within one path element, '**' any number of elements; a
    pattern matching a directory excludes everything below it."""
    out = []
    for raw in open(path):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        neg = s.startswith("!")
        s = s[1:].strip() if neg else s
        s = os.path.normpath(s.lstrip("/"))
        rx, i = "", 0
        while i < len(s):
            if s.startswith("**/", i):
                rx += "(?:.*/)?"
                i += 3
            elif s.startswith("**", i):
                rx += ".*"
                i += 2
            elif s[i] == "*":
                rx += "[^/]*"
                i += 1
            elif s[i] == "?":
                rx += "[^/]"
                i += 1
            else:
                rx += re.escape(s[i])
                i += 1
        out.append((re.compile(rx + "(?:/.*)?$"), not neg))
    return out


def context_ignored(rel, patterns):
    ignored = False
    for rx, exclude in patterns:
        if rx.match(rel):
            ignored = exclude
    return ignored


def context_size(root, patterns=()):
    """(bytes, files) of the build context a container engine sends from root: regular files
    and symlinks (not followed), less what the patterns exclude."""
    total = files = 0
    for d, dirs, names in os.walk(root):
        reld = os.path.relpath(d, root)
        keep = []
        for n in dirs:
            rel = os.path.normpath(os.path.join(reld, n))
            if os.path.islink(os.path.join(d, n)):
                names.append(n)         # sent as a link, not followed
            elif not context_ignored(rel, patterns):
                keep.append(n)
        dirs[:] = keep
        for n in names:
            rel = os.path.normpath(os.path.join(reld, n))
            if context_ignored(rel, patterns):
                continue
            st = os.lstat(os.path.join(d, n))
            total += st.st_size
            files += 1
    return total, files


# ---------------------------------------------------------------- kustomize


def kustomize_cmd():
    """kubectl's built-in kustomize (Debian's kubernetes-client has v2.0.3, newer kubectls v5);
    None when there is none."""
    k = shutil.which("kubectl")
    if not k:
        return None
    p = subprocess.run([k, "kustomize", "--help"], capture_output=True, text=True)
    return [k, "kustomize"] if p.returncode == 0 else None


def render(overlay_dir):
    cmd = kustomize_cmd()
    if not cmd:
        raise RuntimeError("no kustomize: kubectl with 'kubectl kustomize' is needed "
                           "(tools/dev/install-deps.sh installs Debian's kubernetes-client)")
    p = subprocess.run(cmd + [overlay_dir], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError("kubectl kustomize %s failed:\n%s" % (overlay_dir, p.stderr))
    return [d for d in yaml.safe_load_all(p.stdout) if d]


def overlays():
    d = os.path.join(ROOT, "deploy", "kubernetes", "overlays")
    return sorted(os.path.join(d, o) for o in os.listdir(d) if os.path.isdir(os.path.join(d, o)))


def pod_templates(doc):
    """(name, pod template (metadata + spec), is_lws) of Deployments and LeaderWorkerSets."""
    kind = doc.get("kind")
    name = doc.get("metadata", {}).get("name")
    if kind == "Deployment":
        yield name, doc["spec"]["template"], False
    elif kind == "LeaderWorkerSet":
        t = doc["spec"]["leaderWorkerTemplate"]
        if t.get("leaderTemplate"):
            yield name + "/leader", t["leaderTemplate"], True
        yield name + "/worker", t["workerTemplate"], True


# ---------------------------------------------------------------- command lines

LWS_VARS = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def flags(argv):
    """{--flag: value} of a GNU-style command line (--f=v or --f v; a flag without value: True)."""
    out, i = {}, 1
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                k, _, v = a.partition("=")
                out[k] = v
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a] = argv[i + 1]
                i += 1
            else:
                out[a] = True
        i += 1
    return out


def hostport(addr):
    if addr.startswith("unix"):
        return addr, None
    if addr.startswith("["):
        h, _, p = addr[1:].partition("]:")
        return h, int(p) if p.isdigit() else None
    h, _, p = addr.rpartition(":")
    return h, int(p) if p.isdigit() else None


def is_loopback(host):
    return host.startswith("unix") or host.startswith("127.") or host in ("::1", "localhost")


HEALTH_SERVICES = {"", "liveness", "readiness", "stepd.v1.Inference"}


def listeners(argv):
    """What a stepd, `stepd serve` or stepd-worker command line listens on: a list of
    {flag, host, port, proto (grpc|http), tls, health (gRPC health services or None),
    paths (HTTP paths)}."""
    prog = os.path.basename(argv[0])
    f = flags(argv)
    out = []

    def add(flag, default, proto, tls=False, health=None, paths=()):
        v = f.get(flag, default)
        if not v or v is True:
            return
        h, p = hostport(v)
        out.append(dict(flag=flag, host=h, port=p, proto=proto, tls=tls, health=health, paths=set(paths)))

    if prog == "stepd":
        tls = bool(f.get("--tls-cert"))
        add("--listen", "127.0.0.1:20051", "grpc", tls, HEALTH_SERVICES)
        add("--admin-listen", "127.0.0.1:20053", "grpc", False, HEALTH_SERVICES)
        add("--control-listen", "127.0.0.1:20052", "grpc", False, HEALTH_SERVICES)
        add("--metrics-listen", "127.0.0.1:9464", "http", paths=("/metrics", "/healthz", "/health", "/ready"))
        port = f.get("--port", "8000")
        if port not in ("off", ""):
            out.append(dict(flag="--port", host=f.get("--host", "127.0.0.1"), port=int(port) if str(port).isdigit() else None, proto="http", tls=tls,
                            health=None, paths={"/health", "/ready", "/healthz", "/metrics", "/v1/models",
                                                "/v1/chat/completions", "/v1/completions"}))
    elif prog == "stepd-worker":
        if f.get("--rank", "0") in ("0", "$(LWS_WORKER_INDEX)"):
            add("--engine-listen", "127.0.0.1:20061", "grpc", False, None)     # no health service
        add("--health-listen", None, "http", paths=("/livez", "/readyz"))
    return out


def help_flags(binary):
    """The --flags a program's --help names."""
    p = subprocess.run([binary, "--help"], capture_output=True, text=True)
    return set(re.findall(r"--[a-z][a-z0-9-]*", p.stdout + p.stderr))


def build_binary(name):
    for sub in ("daemon", "worker", "tools"):
        p = os.path.join(BUILD, sub, name)
        if os.path.exists(p):
            return p
    return None
