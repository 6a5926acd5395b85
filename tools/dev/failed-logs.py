#!/usr/bin/env python3
"""Print the end of each failed test's output from a meson testlog.json, last.

CI keeps only the tail of what .ci/run prints, and meson prints a failed test's log where it
fails, long before the run's last line (the soak and later stages follow).  The suite scripts
call this at their very end so that the reason of each failure is in that tail.

Usage: failed-logs.py BUILD/meson-logs/testlog.json [LINES]   (LINES per test, default 40)
"""
import json
import sys


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    keep = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    try:
        lines = open(sys.argv[1], encoding="utf-8", errors="replace").read().splitlines()
    except OSError as e:
        print("failed-logs: %s: %s" % (sys.argv[1], e.strerror))
        return 0
    for line in lines:
        try:
            t = json.loads(line)
        except ValueError:
            continue
        if t.get("result") in ("OK", "EXPECTEDFAIL", "SKIP"):
            continue
        out = ((t.get("stdout") or "") + (t.get("stderr") or "")).rstrip().splitlines()
        print("== failed: %s (%s, exit %s); the last %d of its %d output lines:" %
              (t.get("name"), t.get("result"), t.get("returncode"), min(keep, len(out)), len(out)))
        for s in out[-keep:]:
            print("   | " + s[:400])
    return 0


if __name__ == "__main__":
    sys.exit(main())
