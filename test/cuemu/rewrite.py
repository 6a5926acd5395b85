#!/usr/bin/env python3
"""rewrite.py - the mechanical rewrite that lets a kernels/cuda source compile as host C++
against the emulator (test/cuemu, docs/GPU.md "The host emulator").

Only syntax that C++ has no spelling for is rewritten; the kernels' code is untouched:
  - kernel<<<grid, block, smem, stream>>>(args)  ->  cuemu::launch("kernel", kernel, grid, block, smem, stream, args)
  - extern __shared__ T name[];                  ->  T *name = (T *) cuemu::dyn_smem();
  - __shared__ T name[N];                        ->  a per-block allocation of exactly T[N]
  - asm [volatile] ("ptx" : outs : ins)          ->  cuemu::ptx("ptx", {outs}, {ins}) (the
                                                     emulator executes the PTX string)
Usage: rewrite.py IN OUT [--fault NAME FAULTS]: NAME injects one of the faults of
test/cuemu/faults.txt (a sed-like replacement that must match exactly once).  A fault in
a header (its file a header that IN includes as #include "HEADER") is injected into IN's
copy only: the include is replaced by the header's faulted text (the header must be
included once, with #pragma once), so the variant's other sources keep the header as it is.
"""
import re
import sys


def fail(msg):
    sys.stderr.write("rewrite.py: %s\n" % msg)
    sys.exit(1)


def skip_string(s, i):
    q = s[i]
    i += 1
    while s[i] != q:
        i += 2 if s[i] == "\\" else 1
    return i + 1


