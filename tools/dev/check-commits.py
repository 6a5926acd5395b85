#!/usr/bin/env python3
"""The subjects of the commits since BASE keep docs/STYLE.md §10: at most 72 characters, and
no unsquashed fixup!/squash! commit.

History before BASE is left as it is (77 % of its subjects are longer: issue 37); BASE is the
commit the rule started at, so a clean clone checks the same commits everywhere.  A shallow
clone checks the commits it has.  Merges are checked too (git's own subjects are short).

Prints each finding as 'HASH SUBJECT (why)' and exits 1 when there is one; exits 77 when
SRC_ROOT is not a git checkout (a release tarball has no history to check).
Usage: check-commits.py SRC_ROOT
"""
import subprocess
import sys

BASE = "1dceaf93a1b2f96ccbc51506944df6ae8c236ffa"
MAX_SUBJECT = 72


def findings(commits):
    """(hash, subject, why) for each (hash, subject) that breaks the rule."""
    out = []
    for h, s in commits:
        if len(s) > MAX_SUBJECT:
            out.append((h, s, "subject of %d characters, at most %d" % (len(s), MAX_SUBJECT)))
        if s.startswith(("fixup!", "squash!", "amend!")):
            out.append((h, s, "an unsquashed fix-up commit"))
    return out


def self_test():
    got = findings([("a", "x" * 72), ("b", "y" * 73), ("c", "fixup! Add a thing"), ("d", "Add a thing")])
    want = [("b", "y" * 73), ("c", "fixup! Add a thing")]
    if [(h, s) for h, s, _ in got] != want:
        sys.exit("check-commits: self-test failed: %r" % got)


def git(root, *args):
    return subprocess.run(["git", "-C", root] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    self_test()
    if git(root, "rev-parse", "--git-dir").returncode != 0:
        print("check-commits: %s is not a git checkout: no history to check" % root)
        return 77
    shallow = git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    if git(root, "cat-file", "-e", BASE + "^{commit}").returncode != 0:
        if not shallow:
            sys.exit("check-commits: the base commit %s is not in this repository" % BASE)
        r = git(root, "log", "--format=%H%x00%s", "HEAD")
    else:
        if git(root, "merge-base", "--is-ancestor", BASE, "HEAD").returncode != 0:
            sys.exit("check-commits: the base commit %s is not an ancestor of HEAD" % BASE)
        r = git(root, "log", "--format=%H%x00%s", BASE + "..HEAD")
    if r.returncode != 0:
        sys.exit("check-commits: git log failed: %s" % r.stderr.strip())
    commits = [tuple(line.split("\0", 1)) for line in r.stdout.splitlines() if "\0" in line]
    found = findings(commits)
    for h, s, why in found:
        print("%s %s (%s)" % (h[:10], s, why))
    print("check-commits: %d commits since %s%s, %d findings" % (len(commits), BASE[:10],
                                                                  " (shallow clone)" if shallow else "", len(found)))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
