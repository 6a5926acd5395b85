/* test-attention.c - paged attention against a naive fp64 reference.
 *
 * Properties:
 *  - a batch of sequences with different start positions and lengths, GQA with
 *    contiguous grouping, blocks reached through a shuffled block table, full causal
 *    and sliding window, FP32 and BF16 cache, matches the reference (1e-5 abs);
 *  - chunked prefill gives bit-identical outputs to one-shot prefill;
 *  - decode after prefill gives bit-identical outputs to a longer prefill;
 *  - the sliding window holds exactly `window` keys (key t-window is invisible,
 *    key t-window+1 is visible);
 *  - a released block (-1) outside the window is never read; inside it is -EINVAL;
 *  - at level avx512, the AVX-512 path is bit-identical to the AVX2 path (level avx2,
 *    run in a forked child) on random decode, verify and prefill
 *    batches of several head sizes, GQA groups, contexts, windows and cache dtypes, and
 *    matches the fp64 reference.
 *  - at levels avx2 and avx512, the kernels that read a BF16 cache's rows themselves
 *    (scores and P.V with the next pass's rows prefetched) are bit-identical to converting
 *    the rows into fp32 buffers first (cpu_attn_no_fused), on those random batches with
 *    BF16 caches and on long decodes whose KV heads are grouped (>= 4096 keys), and match
 *    the reference, with the next rows prefetched into L2 and into L1 (cpu_attn_pf_l1).
 *  - split-K (segments of 128 keys here): decodes of 60, 128, 517 and 700 keys, a verify
 *    run and a prefill block straddling segment bounds, full and sliding windows (one
 *    within a segment, one crossing a bound), FP32 and BF16 caches: the split forced on,
 *    off and chosen at 1, 2 and 3 threads give the same bits, and those match the
 *    reference (a wrong rescale in the merge fails it); with 64-key segments chunked
 *    prefill and decodes (split on 3 threads) still agree bit for bit; a segment size
 *    that is not a multiple of 64 is refused; cpu_attn_use_split's choice.
 */
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kref.h"
#include "kisa.h"
#include "cpu.h"

enum { NH = 6, NKV = 2, HD = 24, BS = 4, NBLK = 160 };

struct cache {
    struct kv_layer kv;
    int32_t table[NBLK];        /* logical block -> physical, shuffled */
};

static void cache_init(struct cache *c, bool f32)
{
    size_t n = (size_t)NBLK * BS * NKV * HD;

    c->kv = (struct kv_layer){ .dtype_f32 = f32, .n_blocks = NBLK, .block_size = BS,
                               .n_kv_heads = NKV, .head_dim = HD };
    c->kv.k = calloc(n, f32 ? 4 : 2);
    c->kv.v = calloc(n, f32 ? 4 : 2);
    ASSERT_TRUE(c->kv.k && c->kv.v);
    for (int i = 0; i < NBLK; i++)
        c->table[i] = i;
    for (int i = NBLK - 1; i > 0; i--) {
        int j = (int)(krng_u64() % (uint64_t)(i + 1)), t = c->table[i];
        c->table[i] = c->table[j];
        c->table[j] = t;
    }
}

static void cache_free(struct cache *c)
{
    free(c->kv.k);
    free(c->kv.v);
}

static int32_t slot_of(const struct cache *c, int tbl_off, int pos)
{
    return c->table[tbl_off + pos / BS] * BS + pos % BS;
}

/* Store K/V of positions [p0, p0+n) for the sequence whose table starts at tbl_off
 * (logical K/V source arrays indexed by position). */
static void store(struct backend *be, struct cache *c, int tbl_off, const float *K, const float *V,
                  int p0, int n)
{
    int32_t slots[256];

    for (int i = 0; i < n; i++)
        slots[i] = slot_of(c, tbl_off, p0 + i);
    ASSERT_OK(backend_kv_store(be, &c->kv, K + (size_t)p0 * NKV * HD, V + (size_t)p0 * NKV * HD, n, slots));
}

static float round_kv(float x, bool f32)
{
    return f32 ? x : kbf16_to_f32(kf32_to_bf16(x));
}

