/* cli.h - command-line value parsing shared by the programs (stepd-worker, stepd-run,
 * stepd-inspect).  Errors are written into an err_buf naming the flag and the value, so
 * each program prints them with its own name. */
#pragma once

#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Decimal integer in [lo, hi] -> *ret.  -EINVAL with "FLAG 'S': expected an integer in
 * [lo, hi]" otherwise. */
int cli_parse_int(const char *flag, const char *s, int lo, int hi, int *ret, struct err_buf *e);

/* Comma-separated token ids "1,2,3" (leading spaces and one trailing newline allowed), each in
 * [0, vocab) (vocab <= 0: no upper bound) -> a malloc'd array the caller frees.  -EINVAL naming
 * the bad item, -ENOMEM. */
int cli_parse_ids(const char *flag, const char *s, int vocab, int32_t **ret, int *ret_n,
                  struct err_buf *e);

#ifdef __cplusplus
}
#endif
