/* matmul-amx.c - y = x · Wᵀ for BF16 weights on AMX-BF16 tiles, batch-invariant.
 *
 * Yᵀ = W·Xᵀ per block of 16 weight rows: the A tile is 16 weight rows x 32 BF16 values
 * loaded straight from the loader's memory (row stride cols * 2, no repack); the B tile
 * holds activations in VNNI layout (16 k-pairs x 16 columns x 2 BF16), packed once per
 * call by cpu_amx_act_pack(); the C tile is 16 rows x 16 columns of fp32.
 *
 * Activations are fp32.  Each x is split into three BF16 parts, p0 = bf16_rne(x),
 * p1 = bf16_rne(x - p0), p2 = bf16_rne(x - p0 - p1) (every subtraction exact in fp32), so
 * |x - p0 - p1 - p2| <= 2^-26 |x| and the products with a BF16 weight are as good as fp32
 * ones (two parts, 2^-17, measured 20x the AVX-512 kernel's error and failed the tiny-model
 * test's mean bound).  VCVTNE2PS2BF16 (AVX512-BF16, on every AMX CPU) rounds the parts.
 * Two B-tile layouts, both with each C column one fp32 accumulator updated by TDPBF16PS
 * once per k-step of 32 columns in increasing k from zero:
 *   - GROUP tiles: one B tile serves 5 tokens, part p of token t in column 5p + t (column
 *     15 zero); y = (C[m][t] + C[m][5 + t]) + C[m][10 + t].  One TDPBF16PS per A tile for
 *     1 to 5 tokens (the verify step of K = 3 drafts is 4 tokens).
 *   - PART tiles: a block of up to 16 tokens has three B tiles, B_p = part p of token t in
 *     column t, and three C tiles; y = (C_0[m][t] + C_1[m][t]) + C_2[m][t].  Three
 *     TDPBF16PS per A tile for up to 16 tokens (groups: four for 16), and the combine is
 *     zmm adds of whole C rows and one transpose instead of three.
 * TDPBF16PS computes C[m][n] from A row m, B column n and C[m][n] alone, in a fixed k
 * order, so a token's column gets the same fp32 sums in either layout and the outputs are
 * bit-identical.  A call of n tokens puts its full blocks of 16 (and a rest of 11 .. 15)
 * in part tiles and a smaller rest in groups (amx_layout).  So y[t, r] depends only on
 * weight row r and token row t - never on n, on the layout, on the other tokens, on the
 * row block r falls in, on the blocking of the passes, or on the thread that ran it: the
 * batch invariance the engine relies on (K = 0 vs K = 3 greedy equality, identical
 * requests = solo run).  The path is chosen from the weight and the CPU only
 * (cpu_bf16_use_amx), never from n.
 *
 * Row tails: a matrix with rows >= 16 has none - the last block starts at rows - 16 and
 * overlaps the previous one (each C row only depends on its own A row); only rows not yet
 * written are stored.
 *
 * Passes: one row block at a time, all its k-steps, for a part block (pass_g3; the last
 * one with the first group: pass_g4), then four, two or one groups sharing each A tile
 * (pass_g4, pass_g2, pass_g1); A and B tiles alternate between two tile registers per
 * k-step so the next loads overlap the running TDPBF16PS, and the A-tile lines a few k-steps
 * ahead (then the next block's) are prefetched into L1 - a tile load touches 16 rows, and
 * without it the weight stream stalls on each one.  Every tile is 16 rows x 64 bytes
 * (palette 1); each thread loads the configuration on its first call and keeps it (loading
 * and releasing it per call measured ~2 us per matmul).
 *
 * Fast path (cpu_bf16_fast: backend_cfg.mxfp4_exact off, docs/PERFORMANCE.md §8.4): one
 * part, p0 = bf16_rne(x), in ONE-PART tiles - a block of up to 16 tokens is one B tile per
 * k-step, token t in column t, and y = C[m][t].  One TDPBF16PS per A tile for up to 16
 * tokens (four for 64), a third of the exact path's; the passes, the prefetch and the row
 * blocking are the exact path's (pass_g4 .. pass_g1 over blocks instead of groups).  The
 * error is the activations' rounding, |err| <= 2^-8 · Σ|w·x| plus fp32 accumulation
 * (test-matmul).  A token's column gets the same fp32 sums in any block, pass and call,
 * so the one-part path is batch-invariant for the same reasons.
 *
 * Numerics of TDPBF16PS: BF16 products are exact in fp32; accumulation is fp32 with
 * round-to-nearest-even, input denormals treated as zero and denormal results flushed
 * (parts below 2^-126 count as 0, as VCVTNE2PS2BF16 makes denormal inputs: an absolute
 * error far below the tests' 1e-6 floor).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "log.h"
#include "cpu.h"

int cpu_amx_off;

#define AMX_PARTS 3             /* BF16 parts per activation (hi, mid, lo) */
#define AMX_GROUP (16 / AMX_PARTS)  /* tokens per B tile: part p of token t in column p * G + t */
#define AMX_KSTEP 32            /* BF16 values per A tile row */
#define AMX_TILE 1024           /* bytes of one 16 x 64-byte tile */
/* a rest of this many tokens past the full blocks of 16 goes to a (short) part block */
#define AMX_PART_REST 11
/* weight prefetch distance in k-steps (16 lines each) ahead of the running one */
#define AMX_PF_STEPS 4
/* the fast path's one-part tiles: 16 tokens each */
#define AMX_FAST_GROUP 16