/* naive attention of query q (one head) at position t over logical K/V */
static void ref_attn(const float *q, int h, int t, int window, const float *K, const float *V,
                     bool f32, double *out)
{
    int j = h / (NH / NKV), lo = window > 0 && t - window + 1 > 0 ? t - window + 1 : 0;
    double s[1024], m = -INFINITY, l = 0;

    for (int tau = lo; tau <= t; tau++) {
        double d = 0;
        for (int e = 0; e < HD; e++)
            d += (double)q[e] * round_kv(K[((size_t)tau * NKV + j) * HD + e], f32);
        s[tau - lo] = d / sqrt((double)HD);
        m = fmax(m, s[tau - lo]);
    }
    for (int e = 0; e < HD; e++)
        out[e] = 0;
    for (int tau = lo; tau <= t; tau++) {
        double p = exp(s[tau - lo] - m);
        l += p;
        for (int e = 0; e < HD; e++)
            out[e] += p * round_kv(V[((size_t)tau * NKV + j) * HD + e], f32);
    }
    for (int e = 0; e < HD; e++)
        out[e] /= l;
}

static void run_attn(struct backend *be, struct cache *c, const float *q, float *out, int n_seqs,
                     const int32_t *start, const int32_t *pos0, const int32_t *toff, int window)
{
    struct attn_args a = {
        .q = q, .out = out, .n_tok = start[n_seqs], .n_heads = NH, .n_kv_heads = NKV,
        .head_dim = HD, .scale = 1.0f / sqrtf((float)HD), .window = window, .kv = &c->kv,
        .n_seqs = n_seqs, .seq_tok_start = start, .seq_pos0 = pos0, .block_tables = c->table,
        .block_table_off = toff,
    };

    ASSERT_OK(backend_attention(be, &a));
}

/* three sequences in one batch against the reference */
static void test_batch(struct backend *be, bool f32, int window)
{
    /* seq 0: positions 0..9 (prefill), seq 1: decode at 130, seq 2: verify 3 at 70..72 */
    const int32_t start[4] = { 0, 10, 11, 14 }, pos0[3] = { 0, 130, 70 }, toff[3] = { 0, 40, 100 };
    const int lens[3] = { 10, 131, 73 };
    float *K[3], *V[3], q[14 * NH * HD], out[14 * NH * HD];
    struct cache c;

    cache_init(&c, f32);
    for (int s = 0; s < 3; s++) {
        K[s] = malloc(sizeof(float) * lens[s] * NKV * HD);
        V[s] = malloc(sizeof(float) * lens[s] * NKV * HD);
        krng_fill(K[s], (size_t)lens[s] * NKV * HD, 1.5f);
        krng_fill(V[s], (size_t)lens[s] * NKV * HD, 1.0f);
        store(be, &c, toff[s], K[s], V[s], 0, lens[s]);
    }
    krng_fill(q, sizeof(q) / 4, 1.5f);
    run_attn(be, &c, q, out, 3, start, pos0, toff, window);
    for (int s = 0; s < 3; s++) {
        for (int i = start[s]; i < start[s + 1]; i++) {
            for (int h = 0; h < NH; h++) {
                double ref[HD];

                ref_attn(q + ((size_t)i * NH + h) * HD, h, pos0[s] + i - start[s], window, K[s], V[s], f32, ref);
                for (int e = 0; e < HD; e++)
                    ASSERT_NEAR(out[((size_t)i * NH + h) * HD + e], ref[e], 1e-5);
            }
        }
        free(K[s]);
        free(V[s]);
    }
    cache_free(&c);
}

/* chunked prefill == one-shot; decode after prefill == longer prefill */
static void test_chunking(struct backend *be, int window)
{
    enum { L = 150 };
    const int32_t toff[1] = { 3 };
    float *K = malloc(sizeof(float) * L * NKV * HD), *V = malloc(sizeof(float) * L * NKV * HD);
    float *q = malloc(sizeof(float) * L * NH * HD);
    float *one = malloc(sizeof(float) * L * NH * HD), *chk = malloc(sizeof(float) * L * NH * HD);
    struct cache c1, c2;
    static const int chunks[] = { 7, 64, 1, 33, 44, 1 };   /* sums to L */
    int p = 0;

    krng_fill(K, (size_t)L * NKV * HD, 1.0f);
    krng_fill(V, (size_t)L * NKV * HD, 1.0f);
    krng_fill(q, (size_t)L * NH * HD, 2.0f);
    cache_init(&c1, true);
    cache_init(&c2, true);

    store(be, &c1, toff[0], K, V, 0, L);
    {
        int32_t start[2] = { 0, L }, pos0[1] = { 0 };
        run_attn(be, &c1, q, one, 1, start, pos0, toff, window);
    }
    for (size_t k = 0; k < ARRAY_SIZE(chunks); k++) {
        int32_t start[2] = { 0, chunks[k] }, pos0[1] = { p };

        store(be, &c2, toff[0], K, V, p, chunks[k]);
        run_attn(be, &c2, q + (size_t)p * NH * HD, chk + (size_t)p * NH * HD, 1, start, pos0, toff, window);
        p += chunks[k];
    }
    ASSERT_EQ(p, L);
    /* the last two chunks are 1-token decodes after a prefill of L-2 and L-1 tokens */
    ASSERT_TRUE(memcmp(one, chk, sizeof(float) * L * NH * HD) == 0);
    free(K); free(V); free(q); free(one); free(chk);
    cache_free(&c1);
    cache_free(&c2);
}

