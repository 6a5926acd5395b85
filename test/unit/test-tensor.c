/* test-tensor.c - dtype table: every safetensors spelling round-trips, widths; the E4M3
 * codec and the FP8 block / NVFP4 quantisers (docs/MODEL.md §5.6, §5.7). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"
#include "err.h"
#include "tensor.h"

/* E4M3: the documented points, every finite code round-trips, midpoints go to the even
 * code, saturation at 448, NaN codes */
static void test_e4m3(void)
{
    ASSERT_EQ(fp8_e4m3_value(0x38), 1.0f);
    ASSERT_EQ(fp8_e4m3_value(0x7e), 448.0f);
    ASSERT_EQ(fp8_e4m3_value(0xfe), -448.0f);
    ASSERT_EQ(fp8_e4m3_value(0x08), ldexpf(1, -6));
    ASSERT_EQ(fp8_e4m3_value(0x01), ldexpf(1, -9));
    ASSERT_EQ(fp8_e4m3_value(0x3d), 1.625f);
    ASSERT_TRUE(isnan(fp8_e4m3_value(0x7f)) && isnan(fp8_e4m3_value(0xff)));
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f || b == 0x80)
            continue;
        ASSERT_EQ(fp8_e4m3_nearest(fp8_e4m3_value((uint8_t) b)), b);
        if ((b & 0x7f) < 0x7e) {
            /* the midpoint to the next magnitude: the even code of the two */
            float lo = fp8_e4m3_value((uint8_t) b), hi = fp8_e4m3_value((uint8_t) (b + 1));
            uint8_t got = fp8_e4m3_nearest((lo + hi) / 2);
            ASSERT_EQ(got, (b & 1) ? b + 1 : b);
            ASSERT_EQ(fp8_e4m3_nearest(lo + (hi - lo) * 0.25f), b);
            ASSERT_EQ(fp8_e4m3_nearest(lo + (hi - lo) * 0.75f), b + 1);
        }
    }
    ASSERT_EQ(fp8_e4m3_nearest(1e9f), 0x7e);
    ASSERT_EQ(fp8_e4m3_nearest(-500.0f), 0xfe);
    ASSERT_EQ(fp8_e4m3_nearest(NAN), 0x7f);
    ASSERT_EQ(fp8_e4m3_nearest(-0.0f), 0x80);
}

/* The quantisers: values on the grid come back exactly, a bad shape is refused */
static void test_quantisers(void)
{
    float w[4 * 8], s[2 * 2], row[32], back[32];
    uint8_t codes[4 * 8], packed[16], sc[2];

    /* block 2 x 4, amax 448 x 2^-3 in every block: scale_inv 2^-3, codes exact */
    for (int i = 0; i < 32; i++)
        w[i] = fp8_e4m3_value((uint8_t) ((i * 37) % 0x7e)) / 8.0f * ((i & 1) ? -1.0f : 1.0f);
    for (int bl = 0; bl < 4; bl++)
        w[(bl / 2) * 2 * 8 + (bl % 2) * 4] = 56.0f;   /* 448 / 8 */
    ASSERT_OK(fp8_block_quantize(w, 4, 8, 2, 4, codes, s));
    for (int i = 0; i < 4; i++)
        ASSERT_EQ(s[i], 0.125f);
    for (int i = 0; i < 32; i++)
        ASSERT_EQ(fp8_e4m3_value(codes[i]) * s[(i / 16) * 2 + (i % 8) / 4], w[i]);
    ASSERT_ERR(fp8_block_quantize(w, 4, 8, 3, 4, codes, s), -EINVAL);
    w[5] = NAN;
    ASSERT_ERR(fp8_block_quantize(w, 4, 8, 2, 4, codes, s), -EINVAL);

    /* NVFP4: E2M1 points x 2 per group (group amax 6 x 2 = 12), global scale 12 / (6 * 448) */
    for (int i = 0; i < 32; i++)
        row[i] = (float) ((i % 7) - 3) * 0.5f * 2.0f;
    row[3] = 12.0f;
    row[20] = -12.0f;
    ASSERT_EQ(nvfp4_global_scale(row, 32), 12.0f / (6.0f * 448.0f));
    ASSERT_OK(nvfp4_row_quantize(row, 32, 12.0f / (6.0f * 448.0f), packed, sc));
    ASSERT_EQ(sc[0], 0x7e);   /* 448 */
    ASSERT_OK(nvfp4_row_decode(packed, sc, 12.0f / (6.0f * 448.0f), 32, back));
    for (int i = 0; i < 32; i++)
        ASSERT_TRUE(fabsf(back[i] - row[i]) <= 1e-6f * 12.0f);
    ASSERT_EQ(packed[1] & 0xf, 0x9);   /* element 2: -1 = -0.5 x 2, low nibble */
    ASSERT_EQ(packed[1] >> 4, 0x7);    /* element 3: 12 = 6 x 2, high nibble */
    ASSERT_ERR(nvfp4_row_quantize(row, 24, 1.0f, packed, sc), -EINVAL);
    ASSERT_ERR(nvfp4_row_decode(packed, sc, 1.0f, 8, back), -EINVAL);
    sc[1] = 0x7f;
    ASSERT_ERR(nvfp4_row_decode(packed, sc, 1.0f, 32, back), -EBADMSG);
    ASSERT_EQ(nvfp4_global_scale(row, 0), 1.0f);
}

int main(void)
{
    test_e4m3();
    test_quantisers();
    static const char *const names[] = { "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
                                         "I32", "U32", "F32", "F64", "I64", "U64", "F8_E8M0", "F4", "F6_E2M3",
                                         "F6_E3M2", "C64" };
    for (size_t i = 0; i < ARRAY_SIZE(names); i++) {
        enum dtype t = dtype_parse(names[i]);
        ASSERT_NE(t, DTYPE_INVALID);
        ASSERT_STREQ(dtype_name(t), names[i]);
        ASSERT_TRUE(dtype_bits(t) > 0);
    }
    ASSERT_EQ(dtype_parse("bf16"), DTYPE_INVALID);
    ASSERT_EQ(dtype_parse(NULL), DTYPE_INVALID);
    ASSERT_EQ(dtype_bits(DTYPE_BF16), 16);
    ASSERT_EQ(dtype_bits(DTYPE_F4), 4);
    ASSERT_EQ(dtype_bits(DTYPE_F6_E2M3), 6);
    ASSERT_EQ(dtype_bits(DTYPE_INVALID), 0);
    ASSERT_EQ(dtype_bits((enum dtype) 999), 0);
    return 0;
}
