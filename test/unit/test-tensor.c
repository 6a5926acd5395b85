/* test-tensor.c - dtype table: every safetensors spelling round-trips, widths. */
#include <stdlib.h>

#include "harness.h"
#include "err.h"
#include "tensor.h"

int main(void)
{
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
