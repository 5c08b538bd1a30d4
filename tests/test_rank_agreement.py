"""distributed.check_same_config: ranks given different configs are refused at start, in one line naming the
first key that differs, before any collective of training could crash or the ranks train apart."""

import os
import re
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import DDP_TINY, ROOT, TORCHRUN, Launch  # noqa: E402

import train_config  # noqa: E402
from infra import distributed  # noqa: E402


@pytest.mark.torchrun
def test_ranks_given_different_configs_are_refused_naming_the_key(tmp_path):
    """Rank 1 alone gets `extra` (as a per-node wrapper would give it): every rank refuses with one line naming
    the key, nothing is trained or written."""
    extra = '--seed=2'
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


# the launch above on every torch; the same all-gathered comparison for a float, a string and the key that would
# hang (a different max_iters) is pure Python: in-process, on the configs train.py reads from each rank's arguments
@pytest.mark.once
@pytest.mark.parametrize('extra', ['--learning_rate=0.0123', '--method=lisa', '--max_iters=9'])
def test_the_refusal_names_the_key_that_differs(extra):
    args = [*DDP_TINY, '--max_iters=6', '--gradient_accumulation_steps=2']
    configs = [train_config.load(args), train_config.load([*args, extra])]
    with pytest.raises(ValueError) as refused:
        distributed.check_same_config(types.SimpleNamespace(gather=lambda cfg: configs), configs[0])
    key, value = extra[2:].split('=')
    assert re.fullmatch(
        rf"rank 1 was given {key}=.*{re.escape(value)}.* and rank 0 {key}=\S+: every rank must run the same command "
        "and config",
        str(refused.value),
    ), refused.value


if __name__ == '__main__':
    # the worker torchrun starts: train.py's main, with $RANK_1_EXTRA added to rank 1's command line only
    sys.path.insert(0, ROOT)
    import train as train_script

    extra = [os.environ['RANK_1_EXTRA']] if os.environ.get('RANK') == '1' and os.environ.get('RANK_1_EXTRA') else []
    sys.exit(train_script.main(sys.argv[1:] + extra))
