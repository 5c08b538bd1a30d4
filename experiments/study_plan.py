"""
The study's plan: every run as data. A run is a spec (regime, optimizer, method, state policy,
sampling, K, gamma, blocks, iterations, seed); a stage is a list of cells (a spec's fields without
the seed) run at every seed, seed-major; train_args turns a spec into train.py's arguments. Issue
31's pre-registered tests are here too, as data: which cells, which contrast, which sign.
experiments/study.py runs the stages, study_stats.py computes the statistics, study_report.py
writes the tables. The stages in words: study.py's docstring.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MULTI_TOKENS = 100_000
FT_TOKENS = 20_000
# model and schedule of every run (train.py keys); the optimizer's and the regime's own values come
# from OPTIMIZERS and REGIME_ARGS, the geometry (n_layer, gamma, K) and iterations from the spec
BASE = dict(
    n_head=2,
    n_embd=32,
    block_size=64,
    batch_size=32,
    dropout=0.0,
    learning_rate=3e-3,
    min_lr=3e-4,
    warmup_iters=20,
    weight_decay=0.1,
    grad_clip=1.0,
    eval_iters=8,
    log_interval=12,
    omgd_period=10,
    omgd_state='keep',
)
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


def spec(
    regime,
    optimizer,
    method,
    state='keep',
    sampling='rr',
    K=None,
    gamma=None,
    seed=0,
    kind='train',
    n_layer=4,
    iters=None,
    beta1=None,
):
    full = method == 'full'
    return {
        'regime': regime,
        'optimizer': optimizer,
        'method': method,
        'state': 'na' if full else state,
        'sampling': sampling,
        'K': 0 if full else (K or BASE['omgd_period']),
        'gamma': 0 if full else (gamma or 2),
        'n_layer': n_layer,
        'iters': iters or ITERS[regime],
        'seed': seed,
        'kind': kind,
        'beta1': beta1,
    }


KEY_FIELDS = ('n_layer', 'regime', 'iters', 'optimizer', 'method', 'state', 'sampling', 'K', 'gamma', 'beta1')


def config_key(s):
    """The configuration without the seed: runs with the same key and different seeds are a group
    (a beta1 other than train.py's is appended; runs from before beta1 was a field have none)."""
    beta1 = s.get('beta1')
    return (
        f"L{s['n_layer']}-{s['regime']}{s['iters']}-{s['optimizer']}-{s['method']}-{s['state']}-{s['sampling']}"
        f"-K{s['K']}-g{s['gamma']}" + ('' if beta1 is None else f'-beta{beta1}')
    )


def run_name(s):
    return f"{'probe-' if s['kind'] == 'probe' else ''}{config_key(s)}_s{s['seed']}"


def data_root(runs_dir):
    return os.path.join(os.path.dirname(os.path.abspath(runs_dir)), 'data')


def multi_dataset(runs_dir, n_tokens=None):
    return os.path.join(data_root(runs_dir), f'shakespeare_char_{(n_tokens or MULTI_TOKENS) // 1000}k')


def ft_dataset(runs_dir):
    return os.path.join(data_root(runs_dir), 'pydoc_char')


def dataset(s, runs_dir):
    if s['regime'] == 'paper':
        return multi_dataset(runs_dir, PAPER_TOKENS)
    if s['regime'] == 'multi':
        return multi_dataset(runs_dir, M4_MULTI_TOKENS if s['n_layer'] in DEPTH_ARGS else MULTI_TOKENS)
    return ft_dataset(runs_dir) if s['regime'] == 'ft' else 'shakespeare_char'


def train_args(s, runs_dir):
    """train.py's arguments for spec s (runner.train_argv adds the CPU flags and the out_dir)."""
    flags = dict(
        BASE,
        n_layer=s['n_layer'],
        **DEPTH_ARGS.get(s['n_layer'], {}),
        **OPTIMIZERS[s['optimizer']],
        **REGIME_ARGS.get(s['regime'], {}),
    )
    flags.update(max_iters=s['iters'], lr_decay_iters=s['iters'], eval_interval=s['iters'] // EVALS)
    if s['method'] != 'full':
        flags.update(omgd_period=s['K'], omgd_gamma=s['gamma'], omgd_state=s['state'])
    if s.get('beta1') is not None:
        flags['beta1'] = s['beta1']
    flags['dataset'] = dataset(s, runs_dir)
    args = [
        f"--method={s['method']}",
        f"--sampling={s['sampling']}",
        f"--seed={s['seed']}",
        f"--data_seed={s['seed']}",
        f"--omgd_seed={s['seed']}",
        '--decay_lr=True',
    ]
    args += [f'--{k}={v}' for k, v in flags.items()]
    args += [f"--optimizer={s['optimizer']}", '--overwrite=True']
    return args + (['--init_from=resume'] if s['regime'] == 'ft' else [])


# -----------------------------------------------------------------------------
# the stages: {name: (which seeds, cells)}; a cell is spec()'s fields but the seed. Which seeds:
# 'every' (seed-major: all cells of a seed, then the next seed), 'first' (the first seed only),
# 'own' (the cell's own seed, once). POLICY in a cell's state is --policy's choice, OTHER the other.
POLICY, OTHER = '<policy>', '<other policy>'
LISAS = ('lisa', 'lisa_wor')
STATES = ('keep', 'drop')


def cells(methods, states=STATES, **fields):
    """One cell per (state, method), states outer."""
    return [dict(fields, method=m, state=st) for st in states for m in methods]


def m4(**fields):
    """fields at each M = 4 geometry (8 blocks gamma 2, then 12 blocks gamma 3), K 3, 600 iterations."""
    return [dict(fields, n_layer=L, gamma=g, K=M4_K, iters=M4_ITERS) for L, g in M4]


MULTI_ADAMW = dict(regime='multi', optimizer='adamw')
EPOCH = ITERS['multi'] // 10  # 48 steps per epoch of the 4-block multi-epoch runs
STAGES = {
    'core_multi_adamw': ('every', cells(['full'], ['keep'], **MULTI_ADAMW) + cells(LISAS, **MULTI_ADAMW)),
    # K = one epoch: a cycle of M = N_L / gamma periods is M epochs, and every (block group, window)
    # pair is visited once per cycle (up to each epoch's random window offset)
    'aligned': ('every', cells(LISAS, [POLICY], K=EPOCH, **MULTI_ADAMW)),
    'probe': ('first', cells(LISAS, kind='probe', **MULTI_ADAMW)),
    'core_multi_sgd': ('every', cells(LISAS, regime='multi', optimizer='sgd')),
    'core_sub_adamw': (
        'every',
        cells(['full'], ['keep'], regime='sub', optimizer='adamw') + cells(LISAS, regime='sub', optimizer='adamw'),
    ),
    'core_sub_sgd': ('every', cells(LISAS, regime='sub', optimizer='sgd')),
    'offload': ('first', cells(['lisa_wor'], ['offload'], **MULTI_ADAMW)),
    # SGD is not scale-invariant: separates without-replacement from the N_L/gamma scale
    'methods_sgd': ('every', cells(['lisa_scale', 'lisa_wor_noscale'], [POLICY], regime='multi', optimizer='sgd')),
    'aligned_cycle': ('every', cells(LISAS, [POLICY], K=EPOCH // 2, **MULTI_ADAMW)),  # one cycle per epoch
    'iid': ('every', cells(LISAS, [POLICY], sampling='iid', **MULTI_ADAMW)),
    'methods': (
        'every',
        cells(['lisa_scale', 'lisa_wor_noscale', 'tensor_wor', 'tensor_iid'], [POLICY], **MULTI_ADAMW),
    ),
    'sweep': (
        'every',
        [
            c
            for K, g in ((1, 2), (50, 2), (1, 1), (10, 1), (50, 1))
            for c in cells(LISAS, [POLICY], K=K, gamma=g, **MULTI_ADAMW)
        ],
    ),
    # the sweep's K=1 cell under the other policy (the restart count at K=1 is the suspect)
    'k1_keep': ('every', cells(LISAS, [OTHER], K=1, **MULTI_ADAMW)),
    'm4_multi_adamw': ('every', [c for g in m4(**MULTI_ADAMW) for c in cells(LISAS, **g)]),
    # SGD is not scale-invariant: lisa_scale separates the scale's share
    'm4_multi_sgd': (
        'every',
        [
            c
            for g in m4(regime='multi', optimizer='sgd')
            for c in cells(['lisa', 'lisa_scale', 'lisa_wor'], [POLICY], **g)
        ],
    ),
    'm4_pre': ('own', [PRETRAIN]),  # what every fine-tuning run starts from: one model
    'm4_ft': (
        'every',
        cells(
            ['full'],
            ['keep'],
            regime='ft',
            optimizer='adamw',
            n_layer=FT_GEOMETRY['n_layer'],
            iters=FT_GEOMETRY['iters'],
        )
        + cells(LISAS, [POLICY], regime='ft', optimizer='adamw', **FT_GEOMETRY),
    ),
    'm4_sub_adamw': ('every', [c for g in m4(regime='sub', optimizer='adamw') for c in cells(LISAS, **g)]),
    'm4_full': (
        'every',
        cells(['full'], ['keep'], **MULTI_ADAMW, n_layer=8, iters=M4_ITERS)
        + cells(['full'], ['keep'], **MULTI_ADAMW, n_layer=12, iters=M4_ITERS),
    ),
    'm4_probe': ('first', [c for g in m4(**MULTI_ADAMW, kind='probe')[::-1] for c in cells(LISAS, **g)]),
    # the CoLA ablation's axes around m4_ft's cell: K at gamma 3, gamma at K 3
    'ft_sweep': (
        'every',
        [
            c
            for change in FT_SWEEP
            for c in cells(LISAS, [POLICY], regime='ft', optimizer='adamw', **{**FT_GEOMETRY, **change})
        ],
    ),
    'm8_multi_adamw': (
        'every',
        cells(LISAS, n_layer=8, gamma=1, K=2, iters=800, **MULTI_ADAMW),
    ),  # 50 cycles of 16 steps
    # m4's 12-block keep cells with periods twice as long (25 cycles)
    'k6_keep': (
        'every',
        [
            c
            for regime in ('multi', 'sub')
            for c in cells(
                LISAS, ['keep'], regime=regime, optimizer='adamw', n_layer=12, gamma=3, K=2 * M4_K, iters=M4_ITERS
            )
        ],
    ),
    # k6_keep's K = 6 at 8 blocks under keep, and at 12 blocks under drop
    'k6_more': (
        'every',
        [
            c
            for (L, g), st in ((M4[0], 'keep'), (M4[1], 'drop'))
            for c in cells(LISAS, [st], n_layer=L, gamma=g, K=2 * M4_K, iters=M4_ITERS, **MULTI_ADAMW)
        ],
    ),
    **{
        name: (
            'every',
            [dict(cell, optimizer='adamw', method=m, **K31_GEOMETRY) for cell in stage_cells for m in LISAS],
        )
        for name, stage_cells in K31_STAGES.items()
    },
}


def stage_specs(stage, seeds, policy='keep'):
    """The runs of one stage, seed-major; policy: what POLICY stands for."""
    which, stage_cells = STAGES[stage]
    fill = {POLICY: policy, OTHER: 'keep' if policy == 'drop' else 'drop'}
    resolved = [dict(c, state=fill.get(c['state'], c['state'])) if 'state' in c else c for c in stage_cells]
    if which == 'own':
        return [spec(**c) for c in resolved]
    return [spec(**c, seed=seed) for seed in (seeds if which == 'every' else seeds[:1]) for c in resolved]


# -----------------------------------------------------------------------------
# issue 31: the pre-registered tests (experiments/README.md, "Does the period K decide?"); the
# decision rule and the statistics: study_stats.py


def k31_cell(**change):
    """A k31 cell's fields (12 blocks, gamma 3, AdamW; the K axis' regime unless changed)."""
    return {**dict(regime='multi', iters=M4_ITERS, state='keep', K=3, beta1=None), **change}


AXIS_KEEP = [k31_cell(K=K) for K in K31_AXIS]
AXIS_DROP = [k31_cell(K=K, state='drop') for K in K31_AXIS]
# (id, claim, kind, cells, predicted sign of the contrast): the five confirmatory tests, in the plan's words
K31_TESTS = (
    ('H1a', 'the K = 3 loss replicates: D(K 3, keep) > 0', 'd', [k31_cell(K=3)], +1),
    ('H1b', 'the K = 6 win replicates: D(K 6, keep) < 0', 'd', [k31_cell(K=6)], -1),
    ('H1c', 'D falls as K grows (keep): slope of D on log2 K over K 3, 6, 12, 25 < 0', 'slope', AXIS_KEEP, -1),
    (
        'H2',
        'the momentum horizon: D(K 3, keep, beta1 0.9) - D(beta1 0) > 0',
        'dd',
        [k31_cell(K=3), k31_cell(K=3, beta1=0.0)],
        +1,
    ),
    (
        'H3',
        "the paper's K = 100 (keep, 10,000 iterations): D < 0",
        'd',
        [k31_cell(regime='paper', iters=10_000, K=100)],
        -1,
    ),
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
