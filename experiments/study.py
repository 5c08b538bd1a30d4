"""
When does LISA-wor beat LISA? A paired, resumable study through train.py, and the measurements
that explain what it finds.

Every training run is a `python train.py ...` subprocess (experiments/runner.py); a run's seed s
sets --seed, --data_seed and --omgd_seed, so at one seed every configuration starts from the same
weights, sees the same data order (for the same sampling) and is evaluated on the same fixed
windows: differences are paired by seed (experiments/stats.py). The metric the theory is about is
the training loss; train.py's eval 'train' split draws the same fixed windows of the training set
at every evaluation, so 'train loss' below is the loss on a fixed set of training windows (and
'val loss' the same on val.bin).

Models: GPT, n_embd 32, 2 heads, N_L blocks; 4 blocks: block_size 64, batch 32; 8 and 12 blocks:
block_size 32, batch 8 (DEPTH_ARGS). LISA and LISA-wor train gamma blocks for K iterations; M =
N_L / gamma periods make a LISA-wor cycle.

Regimes (the dataset and the iterations of a run):
- multi: a prefix of data/shakespeare_char/train.bin (written once to RUNS/../data/
  shakespeare_char_<N>k with the full val.bin and meta.pkl): MULTI_TOKENS for 4 blocks (48
  iterations per epoch), M4_MULTI_TOKENS for 8 and 12 (75 iterations per epoch).
- sub: the whole corpus (4.46M tokens), a fraction of one epoch.
- pre: the whole corpus, full AdamW: the model the fine-tuning runs start from (checkpoint kept).
- ft: fine-tuning the 'pre' model on another text in the same characters: CPython's own reference
  documentation (pydoc_data.topics, shipped with Python), characters outside Shakespeare's set
  dropped, written once to RUNS/../data/pydoc_char (FT_TOKENS train, a tenth of that val). Each run starts from a checkpoint
  at iteration 0 (the pre-trained weights, a fresh optimizer, cycler and data order for its own
  config) that train.py resumes (--init_from=resume).

Stages, in the order they run (a stage's runs go seed-major, so a stage stopped part-way still pairs):
  M = 2 (4 blocks, gamma 2, K 10; multi 480 iterations = 10 epochs, sub 240):
  core_multi_adamw, core_multi_sgd, core_sub_adamw, core_sub_sgd: lisa, lisa_wor x keep, drop
         (+ full for AdamW)
  aligned: K = one epoch (every (block group, window) pair once per cycle of M epochs); lisa at the
           same K for pairing (aligned_cycle: K = epoch / M, one cycle per epoch)
  probe: in-process instrumented copies of train.py's loop (seed 0; Adam-state age at reactivation,
         update norms after reactivation, clipping), checked against train.py's log
  offload: lisa_wor with omgd_state=offload, to check it equals keep bitwise (seed 0)
  methods_sgd: lisa_scale, lisa_wor_noscale with SGD (multi): without replacement vs the N_L/gamma scale
  iid: lisa, lisa_wor with i.i.d. sampling (multi)
  methods: lisa_scale, lisa_wor_noscale, tensor_wor, tensor_iid (multi, AdamW)
  sweep: K in {1, 10, 50} x gamma in {1, 2} for lisa vs lisa_wor (multi, AdamW)
  k1_keep: the sweep's K=1, gamma=2 cell under the other state policy
  M = 4 (8 blocks gamma 2, and 12 blocks gamma 3 as the paper's GPT-2; K 3, 600 iterations = 50
  cycles: multi 8 epochs, sub 0.04 epoch):
  m4_multi_adamw: lisa, lisa_wor x keep, drop
  m4_multi_sgd: lisa, lisa_scale, lisa_wor (SGD with momentum)
  m4_pre, m4_ft: 12 blocks pre-trained on Shakespeare (full AdamW, 2,000 iterations, seed 0), fine-tuned
         600 iterations (8 epochs) on pydoc_char: full, lisa, lisa_wor at gamma 3, K 3 (50 cycles)
  m4_sub_adamw: m4_multi_adamw's runs, sub-epoch
  m4_full: full AdamW for m4_multi_adamw's models (the reference)
  m4_probe: the instrumented loop for m4_multi_adamw's runs (seed 0)
  ft_sweep: lisa, lisa_wor fine-tuning at K 1 and 6 (gamma 3), and gamma 1 and 6 (K 3)
  k6_keep: the 12-block keep cells of m4_multi_adamw and m4_sub_adamw at K 6 (lisa, lisa_wor)
  k6_more: K 6, multi-epoch: 8 blocks under keep, 12 blocks under drop (lisa, lisa_wor)
  m8_multi_adamw: M = 8 (8 blocks, gamma 1, K 2, 800 iterations = 50 cycles): lisa, lisa_wor x keep, drop
  Issue 31, "does the period K decide?" (K31_STAGES; 12 blocks, gamma 3, AdamW, lisa and lisa_wor;
  pre-registered in experiments/README.md with seeds 100-109: --first_seed=100 --seeds=10):
  k31_keep: multi, 600 iterations, keep: K in {3, 6, 12, 25}, and K 3 with beta1 0.5 and 0
  k31_k100: the paper's K = 100, keep: 10,000 iterations (25 cycles) on the 'paper' prefix (5.4 epochs)
  k31_drop, k31_k100_drop: the same under drop
  Their report adds NAME_tests.md (the five confirmatory tests, the exploratory contrasts, every cell).
'keep' for the later stages is the policy under which lisa_wor reached the lower mean train loss in
core_multi_adamw (M = 2 stages) or m4_multi_adamw (M = 4 stages) (--policy=auto), or the one named.

    python experiments/study.py --stages=m4_multi_adamw,m4_multi_sgd,m4_pre,m4_ft --name=study_m4 --max_load=5
    python experiments/study.py --stages=m4_multi_sgd --layers=8 --name=study_m4   # the 8-block runs only
    python experiments/study.py --stages=core_multi_adamw,probe --seeds=5 --name=study_m2
    python experiments/study.py --report_only --name=study_m4 --report_dir=results
    python experiments/study.py --stages=k31_keep,k31_k100 --first_seed=100 --seeds=10 --jobs=1 --stop_at=10:42 --name=study_k31

--stop_at=HH:MM (UTC) starts no seed group after that time (a stopped stage keeps complete pairs).

Finished runs are skipped (resume). Writes REPORT_DIR/NAME.json (every run's curves and the paired
statistics), NAME_tables.md, NAME_loss.png and NAME_probe.md (default REPORT_DIR: out/study).
"""
import argparse
import functools
import json
import math
import os
import shutil
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

