/* test-moe.c - the grouped MoE op against references.
 *
 * Properties:
 *  - out += Σ_k w_k · down(swiglu(gate x, up x)) over the LOCAL experts only (a rank's
 *    slice expert_first .. +n_local), against an fp64 reference: 1e-5 relative on the
 *    exact MXFP4 path and BF16, and the fast path equals the composition of fast
 *    matmuls (same quantisation) within 1e-6 relative;
 *  - the fast path is within 3 % of the fp64 reference (activation rounding, twice);
 *    BF16 on the fast path (activations rounded to BF16, twice) within 2 x 2^-8 + 1e-5 of
 *    Σ|contributions|, the bound of two roundings of at most 2^-8 each (measured max
 *    below 2e-3 on this test's data: see the printed figure);
 *  - results are bit-identical for 1, 2 and 3 threads, and to the op run once per local
 *    expert in expert order (the fixed scatter order: expert, then token);
 *  - negative ids and mismatched expert shapes are -EINVAL;
 *  - on the tiny model's shapes (hidden 256, inter 128, 16 experts, top-4, also a rank's
 *    slice of them), the fast path gives bit-identical outputs with the 16-row MXFP4
 *    kernel and with the 4-row one, for 1..19 tokens and 1 or 2 threads.
 */
#include "kref.h"
#include "kisa.h"
#include "cpu.h"

enum { H = 96, I = 160, T = 7, K = 3, NE = 6, FIRST = 2, NLOC = 3 };

static void make_experts(struct moe_expert *ex, enum wfmt fmt)
{
    for (int e = 0; e < NLOC; e++) {
        if (fmt == WFMT_MXFP4) {
            ex[e].gate = kref_mxfp4_new(I, H, 119, 124);
            ex[e].up = kref_mxfp4_new(I, H, 119, 124);
            ex[e].down = kref_mxfp4_new(H, I, 119, 124);
        } else {
            ex[e].gate = kref_bf16_new(I, H, 0.2f);
            ex[e].up = kref_bf16_new(I, H, 0.2f);
            ex[e].down = kref_bf16_new(H, I, 0.2f);
        }
    }
}

/* fp64 reference; mag = Σ|contributions| for tolerances */
static void ref_moe(const struct moe_expert *ex, const float *x, const int32_t *ids, const float *w,
                    float limit, double *out, double *mag)
{
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            int e = ids[t * K + k] - FIRST;
            float act[I];

            if (e < 0 || e >= NLOC)
                continue;
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int j = 0; j < H; j++) {
                    g += (double)kref_w(&ex[e].gate, i, j) * x[t * H + j];
                    u += (double)kref_w(&ex[e].up, i, j) * x[t * H + j];
                }
                act[i] = kref_swiglu((float)g, (float)u, limit);
            }
            for (int o = 0; o < H; o++) {
                double d = 0, m = 0;
                for (int i = 0; i < I; i++) {
                    double p = (double)kref_w(&ex[e].down, o, i) * act[i];
                    d += p;
                    m += fabs(p);
                }
                out[t * H + o] += w[t * K + k] * d;
                mag[t * H + o] += fabs(w[t * K + k]) * m;
            }
        }
    }
}

static void run(struct backend *be, const struct moe_expert *ex, const float *x, const int32_t *ids,
                const float *w, float limit, float *out)
{
    struct moe_args a = { .x = x, .out = out, .n_tok = T, .hidden = H, .inter = I, .top_k = K,
                          .ids = ids, .weights = w, .experts = ex, .expert_first = FIRST,
                          .n_local = NLOC, .limit = limit };

    ASSERT_OK(backend_moe(be, &a));
}

/* The op once per local expert, in expert order: the fixed scatter order (expert, then
 * token) with the op's own per-(token, row) arithmetic, so the whole op must match it
 * bit for bit; a token's terms come from distinct experts, so an op that added them in
 * another order would round differently somewhere. */
static void per_expert(struct backend *be, const struct moe_expert *ex, const float *x,
                       const int32_t *ids, const float *w, float limit, float *out)
{
    for (int e = 0; e < NLOC; e++) {
        struct moe_args a = { .x = x, .out = out, .n_tok = T, .hidden = H, .inter = I,
                              .top_k = K, .ids = ids, .weights = w, .experts = ex + e,
                              .expert_first = FIRST + e, .n_local = 1, .limit = limit };

        ASSERT_OK(backend_moe(be, &a));
    }
}

