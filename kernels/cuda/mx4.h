/* mx4.h - the MXFP4 tile layout the CUDA backend repacks routed-expert (and any MXFP4)
 * weights into once at load, and the in-register decode of its words to BF16.
 *
 * Source (the checkpoint, docs/MODEL.md §5): W [R, K], K % 32 == 0; packed [R, K/2] bytes
 * (element 2j in the low nibble), scale [R, K/32] E8M0 bytes.
 *
 * Layout: rows padded to Rp = 16·⌈R/16⌉, columns to Kp = 64·⌈K/64⌉ (padding: code 0 and
 * scale byte 0, i.e. 0.0).  Tile (rt, kt) = rows [16rt, 16rt+16) × k [64kt, 64kt+64),
 * tiles in row-tile-major order (t = rt·Kp/64 + kt).  Nibbles: 512 bytes per tile, lane l
 * (0..31) of the warp that reads it owns bytes [16l, 16l+16): one 16-byte load.  Its
 * word j (k-step j, k = 64kt + 16j + [0, 16)) holds the eight elements of the m16n8k16
 * A fragment (PTX mma.sync, BF16) of lane l, element i in nibble i:
 *     row = 16rt + l/4 + 8·((i >> 1) & 1),   k = 64kt + 16j + 2·(l % 4) + (i & 1) + 8·(i >> 2).
 * Read as the B operand (mma's n = weight rows), rows 0-7 of a tile are one n8 fragment
 * (nibbles 0, 1, 4, 5) and rows 8-15 the next (2, 3, 6, 7).  Scales: 32 bytes per tile;
 * lane l reads the 4 bytes [4q, 4q+4), q = l/4 (lanes of one q share them): E8M0 of
 * (row 16rt+q, group 2kt), (16rt+q, 2kt+1), (16rt+q+8, 2kt), (16rt+q+8, 2kt+1).
 *
 * Element i's code sits in word j where mx4_place puts it: placed (the default), its
 * sign and magnitude bits where a shift or two and a mask or two per register put them
 * into the fields of a BF16 (the value times 2^-126), the 2^126 folded into the stored
 * scale byte (mx4_scale_store: s + 126); with -DMX4_PRMT_DECODE, or for a matrix with an
 * E8M0 above 128 (not placeable), in nibble i, the scale byte as in the checkpoint: the
 * choice per matrix in a word after its scales (mx4_matrix_placed).
 *
 * Decode (mx4_word_bf16): placed, eleven shifts and logic ops a word; PRMT, codes to
 * exact BF16 E2M1 values {0, ±0.5, .., ±6} with nine byte permutes and a few logic ops
 * (no table in memory).  The stored scale is then applied by one BF16 multiply per
 * register (exact: a power of two times a 2-bit mantissa), except that scale byte 0 is
 * taken as 0; or, PRMT with one token tile, to the FP32 sum of each 32-k group
 * (mx4_scale_f32, docs/GPU.md §3).
 */
#pragma once

#include <stdint.h>
#include <string.h>

#include "hd.h"

/* The placed decode and its layout (MX4_PLACED, the default) or, built with
 * -DMX4_PRMT_DECODE, the byte-permute one (docs/GPU.md §3). */
#ifndef MX4_PRMT_DECODE
#define MX4_PLACED 1
#endif
#ifdef MX4_PLACED
#define MX4_PLACED_ON 1
#else
#define MX4_PLACED_ON 0
#endif

#define MX4_TILE_ROWS 16
#define MX4_TILE_K 64
#define MX4_TILE_NIB_BYTES 512
#define MX4_TILE_SCALE_BYTES 32

HD int64_t mx4_rows_padded(int64_t rows)
{
    return (rows + 15) / 16 * 16;
}

HD int64_t mx4_cols_padded(int64_t cols)
{
    return (cols + 63) / 64 * 64;
}

HD int64_t mx4_nib_bytes(int64_t rows, int64_t cols)
{
    return mx4_rows_padded(rows) * mx4_cols_padded(cols) / 2;
}

