"""
When does LISA-wor beat LISA? A paired, resumable study through train.py (issue: "Evidence: when
does LISA-wor beat LISA?"), and the measurements that explain what it finds.

Every training run is a `python train.py ...` subprocess started by experiments/compare.py's
run_one (same command line, same log parsing); a run's seed s sets --seed, --data_seed and
--omgd_seed, so at one seed every configuration starts from the same weights, sees the same data
order (for the same sampling) and is evaluated on the same fixed windows: differences are paired
by seed. The metric the theory is about is the training loss; train.py's eval 'train' split draws
the same fixed windows of the training set at every evaluation, so 'train loss' below is the loss
on a fixed set of training windows (and 'val loss' the same on val.bin).

Regimes:
- multi: a prefix of MULTI_TOKENS tokens of data/shakespeare_char/train.bin (written once to
  RUNS/../data/shakespeare_char_100k with the full val.bin and meta.pkl), trained for >= 10 epochs.
- sub: the whole corpus, a fraction of one epoch.

Stages, in the order they run (a stage's runs go seed-major, so a stage stopped part-way still pairs):
  core_multi_adamw, core_multi_sgd, core_sub_adamw, core_sub_sgd: lisa, lisa_wor x keep, drop
         (+ full for AdamW)
  aligned: the cycle aligned with the data, K = one epoch: every (block group, window) pair once per
           cycle of M epochs; lisa at the same K for pairing (aligned_cycle: K = epoch / M, one cycle per epoch)
  probe: in-process instrumented copies of train.py's loop (seed 0; schedule, Adam-state age at
         reactivation, update norms after reactivation, clipping), also checked against train.py's log
  offload: lisa_wor with omgd_state=offload, to check it equals keep bitwise (seed 0)
  methods_sgd: lisa_scale, lisa_wor_noscale with SGD (multi): without replacement vs the N_L/gamma scale
  iid: lisa, lisa_wor with i.i.d. sampling (multi)
  methods: lisa_scale, lisa_wor_noscale, tensor_wor, tensor_iid (multi, AdamW)
  sweep: K in {1, 10, 50} x gamma in {1, 2} for lisa vs lisa_wor (multi, AdamW)
  k1_keep: the sweep's K=1, gamma=2 cell under the other state policy
'keep' for the later stages is the policy under which lisa_wor reached the lower mean train loss in
core_multi_adamw (--policy=auto), or the one named.

    python experiments/study.py                     # everything, resumes: finished runs are skipped
    python experiments/study.py --stages=core_multi_adamw,probe --seeds=5
    python experiments/study.py --report_only --report_dir=results   # tables/plot from finished runs

Writes REPORT_DIR/study.json (every run's curves and the paired statistics), study_tables.md,
study_loss.png and study_probe.md (default REPORT_DIR: out/study).
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare  # noqa: E402

MULTI_TOKENS = 100_000
# model and schedule of every run (train.py keys); the optimizer's own values come from OPTIMIZERS
BASE = dict(n_layer=4, n_head=2, n_embd=32, block_size=64, batch_size=32, dropout=0.0, learning_rate=3e-3,
            min_lr=3e-4, warmup_iters=20, weight_decay=0.1, grad_clip=1.0, eval_iters=8, log_interval=12,
            omgd_gamma=2, omgd_period=10, omgd_state='keep', galore_rank=16, galore_update_proj_gap=50,
            galore_scale=0.25)
OPTIMIZERS = {'adamw': {}, 'sgd': dict(learning_rate=0.1, min_lr=0.01)}
# iterations and evaluation interval per regime; multi: 48 steps per epoch (100k tokens, 32 x 65-token windows)
REGIMES = {'multi': dict(max_iters=480, eval_interval=48), 'sub': dict(max_iters=240, eval_interval=24)}
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}


# -----------------------------------------------------------------------------
# run specifications


def spec(regime, optimizer, method, state='keep', sampling='rr', K=None, gamma=None, seed=0, kind='train'):
    full = method == 'full'
    return {'regime': regime, 'optimizer': optimizer, 'method': method, 'state': 'na' if full else state,
            'sampling': sampling, 'K': 0 if full else (K or BASE['omgd_period']),
            'gamma': 0 if full else (gamma or BASE['omgd_gamma']), 'seed': seed, 'kind': kind}


def config_key(s):
    """The configuration without the seed: runs with the same key and different seeds are a group."""
    return f"{s['regime']}-{s['optimizer']}-{s['method']}-{s['state']}-{s['sampling']}-K{s['K']}-g{s['gamma']}"


def run_name(s):
    return f"{'probe-' if s['kind'] == 'probe' else ''}{config_key(s)}_s{s['seed']}"  # compare.run_one's folder


def multi_dataset(runs_dir):
    return os.path.join(os.path.dirname(os.path.abspath(runs_dir)), 'data', f'shakespeare_char_{MULTI_TOKENS // 1000}k')


def make_multi_dataset(runs_dir, n_tokens=MULTI_TOKENS, source=os.path.join(ROOT, 'data', 'shakespeare_char')):
    """The multi-epoch split: the first n_tokens tokens of train.bin, the full val.bin, the same meta.pkl."""
    import numpy as np
    dst = multi_dataset(runs_dir)
    if os.path.exists(os.path.join(dst, 'meta.pkl')):
        return dst
    os.makedirs(dst, exist_ok=True)
    train = np.memmap(os.path.join(source, 'train.bin'), dtype=np.uint16, mode='r')
    np.array(train[:n_tokens]).tofile(os.path.join(dst, 'train.bin'))
    shutil.copyfile(os.path.join(source, 'val.bin'), os.path.join(dst, 'val.bin'))
    shutil.copyfile(os.path.join(source, 'meta.pkl'), os.path.join(dst, 'meta.pkl'))  # last: marks it complete
    return dst


def train_args(s, runs_dir, base=None, regimes=None):
    """(variant, argparse.Namespace) for compare.run_one / compare.train_command."""
    base, regimes = base or BASE, regimes or REGIMES
    flags = {name: default for name, _, default in compare.TRAIN_FLAGS}
    flags.update(base)
    flags.update(OPTIMIZERS[s['optimizer']])
    flags.update(regimes[s['regime']])
    if s['method'] != 'full':
        flags.update(omgd_period=s['K'], omgd_gamma=s['gamma'], omgd_state=s['state'])
    flags['dataset'] = multi_dataset(runs_dir) if s['regime'] == 'multi' else 'shakespeare_char'
    extra = [f'--optimizer={s["optimizer"]}', '--overwrite=True']
    ns = argparse.Namespace(**flags, threads=1, train_arg=extra, keep_checkpoints=False)
    variant = {'name': run_name(s)[:-len(f"_s{s['seed']}")], 'method': s['method'], 'sampling': s['sampling']}
    return variant, ns


def stage_specs(stage, seeds, policy='keep'):
    """The runs of one stage, seed-major."""
    out = []
    for seed in seeds:
        S = lambda *a, **k: spec(*a, seed=seed, **k)  # noqa: E731
        if stage.startswith('core_'):
            _, regime, opt = stage.split('_')
            out += [S(regime, opt, 'full')] if opt == 'adamw' else []  # the full-training reference: AdamW only (time)
            out += [S(regime, opt, m, st) for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage == 'probe' and seed == seeds[0]:
            out += [S('multi', 'adamw', m, st, kind='probe') for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage in ('aligned', 'aligned_cycle'):
            # 48 steps per epoch (eval once per epoch); aligned: K = one epoch, so a cycle of M = N_L / gamma
            # periods is M epochs and every (block group, window) pair is visited once per cycle (up to each
            # epoch's random window offset); aligned_cycle: K = epoch / M, one cycle per epoch
            epoch = REGIMES['multi']['eval_interval']
            K = epoch if stage == 'aligned' else epoch // (BASE['n_layer'] // BASE['omgd_gamma'])
            out += [S('multi', 'adamw', m, policy, K=K) for m in ('lisa', 'lisa_wor')]
        elif stage == 'offload' and seed == seeds[0]:
            out += [S('multi', 'adamw', 'lisa_wor', 'offload')]
        elif stage == 'iid':
            out += [S('multi', 'adamw', m, policy, sampling='iid') for m in ('lisa', 'lisa_wor')]
        elif stage == 'methods':
            out += [S('multi', 'adamw', m, policy) for m in ('lisa_scale', 'lisa_wor_noscale', 'tensor_wor', 'tensor_iid')]
        elif stage == 'methods_sgd':  # SGD is not scale-invariant: separates without-replacement from the N_L/gamma scale
            out += [S('multi', 'sgd', m, policy) for m in ('lisa_scale', 'lisa_wor_noscale')]
        elif stage == 'k1_keep':  # the sweep's K=1 cell under the other policy (the restart count at K=1 is the suspect)
            out += [S('multi', 'adamw', m, 'keep' if policy == 'drop' else 'drop', K=1) for m in ('lisa', 'lisa_wor')]
        elif stage == 'sweep':
            out += [S('multi', 'adamw', m, policy, K=K, gamma=g) for K, g in ((1, 2), (50, 2), (1, 1), (10, 1), (50, 1))
                    for m in ('lisa', 'lisa_wor')]
    return out


STAGES = ('core_multi_adamw', 'aligned', 'probe', 'core_multi_sgd', 'core_sub_adamw', 'core_sub_sgd', 'offload',
          'methods_sgd', 'aligned_cycle', 'iid', 'methods', 'sweep', 'k1_keep')


# -----------------------------------------------------------------------------
# running, resumable


def result_path(runs_dir, s):
    return os.path.join(runs_dir, run_name(s), 'result.json')


def load_result(runs_dir, s):
    path = result_path(runs_dir, s)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        r = json.load(f)
    return None if 'error' in r else r


def train_runner(s, runs_dir):
    variant, ns = train_args(s, runs_dir)
    r = compare.run_one(variant, s['seed'], ns, runs_dir)
    r.pop('variant', None)
    return r


def probe_runner(s, runs_dir):
    out_dir = os.path.join(runs_dir, run_name(s))
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    t0 = time.time()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--probe_spec', json.dumps(s),
                           f'--runs_dir={runs_dir}'], cwd=ROOT, capture_output=True, text=True, env=env)
    r = {'returncode': proc.returncode, 'wall_s': round(time.time() - t0, 1)}
    if proc.returncode == 0:
        with open(os.path.join(out_dir, 'probe.json')) as f:
            r.update(json.load(f))
    else:
        r['error'] = (proc.stderr.strip().splitlines() or ['exit code %d' % proc.returncode])[-1][:300]
    print(f"[{time.strftime('%H:%M:%S')}] {run_name(s)}: {r.get('error', 'ok')} ({r['wall_s']:.0f} s)", flush=True)
    return r


def default_runner(s, runs_dir):
    return probe_runner(s, runs_dir) if s['kind'] == 'probe' else train_runner(s, runs_dir)


def run_specs(specs, runs_dir, jobs=2, runner=default_runner):
    """Run the specs not finished yet (no result.json without an error), `jobs` at a time; returns
    {run_name: result} for all specs, finished ones read from disk (resume)."""
    todo = [s for s in specs if load_result(runs_dir, s) is None]

    def one(s):
        r = {**runner(s, runs_dir), **s}
        path = result_path(runs_dir, s)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + '.tmp', 'w') as f:
            json.dump(r, f)
        os.replace(path + '.tmp', path)
        return r

    if todo:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(one, todo))
    return {run_name(s): r for s in specs if (r := load_result(runs_dir, s)) is not None}


def all_results(runs_dir):
    out = []
    if not os.path.isdir(runs_dir):
        return out
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name, 'result.json')
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
            if 'error' not in r:
                out.append(r)
    return out


# -----------------------------------------------------------------------------
# statistics


def paired_stats(a, b):
    """a, b: {seed: value}. Paired differences a - b over the common seeds: mean, sample std and a
    95% t interval (df = n - 1); a_wins counts seeds where a is lower (better)."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds]
    n = len(diffs)
    if n == 0:
        return None
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else None
    half = T975[n - 1] * sd / math.sqrt(n) if n > 1 and n - 1 in T975 else None
    return {'seeds': seeds, 'diffs': diffs, 'n': n, 'mean': mean, 'sd': sd,
            'ci95': [mean - half, mean + half] if half is not None else None,
            'a_wins': sum(d < 0 for d in diffs), 'significant': half is not None and (mean - half > 0 or mean + half < 0)}


