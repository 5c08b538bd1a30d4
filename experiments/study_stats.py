"""
The study's statistics, from the runs' results (study.py's runs folder): the groups of seeds of
each configuration, the paired comparisons of configurations that differ in one factor, mean curves,
and issue 31's pre-registered tests (study_plan.K31_TESTS) with the plan's decision rule. Paired
intervals: experiments/stats.py. Nothing here runs or writes anything.
"""

import math
import statistics

import stats
from study_plan import K31_EXPLORE, K31_GEOMETRY, K31_TESTS, KEY_FIELDS, M4, M4_ITERS, M4_K, config_key, k31_cells, spec


def groups(results):
    """{config_key: {'spec': the configuration, 'train': {seed: final}, 'val': {...}, 'runs': [...]}} (train runs)."""
    out = {}
    for r in results:
        if r.get('kind') != 'train' or not r.get('train_loss') or r.get('regime') == 'pre':
            continue
        g = out.setdefault(
            config_key(r), {'spec': {k: r.get(k) for k in KEY_FIELDS}, 'train': {}, 'val': {}, 'runs': []}
        )
        g['train'][r['seed']] = r['train_loss'][-1]
        g['val'][r['seed']] = r['val_loss'][-1]
        g['runs'].append(r)
    return out


def other(s, **change):
    """The key of s's configuration with some fields changed (a full run has no state, K or gamma)."""
    d = {**s, **change, 'seed': 0, 'kind': 'train'}
    if d['method'] == 'full':
        d.update(state='na', K=0, gamma=0)
    return config_key(d)


def comparisons(G):
    """(label, key a, key b) for every pair of configurations present that differ in one factor of interest."""
    out = []
    for key in sorted(G):
        s = G[key]['spec']
        method, state = s['method'], s['state']
        cand = []
        if method == 'lisa_wor':
            cand += [
                ('lisa_wor - lisa', other(s, method='lisa')),
                ('lisa_wor - lisa_scale', other(s, method='lisa_scale')),  # both scaled: without replacement alone
                ('lisa_wor - lisa_wor_noscale', other(s, method='lisa_wor_noscale')),
                ('lisa_wor - full', other(s, method='full')),
            ]
            if state == 'keep':
                cand += [('keep - drop (lisa_wor)', other(s, state='drop'))]
            if state == 'offload':
                cand += [('offload - keep (lisa_wor)', other(s, state='keep'))]
            if s['sampling'] == 'rr':
                cand += [('rr - iid (lisa_wor)', other(s, sampling='iid'))]
            if s['n_layer'] == 4 and s['K'] != 10 and s['gamma'] == 2:
                cand += [
                    (f"lisa_wor K{s['K']} - lisa K10", other(s, method='lisa', K=10)),
                    (f"lisa_wor K{s['K']} - lisa_wor K10", other(s, K=10)),
                ]
        if method == 'lisa':
            cand += [('lisa - full', other(s, method='full'))]
            if state == 'keep':
                cand += [('keep - drop (lisa)', other(s, state='drop'))]
            if s['sampling'] == 'rr':
                cand += [('rr - iid (lisa)', other(s, sampling='iid'))]
        if method == 'lisa_scale':
            cand += [('lisa_scale - lisa', other(s, method='lisa'))]
        if method == 'lisa_wor_noscale':
            cand += [('lisa_wor_noscale - lisa', other(s, method='lisa'))]
        if method == 'tensor_wor':
            cand += [('tensor_wor - tensor_iid', other(s, method='tensor_iid'))]
        out += [(label, key, b) for label, b in cand if b in G]
    return out


def summarize(results):
    G = groups(results)
    pairs = [
        {
            'label': label,
            'a': a,
            'b': b,
            'train': stats.paired(G[a]['train'], G[b]['train']),
            'val': stats.paired(G[a]['val'], G[b]['val']),
        }
        for label, a, b in comparisons(G)
    ]
    rows = []
    for key, g in sorted(G.items()):
        rows.append(
            {
                'key': key,
                **g['spec'],
                'seeds': sorted(g['train']),
                'train': g['train'],
                'val': g['val'],
                'train_mean': statistics.fmean(g['train'].values()),
                'val_mean': statistics.fmean(g['val'].values()),
                'epochs': g['runs'][0].get('last_logged_epoch'),
                'max_iters': g['runs'][0]['eval_iters'][-1],
                'ms_per_iter': statistics.median(
                    [r['median_ms_per_iter'] for r in g['runs'] if r.get('median_ms_per_iter')] or [0]
                ),
                'wall_s': sum(r.get('wall_s') or 0 for r in g['runs']),
                'curve': curve(g['runs']),
            }
        )
    return rows, pairs


def curve(runs):
    runs = [r for r in runs if r['eval_iters'] == runs[0]['eval_iters']]
    return {
        'iters': runs[0]['eval_iters'],
        **{split: stats.band([r[split] for r in runs]) for split in ('train_loss', 'val_loss')},
    }


# -----------------------------------------------------------------------------
# issue 31: the plan's decision rule and its tests' values (the tests themselves: study_plan.py)

K31_MARGIN = 0.01  # an interval inside (-margin, +margin) refutes a predicted effect: "none that matters"
K31_MIN_SEEDS = 3  # a test with fewer complete seeds is reported as not run


def k31_d(G, cell, split='train'):
    """{seed: LISA-wor - LISA} of one cell, over the seeds that have both runs."""
    key = lambda m: config_key(spec(optimizer='adamw', method=m, **K31_GEOMETRY, **cell))  # noqa: E731
    a, b = G.get(key('lisa_wor'), {}).get(split, {}), G.get(key('lisa'), {}).get(split, {})
    return {seed: a[seed] - b[seed] for seed in sorted(set(a) & set(b))}


