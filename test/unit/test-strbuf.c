/* test-strbuf.c - strbuf: empty string before the first append, appends and printf grow
 * it (across many reallocations, with NULs inside), reset keeps the memory, take hands the
 * string over and leaves an empty buffer. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "strbuf.h"

int main(void)
{
    struct strbuf b = STRBUF_INIT;
    char *p;

    ASSERT_STREQ(strbuf_str(&b), "");
    ASSERT_OK(strbuf_adds(&b, "ab"));
    ASSERT_OK(strbuf_add(&b, "c\0d", 3));
    ASSERT_EQ(b.len, 5);
    ASSERT_TRUE(memcmp(b.p, "abc\0d", 6) == 0);
    for (int i = 0; i < 1000; i++)
        ASSERT_OK(strbuf_printf(&b, "%04d", i));
    ASSERT_EQ(b.len, 5 + 4000);
    ASSERT_TRUE(memcmp(b.p + 5 + 4 * 999, "0999", 5) == 0);
    strbuf_reset(&b);
    ASSERT_EQ(b.len, 0);
    ASSERT_STREQ(strbuf_str(&b), "");
    ASSERT_TRUE(b.cap > 4000);
    ASSERT_OK(strbuf_printf(&b, "%s=%d", "x", 7));
    p = strbuf_take(&b);
    ASSERT_STREQ(p, "x=7");
    ASSERT_TRUE(b.p == NULL && b.len == 0);
    free(p);
    p = strbuf_take(&b);
    ASSERT_STREQ(p, "");
    free(p);
    strbuf_done(&b);
    printf("strbuf: ok\n");
    return 0;
}