HD int64_t mx4_scale_bytes(int64_t rows, int64_t cols)
{
    return mx4_rows_padded(rows) * mx4_cols_padded(cols) / 32;
}

/* Whether the kernel's 32-bit offsets of its activation rows hold for x [x_rows, ldx]:
 * a row's offset in 8-element units plus a chunk of a stage (< 64) under 2^32 - 1 (the
 * value ~0 marks a missing token). */
HD int mx4_x_fits(int64_t x_rows, int64_t ldx)
{
    return x_rows >= 0 && ldx >= 0 && x_rows * (ldx / 8) + 64 < (int64_t) UINT32_MAX;
}

/* Row and column of element i (0..7) of word j (0..3) of lane l in tile (rt, kt). */
HD int64_t mx4_elem_row(int64_t rt, int l, int i)
{
    return 16 * rt + l / 4 + 8 * ((i >> 1) & 1);
}

HD int64_t mx4_elem_col(int64_t kt, int j, int l, int i)
{
    return 64 * kt + 16 * j + 2 * (l % 4) + (i & 1) + 8 * (i >> 2);
}

/* Where element (row, k) lives: byte offset into the nibble array of its word and its
 * element index in the word (mx4_code); and the offset of its scale byte. */
HD int64_t mx4_word_offset(int64_t cols, int64_t row, int64_t k, int *ret_i)
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t t = (row / 16) * kt_n + k / 64;
    int rr = (int)(row % 16), kk = (int)(k % 16), j = (int)((k % 64) / 16);
    int l = (rr % 8) * 4 + (kk % 8) / 2;
    int i = (kk & 1) + 2 * (rr >= 8) + 4 * (kk >= 8);

    *ret_i = i;
    return t * MX4_TILE_NIB_BYTES + l * 16 + j * 4;
}

HD int64_t mx4_scale_offset(int64_t cols, int64_t row, int64_t k)
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t t = (row / 16) * kt_n + k / 64;
    int rr = (int)(row % 16);

    return t * MX4_TILE_SCALE_BYTES + (rr % 8) * 4 + (rr >= 8) * 2 + (int)((k % 64) / 32);
}

/* Where element i (0..7) of a word keeps its code.  The word's register r = i / 2 holds
 * elements 2r (low half) and 2r + 1 (high half) as BF16.  PRMT decode: nibble i (bits
 * 4i..4i+3).  Placed: a code c = s e1 e0 m goes in as (c & 7) << MX4_MAG_BIT(r) and
 * s << MX4_SIGN_BIT(r) of its half.
 * Placed decode (MX4_PLACED): per half, register 0 at bits 6-8 and 15 (where BF16 wants
 * e1 e0 m and the sign: value times 2^-126, exact, code 1 a BF16 subnormal), register 1
 * at 0-2 and 9 (one shift left by 6 puts it there), register 2 at 3-5 and 13, register 3
 * at 10-12 and 14 (two shifts each: no four shifts of the pattern {6, 7, 8, 15} tile a
 * half, docs/GPU.md §3). */
#define MX4_MAG_BIT(r) (0x0A030006u >> (8 * (r)) & 0xFF)      /* placed */
#define MX4_SIGN_BIT(r) (0x0E0D090Fu >> (8 * (r)) & 0xFF)

HD uint32_t mx4_place_as(unsigned code, int i, int placed)
{
    int r = i / 2, h = 16 * (i & 1);

    if (!placed)
        return (uint32_t)code << (4 * i);
    return (uint32_t)(code & 7) << (MX4_MAG_BIT(r) + h) | (uint32_t)(code >> 3) << (MX4_SIGN_BIT(r) + h);
}

HD uint32_t mx4_place(unsigned code, int i)
{
    return mx4_place_as(code, i, MX4_PLACED_ON);
}

/* The code of element i of word w (the inverse of mx4_place_as). */
HD unsigned mx4_code_as(uint32_t w, int i, int placed)
{
    int r = i / 2, h = 16 * (i & 1);

    if (!placed)
        return (w >> (4 * i)) & 0xF;
    return (w >> (MX4_MAG_BIT(r) + h) & 7) | (w >> (MX4_SIGN_BIT(r) + h) & 1) << 3;
}

