"""
Every layer-cycling method (and GaLore/GoLore) on the same small GPT on character-level
Shakespeare, trained by train.py under random reshuffling (rr) and i.i.d. sampling, over several
seeds, with equal iterations and learning-rate schedule.

train.py is the only training code: every run is a train.py subprocess started by
experiments/runner.py, whose log is parsed into curves. A run's seed s sets --seed, --data_seed and
--omgd_seed together, so for one s every method starts from the same weights, sees the same data
order (for the same sampling) and is evaluated on the same windows: differences between methods at
one seed are paired (experiments/stats.py).

Memory: on CPU there is no allocator peak, so the table reports the exact bytes of gradients and
optimizer state right after the first optimizer step following a switch (memory_estimate.memory_bytes, from
train_step's before_zero_grad hook). The config is the runs' own: the train.py arguments of a run
(train_command, --train_args included) parsed by train.py's configurator; the model, optimizer and
cycler come from builder.build and every iteration is Trainer.step, as in train.py.
Activations are not included.

Variants are METHOD or METHOD:SAMPLING (sampling rr by default), e.g.

    python experiments/compare.py --out_dir=results                 # all 9 variants x 3 seeds
    python experiments/compare.py --methods=full,lisa_wor --seeds=1 --max_iters=20 --out_dir=/tmp/c
    python experiments/compare.py --jobs=2 --n_embd=128 --block_size=128

Outputs in --out_dir (default out/, git-ignored; results/ only when named): NAME.md (table),
NAME.json (everything, curves included) and NAME_loss.png (val loss vs iteration, mean over seeds,
band = min..max over seeds); NAME is --name, 'compare' by default. `--replot=True` rewrites the table
and plot from an existing NAME.json without training.
"""

import difflib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runner  # noqa: E402
import stats  # noqa: E402

from configurator import at_least, command_line  # noqa: E402
from train_config import METHOD_NAMES  # noqa: E402

DEFAULT_VARIANTS = (
    'full',
    'lisa',
    'lisa_scale',
    'lisa_wor',
    'lisa_wor_noscale',
    'galore',
    'golore',
    'full:iid',
    'lisa_wor:iid',
)
SAMPLINGS = ('rr', 'iid')
# model / schedule flags passed through to train.py unchanged (name, type, default)
TRAIN_FLAGS = (
    ('dataset', str, 'shakespeare_char'),
    ('n_layer', int, 8),
    ('n_head', int, 4),
    ('n_embd', int, 64),
    ('block_size', int, 64),
    ('batch_size', int, 16),
    ('dropout', float, 0.0),
    ('learning_rate', float, 2e-3),
    ('min_lr', float, 2e-4),
    ('warmup_iters', int, 20),
    ('weight_decay', float, 0.1),
    ('grad_clip', float, 1.0),
    ('eval_interval', int, 24),
    ('eval_iters', int, 12),
    ('log_interval', int, 10),
    ('omgd_gamma', int, 2),
    ('omgd_period', int, 10),
    ('omgd_state', str, 'drop'),
    ('galore_rank', int, 16),
    ('galore_update_proj_gap', int, 50),
    ('galore_scale', float, 0.25),
)


def parse_variant(spec):
    method, _, sampling = spec.partition(':')
    sampling = sampling or 'rr'
    if method not in METHOD_NAMES:  # named here, not by train.py's check after the methods before it
        close = difflib.get_close_matches(method, METHOD_NAMES, n=1)
        raise ValueError(
            f"--methods: unknown method {method!r}{f' (did you mean {close[0]!r}?)' if close else ''}; choose "
            f"from {', '.join(METHOD_NAMES)}, each as METHOD or METHOD:SAMPLING (rr or iid)"
        )
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r} in {spec!r}")
    return {'name': method if sampling == 'rr' else f'{method}:{sampling}', 'method': method, 'sampling': sampling}


