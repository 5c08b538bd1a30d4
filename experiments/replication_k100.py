"""
Issue 42: the K = 100 replication. The plan, the decision rule and the power calculation are in
results/replication_k100_plan.md, written (and copied into the frozen copy the runs came from)
before any of its runs; this file is that plan as code: which runs, in which order, and the
statistics the plan names.

The runs are issue 31's K = 100 cells exactly (study_plan.spec('paper', 'adamw', METHOD, STATE,
n_layer=12, gamma=3, K=100, iters=10_000): the k31_k100 and k31_k100_drop stages' specs, the same
run names), launched through experiments/study.py's launcher and runner.run_all (resumable: a run
with a result.json and no error is skipped), one run at a time (--jobs=2: a pair's two runs side
by side), one thread each. Order:
1. reproduction: the study's seeds 100, 101, 102 under keep (LISA, LISA-wor);
2. fresh seeds 1000..1033, seed-major: keep LISA, keep LISA-wor, drop LISA, drop LISA-wor;
3. reproduction under drop: seeds 100, 101, 102 (last: the lowest priority).
Both runs of a (seed, state) pair run back to back; --stop_at starts no pair after its time.

    # the runs (from a frozen copy; again with the same arguments to resume)
    python experiments/replication_k100.py --runs_dir=/work/k100_runs/runs
    # the report: paired 95% intervals, win counts, per-seed values, the verdicts, the combined
    # answer with the 6 earlier fresh seeds, and the reproduction of seeds 100-102
    python experiments/replication_k100.py --report_only=True --runs_dir=/work/k100_runs/runs --report_dir=results
    # again from the JSON the report keeps (no runs folder needed)
    python experiments/replication_k100.py --report_only=True --runs_from=results/replication_k100.json
    # the plan's power numbers
    python experiments/replication_k100.py --power=True
"""

import functools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402
import stats  # noqa: E402
import study  # noqa: E402
import study_plan  # noqa: E402
from study_plan import run_name, spec  # noqa: E402

from configurator import at_least, between, command_line  # noqa: E402

# -----------------------------------------------------------------------------
# the plan (results/replication_k100_plan.md)

GEOMETRY = dict(regime='paper', optimizer='adamw', n_layer=12, gamma=3, K=100, iters=10_000)
METHODS = ('lisa', 'lisa_wor')
STATES = ('keep', 'drop')  # keep: the primary cell; drop: beside it (secondary)
REPRO_SEEDS = (100, 101, 102)  # the study's (issue 31) seeds, re-run to check this machine reproduces them
FIRST_SEED, N_SEEDS = 1000, 34  # fresh seeds 1000..1033 (never used before)
# the 6 fresh seeds issue 42 reports (K = 100, keep, LISA-wor - LISA final train loss, as printed
# there, 3 decimals; their seed numbers and val values per seed are not recorded in the repository)
EARLIER_FRESH = (-0.022, -0.016, -0.040, +0.018, +0.003, +0.047)
STUDY_JSON = os.path.join(ROOT, 'results', 'study_k31.json')
STUDY_ESTIMATE = -0.0230  # issue 31's H3: -0.0230 [-0.0428, -0.0033], 7/10 seeds
MARGIN = 0.015  # refuted: the 95% interval rules out a LISA-wor win of MARGIN or more (the effect powered for)
POWER_EFFECT, POWER_SD = 0.015, 0.03  # the design: 80% power for D = -0.015 at sd 0.03, 5% two-sided
MIN_SEEDS = 3  # fewer complete pairs: no interval, no verdict (as the study)
EQUAL = 5e-5  # "equal at 4 decimals", the study's criterion for a run that reproduces


def cell_spec(state, method, seed):
    return spec(
        GEOMETRY['regime'],
        GEOMETRY['optimizer'],
        method,
        state,
        K=GEOMETRY['K'],
        gamma=GEOMETRY['gamma'],
        seed=seed,
        n_layer=GEOMETRY['n_layer'],
        iters=GEOMETRY['iters'],
    )


def fresh_seeds(n_seeds=N_SEEDS):
    return list(range(FIRST_SEED, FIRST_SEED + n_seeds))


