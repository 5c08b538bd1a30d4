"""sample.py: text from a checkpoint written by train.py."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from test_train import run_train  # noqa: E402


def test_sample_from_checkpoint_and_missing_checkpoint(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4')
    cmd = [sys.executable, 'sample.py', f'--out_dir={tmp_path}', '--start=ROMEO:', '--max_new_tokens=40',
           '--num_samples=2']
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split('---------------')
    assert len(samples) == 3 and all(s.strip().startswith('ROMEO:') for s in samples[:2])
    assert len(samples[0].strip()) == len('ROMEO:') + 40
    bad = subprocess.run(cmd[:3] + ['--start=ROMEO{}'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.strip() == "error: --start: characters '{}' are not in the " \
        "dataset's vocabulary"
    cmd[2] = f'--out_dir={tmp_path / "none"}'
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and result.stderr.strip().startswith('error: no checkpoint at')