/* fast-path oracle: the op composed from backend matmuls (same quantisation) */
static void composed(struct backend *be, const struct moe_expert *ex, const float *x,
                     const int32_t *ids, const float *w, float limit, float *out)
{
    for (int e = 0; e < NLOC; e++) {
        for (int t = 0; t < T; t++) {
            for (int k = 0; k < K; k++) {
                float g[I], u[I], d[H];

                if (ids[t * K + k] - FIRST != e)
                    continue;
                ASSERT_OK(backend_matmul(be, &ex[e].gate, x + t * H, 1, g));
                ASSERT_OK(backend_matmul(be, &ex[e].up, x + t * H, 1, u));
                ASSERT_OK(backend_swiglu(be, g, u, 1, I, limit, g));
                ASSERT_OK(backend_matmul(be, &ex[e].down, g, 1, d));
                for (int o = 0; o < H; o++)
                    out[t * H + o] += w[t * K + k] * d[o];
            }
        }
    }
}

static void check(enum wfmt fmt, bool exact, float limit)
{
    double rel_max = 0.0;
    struct moe_expert ex[NLOC];
    float x[T * H], w[T * K], base[T * H], out[3][T * H], comp[T * H], seq[T * H];
    int32_t ids[T * K];
    double ref[T * H], mag[T * H];

    make_experts(ex, fmt);
    krng_fill(x, T * H, 2.0f);
    krng_fill(base, T * H, 1.0f);
    for (int t = 0; t < T; t++) {
        for (int k = 0; k < K; k++) {
            int e;
            bool dup;
            do {            /* distinct experts per token, some outside the local slice */
                e = (int)(krng_u64() % NE);
                dup = false;
                for (int j = 0; j < k; j++)
                    dup |= ids[t * K + j] == e;
            } while (dup);
            ids[t * K + k] = e;
            w[t * K + k] = 0.2f + 0.8f * fabsf(krng_f());
        }
    }
    ids[0] = FIRST; ids[1] = FIRST + 1; ids[2] = FIRST + 2;   /* token 0 hits all local */
    for (int th = 1; th <= 3; th++) {
        struct backend *be = kref_backend(th, exact);

        for (int e = 0; e < NLOC; e++) {
            ASSERT_OK(backend_weight_prepare(be, &ex[e].gate));
            ASSERT_OK(backend_weight_prepare(be, &ex[e].up));
            ASSERT_OK(backend_weight_prepare(be, &ex[e].down));
        }
        memcpy(out[th - 1], base, sizeof(base));
        run(be, ex, x, ids, w, limit, out[th - 1]);
        if (th == 2) {
            memcpy(comp, base, sizeof(base));
            composed(be, ex, x, ids, w, limit, comp);
        }
        memcpy(seq, base, sizeof(base));
        per_expert(be, ex, x, ids, w, limit, seq);
        if (memcmp(out[th - 1], seq, sizeof(seq)) != 0)
            FAIL("moe fmt %d exact %d limit %g threads %d: differs from the op run one expert "
                 "at a time (scatter order is not expert, then token)", fmt, exact, limit, th);
        for (int e = 0; e < NLOC; e++) {
            backend_weight_release(be, &ex[e].gate);
            backend_weight_release(be, &ex[e].up);
            backend_weight_release(be, &ex[e].down);
        }
        backend_free(be);
    }
    ASSERT_TRUE(memcmp(out[0], out[1], sizeof(out[0])) == 0);
    ASSERT_TRUE(memcmp(out[0], out[2], sizeof(out[0])) == 0);

    for (int i = 0; i < T * H; i++) {
        ref[i] = base[i];
        mag[i] = 0;
    }
    ref_moe(ex, x, ids, w, limit, ref, mag);
    for (int i = 0; i < T * H; i++) {
        double tol = (exact ? 1e-5 : fmt == WFMT_MXFP4 ? 3e-2 : 2 * 0x1p-8 + 1e-5) * mag[i] + 1e-5;

        if (mag[i] > 0 && fabs(out[0][i] - ref[i]) / mag[i] > rel_max)
            rel_max = fabs(out[0][i] - ref[i]) / mag[i];
        if (!(fabs(out[0][i] - ref[i]) <= tol))
            FAIL("moe fmt %d exact %d limit %g: out[%d] = %.9g, ref %.9g, tol %.3g", fmt, exact,
                 limit, i, out[0][i], ref[i], tol);
        ASSERT_NEAR(out[0][i], comp[i], 1e-6 * mag[i] + 1e-6);
    }
    printf("moe fmt %d exact %d limit %g: max |out - ref| / sum|contributions| %.2e\n", fmt, exact,
           limit, rel_max);
    for (int e = 0; e < NLOC; e++) {
        kref_weight_free(&ex[e].gate);
        kref_weight_free(&ex[e].up);
        kref_weight_free(&ex[e].down);
    }
}