def train_args(variant, seed, args):
    """train.py's arguments for one run (runner.train_argv adds the CPU flags and the out_dir)."""
    argv = [
        f'--method={variant["method"]}',
        f'--sampling={variant["sampling"]}',
        f'--seed={seed}',
        f'--data_seed={seed}',
        f'--omgd_seed={seed}',
        f'--max_iters={args.max_iters}',
        f'--lr_decay_iters={args.max_iters}',
        '--decay_lr=True',
    ]
    argv += [f'--{name}={getattr(args, name)}' for name, _, _ in TRAIN_FLAGS]
    return argv + list(args.train_arg)


def run_name(variant, seed):
    return f'{variant["name"].replace(":", "_")}_s{seed}'


def run_all(variants, seeds, args, runs_dir):
    """Every (variant, seed) run, seed-major (a partial batch still pairs methods), args.jobs at a
    time; a run already finished in runs_dir is read back, not re-run. Returns the results."""
    jobs = [
        {'name': run_name(v, s), 'variant': v['name'], 'method': v['method'], 'sampling': v['sampling'], 'seed': s}
        for s in seeds
        for v in variants
    ]

    def launch(job, out_dir):
        variant = {'name': job['variant'], 'method': job['method'], 'sampling': job['sampling']}
        return runner.run_train(
            train_args(variant, job['seed'], args), out_dir, args.max_iters, args.threads, args.keep_checkpoints
        )

    return list(runner.run_all(jobs, runs_dir, launch, args.jobs).values())


# -----------------------------------------------------------------------------
# memory: the same model / optimizer / cycler as train.py, built in this process


def train_config(method, args):
    """The config train.py runs `method` with under these flags: train_args (the --train_args ones
    included) read as train.py reads them, and the vocabulary train.py
    would use (vocab_size, else the dataset's meta.pkl, else 0: builder.transformer_kwargs' 50304)."""
    from dataloader import dataset_vocab

    cfg = runner.config_of(train_args({'method': method, 'sampling': 'rr'}, 0, args))
    return cfg, dataset_vocab(cfg['dataset'], cfg['vocab_size'])


def model_config(args):
    """The TransformerConfig train.py builds for these flags (a bad --train_args key or model shape raises a
    one-line ValueError)."""
    import memory_estimate

    return memory_estimate.model_config(train_config('full', args)[0])


def measure_memory(method, args):
    """Exact bytes of params, grads and optimizer state right after an optimizer step that follows
    a switch (gradients still held: train_step's before_zero_grad), the largest over one cycle plus
    one switch (N_L / gamma + 1 periods, one step each). With omgd_state='drop' every period gives the
    same number (the previous blocks' state was dropped, the new blocks' state has just been
    created); with 'keep' the state grows to the full model's over the cycle. The model, optimizer,
    cycler and iteration are train.py's (builder.build, Trainer.step) for the runs' own config
    (train_config). Returns a dict, or {'error': ...}."""
    import torch

    import builder
    import memory_estimate
    from train_config import GALORE_METHODS
    from trainer import Trainer

    try:
        cfg, vocab = train_config(method, args)  # checked as train.py checks it
        torch.manual_seed(0)
        model, opt, cycler = builder.build(cfg, 'cpu', vocab)
        gen = torch.Generator().manual_seed(0)
        shape = (cfg['batch_size'], cfg['block_size'])

        def batches():
            while True:
                x = torch.randint(0, model.config.vocab_size, shape, generator=gen)
                yield x, torch.roll(x, -1, dims=1), None

        mem = {}

        def record(trainer):  # before_zero_grad: the step is done, the gradients are still held
            now = memory_estimate.memory_bytes(model, opt)
            now['trainable_params'] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            if not mem or now['grads'] + now['optimizer'] > mem['grads'] + mem['optimizer']:
                mem.update(now)

        periods = len(model.blocks) // max(1, cfg['omgd_gamma']) + 1
        trainer = Trainer(
            cfg,
            model,
            opt,
            cycler,
            batches(),
            'cpu',  # train.py's iteration
            observer=SimpleNamespace(before_zero_grad=record),
        )
        for k in range(periods):
            trainer.step(cfg['omgd_warmup'] + k * cfg['omgd_period'])  # a switch (after any full-training warm-up)
        mem['periods_measured'] = periods
        mem['n_params'] = sum(p.numel() for p in model.parameters())
        if method in GALORE_METHODS:
            import galore

            mem['projector'] = galore.projector_bytes(opt)  # memory_estimate.memory_bytes leaves projectors out
        mem['grads_plus_optimizer'] = mem['grads'] + mem['optimizer']
        return mem
    except Exception as e:  # noqa: BLE001  (report, never stop the comparison for this)
        return {'error': f'{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ""}'}


