"""experiments/precision.py: its runs are train.py's keys, and its statistics pair the precisions by seed."""

import os
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import precision  # noqa: E402
import runner  # noqa: E402


def test_every_run_is_a_valid_train_py_config_seeded_as_one():
    jobs = precision.jobs_for([200, 201], 2000, precision.PRECISIONS)
    assert [j['name'] for j in jobs[:3]] == ['amp_s200', 'bf16_master_s200', 'bf16_s200']  # seed-major: pairs first
    cfg = runner.config_of(jobs[2]['args'])
    assert (cfg['precision'], cfg['seed'], cfg['data_seed'], cfg['omgd_seed']) == ('bf16', 200, 200, 200)
    assert (cfg['max_iters'], cfg['lr_decay_iters'], cfg['eval_interval']) == (2000, 2000, 200)


def test_differences_are_paired_by_seed_at_every_evaluation():
    curves = {
        ('amp', 1): [4.0, 2.0],
        ('amp', 2): [4.0, 3.0],
        ('bf16', 1): [4.0, 2.5],
        ('bf16', 2): [4.0, 3.1],
        ('bf16_master', 1): [4.0, 2.1],
    }  # seed 2 of bf16_master failed: left out of its pairs
    results = {
        f'{p}_s{s}': {'precision': p, 'seed': s, 'eval_iters': [0, 10], 'val_loss': v} for (p, s), v in curves.items()
    }
    results['bf16_master_s2'] = {'precision': 'bf16_master', 'seed': 2, 'error': 'exit code 1'}
    out = precision.analyse(results, precision.PRECISIONS)
    bf16 = out['pairs']['bf16 - amp']
    assert bf16['final']['diffs'] == pytest.approx([0.5, 0.1]) and bf16['final']['n'] == 2
    assert bf16['over_time'][0]['mean'] == 0 and bf16['eval_iters'] == [0, 10]
    assert out['pairs']['bf16_master - amp']['final']['seeds'] == [1]
    text = precision.markdown(out, 'python experiments/precision.py', 60)
    assert '| bf16 | 2 | 2.8000 ± 0.4243 |' in text and '**bf16 - amp**' in text


def test_bad_arguments_are_one_line(capsys):
    for argv, message in (
        (['--seeds=1,x'], "--seeds must be comma-separated integers"),
        (['--precisions=fp8'], "--precisions must be among amp,bf16_master,bf16"),
        (["--iters=5"], "iters must be at least 10"),
    ):
        with pytest.raises(SystemExit) as e:
            precision.main(argv)
        assert str(e.value.code).startswith(f"error: {message}"), e.value.code