/* the window holds exactly `window` keys */
static void test_window_edges(struct backend *be)
{
    enum { W = 8, L = 20 };
    const int32_t toff[1] = { 0 }, start[2] = { 0, 1 };
    float K[L * NKV * HD] = { 0 }, V[L * NKV * HD] = { 0 }, q[NH * HD], out[NH * HD];
    struct cache c;
    int t = 15;

    cache_init(&c, true);
    krng_fill(q, NH * HD, 1.0f);
    /* all keys zero -> uniform weights; mark V of key t-W with 1000, t-W+1 with 1 */
    for (int e = 0; e < NKV * HD; e++) {
        V[(t - W) * NKV * HD + e] = 1000.0f;
        V[(t - W + 1) * NKV * HD + e] = 1.0f;
    }
    store(be, &c, 0, K, V, 0, L);
    {
        int32_t pos0[1] = { t };
        run_attn(be, &c, q, out, 1, start, pos0, toff, W);
        for (int i = 0; i < NH * HD; i++)
            ASSERT_NEAR(out[i], 1.0 / W, 1e-6);             /* t-W+1 visible, t-W not */
        run_attn(be, &c, q, out, 1, start, pos0, toff, W + 1);
        for (int i = 0; i < NH * HD; i++)
            ASSERT_NEAR(out[i], 1001.0 / (W + 1), 1e-4);    /* one more key: t-W visible */
        run_attn(be, &c, q, out, 1, start, pos0, toff, 0);
        for (int i = 0; i < NH * HD; i++)
            ASSERT_NEAR(out[i], 1001.0 / (t + 1), 1e-4);    /* full causal */
    }
    /* released blocks before the window are never read */
    {
        int32_t pos0[1] = { 19 };   /* window 8: keys 12..19 = blocks 3, 4 */
        struct attn_args a;
        int32_t saved[3] = { c.table[0], c.table[1], c.table[2] };

        c.table[0] = c.table[1] = c.table[2] = -1;
        run_attn(be, &c, q, out, 1, start, pos0, toff, W);
        c.table[2] = saved[2];
        c.table[3] = -1;
        a = (struct attn_args){ .q = q, .out = out, .n_tok = 1, .n_heads = NH, .n_kv_heads = NKV,
            .head_dim = HD, .scale = 0.2f, .window = W, .kv = &c.kv, .n_seqs = 1,
            .seq_tok_start = start, .seq_pos0 = pos0, .block_tables = c.table, .block_table_off = toff };
        ASSERT_ERR(backend_attention(be, &a), -EINVAL);
        c.table[0] = saved[0];
        c.table[1] = saved[1];
        c.table[3] = NBLK;          /* out of the pool */
        ASSERT_ERR(backend_attention(be, &a), -EINVAL);
    }
    cache_free(&c);
}

/* ---- AVX-512 vs AVX2: random batches, generated identically in both processes ---- */

enum { ID_CASES = 48, ID_BS = 16, ID_NBLK = 96, ID_MAXSEQ = 16 };

struct id_case {
    bool f32;
    int hd, nkv, G, window, n_seqs;
    int32_t start[ID_MAXSEQ + 1], pos0[ID_MAXSEQ], toff[ID_MAXSEQ];
    int32_t *table;             /* block table (ID_NBLK ids, or the case's own) */
    struct kv_layer kv;
    float *q;
};

static bool id_bf16_only;       /* every case with a BF16 cache (test_fused_identity) */

/* case c: decode (16 x 1 token), verify (2-4 seqs x 4 tokens), prefill chunks and mixes;
 * contexts 1..~300 keys (several KEY_CHUNKs), windows 0/5/37/64/100 */