def groups(results):
    """{config_key: {'spec': first run's spec, 'train': {seed: final}, 'val': {...}, 'runs': [...]}} (train runs)."""
    out = {}
    for r in results:
        if r.get('kind') != 'train' or not r.get('train_loss'):
            continue
        g = out.setdefault(config_key(r), {'spec': {k: r[k] for k in ('regime', 'optimizer', 'method', 'state',
                                                                       'sampling', 'K', 'gamma')},
                                           'train': {}, 'val': {}, 'runs': []})
        g['train'][r['seed']] = r['train_loss'][-1]
        g['val'][r['seed']] = r['val_loss'][-1]
        g['runs'].append(r)
    return out


def variant_key(key, **change):
    regime, opt, method, state, sampling, K, g = key.split('-')
    d = dict(regime=regime, optimizer=opt, method=method, state=state, sampling=sampling, K=K[1:], gamma=g[1:])
    d.update({k: str(v) for k, v in change.items()})
    if d['method'] == 'full':
        d.update(state='na', K='0', gamma='0')
    return f"{d['regime']}-{d['optimizer']}-{d['method']}-{d['state']}-{d['sampling']}-K{d['K']}-g{d['gamma']}"


def comparisons(G):
    """(label, key a, key b) for every pair of configurations present that differ in one factor of interest."""
    out = []
    for key in sorted(G):
        regime, opt, method, state, sampling, K, g = key.split('-')
        cand = []
        if method == 'lisa_wor':
            cand += [('lisa_wor - lisa', variant_key(key, method='lisa')),
                     ('lisa_wor - lisa_scale', variant_key(key, method='lisa_scale')),  # both scaled: wor alone
                     ('lisa_wor - lisa_wor_noscale', variant_key(key, method='lisa_wor_noscale')),
                     ('lisa_wor - full', variant_key(key, method='full'))]
            if state == 'keep':
                cand += [('keep - drop (lisa_wor)', variant_key(key, state='drop'))]
            if state == 'offload':
                cand += [('offload - keep (lisa_wor)', variant_key(key, state='keep'))]
            if sampling == 'rr':
                cand += [('rr - iid (lisa_wor)', variant_key(key, sampling='iid'))]
            if K != 'K10' and g == 'g2':
                cand += [(f'lisa_wor {K} - lisa K10', variant_key(key, method='lisa', K=10)),
                         (f'lisa_wor {K} - lisa_wor K10', variant_key(key, K=10))]
        if method == 'lisa':
            cand += [('lisa - full', variant_key(key, method='full'))]
            if state == 'keep':
                cand += [('keep - drop (lisa)', variant_key(key, state='drop'))]
            if sampling == 'rr':
                cand += [('rr - iid (lisa)', variant_key(key, sampling='iid'))]
        if method == 'lisa_scale':
            cand += [('lisa_scale - lisa', variant_key(key, method='lisa'))]
        if method == 'lisa_wor_noscale':
            cand += [('lisa_wor_noscale - lisa', variant_key(key, method='lisa'))]
        if method == 'tensor_wor':
            cand += [('tensor_wor - tensor_iid', variant_key(key, method='tensor_iid'))]
        out += [(label, key, other) for label, other in cand if other in G]
    return out