# -----------------------------------------------------------------------------
# summary


def summarize(variants, runs, memory):
    rows = []
    for v in variants:
        mine = [r for r in runs if r['variant'] == v['name']]
        ok = [r for r in mine if 'error' not in r and all(math.isfinite(x) for x in r['val_loss'])]
        finals = [r['val_loss'][-1] for r in ok]
        mean, std = stats.mean_std(finals)
        curve = None
        if ok and all(r['eval_iters'] == ok[0]['eval_iters'] for r in ok):
            curve = {
                'iters': ok[0]['eval_iters'],
                'mean': [statistics.fmean(c) for c in zip(*[r['val_loss'] for r in ok])],
                'min': [min(c) for c in zip(*[r['val_loss'] for r in ok])],
                'max': [max(c) for c in zip(*[r['val_loss'] for r in ok])],
            }
        ms = [r['median_ms_per_iter'] for r in ok if r['median_ms_per_iter']]
        rows.append(
            {
                **v,
                'seeds_ok': [r['seed'] for r in ok],
                'final_val': dict(zip([r['seed'] for r in ok], finals)),
                'final_val_mean': mean,
                'final_val_std': std,
                'final_val_min': min(finals) if finals else None,
                'final_val_max': max(finals) if finals else None,
                'final_train_mean': stats.mean_std([r['train_loss'][-1] for r in ok])[0],
                'median_ms_per_iter': statistics.median(ms) if ms else None,
                'switches': ok[0]['switches'] if ok else None,
                'errors': sorted({r['error'] for r in mine if 'error' in r}),
                'val_curve': curve,
                'memory': memory.get(v['method']),
            }
        )
    return rows


def paired(rows, a, b):
    """Per-seed difference a - b of final val loss (negative: a is better), stats.paired's fields."""
    ra = next((r for r in rows if r['name'] == a), None)
    rb = next((r for r in rows if r['name'] == b), None)
    p = stats.paired(ra['final_val'], rb['final_val']) if ra and rb else None
    return {'a': a, 'b': b, **p} if p else None


PAIRS = (
    ('lisa_wor', 'lisa'),
    ('lisa_wor', 'lisa_scale'),
    ('lisa_wor', 'lisa_wor_noscale'),
    ('lisa_scale', 'lisa'),
    ('lisa_wor_noscale', 'lisa'),
    ('lisa_wor', 'full'),
    ('lisa_wor', 'galore'),
    ('lisa_wor', 'golore'),
    ('golore', 'galore'),
    ('full', 'full:iid'),
    ('lisa_wor', 'lisa_wor:iid'),
)


def fmt(x, nd=4):
    return '-' if x is None else f'{x:.{nd}f}'


def kib(n):
    return '-' if n is None else f'{n / 1024:,.1f}'


