#!/usr/bin/env python3
"""test-targets.py BUILD TEST... - the ninja targets (paths relative to BUILD) that the named
tests of BUILD need: each test's program and the targets its test() declares in depends:,
read from meson's introspection files (meson-info/intro-tests.json, intro-targets.json).

A stage that runs only some tests builds only these (`ninja -C BUILD $(test-targets.py BUILD
...)`) rather than the whole tree: CI's ASan/UBSan stage (tools/dev/test-asan.sh) and its
stage without the CUDA toolkit (.ci/run, through tools/dev/test.sh).  The README's test
command builds everything, so the tree still compiles as a whole on every CI run.
Exit status 1 when a name is no test of BUILD (a typo must not build nothing and pass)."""
import json
import os
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__.split("\n")[0])
    build, names = sys.argv[1], sys.argv[2:]
    info = os.path.join(build, "meson-info")
    tests = json.load(open(os.path.join(info, "intro-tests.json")))
    files = {t["id"]: t["filename"] for t in json.load(open(os.path.join(info, "intro-targets.json")))}
    by_name = {}
    for t in tests:
        by_name.setdefault(t["name"], []).append(t)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        sys.exit("test-targets.py: no test %s in %s" % (", ".join(unknown), build))
    out = set()
    for n in names:
        for t in by_name[n]:
            for d in t["depends"]:
                out.update(os.path.relpath(f, build) for f in files[d])
    print("\n".join(sorted(out)))


if __name__ == "__main__":
    main()
