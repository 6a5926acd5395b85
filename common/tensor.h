/* tensor.h - dtypes and borrowed tensor views (value types shared by every layer). */
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TENSOR_MAX_DIMS 8

enum dtype {
    DTYPE_INVALID = 0,
    DTYPE_BOOL, DTYPE_U8, DTYPE_I8, DTYPE_F8_E5M2, DTYPE_F8_E4M3, DTYPE_I16, DTYPE_U16,
    DTYPE_F16, DTYPE_BF16, DTYPE_I32, DTYPE_U32, DTYPE_F32, DTYPE_F64, DTYPE_I64, DTYPE_U64,
    DTYPE_F8_E8M0, DTYPE_F4, DTYPE_F6_E2M3, DTYPE_F6_E3M2, DTYPE_C64,
    _DTYPE_MAX,
};

/* Bits per element (4 for F4, 6 for F6_*), 0 for DTYPE_INVALID. */
int dtype_bits(enum dtype t);
/* safetensors spelling ("BF16") <-> enum; dtype_parse returns DTYPE_INVALID if unknown. */
const char *dtype_name(enum dtype t);
enum dtype dtype_parse(const char *s);

/* A borrowed view of tensor data (mmap or a loader-owned buffer). Row-major. */
struct tview {
    enum dtype dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    const void *data;       /* may be unaligned: read with memcpy or unaligned loads */
    size_t nbytes;
};

static inline int64_t tview_numel(const struct tview *v)
{
    int64_t n = 1;
    for (int i = 0; i < v->ndim; i++)
        n *= v->shape[i];
    return n;
}

#ifdef __cplusplus
}
#endif