HD unsigned mx4_code(uint32_t w, int i)
{
    return mx4_code_as(w, i, MX4_PLACED_ON);
}

/* Code of source element (row, k), 0 in the padding. */
HD unsigned mx4_src_code(const uint8_t *packed, int64_t rows, int64_t cols, int64_t row, int64_t k)
{
    if (row >= rows || k >= cols)
        return 0;
    return (packed[row * (cols / 2) + k / 2] >> (4 * (k & 1))) & 0xF;
}

/* The scale byte as stored for E8M0 s: s (2^(s-127)); placed, s + 126 (2^(s-1): the
 * decoded values are 2^126 too small), s = 0 staying 0; s > 128 is not representable
 * (mx4_scale_placeable): such a matrix is stored with placed 0. */
HD unsigned mx4_scale_store_as(unsigned s, int placed)
{
    return placed && s != 0 ? s + 126 : s;
}

HD unsigned mx4_scale_store(unsigned s)
{
    return mx4_scale_store_as(s, MX4_PLACED_ON);
}

/* Whether E8M0 s can be stored placed (2^(s-1) must be a finite BF16, s <= 128; a matrix
 * with a larger scale is repacked in the nibble layout and read by the PRMT decode,
 * mx4_matrix_placed). */
HD int mx4_scale_placeable(unsigned s)
{
    return !MX4_PLACED_ON || s <= 128;
}

/* The E8M0 s of a stored scale byte (the inverse of mx4_scale_store). */
HD unsigned mx4_scale_e8m0_as(unsigned b, int placed)
{
    return placed && b != 0 ? b - 126 : b;
}

HD unsigned mx4_scale_e8m0(unsigned b)
{
    return mx4_scale_e8m0_as(b, MX4_PLACED_ON);
}

HD unsigned mx4_src_scale_as(const uint8_t *scale, int64_t rows, int64_t cols, int64_t row,
                             int64_t g, int placed)
{
    if (row >= rows || g >= cols / 32)
        return 0;
    return mx4_scale_store_as(scale[row * (cols / 32) + g], placed);
}

HD unsigned mx4_src_scale(const uint8_t *scale, int64_t rows, int64_t cols, int64_t row, int64_t g)
{
    return mx4_src_scale_as(scale, rows, cols, row, g, MX4_PLACED_ON);
}

/* The decode of one matrix as the backend prepared it (per matrix, docs/GPU.md §3): a
 * 32-bit word after its last tile's scales, at mx4_scale_bytes: 1 placed, 0 the nibble
 * layout and PRMT decode (any build with -DMX4_PRMT_DECODE; placed builds for a matrix
 * with a block scale above 2^1). */
HD int mx4_matrix_placed(const uint8_t *sc, int64_t rows, int64_t cols)
{
    return *(const uint32_t *)(sc + mx4_scale_bytes(rows, cols)) != 0;
}

/* The 16 nibble bytes (as 4 words) lane l of tile t reads, gathered from the source with
 * codes placed (mx4_place_as) or in nibbles (placed 0: PRMT, and NVFP4). */
HD void mx4_lane_words(const uint8_t *packed, int64_t rows, int64_t cols, int64_t t, int l,
                       int placed, uint32_t w[4])
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t rt = t / kt_n, kt = t % kt_n;

    for (int j = 0; j < 4; j++) {
        uint32_t v = 0;

        for (int i = 0; i < 8; i++)
            v |= mx4_place_as(mx4_src_code(packed, rows, cols, mx4_elem_row(rt, l, i),
                                           mx4_elem_col(kt, j, l, i)), i, placed);
        w[j] = v;
    }
}

/* The 16 nibble bytes (as 4 words) and the 4 scale bytes lane l of tile t reads, gathered
 * from the source: one thread's work in the repack kernel, one loop step of the host
 * repack.  Lanes with the same l/4 produce the same scale word. */
