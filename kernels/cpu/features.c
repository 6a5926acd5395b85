/* features.c - CPU feature detection and the environment caps (see cpu-features.h).
 *
 * The host level is probed once with cpuid (through GCC's __builtin_cpu_supports) and, for
 * AMX, the one arch_prctl request that makes the kernel hand out the 8 KiB tile state;
 * the environment is read once, at the same time.  Racy first calls compute the same
 * value, so a relaxed store is enough.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu-features.h"
#include "log.h"

_Atomic int cpu__isa_level = -1;

static const char *const isa_names[_CPU_ISA_MAX] = {
    [CPU_ISA_SCALAR] = "scalar",
    [CPU_ISA_AVX2] = "avx2",
    [CPU_ISA_AVX512] = "avx512",
    [CPU_ISA_VNNI] = "vnni",
    [CPU_ISA_AMX] = "amx",
};

const char *cpu_isa_name(enum cpu_isa level)
{
    return level >= 0 && level < _CPU_ISA_MAX ? isa_names[level] : "?";
}

int cpu_isa_parse(const char *s, enum cpu_isa *ret)
{
    for (int i = 0; s && i < _CPU_ISA_MAX; i++) {
        if (strcmp(s, isa_names[i]) == 0) {
            *ret = (enum cpu_isa)i;
            return 0;
        }
    }
    return -EINVAL;
}

#if defined(__x86_64__)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static bool host_amx(void)
{
    unsigned a, b, c, d;

    if (!__builtin_cpu_supports("avx512bf16") || __get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    /* EDX bit 22 AMX-BF16, bit 24 AMX-TILE */
    if (!(d & (1u << 22)) || !(d & (1u << 24)))
        return false;
    /* the kernel hands out the tile state only on request (once per process) */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        log_debug("cpu: AMX present but the kernel refused XTILEDATA");
        return false;
    }
    return true;
}

/* F16C (CPUID.1:ECX bit 29): read directly, as clang's __builtin_cpu_supports does not
 * know the name */
static bool host_f16c(void)
{
    unsigned a, b, c, d;

    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}

/* AVX512-FP16 (CPUID.(EAX=7,ECX=0):EDX bit 23), read directly like F16C; the OS's AVX-512
 * state is the avx512f check of host_probe (the caller asks for level avx512 first) */
static bool host_avx512fp16(void)
{
    unsigned a, b, c, d;

    if (__get_cpuid_max(0, NULL) < 7)
        return false;
    __cpuid_count(7, 0, a, b, c, d);
    return (d >> 23) & 1;
}

static enum cpu_isa host_probe(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !host_f16c())
        return CPU_ISA_SCALAR;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512dq") ||
        !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
        return CPU_ISA_AVX2;
    if (!__builtin_cpu_supports("avx512vnni"))
        return CPU_ISA_AVX512;
    if (!host_amx())
        return CPU_ISA_VNNI;
    return CPU_ISA_AMX;
}
#else
static enum cpu_isa host_probe(void)
{
    return CPU_ISA_SCALAR;
}

static bool host_avx512fp16(void)
{
    return false;
}
#endif

static enum cpu_isa host_level;
static bool host_fp16;      /* AVX512-FP16 on an AVX-512 host, and STEPD_CPU_NO_FP16 unset */
static pthread_once_t host_once = PTHREAD_ONCE_INIT;

static void host_init(void)
{
    const char *s = getenv("STEPD_CPU_NO_FP16");

    host_level = host_probe();
    host_fp16 = host_level >= CPU_ISA_AVX512 && host_avx512fp16() && !(s && *s && strcmp(s, "0") != 0);
}

enum cpu_isa cpu_isa_host(void)
{
    pthread_once(&host_once, host_init);
    return host_level;
}

bool cpu_avx512fp16(void)
{
    pthread_once(&host_once, host_init);
    return host_fp16 && cpu_isa_has(CPU_ISA_VNNI);
}

/* The lowest cap the environment asks for (_CPU_ISA_MAX: none). */
static enum cpu_isa env_cap(void)
{
    static const struct { const char *name; enum cpu_isa cap; } sw[] = {
        { "STEPD_CPU_NO_AVX2", CPU_ISA_SCALAR },
        { "STEPD_CPU_NO_AVX512", CPU_ISA_AVX2 },
        { "STEPD_CPU_NO_VNNI", CPU_ISA_AVX512 },
        { "STEPD_CPU_NO_AMX", CPU_ISA_VNNI },
    };
    enum cpu_isa cap = _CPU_ISA_MAX, v;
    const char *s = getenv("STEPD_CPU_ISA");

    if (s && *s) {
        if (cpu_isa_parse(s, &v) == 0)
            cap = v;
        else
            log_warn("cpu: STEPD_CPU_ISA=%s is not one of scalar, avx2, avx512, vnni, amx; "
                     "ignored", s);
    }
    for (size_t i = 0; i < sizeof(sw) / sizeof(sw[0]); i++) {
        s = getenv(sw[i].name);
        if (s && *s && strcmp(s, "0") != 0 && sw[i].cap < cap)
            cap = sw[i].cap;
    }
    return cap;
}

enum cpu_isa cpu__isa_probe(void)
{
    enum cpu_isa host = cpu_isa_host(), cap = env_cap();
    enum cpu_isa v = host < cap ? host : cap;

    atomic_store_explicit(&cpu__isa_level, (int)v, memory_order_relaxed);
    return v;
}

void cpu_isa_set(enum cpu_isa level)
{
    enum cpu_isa host = cpu_isa_host();

    atomic_store_explicit(&cpu__isa_level, (int)(level < host ? level : host),
                          memory_order_relaxed);
}
