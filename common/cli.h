/* cli.h - command-line value parsing shared by the programs (stepd-worker, stepd-run,
 * stepd-inspect).  Errors are written into an err_buf naming the flag and the value, so
 * each program prints them with its own name. */
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Decimal integer in [lo, hi] -> *ret.  -EINVAL with "FLAG 'S': expected an integer in
 * [lo, hi]" otherwise. */
int cli_parse_int(const char *flag, const char *s, int lo, int hi, int *ret, struct err_buf *e);

/* A byte count: a decimal number (fraction allowed with a suffix) and an optional suffix
 * K, M, G, T (powers of 1000) or KiB/Ki, MiB/Mi, GiB/Gi, TiB/Ti (powers of 1024), B or
 * nothing for bytes, case-insensitive: "4GiB", "141G", "1.5g", "123456" -> *ret in
 * [lo, hi].  -EINVAL naming the flag and the value otherwise. */
int cli_parse_bytes(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *ret,
                    struct err_buf *e);

/* A decimal fraction in (lo, hi] -> *ret.  -EINVAL naming the flag otherwise. */
int cli_parse_fraction(const char *flag, const char *s, double lo, double hi, double *ret,
                       struct err_buf *e);

/* Comma-separated token ids "1,2,3" (leading spaces and one trailing newline allowed), each in
 * [0, vocab) (vocab <= 0: no upper bound) -> a malloc'd array the caller frees.  -EINVAL naming
 * the bad item, -ENOMEM. */
int cli_parse_ids(const char *flag, const char *s, int vocab, int32_t **ret, int *ret_n,
                  struct err_buf *e);

/* A KV cache dtype as vLLM spells it: "auto", "bf16", "bfloat16" -> false (BF16 rows, FP32
 * accumulation), "fp32", "float32" -> true.  -EINVAL naming the flag and what stepd stores
 * otherwise (fp8 and the other dtypes vLLM knows are not implemented). */
int cli_parse_kv_dtype(const char *flag, const char *s, bool *ret_f32, struct err_buf *e);

#ifdef __cplusplus
}
#endif