HD void mx4_lane_gather_as(const uint8_t *packed, const uint8_t *scale, int64_t rows,
                           int64_t cols, int64_t t, int l, int placed, uint32_t w[4],
                           uint32_t *ret_scale)
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t rt = t / kt_n, kt = t % kt_n;
    int q = l / 4;

    mx4_lane_words(packed, rows, cols, t, l, placed, w);
    *ret_scale = mx4_src_scale_as(scale, rows, cols, 16 * rt + q, 2 * kt, placed) |
                 mx4_src_scale_as(scale, rows, cols, 16 * rt + q, 2 * kt + 1, placed) << 8 |
                 mx4_src_scale_as(scale, rows, cols, 16 * rt + q + 8, 2 * kt, placed) << 16 |
                 mx4_src_scale_as(scale, rows, cols, 16 * rt + q + 8, 2 * kt + 1, placed) << 24;
}

HD void mx4_lane_gather(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t cols,
                        int64_t t, int l, uint32_t w[4], uint32_t *ret_scale)
{
    mx4_lane_gather_as(packed, scale, rows, cols, t, l, MX4_PLACED_ON, w, ret_scale);
}

/* Tables of the decode.  z(magnitude m) = iH << 4 | iL, the indices into T of the high
 * and low byte of BF16(E2M1 magnitude m); iH | 4 indexes the negative high byte.
 *   m:  0     1     2     3     4     5     6     7
 *   v:  0     0.5   1     1.5   2     3     4     6
 *   bf16 0000 3F00  3F80  3FC0  4000  4040  4080  40C0
 *   T = [00, 3F, 40, --, 80, BF, C0, --] */
#define MX4_Z_LO 0x16141000u
#define MX4_Z_HI 0x26242220u
#define MX4_T_LO 0x00403F00u
#define MX4_T_HI 0x00C0BF80u

/* The decode's four table words.  On the device each comes from an opaque move, so that
 * a kernel loads them into registers once outside its loop instead of the compiler
 * rematerialising them (a move from a uniform register) at every use. */
struct mx4_tab {
    uint32_t z_lo, z_hi, t_lo, t_hi;
};

HD uint32_t mx4_opaque(uint32_t v)
{
#ifdef __CUDA_ARCH__
    v ^= blockIdx.z;            /* 0: the kernels using it run 2-D grids */
#endif
    return v;
}

HD struct mx4_tab mx4_tables(void)
{
    struct mx4_tab t = { mx4_opaque(MX4_Z_LO), mx4_opaque(MX4_Z_HI), mx4_opaque(MX4_T_LO),
                         mx4_opaque(MX4_T_HI) };
    return t;
}

/* Word w (codes of elements 0..7 in nibbles 0..7) -> r[k] = BF16 pair (element 2k in the
 * low half, 2k+1 in the high half), exact E2M1 values, not yet scaled; tb: mx4_tables(). */
HD void mx4_word_bf16_prmt(uint32_t w, const struct mx4_tab *tb, uint32_t r[4])
{
    uint32_t m = w & 0x77777777u;
    uint32_t zl = hd_prmt(tb->z_lo, tb->z_hi, m);
    uint32_t zh = hd_prmt(tb->z_lo, tb->z_hi, m >> 16);
    uint32_t w4 = w << 4;
    /* 0xFF for a negative element: the sign of nibble 2b is bit 7 of byte b of w << 4,
     * of nibble 2b+1 bit 7 of byte b of w */
    uint32_t sl = hd_prmt(w4, w, 0xD9C8), sh = hd_prmt(w4, w, 0xFBEA);

    zl |= sl & 0x40404040u;
    zh |= sh & 0x40404040u;
    r[0] = hd_prmt(tb->t_lo, tb->t_hi, zl);
    r[1] = hd_prmt(tb->t_lo, tb->t_hi, zl >> 16);
    r[2] = hd_prmt(tb->t_lo, tb->t_hi, zh);
    r[3] = hd_prmt(tb->t_lo, tb->t_hi, zh >> 16);
}

