"""
Why the study's results are what they are: the block schedules the cycler draws (no training), and
the probe, train.py's iteration (Trainer) driven in process with an observer that records
the Adam state at each reactivation, the update sizes after it and the clipping; its losses are
checked against the train.py run of the same spec.
"""

import functools
import json
import math
import os
import statistics
from types import SimpleNamespace

import runner
from study_plan import run_name, train_args


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
    full_windows = window[: iters // (M * K)]
    return {
        'steps_per_block': steps,
        'steps_min': min(steps),
        'steps_max': max(steps),
        'window_steps': full_windows,
        'window_spread_mean': statistics.fmean(max(w) - min(w) for w in full_windows) if full_windows else None,
        'never_in_window': sum(min(w) == 0 for w in full_windows),
        'activations': continued + reactivated + first,
        'continued': continued,
        'reactivated': reactivated,
        'gap_mean': statistics.fmean(gaps) if gaps else None,
        'gap_max': max(gaps) if gaps else None,
    }


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

    import builder
    from dataloader import TokenBatches, data_dir, dataset_vocab
    from trainer import Trainer

    torch.manual_seed(cfg['seed'])
    model, opt, cycler = builder.build(cfg, 'cpu', dataset_vocab(cfg['dataset']))
    torch.manual_seed(cfg['seed'])
    batches = TokenBatches(
        os.path.join(data_dir(cfg['dataset']), 'train.bin'),
        cfg['block_size'],
        cfg['batch_size'],
        cfg['sampling'],
        cfg['data_seed'],
    )

    blocks = [list(b.parameters()) for b in model.blocks]
    outer = [p for p in model.parameters() if p.requires_grad and not any(p is q for b in blocks for q in b)]
    flat = lambda ps: torch.cat([p.detach().reshape(-1) for p in ps])  # noqa: E731
    last = [None] * len(blocks)
    since = [0] * len(blocks)  # steps since the block's current activation began
    prev = set()
    events, updates, losses, clipped = [], [], [], []
    stale_m = {}
    probe = SimpleNamespace()  # the trainer's observer: this iteration's after_switch and before_zero_grad
    trainer = Trainer(cfg, model, opt, cycler, batches.iterate(), 'cpu', observer=probe)  # train.py's iteration
    for it in range(cfg['max_iters']):
        before, cos = {}, {}

        def after_switch(trainer, switched):  # the iteration's active set, before its step
            nonlocal prev
            if switched:
                for i in cycler.active:
                    if i in prev:
                        continue
                    st = opt.state.get(blocks[i][0], {})
                    events.append(
                        {
                            'iter': it,
                            'block': i,
                            'age': None if last[i] is None else it - last[i],
                            'has_state': bool(st),
                            'adam_step': float(st['step']) if 'step' in st else None,
                        }
                    )
                    since[i] = 0
                    if st and 'exp_avg' in st:
                        stale_m[i] = flat([opt.state[p]['exp_avg'] for p in blocks[i]]).clone()
                prev = set(cycler.active)
            before.update({i: flat(blocks[i]).clone() for i in cycler.active})

        def hook(trainer):  # the step is done, the gradients are still held
            scale = cycler.scaling()
            sq = sum(float(p.grad.pow(2).sum()) for p in outer if p.grad is not None)
            sq += sum(
                float(p.grad.pow(2).sum()) / scale**2 for i in cycler.active for p in blocks[i] if p.grad is not None
            )
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
        'activations': len(events),
        'reactivations': len(reacts),
        'fresh_state_at_reactivation': sum(not e['has_state'] for e in reacts),
        'age_mean': statistics.fmean(e['age'] for e in reacts) if reacts else None,
        'age_max': max(e['age'] for e in reacts) if reacts else None,
        'cos_stale_m_new_g_mean': statistics.fmean(c)
        if (c := [e['cos_stale_m_new_g'] for e in reacts if 'cos_stale_m_new_g' in e])
        else None,
        'rel_update_by_steps_since_activation': {str(k): statistics.fmean(v) for k, v in sorted(by_since.items())},
        'clipped_fraction': statistics.fmean(clipped),
        'final_step_loss_mean_last_48': statistics.fmean(losses[-48:]),
        'train_log_match': match,
        'events': events[:400],
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'probe.json'), 'w') as f:
        json.dump(result, f)
    return result