static void id_case_make(struct id_case *ic, int c)
{
    static const int hds[] = { 32, 32, 32, 16, 48, 64, 128, 24 };
    static const int gs[] = { 2, 3, 1, 4, 3, 2, 40 };
    static const int wins[] = { 0, 64, 64, 5, 37, 100 };
    const int kind = c % 4;
    size_t n;

    memset(ic, 0, sizeof(*ic));
    ic->f32 = !id_bf16_only && c % 5 != 4;
    ic->hd = hds[c % ARRAY_SIZE(hds)];
    ic->nkv = c % 3 == 0 ? 4 : 1 + (int)(krng_u64() % 4);
    ic->G = gs[c % ARRAY_SIZE(gs)];
    if (ic->G == 40)
        ic->nkv = 1;            /* one KV head, 40 query heads: R > ATTN_MAX_ROWS */
    ic->window = wins[krng_u64() % ARRAY_SIZE(wins)];
    ic->n_seqs = kind == 0 ? 16 : kind == 1 ? 2 + (int)(krng_u64() % 3) : 1 + (int)(krng_u64() % 3);
    for (int s = 0; s < ic->n_seqs; s++) {
        int len = kind == 0 ? 1 : kind == 1 ? 4 : kind == 2 ? 1 + (int)(krng_u64() % 70)
                                                               : (int)(krng_u64() % 6);
        int ctx = len + (int)(krng_u64() % (kind == 0 ? 100 : 250));

        if (ctx < 1)
            ctx = 1;
        if (len > ctx)
            len = ctx;
        ic->start[s + 1] = ic->start[s] + len;
        ic->pos0[s] = ctx - len;
        ic->toff[s] = (int32_t)(krng_u64() % (ID_NBLK - (300 + ID_BS) / ID_BS));
    }
    if (ic->start[ic->n_seqs] == 0) {   /* at least one token */
        ic->start[ic->n_seqs] = 1;
        ic->pos0[ic->n_seqs - 1] = 0;
    }
    ic->table = malloc(sizeof(int32_t) * ID_NBLK);
    ASSERT_TRUE(ic->table != NULL);
    for (int i = 0; i < ID_NBLK; i++)
        ic->table[i] = i;
    for (int i = ID_NBLK - 1; i > 0; i--) {
        int j = (int)(krng_u64() % (uint64_t)(i + 1)), t = ic->table[i];

        ic->table[i] = ic->table[j];
        ic->table[j] = t;
    }
    n = (size_t)ID_NBLK * ID_BS * ic->nkv * ic->hd;
    ic->kv = (struct kv_layer){ .dtype_f32 = ic->f32, .n_blocks = ID_NBLK, .block_size = ID_BS,
                                .n_kv_heads = ic->nkv, .head_dim = ic->hd };
    ic->kv.k = malloc(n * (ic->f32 ? 4 : 2));
    ic->kv.v = malloc(n * (ic->f32 ? 4 : 2));
    ic->q = malloc(sizeof(float) * (size_t)ic->start[ic->n_seqs] * ic->nkv * ic->G * ic->hd);
    ASSERT_TRUE(ic->kv.k && ic->kv.v && ic->q);
    for (size_t i = 0; i < n; i++) {
        float k = 1.5f * krng_f(), v = krng_f();

        if (ic->f32) {
            ((float *)ic->kv.k)[i] = k;
            ((float *)ic->kv.v)[i] = v;
        } else {
            ((uint16_t *)ic->kv.k)[i] = kf32_to_bf16(k);
            ((uint16_t *)ic->kv.v)[i] = kf32_to_bf16(v);
        }
    }
    krng_fill(ic->q, (size_t)ic->start[ic->n_seqs] * ic->nkv * ic->G * ic->hd, 2.0f);
}

static size_t id_case_out_len(const struct id_case *ic)
{
    return (size_t)ic->start[ic->n_seqs] * ic->nkv * ic->G * ic->hd;
}

static void id_case_run(struct backend *be, struct id_case *ic, float *out)
{
    struct attn_args a = {
        .q = ic->q, .out = out, .n_tok = ic->start[ic->n_seqs], .n_heads = ic->nkv * ic->G,
        .n_kv_heads = ic->nkv, .head_dim = ic->hd, .scale = 1.0f / sqrtf((float)ic->hd),
        .window = ic->window, .kv = &ic->kv, .n_seqs = ic->n_seqs, .seq_tok_start = ic->start,
        .seq_pos0 = ic->pos0, .block_tables = ic->table, .block_table_off = ic->toff,
    };

    ASSERT_OK(backend_attention(be, &a));
}