/* The decode of the layout built (placed, or nibbles: mx4_word_bf16_prmt). */
HD void mx4_word_bf16_tab(uint32_t w, const struct mx4_tab *tb, uint32_t r[4])
{
#ifdef MX4_PLACED
    /* BF16 of value times 2^-126 (the scale bytes carry the 2^126, mx4_scale_store) */
    (void) tb;
    r[0] = w & 0x81C081C0u;
    r[1] = (w << 6) & 0x81C081C0u;
    r[2] = ((w << 3) & 0x01C001C0u) | ((w << 2) & 0x80008000u);
    r[3] = ((w >> 4) & 0x01C001C0u) | ((w << 1) & 0x80008000u);
#else
    mx4_word_bf16_prmt(w, tb, r);
#endif
}

HD void mx4_word_bf16(uint32_t w, uint32_t r[4])
{
    struct mx4_tab tb = { MX4_Z_LO, MX4_Z_HI, MX4_T_LO, MX4_T_HI };

    mx4_word_bf16_tab(w, &tb, r);
}

/* The BF16 pair (2^(s-127), 2^(s-127)) of scale byte `which` (0..3) of a lane's scale
 * word: the exponent field is s itself (s = 0 gives 0, see above). */
HD uint32_t mx4_scale_bf16x2(uint32_t scales, int which)
{
    uint32_t s = (scales >> (8 * which)) & 0xFF;

    return (s << 7) | (s << 23);
}

/* The four BF16 scale pairs of a lane's scale word (scale byte b in both halves of
 * sp[b]): a byte permute and a shift each. */
HD void mx4_scales_bf16x2(uint32_t scales, uint32_t sp[4])
{
    sp[0] = hd_prmt(scales, 0, 0x4040) << 7;    /* bytes s0, 0, s0, 0 */
    sp[1] = hd_prmt(scales, 0, 0x4141) << 7;
    sp[2] = hd_prmt(scales, 0, 0x4242) << 7;
    sp[3] = hd_prmt(scales, 0, 0x4343) << 7;
}

/* The FP32 value 2^(s-127) of scale byte `which` (0..3) of a lane's scale word, for a
 * kernel that scales the FP32 sums of a 32-k group instead of the BF16 weights (s = 0
 * gives 0, as above). */
/* The FP32 of bits u. */
HD float mx4_bits_f32(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;

    memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

HD float mx4_scale_f32(uint32_t scales, int which)
{
    return mx4_bits_f32(((scales >> (8 * which)) & 0xFF) << 23);
}

/* Which scale byte register k (0..3) of word j uses: rows l/4 (k = 0, 2) or l/4 + 8
 * (k = 1, 3), group j / 2 of the tile. */
HD int mx4_scale_which(int j, int k)
{
    return (k & 1) * 2 + j / 2;
}

/* Host repack of a whole matrix (tests, and the reference for the device kernel, which
 * runs mx4_lane_gather per (tile, lane)). */
HD void mx4_repack(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t cols,
                   uint8_t *nib, uint8_t *sc)
{
    int64_t n_tiles = mx4_rows_padded(rows) / 16 * (mx4_cols_padded(cols) / 64);

    for (int64_t t = 0; t < n_tiles; t++) {
        for (int l = 0; l < 32; l++) {
            uint32_t w[4], s;

            mx4_lane_gather(packed, scale, rows, cols, t, l, w, &s);
            for (int j = 0; j < 4; j++)
                for (int b = 0; b < 4; b++)
                    nib[t * MX4_TILE_NIB_BYTES + l * 16 + j * 4 + b] = (uint8_t)(w[j] >> (8 * b));
            if (l % 4 == 0)
                for (int b = 0; b < 4; b++)
                    sc[t * MX4_TILE_SCALE_BYTES + (l / 4) * 4 + b] = (uint8_t)(s >> (8 * b));
        }
    }
}

/* ---- NVFP4 in the tile layout (WFMT_NVFP4 weights; docs/GPU.md §3.1) ----
 * Source: nibbles [R, K/2] as MXFP4's, E4M3 scales [R, K/16] (one per 16 in-features) and
 * an FP32 global scale.  Nibbles: MXFP4's tiles with the codes in nibbles (element i of a
 * word in nibble i, mx4_word_bf16_prmt, whatever MX4_PLACED), so that one k-step of the
 * mma (16 k) is one scale group.  Scales: the E4M3 bytes as in the checkpoint, 64 bytes
 * per tile; lane l reads the 8 bytes [8q, 8q+8), q = l/4: byte g (0..3) of (row 16rt+q,
 * group 4kt+g), byte 4+g of (row 16rt+q+8, group 4kt+g).  After the last tile's scales,
 * at nv4_scale_bytes, the FP32 global scale (4 bytes), so that an expert's pointer
 * table carries it.  Padding: code 0, scale 0. */
#define NV4_TILE_SCALE_BYTES 64

HD int64_t nv4_scale_bytes(int64_t rows, int64_t cols)
{
    return mx4_rows_padded(rows) * mx4_cols_padded(cols) / 16;
}

HD int64_t nv4_scale_offset(int64_t cols, int64_t row, int64_t k)
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t t = (row / 16) * kt_n + k / 64;
    int rr = (int)(row % 16);

    return t * NV4_TILE_SCALE_BYTES + (rr % 8) * 8 + (rr >= 8) * 4 + (int)((k % 64) / 16);
}

