"""
How far pure bf16 and bf16_master drift from fp32 (`amp` on the CPU) on train.py's default model:
paired train.py runs over seeds, the val loss difference at every evaluation with its 95% interval.

    python experiments/precision.py --seeds=200,201,202,203,204 --iters=2000 --out=results/precision_drift
    python experiments/precision.py --check=True  # re-measure the committed reference figure (about 3 minutes)

A seed s sets --seed, --data_seed and --omgd_seed, so the three precisions of one seed start from the same
weights (bf16 rounds them), see the same batches and are evaluated on the same windows: their
differences are paired (experiments/stats.py). Runs go to --runs_dir, one folder each, and resume.

--check=True runs docs/precision.md's 300-iteration table (seed 1337, one thread) and compares its final val
losses with results/precision_reference.json (--write_reference=True writes that file). On the same torch
build, CPU training is deterministic, so the figures agree to the 4 digits printed. A difference beyond
--tolerance exits 1: the numbers moved, and the docs' table and drift figures need re-measuring.
"""

import json
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # train_config
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402
import stats  # noqa: E402

from configurator import above, at_least, command_line  # noqa: E402

PRECISIONS = ('amp', 'bf16_master', 'bf16')
REFERENCE = os.path.join(runner.ROOT, 'results', 'precision_reference.json')
REFERENCE_ITERS = 300  # docs/precision.md's table


def run_args(precision, seed, iters, evals=10):
    return [
        f'--precision={precision}',
        f'--seed={seed}',
        f'--data_seed={seed}',
        f'--omgd_seed={seed}',
        f'--max_iters={iters}',
        f'--lr_decay_iters={iters}',
        f'--eval_interval={iters // evals}',
        '--eval_iters=50',
    ]


def jobs_for(seeds, iters, precisions):
    return [
        {'name': f'{p}_s{s}', 'precision': p, 'seed': s, 'iters': iters, 'args': run_args(p, s, iters)}
        for s in seeds
        for p in precisions
    ]


def launch(job, out_dir):
    return runner.run_train(job['args'], out_dir, job['iters'])


def analyse(results, precisions):
    """Final val loss per precision and seed; each precision minus amp (and bf16 minus bf16_master),
    paired over seeds, at every evaluation."""
    by = {p: {r['seed']: r for r in results.values() if r['precision'] == p and 'error' not in r} for p in precisions}
    final = {p: {s: r['val_loss'][-1] for s, r in runs.items()} for p, runs in by.items()}
    pairs = [
        (a, b)
        for a, b in (('bf16', 'amp'), ('bf16_master', 'amp'), ('bf16', 'bf16_master'))
        if a in precisions and b in precisions
    ]
    out = {'final': final, 'pairs': {}}
    for a, b in pairs:
        seeds = sorted(set(by[a]) & set(by[b]))
        if not seeds:
            continue
        iters = by[a][seeds[0]]['eval_iters']
        over_time = [
            stats.paired({s: by[a][s]['val_loss'][i] for s in seeds}, {s: by[b][s]['val_loss'][i] for s in seeds})
            for i in range(len(iters))
        ]
        out['pairs'][f'{a} - {b}'] = {
            'eval_iters': iters,
            'over_time': over_time,
            'final': stats.paired(final[a], final[b]),
        }
    return out


def markdown(analysis, command, wall_s):
    final = analysis['final']
    lines = [
        f"Command: `{command}`",
        f"Machine: {runner.machine()}, one thread a run; {wall_s / 60:.0f} min of runs",
        '',
        '| precision | seeds | final val loss, mean ± sd |',
        '|---|---|---|',
    ]
    for p, by_seed in final.items():
        mean, sd = stats.mean_std(by_seed.values())
        if mean is not None:
            lines.append(f"| {p} | {len(by_seed)} | {mean:.4f} ± {sd:.4f} |")
    lines += [
        '',
        'Paired differences of the val loss (positive: the first is worse), mean [95% interval], '
        '`*` where the interval excludes 0, and the seeds where the first is lower:',
        '',
    ]
    for name, pair in analysis['pairs'].items():
        lines += [f"**{name}**", '', '| iteration | difference | first lower |', '|---|---|---|']
        for it, p in zip(pair['eval_iters'], pair['over_time']):
            lines.append(f"| {it} | {stats.fmt_pair(p)} | {p['a_wins']}/{p['n']} |")
        lines.append('')
    return '\n'.join(lines)