def plan_specs(n_seeds=N_SEEDS):
    """Every run of the plan, in the order it runs."""
    out = [cell_spec('keep', m, s) for s in REPRO_SEEDS for m in METHODS]
    out += [cell_spec(st, m, s) for s in fresh_seeds(n_seeds) for st in STATES for m in METHODS]
    return out + [cell_spec('drop', m, s) for s in REPRO_SEEDS for m in METHODS]


def pairs_of(specs):
    """specs as consecutive (seed, state) pairs: the units a stop never splits."""
    out = []
    for s in specs:
        if out and (out[-1][0]['seed'], out[-1][0]['state']) == (s['seed'], s['state']):
            out[-1].append(s)
        else:
            out.append([s])
    return out


# -----------------------------------------------------------------------------
# running


def frozen_label():
    """What this copy of the code is: FROZEN_FROM (a file the frozen copy carries), else the git HEAD."""
    path = os.path.join(ROOT, 'FROZEN_FROM')
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    try:
        return (
            'git '
            + subprocess.run(
                ['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True, check=True
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def launch(s, out_dir, runs_dir):
    """study.py's launcher; the result also records where it ran (a pair split across machines is flagged)."""
    import torch

    r = study.default_launch(s, out_dir, runs_dir)
    return {
        **r,
        'host': socket.gethostname(),
        'machine': runner.machine(),
        'torch': torch.__version__,
        'code': frozen_label(),
        'threads': os.environ.get('OMP_NUM_THREADS', ''),
    }


def run(runs_dir, n_seeds=N_SEEDS, stop_at='', launch=launch, jobs=1):
    """Run the plan's unfinished runs, pair by pair, `jobs` runs of a pair at a time (each at the thread
    count the environment sets); returns (finished, failed names, runs not started)."""
    deadline = study.stop_time(stop_at) if stop_at else None
    specs = plan_specs(n_seeds)
    for s in specs:
        try:
            runner.config_of(study_plan.train_args(s, runs_dir))
        except ValueError as e:
            sys.exit(f"error: run {run_name(s)}: {e}")
    study.make_multi_dataset(runs_dir, study_plan.PAPER_TOKENS)
    failed, not_started = [], 0
    todo = sum(runner.load_result(runs_dir, run_name(s)) is None for s in specs)
    print(
        f"[{time.strftime('%H:%M:%S')}] K = 100 replication: {len(specs)} runs planned, {todo} to run "
        f"({runs_dir}; code {frozen_label()})",
        flush=True,
    )
    for pair in pairs_of(specs):
        missing = [s for s in pair if runner.load_result(runs_dir, run_name(s)) is None]
        if not missing:
            continue
        if deadline and time.time() >= deadline:
            not_started += len(missing)
            continue
        got = study.run_specs(pair, runs_dir, jobs=jobs, launch=launch)
        failed += [name for name, r in got.items() if 'error' in r]
    done = len(specs) - sum(runner.load_result(runs_dir, run_name(s)) is None for s in specs)
    print(
        f"[{time.strftime('%H:%M:%S')}] {done}/{len(specs)} runs finished"
        + (f"; --stop_at={stop_at}: {not_started} not started (the same command resumes them)" if not_started else '')
        + (f"; {len(failed)} failed (first: {failed[0]}; the same command retries them)" if failed else ''),
        flush=True,
    )
    return done, failed, not_started


# -----------------------------------------------------------------------------
# the statistics the plan names


@functools.lru_cache(maxsize=None)
def power(n, effect=POWER_EFFECT, sd=POWER_SD, level=0.95):
    """Power of the two-sided paired t test (df = n - 1) at `level` for a true mean difference of
    size `effect` with per-seed sd `sd`: P(|T'| > t_crit), T' noncentral t with noncentrality
    effect / sd * sqrt(n), as an integral over the chi-square variable (Simpson's rule)."""
    if n < 3:
        raise ValueError('power needs n >= 3')
    df, tc, nc = n - 1, stats.t_quantile(0.5 + level / 2, n - 1), abs(effect) / sd * math.sqrt(n)
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731
    log_norm = (df / 2) * math.log(2) + math.lgamma(df / 2)
    top, steps = df + 60 * math.sqrt(2 * df) + 60, 20_000
    h, total = top / steps, 0.0
    for i in range(steps + 1):
        v = i * h
        if v == 0:
            dens = 0.5 if df == 2 else 0.0
        else:
            dens = math.exp((df / 2 - 1) * math.log(v) - v / 2 - log_norm)
        u = tc * math.sqrt(v / df)
        w = 1 if i in (0, steps) else (4 if i % 2 else 2)
        total += w * dens * (phi(nc - u) + phi(-nc - u))
    return total * h / 3


def pairs_needed(target=0.8, effect=POWER_EFFECT, sd=POWER_SD):
    n = 3
    while power(n, effect, sd) < target:
        n += 1
    return n


def decide(lo, hi, margin=MARGIN):
    """The plan's rule for "LISA-wor beats LISA" (D < 0): replicated when the 95% interval lies
    below 0; else refuted when its low end is above -margin (a win of margin or more is ruled out,
    LISA-wor being worse included); else cannot tell. None: fewer than MIN_SEEDS pairs."""
    if lo is None:
        return 'not run'
    if hi < 0:
        return 'replicated'
    if lo > -margin:
        return 'refuted'
    return 'cannot tell'


def study_rule(lo, hi, margin=0.01):
    """Issue 31's rule for a predicted D < 0 (study_stats.verdict), for comparison only."""
    if lo is None:
        return 'not run'
    if hi < 0:
        return 'confirmed'
    if lo > 0 or (-margin < lo and hi < margin):
        return 'refuted'
    return 'inconclusive'


def paired_test(values):
    """values: {seed or label: D}. n, mean, sd, 95% interval, wins (D < 0), the verdict by the plan's
    rule and by the study's, and whether the interval excludes the study's estimate."""
    keys = sorted(values, key=str)
    xs = [values[k] for k in keys]
    n = len(xs)
    out = {
        'n': n,
        'seeds': keys,
        'values': xs,
        'wins': sum(x < 0 for x in xs),
        'mean': statistics.fmean(xs) if xs else None,
        'sd': statistics.stdev(xs) if n > 1 else None,
        'ci95': None,
    }
    if n >= MIN_SEEDS:
        _, lo, hi = stats.interval(xs)
        out['ci95'] = [lo, hi]
    lo, hi = out['ci95'] or (None, None)
    out.update(
        verdict=decide(lo, hi),
        study_rule=study_rule(lo, hi),
        excludes_study_estimate=None if lo is None else not lo <= STUDY_ESTIMATE <= hi,
        power_at_n=power(n) if n >= MIN_SEEDS else None,
    )
    return out


def is_cell_run(r):
    return (
        r.get('kind', 'train') == 'train'
        and r.get('train_loss')
        and r.get('beta1') is None
        and r.get('sampling', 'rr') == 'rr'
        and all(r.get(k) == v for k, v in GEOMETRY.items())
        and r.get('method') in METHODS
        and r.get('state') in STATES
    )


def finals(results):
    """{(state, method): {'train': {seed: final}, 'val': {...}}} of the K = 100 cells' runs."""
    out = {(st, m): {'train': {}, 'val': {}} for st in STATES for m in METHODS}
    for r in results:
        if is_cell_run(r):
            out[(r['state'], r['method'])]['train'][r['seed']] = r['train_loss'][-1]
            out[(r['state'], r['method'])]['val'][r['seed']] = r['val_loss'][-1]
    return out


def d_values(F, state, split, seeds):
    a, b = F[(state, 'lisa_wor')][split], F[(state, 'lisa')][split]
    return {s: a[s] - b[s] for s in sorted(set(a) & set(b) & set(seeds))}


def reproduction(results, study_results):
    """The study's seeds 100-102 run again, run by run against the study's final losses, and D per seed then and now."""
    now, then = finals(results), finals(study_results)
    runs, per_seed = [], []
    for st in STATES:
        for s in REPRO_SEEDS:
            for m in METHODS:
                for split in ('train', 'val'):
                    a, b = now[(st, m)][split].get(s), then[(st, m)][split].get(s)
                    if a is not None and b is not None:
                        runs.append(
                            {
                                'state': st,
                                'seed': s,
                                'method': m,
                                'split': split,
                                'now': a,
                                'then': b,
                                'diff': a - b,
                                'equal': abs(a - b) < EQUAL,
                            }
                        )
            d_now, d_then = d_values(now, st, 'train', [s]), d_values(then, st, 'train', [s])
            if s in d_now and s in d_then:
                per_seed.append({'state': st, 'seed': s, 'd_now': d_now[s], 'd_then': d_then[s]})
    diffs = [abs(r['diff']) for r in runs]
    return {
        'runs': runs,
        'per_seed': per_seed,
        'n': len(runs),
        'equal': sum(r['equal'] for r in runs),
        'max_abs': max(diffs, default=None),
        'mean_abs': statistics.fmean(diffs) if diffs else None,
        'reproduces': bool(runs) and all(r['equal'] for r in runs),
    }


def study_d(study_results, state='keep', split='train'):
    F = finals(study_results)
    return d_values(F, state, split, range(100, 110))


def split_pairs(results):
    """(seed, state) pairs whose two runs record different machines (the plan re-runs such a pair
    whole): the host name and runner.machine() (the CPU and the kernel build: these VMs all call
    themselves 'vm', the kernel build tells them apart)."""
    where = {}
    for r in results:
        if is_cell_run(r) and r.get('host'):
            where.setdefault((r['seed'], r['state']), set()).add((r['host'], r.get('machine')))
    return sorted(k for k, v in where.items() if len(v) > 1)


def analyse(results, study_results=(), n_seeds=N_SEEDS):
    """Everything the plan reports, from the finished runs (and the study's, for the reproduction and the pooling)."""
    F = finals(results)
    fresh = fresh_seeds(n_seeds)
    tests = {f'{st}_{split}': paired_test(d_values(F, st, split, fresh)) for st in STATES for split in ('train', 'val')}
    keep_fresh = d_values(F, 'keep', 'train', fresh)
    study_keep = study_d(study_results) if study_results else {}
    combined = paired_test(
        {**{f'earlier{i + 1}': v for i, v in enumerate(EARLIER_FRESH)}, **{f's{s}': v for s, v in keep_fresh.items()}}
    )
    everything = (
        paired_test(
            {
                **{f'study{s}': v for s, v in study_keep.items()},
                **{f'earlier{i + 1}': v for i, v in enumerate(EARLIER_FRESH)},
                **{f's{s}': v for s, v in keep_fresh.items()},
            }
        )
        if study_keep
        else None
    )
    per_seed = []
    for s in fresh:
        row = {'seed': s}
        for st in STATES:
            for m in METHODS:
                row[f'{st}_{m}_train'] = F[(st, m)]['train'].get(s)
                row[f'{st}_{m}_val'] = F[(st, m)]['val'].get(s)
        if any(v is not None for k, v in row.items() if k != 'seed'):
            per_seed.append(row)
    cell_runs = [r for r in results if is_cell_run(r)]
    return {
        'planned_fresh_seeds': [fresh[0], fresh[-1]],
        'planned_pairs': n_seeds,
        'pairs_done': {st: len(d_values(F, st, 'train', fresh)) for st in STATES},
        'tests': tests,
        'combined': combined,
        'everything': everything,
        'reproduction': reproduction(results, study_results) if study_results else None,
        'per_seed': per_seed,
        'split_pairs': split_pairs(results),
        'means': {
            f'{st}_{m}_{split}': statistics.fmean(v)
            if (v := [F[(st, m)][split][s] for s in fresh if s in F[(st, m)][split]])
            else None
            for st in STATES
            for m in METHODS
            for split in ('train', 'val')
        },
        'wall_s': sum(r.get('wall_s') or 0 for r in cell_runs),
        'runs': len(cell_runs),
        'hosts': sorted({r['host'] for r in cell_runs if r.get('host')}),
        'machines': sorted({r['machine'] for r in cell_runs if r.get('machine')}),
        'code': sorted({r['code'] for r in cell_runs if r.get('code')}),
        'torch': sorted({r['torch'] for r in cell_runs if r.get('torch')}),
        'power_design': {
            'effect': -POWER_EFFECT,
            'sd': POWER_SD,
            'pairs_for_80': pairs_needed(),
            'power_at_planned': power(n_seeds),
        },
    }


# -----------------------------------------------------------------------------
# the report


def fmt(x, nd=4):
    return '-' if x is None else f'{x:+.{nd}f}'


def fmt_sd(x):
    return '-' if x is None else f'{x:.4f}'


def fmt_test(t):
    if t['ci95'] is None:
        return f"{fmt(t['mean'])} (n = {t['n']}: no interval below {MIN_SEEDS} pairs)"
    return f"{fmt(t['mean'])} [{fmt(t['ci95'][0])}, {fmt(t['ci95'][1])}]"


TEST_NAMES = {
    'keep_train': 'PRIMARY: keep, train loss',
    'keep_val': 'keep, val loss (secondary)',
    'drop_train': 'drop, train loss (secondary)',
    'drop_val': 'drop, val loss (secondary)',
}


def markdown(a, command='', source=''):
    n_keep = a['pairs_done']['keep']
    interim = n_keep < a['planned_pairs']
    L = [
        '# K = 100 replication (issue 42)'
        + (f' — interim: {n_keep} of {a["planned_pairs"]} keep pairs' if interim else ''),
        '',
        f"Generated by `{command or 'experiments/replication_k100.py'}`; runs from `{source}`. Plan, rule and power: "
        "`results/replication_k100_plan.md` (written before the runs). 12 blocks, gamma 3, K = 100, AdamW, 10,000 "
        "iterations on the 470k-token 'paper' prefix (issue 31's K = 100 cells). D = LISA-wor - LISA final loss on "
        "the fixed windows, per seed (negative: LISA-wor better); 95% Student-t interval over seeds (df = n - 1); "
        f"wins = seeds with D < 0. Verdict: replicated = interval below 0; refuted = its low end above -{MARGIN} "
        f"(a LISA-wor win of {MARGIN} or more ruled out); cannot tell otherwise. The study's rule (issue 31: refuted "
        "= above 0 or inside (-0.01, +0.01)) beside it, for comparison only.",
        '',
        f"Runs: {a['runs']} of the plan's cells finished, {a['wall_s'] / 60:.0f} min of runs' own wall time; "
        f"machine(s): {'; '.join(a['machines']) or '-'}; host(s): {', '.join(a['hosts']) or '-'}; code: "
        f"{', '.join(a['code']) or '-'}; torch {', '.join(a['torch']) or '-'}. Fresh seeds planned "
        f"{a['planned_fresh_seeds'][0]}-{a['planned_fresh_seeds'][1]}; complete pairs: keep {n_keep}, drop "
        f"{a['pairs_done']['drop']}.",
    ]
    if a['split_pairs']:
        L += [
            '',
            f"**Pairs whose two runs ran on different machines (the plan re-runs them whole):** {a['split_pairs']}",
        ]
    if interim:
        L += [
            '',
            f"**Interim.** The verdict is the plan's at {a['planned_pairs']} pairs; at {n_keep} the design's power for "
            f"D = -{POWER_EFFECT} (sd {POWER_SD}) is " + (f"{power(n_keep):.0%}" if n_keep >= MIN_SEEDS else '-') + '.',
        ]
    L += [
        '',
        '## Fresh seeds (the replication)',
        '',
        '| outcome | n | mean [95% CI] | sd | LISA-wor wins | verdict | study\'s rule | excludes the study\'s -0.023 | '
        'power at n (D = -0.015, sd 0.03) |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for key, name in TEST_NAMES.items():
        t = a['tests'][key]
        L.append(
            f"| {name} | {t['n']} | {fmt_test(t)} | {fmt_sd(t['sd'])} | {t['wins']}/{t['n']} | **{t['verdict']}** | "
            f"{t['study_rule']} | "
            f"{'-' if t['excludes_study_estimate'] is None else ('yes' if t['excludes_study_estimate'] else 'no')} | "
            f"{'-' if t['power_at_n'] is None else format(t['power_at_n'], '.0%')} |"
        )
    m = a['means']
    L += [
        '',
        'Means over the fresh seeds: keep LISA train {} / LISA-wor {}; drop LISA {} / LISA-wor {}.'.format(
            *(
                ('-' if m[k] is None else f'{m[k]:.4f}')
                for k in ('keep_lisa_train', 'keep_lisa_wor_train', 'drop_lisa_train', 'drop_lisa_wor_train')
            )
        ),
    ]
    c, e = a['combined'], a['everything']
    L += [
        '',
        '## Combined (keep, train loss)',
        '',
        '| seeds | n | mean [95% CI] | sd | LISA-wor wins | verdict (same rule) |',
        '|---|---|---|---|---|---|',
        f"| every fresh seed so far: issue 42's 6 earlier + this replication's | {c['n']} | {fmt_test(c)} | "
        f"{fmt_sd(c['sd'])} | {c['wins']}/{c['n']} | {c['verdict']} |",
    ]
    if e:
        L.append(
            f"| everything: the study's 10 (100-109) + the 6 earlier + this replication's (descriptive: the study's "
            f"10 are the result under test) | {e['n']} | {fmt_test(e)} | {fmt_sd(e['sd'])} | {e['wins']}/{e['n']} | "
            f"({e['verdict']}) |"
        )
    L += [
        '',
        "The 6 earlier values are issue 42's, printed to 3 decimals: "
        + ', '.join(f'{v:+.3f}' for v in EARLIER_FRESH)
        + '.',
    ]
    r = a['reproduction']
    L += ['', '## Reproduction: the study\'s seeds 100-102 on this machine', '']
    if not r or not r['n']:
        L.append('Not run yet.')
    else:
        L += [
            f"{r['equal']} of {r['n']} final losses equal to the study's at 4 decimals (|diff| < {EQUAL}); largest "
            f"|diff| {r['max_abs']:.4f}, mean {r['mean_abs']:.4f}: "
            f"**{'reproduces' if r['reproduces'] else 'does not reproduce'}**.",
            '',
            '| state | seed | method | split | study | now | now - study |',
            '|---|---|---|---|---|---|---|',
        ]
        L += [
            f"| {x['state']} | {x['seed']} | {x['method']} | {x['split']} | {x['then']:.4f} | {x['now']:.4f} | "
            f"{x['diff']:+.4f} |"
            for x in r['runs']
        ]
        if r['per_seed']:
            L += ['', '| state | seed | D (train) in the study | D now |', '|---|---|---|---|']
            L += [f"| {x['state']} | {x['seed']} | {x['d_then']:+.4f} | {x['d_now']:+.4f} |" for x in r['per_seed']]
    L += [
        '',
        '## Per seed (final losses; D = LISA-wor - LISA)',
        '',
        '| seed | keep LISA train | keep LISA-wor train | keep D train | keep D val | drop LISA train | '
        'drop LISA-wor train | drop D train | drop D val |',
        '|---|---|---|---|---|---|---|---|---|',
    ]

    def d(row, st, split):
        a_, b_ = row[f'{st}_lisa_wor_{split}'], row[f'{st}_lisa_{split}']
        return None if a_ is None or b_ is None else a_ - b_

    f4 = lambda x: '-' if x is None else f'{x:.4f}'  # noqa: E731
    for row in a['per_seed']:
        L.append(
            f"| {row['seed']} | {f4(row['keep_lisa_train'])} | {f4(row['keep_lisa_wor_train'])} | "
            f"{fmt(d(row, 'keep', 'train'))} | {fmt(d(row, 'keep', 'val'))} | {f4(row['drop_lisa_train'])} | "
            f"{f4(row['drop_lisa_wor_train'])} | {fmt(d(row, 'drop', 'train'))} | {fmt(d(row, 'drop', 'val'))} |"
        )
    return '\n'.join(L) + '\n'


RUN_FIELDS = (
    *study_plan.KEY_FIELDS,
    'seed',
    'kind',
    'wall_s',
    'command',
    'median_ms_per_iter',
    'eval_iters',
    'train_loss',
    'val_loss',
    'host',
    'machine',
    'torch',
    'code',
    'threads',
)


def load_runs(path):
    with open(path) as f:
        return [{'kind': 'train', **r} for r in json.load(f)['runs']]


def restore(runs_dir, path):
    """Write RUNS/NAME/result.json for every run that a report's JSON keeps and runs_dir lacks (a runs folder
    lost with its machine): the runner then skips them as finished, and the report counts them. A result the
    folder holds is never replaced. Returns the names written."""
    written = []
    for r in load_runs(path):
        name = run_name(r)
        if runner.read_result(runs_dir, name) is None:
            os.makedirs(os.path.join(runs_dir, name), exist_ok=True)
            with open(runner.result_path(runs_dir, name), 'w') as f:
                json.dump({**r, 'restored_from': os.path.abspath(path)}, f, indent=1)
            written.append(name)
    return written


def report(results, study_results, report_dir='', name='replication_k100', command='', source='', n_seeds=N_SEEDS):
    a = analyse(results, study_results, n_seeds)
    md = markdown(a, command, source)
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f'{name}.md'), 'w') as f:
            f.write(md)
        with open(os.path.join(report_dir, f'{name}.json'), 'w') as f:
            json.dump(
                {
                    'command': command,
                    'source': source,
                    'analysis': a,
                    'runs': [{k: r.get(k) for k in RUN_FIELDS} for r in results if is_cell_run(r)],
                },
                f,
                indent=1,
            )
    return a, md


DEFAULTS = dict(
    runs_dir=os.path.join(ROOT, 'out', 'k100', 'runs'),
    report_only=False,
    runs_from='',
    restore_from='',
    report_dir='',
    name='replication_k100',
    study=STUDY_JSON,
    seeds=N_SEEDS,
    stop_at='',
    jobs=1,
    power=False,
)
MEANINGS = dict(
    runs_dir='the runs folder (RUNS/../data holds the 470k-token prefix)',
    report_only='report from the runs there (or --runs_from), run nothing',
    runs_from="report from the runs a report's NAME.json keeps (no runs folder needed)",
    restore_from="first write the runs a report's NAME.json keeps into runs_dir (a lost runs folder): "
    "they are not run again",
    report_dir='write NAME.md and NAME.json there (empty: print the report only)',
    name='report file stem',
    study="issue 31's report (its runs of seeds 100-109: the reproduction check and the pooled estimate)",
    seeds=f'fresh seeds from {FIRST_SEED} (the plan: {N_SEEDS})',
    stop_at='HH:MM (UTC): start no (seed, state) pair after it; the same command resumes',
    jobs="runs of a (seed, state) pair at a time: 1 (the plan), 2 (its two runs side by side)",
    power="print the plan's power numbers and exit",
)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    rules = {'seeds': at_least(1), 'jobs': between(1, 2, closed=True)}
    args = SimpleNamespace(**command_line(argv, DEFAULTS, rules, __doc__, MEANINGS))
    if args.power:
        print(f"pairs for 80% power (D = -{POWER_EFFECT}, sd {POWER_SD}, 95% two-sided paired t): {pairs_needed()}")
        for n in (6, 10, 13, 16, 20, 25, 30, 33, 34, 40):
            print(f"n = {n}: power {power(n):.4f} (at D = {STUDY_ESTIMATE}: {power(n, abs(STUDY_ESTIMATE)):.4f})")
        return 0
    runs_dir = os.path.abspath(args.runs_dir)
    command = ' '.join(['python experiments/replication_k100.py', *argv])
    status = 0
    if args.restore_from:
        try:
            restored = restore(runs_dir, args.restore_from)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: cannot restore the runs of {args.restore_from}: {type(e).__name__}: {e}")
        print(f"restored {len(restored)} run(s) of {args.restore_from} into {runs_dir}", flush=True)
    if not args.report_only:
        if args.runs_from:
            sys.exit('error: --runs_from reports from a JSON and runs nothing: add --report_only=True')
        _, failed, _ = run(runs_dir, args.seeds, args.stop_at, jobs=args.jobs)
        status = 1 if failed else 0
    try:
        results = load_runs(args.runs_from) if args.runs_from else runner.all_results(runs_dir)
        study_results = load_runs(args.study) if args.study else []
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: cannot read the runs: {type(e).__name__}: {e}")
    _, md = report(results, study_results, args.report_dir, args.name, command, args.runs_from or runs_dir, args.seeds)
    print(md)
    return status


if __name__ == '__main__':
    sys.exit(main())