def summarize(results):
    G = groups(results)
    pairs = []
    for label, a, b in comparisons(G):
        pairs.append({'label': label, 'a': a, 'b': b, 'train': paired_stats(G[a]['train'], G[b]['train']),
                      'val': paired_stats(G[a]['val'], G[b]['val'])})
    rows = []
    for key, g in sorted(G.items()):
        rows.append({'key': key, **g['spec'], 'seeds': sorted(g['train']),
                     'train': g['train'], 'val': g['val'],
                     'train_mean': statistics.fmean(g['train'].values()), 'val_mean': statistics.fmean(g['val'].values()),
                     'epochs': g['runs'][0].get('last_logged_epoch'),
                     'max_iters': g['runs'][0]['eval_iters'][-1],
                     'ms_per_iter': statistics.median([r['median_ms_per_iter'] for r in g['runs'] if r.get('median_ms_per_iter')] or [0]),
                     'curve': curve(g['runs'])})
    return rows, pairs


def curve(runs):
    runs = [r for r in runs if r['eval_iters'] == runs[0]['eval_iters']]
    out = {'iters': runs[0]['eval_iters']}
    for split in ('train_loss', 'val_loss'):
        cols = list(zip(*[r[split] for r in runs]))
        out[split] = {'mean': [statistics.fmean(c) for c in cols], 'min': [min(c) for c in cols], 'max': [max(c) for c in cols]}
    return out


