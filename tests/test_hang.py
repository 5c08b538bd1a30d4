"""A rank that hangs (SIGSTOP) or dies (SIGKILL) under torchrun: the other rank's next collective
fails within --dist_timeout_s, and it ends with one line naming itself and the cause, not a
silent wait or gloo's traceback; the last checkpoint stays."""

import os
import signal

import pytest
from conftest import DDP_TINY, TORCHRUN, TWO_RANKS, Launch, kill_tree, load, worker_pids

pytestmark = pytest.mark.torchrun  # launches torchrun (deselect with -m "not torchrun")

LONG = [
    *DDP_TINY,
    *TWO_RANKS,
    '--max_iters=100000',
    '--eval_interval=5',
    '--dist_timeout_s=10',
    '--checkpoint_format=file',
]  # saved once 'saved checkpoint' is printed (a sharded save may still run)


@pytest.mark.parametrize('fault', [signal.SIGSTOP, signal.SIGKILL], ids=['hung', 'dead'])
def test_a_hung_or_dead_rank_ends_the_run_in_one_line(tmp_path, fault):
    run = Launch([*TORCHRUN, 'train.py', *LONG, f'--out_dir={tmp_path}'])
    try:
        run.wait_for(r'saved checkpoint to ')
        saved = load(tmp_path)['iter_num']
        os.kill(worker_pids(run)[1], fault)
        match = run.wait_for(
            r'error: rank 0: a collective with the other ranks failed \(.*\): another rank is stuck '
            r'or dead; the last checkpoint in .* is kept: resume with --init_from=auto',
            timeout=120,
        )
        assert '\n' not in match.group(0)
        assert 'Traceback' not in run.out.split('error: rank 0')[0][-3000:]  # no traceback of rank 0 before it
    finally:
        kill_tree(run.proc)
        run.proc.wait()
    assert load(tmp_path)['iter_num'] >= saved  # the checkpoint is whole and loads
