#!/usr/bin/env python3
"""The file-level call graph of a source folder, and its circles.

For each folder named, reads its C sources (*.c, *.cc), finds the functions each defines
(a definition: a name and its parameter list at the start of a line, then a body; static
ones are the file's own), and draws an edge A -> B when A's text names a function that B
defines and exports (a call, or the function taken as a pointer: an identifier-level scan,
comments and string literals removed, preprocessor branches all read).  Prints each file
with the files it calls, then the strongly connected components of more than one file
(a circle: each of its files reaches every other through calls).

  --acyclic DIR    DIR (one of the folders) must have no component of more than one file:
                   exit 1 when it has one.  May be given several times.
  --allow FILES    a known circle tolerated in the --acyclic check (comma-separated file
                   names, as printed): a component whose files are all listed passes.
                   For a circle being cut elsewhere; remove it once that lands.
  --why            name the functions behind each edge.
  --dot            print the graph in Graphviz's dot language instead.
  --self-test      check this script on a made-up folder (a circle, a chain, names in
                   comments, strings and static functions that are not calls).

Usage: callgraph.py [--acyclic DIR]... [--allow a.c,b.c]... [--why] [--dot] DIR...
Example: tools/dev/callgraph.py --acyclic daemon daemon
"""
import argparse
import os
import re
import sys

KEYWORDS = {
    "if", "for", "while", "switch", "return", "sizeof", "do", "else", "case", "goto",
    "defined", "_Alignof", "alignof", "__attribute__", "typeof", "__typeof__",
}
# an identifier, unless it names a tag (struct model_config is a type, not the function)
IDENT = re.compile(r"(?<![\w])(?<!struct )(?<!union )(?<!enum )[A-Za-z_]\w*")
# a definition: at the start of a line, a return type (words, stars), the name, "(",
# the parameters up to the ")" that is followed by "{" (possibly on the next line)
DEF = re.compile(r"^(?!\s)([A-Za-z_][\w \t\*]*?[\s\*])?([A-Za-z_]\w*)\s*\(([^;{}]*?)\)\s*"
                 r"(?:__attribute__\s*\(\([^;{}]*?\)\)\s*)?\{", re.M)


def strip(text):
    """Comments, string and character literals blanked (lengths kept: line numbers hold)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else " " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def sources(folder):
    for name in sorted(os.listdir(folder)):
        if name.endswith((".c", ".cc")) and os.path.isfile(os.path.join(folder, name)):
            yield name


def graph(folder):
    """{file: {file it calls: the functions named}}, over folder's sources."""
    texts, exported = {}, {}
    for name in sources(folder):
        with open(os.path.join(folder, name), errors="replace") as f:
            texts[name] = strip(f.read())
    for name, text in texts.items():
        for m in DEF.finditer(text):
            ret, fn = m.group(1) or "", m.group(2)
            if fn in KEYWORDS or re.search(r"\bstatic\b", ret):
                continue
            exported.setdefault(fn, name)
    edges = {name: {} for name in texts}
    for name, text in texts.items():
        for ident in set(IDENT.findall(text)):
            owner = exported.get(ident)
            if owner and owner != name:
                edges[name].setdefault(owner, set()).add(ident)
    return edges


def sccs(edges):
    """Tarjan's strongly connected components, each sorted, in a stable order."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def self_test():
    import io
    import tempfile
    from contextlib import redirect_stdout
    files = {
        "a.c": "int a_fn(void)\n{\n    return b_fn();\n}\n",
        "b.c": "static int helper(void) { return 0; }\nint b_fn(void)\n{\n    return a_fn() + helper();\n}\n",
        "c.c": "/* b_fn() in a comment */\nconst char *c_fn(int x)\n{\n    return \"a_fn(\";\n}\n"
               "static int helper(void)\n{\n    return 1;\n}\n",
        "d.c": "void d_fn(void (*cb)(void))\n{\n    (void)c_fn(helper2());\n}\nint helper2(void) { return 0; }\n",
    }
    with tempfile.TemporaryDirectory() as t:
        for name, text in files.items():
            with open(os.path.join(t, name), "w") as f:
                f.write(text)
        e = graph(t)
        want = {"a.c": {"b.c"}, "b.c": {"a.c"}, "c.c": set(), "d.c": {"c.c"}}
        got = {k: set(v) for k, v in e.items()}
        assert got == want, "edges %r, want %r" % (got, want)
        assert [c for c in sccs(e) if len(c) > 1] == [["a.c", "b.c"]], sccs(e)
        out = io.StringIO()
        with redirect_stdout(out):
            assert main(["--acyclic", t, t]) == 1
            assert main(["--acyclic", t, "--allow", "a.c,b.c", t]) == 0
            assert main([t]) == 0
            os.remove(os.path.join(t, "b.c"))
            assert main(["--acyclic", t, t]) == 0
    print("callgraph.py self-test: ok")
    return 0


def main(argv):
    if argv == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--acyclic", action="append", default=[])
    ap.add_argument("--allow", action="append", default=[])
    ap.add_argument("--why", action="store_true")
    ap.add_argument("--dot", action="store_true")
    a = ap.parse_args(argv)
    norm = lambda p: os.path.normpath(p)
    allowed = [set(x.split(",")) for x in a.allow]
    missing = [d for d in a.acyclic if norm(d) not in map(norm, a.folders)]
    if missing:
        print("callgraph.py: --acyclic %s is not one of the folders named" % missing[0], file=sys.stderr)
        return 2
    bad = 0
    for folder in a.folders:
        if not os.path.isdir(folder):
            print("callgraph.py: %s is not a folder" % folder, file=sys.stderr)
            return 2
        edges = graph(folder)
        comps = [c for c in sccs(edges) if len(c) > 1]
        if a.dot:
            print('digraph "%s" {' % folder)
            for v in sorted(edges):
                for w in sorted(edges[v]):
                    print('  "%s" -> "%s";' % (v, w))
            print("}")
        else:
            print("%s/ (%d files)" % (norm(folder), len(edges)))
            for v in sorted(edges):
                print("  %s -> %s" % (v, ", ".join(sorted(edges[v])) or "-"))
                for w in sorted(edges[v]) if a.why else ():
                    print("      %s: %s" % (w, " ".join(sorted(edges[v][w]))))
        check = norm(folder) in map(norm, a.acyclic)
        for c in comps:
            ok = any(set(c) <= s for s in allowed)
            what = "allowed circle" if ok else "circle"
            print("%s%s: %s %d files: %s" % ("//" if a.dot else "", norm(folder), what, len(c), " ".join(c)))
            if check and not ok:
                bad += 1
        if not comps:
            print("%s%s: no circle" % ("//" if a.dot else "", norm(folder)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
