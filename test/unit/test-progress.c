/* test-progress.c - the load progress line from byte counts and given elapsed times (no
 * clock): bytes done and total in GB/MB, the percentage, the rate since the start and the
 * time left at that rate; no rate (ETA ?) before a byte or a millisecond; the finished
 * load's duration and average rate. */
#include <stdio.h>
#include <string.h>

#include "harness.h"
#include "progress.h"

int main(void)
{
    char b[128];

    /* 3.1 of 9.4 GB after 4 s: 775 MB/s, (9.4 - 3.1) / 0.775 = 8.1 s left */
    progress_line(b, sizeof(b), 3100000000LL, 9400000000LL, 4000);
    ASSERT_STREQ(b, "3.1 GB of 9.4 GB (33%), 775 MB/s, ETA 8 s");
    progress_line(b, sizeof(b), 0, 9400000000LL, 0);
    ASSERT_STREQ(b, "0 B of 9.4 GB (0%), ETA ?");
    progress_line(b, sizeof(b), 5000000, 9400000000LL, 0);
    ASSERT_STREQ(b, "5 MB of 9.4 GB (0%), ETA ?");
    /* 120 GB at 100 MB/s: 1 GB done after 10 s, 119 GB left = 1190 s */
    progress_line(b, sizeof(b), 1000000000LL, 120000000000LL, 10000);
    ASSERT_STREQ(b, "1.0 GB of 120.0 GB (1%), 100 MB/s, ETA 19 min 50 s");
    progress_line(b, sizeof(b), 1000000000LL, 1000000000000LL, 1000);
    ASSERT_STREQ(b, "1.0 GB of 1000.0 GB (0%), 1.0 GB/s, ETA 16 min 39 s");
    progress_line(b, sizeof(b), 1000000LL, 100000000000LL, 10000);
    ASSERT_STREQ(b, "1 MB of 100.0 GB (0%), 100 kB/s, ETA 277 h 46 min");
    progress_line(b, sizeof(b), 9400000000LL, 9400000000LL, 10200);
    ASSERT_STREQ(b, "9.4 GB of 9.4 GB (100%), 922 MB/s, ETA 0 s");
    progress_done(b, sizeof(b), 9400000000LL, 10200);
    ASSERT_STREQ(b, "9.4 GB in 10.2 s (922 MB/s)");
    progress_done(b, sizeof(b), 1234, 0);
    ASSERT_STREQ(b, "1 kB in 0.0 s");
    progress_line(b, 12, 3100000000LL, 9400000000LL, 4000);      /* truncated, terminated */
    ASSERT_EQ(strlen(b), 11);
    printf("progress: ok\n");
    return 0;
}