int cpu_amx_pf_steps = AMX_PF_STEPS;

#if defined(__x86_64__)

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static bool amx_ok;
/* this thread has loaded the tile configuration (kept: see the header comment) */
static __thread bool amx_configured;

/* Level amx (cpu-features.h): the CPU has the tiles and the kernel granted their state. */
static void amx_detect(void)
{
    if (!cpu_isa_has(CPU_ISA_AMX))
        return;
    amx_ok = true;
    log_debug("cpu: AMX-BF16 matmul for BF16 weights");
}

bool cpu_amx_bf16_ok(void)
{
    pthread_once(&amx_once, amx_detect);
    return amx_ok;
}

bool cpu_bf16_use_amx(const struct bweight *w)
{
    return w->fmt == WFMT_BF16 && w->cols % AMX_KSTEP == 0 && w->cols > 0 && w->rows >= 16 &&
           !cpu_amx_off && cpu_amx_bf16_ok();
}

/* The B-tile layout of a call of n tokens: *ret_pb part blocks (tokens 16b .. 16b + 15, the
 * last one possibly short; B tiles 3b + p, p = part), then *ret_ng groups of AMX_GROUP tokens
 * from token 16 * pb (B tile 3 pb + g).  Full blocks of 16 go to part tiles (3 TDPBF16PS per
 * A tile instead of 4); a rest of AMX_PART_REST or more tokens too (3 either way, and one
 * combine instead of three); a smaller rest to groups (1 or 2). */
static void amx_layout(int n, int *ret_pb, int *ret_ng)
{
    int pb = n / 16, rest = n % 16;

    if (rest >= AMX_PART_REST) {
        pb++;
        rest = 0;
    }
    *ret_pb = pb;
    *ret_ng = (rest + AMX_GROUP - 1) / AMX_GROUP;
}

size_t cpu_amx_act_bytes(int n, int64_t cols, bool fast)
{
    int pb, ng;

    if (fast)
        return (size_t)((n + AMX_FAST_GROUP - 1) / AMX_FAST_GROUP) * (size_t)(cols / AMX_KSTEP) *
               AMX_TILE;
    amx_layout(n, &pb, &ng);
    return (size_t)(AMX_PARTS * pb + ng) * (size_t)(cols / AMX_KSTEP) * AMX_TILE;
}

#define AMX_FN CPU_FN_AMX
#define AMX_INLINE __attribute__((target(CPU_TARGET_AMX), always_inline)) static inline

