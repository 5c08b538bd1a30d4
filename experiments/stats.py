"""
Paired statistics over seeds, shared by experiments/compare.py and experiments/study.py.

At one seed every configuration starts from the same weights, sees the same data order and is
evaluated on the same windows, so two configurations are compared by their per-seed differences:
mean, sample standard deviation, a 95% t interval (df = n - 1, any n >= 2), and the seeds each one
wins.

The Student-t quantile is computed, not looked up: the t distribution's CDF is the regularized
incomplete beta function, P(|T| > t) = I_x(df/2, 1/2) with x = df / (df + t^2) (Abramowitz and
Stegun 26.7.1 with 26.5.27), evaluated by its continued fraction (Numerical Recipes, betacf, with
Lentz's method) and inverted by bisection to double precision. t_quantile(0.975, 9) = 2.2622,
(0.975, 30) = 2.0423, (0.975, 1000) = 1.9623; tests/test_study.py checks these against the tables.
"""

import functools
import math
import statistics


def _betacf(a, b, x, eps=1e-15, max_iter=10_000):
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f'incomplete beta: continued fraction did not converge (a={a}, b={b}, x={x})')


def betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b), a, b > 0, 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f'betainc needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}')
    if x in (0.0, 1.0):
        return x
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):  # the fraction converges fast here; else use I_x(a, b) = 1 - I_{1-x}(b, a)
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t, df):
    """P(T <= t) for Student's t with df > 0 degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """The p quantile of Student's t with df > 0 degrees of freedom (any df, integer or not)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f't_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}')
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    # P(T > t) = 1 - p = I_x(df/2, 1/2) / 2 with x = df / (df + t^2): I_x rises with x, so bisect on x
    target, lo, hi = 2.0 * (1.0 - p), 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if betainc(df / 2.0, 0.5, mid) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-17 * max(hi, 1e-300):
            break
    x = 0.5 * (lo + hi)
    return math.sqrt(df * (1.0 - x) / x)


def t975(df):
    """Student's t 0.975 quantile (two-sided 95%) for df degrees of freedom."""
    return t_quantile(0.975, df)


def mean_std(values):
    """(mean, sample standard deviation; 0.0 for one value), (None, None) for none."""
    values = list(values)
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def interval(values, level=0.95):
    """(mean, lo, hi): the two-sided Student-t interval at `level` for the mean of `values`
    (df = n - 1); lo = hi = None for fewer than 2 values, None for none."""
    values = list(values)
    if not values:
        return None
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    half = t_quantile(0.5 + level / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def paired(a, b):
    """a, b: {seed: value} (lower is better). Differences a - b over the seeds both have: n,
    mean, sd, t = mean / (sd / sqrt(n)), the 95% t interval (any n >= 2; None for one seed),
    a_wins (seeds where a is lower) and significant (the interval excludes 0). None when no seed
    is shared."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    n = len(diffs)
    if n == 0:
        return None
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else None
    half = t975(n - 1) * sd / math.sqrt(n) if n > 1 else None
    return {
        'seeds': seeds,
        'diffs': diffs,
        'n': n,
        'mean': mean,
        'sd': sd,
        't': mean / (sd / math.sqrt(n)) if sd else None,
        'ci95': [mean - half, mean + half] if half is not None else None,
        'a_wins': sum(d < 0 for d in diffs),
        'significant': half is not None and (mean - half > 0 or mean + half < 0),
    }


def band(curves):
    """Mean, min and max over runs of curves sampled at the same points (lists of equal length)."""
    cols = list(zip(*curves))
    return {'mean': [statistics.fmean(c) for c in cols], 'min': [min(c) for c in cols], 'max': [max(c) for c in cols]}


def fmt_pair(p, nd=4):
    """'mean [lo, hi] *' (* when the interval excludes 0), '-' for none."""
    if p is None:
        return '-'
    ci = f"[{p['ci95'][0]:+.{nd}f}, {p['ci95'][1]:+.{nd}f}]" if p['ci95'] else '-'
    return f"{p['mean']:+.{nd}f} {ci}{' *' if p['significant'] else ''}"
