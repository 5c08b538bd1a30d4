"""Faults beyond a bad value: a second writer into a running run's out_dir, a writer that crashed,
a reader of the log that goes away. Each ends in one `error:` line (or a clean exit) and loses nothing."""
import os
import signal
import subprocess
import sys

from conftest import ROOT, TINY, Launch, assert_one_line_error, load, run_train


def test_a_second_writer_is_refused_and_a_crashed_one_leaves_no_lock(tmp_path):
    out = tmp_path / 'run'
    first = Launch([sys.executable, 'train.py', *TINY, f'--out_dir={out}', '--max_iters=100000',
                    '--eval_interval=5'])
    try:
        first.wait_for(r'saved checkpoint to ')
        saved = (out / 'ckpt.pt').read_bytes()
        for args in (['--overwrite=True'], ['--init_from=resume'], ['--init_from=auto']):
            result = run_train(f'--out_dir={out}', '--max_iters=3', *args, expect_ok=False)
            assert_one_line_error(result, rf"out_dir='{out}' is in use by the run of pid {first.proc.pid} on .*, "
                                          rf"started .*; wait for that run to end or stop it, or choose another --out_dir")
        # evaluating beside it writes nothing, so it is let through, and removes none of its files
        os.kill(first.proc.pid, signal.SIGSTOP)  # no save of the first run between the two reads
        try:
            saved = (out / 'ckpt.pt').read_bytes()
            run_train(f'--out_dir={out}', '--eval_only=True', '--init_from=resume')
            assert (out / 'ckpt.pt').read_bytes() == saved
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
    finally:
        os.kill(first.proc.pid, signal.SIGKILL)  # a crash: no clean-up, the lock file stays behind
        first.proc.wait()
    iteration = load(out)['iter_num']
    resumed = run_train(f'--out_dir={out}', '--init_from=auto', f'--max_iters={iteration + 2}')
    assert f'resuming from iteration {iteration}' in resumed.stdout


def test_a_log_reader_that_goes_away_does_not_kill_the_run(tmp_path):
    """`python train.py | head -1`: the log is cut, the run trains on and saves."""
    cmd = f"{sys.executable} train.py {' '.join(TINY)} --out_dir={tmp_path} --max_iters=6 --eval_interval=6 | head -1"
    result = subprocess.run(['bash', '-o', 'pipefail', '-c', cmd], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and 'BrokenPipeError' not in result.stderr, result.stderr[-2000:]
    assert result.stdout.count('\n') == 1
    assert load(tmp_path)['iter_num'] == 6