static float id_kv(const struct id_case *ic, const void *base, int s, int tau, int j, int e)
{
    size_t off = (((size_t)ic->table[ic->toff[s] + tau / ID_BS] * ID_BS + (size_t)(tau % ID_BS)) *
                  ic->nkv + (size_t)j) * ic->hd + (size_t)e;

    return ic->f32 ? ((const float *)base)[off] : kbf16_to_f32(((const uint16_t *)base)[off]);
}

/* fp64 attention of every row of the case against the paged cache */
static void id_case_check_ref(const struct id_case *ic, const float *out)
{
    const int nh = ic->nkv * ic->G, hd = ic->hd;

    for (int s = 0; s < ic->n_seqs; s++) {
        for (int i = ic->start[s]; i < ic->start[s + 1]; i++) {
            const int t = ic->pos0[s] + i - ic->start[s];
            const int lo = ic->window > 0 && t - ic->window + 1 > 0 ? t - ic->window + 1 : 0;

            for (int h = 0; h < nh; h++) {
                const float *q = ic->q + ((size_t)i * nh + h) * hd;
                const int j = h / ic->G;
                double *sc = malloc(sizeof(double) * (size_t)(t - lo + 1));
                double m = -INFINITY, l = 0, o[128] = { 0 };

                ASSERT_TRUE(sc != NULL);

                for (int tau = lo; tau <= t; tau++) {
                    double d = 0;

                    for (int e = 0; e < hd; e++)
                        d += (double)q[e] * id_kv(ic, ic->kv.k, s, tau, j, e);
                    sc[tau - lo] = d / sqrt((double)hd);
                    m = fmax(m, sc[tau - lo]);
                }
                for (int tau = lo; tau <= t; tau++) {
                    double p = exp(sc[tau - lo] - m);

                    l += p;
                    for (int e = 0; e < hd; e++)
                        o[e] += p * id_kv(ic, ic->kv.v, s, tau, j, e);
                }
                for (int e = 0; e < hd; e++)
                    ASSERT_NEAR(out[((size_t)i * nh + h) * hd + e], o[e] / l, 1e-5);
                free(sc);
            }
        }
    }
}

static void id_case_free(struct id_case *ic)
{
    free(ic->table);
    free(ic->kv.k);
    free(ic->kv.v);
    free(ic->q);
}

/* all cases' outputs, one after another, into buf (cap floats); returns the float count */
static size_t id_cases_run(struct backend *be, float *buf, size_t cap, bool check_ref)
{
    size_t used = 0;

    krng_seed(4242);
    for (int c = 0; c < ID_CASES; c++) {
        struct id_case ic;

        id_case_make(&ic, c);
        ASSERT_TRUE(used + id_case_out_len(&ic) <= cap);
        id_case_run(be, &ic, buf + used);
        if (check_ref)
            id_case_check_ref(&ic, buf + used);
        used += id_case_out_len(&ic);
        id_case_free(&ic);
    }
    return used;
}

/* At level avx512: the AVX-512 path against the AVX2 kernels (level avx2, in a child forked
 * before either was used: the choice is fixed by the first call), bit for bit. */
static void test_avx512_identity(void)
{
    const size_t cap = (size_t)4 << 20, bytes = 64 + cap * sizeof(float);
    void *shared = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    size_t *n_theirs = shared;                      /* the child's float count, then them */
    float *theirs = (float *)((char *)shared + 64), *mine = malloc(cap * sizeof(float));
    size_t n_mine = 0;
    pid_t pid;
    int st = 0;

    ASSERT_TRUE(shared != MAP_FAILED && mine != NULL);
    fflush(stdout);
    fflush(stderr);
    pid = fork();
    ASSERT_TRUE(pid >= 0);
    if (pid == 0) {
        struct backend *be;

        cpu_isa_set(CPU_ISA_AVX2);
        be = kref_backend(2, false);
        *n_theirs = id_cases_run(be, theirs, cap, false);
        backend_free(be);
        _exit(0);
    }
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    for (int th = 1; th <= 3; th += 2) {
        struct backend *be = kref_backend(th, false);

        n_mine = id_cases_run(be, mine, cap, th == 1);
        ASSERT_EQ(*n_theirs, n_mine);
        for (size_t i = 0; i < n_mine; i++) {
            if (memcmp(&mine[i], &theirs[i], sizeof(float)) != 0)
                FAIL("AVX-512 vs AVX2 attention differ at output %zu: %.9g vs %.9g", i,
                     (double)mine[i], (double)theirs[i]);
        }
        backend_free(be);
    }
    printf("attention: %d random batches (%zu outputs) identical on both paths\n", ID_CASES,
           n_mine);
    munmap(shared, bytes);
    free(mine);
}

