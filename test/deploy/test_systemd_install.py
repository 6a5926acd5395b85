#!/usr/bin/env python3
"""test_systemd_install.py - `meson install` yields systemd units that start: the project is
configured with --prefix=/usr and with the default prefix (/usr/local), its systemd and doc
files installed into a DESTDIR (install tags systemd, doc), the programs put where that
install puts them (<bindir>; the build's binaries, as `meson install` would copy them), and
then, for each prefix:

  - every unit's ExecStart= runs <bindir>/stepd or <bindir>/stepd-worker of that install,
    its EnvironmentFile= (required) is the installed <sysconfdir>/stepd/stepd.env, its
    LoadCredential= keys live in <sysconfdir>/stepd, the directory the installed tmpfiles.d
    snippet creates, Documentation= names an installed file;
  - `systemd-analyze verify --root=<DESTDIR + this host's units>` on every unit (the worker
    template as stepd-worker@0) has no complaint at all: it finds the programs at the
    units' paths inside the install tree.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402

UNITS = ("stepd.service", "stepd-worker@.service", "stepd-serve.service", "stepd-workers.target")


def configure(src, build, args):
    p = subprocess.run(["meson", "setup", build, src, "-Dcuda=disabled"] + args,
                       capture_output=True, text=True)
    assert p.returncode == 0, "meson setup %s failed:\n%s" % (args, (p.stdout + p.stderr)[-3000:])


def check_install(tmp, label, args, want_bindir, want_sysconfdir):
    build = os.path.join(tmp, "build")
    dest = os.path.join(tmp, "dest")
    configure(dl.ROOT, build, args)
    dl.meson_install(build, dest, ["systemd", "doc"])
    dirs = dl.meson_dirs(build)
    assert dirs["bindir"] == want_bindir and dirs["sysconfdir"] == want_sysconfdir, (label, dirs)
    bindir = dest + dirs["bindir"]
    os.makedirs(bindir, exist_ok=True)
    for prog in ("stepd", "stepd-worker"):
        shutil.copy2(dl.build_binary(prog), os.path.join(bindir, prog))
    unit_dir = dest + os.path.join(dirs["prefix"], "lib", "systemd", "system")
    conf = os.path.join(dirs["sysconfdir"], "stepd")
    tmpfiles = open(dest + os.path.join(dirs["prefix"], "lib", "tmpfiles.d", "stepd.conf")).read()
    assert re.search(r"^d %s\s" % re.escape(conf), tmpfiles, re.M), \
        "%s: tmpfiles.d does not create %s:\n%s" % (label, conf, tmpfiles)
    sysusers = open(dest + os.path.join(dirs["prefix"], "lib", "sysusers.d", "stepd.conf")).read()
    assert re.search(r"^u stepd\s", sysusers, re.M), sysusers
    assert os.path.isfile(dest + os.path.join(conf, "stepd.env")), "%s: no %s/stepd.env" % (label, conf)
    for name in UNITS:
        path = os.path.join(unit_dir, name)
        assert os.path.isfile(path), "%s: meson install puts no %s in %s" % (label, name, unit_dir)
        u = dl.unit_parse(path)
        for doc in u["Unit"].get("Documentation", []):
            assert doc.startswith("file://") and os.path.isfile(dest + doc[len("file://"):]), \
                "%s: %s: Documentation=%s is not installed" % (label, name, doc)
        svc = u.get("Service")
        if not svc:
            continue
        prog = dl.split_words(svc["ExecStart"][0])[0]
        assert os.path.dirname(prog) == dirs["bindir"], "%s: %s runs %s, not from %s" % (
            label, name, prog, dirs["bindir"])
        required = [f for f in svc.get("EnvironmentFile", []) if not f.startswith("-")]
        assert os.path.join(conf, "stepd.env") in required, \
            "%s: %s: EnvironmentFile= %s (the installed %s/stepd.env, required)" % (
                label, name, svc.get("EnvironmentFile"), conf)
        for f in required:
            assert os.path.isfile(dest + f), "%s: %s: EnvironmentFile=%s not installed" % (label, name, f)
        for cred in svc.get("LoadCredential", []):
            src = cred.partition(":")[2]
            assert os.path.dirname(src) == conf, "%s: %s: LoadCredential=%s outside %s" % (
                label, name, cred, conf)
    # systemd-analyze verify on the installed tree, with this host's units beside it
    # (sysinit.target, network-online.target, ...); copies: verify rejects symlinked units
    root = os.path.join(tmp, "root")
    shutil.copytree("/usr/lib/systemd/system", os.path.join(root, "usr", "lib", "systemd", "system"),
                    symlinks=True)
    shutil.copytree(dest, root, symlinks=True, dirs_exist_ok=True)
    names = [n.replace("@.service", "@0.service") for n in UNITS]
    v = subprocess.run(["systemd-analyze", "verify", "--man=no", "--root=" + root] + names,
                       capture_output=True, text=True, cwd=tmp)
    out = (v.stdout + v.stderr).strip()
    assert v.returncode == 0 and not out, "%s: systemd-analyze verify:\n%s" % (label, out)
    print("   %s: units in %s run %s/stepd*, read %s/stepd.env; systemd-analyze verify: no complaint"
          % (label, unit_dir[len(dest):], dirs["bindir"], conf))


def main():
    if not shutil.which("systemd-analyze"):
        print("FAIL: systemd-analyze is missing (Debian package systemd; tools/dev/install-deps.sh)")
        sys.exit(1)
    for label, args, bindir, sysconfdir in (("--prefix=/usr", ["--prefix=/usr"], "/usr/bin", "/etc"),
                                            ("default prefix", [], "/usr/local/bin", "/usr/local/etc")):
        with tempfile.TemporaryDirectory(prefix="stepd-install-") as tmp:
            check_install(tmp, label, args, bindir, sysconfdir)
    print("systemd install: all checks passed")


if __name__ == "__main__":
    main()
