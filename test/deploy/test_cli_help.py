#!/usr/bin/env python3
"""test_cli_help.py - every program says its version (--version: "PROGRAM X.Y.Z") and its
--help names every long option the program takes (read from its getopt table, or stepd's
option declarations, in the source); every option stepd declares has a handler."""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploylib as dl  # noqa: E402

ROOT = os.path.abspath(dl.ROOT)
PROGRAMS = [("stepd", "daemon/main.c"), ("stepd-worker", "worker/main.c"), ("stepd-run", "worker/run.c"),
            ("stepctl", "tools/stepctl.c"), ("stepd-inspect", "tools/inspect.c"),
            ("stepd-mkmodel", "tools/mkmodel.c")]
HIDDEN = {"help-vllm-flags", "help-flags-md"}     # stepd: the docs' table generators (OPTF_HIDDEN)
# a row of stepd's optdecls: name, value, flags, then the handler (V_STR(...), V_FN(...), ...)
DECL = re.compile(r'\{\s*"([a-z0-9][a-z0-9-]*)",\s*(NULL|"[^"]*"),\s*(?:0|OPTF_\w+|SERVE_VLLM),\s*V_')


def options(src):
    text = open(os.path.join(ROOT, src)).read()
    names = re.findall(r'\{\s*"([a-z0-9][a-z0-9-]*)",\s*(?:no_argument|required_argument|optional_argument)', text)
    names += [n for n, _ in DECL.findall(text)]                                       # stepd's optdecls
    return sorted(set(names) - HIDDEN)


def main():
    version = None
    for prog, src in PROGRAMS:
        exe = os.path.abspath(dl.build_binary(prog))
        v = subprocess.run([exe, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=30)
        m = re.fullmatch(r"%s (\d+\.\d+\.\d+\S*)\n" % re.escape(prog), v.stdout)
        assert v.returncode == 0 and m, "%s --version: exit %d, %r" % (prog, v.returncode, v.stdout)
        assert version in (None, m.group(1)), (prog, m.group(1), version)
        version = m.group(1)
        h = subprocess.run([exe, "--help"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
        assert h.returncode == 0, "%s --help: exit %d\n%s" % (prog, h.returncode, h.stdout)
        names = options(src)
        assert len(names) >= 3, (prog, names)
        missing = [n for n in names if not re.search(r"--%s\b(?!-)" % re.escape(n), h.stdout)]
        assert not missing, "%s --help does not describe %s" % (prog, ", ".join("--" + n for n in missing))
        print("%s %s: --help names all %d options" % (prog, version, len(names)))
    # every option stepd declares has a handler: none ends in an assertion (a value of "1",
    # a model directory that is not there)
    text = open(os.path.join(ROOT, "daemon/main.c")).read()
    decls = DECL.findall(text)
    assert len(decls) >= 90, "daemon/main.c: %d option rows found" % len(decls)
    exe = os.path.abspath(dl.build_binary("stepd"))
    for name, arg in decls:
        argv = [exe, "serve", "/nonexistent-model-dir", "--" + name] + (["1"] if arg != "NULL" else [])
        r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
        assert r.returncode >= 0 and "without a handler" not in r.stdout, (argv, r.returncode, r.stdout)
    print("stepd: each of %d declared options parsed without an assertion" % len(decls))
    # a serve-only flag without `serve` is named as it is spelled
    r = subprocess.run([exe, "--tensor-parallel-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=30)
    assert r.returncode == 2 and "--tensor-parallel-size is a flag of `stepd serve MODEL_DIR`" in r.stdout, r.stdout
    # docs/OPERATIONS.md §7.1 is stepd --help-flags-md, from the same rows as the parser
    doc = open(os.path.join(ROOT, "docs/OPERATIONS.md")).read()
    m = re.search(r"<!-- stepd --help-flags-md -->\n(.*?)<!-- end of stepd --help-flags-md -->", doc, re.S)
    table = subprocess.run([exe, "--help-flags-md"], stdout=subprocess.PIPE, text=True, timeout=30).stdout
    assert m and m.group(1) == table, "docs/OPERATIONS.md §7.1 differs from stepd --help-flags-md:\n" + table
    rows = [ln for ln in table.splitlines() if ln.startswith("| `--")]
    print("stepd: docs/OPERATIONS.md §7.1 is stepd --help-flags-md (%d flags)" % len(rows))
    print("every program: --version and --help: ok")


if __name__ == "__main__":
    main()
