"""A rank that hangs (SIGSTOP) or dies (SIGKILL) under torchrun: the other rank's next collective
fails within --dist_timeout_s, and it ends with one line naming itself and the cause, not a
silent wait or gloo's traceback; the last checkpoint stays."""

import contextlib
import os
import signal

import pytest
from conftest import DDP_TINY, TWO_RANKS, forked_torchrun, load

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
    saved = []

    def fault_rank1(run):
        run.wait_for(r'saved checkpoint to ')
        saved.append(load(tmp_path)['iter_num'])
        rank1 = run.worker_pids()[1]
        os.kill(rank1, fault)
        match = run.wait_for(
            r'error: rank 0: a collective with the other ranks failed \(.*\): another rank is stuck '
            r'or dead; the last checkpoint in .* is kept: resume with --init_from=auto',
            timeout=120,
        )
        assert '\n' not in match.group(0)
        assert 'Traceback' not in run.out.split('error: rank 0')[0][-3000:]  # no traceback of rank 0 before it
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1, signal.SIGKILL)  # a stopped process cannot act on torchrun's SIGTERM

    run = forked_torchrun('train.py', *LONG, f'--out_dir={tmp_path}', during=fault_rank1)
    assert run.proc.returncode == 1
    assert load(tmp_path)['iter_num'] >= saved[0]  # the checkpoint is whole and loads
