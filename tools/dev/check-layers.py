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


def main():
    cc = sys.argv[1]
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