/* At level avx2 and up: a BF16 cache read by the fused kernels against the rows converted into
 * fp32 buffers first, bit for bit, on the random batches (every cache BF16) and on decodes
 * of 4100-4400 keys, where KV heads are grouped and each pass prefetches the next head's
 * rows; outputs also against the fp64 reference. */
static void test_fused_identity(void)
{
    const size_t cap = (size_t)4 << 20;
    float *a = malloc(cap * sizeof(float)), *b = malloc(cap * sizeof(float));
    size_t na, nb;

    ASSERT_TRUE(a && b);
    id_bf16_only = true;
    for (int th = 1; th <= 2; th++) {
        struct backend *be = kref_backend(th, false);

        cpu_attn_no_fused = 1;
        na = id_cases_run(be, a, cap, false);
        cpu_attn_no_fused = 0;
        /* the next rows prefetched into L2, then into L1 (cpu_attn_pf_l1): the same bits */
        for (int pf = 0; pf <= 1; pf++) {
            cpu_attn_pf_l1 = pf;
            nb = id_cases_run(be, b, cap, th == 1 && pf == 0);
            ASSERT_EQ(na, nb);
            for (size_t i = 0; i < na; i++)
                if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
                    FAIL("fused (prefetch into L%d) vs buffered BF16 attention differ at output "
                         "%zu: %.9g vs %.9g", 2 - pf, i, (double)b[i], (double)a[i]);
        }
        cpu_attn_pf_l1 = -1;
        /* long decodes: 3 sequences, 4 KV heads x G 8, head dims 16 and 128 */
        for (int hd = 16; hd <= 128; hd *= 8) {
            static const int ctx[3] = { 4100, 4400, 4243 };
            struct id_case ic = { .hd = hd, .nkv = 4, .G = 8, .n_seqs = 3 };
            int nblk = 0;
            size_t n, nout;
            float *o1, *o2;

            for (int s = 0; s < ic.n_seqs; s++) {
                ic.start[s + 1] = s + 1;
                ic.pos0[s] = ctx[s] - 1;
                ic.toff[s] = nblk;
                nblk += (ctx[s] + ID_BS - 1) / ID_BS;
            }
            n = (size_t)nblk * ID_BS * ic.nkv * hd;
            nout = id_case_out_len(&ic);
            ic.table = malloc(sizeof(int32_t) * (size_t)nblk);
            ic.kv = (struct kv_layer){ .dtype_f32 = 0, .n_blocks = nblk, .block_size = ID_BS,
                                       .n_kv_heads = ic.nkv, .head_dim = hd,
                                       .k = malloc(n * 2), .v = malloc(n * 2) };
            ic.q = malloc(sizeof(float) * nout);
            o1 = malloc(sizeof(float) * nout);
            o2 = malloc(sizeof(float) * nout);
            ASSERT_TRUE(ic.table && ic.kv.k && ic.kv.v && ic.q && o1 && o2);
            for (int i = 0; i < nblk; i++)
                ic.table[i] = nblk - 1 - i;
            for (size_t i = 0; i < n; i++) {
                ((uint16_t *)ic.kv.k)[i] = kf32_to_bf16(1.5f * krng_f());
                ((uint16_t *)ic.kv.v)[i] = kf32_to_bf16(krng_f());
            }
            krng_fill(ic.q, nout, 2.0f);
            cpu_attn_no_fused = 1;
            id_case_run(be, &ic, o1);
            cpu_attn_no_fused = 0;
            for (int pf = 0; pf <= 1; pf++) {
                cpu_attn_pf_l1 = pf;
                id_case_run(be, &ic, o2);
                ASSERT_TRUE(memcmp(o1, o2, sizeof(float) * nout) == 0);
            }
            cpu_attn_pf_l1 = -1;
            id_case_check_ref(&ic, o2);
            id_case_free(&ic);
            free(o1);
            free(o2);
        }
        backend_free(be);
    }
    id_bf16_only = false;
    printf("attention: fused BF16 kernels identical to buffered rows (%zu outputs + long decodes)\n",
           na);
    free(a);
    free(b);
}

/* cpu_attn_groups: a decode on one thread takes all KV heads of its sequence in one item
 * (its state sized by the one token it has, not by a block's 4); more threads or a block's
 * longer state split them; short contexts keep a head per item. */
