/* add.c - residual add, y += x. */
#include "cpu.h"

int cpu_add(struct backend *be, float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
    return 0;
}
