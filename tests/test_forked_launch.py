"""conftest.forked_torchrun, the launcher of the two-rank tests: a worker's failure, a line never printed and a hang
each fail the launch with its output; the pytest process gets its environment and signal handlers back."""

import os
import re
import signal
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import forked_torchrun  # noqa: E402

SCRIPT = 'tests/test_forked_launch.py'  # run as the workers' script: the block at the end
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@pytest.mark.torchrun
def test_a_worker_that_raises_fails_the_launch_with_its_traceback():
    run = forked_torchrun(SCRIPT, env={'PROBE': 'raise'})
    assert run.proc.returncode == 1, run.out[-3000:]
    assert 'ZeroDivisionError' in run.out and 'ChildFailedError' in run.out, run.out[-3000:]


@pytest.mark.torchrun
def test_a_line_never_printed_or_a_hang_fails_and_the_next_launch_works():
    with pytest.raises(pytest.fail.Exception, match='never printed'):
        forked_torchrun(SCRIPT, env={'PROBE': 'hello'}, during=lambda run: run.wait_for('goodbye', timeout=30))
    with pytest.raises(pytest.fail.Exception, match='timed out after 3 s'):
        forked_torchrun(SCRIPT, env={'PROBE': 'hang'}, timeout=3)
    run = forked_torchrun(SCRIPT, env={'PROBE': 'hello'})
    assert run.proc.returncode == 0 and sorted(re.findall(r'rank (\d) says hello', run.out)) == ['0', '1'], run.out
    # the agent sets these in its process, this one: a later test (a signal, a config read) must not meet them
    assert 'TORCHELASTIC_SIGNALS_TO_HANDLE' not in os.environ
    assert not any(getattr(signal.getsignal(s), '__module__', '').startswith('torch.') for s in SIGNALS)


if __name__ == '__main__':  # a worker of the launches above
    probe = os.environ['PROBE']
    if probe == 'raise':
        print(1 / 0)
    elif probe == 'hang':
        time.sleep(600)
    print(f"rank {os.environ['RANK']} says hello")