def slope(xs, ys):
    """The least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def contrast(G, kind, cells, split='train'):
    """Per-seed values of a contrast over the seeds every cell has: 'd' (one cell's D), 'dd' (D of
    the first cell - D of the second), 'slope' (the slope of D on log2 K over the cells)."""
    ds = [k31_d(G, c, split) for c in cells]
    seeds = sorted(set.intersection(*(set(d) for d in ds))) if ds else []
    if kind == 'd':
        return {s: ds[0][s] for s in seeds}
    if kind == 'dd':
        return {s: ds[0][s] - ds[1][s] for s in seeds}
    xs = [math.log2(c['K']) for c in cells]
    return {s: slope(xs, [d[s] for d in ds]) for s in seeds}


def verdict(lo, hi, sign, margin=K31_MARGIN):
    """The plan's rule: confirmed when the interval excludes 0 on the predicted side (sign -1: below,
    +1: above), refuted when it excludes 0 on the other side or lies inside (-margin, +margin),
    inconclusive otherwise."""
    if lo is None:
        return 'not run'
    if (sign < 0 and hi < 0) or (sign > 0 and lo > 0):
        return 'confirmed'
    if (sign < 0 and lo > 0) or (sign > 0 and hi < 0) or (-margin < lo and hi < margin):
        return 'refuted'
    return 'inconclusive'


def k31_tests(results):
    """The confirmatory tests and the exploratory contrasts (train loss, val beside), and every
    cell's D, from the runs present."""
    G = groups(results)

    def one(tid, claim, kind, cells, sign):
        row = {'id': tid, 'claim': claim, 'kind': kind, 'predicted': {-1: '< 0', 1: '> 0', 0: '-'}[sign]}
        for split in ('train', 'val'):
            v = contrast(G, kind, cells, split)
            n = len(v)
            ci = stats.interval(v.values()) if n >= K31_MIN_SEEDS else None
            ci99 = stats.interval(v.values(), 0.99) if n >= K31_MIN_SEEDS else None
            row[split] = {
                'n': n,
                'seeds': sorted(v),
                'values': [v[s] for s in sorted(v)],
                'mean': ci[0] if ci else None,
                'ci95': list(ci[1:]) if ci else None,
                'ci99': list(ci99[1:]) if ci99 else None,
            }
        ci = row['train']['ci95']
        row['verdict'] = verdict(*(ci or (None, None)), sign) if sign else 'exploratory'
        ci = row['train']['ci99']
        row['verdict_99'] = verdict(*(ci or (None, None)), sign) if sign else 'exploratory'
        return row

    tests = [one(*t) for t in K31_TESTS]
    explore = [one(*t) for t in K31_EXPLORE]
    cells = []
    for c in k31_cells():
        key = lambda m: config_key(spec(optimizer='adamw', method=m, **K31_GEOMETRY, **c))  # noqa: E731
        row = {'cell': c, 'lisa': key('lisa'), 'lisa_wor': key('lisa_wor')}
        for split in ('train', 'val'):
            row[split] = stats.paired(G.get(key('lisa_wor'), {}).get(split, {}), G.get(key('lisa'), {}).get(split, {}))
            row[f'{split}_means'] = {
                m: statistics.fmean(G[key(m)][split].values()) if key(m) in G else None for m in ('lisa', 'lisa_wor')
            }
        cells.append(row)
    return {'margin': K31_MARGIN, 'min_seeds': K31_MIN_SEEDS, 'tests': tests, 'exploratory': explore, 'cells': cells}


# -----------------------------------------------------------------------------
# which state policy the later stages run (--policy=auto): decided from earlier results


def resolve_policy(policy, results, stage=''):
    """'keep' or 'drop': the named one, or (auto) the one under which lisa_wor had the lower mean
    train loss in the multi-epoch AdamW stage of the same M (keep until it has run), in `results`."""
    if policy != 'auto':
        return policy
    G = groups(results)
    geoms = (
        [dict(n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS) for L, g in M4] if stage.startswith(('m4', 'ft')) else [{}]
    )
    means = {}
    for st in ('keep', 'drop'):
        vals = [
            v
            for geo in geoms
            for v in G.get(config_key(spec('multi', 'adamw', 'lisa_wor', st, **geo)), {'train': {}})['train'].values()
        ]
        if vals:
            means[st] = statistics.fmean(vals)
    return min(means, key=means.get) if len(means) == 2 else 'keep'


# -----------------------------------------------------------------------------
# the same runs run twice (another machine, a lost runs folder): how far their final losses differ


def agreement(results, earlier_rows):
    """Final losses of the train runs in `results` against an earlier report's rows (NAME.json's
    'rows': per configuration, {seed: final loss}), at the seeds both have: per split, how many
    runs, how many equal at the 4 decimals of the log, and the largest and mean absolute difference."""
    G, out = groups(results), {}
    for split in ('train', 'val'):
        diffs = [
            abs(G[row['key']][split][seed] - value)
            for row in earlier_rows
            if row['key'] in G
            for seed, value in ((int(s), v) for s, v in row[split].items())
            if seed in G[row['key']][split]
        ]
        out[split] = {
            'n': len(diffs),
            'equal_at_4_decimals': sum(d < 5e-5 for d in diffs),
            'max_abs': max(diffs, default=None),
            'mean_abs': statistics.fmean(diffs) if diffs else None,
        }
    return out
