/* cpu-features.h - the CPU features that choose every ISA-specific path of the CPU backend.
 *
 * Four levels above scalar, each a superset of the one below.  A level's CPU check and the
 * target attribute of its functions come from the same list, so a kernel never runs on a
 * CPU that lacks one of the instructions it was compiled with, and a build made on one
 * x86-64 host runs on any other (no -march=native needed):
 *
 *   level    CPU features checked (= target string)                      used by
 *   avx2     AVX2, FMA, F16C                     CPU_TARGET_AVX2          every fast path
 *   avx512   + AVX-512 F, DQ, BW, VL             CPU_TARGET_AVX512        BF16/F32 tiles, attention,
 *                                                                         swiglu, MXFP4 activations
 *   vnni     + AVX-512 VNNI                      CPU_TARGET_VNNI          MXFP4 int8 dot products
 *   amx      + AVX-512 BF16, AMX-TILE, AMX-BF16  CPU_TARGET_AMX           BF16 matmul on tiles
 *            and the kernel granting the tile state (arch_prctl XTILEDATA)
 *
 * The active level is the host's, capped once per process by the environment:
 * STEPD_CPU_ISA=scalar|avx2|avx512|vnni|amx, or the older switches STEPD_CPU_NO_AVX2
 * (scalar), STEPD_CPU_NO_AVX512 (avx2), STEPD_CPU_NO_VNNI (avx512), STEPD_CPU_NO_AMX (vnni);
 * the lowest cap wins.  Tests run each level through these (test/kernels/meson.build).
 *
 * One feature outside the levels: AVX512-FP16 (CPUID.7.0:EDX bit 23; Intel Sapphire Rapids
 * and later, not Zen 4 or Zen 5), used by the FP8 fast path (matmul-fp8-fp16.c) from level
 * vnni on: cpu_avx512fp16().  STEPD_CPU_NO_FP16=1 (read once per process) or a cap below
 * vnni turns it off.
 */
#pragma once

#include <stdatomic.h>
#include <stdbool.h>

enum cpu_isa {
    CPU_ISA_SCALAR,
    CPU_ISA_AVX2,
    CPU_ISA_AVX512,
    CPU_ISA_VNNI,
    CPU_ISA_AMX,
    _CPU_ISA_MAX,
};

#define CPU_TARGET_AVX2   "avx2,fma,f16c"
#define CPU_TARGET_AVX512 CPU_TARGET_AVX2 ",avx512f,avx512dq,avx512bw,avx512vl"
#define CPU_TARGET_VNNI   CPU_TARGET_AVX512 ",avx512vnni"
#define CPU_TARGET_AMX    CPU_TARGET_VNNI ",avx512bf16,amx-tile,amx-bf16"

/* Function attributes for each level's code (inline helpers must carry them too). */
#define CPU_FN_AVX2     __attribute__((target(CPU_TARGET_AVX2)))
#define CPU_FN_AVX512   __attribute__((target(CPU_TARGET_AVX512)))
#define CPU_FN_VNNI     __attribute__((target(CPU_TARGET_VNNI)))
#define CPU_FN_AMX      __attribute__((target(CPU_TARGET_AMX)))

/* private: the cached active level, -1 before the first probe */
extern _Atomic int cpu__isa_level;
enum cpu_isa cpu__isa_probe(void);

/* The active level (host level capped by the environment); probed on first use, then one
 * relaxed load.  Any thread. */
static inline enum cpu_isa cpu_isa(void)
{
    int v = atomic_load_explicit(&cpu__isa_level, memory_order_relaxed);

    return v >= 0 ? (enum cpu_isa)v : cpu__isa_probe();
}

/* The active level is at least `level`. */
static inline bool cpu_isa_has(enum cpu_isa level)
{
    return cpu_isa() >= level;
}

/* AVX512-FP16 is in use: the host has it (and AVX-512), STEPD_CPU_NO_FP16 is unset and the
 * active level is at least vnni. */
bool cpu_avx512fp16(void);
/* What the CPU itself offers, ignoring the environment caps. */
enum cpu_isa cpu_isa_host(void);
/* Tests and benchmarks: lower the active level to min(level, host).  Call it before the
 * backend that should see it is made (a backend reads the level at init, and attention's
 * and AMX's one-time checks keep what they found). */
void cpu_isa_set(enum cpu_isa level);
/* "scalar", "avx2", "avx512", "vnni", "amx". */
const char *cpu_isa_name(enum cpu_isa level);
/* Parses one of the names above: 0, or -EINVAL. */
int cpu_isa_parse(const char *s, enum cpu_isa *ret);
