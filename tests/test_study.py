"""experiments/study.py: paired statistics on known numbers, resume, tables, block schedules, and a
smoke run of one tiny train.py run plus the in-process probe, which must reproduce train.py's losses."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import study  # noqa: E402


def test_paired_stats_known_numbers():
    p = study.paired_stats({s: 1.0 + s for s in range(5)}, {s: 0.0 for s in range(5)})  # diffs 1..5
    assert p['n'] == 5 and p['diffs'] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert p['mean'] == pytest.approx(3.0) and p['sd'] == pytest.approx(math.sqrt(2.5))
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)  # t_{0.975, 4}
    assert p['ci95'] == pytest.approx([3.0 - half, 3.0 + half])
    assert p['significant'] and p['a_wins'] == 0
    q = study.paired_stats({0: 1.0, 1: 2.0, 7: 5.0}, {0: 2.0, 1: 1.0})  # seed 7 unpaired: left out
    assert q['seeds'] == [0, 1] and q['mean'] == pytest.approx(0.0) and q['a_wins'] == 1 and not q['significant']
    assert q['ci95'] == pytest.approx([-12.706 * 1.0, 12.706 * 1.0])  # sd sqrt(2), /sqrt(2)


def fake_result(s, train, val=None):
    return {**s, 'returncode': 0, 'eval_iters': [0, 10], 'train_loss': [4.0, train], 'val_loss': [4.0, val or train + 0.1],
            'median_ms_per_iter': 5.0, 'last_logged_epoch': 10.0}


def test_resume_runs_only_missing_or_failed(tmp_path):
    specs = study.stage_specs('core_multi_adamw', [0, 1])
    assert len(specs) == 10 and [s['seed'] for s in specs[:5]] == [0] * 5  # seed-major
    calls = []

    def runner(s, runs_dir):
        calls.append(study.run_name(s))
        return fake_result(s, 2.0)

    got = study.run_specs(specs, str(tmp_path), jobs=2, runner=runner)
    assert len(calls) == 10 and len(got) == 10
    os.remove(study.result_path(str(tmp_path), specs[3]))
    with open(study.result_path(str(tmp_path), specs[7]), 'w') as f:
        json.dump({**specs[7], 'error': 'boom'}, f)
    calls.clear()
    got = study.run_specs(specs, str(tmp_path), jobs=2, runner=runner)
    assert sorted(calls) == sorted([study.run_name(specs[3]), study.run_name(specs[7])]) and len(got) == 10
    calls.clear()
    study.run_specs(specs, str(tmp_path), jobs=2, runner=runner)
    assert calls == []


def test_summary_pairs_and_table(tmp_path):
    results = []
    for seed in range(5):
        results.append(fake_result(study.spec('multi', 'adamw', 'lisa', 'keep', seed=seed), 2.0 + 0.01 * seed))
        results.append(fake_result(study.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=seed), 2.0 + 0.01 * seed + 0.02))
        results.append(fake_result(study.spec('multi', 'adamw', 'full', seed=seed), 1.9))
    rows, pairs = study.summarize(results)
    wor = [p for p in pairs if p['label'] == 'lisa_wor - lisa'][0]
    assert wor['train']['diffs'] == pytest.approx([0.02] * 5) and wor['train']['a_wins'] == 0
    assert {p['label'] for p in pairs} == {'lisa_wor - lisa', 'lisa_wor - full', 'lisa - full'}
    path = tmp_path / 'tables.md'
    study.write_tables(str(path), rows, pairs, {'command': 'x', 'runs_dir': 'r'})
    md = path.read_text()
    assert '| lisa_wor - lisa | multi-adamw-lisa_wor-keep-rr-K10-g2 | multi-adamw-lisa-keep-rr-K10-g2 | 5 | +0.0200' in md
    assert '| 0/5 |' in md
    assert '| multi-adamw-lisa-keep-rr-K10-g2 | 10 | 10.0 | 5 | 2.0200 | 2.1200 | 2.0000, 2.0100, 2.0200, 2.0300, 2.0400 |' in md


def test_schedule_stats_without_replacement_is_even():
    wor = study.schedule_stats('lisa_wor', 4, 2, 10, 200, seed=3)
    lisa = study.schedule_stats('lisa', 4, 2, 10, 200, seed=3)
    assert wor['steps_per_block'] == [100] * 4 and wor['window_spread_mean'] == 0 and wor['never_in_window'] == 0
    assert sum(lisa['steps_per_block']) == 400 and wor['gap_max'] <= 2 * 10 + 1  # at most M periods idle (M=2)
    assert wor['activations'] == lisa['activations'] == 40


def test_smoke_two_runs_resume_and_probe(tmp_path, monkeypatch):
    monkeypatch.setattr(study, 'BASE', dict(study.BASE, n_layer=4, n_head=2, n_embd=16, block_size=16, batch_size=4,
                                            eval_iters=1, log_interval=1, warmup_iters=2, omgd_period=2))
    monkeypatch.setattr(study, 'REGIMES', {'multi': dict(max_iters=6, eval_interval=3)})
    runs = str(tmp_path / 'runs')
    data = study.make_multi_dataset(runs, n_tokens=3000)
    assert os.path.getsize(os.path.join(data, 'train.bin')) == 6000
    specs = [study.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=0)]  # one train.py run: CI time
    got = study.run_specs(specs, runs, jobs=1)
    assert len(got) == 1
    for r in got.values():
        assert r['eval_iters'] == [0, 3, 6] and all(math.isfinite(x) for x in r['train_loss'])
        assert '--omgd_state=keep' in r['command'] and '--seed=0 --data_seed=0 --omgd_seed=0' in r['command']
        assert data in r['command']
    study.run_specs(specs, runs, jobs=1, runner=lambda s, d: pytest.fail('finished run re-run'))  # resume
    probe = study.probe(study.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=0, kind='probe'), runs)
    assert probe['train_log_match']['logged_iters_compared'] == 6
    assert probe['train_log_match']['max_abs_diff'] == 0  # the probe is train.py's loop: same losses
    assert sum(probe['steps_per_block']) == 6 * 2  # gamma=2 blocks train at each of 6 steps