def write_markdown(path, report):
    cfg, rows = report['config'], report['rows']
    lines = [
        '# Method comparison on character-level Shakespeare',
        '',
        f"Generated by `experiments/compare.py`. Command: `{report['command']}`",
        '',
        f"Machine: {report['machine']}. Wall time: {report['wall_s'] / 60:.1f} min "
        f"({len(report['runs'])} runs, {cfg['jobs']} at a time).",
        '',
        f"Model: GPT-2 style, {cfg['n_layer']} blocks, n_embd {cfg['n_embd']}, {cfg['n_head']} heads, "
        f"block_size {cfg['block_size']}, batch {cfg['batch_size']}, {report['n_params']:,} parameters. "
        f"{cfg['max_iters']} iterations for every method, AdamW lr {cfg['learning_rate']:g} "
        f"(warm-up {cfg['warmup_iters']}, cosine to {cfg['min_lr']:g} at {cfg['max_iters']}), "
        f"grad clip {cfg['grad_clip']:g}. Layer cycling: gamma={cfg['omgd_gamma']} of {cfg['n_layer']} blocks, "
        f"period K={cfg['omgd_period']}, optimizer state '{cfg['omgd_state']}'. GaLore/GoLore: rank "
        f"{cfg['galore_rank']}, update_proj_gap {cfg['galore_update_proj_gap']}, scale {cfg['galore_scale']:g}. "
        f"Seeds {cfg['seeds']} (seed = data_seed = omgd_seed; same init, data order and eval windows "
        f"for every method at one seed). Val loss: mean over {cfg['eval_iters']} fixed batches.",
        '',
        '## Final validation loss',
        '',
        '| variant | sampling | final val loss (mean ± std) | min .. max | per seed | final train loss '
        '| grads + optimizer state (KiB) | trainable params after a switch | ms/iter (median) |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for r in rows:
        mem = r['memory'] or {}
        if r['final_val_mean'] is None:
            lines.append(
                f"| {r['name']} | {r['sampling']} | FAILED: {'; '.join(r['errors'])[:200]} | | | | "
                f"{kib(mem.get('grads_plus_optimizer'))} | | |"
            )
            continue
        per_seed = ', '.join(f'{v:.4f}' for v in r['final_val'].values())
        memtxt = kib(mem.get('grads_plus_optimizer')) if 'error' not in mem else f"n/a ({mem['error'][:60]})"
        trainable = mem.get('trainable_params')
        lines.append(
            f"| {r['name']} | {r['sampling']} | {fmt(r['final_val_mean'])} ± {fmt(r['final_val_std'])} | "
            f"{fmt(r['final_val_min'])} .. {fmt(r['final_val_max'])} | {per_seed} | {fmt(r['final_train_mean'])} | "
            f"{memtxt} | {f'{trainable:,}' if isinstance(trainable, int) else '-'} | "
            f"{fmt(r['median_ms_per_iter'], 0)} |"
        )
        if r['errors']:
            lines.append(f"|  | | ({len(r['errors'])} failed seed(s): {'; '.join(r['errors'])[:200]}) | | | | | | |")
    lines += [
        '',
        'std: sample standard deviation over seeds. Memory: NOT an allocator peak (CPU has none); the exact '
        'bytes of gradients + optimizer state tensors right after an optimizer step that follows a switch '
        '(largest over one cycle + 1 switch), built in-process from the runs\' own train.py arguments '
        '(--train_args included) by builder.build and stepped by Trainer.step, as train.py does '
        '(memory_estimate.memory_bytes; GaLore/GoLore projection matrices are not counted as optimizer state '
        'but listed apart below, as in the GaLore paper). Parameters and activations excluded; identical for rr '
        'and iid. '
        'ms/iter is wall time on a shared CPU and only indicative.',
        '',
    ]
    if report['pairs']:
        lines += [
            '## Paired differences (same seed)',
            '',
            'Final val loss of A minus B at each seed (negative: A is lower): mean [95% t interval] (* when it '
            'excludes 0), sample std, t = mean / (std / sqrt(n)).',
            '',
            '| A | B | per-seed A - B | mean [95% CI] | std | A lower in | t |',
            '|---|---|---|---|---|---|---|',
        ]
        for p in report['pairs']:
            lines.append(
                f"| {p['a']} | {p['b']} | {', '.join(f'{d:+.4f}' for d in p['diffs'])} | {stats.fmt_pair(p)} | "
                f"{fmt(p['sd'])} | {p['a_wins']}/{len(p['diffs'])} | {fmt(p['t'], 2)} |"
            )
        lines.append('')
    mem_rows = [(m, v) for m, v in report['memory'].items()]
    if mem_rows:
        lines += [
            '## Memory detail (bytes, right after a step that follows a switch; largest over N_L/gamma + 1 periods)',
            '',
            '| method | params | grads | optimizer state | GaLore projectors (not in optimizer state) | '
            'grads + optimizer |',
            '|---|---|---|---|---|---|',
        ]
        for m, v in mem_rows:
            if 'error' in v:
                lines.append(f'| {m} | n/a: {v["error"]} | | | | |')
            else:
                lines.append(
                    f"| {m} | {v['params']:,} | {v['grads']:,} | {v['optimizer']:,} | "
                    f"{v.get('projector', 0):,} | {v['grads_plus_optimizer']:,} |"
                )
        lines.append('')
    lines += [
        f"Loss curves: `{report.get('name', 'compare')}_loss.png` (val loss vs iteration, mean over seeds, "
        f"band = min..max).",
        '',
    ]
    if report.get('replotted_with'):
        lines += [f"Table and plot rewritten from the JSON (no training) by `{report['replotted_with']}`.", '']
    with open(path, 'w') as f:
        f.write('\n'.join(lines))


def plot(path, report):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    rows = [r for r in report['rows'] if r['val_curve']]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    cmap = plt.get_cmap('tab10')
    methods = list(dict.fromkeys(r['method'] for r in rows))
    zoomed = []
    for ax, zoom in zip(axes, (False, True)):
        for r in rows:
            c = r['val_curve']
            color = cmap(methods.index(r['method']) % 10)
            style = '--' if r['sampling'] == 'iid' else '-'
            it = c['iters']
            start = next((i for i, x in enumerate(it) if x >= it[-1] / 2), 0) if zoom else 0
            if zoom:
                zoomed += c['mean'][start:]
            ax.plot(
                it[start:],
                c['mean'][start:],
                style,
                color=color,
                marker='.' if zoom else None,
                label=f"{r['name']} ({len(r['seeds_ok'])} seeds)",
            )
            if len(r['seeds_ok']) > 1:
                ax.fill_between(it[start:], c['min'][start:], c['max'][start:], color=color, alpha=0.12)
        ax.set_xlabel('iteration')
        ax.set_ylabel('validation loss')
        ax.grid(alpha=0.3)
        ax.set_title('second half (zoom; band = min..max over seeds)' if zoom else 'validation loss, mean over seeds')
    if zoomed:
        lo, hi = min(zoomed), max(zoomed)
        axes[1].set_ylim(lo - 0.1 * (hi - lo) - 0.005, hi + 0.3 * (hi - lo) + 0.005)
    axes[0].legend(fontsize=8)
    cfg = report['config']
    fig.suptitle(
        f"shakespeare_char, {cfg['n_layer']} blocks x {cfg['n_embd']}, gamma={cfg['omgd_gamma']}, "
        f"K={cfg['omgd_period']}, {cfg['max_iters']} iters; dashed = iid sampling, solid = reshuffling",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def n_params(config, memory):
    """The model's parameter count: from a memory measurement when there is one, else counted on meta."""
    counted = [m['n_params'] for m in memory.values() if 'n_params' in m]
    if counted:
        return counted[0]
    import torch

    from model import Transformer

    with torch.device('meta'):
        return sum(p.numel() for p in Transformer(config).parameters())


REPORT_KEYS = ('command', 'machine', 'wall_s', 'n_params', 'config', 'rows', 'memory', 'runs')


def read_report(path):
    """The NAME.json of an earlier comparison (--replot), or a one-line ValueError saying what to do."""
    if not os.path.exists(path):
        raise ValueError(
            f"--replot=True rewrites the table and plot of {path}, which does not exist: run the comparison "
            f"first (without --replot), or give the --out_dir and --name it was written with"
        )
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} cannot be read ({type(e).__name__}: {str(e)[:100]}); run the comparison again "
            f"(without --replot) to rewrite it"
        ) from None
    missing = [k for k in REPORT_KEYS if not isinstance(report, dict) or k not in report]
    if missing:
        raise ValueError(
            f"{path} is not a report of compare.py (it lacks {missing[0]!r}); give the --name of one, "
            f"or run the comparison again (without --replot)"
        )
    return report


