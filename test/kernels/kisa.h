/* kisa.h - which CPU dispatch level a run of a kernel test exercises (header-only). */
#pragma once

#include <stdio.h>
#include <stdlib.h>

#include "cpu-features.h"
#include "harness.h"

/* The dispatch level a run of a kernel test exercises: meson runs each test once per level
 * with STEPD_CPU_ISA=<level> (test/kernels/meson.build).  A host without that level skips
 * (77) instead of passing on a lower path; `need` is the lowest level whose code the test
 * exists to check (SCALAR: every level means something).  Returns the level. */
static inline enum cpu_isa kt_isa_require(const char *test, enum cpu_isa need)
{
    const char *s = getenv("STEPD_CPU_ISA");
    enum cpu_isa want, have = cpu_isa();

    if (s && *s) {
        if (cpu_isa_parse(s, &want) < 0)
            FAIL("%s: STEPD_CPU_ISA=%s is not a level", test, s);
        if (want < need)
            FAIL("%s: level %s given, the test checks level %s code", test,
                 cpu_isa_name(want), cpu_isa_name(need));
    } else {
        want = have > need ? have : need;     /* a run by hand: the host's level */
    }
    if (have < want) {
        printf("SKIP %s: this CPU's level is %s, the run is for %s\n", test,
               cpu_isa_name(cpu_isa_host()), cpu_isa_name(want));
        exit(TEST_SKIP);
    }
    ASSERT_EQ(have, want);
    printf("%s: running at level %s (host %s)\n", test, cpu_isa_name(have),
           cpu_isa_name(cpu_isa_host()));
    return have;
}
