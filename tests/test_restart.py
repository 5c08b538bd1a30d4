"""Restart = resume: with --init_from=auto, a job that torchrun (--max-restarts) or a scheduler
starts again after a crash continues from out_dir's last checkpoint by itself, and ends bitwise
where an uninterrupted run ends.

The crash is a SIGKILL of the worker at a fixed iteration on its first launch only (this file's
__main__, run by torchrun as the worker: train.main with Trainer.step wrapped), so the test does
not race the training for a moment to kill it."""

import os
import signal
import sys

import pytest
from conftest import DDP_TINY, ROOT, assert_same_state, forked_torchrun, load

pytestmark = pytest.mark.torchrun  # launches torchrun (deselect with -m "not torchrun")

ARGS = [*DDP_TINY, '--batch_size=4', '--max_iters=12', '--eval_interval=4', '--init_from=auto']


# [2] on every torch: torchrun's restart of a dead worker, the attempt's store and a sharded resume; [1] goes through
# the same restart and store with one rank, and resumes ckpt.pt, whose torch.load test_resume.py covers on every torch
@pytest.mark.parametrize('workers', [pytest.param(1, marks=pytest.mark.once), 2])
def test_a_killed_worker_is_restarted_by_torchrun_and_resumes_bitwise(tmp_path, workers):
    """One worker (ckpt.pt), or two gloo workers (sharded step folders) of which rank 1 dies. Two
    workers: the restarted attempt once failed in init_process_group, reading the dead attempt's
    addresses from torchrun's store (distributed.attempt_store)."""
    args = [*ARGS, f'--gradient_accumulation_steps={2 * workers}']
    straight = forked_torchrun('train.py', *args, f'--out_dir={tmp_path / "straight"}', ranks=workers)
    assert straight.proc.returncode == 0, straight.out[-3000:]
    crashed = forked_torchrun(
        'tests/test_restart.py',
        *args,
        f'--out_dir={tmp_path / "crashed"}',
        ranks=workers,
        torchrun_args=['--max-restarts=1'],
        env={'KILL_AT_ITER': '6', 'KILL_RANK': str(workers - 1)},
    )
    out = crashed.out
    assert crashed.proc.returncode == 0, out[-3000:]
    assert 'killed at iteration 6' in out and 'resuming from iteration 4' in out, out[-3000:]
    assert_same_state(load(tmp_path / 'straight'), load(tmp_path / 'crashed'))
    # the records describe one run: iterations 4 and 5 ran twice, and are in the file once
    import json

    with open(tmp_path / 'crashed' / 'metrics.jsonl') as f:
        iters = [r['iter'] for r in map(json.loads, f) if r['kind'] == 'iter']
    assert iters == list(range(12)), iters


def test_auto_starts_from_scratch_then_resumes(tmp_path):
    """The same command twice: the first trains from scratch, the second continues the checkpoint
    (where init_from=resume fails on a first launch and scratch refuses a second)."""
    from conftest import run_train

    first = run_train(f'--out_dir={tmp_path}', '--init_from=auto', '--max_iters=4', '--eval_interval=4')
    assert 'resuming' not in first.stdout and load(tmp_path)['iter_num'] == 4
    second = run_train(f'--out_dir={tmp_path}', '--init_from=auto', '--max_iters=8', '--eval_interval=4')
    assert f"resuming from iteration 4 of {tmp_path / 'ckpt.pt'}" in second.stdout
    assert load(tmp_path)['iter_num'] == 8


if __name__ == '__main__':
    # the worker torchrun starts: train.py's main; rank KILL_RANK is killed (SIGKILL, no clean-up, as a
    # preempted node or an OOM kill) when it reaches iteration KILL_AT_ITER, on the first launch only,
    # once the background write of the last checkpoint has ended (else that checkpoint is lost too)
    sys.path.insert(0, ROOT)
    import train
    from infra import checkpoint_dcp
    from trainer import Trainer

    step = Trainer.step

    def step_or_die(trainer):
        if trainer.iter_num == int(os.environ['KILL_AT_ITER']) and os.environ.get('TORCHELASTIC_RESTART_COUNT') == '0':
            for saver in list(checkpoint_dcp._SAVERS):
                saver.wait()  # a collective: every rank
            if os.environ['RANK'] == os.environ['KILL_RANK']:
                print(f"killed at iteration {trainer.iter_num}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return step(trainer)

    Trainer.step = step_or_die
    sys.exit(train.main(sys.argv[1:]))