def write_json(path, report):
    """NAME.json, replaced whole or not at all: a report cut short would lose the earlier one."""
    with open(path + '.tmp', 'w') as f:
        json.dump(report, f, indent=1)
    os.replace(path + '.tmp', path)


DEFAULTS = dict(
    methods=','.join(DEFAULT_VARIANTS),
    seeds='3',
    max_iters=240,
    out_dir=os.path.join(ROOT, 'out'),
    name='compare',
    runs_dir='',
    jobs=1,
    threads=1,
    keep_checkpoints=False,
    memory=True,
    train_args='',
    **{name: default for name, _, default in TRAIN_FLAGS},
    replot=False,
)
MEANINGS = dict(
    methods='comma-separated METHOD or METHOD:SAMPLING (rr|iid; default rr)',
    seeds='a count N (seeds 0..N-1) or a comma-separated list',
    out_dir='where compare.* are written (default out/, git-ignored; results/ only when named)',
    name='output file stem: NAME.md, NAME.json, NAME_loss.png',
    runs_dir='one out_dir per run (default: a temporary folder)',
    jobs='runs in parallel (2 cores here: keep 1 or 2)',
    threads='OMP_NUM_THREADS per run (0: torch default). 1 by default: on a shared 2-core machine two intra-op '
    'threads per run made a step ~8x slower in wall time than one thread',
    memory='measure the gradient and optimizer-state bytes in process (cheap, no training)',
    train_args="more train.py arguments, space-separated, e.g. --train_args='--omgd_warmup=50 --arch=llama'",
    replot='no training: rewrite NAME.md and NAME_loss.png from OUT_DIR/NAME.json (re-measuring memory unless '
    '--memory=False)',
    **{name: 'passed to train.py' for name, _, _ in TRAIN_FLAGS},
)
RULES = dict(max_iters=at_least(1), jobs=at_least(1), threads=at_least(0))