static void check_errors(void)
{
    struct moe_expert ex[NLOC];
    struct backend *be = kref_backend(2, false);
    float x[T * H] = { 0 }, w[T * K] = { 0 }, out[T * H] = { 0 };
    int32_t ids[T * K] = { 0 };
    struct moe_args a = { .x = x, .out = out, .n_tok = T, .hidden = H, .inter = I, .top_k = K,
                          .ids = ids, .weights = w, .experts = ex, .expert_first = FIRST,
                          .n_local = NLOC };

    make_experts(ex, WFMT_BF16);
    ids[4] = -3;
    ASSERT_ERR(backend_moe(be, &a), -EINVAL);
    ids[4] = 0;
    ex[1].down.rows = H - 1;
    ASSERT_ERR(backend_moe(be, &a), -EINVAL);
    ex[1].down.rows = H;
    ASSERT_OK(backend_moe(be, &a));
    for (int e = 0; e < NLOC; e++) {
        kref_weight_free(&ex[e].gate);
        kref_weight_free(&ex[e].up);
        kref_weight_free(&ex[e].down);
    }
    backend_free(be);
}

/* 16-row vs 4-row MXFP4 kernel inside the op: bit for bit (tiny model shapes). */
static void check_t16(void)
{
    enum { TH = 256, TI = 128, TE = 16, TK = 4, TT = 19 };
    static const int ns[] = { 1, 2, 4, 5, 16, 19 };
    static float x[TT * TH], w[TT * TK], o_old[TT * TH], o_new[TT * TH];
    static int32_t ids[TT * TK];
    struct moe_expert ex[TE];
    const bool have = cpu_isa_has(CPU_ISA_VNNI);

    ASSERT_EQ(cpu_mxfp4_row_align(NULL), have ? 16 : MXFP4_TILE_ROWS);
    krng_fill(x, TT * TH, 2.0f);
    for (int t = 0; t < TT; t++) {
        for (int k = 0; k < TK; k++) {
            bool dup;

            do {
                ids[t * TK + k] = (int32_t)(krng_u64() % TE);
                dup = false;
                for (int j = 0; j < k; j++)
                    dup |= ids[t * TK + j] == ids[t * TK + k];
            } while (dup);
            w[t * TK + k] = 0.1f + 0.2f * (float)k;
        }
    }
    for (int nth = 1; nth <= 2; nth++) {
        struct backend *be = kref_backend(nth, false);

        for (int e = 0; e < TE; e++) {
            ex[e].gate = kref_mxfp4_new(TI, TH, 118, 126);
            ex[e].up = kref_mxfp4_new(TI, TH, 118, 126);
            ex[e].down = kref_mxfp4_new(TH, TI, 118, 126);
            ASSERT_OK(backend_weight_prepare(be, &ex[e].gate));
            ASSERT_OK(backend_weight_prepare(be, &ex[e].up));
            ASSERT_OK(backend_weight_prepare(be, &ex[e].down));
        }
        for (size_t a = 0; a < ARRAY_SIZE(ns); a++) {
            for (int slice = 0; slice < 2; slice++) {
                struct moe_args ma = { .x = x, .n_tok = ns[a], .hidden = TH, .inter = TI,
                                       .top_k = TK, .ids = ids, .weights = w,
                                       .experts = slice ? ex + 4 : ex,
                                       .expert_first = slice ? 4 : 0, .n_local = slice ? 8 : TE,
                                       .limit = 7.0f };

                memset(o_old, 0, sizeof(o_old));
                memset(o_new, 0, sizeof(o_new));
                ma.out = o_old;
                cpu_mxfp4_t16_off = 1;
                ASSERT_OK(backend_moe(be, &ma));
                ma.out = o_new;
                cpu_mxfp4_t16_off = 0;
                ASSERT_OK(backend_moe(be, &ma));
                if (memcmp(o_old, o_new, sizeof(o_old)) != 0)
                    FAIL("moe t16: n=%d slice=%d threads=%d: 16-row and 4-row kernels differ",
                         ns[a], slice, nth);
            }
        }
        for (int e = 0; e < TE; e++) {
            backend_weight_release(be, &ex[e].gate);
            backend_weight_release(be, &ex[e].up);
            backend_weight_release(be, &ex[e].down);
            kref_weight_free(&ex[e].gate);
            kref_weight_free(&ex[e].up);
            kref_weight_free(&ex[e].down);
        }
        backend_free(be);
    }
}

int main(void)
{
    setenv("STEPD_CPU_MIN_WORK", "0", 0);   /* split every op over all threads */
    kt_isa_require("moe", CPU_ISA_SCALAR);
    krng_seed(99);
    check(WFMT_MXFP4, true, 0.0f);
    check(WFMT_MXFP4, true, 2.0f);
    check(WFMT_MXFP4, false, 0.0f);
    check(WFMT_MXFP4, false, 2.0f);
    check(WFMT_BF16, true, 0.0f);
    check(WFMT_BF16, true, 0.5f);
    check(WFMT_BF16, false, 0.0f);
    check(WFMT_BF16, false, 0.5f);
    check_errors();
    check_t16();
    printf("moe: all checks passed\n");
    return 0;
}
