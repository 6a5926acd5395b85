#!/usr/bin/env python3
"""Every CPU kernel source compiles for a baseline x86-64 (-march=x86-64-v2, no AVX).

A function that uses an intrinsic its target attribute does not name builds only where the
compiler's default target already has that feature (-march=native on an AVX-512 host), so an
AVX-512 machine hides the bug and an AVX2-only one fails to build.  Compiling each kernels/cpu
file of this build's compile_commands.json again with -march=x86-64-v2 (and -march/-mtune
flags removed, at -O0) finds it on any host.  Usage: check_portable.py BUILD/compile_commands.json
"""
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def recompile(entry):
    args = [a for a in shlex.split(entry["command"]) if not a.startswith(("-march=", "-mtune="))]
    if "-o" in args:
        args[args.index("-o") + 1] = "/dev/null"
    for dep in ("-MD", "-MMD"):
        while dep in args:
            args.remove(dep)
    for opt in ("-MQ", "-MF"):
        while opt in args:
            i = args.index(opt)
            del args[i:i + 2]
    args[1:1] = ["-march=x86-64-v2"]
    # -O0 last (over the kernels' -O3): the target mismatch of an always_inline intrinsic is
    # reported at every level (the inliner runs for always_inline at -O0 too), and -O0 also
    # compiles a helper without a target attribute on its own rather than inlined into a
    # caller that has one - what a -O0 debug build of the portable tree must compile.  A
    # third of the CPU time of -O3 (9 CPU-s for 30, 26 sources).
    args += ["-fdiagnostics-color=never", "-O0"]
    r = subprocess.run(args, cwd=entry.get("directory", "."), capture_output=True, text=True)
    return entry["file"], r.returncode, r.stderr


def main():
    entries = [e for e in json.load(open(sys.argv[1]))
               if "/kernels/cpu/" in e["file"].replace(os.sep, "/") and e["file"].endswith(".c")]
    if not entries:
        print("no kernels/cpu sources in %s" % sys.argv[1])
        return 1
    with ThreadPoolExecutor(max_workers=2) as ex:
        results = list(ex.map(recompile, entries))
    bad = 0
    for f, rc, err in results:
        name = os.path.basename(f)
        if rc != 0:
            bad += 1
            lines = [l for l in err.splitlines() if "error" in l]
            print("NOT PORTABLE %s:\n  %s" % (name, "\n  ".join(lines[:5]) or err[-500:]))
        else:
            print("ok %s" % name)
    print("%d of %d kernel sources compile for x86-64-v2" % (len(results) - bad, len(results)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