def parse(argv):
    """The command line's keys as attributes; train_arg: train_args split into train.py's arguments."""
    args = SimpleNamespace(**command_line(argv, DEFAULTS, RULES, __doc__, MEANINGS))
    args.train_arg = args.train_args.split()
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.replot:
        path = os.path.join(args.out_dir, f'{args.name}.json')
        try:
            report = read_report(path)
        except ValueError as e:
            sys.exit(f"error: {e}")
        if report['memory'] and args.memory:  # cheap, no training: re-measure with the report's config
            cfg = SimpleNamespace(
                **{n: report['config'][n] for n, _, _ in TRAIN_FLAGS},
                max_iters=report['config']['max_iters'],
                train_arg=report['config'].get('train_args', []),
            )
            report['memory'] = {m: measure_memory(m, cfg) for m in report['memory']}
            for r in report['rows']:
                r['memory'] = report['memory'].get(r['method'])
        report['pairs'] = [p for a, b in PAIRS if (p := paired(report['rows'], a, b))]
        report['name'] = args.name
        report['replotted_with'] = ' '.join(
            ['python', os.path.relpath(os.path.abspath(__file__), ROOT)]
            + (sys.argv[1:] if argv is None else list(argv))
        )
        write_json(path, report)
        write_markdown(os.path.join(args.out_dir, f'{args.name}.md'), report)
        plot(os.path.join(args.out_dir, f'{args.name}_loss.png'), report)
        print(f"rewrote {args.out_dir}/{args.name}.md and {args.name}_loss.png from {args.name}.json")
        return 0
    # every argument checked before hours of training: methods, seeds, each run's train.py config
    try:
        variants = [parse_variant(s.strip()) for s in args.methods.split(',') if s.strip()]
        if not variants:
            raise ValueError("--methods names no method, e.g. --methods=lisa,lisa_wor")
        try:
            seeds = (
                list(range(int(args.seeds)))
                if args.seeds.strip().isdigit()
                else [int(s) for s in args.seeds.split(',') if s.strip()]
            )
        except ValueError:
            raise ValueError(f"--seeds={args.seeds!r}: give a count N or a list, e.g. --seeds=0,1,2") from None
        if not seeds:
            raise ValueError("--seeds needs at least one seed, e.g. --seeds=3")
        # a mistyped train_arg fails now, not after the other runs; the schedule is checked next, in our keys
        unscheduled = SimpleNamespace(**{**vars(args), 'max_iters': max(args.max_iters, args.warmup_iters)})
        for v in variants:
            train_config(v['method'], unscheduled)
        if args.max_iters < args.warmup_iters:  # the runs' cosine ends at max_iters (lr_decay_iters=max_iters)
            raise ValueError(
                f"--max_iters={args.max_iters} ends inside the learning-rate warm-up (--warmup_iters="
                f"{args.warmup_iters}), before the cosine decay the runs compare under; raise --max_iters to "
                f"{args.warmup_iters} or more, or lower --warmup_iters (e.g. --warmup_iters={args.max_iters})"
            )
        config = model_config(args)
        os.makedirs(args.out_dir, exist_ok=True)
    except ValueError as e:
        sys.exit(f"error: {e}")
    except OSError as e:  # a file where the folder should be, a read-only place
        sys.exit(f"error: --out_dir={args.out_dir} cannot hold the reports ({e.strerror or e}); choose a folder")
    tmp = None
    runs_dir = args.runs_dir
    if not runs_dir:
        tmp = runs_dir = tempfile.mkdtemp(prefix='compare_runs_')
    print(f"{len(variants)} variants x {len(seeds)} seeds, {args.max_iters} iterations, runs in {runs_dir}", flush=True)

    t0 = time.time()
    runs = run_all(variants, seeds, args, runs_dir)
    wall = time.time() - t0

    memory = {}
    if args.memory:
        for m in dict.fromkeys(v['method'] for v in variants):
            memory[m] = measure_memory(m, args)

    rows = summarize(variants, runs, memory)
    pairs = [p for a, b in PAIRS if (p := paired(rows, a, b))]
    report = {
        'command': ' '.join(
            ['python', os.path.relpath(os.path.abspath(__file__), ROOT)]
            + (sys.argv[1:] if argv is None else list(argv))
        ),
        'name': args.name,
        'machine': runner.machine(),
        'wall_s': round(wall, 1),
        'n_params': n_params(config, memory),
        'config': {
            **{n: getattr(args, n) for n, _, _ in TRAIN_FLAGS},
            'max_iters': args.max_iters,
            'seeds': seeds,
            'jobs': args.jobs,
            'threads': args.threads,
            'train_args': args.train_arg,
            'variants': [v['name'] for v in variants],
        },
        'rows': rows,
        'pairs': pairs,
        'memory': memory,
        'runs': runs,
        'memory_note': 'exact bytes of gradients + optimizer state after an optimizer step following a switch '
        '(largest over one cycle + 1 switch), built on CPU by builder.build from the runs\' train.py '
        'arguments and stepped by Trainer.step (memory_estimate.memory_bytes); not an allocator peak',
    }
    failed = [r for r in runs if 'error' in r]
    if failed:  # the reports of an earlier, complete comparison stay as they were
        stem = os.path.join(args.out_dir, f'{args.name}.failed.json')
        write_json(stem, report)
        print(
            f"error: {len(failed)} of {len(runs)} runs failed (first: {failed[0]['error']}); {args.name}.md/.json "
            f"left as they were; this comparison is in {stem}, the runs' logs in {runs_dir}",
            file=sys.stderr,
        )
        return 1
    write_json(os.path.join(args.out_dir, f'{args.name}.json'), report)
    write_markdown(os.path.join(args.out_dir, f'{args.name}.md'), report)
    plot(os.path.join(args.out_dir, f'{args.name}_loss.png'), report)
    if tmp and not args.runs_dir:
        shutil.rmtree(tmp, ignore_errors=True)
    print(open(os.path.join(args.out_dir, f'{args.name}.md')).read())
    print(
        f"wall time {wall / 60:.1f} min; wrote {args.name}.md, {args.name}.json, {args.name}_loss.png in {args.out_dir}"
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
