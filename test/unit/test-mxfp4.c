/* test-mxfp4.c - E2M1/E8M0 codec: the docs/MODEL.md §5.3 worked examples, the code
 * table, the 255-scale corruption check, quantise->decode round trips, and the
 * nearest-grid-point choice against a plain search around every midpoint. */
#include <errno.h>
#include <math.h>

#include "harness.h"
#include "mxfp4.h"

/* The definition of the choice: the grid point at the least |a - g|, ties to even. */
static unsigned nearest_search(float a)
{
    static const float g[8] = { 0, 0.5f, 1, 1.5f, 2, 3, 4, 6 };
    unsigned best = 0;
    float best_d = INFINITY;

    for (unsigned i = 0; i < 8; i++) {
        float d = fabsf(a - g[i]);
        if (d < best_d || (d == best_d && (i & 1) == 0)) {
            best_d = d;
            best = i;
        }
    }
    return best;
}

int main(void)
{
    static const float table[16] = { 0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6 };
    uint8_t packed[16] = { 0 }, scale[1] = { 0x7e };
    float out[32], in[64], back[64];
    uint8_t p2[32], s2[2];

    for (unsigned c = 0; c < 16; c++)
        ASSERT_EQ(mxfp4_e2m1_value(c), table[c]);

    /* every midpoint and the 64 floats either side of it, the grid points, and a sweep */
    {
        static const float mid[7] = { 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f };
        for (int i = 0; i < 7; i++) {
            float lo = mid[i], hi = mid[i];
            for (int k = 0; k < 64; k++) {
                ASSERT_EQ(mxfp4_e2m1_nearest(lo), nearest_search(lo));
                ASSERT_EQ(mxfp4_e2m1_nearest(hi), nearest_search(hi));
                lo = nextafterf(lo, 0.0f);
                hi = nextafterf(hi, 6.0f);
            }
        }
        ASSERT_EQ(mxfp4_e2m1_nearest(0.25f), 0u);      /* ties to even */
        ASSERT_EQ(mxfp4_e2m1_nearest(0.75f), 2u);
        ASSERT_EQ(mxfp4_e2m1_nearest(5.0f), 6u);
        for (unsigned c = 0; c < 8; c++)
            ASSERT_EQ(mxfp4_e2m1_nearest(table[c]), c);
        for (int i = 0; i <= 600000; i++) {
            float a = 6.0f * (float)i / 600000.0f;
            ASSERT_EQ(mxfp4_e2m1_nearest(a), nearest_search(a));
        }
        ASSERT_EQ(mxfp4_e2m1_nearest(1e-40f), 0u);
    }
    ASSERT_EQ(mxfp4_e8m0_value(127), 1.0f);
    ASSERT_EQ(mxfp4_e8m0_value(0), ldexpf(1.0f, -127));
    ASSERT_TRUE(isnan(mxfp4_e8m0_value(255)));

    /* 0xB3 with scale 0x7E -> +0.75, -0.75 */
    packed[0] = 0xB3;
    ASSERT_OK(mxfp4_row_decode(packed, scale, 32, out));
    ASSERT_EQ(out[0], 0.75f);
    ASSERT_EQ(out[1], -0.75f);
    ASSERT_EQ(out[2], 0.0f);
    /* 0x70 with scale 0x81 -> 0, 24 */
    packed[0] = 0x70;
    scale[0] = 0x81;
    ASSERT_OK(mxfp4_row_decode(packed, scale, 32, out));
    ASSERT_EQ(out[0], 0.0f);
    ASSERT_EQ(out[1], 24.0f);

    scale[0] = 255;
    ASSERT_ERR(mxfp4_row_decode(packed, scale, 32, out), -EBADMSG);
    ASSERT_ERR(mxfp4_row_decode(packed, scale, 31, out), -EINVAL);
    ASSERT_ERR(mxfp4_row_quantize(in, 48, p2, s2), -EINVAL);

    /* values on the grid survive exactly; others within half a step */
    for (int i = 0; i < 32; i++)
        in[i] = table[i % 16] * 4.0f;
    for (int i = 32; i < 64; i++)
        in[i] = sinf((float) i) * 0.3f;
    ASSERT_OK(mxfp4_row_quantize(in, 64, p2, s2));
    ASSERT_EQ(s2[0], 127 + 2);
    ASSERT_OK(mxfp4_row_decode(p2, s2, 64, back));
    for (int i = 0; i < 32; i++)
        ASSERT_EQ(back[i], in[i]);
    for (int i = 32; i < 64; i++)
        ASSERT_NEAR(back[i], in[i], mxfp4_e8m0_value(s2[1]) * 1.0f + 1e-7);
    /* zero block */
    for (int i = 0; i < 32; i++)
        in[i] = 0;
    ASSERT_OK(mxfp4_row_quantize(in, 32, p2, s2));
    ASSERT_OK(mxfp4_row_decode(p2, s2, 32, back));
    for (int i = 0; i < 32; i++)
        ASSERT_EQ(back[i], 0.0f);
    return 0;
}
