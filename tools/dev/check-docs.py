#!/usr/bin/env python3
"""The docs name only things that exist, and name every flag the programs take.

Reads README.md and docs/*.md and checks:

  (a) path      every repository path named in backticks (`daemon/http.c`, `test/cuemu/`)
                exists in the source tree;
  (b) function  every C function named in backticks as `name()` has a definition in the
                sources (or a declaration in a system header: libc, CUDA, NCCL, ...);
  (c) metric    every Prometheus metric named `stepd:...` or `stepd_...` is a string in the
                sources (daemon/metrics.c, the workers);
  (d) flag      every --flag the docs name (in text, code spans or code blocks) is
                accepted by one of the programs (read from their --help output: stepd,
                stepd serve, stepd-worker, stepctl, stepd-inspect, stepd-run,
                stepd-mkmodel) or by a test or developer program of the tree (test/,
                tools/: getopt tables, '--name' literals);
  (e) undoc     every --flag a program takes is mentioned somewhere in the docs: the flags its
                --help lists and those of its option table in the source (getopt_long's
                table; stepd's optdecls rows), so a flag left out of --help is caught too;
  (f) comment   every repository path a comment in the sources names (`daemon/rpc.h`,
                `worker/model/`) exists.

Prints each finding as 'KIND NAME (WHERE)' and exits 1 when there is one.
Each PROGRAM must be one PROGRAM_SOURCES knows (its option table is read from there).
Usage: check-docs.py SRC_ROOT PROGRAM...   (stepd's 'serve --help' is read as well)
       check-docs.py --self-test SRC_ROOT PROGRAM...   (checks that each kind is caught)
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

# Names the docs use deliberately although no stepd program or source defines them.
ALLOW = {
    # meson test's own flags, in the docs' "how to run the suite" lines
    "--benchmark", "--suite", "--no-suite", "--print-errorlogs",
    # meson setup, systemd-tmpfiles and systemctl in the install steps (OPERATIONS.md §9)
    "--buildtype", "--create", "--now",
    # an error message quoted verbatim: stepd's reply to a misspelt flag (OPERATIONS.md §1.1)
    "--enable-prefix-cachin",
    # upstream NCCL; the headers are not installed where the suite runs
    "ncclCommAbort",
    # llama.cpp's copy of the chat template, named as the template's origin (MODEL.md §7)
    "models/templates/StepFun3.7-Flash.jinja",
}

# Paths that comments name deliberately although the tree has no such file.
ALLOW_COMMENT = {
    "test/task.h",              # libuv's test header, the origin of test/harness.h
    "systemd/Kubernetes",       # "restarted by systemd/Kubernetes": not a path
    "models/templates/StepFun3.7-Flash.jinja",   # llama.cpp's copy of the chat template
}

# Where each program's options are declared: getopt_long tables, or stepd's optdecls rows.
PROGRAM_SOURCES = {
    "stepd": ["daemon/main.c"],
    "stepd-worker": ["worker/main.c"],
    "stepd-run": ["worker/run.c"],
    "stepctl": ["tools/stepctl.c"],
    "stepd-inspect": ["tools/inspect.c"],
    "stepd-mkmodel": ["tools/mkmodel.c"],
}
# stepd's optdecls row: name, value, flags, then the handler (V_STR(...), V_FN(...), ...)
OPTDECL = re.compile(r'\{\s*"([a-z0-9][a-z0-9-]*)",\s*(?:NULL|"[^"]*"),\s*(?:0|OPTF_\w+|SERVE_VLLM),\s*V_')
HIDDEN = {"help-vllm-flags", "help-flags-md"}  # stepd: the docs' table generators (OPTF_HIDDEN)

TOP = None                      # top-level entries of the source tree
SRC_EXT = (".c", ".h", ".cu", ".cuh", ".cc", ".cpp", ".py", ".sh", ".build", ".proto")
SPAN = re.compile(r"``?([^`\n]+?)``?")
# a C function: not a method (`json.dumps()`), not STYLE.md's naming patterns (`x_new()`,
# `*_init()`)
FUNC = re.compile(r"(?<![\w.*])(?!x_|_)([A-Za-z_][A-Za-z0-9_]*)\(\)")
METRIC = re.compile(r"\bstepd[:_][a-z0-9_:]*[a-z0-9]")
FLAG = re.compile(r"(?<![\w-])--([a-z0-9][a-z0-9-]*[a-z0-9])(?![\w-])")   # not `--tls-*`
# flags of the test and developer programs (bench-*, the mock engine, scripts): C getopt
# tables, and '--name' literals in Python and shell
GETOPT = re.compile(r'\{\s*"([a-z0-9][a-z0-9-]*)",\s*(?:no|required|optional)_argument')
LITERAL = re.compile(r"""["'](?:--)([a-z0-9][a-z0-9-]*[a-z0-9])["'=]|^\s*--([a-z0-9][a-z0-9-]*[a-z0-9])\)""", re.M)
# this file (its self-test names missing things): compared resolved, whatever path led here
SELF = os.path.realpath(__file__)
SYS_INCLUDE = ["/usr/include", "/usr/local/cuda/include"]


def spans(text):
    """Inline code spans outside fenced blocks, with their line numbers."""
    out = []
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out += [(n, m.group(1)) for m in SPAN.finditer(line)]
    return out


def looks_like_path(tok):
    tok = tok.rstrip(".,;:)")
    if "/" not in tok or tok.startswith(("/", "build/", "http")) or "://" in tok:
        return None
    first = tok.split("/")[0]
    if first not in TOP:
        return None
    tok = re.sub(r":\d+(-\d+)?$", "", tok)
    return tok


def path_exists(root, tok):
    if any(c in tok for c in "*?[{<…"):
        return bool(glob.glob(os.path.join(root, re.sub(r"[{<…].*", "*", tok))))
    # a program built from one source names it without the suffix (`test/bench/bench-shapes`)
    return os.path.exists(os.path.join(root, tok)) or os.path.exists(os.path.join(root, tok + ".c"))


class Sources:
    def __init__(self, root):
        self.text = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in ("build", "docs", "node_modules")
                       and not x.startswith("build")]
            for f in files:
                if os.path.realpath(os.path.join(d, f)) == SELF:      # its self-test names missing things
                    continue
                if f.endswith(SRC_EXT) or f == "meson.build":
                    try:
                        self.text.append(open(os.path.join(d, f), encoding="utf-8", errors="replace").read())
                    except OSError:
                        pass
        self.all = "\n".join(self.text)
        self.tool_flags = set()
        for d in ("test", "tools"):
            for path in glob.glob(os.path.join(root, d, "**", "*"), recursive=True):
                if os.path.realpath(path) == SELF:
                    continue
                if path.endswith((".c", ".py", ".sh")) or os.access(path, os.X_OK) and os.path.isfile(path):
                    try:            # a file a running test makes and removes may be gone
                        t = open(path, encoding="utf-8", errors="replace").read()
                    except OSError:
                        continue
                    self.tool_flags.update(GETOPT.findall(t))
                    self.tool_flags.update(a or b for a, b in LITERAL.findall(t))
        self.sys_cache = {}

    def defines(self, name):
        # a definition or declaration starting a line: 'type name(', 'name(' after a
        # type line, '#define name(', 'def name(' (Python helpers the docs name)
        pat = re.compile(r"^(?:[A-Za-z_][\w \t\*]*[\s\*])?%s\s*\(|^#\s*define\s+%s\(|^\s*def %s\(" %
                         ((re.escape(name),) * 3), re.M)
        if pat.search(self.all):
            return True
        if name not in self.sys_cache:
            r = subprocess.run(["grep", "-rlqwE", r"%s\s*\(" % name] + [d for d in SYS_INCLUDE if os.path.isdir(d)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.sys_cache[name] = r.returncode == 0
        return self.sys_cache[name]

    def has_string(self, s):
        return s in self.all


def help_flags(programs):
    flags = {}
    for exe in programs:
        runs = [[exe, "--help"]]
        if os.path.basename(exe) == "stepd":
            runs.append([exe, "serve", "--help"])
        for argv in runs:
            r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8",
                               errors="replace", timeout=60)
            if r.returncode != 0:
                sys.exit("check-docs: %s exited %d; its last lines:\n%s" %
                         (" ".join(argv), r.returncode, "\n".join(r.stdout.splitlines()[-15:])))
            for f in FLAG.findall(r.stdout):
                flags.setdefault(f, " ".join([os.path.basename(argv[0])] + argv[1:]))
    return flags


def source_flags(root, programs):
    """The flags each program's option table declares, by flag: the program's name."""
    flags = {}
    for exe in programs:
        name = os.path.basename(exe)
        if name not in PROGRAM_SOURCES:
            sys.exit("check-docs: %s: no option table known (add it to PROGRAM_SOURCES)" % name)
        for rel in PROGRAM_SOURCES[name]:
            text = open(os.path.join(root, rel), encoding="utf-8", errors="replace").read()
            found = GETOPT.findall(text) + OPTDECL.findall(text)
            if not found:
                sys.exit("check-docs: %s declares no options (its table's shape changed?)" % rel)
            for f in set(found) - HIDDEN:
                flags.setdefault(f, "%s (%s)" % (name, rel))
    return flags


# a comment: C and CUDA (/*, //, a continuation line ' * '), Python, shell and meson (#)
COMMENT = re.compile(r"//|/\*|^\s*\*|(?<![\w'\"])#(?!\s*(?:include|define|if|ifdef|ifndef|endif|else|elif|"
                     r"pragma|undef|error)\b)")


def comment_paths(root, text, top):
    """(line, path) for each repository path named in a comment of text."""
    pat = re.compile(r"(?<![\w./$-])((?:%s)/[A-Za-z0-9_.*{}@\-/]*[A-Za-z0-9_*}/@])" %
                     "|".join(re.escape(t) for t in sorted(top) if os.path.isdir(os.path.join(root, t))))
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        m = COMMENT.search(line)
        if m:
            c = line[m.start():]
            # a path broken at a hyphen continues on the next line: not checked
            out += [(n, p.group(1).rstrip(".")) for p in pat.finditer(c) if c[p.end():].rstrip() != "-"]
    return out


def source_path_exists(root, p):
    # a generated file is named without its template's .in (systemd/stepd-worker@.service)
    return path_exists(root, p) or os.path.exists(os.path.join(root, p + ".in"))


def check_comments(root, files, seen=None):
    """Findings for the paths the comments of files (relative paths) name."""
    found = []
    for rel in files:
        try:
            text = open(os.path.join(root, rel), encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        for n, p in comment_paths(root, text, TOP):
            if seen is not None:
                seen.setdefault("comment path", set()).add(p)
            if p not in ALLOW_COMMENT and not source_path_exists(root, p):
                found.append(("comment", p, "%s:%d" % (rel, n)))
    return found


def source_files(root):
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith((".", "build")) and x not in ("node_modules",)]
        for f in files:
            path = os.path.join(d, f)
            if os.path.realpath(path) != SELF and (f.endswith(SRC_EXT) or f == "meson.build"):
                out.append(os.path.relpath(path, root))
    return sorted(out)


def check(root, docs, flags, src, seen=None):
    """The findings; seen (a dict) gets the distinct names checked of each kind."""
    seen = {} if seen is None else seen
    for k in ("path", "function", "metric", "flag"):
        seen.setdefault(k, set())
    found = []
    mentioned = set()
    for doc in docs:
        text = open(doc, encoding="utf-8").read()
        rel = os.path.relpath(doc, root)
        mentioned.update(FLAG.findall(text))
        for n, s in spans(text):
            where = "%s:%d" % (rel, n)
            for tok in s.split():
                p = looks_like_path(tok)
                if p:
                    seen["path"].add(p)
                if p and not path_exists(root, p) and p not in ALLOW:
                    found.append(("path", p, where))
            for f in FUNC.findall(s):
                seen["function"].add(f)
                if f not in ALLOW and not src.defines(f):
                    found.append(("function", f + "()", where))
        for n, line in enumerate(text.split("\n"), 1):
            for f in FLAG.findall(line):
                seen["flag"].add(f)
                if f not in flags and f not in src.tool_flags and "--" + f not in ALLOW:
                    found.append(("flag", "--" + f, "%s:%d" % (rel, n)))
            for m in METRIC.findall(line):
                seen["metric"].add(m)
                if m not in ALLOW and not src.has_string(m) and not src.has_string(m.replace(":", "_", 1)):
                    found.append(("metric", m, "%s:%d" % (rel, n)))
    for f, prog in sorted(flags.items()):
        if f not in mentioned:
            found.append(("undoc", "--" + f, prog))
    return found


def top_entries(root):
    """The top-level entries a comment's path may start with: not the build folder, and
    not git's own folder, whose contents (info/exclude, hooks) depend on how the checkout
    was made and are no part of the source tree."""
    return set(os.listdir(root)) - {"build", ".git"}


def docs_of(root):
    return [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))