def match_paren(s, i):
    """s[i] is an opening bracket: index just past its match (strings skipped)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = [pairs[s[i]]]
    i += 1
    while stack:
        c = s[i]
        if c in "\"'":
            i = skip_string(s, i)
            continue
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")]}":
            if c != stack.pop():
                fail("unbalanced brackets near: %r" % s[i - 40:i + 10])
        i += 1
    return i


def split_top(s, sep):
    """Split on sep outside brackets and strings."""
    out, depth, cur, i = [], 0, "", 0
    while i < len(s):
        c = s[i]
        if c in "\"'":
            j = skip_string(s, i)
            cur += s[i:j]
            i = j
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    out.append(cur)
    return out


def rewrite_launches(s):
    out, pos = [], 0
    while True:
        i = s.find("<<<", pos)
        if i < 0:
            break
        j = s.find(">>>", i)
        # the kernel expression before <<<: an identifier with optional template arguments
        k = i
        while s[k - 1].isspace():
            k -= 1
        if s[k - 1] == ">":
            depth, k = 0, k - 1
            while True:
                if s[k] == ">":
                    depth += 1
                elif s[k] == "<":
                    depth -= 1
                    if depth == 0:
                        break
                k -= 1
        while k > 0 and (s[k - 1].isalnum() or s[k - 1] in "_:"):
            k -= 1
        kernel = s[k:i].strip()
        cfg = [c.strip() for c in split_top(s[i + 3:j], ",")]
        if len(cfg) < 2 or len(cfg) > 4:
            fail("launch of %s: %d configuration arguments" % (kernel, len(cfg)))
        while len(cfg) < 4:
            cfg.append("0")
        p = j + 3
        while s[p].isspace():
            p += 1
        if s[p] != "(":
            fail("launch of %s without arguments" % kernel)
        e = match_paren(s, p)
        args = s[p + 1:e - 1].strip()
        call = "cuemu::launch(%s, %s)" % (", ".join(['"%s"' % kernel, "&" + kernel] + cfg), args) \
            if args else "cuemu::launch(%s)" % ", ".join(['"%s"' % kernel, "&" + kernel] + cfg)
        out.append(s[pos:k])
        out.append(call)
        pos = e
    out.append(s[pos:])
    return "".join(out)


SHARED_ID = [0]


def rewrite_shared(s):
    def dyn(m):
        return "%s *%s = (%s *) cuemu::dyn_smem(%s);" % (m.group(2), m.group(3), m.group(2),
                                                          m.group(1) or "0")

    s = re.sub(r"extern\s+__shared__\s+(?:__align__\((\d+)\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;",
               dyn, s)

    def static(m):
        SHARED_ID[0] += 1
        al, t, name, dims = m.group(1) or "1", m.group(2), m.group(3), m.group(4)
        return ("%s (&%s)%s = *(%s (*)%s) cuemu::static_smem(%d, sizeof(%s%s), "
                "alignof(%s) > %s ? alignof(%s) : %s);" % (t, name, dims, t, dims, SHARED_ID[0], t,
                                                           dims, t, al, t, al))

    s = re.sub(r"__shared__\s+(?:__align__\((\d+)\)\s+)?([A-Za-z_][\w ]*?)\s+(\w+)\s*"
               r"((?:\[[^\]]+\])+)\s*;", static, s)
    if "__shared__" in re.sub(r"//.*|/\*.*?\*/", "", s, flags=re.S):
        fail("a __shared__ declaration this script does not know")
    return s


def rewrite_asm(s):
    out, pos = [], 0
    pat = re.compile(r"\basm\s*(?:volatile\s*)?\(")
    while True:
        m = pat.search(s, pos)
        if not m:
            break
        p = m.end() - 1
        e = match_paren(s, p)
        parts = split_top(s[p + 1:e - 1], ":")
        tmpl = parts[0].strip()
        ops = []
        for n, part in enumerate(parts[1:3]):
            for op in split_top(part, ","):
                op = op.strip()
                if not op:
                    continue
                om = re.match(r'^"([^"]*)"\s*\((.*)\)$', op, re.S)
                if not om:
                    fail("asm operand %r" % op)
                fn = "cuemu::asm_out" if n == 0 else "cuemu::asm_in"
                ops.append((n, "%s(\"%s\", %s)" % (fn, om.group(1), om.group(2))))
        outs = ", ".join(o for n, o in ops if n == 0)
        ins = ", ".join(o for n, o in ops if n == 1)
        out.append(s[pos:m.start()])
        out.append("cuemu::ptx(%s, {%s}, {%s})" % (tmpl, outs, ins))
        pos = e
    out.append(s[pos:])
    return "".join(out)


def apply_fault(s, name, faults_file):
    for line in open(faults_file):
        line = line.rstrip("\n")
        if not line or line.startswith("#"):
            continue
        fname, src, old, new = line.split("\t")[:4]
        if fname != name:
            continue
        return src, old.replace("\\n", "\n"), new.replace("\\n", "\n")
    fail("no fault %s in %s" % (name, faults_file))


def main():
    args = sys.argv[1:]
    fault = None
    if "--fault" in args:
        i = args.index("--fault")
        fault = args[i + 1:i + 3]
        del args[i:i + 3]
    src, dst = args
    s = open(src).read()
    base = src.rsplit("/", 1)[-1]
    if fault:
        fsrc, old, new = apply_fault(s, fault[0], fault[1])
        inc = '#include "%s"\n' % fsrc
        if fsrc != base and s.count(inc) == 1:
            hpath = src.rsplit("/", 1)[0] + "/" + fsrc
            h = open(hpath).read()
            if h.count(old) != 1:
                fail("fault %s: %r occurs %d times in %s" % (fault[0], old, h.count(old), fsrc))
            s = s.replace(inc, '#line 1 "%s"\n' % hpath +
                          h.replace(old, new).replace("#pragma once\n", "", 1) +
                          '#line %d "%s"\n' % (s[:s.index(inc)].count("\n") + 2, src))
        elif fsrc == base:
            if s.count(old) != 1:
                fail("fault %s: %r occurs %d times in %s" % (fault[0], old, s.count(old), base))
            s = s.replace(old, new)
        else:
            fail("fault %s: %s neither is %s nor is included by it" % (fault[0], fsrc, base))
    s = rewrite_launches(s)
    s = rewrite_shared(s)
    s = rewrite_asm(s)
    with open(dst, "w") as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(s)


main()