# -----------------------------------------------------------------------------
# report


def f4(x):
    return '-' if x is None else f'{x:+.4f}'


def fmt_pair(p):
    if p is None:
        return '-'
    ci = f"[{p['ci95'][0]:+.4f}, {p['ci95'][1]:+.4f}]" if p['ci95'] else '-'
    return f"{p['mean']:+.4f} {ci}{' *' if p['significant'] else ''}"


def per_seed(values, seeds):
    return ', '.join(f'{values[s]:.4f}' for s in seeds)


def write_tables(path, rows, pairs, meta):
    L = ['# LISA-wor vs LISA study: full tables', '',
         f"Generated by `experiments/study.py` ({meta.get('command', '')}). Runs read from `{meta.get('runs_dir', '')}`.", '',
         'Metric: final loss on train.py\'s fixed evaluation windows ("train" = fixed windows of the training split, '
         'the objective the theory is about; "val" = val.bin). Paired differences a - b over the seeds both have '
         '(same init, data order and eval windows at one seed); negative = a better; [95% t interval]; * = the interval '
         'excludes 0; wins = seeds where a is lower.', '',
         '## Paired differences', '',
         '| comparison | a | b | n | train: mean [95% CI] | train wins | val: mean [95% CI] | per-seed train differences |',
         '|---|---|---|---|---|---|---|---|']
    for p in pairs:
        t, v = p['train'], p['val']
        L.append(f"| {p['label']} | {p['a']} | {p['b']} | {t['n']} | {fmt_pair(t)} | {t['a_wins']}/{t['n']} | "
                 f"{fmt_pair(v)} | {', '.join(f'{d:+.4f}' for d in t['diffs'])} |")
    L += ['', '## Every configuration', '',
          'key = regime-optimizer-method-state-sampling-K-gamma.', '',
          '| configuration | iters | epochs (at the last logged iteration) | seeds | train mean | val mean | train per seed | val per seed | ms/iter |',
          '|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        L.append(f"| {r['key']} | {r['max_iters']} | {r['epochs'] if r['epochs'] is not None else '-'} | {len(r['seeds'])} | "
                 f"{r['train_mean']:.4f} | {r['val_mean']:.4f} | "
                 f"{per_seed(r['train'], r['seeds'])} | {per_seed(r['val'], r['seeds'])} | {r['ms_per_iter']:.0f} |")
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


