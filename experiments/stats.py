"""
Paired statistics over seeds, shared by experiments/compare.py and experiments/study.py.

At one seed every configuration starts from the same weights, sees the same data order and is
evaluated on the same windows, so two configurations are compared by their per-seed differences:
mean, sample standard deviation, a 95% t interval (df = n - 1), and the seeds each one wins.
"""
import math
import statistics

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


def mean_std(values):
    """(mean, sample standard deviation; 0.0 for one value), (None, None) for none."""
    values = list(values)
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def paired(a, b):
    """a, b: {seed: value} (lower is better). Differences a - b over the seeds both have: n,
    mean, sd, t = mean / (sd / sqrt(n)), the 95% t interval, a_wins (seeds where a is lower) and
    significant (the interval excludes 0). None when no seed is shared."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    n = len(diffs)
    if n == 0:
        return None
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else None
    half = T975[n - 1] * sd / math.sqrt(n) if n > 1 and n - 1 in T975 else None
    return {'seeds': seeds, 'diffs': diffs, 'n': n, 'mean': mean, 'sd': sd,
            't': mean / (sd / math.sqrt(n)) if sd else None,
            'ci95': [mean - half, mean + half] if half is not None else None,
            'a_wins': sum(d < 0 for d in diffs), 'significant': half is not None and (mean - half > 0 or mean + half < 0)}


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
