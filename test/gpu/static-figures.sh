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
#   static-figures.sh [PLUGIN]   (default build/kernels/cuda/libstepd-cuda.so)
# Needs cuobjdump and nvdisasm (the toolkit's, or CUOBJDUMP / NVDISASM_PATH).
#   Then the registers of mx4_gemm<NT 1 and 2, D 4, WB 1, gate+up and down, bf16>.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
plugin=${1:-$root/build/kernels/cuda/libstepd-cuda.so}
cuobjdump=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -x "$cuobjdump" ] || { echo "static-figures: no cuobjdump (set CUOBJDUMP)" >&2; exit 77; }
"$cuobjdump" -sass -arch sm_90a "$plugin" | python3 -c '
import re, sys
funcs, cur = {}, None
for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m:
        cur = m.group(1); funcs.setdefault(cur, []); continue
    m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m and cur:
        funcs[cur].append((int(m.group(1), 16), m.group(2).strip()))
for fmt, nv, per_hmma in (("MXFP4", 0, 136), ("NVFP4", 1, 144)):
  for mode, name in ((0, "gate+up"), (1, "down")):
    f = "_Z8mx4_gemmILi1ELi4ELi1ELi%dE13__nv_bfloat16Lb%dEEv8mx4_args" % (mode, nv)
    ins = funcs.get(f)
    if not ins:
        sys.exit("static-figures: %s not in the plugin" % f)
    loops = []
    for a, t in ins:
        m = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)
        if not m:
            continue
        tgt = int(m.group(1), 16)
        if tgt >= a:
            continue
        body = [x for x in ins if tgt <= x[0] <= a]
        loops.append((tgt, a, sum("HMMA" in x[1] for x in body), body))
    hmax = max(l[2] for l in loops)
    loops = sorted((l for l in loops if l[2] == hmax), key=lambda l: len(l[3]))
    # MXFP4: two copies of the loop, every matrix placed (the shorter) and a launch with a
    # matrix in the PRMT fallback (docs/GPU.md section 3)
    if len(loops) > 1:
        fb = loops[-1]
        print("mx4_gemm %s decode %-7s loop with a PRMT-fallback matrix: %d instructions = "
              "%.0f per KB" % (fmt, name, sum(not x[1].startswith("NOP") for x in fb[3]),
                               sum(not x[1].startswith("NOP") for x in fb[3]) * 1000.0 /
                               (fb[2] * per_hmma)))
    tgt, a, h, body = loops[0]
    n = sum(not x[1].startswith("NOP") for x in body)
    nbytes = h * per_hmma
    kinds = {}
    for _, t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        kinds[op] = kinds.get(op, 0) + 1
    top = ", ".join("%s %d" % kv for kv in sorted(kinds.items(), key=lambda kv: -kv[1])[:8])
    print("mx4_gemm %s decode %-7s stage loop 0x%x-0x%x: %d instructions (%d HMMA) per %d "
          "bytes of weights = %.0f per KB (1000 B); %s" % (fmt, name, tgt, a, n, h, nbytes,
                                                         n * 1000.0 / nbytes, top))
ins = funcs.get("_Z12flash_kernelILi128E13__nv_bfloat16S0_S0_Ev10flash_args")
if not ins:
    sys.exit("static-figures: flash_kernel<128, bf16, bf16, bf16> not in the plugin")
best = None
for a, t in ins:
    m = re.search(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)
    if not m or int(m.group(1), 16) >= a:
        continue
    body = [x[1] for x in ins if int(m.group(1), 16) <= x[0] <= a]
    if any("LDGSTS" in x for x in body) and (best is None or len(body) < len(best)):
        best = body
n = sum(not x.startswith("NOP") for x in best)
print("flash_kernel<128> K/V gather loop: %d instructions per 16-byte chunk, %d calls, %d "
      "other global loads" % (n, sum("CALL" in x for x in best),
                              sum(bool(re.search(r"\bLDG\.", x)) for x in best)))
'
"$cuobjdump" -res-usage -arch sm_90a "$plugin" | python3 -c '
import re, sys
regs, cur = {}, None
for line in sys.stdin:
    m = re.search(r"Function (\S+):", line)
    if m:
        cur = m.group(1); continue
    m = re.search(r"REG:(\d+)", line)
    if m and cur:
        regs[cur] = int(m.group(1)); cur = None
out = []
for nv in (0, 1):
  for mode, name in ((0, "gate+up"), (1, "down")):
    for nt in (1, 2):
        f = "_Z8mx4_gemmILi%dELi4ELi1ELi%dE13__nv_bfloat16Lb%dEEv8mx4_args" % (nt, mode, nv)
        if f in regs:
            out.append("%s%s NT %d: %d" % ("NVFP4 " if nv else "", name, nt, regs[f]))
print("mx4_gemm decode registers: " + ", ".join(out))
'