/* v[k] word c <- v[c] word k (16 x 16 32-bit transpose) */
AMX_INLINE void transpose16(__m512i v[16])
{
    __m512i t[16], u[16];

    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* u[4i + j], 128-bit lane L: words 4L + j of rows 4i .. 4i + 3 */
    for (int j = 0; j < 4; j++) {
        __m512i s0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        __m512i s1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        __m512i s2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        __m512i s3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);

        v[0 + j] = _mm512_shuffle_i32x4(s0, s2, 0x88);
        v[4 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        v[8 + j] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        v[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
}

/* The three BF16 parts of 32 activations xk[0 .. 31] as VNNI pairs: part p into v[p * step].
 * x = part 0 + part 1 (+ part 2): each part the BF16 rounding of what the earlier ones left,
 * every subtraction exact in fp32.  VCVTNE2PS2BF16 rounds 32 values at once, in k order
 * (= the pair layout), to nearest even, NaN quietened, denormal inputs as zero (TDPBF16PS
 * ignores denormal parts anyway). */
AMX_INLINE void amx_split(const float *xk, __m512i *v, int step)
{
    const __m512i e = _mm512_set1_epi32(0x7f800000);
    __m512 x0 = _mm512_loadu_ps(xk), x1 = _mm512_loadu_ps(xk + 16);

    for (int p = 0; p < AMX_PARTS; p++) {
        const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
        __m512i f0, f1;

        v[p * step] = h;
        if (p == AMX_PARTS - 1)
            break;
        f0 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16);
        f1 = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16);
        /* an Inf or NaN part leaves nothing (not Inf - Inf = NaN) behind */
        x0 = _mm512_maskz_sub_ps(_mm512_cmpneq_epi32_mask(_mm512_and_si512(f0, e), e), x0,
                                 _mm512_castsi512_ps(f0));
        x1 = _mm512_maskz_sub_ps(_mm512_cmpneq_epi32_mask(_mm512_and_si512(f1, e), e), x1,
                                 _mm512_castsi512_ps(f1));
    }
}

/* v[c] = column c of a tile: transposed into its 16 rows (row p = pair p of every column) */
AMX_INLINE void amx_tile_put(uint8_t *tile, __m512i v[16])
{
    transpose16(v);
    for (int p = 0; p < 16; p++)
        _mm512_store_si512((void *)(tile + p * 64), v[p]);
}

/* The fast path's one-part tiles: tile b of k-step s, column t = bf16_rne of token 16b + t;
 * token blocks [b0, b1) */
AMX_INLINE void amx_act_pack1(uint8_t *out, const float *x, const int32_t *xidx, int n, int64_t cols, int b0,
                              int b1)
{
    const int64_t ks = cols / AMX_KSTEP;

    for (int b = b0; b < b1; b++) {
        const int nt = n - b * AMX_FAST_GROUP < AMX_FAST_GROUP ? n - b * AMX_FAST_GROUP : AMX_FAST_GROUP;
        const float *xs[AMX_FAST_GROUP];

        for (int t = 0; t < nt; t++) {
            int64_t i = b * AMX_FAST_GROUP + t;

            xs[t] = x + (xidx ? xidx[i] : i) * cols;
        }
        for (int64_t s = 0; s < ks; s++) {
            __m512i v[16];

            for (int t = 0; t < 16; t++)
                v[t] = t < nt ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xs[t] + s * AMX_KSTEP + 16),
                                                             _mm512_loadu_ps(xs[t] + s * AMX_KSTEP))
                              : _mm512_setzero_si512();
            amx_tile_put(out + (b * ks + s) * AMX_TILE, v);
        }
    }
}

int cpu_amx_act_blocks(int n, bool fast)
{
    int pb, ng;

    if (fast)
        return (n + AMX_FAST_GROUP - 1) / AMX_FAST_GROUP;
    amx_layout(n, &pb, &ng);
    return pb + ng;
}