HD unsigned nv4_code(uint32_t w, int i)
{
    return (w >> (4 * i)) & 0xF;
}

HD unsigned nv4_src_scale(const uint8_t *scale, int64_t rows, int64_t cols, int64_t row, int64_t g)
{
    if (row >= rows || g >= cols / 16)
        return 0;
    return scale[row * (cols / 16) + g];
}

/* Lane l of tile t: its 4 nibble words and its 8 scale bytes (s[0]: row q, s[1]: row q+8). */
HD void nv4_lane_gather(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t cols,
                        int64_t t, int l, uint32_t w[4], uint32_t s[2])
{
    int64_t kt_n = mx4_cols_padded(cols) / 64;
    int64_t rt = t / kt_n, kt = t % kt_n;
    int q = l / 4;

    mx4_lane_words(packed, rows, cols, t, l, 0, w);
    for (int h = 0; h < 2; h++) {
        s[h] = 0;
        for (int g = 0; g < 4; g++)
            s[h] |= nv4_src_scale(scale, rows, cols, 16 * rt + q + 8 * h, 4 * kt + g) << (8 * g);
    }
}

/* The E4M3 byte b as FP32 times 2^-120, exactly (bit placement; an E4M3 subnormal becomes
 * an FP32 subnormal): multiplied by 2^120 it is the scale.  0x7F / 0xFF (NaN) are refused
 * at load. */
HD float nv4_e4m3_f32_2m120(unsigned b)
{
    return mx4_bits_f32(((b & 0x80u) << 24) | ((b & 0x7Fu) << 20));
}

/* The FP32 scale of byte `which` (0..7) of a lane's two scale words. */
HD float nv4_scale_f32(uint32_t s_lo, uint32_t s_hi, int which)
{
    uint32_t w = which < 4 ? s_lo : s_hi;

    return nv4_e4m3_f32_2m120((w >> (8 * (which & 3))) & 0xFF) * 0x1p120f;
}

/* Host repack of a whole NVFP4 matrix (tests, and the reference of the device kernel). */
HD void nv4_repack(const uint8_t *packed, const uint8_t *scale, int64_t rows, int64_t cols,
                   uint8_t *nib, uint8_t *sc)
{
    int64_t n_tiles = mx4_rows_padded(rows) / 16 * (mx4_cols_padded(cols) / 64);

    for (int64_t t = 0; t < n_tiles; t++) {
        for (int l = 0; l < 32; l++) {
            uint32_t w[4], s[2];

            nv4_lane_gather(packed, scale, rows, cols, t, l, w, s);
            for (int j = 0; j < 4; j++)
                for (int b = 0; b < 4; b++)
                    nib[t * MX4_TILE_NIB_BYTES + l * 16 + j * 4 + b] = (uint8_t)(w[j] >> (8 * b));
            if (l % 4 == 0)
                for (int b = 0; b < 8; b++)
                    sc[t * NV4_TILE_SCALE_BYTES + (l / 4) * 8 + b] = (uint8_t)(s[b / 4] >> (8 * (b % 4)));
        }
    }
}