static void test_groups(void)
{
    const int nkv = 8, hd = 128, G = 8;

    ASSERT_EQ(cpu_attn_groups(nkv, 32768, 1, 1 * G * hd, 1), 1);
    ASSERT_EQ(cpu_attn_groups(nkv, 8192, 16, 1 * G * hd, 1), 1);
    ASSERT_EQ(cpu_attn_groups(nkv, 8192, 16, 1 * G * hd, 2), 1);
    ASSERT_EQ(cpu_attn_groups(nkv, 32768, 1, 1 * G * hd, 2), 2);       /* an item a thread */
    ASSERT_EQ(cpu_attn_groups(nkv, 32768, 1, 1 * G * hd, 4), 4);
    ASSERT_EQ(cpu_attn_groups(nkv, 32768, 1, 4 * G * hd, 1), 2);       /* 4-token block */
    ASSERT_EQ(cpu_attn_groups(nkv, 1024, 1, 1 * G * hd, 1), nkv);      /* short context */
    cpu_attn_no_groups = 1;
    ASSERT_EQ(cpu_attn_groups(nkv, 32768, 1, 1 * G * hd, 1), nkv);
    cpu_attn_no_groups = 0;
    printf("attention: head groups per work item as expected\n");
}

/* One split-K case: sequences of len[s] query tokens ending at context ctx[s], 2 KV heads x
 * G 4, head dim 64, blocks of 16 in reverse order. */
static void split_case_make(struct id_case *ic, int n_seqs, const int *len, const int *ctx,
                            int window, bool f32)
{
    int nblk = 0;
    size_t n;

    memset(ic, 0, sizeof(*ic));
    *ic = (struct id_case){ .f32 = f32, .hd = 64, .nkv = 2, .G = 4, .window = window,
                            .n_seqs = n_seqs };
    for (int s = 0; s < n_seqs; s++) {
        ic->start[s + 1] = ic->start[s] + len[s];
        ic->pos0[s] = ctx[s] - len[s];
        ic->toff[s] = nblk;
        nblk += (ctx[s] + ID_BS - 1) / ID_BS;
    }
    n = (size_t)nblk * ID_BS * ic->nkv * ic->hd;
    ic->table = malloc(sizeof(int32_t) * (size_t)nblk);
    ic->kv = (struct kv_layer){ .dtype_f32 = f32, .n_blocks = nblk, .block_size = ID_BS,
                                .n_kv_heads = ic->nkv, .head_dim = ic->hd,
                                .k = malloc(n * (f32 ? 4 : 2)), .v = malloc(n * (f32 ? 4 : 2)) };
    ic->q = malloc(sizeof(float) * id_case_out_len(ic));
    ASSERT_TRUE(ic->table && ic->kv.k && ic->kv.v && ic->q);
    for (int i = 0; i < nblk; i++)
        ic->table[i] = nblk - 1 - i;
    for (size_t i = 0; i < n; i++) {
        float k = 1.5f * krng_f(), v = krng_f();

        if (f32) {
            ((float *)ic->kv.k)[i] = k;
            ((float *)ic->kv.v)[i] = v;
        } else {
            ((uint16_t *)ic->kv.k)[i] = kf32_to_bf16(k);
            ((uint16_t *)ic->kv.v)[i] = kf32_to_bf16(v);
        }
    }
    krng_fill(ic->q, id_case_out_len(ic), 2.0f);
}

/* Split-K: the same bits whether the segments run in one item or in items of their own, on
 * any thread count, and the fp64 reference's values. */
