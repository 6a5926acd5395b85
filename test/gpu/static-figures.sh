#!/usr/bin/env bash
# static-figures.sh - the figures of the GPU path that need no GPU, from the built plugin:
#   SASS instructions per KB of MXFP4 weights in the MoE decode loop: the sm_90a code of
#   mx4_gemm<NT 1, D 4, WB 1, MODE, bf16> (the decode shape: up to 8 tokens an expert),
#   its stage loop (the backward branch whose body holds the most HMMA instructions; it
#   runs two stages a turn), its instructions per byte of weights it reads: at NT 1 an
#   HMMA takes 16 rows x 16 k of one matrix, 128 nibble bytes and 8 scale bytes (a stage:
#   gate+up 2 x 4 tiles of 16x64, 544 bytes each = 4352 bytes, 32 HMMA; down 2176 bytes);
#   the same for NVFP4 experts (mx4_gemm<…, NV>: an HMMA takes 128 nibble bytes and 16
#   E4M3 scale bytes, 144; a stage gate+up 4608 bytes, down 2304);
#   the decode attention's K/V gather loop: flash_kernel<128, bf16, bf16, bf16>, the
#   backward branch whose body holds its LDGSTS, i.e. the instructions per 16-byte chunk,
#   and whether the chunk pays a call (the 64-bit division routine) or a dependent load.
#   SASS per KB of FP8 weights in fp8_gemm's stage loop (fp8mma.cu), sm_90a and sm_80:
#   fp8_gemm<NT, WB, MODE, bf16> at the decode shape <1, 1> and the prefill shape <4, 4>,
#   the backward branch whose body holds the most HMMA instructions (one stage of 128 k);
#   an HMMA takes 16 rows x 16 k of E4M3 codes, shared by the NT n8 token tiles (bytes =
#   HMMA x 256 / NT), its registers and the kernel's instructions in all (printed first;
#   FP8_ONLY=1: these alone, e.g. of an object file fp8mma.cu.o built from any commit).
#   static-figures.sh [PLUGIN]   (default build/kernels/cuda/libstepd-cuda.so)
# Needs cuobjdump and nvdisasm (the toolkit's, or CUOBJDUMP / NVDISASM_PATH).
#   Then the registers of mx4_gemm<NT 1 and 2, D 4, WB 1, gate+up and down, bf16>.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
plugin=${1:-$root/build/kernels/cuda/libstepd-cuda.so}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -x "$cuobjdump" ] || { echo "static-figures: no cuobjdump (set CUOBJDUMP)" >&2; exit 77; }
# the SASS and the resource usage of each architecture, one stream with marker lines
{ for arch in sm_90a sm_80; do
    echo "#### sass $arch"; "$cuobjdump" -sass -arch "$arch" "$plugin"
    echo "#### res-usage $arch"; "$cuobjdump" -res-usage -arch "$arch" "$plugin"
  done; } | python3 -c '
import os, re, sys
funcs, regs = {}, {}             # by architecture: name -> [(address, text)], name -> REG
part, arch, cur = None, None, None
for line in sys.stdin:
    if line.startswith("#### "):
        part, arch = line.split()[1:3]; cur = None
        funcs.setdefault(arch, {}); regs.setdefault(arch, {}); continue
    if part == "res-usage":
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1); continue
        m = re.search(r"REG:(\d+)", line)
        if m and cur:
            regs[arch][cur] = int(m.group(1)); cur = None
        continue
    m = re.search(r"Function : (\S+)", line)
    if m:
        cur = m.group(1); funcs[arch].setdefault(cur, []); continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m and cur:
        funcs[arch][cur].append((int(m.group(1), 16), m.group(2).strip()))

def code(arch, f, what):
    ins = funcs[arch].get(f)
    if not ins:
        sys.exit("static-figures: %s not in the plugin" % what)
    return ins

def loops(ins):
    """the backward branches: (target, address, HMMA in the body, the body text)"""
    out = []
    for a, t in ins:
        m = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)
        if not m or int(m.group(1), 16) >= a:
            continue
        tgt = int(m.group(1), 16)
        body = [x[1] for x in ins if tgt <= x[0] <= a]
        out.append((tgt, a, sum("HMMA" in x for x in body), body))
    return out

