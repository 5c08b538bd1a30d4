"""distributed.check_same_config: ranks given different configs are refused at start, in one line naming the
first key that differs, before any collective of training could crash or the ranks train apart."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import DDP_TINY, ROOT, TORCHRUN, Launch  # noqa: E402

pytestmark = pytest.mark.torchrun


# one key on every torch: all four go through the same all-gather of the configs; the others differ only in
# check_same_config's pure-Python comparison and formatting (a float, a string, the key that would hang)
ONCE = pytest.mark.once


@pytest.mark.parametrize(
    'extra',
    [
        '--seed=2',
        pytest.param('--learning_rate=0.0123', marks=ONCE),
        pytest.param('--method=lisa', marks=ONCE),
        pytest.param('--max_iters=9', marks=ONCE),
    ],
)
def test_ranks_given_different_configs_are_refused_naming_the_key(tmp_path, extra):
    """Rank 1 alone gets `extra` (as a per-node wrapper would give it): every rank refuses with one line naming
    the key, nothing is trained or written."""
    out = tmp_path / 'run'
    cmd = [
        *TORCHRUN,
        'tests/test_rank_agreement.py',
        *DDP_TINY,
        '--max_iters=6',
        '--gradient_accumulation_steps=2',
        f'--out_dir={out}',
    ]
    run = Launch(cmd, env={'RANK_1_EXTRA': extra}).wait()
    assert run.proc.returncode != 0
    key, value = extra[2:].split('=')
    errors = [line for line in run.out.splitlines() if line.startswith('error: ')]
    assert len(errors) == 1 and re.search(
        rf"rank 1 was given {key}=.*{re.escape(value)}.* and rank 0 {key}=", errors[0]
    ), run.out[-3000:]
    assert 'train.py", line' not in run.out, run.out[-3000:]  # no worker traceback (torchrun prints its own)
    # torchrun's failure summary names the line as its root cause (the error file), not a link to its docs
    root_cause = run.out[run.out.rindex('Root Cause') :]
    assert f'traceback : {errors[0]}' in root_cause and 'To enable traceback' not in run.out, root_cause
    assert not out.exists() or not any(p.name != '.lock' for p in out.iterdir())


if __name__ == '__main__':
    # the worker torchrun starts: train.py's main, with $RANK_1_EXTRA added to rank 1's command line only
    sys.path.insert(0, ROOT)
    import train as train_script

    extra = [os.environ['RANK_1_EXTRA']] if os.environ.get('RANK') == '1' and os.environ.get('RANK_1_EXTRA') else []
    sys.exit(train_script.main(sys.argv[1:] + extra))