def check(tolerance, write):
    """Re-run the reference table; compare with (or write) results/precision_reference.json."""
    runs_dir = os.path.join(runner.ROOT, 'out', 'precision_reference')
    figures = {}
    for p in PRECISIONS:
        out_dir = os.path.join(runs_dir, p)
        r = runner.run_train(
            [
                f'--precision={p}',
                f'--max_iters={REFERENCE_ITERS}',
                f'--lr_decay_iters={REFERENCE_ITERS}',
                f'--eval_interval={REFERENCE_ITERS}',
                '--eval_iters=50',
                '--overwrite=True',
            ],
            out_dir,
            REFERENCE_ITERS,
        )
        if 'error' in r:
            sys.exit(f"error: the {p} run failed ({r['error']}); its log is {out_dir}/train.log")
        figures[p] = {
            'val_loss_0': round(r['val_loss'][0], 4),
            f'val_loss_{REFERENCE_ITERS}': round(r['val_loss'][-1], 4),
        }
    import torch

    here = {
        'torch': torch.__version__,
        'machine': runner.machine(),
        'cpu_capability': torch.backends.cpu.get_cpu_capability(),
    }
    if write:
        with open(REFERENCE, 'w') as f:
            json.dump(
                {**here, 'command': 'python experiments/precision.py --write_reference=True', 'figures': figures},
                f,
                indent=1,
            )
        print(f"wrote {REFERENCE}")
        return 0
    with open(REFERENCE) as f:
        reference = json.load(f)
    if (here['torch'], here['cpu_capability']) != (reference['torch'], reference['cpu_capability']):
        print(
            f"warning: the reference was measured with torch {reference['torch']} on {reference['cpu_capability']} "
            f"kernels ({reference['machine']}), this is torch {here['torch']} on {here['cpu_capability']}: the bf16 "
            f"figures differ by about 0.01 between CPUs (results/precision_bisect.md)",
            file=sys.stderr,
        )
    moved = []
    for p, now in figures.items():
        for key, value in now.items():
            was = reference['figures'][p][key]
            print(f"{p:12s} {key}: {value:.4f} (reference {was:.4f}, torch {reference['torch']})")
            if abs(value - was) > tolerance:
                moved.append(f"{p} {key} {was:.4f} -> {value:.4f}")
    if moved:
        print(
            f"error: the precision figures moved beyond {tolerance}: {'; '.join(moved)}; re-measure "
            f"docs/precision.md's table and experiments/precision.py's drift",
            file=sys.stderr,
        )
        return 1
    print(f"the precision figures hold (within {tolerance})")
    return 0


DEFAULTS = dict(
    seeds='200,201,202,203,204',
    iters=2000,
    precisions=','.join(PRECISIONS),
    runs_dir=os.path.join(runner.ROOT, 'out', 'precision_runs'),
    jobs=1,
    out='',
    check=False,
    write_reference=False,
    tolerance=0.002,
)
MEANINGS = dict(
    seeds='comma-separated seeds',
    iters='iterations per run (10 evaluations)',
    jobs='runs at a time (one thread each)',
    out='write OUT.md and OUT.json (nothing is written without it)',
    check='re-measure the reference figure and compare',
    write_reference='re-measure and write the reference figure',
    tolerance='check: largest accepted change of a val loss',
)
RULES = dict(iters=at_least(10, 'at least 10 (10 evaluations)'), jobs=at_least(1), tolerance=above(0))


def main(argv=None):
    args = SimpleNamespace(**command_line(sys.argv[1:] if argv is None else argv, DEFAULTS, RULES, __doc__, MEANINGS))
    if args.check or args.write_reference:
        return check(args.tolerance, args.write_reference)
    try:
        seeds = [int(s) for s in args.seeds.split(',')]
    except ValueError:
        sys.exit(f"error: --seeds must be comma-separated integers, got {args.seeds!r}")
    precisions = [p for p in args.precisions.split(',') if p]
    if not set(precisions) <= set(PRECISIONS) or not precisions:
        sys.exit(f"error: --precisions must be among {','.join(PRECISIONS)}, got {args.precisions!r}")
    jobs = jobs_for(seeds, args.iters, precisions)
    try:
        for job in jobs:
            runner.config_of(job['args'])  # every run's config checked before the first starts
    except ValueError as e:
        sys.exit(f"error: {e}")
    results = runner.run_all(jobs, args.runs_dir, launch, n_jobs=args.jobs)
    failed = [name for name, r in results.items() if 'error' in r]
    analysis = analyse(results, precisions)
    command = 'python experiments/precision.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    text = markdown(analysis, command, sum(r.get('wall_s', 0) for r in results.values()))
    print(text)
    if args.out:
        with open(args.out + '.md', 'w') as f:
            f.write(text + '\n')
        with open(args.out + '.json', 'w') as f:
            json.dump({'command': command, 'machine': runner.machine(), 'runs': results, 'analysis': analysis}, f)
        print(f"wrote {args.out}.md, {args.out}.json")
    if failed:
        print(
            f"error: {len(failed)} runs failed ({', '.join(failed[:5])}); run the same command again to retry them",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
