/* test-secret-equal.c - rpc_secret_equal() (the API key, cluster key and abort token
 * comparison) runs the same instructions whatever the bytes compared: the timing
 * side channel of docs/RELIABILITY.md E3 checked without a clock.
 *
 * The call is single-stepped (the x86 trap flag: a SIGTRAP after every instruction) and
 * the addresses of the instructions it ran are hashed into its trace.  For a key and
 * wrong keys of its length (one byte wrong at the start, the middle or the end, every
 * byte wrong, the case changed) and the key itself, the traces must be one and the same:
 * a comparison that stops at the first differing byte, or branches on one, runs another
 * path.  The harness is checked on such a comparison (an early-exit loop here), whose
 * traces must differ, so the test cannot pass by tracing nothing.  Lengths are public
 * (only keys of the secret's length are compared with each other).
 */
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>

#include "harness.h"
#include "rpc.h"

#if !defined(__x86_64__)
#error "test-secret-equal single-steps with the x86-64 trap flag"
#endif

struct trace {
    uint64_t n;                 /* instructions stepped */
    uint64_t hash;              /* FNV-1a over their addresses */
};

static volatile struct trace cur;

static void on_trap(int sig, siginfo_t *si, void *uc_)
{
    ucontext_t *uc = uc_;
    uint64_t rip = (uint64_t)uc->uc_mcontext.gregs[REG_RIP];

    (void)sig;
    (void)si;
    cur.n++;
    cur.hash = (cur.hash ^ rip) * 0x100000001b3ull;
}

typedef bool (*cmp_fn)(const char *expected, const char *given);

/* The call between setting the trap flag and clearing it (both inline, around one
 * indirect call: the same instructions every time). */
static __attribute__((noinline)) struct trace traced(cmp_fn f, const char *expected, const char *given,
                                                     bool *result)
{
    bool r;

    cur.n = 0;
    cur.hash = 0xcbf29ce484222325ull;
    __asm__ volatile("pushfq\n\torq $0x100, (%%rsp)\n\tpopfq" ::: "memory", "cc");
    r = f(expected, given);
    __asm__ volatile("pushfq\n\tandq $~0x100, (%%rsp)\n\tpopfq" ::: "memory", "cc");
    *result = r;
    return (struct trace){ cur.n, cur.hash };
}

/* What rpc_secret_equal must not be: stops at the first differing byte. */
static __attribute__((noinline)) bool early_exit_equal(const char *expected, const char *given)
{
    size_t i;

    for (i = 0; expected[i] && expected[i] == given[i]; i++)
        ;
    return expected[i] == given[i];
}

#define KEY "q7Vd0LkM3xPz9TbN4hYw2CjR8sGf6EuA"      /* 32 characters */

/* The wrong keys of the secret's length, then the key itself; each copied into the same
 * buffer (the same address and alignment for every call). */
static const char *const cases[] = {
    "X7Vd0LkM3xPz9TbN4hYw2CjR8sGf6EuA",     /* first byte wrong */
    "q7Vd0LkM3xPz9TbNXhYw2CjR8sGf6EuA",     /* a middle byte wrong */
    "q7Vd0LkM3xPz9TbN4hYw2CjR8sGf6EuX",     /* last byte wrong (a 31/32 prefix match) */
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",     /* every byte wrong */
    "Q7vD0lKm3XpZ9tBn4HyW2cJr8SgF6eUa",     /* the case changed */
    KEY,                                    /* right */
};

static void check_one_path(const char *name, cmp_fn f, bool want_same)
{
    static char expected[64], given[64];
    struct trace t[sizeof(cases) / sizeof(cases[0])];
    size_t n = sizeof(cases) / sizeof(cases[0]);
    bool r, differ = false;

    snprintf(expected, sizeof(expected), "%s", KEY);
    snprintf(given, sizeof(given), "%s", cases[0]);
    f(expected, given);                 /* once untraced: lazy binding, first-use paths */
    for (size_t i = 0; i < n; i++) {
        snprintf(given, sizeof(given), "%s", cases[i]);
        t[i] = traced(f, expected, given, &r);
        ASSERT_EQ(r, i == n - 1);       /* only the key itself is equal */
        ASSERT_TRUE(t[i].n > 0);        /* the trap flag stepped it */
        if (t[i].n != t[0].n || t[i].hash != t[0].hash)
            differ = true;
        printf("   %-16s %-34s %6" PRIu64 " instructions, trace %016" PRIx64 "\n", name, cases[i], t[i].n,
               t[i].hash);
    }
    if (want_same && differ)
        FAIL("%s: the instructions run depend on the bytes compared (traces above)", name);
    if (!want_same && !differ)
        FAIL("%s: an early-exit comparison traced alike for every key: the harness sees nothing", name);
    if (want_same)
        ASSERT_TRUE(t[0].n > 32);       /* every byte looked at: an instruction each at least */
}

int main(void)
{
    struct sigaction sa;

    setvbuf(stdout, NULL, _IOLBF, 0);
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_trap;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    ASSERT_OK(sigaction(SIGTRAP, &sa, NULL));

    check_one_path("early-exit", early_exit_equal, false);     /* the harness tells them apart */
    check_one_path("rpc_secret_equal", rpc_secret_equal, true);
    printf("test-secret-equal: rpc_secret_equal runs one instruction path for %zu keys of the secret's "
           "length; an early-exit loop runs several\n", sizeof(cases) / sizeof(cases[0]));
    return 0;
}