def plot(path, rows):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = [(reg, opt, st) for reg in ('multi', 'sub') for opt in ('adamw', 'sgd') for st in ('keep', 'drop')]
    by_key = {r['key']: r for r in rows}
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (reg, opt, st) in zip(axes.flat, panels):
        for method, color in (('full', 'k'), ('lisa', 'tab:blue'), ('lisa_wor', 'tab:red')):
            key = config_key(spec(reg, opt, method, st))
            r = by_key.get(key)
            if not r:
                continue
            c = r['curve']
            ax.plot(c['iters'], c['train_loss']['mean'], color=color, label=f"{method} ({len(r['seeds'])} seeds)")
            ax.fill_between(c['iters'], c['train_loss']['min'], c['train_loss']['max'], color=color, alpha=0.2)
        ax.set_title(f'{reg}-epoch, {opt}, state={st}')
        ax.set_xlabel('iteration')
        ax.set_ylabel('train loss (fixed windows)')
        if ax.get_lines():
            ax.legend(fontsize=8)
        ymin = [v for l in ax.get_lines() for v in l.get_ydata()]
        if ymin:
            ax.set_ylim(min(ymin) - 0.05, min(ymin) + 1.0)
    fig.suptitle('LISA vs LISA-wor: training loss on fixed windows, mean over seeds, band = min..max')
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -----------------------------------------------------------------------------
# cause: schedule statistics (no training) and an instrumented copy of train.py's loop


