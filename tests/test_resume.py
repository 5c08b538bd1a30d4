"""A resume is read once and checked once, on the checkpoint's config merged with the command's keys
(train_config.run_config): a run extends with its own schedule, and a schedule a resume may change is changed."""

import json
import math

import torch
from conftest import TINY, run_script

import train_config

BASE = [a for a in TINY if not a.startswith(('--warmup_iters=', '--lr_decay_iters='))]  # the defaults: 50, 1000
LR, MIN_LR = train_config.DEFAULTS['learning_rate'], train_config.DEFAULTS['min_lr']


def cosine(it, warmup, decay):
    """The learning rate of iteration `it` of a warm-up then cosine schedule, written out here."""
    if it < warmup:
        return LR * (it + 1) / (warmup + 1)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * (it - warmup) / (decay - warmup))) * (LR - MIN_LR)


def train(out, *args):
    result = run_script('train.py', [*BASE, f'--out_dir={out}', *args])
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def logged_lr(out):
    """{iteration: lr} of the run's iteration records (the last record of an iteration wins)."""
    records = [json.loads(line) for line in open(out / 'metrics.jsonl')]
    return {r['iter']: r['lr'] for r in records if r['kind'] == 'iter'}


def last_lr(out):
    return torch.load(out / 'ckpt.pt', weights_only=True)['optimizer']['param_groups'][0]['lr']


def test_an_extended_run_keeps_its_own_warmup(tmp_path):
    """Trained with warmup_iters=2, extended with a longer decay: the unmerged command line has the default
    warmup_iters=50, which would end after lr_decay_iters=26 (refused before the merge); merged, it is the run's 2."""
    out = tmp_path / 'run'
    train(out, '--max_iters=20', '--lr_decay_iters=20', '--warmup_iters=2', '--eval_interval=20')
    train(out, '--init_from=resume', '--max_iters=26', '--lr_decay_iters=26', '--eval_interval=20')
    saved = torch.load(out / 'ckpt.pt', weights_only=True)
    assert saved['iter_num'] == 26
    assert (saved['config']['warmup_iters'], saved['config']['lr_decay_iters']) == (2, 26)
    lrs = logged_lr(out)
    assert all(math.isclose(lrs[it], cosine(it, 2, 26), rel_tol=1e-12) for it in range(20, 26)), lrs
    assert math.isclose(last_lr(out), cosine(25, 2, 26), rel_tol=1e-12)


def test_a_resume_branches_a_decay_off_a_constant_run(tmp_path):
    """Warmup-stable-decay: a run at a constant rate (decay_lr=False), then its checkpoint resumed with a decay
    that starts at the branch (warmup_iters=12) and ends at 20: the resumed run's rates are the new schedule's."""
    out = tmp_path / 'run'
    train(out, '--decay_lr=False', '--max_iters=12', '--eval_interval=12')
    assert set(logged_lr(out).values()) == {LR}
    train(out, '--init_from=resume', '--decay_lr=True', '--warmup_iters=12', '--lr_decay_iters=20', '--max_iters=20')
    lrs = logged_lr(out)
    assert all(lrs[it] == LR for it in range(12)), lrs
    expected = [cosine(it, 12, 20) for it in range(12, 20)]
    assert expected[0] == LR and expected[-1] < LR / 2  # the branch starts at the stable rate and decays
    assert all(math.isclose(lrs[it], e, rel_tol=1e-12) for it, e in zip(range(12, 20), expected)), lrs
    assert math.isclose(last_lr(out), expected[-1], rel_tol=1e-12)  # what the optimizer stepped with last


def test_every_check_runs_once(tmp_path, monkeypatch):
    """check() once per run, on the final values, whether it starts from scratch, finds nothing to resume
    (auto) or resumes; check_resume once per resume."""
    calls = []
    for name in ('check', 'check_resume'):
        original = getattr(train_config, name)
        monkeypatch.setattr(train_config, name, lambda *a, name=name, f=original: calls.append(name) or f(*a))
    out = tmp_path / 'run'
    for args, expected in (
        (['--init_from=auto', '--max_iters=2'], ['check']),
        (['--init_from=resume', '--max_iters=4'], ['check_resume', 'check']),
        (['--init_from=scratch', '--overwrite=True', '--max_iters=2', f'--out_dir={tmp_path / "new"}'], ['check']),
    ):
        calls.clear()
        train(out, '--eval_interval=2', *args)
        assert calls == expected, (args, calls)


def test_a_resume_of_ckpt_pt_reads_the_file_twice(tmp_path, monkeypatch):
    """Resuming ckpt.pt reads it twice: once mapped for its iteration (to order it among the step folders), once
    whole; listing out_dir's checkpoints again for the fall-back read it a third time."""
    from infra import checkpoint

    out = tmp_path / 'run'
    train(out, '--eval_interval=2', '--max_iters=2')
    reads = []
    original = checkpoint.read
    monkeypatch.setattr(checkpoint, 'read', lambda path, *a, **k: reads.append(path) or original(path, *a, **k))
    train(out, '--eval_interval=2', '--max_iters=4', '--init_from=resume')
    assert reads == [str(out / 'ckpt.pt')] * 2, reads