AMX_FN void cpu_amx_act_pack_blocks(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols,
                                    bool fast, int i0, int i1)
{
    const int64_t ks = cols / AMX_KSTEP;
    uint8_t *out = buf;
    int pb, ng;

    if (fast) {
        amx_act_pack1(out, x, xidx, n, cols, i0, i1);
        return;
    }
    amx_layout(n, &pb, &ng);
    /* part blocks (items 0 .. pb - 1): tile 3b + p, column t = part p of token 16b + t */
    for (int b = i0; b < pb && b < i1; b++) {
        const int nt = n - b * 16 < 16 ? n - b * 16 : 16;
        const float *xs[16];

        for (int t = 0; t < nt; t++) {
            int64_t i = b * 16 + t;

            xs[t] = x + (xidx ? xidx[i] : i) * cols;
        }
        for (int64_t s = 0; s < ks; s++) {
            __m512i v[AMX_PARTS][16];

            for (int t = nt; t < 16; t++)
                for (int p = 0; p < AMX_PARTS; p++)
                    v[p][t] = _mm512_setzero_si512();
            for (int t = 0; t < nt; t++)
                amx_split(xs[t] + s * AMX_KSTEP, &v[0][t], 16);
            for (int p = 0; p < AMX_PARTS; p++)
                amx_tile_put(out + ((AMX_PARTS * b + p) * ks + s) * AMX_TILE, v[p]);
        }
    }
    /* groups (items pb .. pb + ng - 1): tile 3 pb + g, part p of token 16 pb + 5g + t in
     * column 5p + t */
    for (int g = i0 > pb ? i0 - pb : 0; g < ng && pb + g < i1; g++) {
        const int t0 = pb * 16 + g * AMX_GROUP;
        const int nt = n - t0 < AMX_GROUP ? n - t0 : AMX_GROUP;
        const float *xs[AMX_GROUP];

        for (int t = 0; t < nt; t++) {
            int64_t i = t0 + t;

            xs[t] = x + (xidx ? xidx[i] : i) * cols;
        }
        for (int64_t s = 0; s < ks; s++) {
            __m512i v[16];

            for (int c = 0; c < 16; c++)
                v[c] = _mm512_setzero_si512();
            for (int t = 0; t < nt; t++)
                amx_split(xs[t] + s * AMX_KSTEP, &v[t], AMX_GROUP);
            amx_tile_put(out + ((AMX_PARTS * pb + g) * ks + s) * AMX_TILE, v);
        }
    }
}

/* Software prefetch of the A-tile lines `dist` k-steps ahead: the rows of the block in
 * flight, then of the next blocks (a block's 16 rows are one contiguous region, so past
 * the k loop this walks into the next block).  Past the matrix end it only prefetches
 * addresses (prefetches never fault). */
struct amx_pf {
    uintptr_t base;         /* row 0 of the block `so` k-steps ahead refers to */
    int64_t so, ks, blk;    /* k-step within that block; k-steps; bytes per block */
};

AMX_INLINE void pf_init(struct amx_pf *p, const uint8_t *a, int64_t stride, int64_t ks, int dist)
{
    p->ks = ks;
    p->blk = 16 * stride;
    p->base = (uintptr_t)a + (uintptr_t)(dist / ks) * (uintptr_t)p->blk;
    p->so = dist % ks;
}

AMX_INLINE void pf_step(struct amx_pf *p, int64_t stride, bool on)
{
    if (!on)
        return;
    uintptr_t q = p->base + (uintptr_t)(p->so * 64);

    for (int r = 0; r < 16; r++, q += (uintptr_t)stride)
        _mm_prefetch((const char *)q, _MM_HINT_T0);
    if (++p->so == p->ks) {
        p->so = 0;
        p->base += (uintptr_t)p->blk;
    }
}

/* One row block (16 weight rows from a) x one group (b: ks packed tiles) -> C tile 0,
 * stored to c.  A and B tiles alternate 4/6 and 5/7 over k so the next loads overlap the
 * running TDPBF16PS.  The accumulation order is k-step 0, 1, ... in every variant. */
AMX_INLINE void pass_g1(const uint8_t *a, int64_t stride, const uint8_t *b, int64_t ks, float *c,
                        struct amx_pf *pf, bool pf_on)
{
    int64_t s = 0;

    _tile_zero(0);
    for (; s + 2 <= ks; s += 2) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + s * 64, stride);
        CPU_TILE_LOADD(6, b + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(5, a + (s + 1) * 64, stride);
        CPU_TILE_LOADD(7, b + (s + 1) * AMX_TILE, 64);
        _tile_dpbf16ps(0, 5, 7);
    }
    if (s < ks) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + s * 64, stride);
        CPU_TILE_LOADD(6, b + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 6);
    }
    _tile_stored(0, c, 64);
}

/* One row block x two groups (b0, b1) -> C tiles 0 and 1 (c, c + 256): each A tile feeds
 * both.  Tiles: A 4/5, B 2,3/6,7 alternating over k. */