def schedule_stats(method, n_blocks, gamma, K, iters, seed):
    """Which blocks omgd's cycler activates, run on dummy parameters: per-block steps trained over
    the run and per window of M*K steps (a LISA-wor cycle), activations that continue the previous
    period, and idle gaps (steps since a block's last update when it is reactivated)."""
    import torch
    import omgd
    units = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(n_blocks)]
    opt = torch.optim.SGD([p for u in units for p in u], lr=0.0)
    cycler_class = getattr(omgd, 'UnitMask', None) or getattr(omgd, 'LayerCycler')  # the name omgd.py has
    cyc = cycler_class(units, opt, method, gamma, K, 0, 0.5, 'keep', seed)
    M = n_blocks // gamma
    steps = [0] * n_blocks
    window = [[0] * n_blocks for _ in range(math.ceil(iters / (M * K)))]
    last = [None] * n_blocks
    prev, continued, reactivated, gaps, first = set(), 0, 0, [], 0
    for it in range(iters):
        if cyc.step(it):
            for i in cyc.active:
                if i in prev:
                    continued += 1
                elif last[i] is None:
                    first += 1
                else:
                    reactivated += 1
                    gaps.append(it - last[i])
            prev = set(cyc.active)
        for i in cyc.active:
            steps[i] += 1
            window[it // (M * K)][i] += 1
            last[i] = it
    full_windows = window[:iters // (M * K)]
    return {'steps_per_block': steps, 'steps_min': min(steps), 'steps_max': max(steps),
            'window_steps': full_windows,
            'window_spread_mean': statistics.fmean(max(w) - min(w) for w in full_windows) if full_windows else None,
            'never_in_window': sum(min(w) == 0 for w in full_windows),
            'activations': continued + reactivated + first, 'continued': continued, 'reactivated': reactivated,
            'gap_mean': statistics.fmean(gaps) if gaps else None, 'gap_max': max(gaps) if gaps else None}


def probe(s, runs_dir):
    """train.py's loop for one run (same config, build, data, schedule and step; no evaluation),
    instrumented. Writes RUN/probe.json."""
    import torch
    import training
    from bench_memory import TRAIN_DEFAULTS, dataset_vocab
    from configurator import configure
    from dataloader import TokenBatches
    out_dir = os.path.join(runs_dir, run_name(s))
    variant, ns = train_args(s, runs_dir)
    cfg = configure(TRAIN_DEFAULTS, compare.train_command(variant, s['seed'], ns, out_dir)[2:])
    torch.manual_seed(cfg['seed'])
    model, opt, cycler = training.build(cfg, 'cpu', dataset_vocab(cfg))
    torch.manual_seed(cfg['seed'])
    data_dir = os.path.join(ROOT, 'data', cfg['dataset'])
    batches = TokenBatches(os.path.join(data_dir, 'train.bin'), cfg['block_size'], cfg['batch_size'], cfg['sampling'],
                           cfg['data_seed'])

    def get_lr(it):  # train.py's get_lr
        if it < cfg['warmup_iters']:
            return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
        if it > cfg['lr_decay_iters']:
            return cfg['min_lr']
        ratio = (it - cfg['warmup_iters']) / max(1, cfg['lr_decay_iters'] - cfg['warmup_iters'])
        return cfg['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg['learning_rate'] - cfg['min_lr'])

    blocks = [list(b.parameters()) for b in model.blocks]
    outer = [p for p in model.parameters() if p.requires_grad and not any(p is q for b in blocks for q in b)]
    flat = lambda ps: torch.cat([p.detach().reshape(-1) for p in ps])  # noqa: E731
    last = [None] * len(blocks)
    since = [0] * len(blocks)  # steps since the block's current activation began
    prev = set()
    events, updates, losses, clipped = [], [], [], []
    stale_m = {}
    X, Y = batches.next_batch()
    for it in range(cfg['max_iters']):
        lr = get_lr(it)
        for group in opt.param_groups:
            group['lr'] = lr
        if cycler.step(it):
            for i in cycler.active:
                if i in prev:
                    continue
                st = opt.state.get(blocks[i][0], {})
                events.append({'iter': it, 'block': i, 'age': None if last[i] is None else it - last[i],
                               'has_state': bool(st), 'adam_step': float(st['step']) if 'step' in st else None})
                since[i] = 0
                if st and 'exp_avg' in st:
                    stale_m[i] = flat([opt.state[p]['exp_avg'] for p in blocks[i]]).clone()
            prev = set(cycler.active)
        cycler.prefetch(it)
        before = {i: flat(blocks[i]).clone() for i in cycler.active}
        cos = {}

        def hook():
            scale = cycler.scaling()
            sq = sum(float(p.grad.pow(2).sum()) for p in outer if p.grad is not None)
            sq += sum(float(p.grad.pow(2).sum()) / scale ** 2 for i in cycler.active for p in blocks[i] if p.grad is not None)
            clipped.append(cfg['grad_clip'] > 0 and math.sqrt(sq) >= cfg['grad_clip'] * (1 - 1e-4))
            for i, m in list(stale_m.items()):
                g = flat([p.grad for p in blocks[i]])
                cos[i] = float(torch.nn.functional.cosine_similarity(m, g, dim=0))
            stale_m.clear()

        loss, (X, Y) = training.train_step(model, opt, cycler, (X, Y), batches.next_batch, 1, cfg['grad_clip'],
                                           cfg['omgd_scale_after_clip'], before_zero_grad=hook)
        losses.append(float(loss))
        for i in cycler.active:
            after = flat(blocks[i])
            updates.append((it, i, since[i], float((after - before[i]).norm() / before[i].norm())))
            if i in cos:
                events[-1 - [e['block'] for e in reversed(events)].index(i)]['cos_stale_m_new_g'] = cos[i]
            since[i] += 1
            last[i] = it
    # agreement with train.py's log of the same run (its step losses at the logged iterations)
    log_path = os.path.join(runs_dir, run_name({**s, 'kind': 'train'}), 'train.log')
    match = None
    if os.path.exists(log_path):
        parsed = compare.parse_log(open(log_path).read())
        diffs = [abs(round(losses[i], 4) - l) for i, l in zip(parsed['log_iters'], parsed['step_loss']) if i < len(losses)]
        match = {'logged_iters_compared': len(diffs), 'max_abs_diff': max(diffs) if diffs else None}
    by_since = {}
    for _, _, k, u in updates:
        by_since.setdefault(min(k, 10), []).append(u)
    reacts = [e for e in events if e['age'] is not None]
    result = {
        'steps_per_block': [sum(1 for u in updates if u[1] == i) for i in range(len(blocks))],
        'activations': len(events), 'reactivations': len(reacts),
        'fresh_state_at_reactivation': sum(not e['has_state'] for e in reacts),
        'age_mean': statistics.fmean(e['age'] for e in reacts) if reacts else None,
        'age_max': max(e['age'] for e in reacts) if reacts else None,
        'cos_stale_m_new_g_mean': statistics.fmean(c) if (c := [e['cos_stale_m_new_g'] for e in reacts
                                                              if 'cos_stale_m_new_g' in e]) else None,
        'rel_update_by_steps_since_activation': {str(k): statistics.fmean(v) for k, v in sorted(by_since.items())},
        'clipped_fraction': statistics.fmean(clipped), 'final_step_loss_mean_last_48': statistics.fmean(losses[-48:]),
        'train_log_match': match, 'events': events[:400],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'probe.json'), 'w') as f:
        json.dump(result, f)
    return result


def match_text(m):
    if m.get('max_abs_diff') is None:
        return '-'
    return f"{m['max_abs_diff']:.4f} ({m['logged_iters_compared']} iters)"


def write_probe(path, results, seeds, iters):
    L = ['# Cause measurements', '',
         '## Block schedule (omgd.LayerCycler on dummy parameters, no training)', '',
         f'4 blocks, {iters} iterations, seeds {seeds[0]}..{seeds[-1]}; per seed, then averaged. "spread per cycle": '
         'mean over windows of M*K steps (one LISA-wor cycle) of (most - fewest steps a block trained in it); '
         '"blocks idle a whole cycle": windows in which some block never trained; "continued": activations where '
         'the block was already active in the previous period (its optimizer state survives even under drop); '
         '"gap": steps since a block\'s last update when it is reactivated (the age of its Adam moments under keep).', '',
         '| method | K | gamma | steps per block (min..max over blocks, mean over seeds) | spread per cycle | '
         'windows with an idle block | activations | continued | reactivated | mean gap | max gap |',
         '|---|---|---|---|---|---|---|---|---|---|---|']
    for method in ('lisa', 'lisa_wor'):
        for K, g in ((10, 2), (48, 2), (24, 2), (1, 2), (50, 2), (10, 1)):
            st = [schedule_stats(method, 4, g, K, iters, s) for s in seeds]
            mean = lambda k: statistics.fmean(x[k] for x in st if x[k] is not None) if any(x[k] is not None for x in st) else float('nan')  # noqa: E731
            L.append(f"| {method} | {K} | {g} | {mean('steps_min'):.0f}..{mean('steps_max'):.0f} | "
                     f"{mean('window_spread_mean'):.1f} | {mean('never_in_window'):.1f} | {mean('activations'):.0f} | "
                     f"{mean('continued'):.0f} | {mean('reactivated'):.0f} | {mean('gap_mean'):.1f} | {mean('gap_max'):.0f} |")
    probes = [r for r in results if r.get('kind') == 'probe']
    if probes:
        L += ['', '## Instrumented runs (multi-epoch, AdamW, seed 0; train.py\'s loop re-run in process)', '',
              'rel. update = ||block after - block before|| / ||block before|| of one step, by steps since the '
              'block\'s activation (0 = its first step after a (re)activation); cos = cosine between the stale Adam '
              'first moment kept at reactivation and the first new gradient (keep only); clipped = fraction of steps '
              'whose gradient norm reached grad_clip; match = max |probe loss - train.py logged loss| at the logged '
              'iterations (4 decimals).', '',
              '| method | state | steps per block | reactivations | fresh state | mean age (steps) | cos(stale m, new g) | '
              'rel. update step 0 | step 1 | steps >= 10 | clipped | mean loss last epoch | match |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
        for r in sorted(probes, key=lambda r: (r['state'], r['method'])):
            u = r['rel_update_by_steps_since_activation']
            m = r.get('train_log_match') or {}
            L.append(f"| {r['method']} | {r['state']} | {r['steps_per_block']} | {r['reactivations']} | "
                     f"{r['fresh_state_at_reactivation']} | {r['age_mean']:.1f} | "
                     f"{'-' if r['cos_stale_m_new_g_mean'] is None else format(r['cos_stale_m_new_g_mean'], '.3f')} | "
                     f"{u.get('0', float('nan')):.2e} | {u.get('1', float('nan')):.2e} | {u.get('10', float('nan')):.2e} | "
                     f"{r['clipped_fraction']:.2f} | {r['final_step_loss_mean_last_48']:.4f} | "
                     f"{match_text(m)} |")
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


# -----------------------------------------------------------------------------


def resolve_policy(policy, runs_dir):
    if policy != 'auto':
        return policy
    G = groups(all_results(runs_dir))
    means = {}
    for st in ('keep', 'drop'):
        g = G.get(config_key(spec('multi', 'adamw', 'lisa_wor', st)))
        if g and g['train']:
            means[st] = statistics.fmean(g['train'].values())
    return min(means, key=means.get) if len(means) == 2 else 'keep'


def report(runs_dir, report_dir, seeds, command):
    results = all_results(runs_dir)
    rows, pairs = summarize(results)
    os.makedirs(report_dir, exist_ok=True)
    meta = {'command': command, 'runs_dir': os.path.relpath(runs_dir, ROOT), 'base': BASE, 'optimizers': OPTIMIZERS,
            'regimes': REGIMES, 'multi_tokens': MULTI_TOKENS, 'machine': compare.machine(),
            'policy_auto': resolve_policy('auto', runs_dir)}
    with open(os.path.join(report_dir, 'study.json'), 'w') as f:
        json.dump({'meta': meta, 'rows': rows, 'pairs': pairs,
                   'probes': [{k: v for k, v in r.items() if k != 'events'} for r in results if r.get('kind') == 'probe'],
                   'runs': [{k: r.get(k) for k in ('regime', 'optimizer', 'method', 'state', 'sampling', 'K', 'gamma',
                                                  'seed', 'wall_s', 'command', 'median_ms_per_iter')}
                            for r in results if r.get('kind') == 'train']}, f, indent=1)
    write_tables(os.path.join(report_dir, 'study_tables.md'), rows, pairs, meta)
    write_probe(os.path.join(report_dir, 'study_probe.md'), results, seeds, REGIMES['multi']['max_iters'])
    if rows:
        plot(os.path.join(report_dir, 'study_loss.png'), rows)
    return rows, pairs


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--stages', default=','.join(STAGES), help=f'comma-separated, in order; of {",".join(STAGES)}')
    ap.add_argument('--seeds', type=int, default=5, help='seeds 0..N-1')
    ap.add_argument('--jobs', type=int, default=2, help='runs at a time (each OMP_NUM_THREADS=1)')
    ap.add_argument('--policy', default='auto', help="state policy of the later stages: keep, drop or auto")
    ap.add_argument('--runs_dir', default=os.path.join(ROOT, 'out', 'study', 'runs'))
    ap.add_argument('--report_dir', default=os.path.join(ROOT, 'out', 'study'))
    ap.add_argument('--report_only', action='store_true')
    ap.add_argument('--probe_spec', default='', help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    runs_dir = os.path.abspath(args.runs_dir)
    if args.probe_spec:
        probe(json.loads(args.probe_spec), runs_dir)
        return 0
    seeds = list(range(args.seeds))
    command = ' '.join(['python experiments/study.py'] + (sys.argv[1:] if argv is None else list(argv)))
    if not args.report_only:
        make_multi_dataset(runs_dir)
        for stage in [s.strip() for s in args.stages.split(',') if s.strip()]:
            if stage not in STAGES:
                sys.exit(f'error: unknown stage {stage!r}; choose from {", ".join(STAGES)}')
            specs = stage_specs(stage, seeds, resolve_policy(args.policy, runs_dir))
            t0 = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage}: {len(specs)} runs", flush=True)
            run_specs(specs, runs_dir, args.jobs)
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage} done in {time.time() - t0:.0f} s", flush=True)
            report(runs_dir, args.report_dir, seeds, command)
    report(runs_dir, args.report_dir, seeds, command)
    print(f"wrote study.json, study_tables.md, study_probe.md, study_loss.png in {args.report_dir}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
