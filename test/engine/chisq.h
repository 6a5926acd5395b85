/* chisq.h - chi-square goodness of fit for the statistical engine tests: statistic and
 * upper-tail p-value Q(df/2, x/2) (regularized incomplete gamma, series / continued
 * fraction as in Numerical Recipes §6.2). */
#pragma once

#include <math.h>

static double chisq__gser(double a, double x)
{
    double sum = 1.0 / a, del = sum, ap = a;
    for (int n = 0; n < 1000; n++) {
        ap += 1.0;
        del *= x / ap;
        sum += del;
        if (fabs(del) < fabs(sum) * 1e-15)
            break;
    }
    return sum * exp(-x + a * log(x) - lgamma(a));
}

static double chisq__gcf(double a, double x)
{
    double b = x + 1.0 - a, c = 1e300, d = 1.0 / b, h = d;
    for (int i = 1; i < 1000; i++) {
        double an = -i * (i - a);
        b += 2.0;
        d = an * d + b;
        if (fabs(d) < 1e-300)
            d = 1e-300;
        c = b + an / c;
        if (fabs(c) < 1e-300)
            c = 1e-300;
        d = 1.0 / d;
        double del = d * c;
        h *= del;
        if (fabs(del - 1.0) < 1e-15)
            break;
    }
    return exp(-x + a * log(x) - lgamma(a)) * h;
}

/* P(X >= x) for X ~ chi-square(df) */
static inline double chisq_pvalue(double x, int df)
{
    double a = df / 2.0, xx = x / 2.0;
    if (xx <= 0)
        return 1.0;
    if (xx < a + 1.0)
        return 1.0 - chisq__gser(a, xx);
    return chisq__gcf(a, xx);
}

/* Statistic over cells with expected count >= 5 (others pooled into one cell); writes
 * the degrees of freedom to *ret_df. */
static inline double chisq_stat(const long *obs, const double *expect, int n, int *ret_df)
{
    double x = 0.0, pool_o = 0.0, pool_e = 0.0;
    int cells = 0;
    for (int i = 0; i < n; i++) {
        if (expect[i] < 5.0) {
            pool_o += (double) obs[i];
            pool_e += expect[i];
            continue;
        }
        double d = (double) obs[i] - expect[i];
        x += d * d / expect[i];
        cells++;
    }
    if (pool_e > 0.0) {
        double d = pool_o - pool_e;
        x += d * d / (pool_e > 1e-9 ? pool_e : 1e-9);
        cells++;
    }
    *ret_df = cells - 1;
    return x;
}
