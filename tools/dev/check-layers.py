#!/usr/bin/env python3
"""The dependency rules of the source tree, checked on the real build graph.

Reads BUILD/compile_commands.json and, for every compiled source of the project, its
include path (-I) and the headers its #include "..." lines resolve to (searched as the
compiler does: the file's own folder, then the -I folders in order).  Rules:

  common/   includes nothing from kernels/, worker/, daemon/ or rpc/
  kernels/  includes nothing from worker/, daemon/ or rpc/
  rpc/      includes nothing from kernels/, worker/ or daemon/
  worker/   includes nothing from daemon/ (the coordinator and the workers meet only
            over the wire: proto/ and rpc/)
  tools/    includes nothing from daemon/
  daemon/   includes nothing from kernels/ or worker/ (the coordinator runs no model)
  worker/engine/  includes nothing from worker/model/ or worker/comm/ (the engine drives
            the model through worker/forward.h and its plan, never the model's insides)
  and no target outside daemon/ (and its own tests, test/daemon/) has daemon/ on its
  include path.

Prints each violation as 'FILE: RULE (HOW)' and exits 1 when there is one.
Usage: check-layers.py BUILD/compile_commands.json
       check-layers.py --self-test   (the rules on a made-up tree: each one catches its case)
"""
import json
import os
import re
import shlex
import sys

# a folder (and everything under it): the folders its sources may not include from
FORBIDDEN = {
    "common": ("kernels", "worker", "daemon", "rpc"),
    "kernels": ("worker", "daemon", "rpc"),
    "rpc": ("kernels", "worker", "daemon"),
    "worker": ("daemon",),
    "tools": ("daemon",),
    "daemon": ("kernels", "worker"),
    "worker/engine": ("worker/model", "worker/comm"),
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def top(path, root):
    rel = os.path.relpath(path, root)
    return rel.split(os.sep)[0] if not rel.startswith("..") else None


def under(rel, folder):
    """Whether the tree-relative path rel lies in folder ("a/b")."""
    return rel.replace(os.sep, "/").startswith(folder + "/")


def forbidden_for(rel):
    """(rule's folder, forbidden folder) pairs that apply to the source rel."""
    return [(f, x) for f, xs in sorted(FORBIDDEN.items()) if under(rel, f) for x in xs]


def self_test():
    import io
    import tempfile
    from contextlib import redirect_stdout
    files = {
        "daemon/bad.c": '#include "../worker/plan.h"\n#include "../kernels/k.h"\n',
        "daemon/ok.c": '#include "ok.h"\n#include "../common/c.h"\n',
        "daemon/ok.h": "",
        "worker/plan.h": "",
        "worker/engine/bad.c": '#include "../model/model.h"\n#include "comm.h"\n',
        "worker/engine/ok.c": '#include "plan.h"\n',
        "worker/model/model.h": "",
        "worker/comm/comm.h": "",
        "kernels/k.h": "",
        "common/c.h": "",
    }
    with tempfile.TemporaryDirectory() as t:
        for name, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(t, name)), exist_ok=True)
            with open(os.path.join(t, name), "w") as f:
                f.write(text)
        os.makedirs(os.path.join(t, "build"))
        cc = os.path.join(t, "build", "compile_commands.json")
        entries = [{"directory": os.path.join(t, "build"), "file": "../" + f,
                    "command": "cc -I../worker -I../worker/comm -c ../" + f}
                   for f in files if f.endswith(".c")]
        with open(cc, "w") as f:
            json.dump(entries, f)
        out = io.StringIO()
        with redirect_stdout(out):
            rc = main([cc])
        got = sorted(line.split(":")[0] + " " + line.split(" from ")[1].split("/ ")[0]
                     for line in out.getvalue().splitlines() if " from " in line)
        want = ["daemon/bad.c kernels", "daemon/bad.c worker", "worker/engine/bad.c worker/comm",
                "worker/engine/bad.c worker/model"]
        assert rc == 1 and got == want, (rc, got, out.getvalue())
    print("check-layers.py self-test: ok")
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--self-test"]:
        return self_test()
    cc = argv[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(cc)))
    entries = json.load(open(cc))
    bad = []
    for e in entries:
        d = e.get("directory", ".")
        src = os.path.normpath(os.path.join(d, e["file"]))
        area = top(src, root)
        if area is None or area in ("build",) or src.startswith(os.path.dirname(cc)):
            continue
        args = shlex.split(e["command"])
        incs = []
        for i, a in enumerate(args):
            if a.startswith("-I") and len(a) > 2:
                incs.append(os.path.normpath(os.path.join(d, a[2:])))
            elif a == "-I" and i + 1 < len(args):
                incs.append(os.path.normpath(os.path.join(d, args[i + 1])))
        rel_src = os.path.relpath(src, root)
        in_daemon = rel_src.startswith("daemon" + os.sep) or rel_src.startswith(
            os.path.join("test", "daemon") + os.sep)
        for inc in incs:
            if top(inc, root) == "daemon" and not in_daemon:
                bad.append("%s: has daemon/ on its include path (%s)" % (rel_src, inc))
        forbidden = forbidden_for(rel_src)
        if not forbidden:
            continue
        try:
            text = open(src, errors="replace").read()
        except OSError:
            continue
        for name in INCLUDE.findall(text):
            for base in [os.path.dirname(src)] + incs:
                cand = os.path.normpath(os.path.join(base, name))
                if os.path.exists(cand):
                    rel_cand = os.path.relpath(cand, root)
                    for _, where in forbidden:
                        if under(rel_cand, where):
                            bad.append('%s: includes "%s" from %s/ (%s)' % (rel_src, name, where, rel_cand))
                    break
    for b in sorted(set(bad)):
        print(b)
    n = len({e["file"] for e in entries})
    print("%d sources checked, %d violation%s" % (n, len(set(bad)), "" if len(set(bad)) == 1 else "s"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