AMX_INLINE void pass_g2(const uint8_t *a, int64_t stride, const uint8_t *b0, const uint8_t *b1,
                        int64_t ks, float *c, struct amx_pf *pf, bool pf_on)
{
    int64_t s = 0;

    _tile_zero(0);
    _tile_zero(1);
    for (; s + 2 <= ks; s += 2) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + s * 64, stride);
        CPU_TILE_LOADD(2, b0 + s * AMX_TILE, 64);
        CPU_TILE_LOADD(3, b1 + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 3);
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(5, a + (s + 1) * 64, stride);
        CPU_TILE_LOADD(6, b0 + (s + 1) * AMX_TILE, 64);
        CPU_TILE_LOADD(7, b1 + (s + 1) * AMX_TILE, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_dpbf16ps(1, 5, 7);
    }
    if (s < ks) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + s * 64, stride);
        CPU_TILE_LOADD(2, b0 + s * AMX_TILE, 64);
        CPU_TILE_LOADD(3, b1 + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 4, 3);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
}

/* One row block x three B tiles (a part block) -> C tiles 0-2: one A tile feeds three
 * TDPBF16PS; A alternates 3/4 over k so the next load overlaps, the B tiles are 5, 6, 7. */
AMX_INLINE void pass_g3(const uint8_t *a, int64_t stride, const uint8_t *const *b, int64_t ks,
                        float *c, struct amx_pf *pf, bool pf_on)
{
    int64_t s = 0;

    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (; s + 2 <= ks; s += 2) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(3, a + s * 64, stride);
        CPU_TILE_LOADD(5, b[0] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(6, b[1] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(7, b[2] + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(2, 3, 7);
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + (s + 1) * 64, stride);
        CPU_TILE_LOADD(5, b[0] + (s + 1) * AMX_TILE, 64);
        CPU_TILE_LOADD(6, b[1] + (s + 1) * AMX_TILE, 64);
        CPU_TILE_LOADD(7, b[2] + (s + 1) * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
    }
    if (s < ks) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(3, a + s * 64, stride);
        CPU_TILE_LOADD(5, b[0] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(6, b[1] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(7, b[2] + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 3, 5);
        _tile_dpbf16ps(1, 3, 6);
        _tile_dpbf16ps(2, 3, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
}

/* One row block x four groups -> C tiles 0-3: one A tile (from L2, the scarce bandwidth)
 * feeds four TDPBF16PS; the B tiles (L1) are 5, 6, 7 and 5 again. */
AMX_INLINE void pass_g4(const uint8_t *a, int64_t stride, const uint8_t *const *b, int64_t ks,
                        float *c, struct amx_pf *pf, bool pf_on)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < ks; s++) {
        pf_step(pf, stride, pf_on);
        CPU_TILE_LOADD(4, a + s * 64, stride);
        CPU_TILE_LOADD(5, b[0] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(6, b[1] + s * AMX_TILE, 64);
        CPU_TILE_LOADD(7, b[2] + s * AMX_TILE, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        CPU_TILE_LOADD(5, b[3] + s * AMX_TILE, 64);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
}

/* Scatter C tile c (rows = weight rows st .. st + 15, columns = the parts of a group's nt
 * tokens t0 ..: part p of token t in column p * grp + t) into y: rows [w0, w1) of the
 * block, each the sum (part 0 + part 1) + part 2 of its columns (parts = 3, grp =
 * AMX_GROUP), or its one column (the fast path's one-part tiles: parts = 1, grp = 16).
 * y[i * ldy + (r - r0)]. */
AMX_INLINE void amx_scatter(const float *c, int t0, int nt, int64_t st, int64_t w0, int64_t w1,
                            float *y, int64_t ldy, int64_t r0, const int parts, const int grp)
{
    const int d = (int)(w0 - st);
    const __mmask16 m = (__mmask16)((1u << (w1 - w0)) - 1);
    float *yb = y + (int64_t)t0 * ldy + (w0 - r0);

    if (nt <= 2) {
        /* few tokens: gather each token's part columns (same adds, fewer moves) */
        const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(16)), _mm512_set1_epi32(d * 16));

        for (int t = 0; t < nt; t++) {
            __m512 sum = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, c + t, 4);

            for (int p = 1; p < parts; p++)
                sum = _mm512_add_ps(sum, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx,
                                                                  c + p * grp + t, 4));
            _mm512_mask_storeu_ps(yb + t * ldy, m, sum);
        }
        return;
    }
    {
        __m512i v[16];

        for (int k = 0; k < 16; k++)
            v[k] = _mm512_load_si512((const void *)(c + k * 16));
        transpose16(v);
        for (int t = 0; t < nt; t++) {
            __m512 s = _mm512_castsi512_ps(v[t]);

            for (int p = 1; p < parts; p++)
                s = _mm512_add_ps(s, _mm512_castsi512_ps(v[p * grp + t]));

            if (d)       /* block overlapping the previous one: drop its first d rows */
                s = _mm512_permutexvar_ps(
                    _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                       13, 14, 15), _mm512_set1_epi32(d)), s);
            _mm512_mask_storeu_ps(yb + t * ldy, m, s);
        }
    }
}

