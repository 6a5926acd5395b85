/* mxfp4.c - see mxfp4.h. Reference code; mxfp4_row_quantize also re-quantises MTP draft
 * weights at load (model.c), where it runs over every weight of the draft layers. */
#include "mxfp4.h"

#include <errno.h>
#include <math.h>

static const float e2m1_table[8] = { 0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f };

float mxfp4_e2m1_value(unsigned code)
{
    float v = e2m1_table[code & 7];
    return (code & 8) ? -v : v;
}

float mxfp4_e8m0_value(uint8_t byte)
{
    if (byte == 255)
        return NAN;
    return ldexpf(1.0f, (int) byte - 127);
}

int mxfp4_row_decode(const uint8_t *packed, const uint8_t *scale, int64_t k, float *out)
{
    if (k <= 0 || k % MXFP4_GROUP)
        return -EINVAL;
    for (int64_t g = 0; g < k / MXFP4_GROUP; g++) {
        float s;
        if (scale[g] == 255)
            return -EBADMSG;
        s = mxfp4_e8m0_value(scale[g]);
        for (int j = 0; j < MXFP4_GROUP / 2; j++) {
            uint8_t b = packed[g * (MXFP4_GROUP / 2) + j];
            out[g * MXFP4_GROUP + 2 * j] = mxfp4_e2m1_value(b & 0xF) * s;
            out[g * MXFP4_GROUP + 2 * j + 1] = mxfp4_e2m1_value(b >> 4) * s;
        }
    }
    return 0;
}

/* Nearest E2M1 magnitude index for a = |x| / scale in [0, 6], ties to the even index:
 * the midpoints between grid neighbours, taken with > where the lower neighbour has the
 * even index and with >= where the upper one has.  The same choice as the minimum of
 * |a - grid[i]| over the grid (test-mxfp4 checks both around every midpoint): near a
 * midpoint both differences are exact (Sterbenz), so a tie in float is a tie in fact. */
unsigned mxfp4_e2m1_nearest(float a)
{
    return (unsigned)(a > 0.25f) + (unsigned)(a >= 0.75f) + (unsigned)(a > 1.25f) +
           (unsigned)(a >= 1.75f) + (unsigned)(a > 2.5f) + (unsigned)(a >= 3.5f) +
           (unsigned)(a > 5.0f);
}

int mxfp4_row_quantize(const float *in, int64_t k, uint8_t *packed, uint8_t *scale)
{
    if (k <= 0 || k % MXFP4_GROUP)
        return -EINVAL;
    for (int64_t g = 0; g < k / MXFP4_GROUP; g++) {
        const float *x = in + g * MXFP4_GROUP;
        float amax = 0.0f, s;
        int ex;

        for (int i = 0; i < MXFP4_GROUP; i++)
            if (isfinite(x[i]) && fabsf(x[i]) > amax)
                amax = fabsf(x[i]);
        if (amax < 1e-30f) {
            scale[g] = 0;
            for (int j = 0; j < MXFP4_GROUP / 2; j++)
                packed[g * (MXFP4_GROUP / 2) + j] = 0;
            continue;
        }
        ex = (int) floorf(log2f(amax / 6.0f));
        if (amax / ldexpf(1.0f, ex) > 6.0f)
            ex++;
        if (ex < -127)
            ex = -127;
        if (ex > 127)
            ex = 127;
        scale[g] = (uint8_t) (ex + 127);
        s = ldexpf(1.0f, ex);
        for (int j = 0; j < MXFP4_GROUP / 2; j++) {
            unsigned c[2];
            for (int h = 0; h < 2; h++) {
                float v = x[2 * j + h];
                if (!isfinite(v))
                    v = 0.0f;
                c[h] = mxfp4_e2m1_nearest(fminf(fabsf(v) / s, 6.0f)) | (v < 0 ? 8u : 0u);
            }
            packed[g * (MXFP4_GROUP / 2) + j] = (uint8_t) (c[0] | (c[1] << 4));
        }
    }
    return 0;
}
