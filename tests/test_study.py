"""experiments/study.py (with experiments/runner.py and experiments/stats.py): paired statistics on
known numbers, resume, tables, block schedules, and a smoke run of tiny train.py runs: one the
in-process probe must reproduce, and a fine-tuning run that starts from a pre-trained checkpoint."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import runner  # noqa: E402
import stats  # noqa: E402
import study  # noqa: E402


def test_paired_stats_known_numbers():
    p = stats.paired({s: 1.0 + s for s in range(5)}, {s: 0.0 for s in range(5)})  # diffs 1..5
    assert p['n'] == 5 and p['diffs'] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert p['mean'] == pytest.approx(3.0) and p['sd'] == pytest.approx(math.sqrt(2.5))
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)  # t_{0.975, 4}
    assert p['ci95'] == pytest.approx([3.0 - half, 3.0 + half])
    assert p['t'] == pytest.approx(3.0 / (math.sqrt(2.5) / math.sqrt(5)))
    assert p['significant'] and p['a_wins'] == 0
    q = stats.paired({0: 1.0, 1: 2.0, 7: 5.0}, {0: 2.0, 1: 1.0})  # seed 7 unpaired: left out
    assert q['seeds'] == [0, 1] and q['mean'] == pytest.approx(0.0) and q['a_wins'] == 1 and not q['significant']
    assert q['ci95'] == pytest.approx([-12.706 * 1.0, 12.706 * 1.0])  # sd sqrt(2), /sqrt(2)
    assert stats.paired({0: 1.0}, {1: 1.0}) is None
    assert stats.fmt_pair(p) == f'+3.0000 [{3.0 - half:+.4f}, {3.0 + half:+.4f}] *'


def fake_result(s, train, val=None):
    return {**s, 'returncode': 0, 'eval_iters': [0, 10], 'train_loss': [4.0, train], 'val_loss': [4.0, val or train + 0.1],
            'median_ms_per_iter': 5.0, 'last_logged_epoch': 10.0, 'wall_s': 1.0}


def test_resume_runs_only_missing_or_failed(tmp_path):
    specs = study.stage_specs('m4_multi_adamw', [0, 1])
    assert len(specs) == 16 and [s['seed'] for s in specs[:8]] == [0] * 8  # seed-major
    assert {(s['n_layer'], s['gamma'], s['K'], s['iters']) for s in specs} == {(8, 2, 3, 600), (12, 3, 3, 600)}
    calls = []

    def launch(s, out_dir, runs_dir):
        calls.append(study.run_name(s))
        assert out_dir == os.path.join(runs_dir, study.run_name(s))
        return fake_result(s, 2.0)

    got = study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert len(calls) == 16 and len(got) == 16
    os.remove(study.result_path(str(tmp_path), specs[3]))
    with open(study.result_path(str(tmp_path), specs[7]), 'w') as f:
        json.dump({**specs[7], 'error': 'boom'}, f)
    calls.clear()
    got = study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert sorted(calls) == sorted([study.run_name(specs[3]), study.run_name(specs[7])]) and len(got) == 16
    calls.clear()
    study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert calls == []
    assert len(runner.all_results(str(tmp_path))) == 16


def test_train_args_per_regime(tmp_path):
    runs = str(tmp_path / 'runs')
    ft = study.spec('ft', 'adamw', 'lisa_wor', 'drop', seed=3, **study.FT_GEOMETRY)
    args = study.train_args(ft, runs)
    assert '--init_from=resume' in args and f'--dataset={study.ft_dataset(runs)}' in args
    assert '--learning_rate=0.001' in args and '--omgd_gamma=3' in args and '--omgd_period=3' in args
    assert '--n_layer=12' in args and '--batch_size=8' in args and '--block_size=32' in args
    assert '--omgd_state=drop' in args
    assert '--seed=3 --data_seed=3 --omgd_seed=3' in ' '.join(args) and '--eval_interval=60' in args
    sgd = study.train_args(study.spec('sub', 'sgd', 'lisa', n_layer=4), runs)
    assert '--dataset=shakespeare_char' in sgd and '--learning_rate=0.1' in sgd and '--batch_size=32' in sgd
    assert '--init_from=resume' not in sgd and '--max_iters=240' in sgd
    full = study.spec('multi', 'adamw', 'full', 'drop', K=7, gamma=3)
    assert (full['state'], full['K'], full['gamma']) == ('na', 0, 0)


def test_summary_pairs_and_table(tmp_path):
    results = []
    for seed in range(5):
        results.append(fake_result(study.spec('multi', 'adamw', 'lisa', 'keep', seed=seed), 2.0 + 0.01 * seed))
        results.append(fake_result(study.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=seed), 2.0 + 0.01 * seed + 0.02))
        results.append(fake_result(study.spec('multi', 'adamw', 'full', seed=seed), 1.9))
        results.append(fake_result(study.spec('multi', 'adamw', 'lisa', 'keep', seed=seed, n_layer=8), 1.0))  # no partner
    rows, pairs = study.summarize(results)
    wor = [p for p in pairs if p['label'] == 'lisa_wor - lisa'][0]
    assert wor['train']['diffs'] == pytest.approx([0.02] * 5) and wor['train']['a_wins'] == 0
    assert {p['label'] for p in pairs} == {'lisa_wor - lisa', 'lisa_wor - full', 'lisa - full'}
    path = tmp_path / 'tables.md'
    study.write_tables(str(path), rows, pairs, {'command': 'x', 'runs_dir': 'r'})
    md = path.read_text()
    assert ('| lisa_wor - lisa | L4-multi480-adamw-lisa_wor-keep-rr-K10-g2 | L4-multi480-adamw-lisa-keep-rr-K10-g2 '
            '| 5 | +0.0200') in md
    assert '| 0/5 |' in md
    assert ('| L4-multi480-adamw-lisa-keep-rr-K10-g2 | 10 | 10.0 | 5 | 2.0200 | 2.1200 | '
            '2.0000, 2.0100, 2.0200, 2.0300, 2.0400 |') in md
    study.plot(str(tmp_path / 'loss.png'), rows)
    assert (tmp_path / 'loss.png').stat().st_size > 0


def test_schedule_stats_without_replacement_is_even():
    wor = study.schedule_stats('lisa_wor', 4, 2, 10, 200, seed=3)
    lisa = study.schedule_stats('lisa', 4, 2, 10, 200, seed=3)
    assert wor['steps_per_block'] == [100] * 4 and wor['window_spread_mean'] == 0 and wor['never_in_window'] == 0
    assert sum(lisa['steps_per_block']) == 400 and wor['gap_max'] <= 2 * 10 + 1  # at most M periods idle (M=2)
    assert wor['activations'] == lisa['activations'] == 40
    wor4 = study.schedule_stats('lisa_wor', 12, 3, 3, 600, seed=1)  # M = 4: every block once per cycle of 12 steps
    assert wor4['steps_per_block'] == [150] * 12 and wor4['window_spread_mean'] == 0
    assert wor4['gap_max'] <= 2 * 4 * 3 - 3 + 1


TINY = dict(n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, log_interval=1, warmup_iters=2)


def test_smoke_runs_resume_probe_and_finetune(tmp_path, monkeypatch):
    monkeypatch.setattr(study, 'BASE', dict(study.BASE, **TINY, omgd_period=2))
    monkeypatch.setattr(study, 'ITERS', {'multi': 6, 'pre': 6, 'ft': 4})
    monkeypatch.setattr(study, 'EVALS', 2)
    monkeypatch.setattr(study, 'PRETRAIN', dict(study.PRETRAIN, n_layer=4, iters=6))
    monkeypatch.setattr(study, 'MULTI_TOKENS', 3000)
    monkeypatch.setattr(study, 'FT_TOKENS', 2000)
    runs = str(tmp_path / 'runs')
    data = study.make_multi_dataset(runs)
    assert os.path.getsize(os.path.join(data, 'train.bin')) == 6000
    ft_data = study.make_ft_dataset(runs)
    assert (os.path.getsize(os.path.join(ft_data, 'train.bin')), os.path.getsize(os.path.join(ft_data, 'val.bin'))) \
        == (4000, 400)
    wor = study.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=0)
    got = study.run_specs([wor], runs, jobs=1)
    r = got[study.run_name(wor)]
    assert r['eval_iters'] == [0, 3, 6] and all(math.isfinite(x) for x in r['train_loss'])
    assert '--omgd_state=keep' in r['command'] and '--seed=0 --data_seed=0 --omgd_seed=0' in r['command']
    assert data in r['command']
    study.run_specs([wor], runs, jobs=1, launch=lambda *a: pytest.fail('finished run re-run'))  # resume
    probe = study.probe({**wor, 'kind': 'probe'}, runs)
    assert probe['train_log_match']['logged_iters_compared'] == 6
    assert probe['train_log_match']['max_abs_diff'] == 0  # the probe is train.py's loop: same losses
    assert sum(probe['steps_per_block']) == 6 * 2  # gamma=2 blocks train at each of 6 steps
    # fine-tuning: the pre-trained model (its checkpoint kept), then a run resumed from it at iteration 0
    pre = study.spec(**study.PRETRAIN)
    study.run_specs(study.stage_specs('m4_pre', [0]), runs, jobs=1)
    assert os.path.exists(os.path.join(runs, study.run_name(pre), 'ckpt.pt'))
    ft = study.spec('ft', 'adamw', 'lisa_wor', 'drop', seed=1, n_layer=4, gamma=2, K=2)
    r = study.run_specs([ft], runs, jobs=1)[study.run_name(ft)]
    assert 'error' not in r, r
    assert '--init_from=resume' in r['command'] and ft_data in r['command'] and r['eval_iters'] == [0, 2, 4]
    log = open(os.path.join(runs, study.run_name(ft), 'train.log')).read()
    assert 'resuming from iteration 0' in log
    # the start: the pre-trained weights, a fresh optimizer, the run's own cycler, data order and config
    import torch
    study.finetune_start(ft, str(tmp_path / 'start'), runs)
    start = torch.load(str(tmp_path / 'start' / 'ckpt.pt'), weights_only=False)
    pretrained = torch.load(os.path.join(runs, study.run_name(pre), 'ckpt.pt'), weights_only=False)
    assert start['model'].keys() == pretrained['model'].keys()
    assert all(torch.equal(start['model'][k], pretrained['model'][k]) for k in start['model'])
    assert start['iter_num'] == 0 and start['optimizer']['state'] == {} and pretrained['optimizer']['state']
    assert (start['config']['method'], start['config']['omgd_seed'], start['config']['dataset']) == ('lisa_wor', 1, ft_data)
