"""
How far pure bf16 and bf16_master drift from fp32 (`amp` on the CPU) on train.py's default model:
paired train.py runs over seeds, the val loss difference at every evaluation with its 95% interval.

    python experiments/precision.py --seeds=200,201,202,203,204 --iters=2000 --out=results/precision_drift
    python experiments/precision.py --check=True  # re-measure the committed reference (3-10 min on AVX-512)

A seed s sets --seed, --data_seed and --omgd_seed, so the three precisions of one seed start from the same
weights (bf16 rounds them), see the same batches and are evaluated on the same windows: their
differences are paired (experiments/stats.py). Runs go to --runs_dir, one folder each, and resume.

--check=True runs docs/precision.md's 300-iteration table (seed 1337, one thread) and compares its final val
losses with results/precision_reference.json (--write_reference=True writes that file, with this machine's
kernels). What it can promise depends on the kernels (results/precision_bisect.md):
- the same kernels (torch build, CPU model, instruction sets, caches: `kernels()`), one thread: the runs are
  bitwise repeatable, whatever else runs beside them, so every figure must agree within --tolerance;
- other kernels: amp (fp32) still agrees to the 4 digits on every machine measured, but the bf16 rows moved by
  up to 0.0091 between CPUs, so they are held only to --other_kernels_tolerance, and the check says so first.
A difference beyond the tolerance exits 1: the numbers moved, and the docs' table and drift figures need
re-measuring. On a CPU without oneDNN's bf16 kernels (no AVX-512) a bf16 iteration takes seconds, not
milliseconds: the check says so before it starts.
"""

import glob
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
THREADS = 1  # each reference run's; recorded with the reference
BF16_FLAGS = {'avx512f', 'avx512bw', 'avx512_bf16', 'avx512_vnni', 'avx512_fp16', 'amx_bf16', 'amx_tile'}


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


def kernels():
    """What the bf16 runs' rounding depends on here: the torch build, the instruction sets its kernels use
    (oneDNN's bf16 matmuls, or ATen's where oneDNN has none), the CPU model and its caches (oneDNN's blocking,
    hence the order of sums), and the one thread each run gets."""
    import torch

    info, flags = {}, set()
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = (part.strip() for part in line.partition(':'))
                if key in ('cpu family', 'model', 'stepping') and key not in info:
                    info[key] = value
                elif key == 'flags' and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    caches = []
    for index in sorted(glob.glob('/sys/devices/system/cpu/cpu0/cache/index*')):
        try:
            level, kind, size = (open(os.path.join(index, n)).read().strip() for n in ('level', 'type', 'size'))
        except OSError:
            continue
        if kind != 'Instruction':
            caches.append(f"L{level} {size}")
    return {
        'torch': torch.__version__,
        'cpu_capability': torch.backends.cpu.get_cpu_capability(),
        'onednn_bf16': torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        'cpu': ' '.join(f"{k} {info[k]}" for k in ('cpu family', 'model', 'stepping') if k in info) or None,
        'bf16_flags': sorted(flags & BF16_FLAGS),
        'caches': ', '.join(caches) or None,
        'threads': THREADS,
    }


def differences(reference, here):
    """The kernel facts that differ between the reference's machine and this one, and those it did not record."""
    differ = [f"{k} {reference[k]!r} there, {v!r} here" for k, v in here.items() if reference.get(k) not in (None, v)]
    unknown = [k for k in here if reference.get(k) is None]
    return differ, unknown


def check(tolerance, other_tolerance, write):
    """Re-run the reference table; compare with (or write) results/precision_reference.json."""
    here = kernels()
    if not write:
        with open(REFERENCE) as f:
            reference = json.load(f)
        differ, unknown = differences(reference.get('kernels', {}), here)
        if differ or unknown:
            said = '; '.join(differ + ([f"not recorded: {', '.join(unknown)}"] if unknown else []))
            print(
                f"warning: other kernels than the reference's ({said}): amp is held to {tolerance}, the bf16 rows "
                f"only to {other_tolerance}, their spread between CPUs (results/precision_bisect.md); "
                f"--write_reference=True at a commit you trust gives this machine's own",
                file=sys.stderr,
            )
    if not here['onednn_bf16']:
        print(
            "warning: this CPU has no oneDNN bf16 kernels (no AVX-512): a bf16 iteration took 13-16 s on a 2-core "
            "AVX2 EPYC, so the two bf16 runs may take hours",
            file=sys.stderr,
        )
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
            threads=THREADS,
        )
        if 'error' in r:
            sys.exit(f"error: the {p} run failed ({r['error']}); its log is {out_dir}/train.log")
        figures[p] = {
            'val_loss_0': round(r['val_loss'][0], 4),
            f'val_loss_{REFERENCE_ITERS}': round(r['val_loss'][-1], 4),
        }
    if write:
        with open(REFERENCE, 'w') as f:
            json.dump(
                {
                    'machine': runner.machine(),
                    'kernels': here,
                    'command': 'python experiments/precision.py --write_reference=True',
                    'figures': figures,
                },
                f,
                indent=1,
            )
        print(f"wrote {REFERENCE}")
        return 0
    return compare(figures, reference, here, tolerance, other_tolerance)


def compare(figures, reference, here, tolerance, other_tolerance):
    """Print each figure against the reference; 1 (with one `error:` line) when one moved beyond its tolerance:
    `tolerance` for amp and for every row on the reference's kernels, `other_tolerance` for bf16 rows elsewhere."""
    differ, unknown = differences(reference.get('kernels', {}), here)
    moved = []
    for p, now in figures.items():
        allowed = other_tolerance if p != 'amp' and (differ or unknown) else tolerance
        for key, value in now.items():
            was = reference['figures'][p][key]
            print(f"{p:12s} {key}: {value:.4f} (reference {was:.4f}, within {allowed})")
            if abs(value - was) > allowed + 1e-9:  # the figures are rounded to 4 digits
                moved.append(f"{p} {key} {was:.4f} -> {value:.4f}")
    if moved:
        print(
            f"error: the precision figures moved beyond their tolerance: {'; '.join(moved)}; re-measure "
            f"docs/precision.md's table and experiments/precision.py's drift",
            file=sys.stderr,
        )
        return 1
    print("the precision figures hold" + (" (bf16 rows to the other kernels' tolerance)" if differ or unknown else ''))
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
    tolerance=0.0001,
    other_kernels_tolerance=0.01,
)
MEANINGS = dict(
    seeds='comma-separated seeds',
    iters='iterations per run (10 evaluations)',
    jobs='runs at a time (one thread each)',
    out='write OUT.md and OUT.json (nothing is written without it)',
    check='re-measure the reference figure and compare',
    write_reference='re-measure and write the reference figure',
    tolerance='check: largest accepted change of a val loss on the reference\'s kernels (and of amp anywhere)',
    other_kernels_tolerance='check: the same for the bf16 rows on other kernels (their spread between CPUs)',
)
RULES = dict(
    iters=at_least(10, 'at least 10 (10 evaluations)'),
    jobs=at_least(1),
    tolerance=above(0),
    other_kernels_tolerance=above(0),
)


def main(argv=None):
    args = SimpleNamespace(**command_line(sys.argv[1:] if argv is None else argv, DEFAULTS, RULES, __doc__, MEANINGS))
    if args.check or args.write_reference:
        return check(args.tolerance, args.other_kernels_tolerance, args.write_reference)
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