def stage_loops(ins):
    """the loops holding the most HMMA, the shortest first"""
    ls = loops(ins)
    hmax = max(l[2] for l in ls)
    return sorted((l for l in ls if l[2] == hmax), key=lambda l: len(l[3]))

def count(body):
    return sum(not x.startswith("NOP") for x in body)

def opcodes(body, k):
    kinds = {}
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        kinds[op] = kinds.get(op, 0) + 1
    return ", ".join("%s %d" % kv for kv in sorted(kinds.items(), key=lambda kv: -kv[1])[:k])

for arch in ("sm_90a", "sm_80"):
  for nt, wb, shape in ((1, 1, "decode"), (4, 4, "prefill")):
    for mode, name in ((0, "gate+up"), (1, "down")):
      f = "_Z8fp8_gemmILi%dELi%dELi%dE13__nv_bfloat16Ev7f8_args" % (nt, wb, mode)
      ins = code(arch, f, "%s fp8_gemm<%d, %d, %d, bf16>" % (arch, nt, wb, mode))
      tgt, a, h, body = stage_loops(ins)[0]
      n, nbytes = count(body), h * 256 // nt
      print("fp8_gemm %s <%d, %d> %-7s %-7s stage loop: %d instructions (%d HMMA) per %d "
            "bytes = %.0f per KB, %d registers, %d instructions in all; %s" %
            (arch, nt, wb, shape, name, n, h, nbytes, n * 1000.0 / nbytes,
             regs[arch].get(f, -1), count([x[1] for x in ins]), opcodes(body, 6)))
if os.environ.get("FP8_ONLY"):
    sys.exit(0)
for fmt, nv, per_hmma in (("MXFP4", 0, 136), ("NVFP4", 1, 144)):
  for mode, name in ((0, "gate+up"), (1, "down")):
    f = "_Z8mx4_gemmILi1ELi4ELi1ELi%dE13__nv_bfloat16Lb%dEEv8mx4_args" % (mode, nv)
    ls = stage_loops(code("sm_90a", f, f))
    # MXFP4: two copies of the loop, every matrix placed (the shorter) and a launch with a
    # matrix in the PRMT fallback (docs/GPU.md section 3)
    if len(ls) > 1:
        fb = ls[-1]
        print("mx4_gemm %s decode %-7s loop with a PRMT-fallback matrix: %d instructions = "
              "%.0f per KB" % (fmt, name, count(fb[3]), count(fb[3]) * 1000.0 /
                               (fb[2] * per_hmma)))
    tgt, a, h, body = ls[0]
    n, nbytes = count(body), h * per_hmma
    print("mx4_gemm %s decode %-7s stage loop 0x%x-0x%x: %d instructions (%d HMMA) per %d "
          "bytes of weights = %.0f per KB (1000 B); %s" % (fmt, name, tgt, a, n, h, nbytes,
                                                         n * 1000.0 / nbytes, opcodes(body, 8)))
ins = code("sm_90a", "_Z12flash_kernelILi128E13__nv_bfloat16S0_S0_Ev10flash_args",
           "flash_kernel<128, bf16, bf16, bf16>")
best = min((l[3] for l in loops(ins) if any("LDGSTS" in x for x in l[3])), key=len)
print("flash_kernel<128> K/V gather loop: %d instructions per 16-byte chunk, %d calls, %d "
      "other global loads" % (count(best), sum("CALL" in x for x in best),
                              sum(bool(re.search(r"\bLDG\.", x)) for x in best)))
out = []
for nv in (0, 1):
  for mode, name in ((0, "gate+up"), (1, "down")):
    for nt in (1, 2):
        f = "_Z8mx4_gemmILi%dELi4ELi1ELi%dE13__nv_bfloat16Lb%dEEv8mx4_args" % (nt, mode, nv)
        if f in regs["sm_90a"]:
            out.append("%s%s NT %d: %d" % ("NVFP4 " if nv else "", name, nt, regs["sm_90a"][f]))
print("mx4_gemm decode registers: " + ", ".join(out))
'