/* Combine the C tiles c, c + 256, c + 512 of a part block (rows = weight rows st .. st + 15,
 * column t = part p of token t0 + t) into y: rows [w0, w1) of the block for its nt tokens,
 * each (part 0 + part 1) + part 2 - the group scheme's sum, in its order, so bit-identical -
 * added row by row in zmm before one transpose. */
AMX_INLINE void amx_combine(const float *c, int t0, int nt, int64_t st, int64_t w0, int64_t w1,
                            float *y, int64_t ldy, int64_t r0)
{
    const int d = (int)(w0 - st);
    const __mmask16 m = (__mmask16)((1u << (w1 - w0)) - 1);
    const __m512i sh = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                          12, 13, 14, 15), _mm512_set1_epi32(d));
    float *yb = y + (int64_t)t0 * ldy + (w0 - r0);
    __m512i v[16];

    for (int k = 0; k < 16; k++)
        v[k] = _mm512_castps_si512(_mm512_add_ps(_mm512_add_ps(_mm512_load_ps(c + k * 16),
                                                               _mm512_load_ps(c + 256 + k * 16)),
                                                 _mm512_load_ps(c + 512 + k * 16)));
    transpose16(v);
    for (int t = 0; t < nt; t++) {
        __m512 s = _mm512_castsi512_ps(v[t]);

        if (d)       /* block overlapping the previous one: drop its first d rows */
            s = _mm512_permutexvar_ps(sh, s);
        _mm512_mask_storeu_ps(yb + t * ldy, m, s);
    }
}

/* rows [r0, r1) of the C tiles of groups (exact path: parts = AMX_PARTS, grp = AMX_GROUP,
 * after pb part blocks) or one-part blocks (fast: parts = 1, grp = 16, pb = 0) */
AMX_INLINE void amx_rows(const struct bweight *w, const uint8_t *xp, int n, float *y, int64_t ldy,
                         int64_t r0, int64_t r1, const int parts, const int grp)
{
    const int64_t cols = w->cols, stride = cols * 2, ks = cols / AMX_KSTEP;
    const int64_t last = w->rows - 16, tb = ks * AMX_TILE;
    const int dist = cpu_amx_pf_steps;
    const uint8_t *wd = w->data;
    float c[4 * 256] __attribute__((aligned(64)));
    int pb, ng, gt0;

    if (!amx_configured) {
        static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};

        cpu_tile_config16(colsb);
        amx_configured = true;
    }
    if (parts == 1) {
        pb = 0;
        ng = (n + grp - 1) / grp;
    } else {
        amx_layout(n, &pb, &ng);
    }
    gt0 = pb * 16;          /* first token of the groups */
    for (int64_t b = r0; b < r1; b += 16) {
        const int64_t st = b < last ? b : last, hi = b + 16 < r1 ? b + 16 : r1;
        const uint8_t *a = wd + st * stride;
        const uint8_t *bg[4];
        struct amx_pf pf;
        bool first = true;  /* the block's rows stay in L1 for the later passes, so only
                             * the first one prefetches */
        int g = 0;

        pf_init(&pf, a, stride, ks, dist);
        /* part blocks, the last one with the first group if any (four TDPBF16PS per A tile) */
        for (int k = 0; k < pb; k++, first = false) {
            const int nt = n - k * 16 < 16 ? n - k * 16 : 16;

            for (int p = 0; p < AMX_PARTS; p++)
                bg[p] = xp + (AMX_PARTS * k + p) * tb;
            if (k == pb - 1 && ng > 0) {
                bg[3] = xp + AMX_PARTS * pb * tb;
                pass_g4(a, stride, bg, ks, c, &pf, dist && first);
                amx_scatter(c + 768, gt0, n - gt0 < grp ? n - gt0 : grp, st, b, hi, y, ldy, r0,
                            parts, grp);
                g = 1;
            } else {
                pass_g3(a, stride, bg, ks, c, &pf, dist && first);
            }
            amx_combine(c, k * 16, nt, st, b, hi, y, ldy, r0);
        }
        /* groups four, then three (one-part blocks) or two, then one at a time */
        while (g < ng) {
            const int m = ng - g >= 4 ? 4 : (parts == 1 && ng - g == 3 ? 3 : (ng - g >= 2 ? 2 : 1));

            for (int k = 0; k < m; k++)
                bg[k] = xp + (parts * pb + g + k) * tb;
            if (m == 4)
                pass_g4(a, stride, bg, ks, c, &pf, dist && first);
            else if (m == 3)
                pass_g3(a, stride, bg, ks, c, &pf, dist && first);
            else if (m == 2)
                pass_g2(a, stride, bg[0], bg[1], ks, c, &pf, dist && first);
            else
                pass_g1(a, stride, bg[0], ks, c, &pf, dist && first);
            for (int k = 0; k < m; k++) {
                const int t0 = gt0 + (g + k) * grp;

                amx_scatter(c + 256 * k, t0, n - t0 < grp ? n - t0 : grp, st, b, hi, y, ldy, r0,
                            parts, grp);
            }
            g += m;
            first = false;
        }
    }
}