MULTI_TOKENS = 100_000
FT_TOKENS = 20_000
# model and schedule of every run (train.py keys); the optimizer's and the regime's own values come
# from OPTIMIZERS and REGIME_ARGS, the geometry (n_layer, gamma, K) and iterations from the spec
BASE = dict(n_head=2, n_embd=32, block_size=64, batch_size=32, dropout=0.0, learning_rate=3e-3,
            min_lr=3e-4, warmup_iters=20, weight_decay=0.1, grad_clip=1.0, eval_iters=8, log_interval=12,
            omgd_period=10, omgd_state='keep')
OPTIMIZERS = {'adamw': {}, 'sgd': dict(learning_rate=0.1, min_lr=0.01)}
REGIME_ARGS = {'ft': dict(learning_rate=1e-3, min_lr=1e-4)}  # fine-tuning: a third of the pre-training rate
ITERS = {'multi': 480, 'sub': 240, 'pre': 2000, 'ft': 600}  # M = 2 stages' iterations, and pre / ft
M4 = ((8, 2), (12, 3))  # (N_L, gamma) with N_L / gamma = 4
# the deeper models see 8 x 32 tokens per step (a quarter of the 4-block study's: CPU time), on a
# multi-epoch prefix as many steps long per epoch as the 4-block study's
DEPTH_ARGS = {L: dict(batch_size=8, block_size=32) for L in (8, 12)}
M4_MULTI_TOKENS = 20_000
M4_K, M4_ITERS = 3, 600  # 50 cycles of M * K = 12 iterations
FT_GEOMETRY = dict(n_layer=12, gamma=3, K=3, iters=600)  # the paper's CoLA ablation: gamma, K in 1..6
FT_SWEEP = (dict(K=1), dict(K=6), dict(gamma=1), dict(gamma=6))  # M = 12 at gamma 1, 2 at gamma 6
EVALS = 10  # evaluations per run (and one at iteration 0)
# the 'paper' regime: a prefix of train.bin that 10,000 iterations of the deeper models' 8 x 32 tokens
# pass over 5.4 times, as the paper's GPT-2 run (100k iterations x 491,520 tokens) passes over
# OpenWebText's ~9B tokens (experiments/README.md, "Does the period K decide?")
PAPER_TOKENS = 470_000
# Issue 31, "does the period K decide?": the pre-registered cells (experiments/README.md), 12 blocks,
# gamma 3, AdamW, lisa and lisa_wor at each, seed-major; run with --first_seed=100 --seeds=10.
# A cell changes spec()'s fields; beta1 None is train.py's 0.9.
K31_GEOMETRY = dict(n_layer=12, gamma=3)
K31_AXIS = (3, 6, 12, 25)  # K at 600 iterations (the same iterations for every K, not the same cycles)
K31_BETA1 = (0.5, 0.0)  # the K = 3 keep cell without most / all of the momentum (0.9 is the axis' own run)
K31_STAGES = {
    'k31_keep': [dict(regime='multi', iters=M4_ITERS, state='keep', K=K) for K in K31_AXIS]
                + [dict(regime='multi', iters=M4_ITERS, state='keep', K=3, beta1=b) for b in K31_BETA1],
    'k31_k100': [dict(regime='paper', iters=10_000, state='keep', K=100)],  # 25 cycles of 4 periods
    'k31_drop': [dict(regime='multi', iters=M4_ITERS, state='drop', K=K) for K in K31_AXIS],
    'k31_k100_drop': [dict(regime='paper', iters=10_000, state='drop', K=100)],
}
PRETRAIN = dict(regime='pre', optimizer='adamw', method='full', n_layer=12, iters=2000, seed=0)


# -----------------------------------------------------------------------------
# run specifications


def spec(regime, optimizer, method, state='keep', sampling='rr', K=None, gamma=None, seed=0, kind='train',
         n_layer=4, iters=None, beta1=None):
    full = method == 'full'
    return {'regime': regime, 'optimizer': optimizer, 'method': method, 'state': 'na' if full else state,
            'sampling': sampling, 'K': 0 if full else (K or BASE['omgd_period']),
            'gamma': 0 if full else (gamma or 2), 'n_layer': n_layer, 'iters': iters or ITERS[regime],
            'seed': seed, 'kind': kind, 'beta1': beta1}


KEY_FIELDS = ('n_layer', 'regime', 'iters', 'optimizer', 'method', 'state', 'sampling', 'K', 'gamma', 'beta1')


def config_key(s):
    """The configuration without the seed: runs with the same key and different seeds are a group
    (a beta1 other than train.py's is appended; runs from before beta1 was a field have none)."""
    beta1 = s.get('beta1')
    return (f"L{s['n_layer']}-{s['regime']}{s['iters']}-{s['optimizer']}-{s['method']}-{s['state']}-{s['sampling']}"
            f"-K{s['K']}-g{s['gamma']}" + ('' if beta1 is None else f'-beta{beta1}'))


def run_name(s):
    return f"{'probe-' if s['kind'] == 'probe' else ''}{config_key(s)}_s{s['seed']}"


def data_root(runs_dir):
    return os.path.join(os.path.dirname(os.path.abspath(runs_dir)), 'data')


def multi_dataset(runs_dir, n_tokens=None):
    return os.path.join(data_root(runs_dir), f'shakespeare_char_{(n_tokens or MULTI_TOKENS) // 1000}k')


def ft_dataset(runs_dir):
    return os.path.join(data_root(runs_dir), 'pydoc_char')


def shakespeare_char():
    from dataloader import data_dir, prepare_if_embedded
    prepare_if_embedded('shakespeare_char')
    return data_dir('shakespeare_char')


def make_multi_dataset(runs_dir, n_tokens=None):
    """The multi-epoch split: the first n_tokens tokens of train.bin, the full val.bin, the same meta.pkl."""
    import numpy as np
    dst = multi_dataset(runs_dir, n_tokens)
    if os.path.exists(os.path.join(dst, 'meta.pkl')):
        return dst
    source = shakespeare_char()
    os.makedirs(dst, exist_ok=True)
    train = np.memmap(os.path.join(source, 'train.bin'), dtype=np.uint16, mode='r')
    np.array(train[:n_tokens or MULTI_TOKENS]).tofile(os.path.join(dst, 'train.bin'))
    shutil.copyfile(os.path.join(source, 'val.bin'), os.path.join(dst, 'val.bin'))
    shutil.copyfile(os.path.join(source, 'meta.pkl'), os.path.join(dst, 'meta.pkl'))  # last: marks it complete
    return dst


