"""train.py under FSDP2 (`--parallel=fsdp`): two gloo ranks on CPU, launched with torchrun.

What is checked, and how (helpers and the tiny model come from tests/conftest.py):
- `--ddp_check=True` under FSDP makes every rank, after every optimizer step, report its active
  set, a SHA-256 of the full (all-gathered) weights, whether its frozen shards are bitwise
  unchanged since the switch, whether gradients exist exactly for the active parameters, whether
  optimizer state exists only for active parameters, and how many elements its reduce-scatters
  sent this step (counted in a custom FSDP2 ReduceScatter); every rank compares all reports and
  the run fails on any mismatch. The reduce-scattered elements must equal the active elements
  (padded): frozen blocks send nothing, and with 2 micro-steps per rank only the last one sends.
- 2 ranks x 2 micro-steps x 2 windows against 1 rank x 2 micro-steps x 4 windows (the same
  windows) with SGD, where gradient clipping is active (clip_grad_norm_ over DTensor gradients
  must use the norm of the full gradient; a per-shard norm would be ~1/sqrt(2) of it).
- Evaluations and checkpoint writes inside a switching period (the checked run evaluates every 4
  iterations, switches every 3) change nothing: the run still matches the one-process run, which
  evaluates only at the start and the end.
- The FSDP checkpoint (a step folder, consolidated) is the single-process format: it loads into a
  plain GPT and optimizer, and resumes in one process, resharded by DCP.
- Exact resume under FSDP through a normal end and a SIGTERM to one worker: the resumed run ends
  bit for bit where a straight run ends (AdamW, dropout).
"""

import json
import re
import shutil

import pytest
import torch
from conftest import (
    LINEAR,
    ONE_RANK,
    TWO_RANKS,
    assert_same_state,
    copy_checkpoint,
    forked_torchrun,
    load,
    records,
    stop_with_sigterm,
)
from conftest import (
    torchrun_train as train,
)

pytestmark = pytest.mark.torchrun  # launches torchrun (deselect with -m "not torchrun")

FSDP = ['--parallel=fsdp']
CLIPPED = [*LINEAR[:-1], '--grad_clip=0.05']  # SGD with clipping (active: without it the weights end 0.18 away)
ITERS = 16
EVAL = 4  # the checked run evaluates (and saves) inside switching periods too: at 4 and 8
RESUME = ['--dropout=0.1', '--omgd_period=4', *TWO_RANKS, *FSDP]  # AdamW; dropout: per-rank RNG streams
STRAIGHT = 16


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """One torchrun launch (tests/test_ddp.py's runner): the checked FSDP run, the straight run of
    the resume test and its first part (a normal end at 5), and a short tensor_wor run (units are single
    tensors)."""
    root = tmp_path_factory.mktemp('fsdp')
    runs = [
        (
            'checked',
            [
                f'--out_dir={root / "checked"}',
                f'--max_iters={ITERS}',
                '--ddp_check=True',
                *CLIPPED,
                *TWO_RANKS,
                *FSDP,
                f'--eval_interval={EVAL}',
            ],
        ),
        ('straight', [f'--out_dir={root / "straight"}', f'--max_iters={STRAIGHT}', *RESUME]),
        ('first', [f'--out_dir={root / "first"}', '--max_iters=5', *RESUME]),
        (
            'tensor_wor',
            [
                f'--out_dir={root / "tensor_wor"}',
                '--method=tensor_wor',
                '--max_iters=4',
                '--omgd_period=2',
                '--ddp_check=True',
                *TWO_RANKS,
                *FSDP,
            ],
        ),
    ]
    run = forked_torchrun('tests/test_ddp.py', env={'DDP_TEST_RUNS': json.dumps(runs)})
    assert run.proc.returncode == 0, run.out[-3000:]
    logs = dict(re.findall(r'=== (\w+)\n(.*?)(?==== |\Z)', run.out, flags=re.S))
    return root, logs


CHECK = (
    r'iter (\d+): fsdp check: 2 ranks agree on active \[([\d, ]+)\] and weights sha256 [0-9a-f]{16}; '
    r'(\d+) active elements, reduce-scattered (\d+) \(padded\); one reduce-scatter per unit with active '
    r'parameters; frozen untouched, no frozen gradients, optimizer state only for active parameters'
)


