/* tensor.c - dtype table (safetensors spellings and element widths). */
#include "tensor.h"

#include <string.h>

static const struct {
    const char *name;
    int bits;
} dtype_table[_DTYPE_MAX] = {
    [DTYPE_INVALID] = { "INVALID", 0 },
    [DTYPE_BOOL] = { "BOOL", 8 },
    [DTYPE_U8] = { "U8", 8 },
    [DTYPE_I8] = { "I8", 8 },
    [DTYPE_F8_E5M2] = { "F8_E5M2", 8 },
    [DTYPE_F8_E4M3] = { "F8_E4M3", 8 },
    [DTYPE_I16] = { "I16", 16 },
    [DTYPE_U16] = { "U16", 16 },
    [DTYPE_F16] = { "F16", 16 },
    [DTYPE_BF16] = { "BF16", 16 },
    [DTYPE_I32] = { "I32", 32 },
    [DTYPE_U32] = { "U32", 32 },
    [DTYPE_F32] = { "F32", 32 },
    [DTYPE_F64] = { "F64", 64 },
    [DTYPE_I64] = { "I64", 64 },
    [DTYPE_U64] = { "U64", 64 },
    [DTYPE_F8_E8M0] = { "F8_E8M0", 8 },
    [DTYPE_F4] = { "F4", 4 },
    [DTYPE_F6_E2M3] = { "F6_E2M3", 6 },
    [DTYPE_F6_E3M2] = { "F6_E3M2", 6 },
    [DTYPE_C64] = { "C64", 64 },
};

int dtype_bits(enum dtype t)
{
    if ((int) t <= DTYPE_INVALID || t >= _DTYPE_MAX)
        return 0;
    return dtype_table[t].bits;
}

const char *dtype_name(enum dtype t)
{
    if ((int) t < 0 || t >= _DTYPE_MAX)
        return "INVALID";
    return dtype_table[t].name;
}

enum dtype dtype_parse(const char *s)
{
    if (!s)
        return DTYPE_INVALID;
    for (int t = DTYPE_INVALID + 1; t < _DTYPE_MAX; t++)
        if (strcmp(s, dtype_table[t].name) == 0)
            return (enum dtype) t;
    return DTYPE_INVALID;
}