def make_ft_dataset(runs_dir, n_tokens=None):
    """The fine-tuning text: CPython's reference documentation (pydoc_data.topics, in key order) in
    shakespeare_char's characters (others dropped): n_tokens train, n_tokens // 10 val, same meta.pkl."""
    import numpy as np
    from pydoc_data.topics import topics

    from data.tokenizer import read_meta  # data only: a meta.pkl never runs code
    dst = ft_dataset(runs_dir)
    if os.path.exists(os.path.join(dst, 'meta.pkl')):
        return dst
    source = shakespeare_char()
    stoi = read_meta(source)['stoi']
    n_tokens = n_tokens or FT_TOKENS
    ids = [stoi[c] for c in ''.join(topics[k] for k in sorted(topics)) if c in stoi]
    n_val = n_tokens // 10
    if len(ids) < n_tokens + n_val:
        raise ValueError(f"pydoc_data.topics has {len(ids)} usable characters, fewer than {n_tokens + n_val}")
    os.makedirs(dst, exist_ok=True)
    np.array(ids[:n_tokens], dtype=np.uint16).tofile(os.path.join(dst, 'train.bin'))
    np.array(ids[n_tokens:n_tokens + n_val], dtype=np.uint16).tofile(os.path.join(dst, 'val.bin'))
    shutil.copyfile(os.path.join(source, 'meta.pkl'), os.path.join(dst, 'meta.pkl'))  # last: marks it complete
    return dst


def dataset(s, runs_dir):
    if s['regime'] == 'paper':
        return multi_dataset(runs_dir, PAPER_TOKENS)
    if s['regime'] == 'multi':
        return multi_dataset(runs_dir, M4_MULTI_TOKENS if s['n_layer'] in DEPTH_ARGS else MULTI_TOKENS)
    return ft_dataset(runs_dir) if s['regime'] == 'ft' else 'shakespeare_char'