AMX_FN void cpu_matmul_bf16_amx_rows(const struct bweight *w, const void *xb, int n, float *y,
                                     int64_t ldy, int64_t r0, int64_t r1, bool fast)
{
    if (fast)
        amx_rows(w, xb, n, y, ldy, r0, r1, 1, AMX_FAST_GROUP);
    else
        amx_rows(w, xb, n, y, ldy, r0, r1, AMX_PARTS, AMX_GROUP);
}

void cpu_amx_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols, bool fast)
{
    cpu_amx_act_pack_blocks(buf, x, xidx, n, cols, fast, 0, cpu_amx_act_blocks(n, fast));
}

/* Pack into this thread's buffer and run (callers without a per-call packed copy: moe). */
bool cpu_matmul_bf16_amx_self(const struct bweight *w, const float *x, const int32_t *xidx,
                              int n, float *y, int64_t ldy, int64_t r0, int64_t r1, bool fast)
{
    void *buf = cpu_thread_buf(cpu_amx_act_bytes(n, w->cols, fast));

    if (!buf)
        return false;
    cpu_amx_act_pack(buf, x, xidx, n, w->cols, fast);
    cpu_matmul_bf16_amx_rows(w, buf, n, y, ldy, r0, r1, fast);
    return true;
}

#else /* !__x86_64__ */

bool cpu_amx_bf16_ok(void)
{
    return false;
}

bool cpu_bf16_use_amx(const struct bweight *w)
{
    (void)w;
    return false;
}

size_t cpu_amx_act_bytes(int n, int64_t cols, bool fast)
{
    (void)n;
    (void)cols;
    (void)fast;
    return 0;
}

void cpu_amx_act_pack(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols, bool fast)
{
    (void)buf; (void)x; (void)xidx; (void)n; (void)cols; (void)fast;
}

int cpu_amx_act_blocks(int n, bool fast)
{
    (void)n;
    (void)fast;
    return 0;
}

void cpu_amx_act_pack_blocks(void *buf, const float *x, const int32_t *xidx, int n, int64_t cols, bool fast,
                             int i0, int i1)
{
    (void)buf; (void)x; (void)xidx; (void)n; (void)cols; (void)fast; (void)i0; (void)i1;
}

void cpu_matmul_bf16_amx_rows(const struct bweight *w, const void *xb, int n, float *y,
                              int64_t ldy, int64_t r0, int64_t r1, bool fast)
{
    (void)w; (void)xb; (void)n; (void)y; (void)ldy; (void)r0; (void)r1; (void)fast;
}

bool cpu_matmul_bf16_amx_self(const struct bweight *w, const float *x, const int32_t *xidx,
                              int n, float *y, int64_t ldy, int64_t r0, int64_t r1, bool fast)
{
    (void)w; (void)x; (void)xidx; (void)n; (void)y; (void)ldy; (void)r0; (void)r1; (void)fast;
    return false;
}

#endif