def test_fsdp_checks_hold_and_two_ranks_match_one_process(runs, tmp_path):
    root, logs = runs
    log = logs['checked']
    switches = records(root / 'checked', 'switch')
    assert [s['iter'] for s in switches] == list(range(0, ITERS, 3))
    assert all(s['ddp_rebuild_ms'] is None for s in switches)  # FSDP reshards: nothing to rebuild
    checks = re.findall(CHECK, log)
    # a check line per switch and at the last iteration; the checks run at every step
    assert [int(c[0]) for c in checks] == sorted(set(range(0, ITERS, 3)) | {ITERS - 1}), log[-3000:]
    # frozen blocks reduce-scatter nothing: the elements sent are the active ones (all dims even here)
    assert all(c[2] == c[3] and int(c[2]) < 40000 for c in checks)
    assert [c[1] for c in checks if int(c[0]) % 3 == 0] == [', '.join(map(str, s['active'])) for s in switches]
    assert 'tokens per iteration: 256 (2 ranks)' in log
    # An evaluation leaves FSDP's root unit all-gathered and the next forward reuses it, here both
    # inside a period (4, 8) and at a switch (12, after reshard_fsdp); evaluations and
    # checkpoint writes must leave training as it is without them: the comparison with one process
    # below, which evaluates only at 0 and at the end, covers that.
    evals = [r['iter'] for r in records(root / 'checked', 'eval')]
    assert evals == list(range(0, ITERS + 1, EVAL)) and any(i % 3 for i in evals)
    assert len(records(root / 'checked', 'save')) == len(evals) - 1  # always_save_checkpoint, not at 0

    one = tmp_path / 'one'
    train(f'--out_dir={one}', f'--max_iters={ITERS}', *CLIPPED, *ONE_RANK, ranks=1)
    a, b = load(root / 'checked'), load(one)
    assert a['cycler']['active'] == b['cycler']['active'] and a['data'] == b['data']
    # Not bitwise: the gradient sum runs in another order (ranks, micro-steps, reduce-scatter).
    # Observed 7.5e-9; clipping alone moves the weights by 0.18, so a per-shard norm would show.
    worst = max((a['model'][k] - b['model'][k]).abs().max().item() for k in b['model'])
    assert worst < 1e-5, worst
    losses = [[r['loss'] for r in records(d, 'iter')] for d in (root / 'checked', one)]
    assert len(losses[0]) == ITERS and losses[0] == pytest.approx(losses[1], abs=1e-5)

    # the FSDP checkpoint has the single-process format, down to the optimizer's parameter numbering
    assert a['model'].keys() == b['model'].keys() and all(
        not v.is_meta and type(v) is torch.Tensor for v in a['model'].values()
    )
    assert a['optimizer']['state'].keys() == b['optimizer']['state'].keys()
    assert [g['params'] for g in a['optimizer']['param_groups']] == [
        g['params'] for g in b['optimizer']['param_groups']
    ]
    for i, s in a['optimizer']['state'].items():
        assert {k: (type(v), v.shape) for k, v in s.items()} == {
            k: (type(v), v.shape) for k, v in b['optimizer']['state'][i].items()
        }


def test_fsdp_checkpoint_loads_in_one_process(runs, tmp_path):
    root, _ = runs
    copy_checkpoint(root / 'checked', tmp_path)  # the sharded step folder, resharded to 1 rank
    run = train(f'--out_dir={tmp_path}', f'--max_iters={ITERS + 3}', '--init_from=resume', *CLIPPED, *ONE_RANK, ranks=1)
    assert 'resuming a 2-rank checkpoint on 1 rank' in run.out and load(tmp_path)['iter_num'] == ITERS + 3


def test_tensor_method_under_fsdp(runs):
    root, logs = runs
    checks = re.findall(CHECK, logs['tensor_wor'])
    assert [c[0] for c in checks] == ['0', '2', '3'] and all(c[2] == c[3] for c in checks), logs['tensor_wor']
    assert load(root / 'tensor_wor')['iter_num'] == 4


def test_fsdp_resume_and_sigterm_continue_exactly(runs, tmp_path):
    root, _ = runs
    tmp_path = tmp_path / 'run'
    shutil.copytree(root / 'first', tmp_path)  # a normal end at 5 (the runs fixture), then resume
    assert load(tmp_path)['iter_num'] == 5
    stop_with_sigterm(tmp_path, after=7, target='rank1', args=RESUME, max_iters=STRAIGHT)
    train(f'--out_dir={tmp_path}', f'--max_iters={STRAIGHT}', '--init_from=resume', *RESUME)
    assert_same_state(load(root / 'straight'), load(tmp_path))


# once: check_parallel's refusal is pure Python (tests/test_train.py checks its line), and torchrun's summary of
# a one-line refusal is checked on every torch by tests/test_rank_agreement.py
@pytest.mark.once
def test_offload_is_refused_under_fsdp(tmp_path):
    run = train(f'--out_dir={tmp_path}', '--omgd_state=offload', *TWO_RANKS, *FSDP, expect_ok=False)
    assert run.proc.returncode != 0 and '[rank0]: Traceback' not in run.out  # torchrun's own report aside
    assert "error: omgd_state='offload' is not supported with parallel='fsdp'" in run.out