static void test_split(void)
{
    /* a batch: decodes of 517 (5 segments, the last partial), 128 (one, ending on a bound)
     * and 60 keys (one chunk), a verify of 4 tokens at 254..257 (across the bound at 256),
     * a prefill block of 70 tokens at 130..199; then one decode of 700 keys alone */
    static const int len5[5] = { 1, 1, 1, 4, 70 }, ctx5[5] = { 517, 128, 60, 258, 200 };
    static const int len1[1] = { 1 }, ctx1[1] = { 700 };
    static const int wins[3] = { 0, 100, 37 };  /* 100 at 516: keys 417..516, across 512 */
    size_t cases = 0;

    cpu_attn_split_keys = 128;
    krng_seed(99);
    for (int c = 0; c < 2 * 2 * 3; c++) {
        const bool one = c % 2 == 1, f32 = c / 2 % 2 == 1;
        struct id_case ic;
        float *ref = NULL, *out;
        size_t nout;

        split_case_make(&ic, one ? 1 : 5, one ? len1 : len5, one ? ctx1 : ctx5, wins[c / 4], f32);
        nout = id_case_out_len(&ic);
        ref = malloc(sizeof(float) * nout);
        out = malloc(sizeof(float) * nout);
        ASSERT_TRUE(ref && out);
        for (int th = 1; th <= 3; th++) {
            struct backend *be = kref_backend(th, false);

            for (int sp = -1; sp <= 1; sp++) {
                cpu_attn_split = sp;
                id_case_run(be, &ic, th == 1 && sp == -1 ? ref : out);
                if (th == 1 && sp == -1)
                    id_case_check_ref(&ic, ref);
                else if (memcmp(ref, out, sizeof(float) * nout) != 0)
                    FAIL("split-K case %d: %d threads, split %d differ from 1 thread unsplit",
                         c, th, sp);
                cases++;
            }
            backend_free(be);
        }
        cpu_attn_split = 0;
        id_case_free(&ic);
        free(ref);
        free(out);
    }
    {
        /* a segment size the key chunks do not divide */
        struct id_case ic;
        struct backend *be = kref_backend(1, false);
        float *out;
        struct attn_args a;

        split_case_make(&ic, 1, len1, ctx1, 0, true);
        out = malloc(sizeof(float) * id_case_out_len(&ic));
        ASSERT_TRUE(out != NULL);
        a = (struct attn_args){ .q = ic.q, .out = out, .n_tok = 1, .n_heads = 8, .n_kv_heads = 2,
            .head_dim = 64, .scale = 0.125f, .kv = &ic.kv, .n_seqs = 1, .seq_tok_start = ic.start,
            .seq_pos0 = ic.pos0, .block_tables = ic.table, .block_table_off = ic.toff };
        cpu_attn_split_keys = 100;
        ASSERT_ERR(backend_attention(be, &a), -EINVAL);
        backend_free(be);
        id_case_free(&ic);
        free(out);
    }
    cpu_attn_split_keys = 2048;
    /* the choice: several threads, two segments or more, under 2 items a thread, at most
     * 64 MiB of segment states */
    ASSERT_TRUE(cpu_attn_use_split(1, 8192, 2048, 1 << 20, 2));
    ASSERT_TRUE(cpu_attn_use_split(3, 32768, 2048, 1 << 20, 2));
    ASSERT_TRUE(!cpu_attn_use_split(4, 32768, 2048, 1 << 20, 2));   /* batch 4: 2 a thread */
    ASSERT_TRUE(!cpu_attn_use_split(16, 8192, 2048, 1 << 20, 2));
    ASSERT_TRUE(!cpu_attn_use_split(1, 32768, 2048, 1 << 20, 1));       /* one thread */
    ASSERT_TRUE(!cpu_attn_use_split(1, 4095, 2048, 1 << 20, 2));        /* under two segments */
    ASSERT_TRUE(cpu_attn_use_split(1, 131072, 2048, (size_t)64 << 20, 2));
    ASSERT_TRUE(!cpu_attn_use_split(1, 131072, 2048, ((size_t)64 << 20) + 1, 2));  /* scratch */
    printf("attention: split-K identical forced on/off, 1-3 threads (%zu runs), matches the "
           "reference\n", cases);
}

int main(void)
{
    enum cpu_isa level;

    setenv("STEPD_CPU_MIN_WORK", "0", 0);   /* split every op over all threads */
    level = kt_isa_require("attention", CPU_ISA_SCALAR);

    if (level >= CPU_ISA_AVX512) {
        test_avx512_identity();             /* first: forks before any attention call */
        ASSERT_TRUE(cpu_attn_avx512_level() >= 1);
    }
    if (level >= CPU_ISA_AVX2)
        test_fused_identity();
    test_groups();
    test_split();
    for (int th = 1; th <= 3; th += 2) {
        struct backend *be = kref_backend(th, false);

        krng_seed(7 + th);
        test_batch(be, true, 0);
        test_batch(be, true, 5);
        test_batch(be, false, 0);
        test_batch(be, false, 64);
        test_chunking(be, 0);
        test_chunking(be, 37);
        test_chunking(be, 64);      /* the tiny model's window: rows straddle key chunks */
        cpu_attn_split_keys = 64;   /* rows straddle split-K segments; decodes split at 3 */
        test_chunking(be, 0);
        test_chunking(be, 100);
        cpu_attn_split_keys = 2048;
        test_window_edges(be);
        backend_free(be);
    }
    printf("attention: all checks passed\n");
    return 0;
}