def self_test(root, flags, src):
    """A doc naming one missing thing of each kind, and a program flag no doc names."""
    with tempfile.TemporaryDirectory() as tmp:
        bad = os.path.join(tmp, "BAD.md")
        with open(bad, "w") as f:
            f.write("See `daemon/no-such-file.c` and `no_such_function_xyz()`,\n"
                    "the metric stepd:no_such_metric_total and the flag --zz-no-such-doc-flag.\n")
        flags = dict(flags, **{"zz-undocumented-flag": "stepd"})
        # an option table with a flag that no --help lists, and a comment naming a moved file
        # (and a file under git's folder, which no checkout is bound to have: not a finding)
        os.makedirs(os.path.join(tmp, "daemon"))
        os.makedirs(os.path.join(tmp, ".git", "info"))
        with open(os.path.join(tmp, "daemon", "main.c"), "w") as f:
            f.write('/* see daemon/rpc.h and daemon/main.c; .git/info/no-such-file */\n'
                    'static const struct option o[] = { { "zz-table-only-flag", no_argument, NULL, 1 } };\n'
                    '    { "zz-table-only-decl", "N", 0, V_UINT(o.x, 0, 1), "1", "help" },\n')
        saved = dict(PROGRAM_SOURCES)
        PROGRAM_SOURCES.clear()
        PROGRAM_SOURCES["stepd"] = ["daemon/main.c"]
        try:
            flags.update((f, "stepd") for f in source_flags(tmp, ["stepd"]))
        finally:
            PROGRAM_SOURCES.clear()
            PROGRAM_SOURCES.update(saved)
        got = {(k, n) for k, n, _ in check(root, docs_of(root) + [bad], flags, src)}
        got |= {(k, n) for k, n, _ in check_comments(tmp, ["daemon/main.c"])}
        want = {("path", "daemon/no-such-file.c"), ("function", "no_such_function_xyz()"),
                ("metric", "stepd:no_such_metric_total"), ("flag", "--zz-no-such-doc-flag"),
                ("undoc", "--zz-undocumented-flag"), ("undoc", "--zz-table-only-flag"),
                ("undoc", "--zz-table-only-decl"), ("comment", "daemon/rpc.h")}
        missed = want - got
        extra = {(k, n) for k, n in got - want if n.startswith(".git/")}
        for k, n in sorted(extra):
            print("self-test: %s %s was reported, but git's folder is not the source tree" % (k, n))
        for k, n in sorted(missed):
            print("self-test: %s %s was not caught" % (k, n))
        print("self-test: %d of %d planted names caught" % (len(want) - len(missed), len(want)))
        return 1 if missed or extra else 0


def main():
    global TOP
    args = sys.argv[1:]
    selftest = bool(args) and args[0] == "--self-test"
    if selftest:
        args = args[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    root, programs = os.path.abspath(args[0]), args[1:]
    TOP = top_entries(root)
    src = Sources(root)
    flags = help_flags(programs)
    for f, where in source_flags(root, programs).items():
        flags.setdefault(f, where)
    if selftest:
        return self_test(root, flags, src)
    seen = {}
    found = check(root, docs_of(root), flags, src, seen) + check_comments(root, source_files(root), seen)
    for k, n, w in found:
        print("%s %s (%s)" % (k, n, w))
    kinds = {}
    for k, _, _ in found:
        kinds[k] = kinds.get(k, 0) + 1
    print("check-docs: %d docs name %s; the programs take %d flags; %s" % (
        len(docs_of(root)), ", ".join("%d %ss" % (len(v), k) for k, v in sorted(seen.items())), len(flags),
        ", ".join("%d %s" % (v, k) for k, v in sorted(kinds.items())) or "0 findings"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