def train_args(s, runs_dir):
    """train.py's arguments for spec s (runner.train_argv adds the CPU flags and the out_dir)."""
    flags = dict(BASE, n_layer=s['n_layer'], **DEPTH_ARGS.get(s['n_layer'], {}), **OPTIMIZERS[s['optimizer']],
                 **REGIME_ARGS.get(s['regime'], {}))
    flags.update(max_iters=s['iters'], lr_decay_iters=s['iters'], eval_interval=s['iters'] // EVALS)
    if s['method'] != 'full':
        flags.update(omgd_period=s['K'], omgd_gamma=s['gamma'], omgd_state=s['state'])
    if s.get('beta1') is not None:
        flags['beta1'] = s['beta1']
    flags['dataset'] = dataset(s, runs_dir)
    args = [f"--method={s['method']}", f"--sampling={s['sampling']}",
            f"--seed={s['seed']}", f"--data_seed={s['seed']}", f"--omgd_seed={s['seed']}", '--decay_lr=True']
    args += [f'--{k}={v}' for k, v in flags.items()]
    args += [f"--optimizer={s['optimizer']}", '--overwrite=True']
    return args + (['--init_from=resume'] if s['regime'] == 'ft' else [])


def stage_specs(stage, seeds, policy='keep'):
    """The runs of one stage, seed-major."""
    if stage == 'm4_pre':  # what every fine-tuning run starts from: one model
        return [spec(**PRETRAIN)]
    out = []
    for seed in seeds:
        S = lambda *a, **k: spec(*a, seed=seed, **k)  # noqa: E731
        if stage in K31_STAGES:
            out += [S(optimizer='adamw', method=m, **K31_GEOMETRY, **cell) for cell in K31_STAGES[stage]
                    for m in ('lisa', 'lisa_wor')]
        elif stage.startswith('core_'):
            _, regime, opt = stage.split('_')
            out += [S(regime, opt, 'full')] if opt == 'adamw' else []  # the full-training reference: AdamW only (time)
            out += [S(regime, opt, m, st) for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage in ('m4_multi_adamw', 'm4_sub_adamw'):
            regime = stage.split('_')[1]
            for L, g in M4:
                G = dict(n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS)
                out += [S(regime, 'adamw', m, st, **G) for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage == 'm4_full':  # the full-training reference of m4_multi_adamw
            out += [S('multi', 'adamw', 'full', n_layer=L, iters=M4_ITERS) for L, _ in M4]
        elif stage == 'm4_multi_sgd':  # SGD is not scale-invariant: lisa_scale separates the scale's share
            for L, g in M4:
                out += [S('multi', 'sgd', m, policy, n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS)
                        for m in ('lisa', 'lisa_scale', 'lisa_wor')]
        elif stage == 'm4_ft':
            G = dict(FT_GEOMETRY)
            out += [S('ft', 'adamw', 'full', n_layer=G['n_layer'], iters=G['iters'])]
            out += [S('ft', 'adamw', m, policy, **G) for m in ('lisa', 'lisa_wor')]
        elif stage == 'm8_multi_adamw':  # M = 8: one block of 8 at a time, 50 cycles of 16 steps
            G = dict(n_layer=8, gamma=1, K=2, iters=800)
            out += [S('multi', 'adamw', m, st, **G) for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage == 'k6_keep':  # m4's 12-block keep cells with periods twice as long (25 cycles)
            L, g = M4[1]
            out += [S(regime, 'adamw', m, 'keep', n_layer=L, gamma=g, K=2 * M4_K, iters=M4_ITERS)
                    for regime in ('multi', 'sub') for m in ('lisa', 'lisa_wor')]
        elif stage == 'k6_more':  # k6_keep's K = 6 at 8 blocks under keep, and at 12 blocks under drop
            out += [S('multi', 'adamw', m, st, n_layer=L, gamma=g, K=2 * M4_K, iters=M4_ITERS)
                    for (L, g), st in ((M4[0], 'keep'), (M4[1], 'drop')) for m in ('lisa', 'lisa_wor')]
        elif stage == 'ft_sweep':  # the CoLA ablation's axes around m4_ft's cell: K at gamma 3, gamma at K 3
            G = dict(FT_GEOMETRY)
            out += [S('ft', 'adamw', m, policy, **{**G, **change}) for change in FT_SWEEP for m in ('lisa', 'lisa_wor')]
        elif stage == 'm4_probe' and seed == seeds[0]:
            out += [S('multi', 'adamw', m, st, kind='probe', n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS)
                    for L, g in M4[::-1] for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage == 'probe' and seed == seeds[0]:
            out += [S('multi', 'adamw', m, st, kind='probe') for st in ('keep', 'drop') for m in ('lisa', 'lisa_wor')]
        elif stage in ('aligned', 'aligned_cycle'):
            # 48 steps per epoch: aligned: K = one epoch, so a cycle of M = N_L / gamma periods is M
            # epochs and every (block group, window) pair is visited once per cycle (up to each epoch's
            # random window offset); aligned_cycle: K = epoch / M, one cycle per epoch
            epoch = ITERS['multi'] // 10
            K = epoch if stage == 'aligned' else epoch // 2
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
          'methods_sgd', 'aligned_cycle', 'iid', 'methods', 'sweep', 'k1_keep',
          'm4_multi_adamw', 'm4_multi_sgd', 'm4_pre', 'm4_ft', 'm4_sub_adamw', 'm4_full', 'm4_probe', 'ft_sweep',
          'm8_multi_adamw', 'k6_keep', 'k6_more', *K31_STAGES)


# -----------------------------------------------------------------------------
# running, resumable (runner.run_all: a run with a result.json and no error is skipped)


def finetune_start(s, out_dir, runs_dir):
    """RUN/ckpt.pt at iteration 0 for fine-tuning run s: the pre-trained weights, and the
    optimizer, cycler, data position and RNG a fresh run of s's own config starts with, in
    train.py's checkpoint format (resumed with --init_from=resume)."""
    import torch

    import checkpoint
    import training
    pre = os.path.join(runs_dir, run_name(spec(**PRETRAIN)), 'ckpt.pt')
    if not os.path.exists(pre):
        raise FileNotFoundError(f"{pre} not found: the pre-training run must finish first")
    pretrained = checkpoint.read(pre)  # weights_only, as every checkpoint read
    cfg = runner.config_of(train_args(s, runs_dir), out_dir)
    torch.manual_seed(cfg['seed'])
    model, opt, cycler = training.build(cfg, 'cpu', pretrained['model_args']['vocab_size'])
    model.load_state_dict(pretrained['model'])
    from dataloader import open_splits
    train_batches, _ = open_splits(cfg['dataset'], cfg['block_size'], cfg['batch_size'], cfg['sampling'],
                                   cfg['data_seed'])
    os.makedirs(out_dir, exist_ok=True)
    from distributed import Ranks
    objects = {'model': model, 'optimizer': opt, 'cycler': cycler, 'scaler': training.grad_scaler(cfg, 'cpu')}
    values = {'data': train_batches.state_dict(), 'model_args': pretrained['model_args'], 'iter_num': 0,
              'best_val_loss': 1e9, 'config': cfg, 'wandb_id': None}
    checkpoint.save(os.path.join(out_dir, 'ckpt.pt'), Ranks(), objects, values)  # train.py's writer


def train_launch(s, out_dir, runs_dir):
    if s['regime'] == 'ft':
        try:
            finetune_start(s, out_dir, runs_dir)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            return {'error': f'fine-tuning start: {type(e).__name__}: {str(e)[:200]}'}
    return runner.run_train(train_args(s, runs_dir), out_dir, s['iters'], keep_checkpoints=s['regime'] == 'pre')


def probe_launch(s, out_dir, runs_dir):
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


def default_launch(s, out_dir, runs_dir):
    return probe_launch(s, out_dir, runs_dir) if s['kind'] == 'probe' else train_launch(s, out_dir, runs_dir)


def run_specs(specs, runs_dir, jobs=2, launch=default_launch, max_load=None):
    """Run the specs not finished yet, `jobs` at a time (runner.run_all); {run_name: result} for
    every saved result."""
    return runner.run_all([{**s, 'name': run_name(s)} for s in specs], runs_dir,
                          lambda job, out_dir: launch(job, out_dir, runs_dir), jobs, max_load)


def result_path(runs_dir, s):
    return runner.result_path(runs_dir, run_name(s))


def seed_groups(specs):
    """specs split into consecutive runs of one seed (a seed-major stage: one group per seed)."""
    out = []
    for s in specs:
        if out and out[-1][0]['seed'] == s['seed']:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def stop_time(hhmm, now=None):
    """The epoch time of the next HH:MM UTC at or after `now` (today's, or tomorrow's once it has passed
    by more than 12 hours: a deadline set just after midnight for the evening before is past)."""
    import datetime
    h, m = (int(x) for x in hhmm.split(':'))
    if not (0 <= h < 24 and 0 <= m < 60):
        raise ValueError(hhmm)
    now = datetime.datetime.now(datetime.timezone.utc) if now is None else now
    t = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if (now - t).total_seconds() > 12 * 3600:
        t += datetime.timedelta(days=1)
    return t.timestamp()


# -----------------------------------------------------------------------------
# statistics


def groups(results):
    """{config_key: {'spec': the configuration, 'train': {seed: final}, 'val': {...}, 'runs': [...]}} (train runs)."""
    out = {}
    for r in results:
        if r.get('kind') != 'train' or not r.get('train_loss') or r.get('regime') == 'pre':
            continue
        g = out.setdefault(config_key(r), {'spec': {k: r.get(k) for k in KEY_FIELDS}, 'train': {}, 'val': {}, 'runs': []})
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
            cand += [('lisa_wor - lisa', other(s, method='lisa')),
                     ('lisa_wor - lisa_scale', other(s, method='lisa_scale')),  # both scaled: without replacement alone
                     ('lisa_wor - lisa_wor_noscale', other(s, method='lisa_wor_noscale')),
                     ('lisa_wor - full', other(s, method='full'))]
            if state == 'keep':
                cand += [('keep - drop (lisa_wor)', other(s, state='drop'))]
            if state == 'offload':
                cand += [('offload - keep (lisa_wor)', other(s, state='keep'))]
            if s['sampling'] == 'rr':
                cand += [('rr - iid (lisa_wor)', other(s, sampling='iid'))]
            if s['n_layer'] == 4 and s['K'] != 10 and s['gamma'] == 2:
                cand += [(f"lisa_wor K{s['K']} - lisa K10", other(s, method='lisa', K=10)),
                         (f"lisa_wor K{s['K']} - lisa_wor K10", other(s, K=10))]
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
    pairs = [{'label': label, 'a': a, 'b': b, 'train': stats.paired(G[a]['train'], G[b]['train']),
              'val': stats.paired(G[a]['val'], G[b]['val'])} for label, a, b in comparisons(G)]
    rows = []
    for key, g in sorted(G.items()):
        rows.append({'key': key, **g['spec'], 'seeds': sorted(g['train']),
                     'train': g['train'], 'val': g['val'],
                     'train_mean': statistics.fmean(g['train'].values()), 'val_mean': statistics.fmean(g['val'].values()),
                     'epochs': g['runs'][0].get('last_logged_epoch'),
                     'max_iters': g['runs'][0]['eval_iters'][-1],
                     'ms_per_iter': statistics.median([r['median_ms_per_iter'] for r in g['runs'] if r.get('median_ms_per_iter')] or [0]),
                     'wall_s': sum(r.get('wall_s') or 0 for r in g['runs']),
                     'curve': curve(g['runs'])})
    return rows, pairs


def curve(runs):
    runs = [r for r in runs if r['eval_iters'] == runs[0]['eval_iters']]
    return {'iters': runs[0]['eval_iters'], **{split: stats.band([r[split] for r in runs])
                                               for split in ('train_loss', 'val_loss')}}


# -----------------------------------------------------------------------------
# issue 31: the pre-registered tests (experiments/README.md, "Does the period K decide?")

K31_MARGIN = 0.01  # an interval inside (-margin, +margin) refutes a predicted effect: "none that matters"
K31_MIN_SEEDS = 3  # a test with fewer complete seeds is reported as not run


def k31_cell(**change):
    """A k31 cell's fields (12 blocks, gamma 3, AdamW; the K axis' regime unless changed)."""
    return {**dict(regime='multi', iters=M4_ITERS, state='keep', K=3, beta1=None), **change}


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


AXIS_KEEP = [k31_cell(K=K) for K in K31_AXIS]
AXIS_DROP = [k31_cell(K=K, state='drop') for K in K31_AXIS]
# (id, claim, kind, cells, predicted sign of the contrast): the five confirmatory tests, in the plan's words
K31_TESTS = (
    ('H1a', 'the K = 3 loss replicates: D(K 3, keep) > 0', 'd', [k31_cell(K=3)], +1),
    ('H1b', 'the K = 6 win replicates: D(K 6, keep) < 0', 'd', [k31_cell(K=6)], -1),
    ('H1c', 'D falls as K grows (keep): slope of D on log2 K over K 3, 6, 12, 25 < 0', 'slope', AXIS_KEEP, -1),
    ('H2', 'the momentum horizon: D(K 3, keep, beta1 0.9) - D(beta1 0) > 0', 'dd',
     [k31_cell(K=3), k31_cell(K=3, beta1=0.0)], +1),
    ('H3', "the paper's K = 100 (keep, 10,000 iterations): D < 0", 'd',
     [k31_cell(regime='paper', iters=10_000, K=100)], -1),
)
# exploratory (labelled so in every table): the same contrasts elsewhere
K31_EXPLORE = (
    ('E1', 'D falls as K grows (drop): slope of D on log2 K over K 3, 6, 12, 25', 'slope', AXIS_DROP, 0),
    ('E2', 'D(K 3, keep, beta1 0.9) - D(beta1 0.5)', 'dd', [k31_cell(K=3), k31_cell(K=3, beta1=0.5)], 0),
    ('E3', "K = 100 under drop: D", 'd', [k31_cell(regime='paper', iters=10_000, K=100, state='drop')], 0),
    ('E4', 'D(K 6, keep) - D(K 3, keep)', 'dd', [k31_cell(K=6), k31_cell(K=3)], 0),
)


def k31_cells():
    """Every k31 cell once, in stage order."""
    out = []
    for cells in K31_STAGES.values():
        out += [c for c in (k31_cell(**c) for c in cells) if c not in out]
    return out


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
            row[split] = {'n': n, 'seeds': sorted(v), 'values': [v[s] for s in sorted(v)],
                          'mean': ci[0] if ci else None, 'ci95': list(ci[1:]) if ci else None,
                          'ci99': list(ci99[1:]) if ci99 else None}
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
            row[f'{split}_means'] = {m: statistics.fmean(G[key(m)][split].values()) if key(m) in G else None
                                     for m in ('lisa', 'lisa_wor')}
        cells.append(row)
    return {'margin': K31_MARGIN, 'min_seeds': K31_MIN_SEEDS, 'tests': tests, 'exploratory': explore, 'cells': cells}


def fmt_ci(r, nd=4):
    if r['mean'] is None:
        return f"not run ({r['n']} complete seeds)" if r['n'] else 'not run'
    return f"{r['mean']:+.{nd}f} [{r['ci95'][0]:+.{nd}f}, {r['ci95'][1]:+.{nd}f}]"


def cell_name(c):
    return (f"K {c['K']}, {c['state']}" + ('' if c['beta1'] is None else f", beta1 {c['beta1']}")
            + (f", {c['regime']} {c['iters']}" if (c['regime'], c['iters']) != ('multi', M4_ITERS) else ''))


def write_k31(path, k31, meta):
    L = ['# Does the period K decide? Pre-registered tests (issue 31)', '',
         f"Generated by `experiments/study.py` ({meta.get('command', '')}); runs in `{meta.get('runs_dir', '')}`; "
         f"{meta.get('machine', '')}, one run at a time, one thread each (OMP_NUM_THREADS=1), torch "
         f"{meta.get('torch', '?')} CPU. The plan, hypotheses and decision rule: experiments/README.md, "
         '"Does the period K decide?".', '',
         '12 blocks, gamma 3 (M = 4), AdamW; D = LISA-wor - LISA of the final loss on the fixed train windows, '
         'per seed (negative: LISA-wor better); seeds 100-109. A test\'s value is its per-seed contrast; '
         '[95% t interval, df = n - 1]; 99% = Bonferroni over the 5 confirmatory tests. Verdict (95%): '
         f"confirmed = the interval excludes 0 on the predicted side; refuted = it excludes 0 on the other side or "
         f"lies inside (-{K31_MARGIN}, +{K31_MARGIN}); inconclusive otherwise; fewer than {K31_MIN_SEEDS} complete "
         'seeds = not run.', '',
         '## Confirmatory', '',
         '| test | claim | n | train: mean [95% CI] | 99% CI | verdict (95%) | verdict (99%) | val: mean [95% CI] | '
         'per-seed train values |', '|---|---|---|---|---|---|---|---|---|']

    def line(r):
        t, v = r['train'], r['val']
        c99 = f"[{t['ci99'][0]:+.4f}, {t['ci99'][1]:+.4f}]" if t['ci99'] else '-'
        return (f"| {r['id']} | {r['claim']} | {t['n']} | {fmt_ci(t)} | {c99} | **{r['verdict']}** | {r['verdict_99']} | "
                f"{fmt_ci(v)} | {', '.join(f'{x:+.4f}' for x in t['values'])} |")
    L += [line(r) for r in k31['tests']]
    L += ['', '## Exploratory (not part of the decision)', '',
          '| contrast | claim | n | train: mean [95% CI] | 99% CI | - | - | val: mean [95% CI] | per-seed train values |',
          '|---|---|---|---|---|---|---|---|---|']
    L += [line(r) for r in k31['exploratory']]
    L += ['', '## Every cell: D = LISA-wor - LISA', '',
          '| cell | n | train D: mean [95% CI] | LISA-wor wins | LISA train | LISA-wor train | val D: mean [95% CI] | '
          'LISA val | LISA-wor val |', '|---|---|---|---|---|---|---|---|---|']
    for r in k31['cells']:
        t, tm, vm = r['train'], r['train_means'], r['val_means']
        f = lambda x: '-' if x is None else f'{x:.4f}'  # noqa: E731
        wins = f"{t['a_wins']}/{t['n']}" if t else '-'
        L.append(f"| {cell_name(r['cell'])} | {t['n'] if t else 0} | {stats.fmt_pair(t)} | "
                 f"{wins} | {f(tm['lisa'])} | {f(tm['lisa_wor'])} | "
                 f"{stats.fmt_pair(r['val'])} | {f(vm['lisa'])} | {f(vm['lisa_wor'])} |")
    if meta.get('k31_wall_s'):
        L += ['', f"Runs' own wall times, summed: {meta['k31_wall_s'] / 60:.1f} min for {meta['k31_runs']} runs."]
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


# -----------------------------------------------------------------------------
# report


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
        L.append(f"| {p['label']} | {p['a']} | {p['b']} | {t['n']} | {stats.fmt_pair(t)} | {t['a_wins']}/{t['n']} | "
                 f"{stats.fmt_pair(v)} | {', '.join(f'{d:+.4f}' for d in t['diffs'])} |")
    L += ['', '## Every configuration', '',
          'key = L<blocks>-<regime><iterations>-optimizer-method-state-sampling-K-gamma.', '',
          '| configuration | iters | epochs (at the last logged iteration) | seeds | train mean | val mean | '
          'train per seed | val per seed | ms/iter | run time (s, all seeds) |',
          '|---|---|---|---|---|---|---|---|---|---|']
    for r in rows:
        L.append(f"| {r['key']} | {r['max_iters']} | {r['epochs'] if r['epochs'] is not None else '-'} | {len(r['seeds'])} | "
                 f"{r['train_mean']:.4f} | {r['val_mean']:.4f} | "
                 f"{per_seed(r['train'], r['seeds'])} | {per_seed(r['val'], r['seeds'])} | {r['ms_per_iter']:.0f} | "
                 f"{r.get('wall_s', 0):.0f} |")
    if meta.get('wall_s'):
        L += ['', f"Sum of the runs' wall times: {meta['wall_s'] / 60:.1f} min ({meta['machine']}; "
                  f"{meta.get('jobs', 2)} runs at a time, one thread each)."]
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


def plot(path, rows):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    by_key = {r['key']: r for r in rows}
    panels = list(dict.fromkeys((r['n_layer'], r['regime'], r['iters'], r['optimizer'], r['state'], r['K'], r['gamma'])
                                for r in rows if r['method'] == 'lisa_wor' and r['sampling'] == 'rr'))
    cols = 4
    nrows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.8 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis('off')
    for ax, (L, reg, iters, opt, st, K, g) in zip(axes.flat, panels):
        base = dict(n_layer=L, regime=reg, iters=iters, optimizer=opt, state=st, sampling='rr', K=K, gamma=g)
        for method, color in (('full', 'k'), ('lisa', 'tab:blue'), ('lisa_scale', 'tab:green'), ('lisa_wor', 'tab:red')):
            r = by_key.get(other(base, method=method))
            if not r:
                continue
            c = r['curve']
            ax.plot(c['iters'], c['train_loss']['mean'], color=color, label=f"{method} ({len(r['seeds'])} seeds)")
            ax.fill_between(c['iters'], c['train_loss']['min'], c['train_loss']['max'], color=color, alpha=0.2)
        ax.set_title(f'{L} blocks, gamma {g}, K {K}: {reg}, {opt}, {st}', fontsize=9)
        ax.set_xlabel('iteration')
        ax.set_ylabel('train loss (fixed windows)')
        if ax.get_lines():
            ax.legend(fontsize=7)
        ys = [v for l in ax.get_lines() for v in l.get_ydata()]
        if ys:
            ax.set_ylim(min(ys) - 0.05, min(ys) + 1.0)
    fig.suptitle('LISA vs LISA-wor: training loss on fixed windows, mean over seeds, band = min..max')
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


# -----------------------------------------------------------------------------
# cause: schedule statistics (no training) and an instrumented copy of train.py's loop


def make_cycler(units, opt, method, gamma, K, seed):
    import omgd
    return omgd.Cycler(units, opt, omgd.CyclerConfig(method=method, gamma=gamma, period=K, state='keep', seed=seed))


@functools.lru_cache(maxsize=None)  # a study writes its report after every stage: the schedules once
def schedule_stats(method, n_blocks, gamma, K, iters, seed):
    """Which blocks omgd's cycler activates, run on dummy parameters: per-block steps trained over
    the run and per window of M*K steps (a LISA-wor cycle), activations that continue the previous
    period, and idle gaps (steps since a block's last update when it is reactivated)."""
    import torch
    units = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(n_blocks)]
    opt = torch.optim.SGD([p for u in units for p in u], lr=0.0)
    cyc = make_cycler(units, opt, method, gamma, K, seed)
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
    out_dir = os.path.join(runs_dir, run_name(s))
    cfg = runner.config_of(train_args(s, runs_dir), out_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # runner's train.py runs: another thread count sums in another order
    try:
        return _probe(s, cfg, out_dir, runs_dir)
    finally:
        torch.set_num_threads(threads)


def _probe(s, cfg, out_dir, runs_dir):
    import torch

    import training
    from dataloader import TokenBatches, data_dir, dataset_vocab
    torch.manual_seed(cfg['seed'])
    model, opt, cycler = training.build(cfg, 'cpu', dataset_vocab(cfg['dataset']))
    torch.manual_seed(cfg['seed'])
    batches = TokenBatches(os.path.join(data_dir(cfg['dataset']), 'train.bin'), cfg['block_size'], cfg['batch_size'],
                           cfg['sampling'], cfg['data_seed'])

    blocks = [list(b.parameters()) for b in model.blocks]
    outer = [p for p in model.parameters() if p.requires_grad and not any(p is q for b in blocks for q in b)]
    flat = lambda ps: torch.cat([p.detach().reshape(-1) for p in ps])  # noqa: E731
    last = [None] * len(blocks)
    since = [0] * len(blocks)  # steps since the block's current activation began
    prev = set()
    events, updates, losses, clipped = [], [], [], []
    stale_m = {}
    probe = SimpleNamespace()  # the trainer's observer: this iteration's after_switch and before_zero_grad
    trainer = training.Trainer(cfg, model, opt, cycler, batches.iterate(), 'cpu', observer=probe)  # train.py's iteration
    for it in range(cfg['max_iters']):
        before, cos = {}, {}

        def after_switch(trainer, switched):  # the iteration's active set, before its step
            nonlocal prev
            if switched:
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
            before.update({i: flat(blocks[i]).clone() for i in cycler.active})

        def hook(trainer):  # the step is done, the gradients are still held
            scale = cycler.scaling()
            sq = sum(float(p.grad.pow(2).sum()) for p in outer if p.grad is not None)
            sq += sum(float(p.grad.pow(2).sum()) / scale ** 2 for i in cycler.active for p in blocks[i] if p.grad is not None)
            clipped.append(cfg['grad_clip'] > 0 and math.sqrt(sq) >= cfg['grad_clip'] * (1 - 1e-4))
            for i, m in list(stale_m.items()):
                g = flat([p.grad for p in blocks[i]])
                cos[i] = float(torch.nn.functional.cosine_similarity(m, g, dim=0))
            stale_m.clear()

        probe.after_switch, probe.before_zero_grad = after_switch, hook
        loss, _ = trainer.step()
        losses.append(float(loss))
        for i in cycler.active:
            after = flat(blocks[i])
            updates.append((it, i, since[i], float((after - before[i]).norm() / before[i].norm())))
            if i in cos:
                events[-1 - [e['block'] for e in reversed(events)].index(i)]['cos_stale_m_new_g'] = cos[i]
            since[i] += 1
            last[i] = it
    # agreement with train.py's records of the same run (its step losses at the logged iterations)
    parsed = runner.read_records(os.path.join(runs_dir, run_name({**s, 'kind': 'train'})))
    diffs = [abs(losses[i] - l) for i, l in zip(parsed['log_iters'], parsed['step_loss']) if i < len(losses)]
    match = {'logged_iters_compared': len(diffs), 'max_abs_diff': max(diffs) if diffs else None} if diffs else None
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
        'clipped_fraction': statistics.fmean(clipped),
        'final_step_loss_mean_last_48': statistics.fmean(losses[-48:]),
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


# (blocks, gamma, K, iterations) of the schedules tabulated: the M = 2 study's, then the M = 4 runs'
SCHEDULES = ((4, 2, 10, 480), (4, 2, 48, 480), (4, 2, 24, 480), (4, 2, 1, 480), (4, 2, 50, 480), (4, 1, 10, 480),
             (8, 2, 3, 600), (12, 3, 3, 600), (8, 1, 2, 800), (12, 3, 1, 600), (12, 3, 6, 600), (12, 1, 3, 600),
             (12, 6, 3, 600), (12, 3, 12, 600), (12, 3, 25, 600))


def write_probe(path, results, seeds, schedules=SCHEDULES):
    L = ['# Cause measurements', '',
         '## Block schedule (omgd\'s cycler on dummy parameters, no training)', '',
         f'Seeds {seeds[0]}..{seeds[-1]}; per seed, then averaged. "spread per cycle": '
         'mean over windows of M*K steps (one LISA-wor cycle) of (most - fewest steps a block trained in it); '
         '"windows with an idle block": windows in which some block never trained; "continued": activations where '
         'the block was already active in the previous period (its optimizer state survives even under drop); '
         '"gap": steps since a block\'s last update when it is reactivated (the age of its Adam moments under keep).', '',
         '| method | blocks | gamma | M | K | iters | steps per block (min..max over blocks, mean over seeds) | '
         'spread per cycle | windows with an idle block | activations | continued | reactivated | mean gap | max gap |',
         '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for n, g, K, iters in schedules:
        for method in ('lisa', 'lisa_wor'):
            st = [schedule_stats(method, n, g, K, iters, s) for s in seeds]
            mean = lambda k: statistics.fmean(x[k] for x in st if x[k] is not None) if any(x[k] is not None for x in st) else float('nan')  # noqa: E731
            L.append(f"| {method} | {n} | {g} | {n // g} | {K} | {iters} | {mean('steps_min'):.0f}..{mean('steps_max'):.0f} | "
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
              '| blocks | method | state | steps per block | reactivations | fresh state | mean age (steps) | '
              'cos(stale m, new g) | rel. update step 0 | step 1 | step 2 | steps >= 10 | clipped | mean loss last 48 steps | '
              'match |',
              '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
        for r in sorted(probes, key=lambda r: (r.get('n_layer', 4), r['state'], r['method'])):
            u = r['rel_update_by_steps_since_activation']
            m = r.get('train_log_match') or {}
            L.append(f"| {r.get('n_layer', 4)} | {r['method']} | {r['state']} | {r['steps_per_block']} | "
                     f"{r['reactivations']} | {r['fresh_state_at_reactivation']} | {r['age_mean']:.1f} | "
                     f"{'-' if r['cos_stale_m_new_g_mean'] is None else format(r['cos_stale_m_new_g_mean'], '.3f')} | "
                     f"{u.get('0', float('nan')):.2e} | {u.get('1', float('nan')):.2e} | {u.get('2', float('nan')):.2e} | "
                     f"{u.get('10', float('nan')):.2e} | "
                     f"{r['clipped_fraction']:.2f} | {r['final_step_loss_mean_last_48']:.4f} | "
                     f"{match_text(m)} |")
    with open(path, 'w') as f:
        f.write('\n'.join(L) + '\n')


# -----------------------------------------------------------------------------


def resolve_policy(policy, runs_dir, stage=''):
    """'keep' or 'drop': the named one, or (auto) the one under which lisa_wor had the lower mean
    train loss in the multi-epoch AdamW stage of the same M (keep until it has run)."""
    if policy != 'auto':
        return policy
    G = groups(runner.all_results(runs_dir))
    geoms = [dict(n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS) for L, g in M4] if stage.startswith(('m4', 'ft')) else [{}]
    means = {}
    for st in ('keep', 'drop'):
        vals = [v for geo in geoms for v in G.get(config_key(spec('multi', 'adamw', 'lisa_wor', st, **geo)),
                                                  {'train': {}})['train'].values()]
        if vals:
            means[st] = statistics.fmean(vals)
    return min(means, key=means.get) if len(means) == 2 else 'keep'


def report(runs_dir, report_dir, seeds, command, name='study', jobs=2):
    results = runner.all_results(runs_dir)
    rows, pairs = summarize(results)
    os.makedirs(report_dir, exist_ok=True)
    meta = {'command': command, 'runs_dir': os.path.relpath(runs_dir, ROOT), 'base': BASE, 'optimizers': OPTIMIZERS,
            'iters': ITERS, 'm4': M4, 'm4_K': M4_K, 'm4_iters': M4_ITERS, 'ft': FT_GEOMETRY, 'pretrain': PRETRAIN,
            'multi_tokens': MULTI_TOKENS, 'ft_tokens': FT_TOKENS, 'machine': runner.machine(), 'jobs': jobs,
            'wall_s': sum(r.get('wall_s') or 0 for r in results),
            'policy_auto': {'m2': resolve_policy('auto', runs_dir), 'm4': resolve_policy('auto', runs_dir, 'm4')}}
    with open(os.path.join(report_dir, f'{name}.json'), 'w') as f:
        json.dump({'meta': meta, 'rows': rows, 'pairs': pairs,
                   'probes': [{k: v for k, v in r.items() if k != 'events'} for r in results if r.get('kind') == 'probe'],
                   'runs': [{k: r.get(k) for k in (*KEY_FIELDS, 'seed', 'wall_s', 'command', 'median_ms_per_iter')}
                            for r in results if r.get('kind') == 'train']}, f, indent=1)
    write_tables(os.path.join(report_dir, f'{name}_tables.md'), rows, pairs, meta)
    write_probe(os.path.join(report_dir, f'{name}_probe.md'), results, seeds, SCHEDULES)
    k31_runs = [r for r in results if r.get('kind') == 'train' and r.get('n_layer') == K31_GEOMETRY['n_layer']
                and r.get('gamma') == K31_GEOMETRY['gamma'] and r.get('seed', 0) >= 100]
    if k31_runs:  # issue 31's pre-registered tests
        import torch
        k31 = k31_tests(results)
        meta.update(torch=torch.__version__, k31_wall_s=sum(r.get('wall_s') or 0 for r in k31_runs),
                    k31_runs=len(k31_runs))
        write_k31(os.path.join(report_dir, f'{name}_tests.md'), k31, meta)
        with open(os.path.join(report_dir, f'{name}.json')) as f:
            data = json.load(f)
        data['k31'] = k31
        data['meta'] = meta
        with open(os.path.join(report_dir, f'{name}.json'), 'w') as f:
            json.dump(data, f, indent=1)
    if rows:
        plot(os.path.join(report_dir, f'{name}_loss.png'), rows)
    return rows, pairs


def build_parser():
    ap = runner.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--stages', default=','.join(STAGES), help=f'comma-separated, in order; of {",".join(STAGES)}')
    ap.add_argument('--seeds', type=int, default=5, help='how many seeds: FIRST_SEED..FIRST_SEED+N-1')
    ap.add_argument('--first_seed', type=int, default=0, help='the first seed (the k31 stages: 100)')
    ap.add_argument('--stop_at', default='', help='HH:MM (UTC): start no seed group after it (the runs '
                    'that started finish; the rest are reported as not run, and a rerun resumes them)')
    ap.add_argument('--jobs', type=int, default=2, help='runs at a time (each OMP_NUM_THREADS=1)')
    ap.add_argument('--max_load', type=float, default=None,
                    help='start a second run beside the first only while the 1-minute load average is below this')
    ap.add_argument('--layers', default='', help='only the runs of models with these numbers of blocks, e.g. 8,12')
    ap.add_argument('--policy', default='auto', help="state policy of the later stages: keep, drop or auto")
    ap.add_argument('--runs_dir', default=os.path.join(ROOT, 'out', 'study', 'runs'))
    ap.add_argument('--report_dir', default=os.path.join(ROOT, 'out', 'study'))
    ap.add_argument('--name', default='study', help='report file stem: NAME.json, NAME_tables.md, ...')
    ap.add_argument('--report_only', action='store_true')
    ap.add_argument('--probe_spec', default='', help=argparse.SUPPRESS)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    runs_dir = os.path.abspath(args.runs_dir)
    if args.probe_spec:
        probe(json.loads(args.probe_spec), runs_dir)
        return 0
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    try:
        deadline = stop_time(args.stop_at) if args.stop_at else None
    except ValueError:
        sys.exit(f'error: --stop_at={args.stop_at!r}: give a UTC time as HH:MM, e.g. --stop_at=10:42')
    command = ' '.join(['python experiments/study.py'] + (sys.argv[1:] if argv is None else list(argv)))
    stages = [s.strip() for s in args.stages.split(',') if s.strip()]
    try:
        layers = {int(n) for n in args.layers.split(',') if n.strip()}
    except ValueError:
        sys.exit(f'error: --layers={args.layers!r}: give numbers of blocks, e.g. --layers=8,12')
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        sys.exit(f'error: unknown stage {unknown[0]!r}; choose from {", ".join(STAGES)}')
    if args.seeds < 1 or args.jobs < 1:
        sys.exit(f"error: --seeds={args.seeds} and --jobs={args.jobs} must be >= 1")
    if not args.report_only:
        # every run's train.py config checked before the first run starts (a bad one fails now, in one line)
        for stage in stages:
            for s in stage_specs(stage, seeds, resolve_policy(args.policy, runs_dir, stage)):
                try:
                    runner.config_of(train_args(s, runs_dir))
                except ValueError as e:
                    sys.exit(f"error: stage {stage}, run {run_name(s)}: {e}")
        failed = []
        make_multi_dataset(runs_dir)
        if any(s.startswith(('m4', 'm8', 'k6', 'k31')) for s in stages):  # the deeper models' multi-epoch prefix
            make_multi_dataset(runs_dir, M4_MULTI_TOKENS)
        if any(c['regime'] == 'paper' for s in stages for c in K31_STAGES.get(s, ())):
            make_multi_dataset(runs_dir, PAPER_TOKENS)
        if {'m4_ft', 'ft_sweep'} & set(stages):
            make_ft_dataset(runs_dir)
        not_started = 0
        for stage in stages:
            specs = stage_specs(stage, seeds, resolve_policy(args.policy, runs_dir, stage))
            specs = [s for s in specs if not layers or s['n_layer'] in layers]
            t0 = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage}: {len(specs)} runs", flush=True)
            results, started = {}, sum(runner.load_result(runs_dir, run_name(s)) is None for s in specs)
            for group in seed_groups(specs) if deadline else [specs]:  # a seed's runs: complete pairs
                if deadline and time.time() >= deadline and any(runner.load_result(runs_dir, run_name(s)) is None
                                                                for s in group):
                    not_started += sum(runner.load_result(runs_dir, run_name(s)) is None for s in group)
                    continue
                results.update(run_specs(group, runs_dir, args.jobs, max_load=args.max_load))
            failed += [name for name, r in results.items() if 'error' in r]
            print(f"[{time.strftime('%H:%M:%S')}] stage {stage} done in {time.time() - t0:.0f} s", flush=True)
            if not failed and started and (not deadline or time.time() < deadline):  # the last one: below
                report(runs_dir, args.report_dir, seeds, command, args.name, args.jobs)
        if failed:  # earlier reports stay as they were; finished runs are kept, and rerun failures resume
            print(f"error: {len(failed)} runs failed (first: {failed[0]}: see {runs_dir}/{failed[0]}); reports "
                  f"not rewritten; run the same command again to retry them", file=sys.stderr)
            return 1
        if not_started:
            print(f"[{time.strftime('%H:%M:%S')}] --stop_at={args.stop_at}: {not_started} runs not started "
                  f"(the same command resumes them)", flush=True)
    report(runs_dir, args.report_dir, seeds, command, args.name, args.jobs)
    print(f"wrote {args.name}.json, {args.name}_tables.md, {args.name}_probe.md, {args.name}_loss.png "
          f"in {args.report_dir}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
