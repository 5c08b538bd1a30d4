"""experiments/study.py and its parts (study_plan, study_stats, study_report, study_probe; with runner.py and
stats.py): paired statistics on known numbers, resume, tables, block schedules, and a smoke run of tiny train.py
runs: one the in-process probe must reproduce, and a fine-tuning run that starts from a pre-trained checkpoint."""

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
import study_plan  # noqa: E402
import study_probe  # noqa: E402
import study_report  # noqa: E402
import study_stats  # noqa: E402


def test_paired_stats_known_numbers():
    p = stats.paired({s: 1.0 + s for s in range(5)}, {s: 0.0 for s in range(5)})  # diffs 1..5
    assert p['n'] == 5 and p['diffs'] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert p['mean'] == pytest.approx(3.0) and p['sd'] == pytest.approx(math.sqrt(2.5))
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)  # t_{0.975, 4}
    assert p['ci95'] == pytest.approx([3.0 - half, 3.0 + half])
    assert p['t'] == pytest.approx(3.0 / (math.sqrt(2.5) / math.sqrt(5)))
    assert p['significant'] and p['a_wins'] == 0
    q = stats.paired({0: 1.0, 1: 2.0, 7: 5.0}, {0: 2.0, 1: 1.0})  # seed 7 unpaired: left out
    assert q['seeds'] == [0, 1] and q['mean'] == pytest.approx(0.0) and q['a_wins'] == 1 and not q['significant']
    assert q['ci95'] == pytest.approx([-12.706204736174696, 12.706204736174696])  # sd sqrt(2), /sqrt(2)
    assert stats.paired({0: 1.0}, {1: 1.0}) is None
    assert stats.fmt_pair(p) == f'+3.0000 [{3.0 - half:+.4f}, {3.0 + half:+.4f}] *'


# Student's t 0.975 quantiles from the printed tables (3 decimals), and 0.995 ones (the 99% intervals)
T975_TABLE = {
    1: 12.706,
    2: 4.303,
    4: 2.776,
    9: 2.262,
    19: 2.093,
    20: 2.086,
    29: 2.045,
    30: 2.042,
    60: 2.000,
    120: 1.980,
    1000: 1.962,
}
T995_TABLE = {1: 63.657, 4: 4.604, 9: 3.250, 30: 2.750, 1000: 2.581}


def test_t_quantile_matches_the_tables_for_any_degrees_of_freedom():
    for df, t in T975_TABLE.items():
        assert stats.t975(df) == pytest.approx(t, abs=6e-4), df
        assert stats.t_cdf(stats.t975(df), df) == pytest.approx(0.975, abs=1e-12)
    for df, t in T995_TABLE.items():
        assert stats.t_quantile(0.995, df) == pytest.approx(t, abs=6e-4), df
    assert stats.t_quantile(0.975, 10**7) == pytest.approx(1.959964, abs=1e-5)  # the normal quantile
    assert stats.t_quantile(0.025, 9) == pytest.approx(-stats.t975(9)) and stats.t_quantile(0.5, 3) == 0.0
    assert stats.t_cdf(0.0, 5) == pytest.approx(0.5) and stats.betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248)
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 3)


@pytest.mark.parametrize('n', [2, 20, 21, 31, 1001])
def test_paired_interval_exists_for_any_number_of_seeds(n):
    diffs = [0.01 * ((7 * s) % 11) - 0.03 for s in range(n)]
    p = stats.paired({s: 1.0 + d for s, d in enumerate(diffs)}, {s: 1.0 for s in range(n)})
    assert p['n'] == n and p['ci95'] is not None
    mean, sd = sum(diffs) / n, p['sd']
    half = T975_TABLE.get(n - 1, stats.t975(n - 1)) * sd / math.sqrt(n)
    assert p['ci95'] == pytest.approx([mean - half, mean + half], abs=6e-4 * sd / math.sqrt(n) + 1e-12)
    m, lo, hi = stats.interval(diffs, 0.99)
    assert m == pytest.approx(mean) and hi - lo == pytest.approx(2 * stats.t_quantile(0.995, n - 1) * sd / math.sqrt(n))


def fake_result(s, train, val=None):
    return {
        **s,
        'returncode': 0,
        'eval_iters': [0, 10],
        'train_loss': [4.0, train],
        'val_loss': [4.0, val or train + 0.1],
        'median_ms_per_iter': 5.0,
        'last_logged_epoch': 10.0,
        'wall_s': 1.0,
    }


def test_resume_runs_only_missing_or_failed(tmp_path):
    specs = study_plan.stage_specs('m4_multi_adamw', [0, 1])
    assert len(specs) == 16 and [s['seed'] for s in specs[:8]] == [0] * 8  # seed-major
    assert {(s['n_layer'], s['gamma'], s['K'], s['iters']) for s in specs} == {(8, 2, 3, 600), (12, 3, 3, 600)}
    calls = []

    def launch(s, out_dir, runs_dir):
        calls.append(study_plan.run_name(s))
        assert out_dir == os.path.join(runs_dir, study_plan.run_name(s))
        return fake_result(s, 2.0)

    got = study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert len(calls) == 16 and len(got) == 16
    os.remove(study.result_path(str(tmp_path), specs[3]))
    with open(study.result_path(str(tmp_path), specs[7]), 'w') as f:
        json.dump({**specs[7], 'error': 'boom'}, f)
    calls.clear()
    got = study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert sorted(calls) == sorted([study_plan.run_name(specs[3]), study_plan.run_name(specs[7])]) and len(got) == 16
    calls.clear()
    study.run_specs(specs, str(tmp_path), jobs=2, launch=launch)
    assert calls == []
    assert len(runner.all_results(str(tmp_path))) == 16


def test_train_args_per_regime(tmp_path):
    runs = str(tmp_path / 'runs')
    ft = study_plan.spec('ft', 'adamw', 'lisa_wor', 'drop', seed=3, **study_plan.FT_GEOMETRY)
    args = study_plan.train_args(ft, runs)
    assert '--init_from=resume' in args and f'--dataset={study_plan.ft_dataset(runs)}' in args
    assert '--learning_rate=0.001' in args and '--omgd_gamma=3' in args and '--omgd_period=3' in args
    assert '--n_layer=12' in args and '--batch_size=8' in args and '--block_size=32' in args
    assert '--omgd_state=drop' in args
    assert '--seed=3 --data_seed=3 --omgd_seed=3' in ' '.join(args) and '--eval_interval=60' in args
    sgd = study_plan.train_args(study_plan.spec('sub', 'sgd', 'lisa', n_layer=4), runs)
    assert '--dataset=shakespeare_char' in sgd and '--learning_rate=0.1' in sgd and '--batch_size=32' in sgd
    assert '--init_from=resume' not in sgd and '--max_iters=240' in sgd
    full = study_plan.spec('multi', 'adamw', 'full', 'drop', K=7, gamma=3)
    assert (full['state'], full['K'], full['gamma']) == ('na', 0, 0)


def test_summary_pairs_and_table(tmp_path):
    results = []
    for seed in range(5):
        results.append(fake_result(study_plan.spec('multi', 'adamw', 'lisa', 'keep', seed=seed), 2.0 + 0.01 * seed))
        results.append(
            fake_result(study_plan.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=seed), 2.0 + 0.01 * seed + 0.02)
        )
        results.append(fake_result(study_plan.spec('multi', 'adamw', 'full', seed=seed), 1.9))
        results.append(
            fake_result(study_plan.spec('multi', 'adamw', 'lisa', 'keep', seed=seed, n_layer=8), 1.0)
        )  # no partner
    rows, pairs = study_stats.summarize(results)
    wor = [p for p in pairs if p['label'] == 'lisa_wor - lisa'][0]
    assert wor['train']['diffs'] == pytest.approx([0.02] * 5) and wor['train']['a_wins'] == 0
    assert {p['label'] for p in pairs} == {'lisa_wor - lisa', 'lisa_wor - full', 'lisa - full'}
    path = tmp_path / 'tables.md'
    study_report.write_tables(str(path), rows, pairs, {'command': 'x', 'runs_dir': 'r'})
    md = path.read_text()
    assert (
        '| lisa_wor - lisa | L4-multi480-adamw-lisa_wor-keep-rr-K10-g2 | L4-multi480-adamw-lisa-keep-rr-K10-g2 '
        '| 5 | +0.0200'
    ) in md
    assert '| 0/5 |' in md
    assert (
        '| L4-multi480-adamw-lisa-keep-rr-K10-g2 | 10 | 10.0 | 5 | 2.0200 | 2.1200 | '
        '2.0000, 2.0100, 2.0200, 2.0300, 2.0400 |'
    ) in md
    study_report.plot(str(tmp_path / 'loss.png'), rows)
    assert (tmp_path / 'loss.png').stat().st_size > 0


def test_schedule_stats_without_replacement_is_even():
    wor = study_probe.schedule_stats('lisa_wor', 4, 2, 10, 200, seed=3)
    lisa = study_probe.schedule_stats('lisa', 4, 2, 10, 200, seed=3)
    assert wor['steps_per_block'] == [100] * 4 and wor['window_spread_mean'] == 0 and wor['never_in_window'] == 0
    assert sum(lisa['steps_per_block']) == 400 and wor['gap_max'] <= 2 * 10 + 1  # at most M periods idle (M=2)
    assert wor['activations'] == lisa['activations'] == 40
    wor4 = study_probe.schedule_stats(
        'lisa_wor', 12, 3, 3, 600, seed=1
    )  # M = 4: every block once per cycle of 12 steps
    assert wor4['steps_per_block'] == [150] * 12 and wor4['window_spread_mean'] == 0
    assert wor4['gap_max'] <= 2 * 4 * 3 - 3 + 1


TINY = dict(n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1, log_interval=1, warmup_iters=2)


def test_smoke_runs_resume_probe_and_finetune(tmp_path, monkeypatch):
    monkeypatch.setattr(study_plan, 'BASE', dict(study_plan.BASE, **TINY, omgd_period=2))
    monkeypatch.setattr(study_plan, 'ITERS', {'multi': 6, 'pre': 6, 'ft': 4})
    monkeypatch.setattr(study_plan, 'EVALS', 2)
    tiny_pretrain = dict(study_plan.PRETRAIN, n_layer=4, iters=6)
    monkeypatch.setattr(study_plan, 'PRETRAIN', tiny_pretrain)
    monkeypatch.setitem(study_plan.STAGES, 'm4_pre', ('own', [tiny_pretrain]))
    monkeypatch.setattr(study_plan, 'MULTI_TOKENS', 3000)
    monkeypatch.setattr(study_plan, 'FT_TOKENS', 2000)
    runs = str(tmp_path / 'runs')
    data = study.make_multi_dataset(runs)
    assert os.path.getsize(os.path.join(data, 'train.bin')) == 6000
    ft_data = study.make_ft_dataset(runs)
    assert (os.path.getsize(os.path.join(ft_data, 'train.bin')), os.path.getsize(os.path.join(ft_data, 'val.bin'))) == (
        4000,
        400,
    )
    wor = study_plan.spec('multi', 'adamw', 'lisa_wor', 'keep', seed=0)
    got = study.run_specs([wor], runs, jobs=1)
    r = got[study_plan.run_name(wor)]
    assert r['eval_iters'] == [0, 3, 6] and all(math.isfinite(x) for x in r['train_loss'])
    assert '--omgd_state=keep' in r['command'] and '--seed=0 --data_seed=0 --omgd_seed=0' in r['command']
    assert data in r['command']
    study.run_specs([wor], runs, jobs=1, launch=lambda *a: pytest.fail('finished run re-run'))  # resume
    probe = study_probe.probe({**wor, 'kind': 'probe'}, runs)
    assert probe['train_log_match']['logged_iters_compared'] == 6
    assert probe['train_log_match']['max_abs_diff'] == 0  # the probe is train.py's loop: same losses
    assert sum(probe['steps_per_block']) == 6 * 2  # gamma=2 blocks train at each of 6 steps
    # fine-tuning: the pre-trained model (its checkpoint kept), then a run resumed from it at iteration 0
    pre = study_plan.spec(**study_plan.PRETRAIN)
    study.run_specs(study_plan.stage_specs('m4_pre', [0]), runs, jobs=1)
    assert os.path.exists(os.path.join(runs, study_plan.run_name(pre), 'ckpt.pt'))
    ft = study_plan.spec('ft', 'adamw', 'lisa_wor', 'drop', seed=1, n_layer=4, gamma=2, K=2)
    r = study.run_specs([ft], runs, jobs=1)[study_plan.run_name(ft)]
    assert 'error' not in r, r
    assert '--init_from=resume' in r['command'] and ft_data in r['command'] and r['eval_iters'] == [0, 2, 4]
    log = open(os.path.join(runs, study_plan.run_name(ft), 'train.log')).read()
    assert 'resuming from iteration 0' in log
    # the start: the pre-trained weights, a fresh optimizer, the run's own cycler, data order and config
    import torch

    study.finetune_start(ft, str(tmp_path / 'start'), runs)
    start = torch.load(str(tmp_path / 'start' / 'ckpt.pt'), weights_only=False)
    pretrained = torch.load(os.path.join(runs, study_plan.run_name(pre), 'ckpt.pt'), weights_only=False)
    assert start['model'].keys() == pretrained['model'].keys()
    assert all(torch.equal(start['model'][k], pretrained['model'][k]) for k in start['model'])
    assert start['iter_num'] == 0 and start['optimizer']['state'] == {} and pretrained['optimizer']['state']
    assert (start['config']['method'], start['config']['omgd_seed'], start['config']['dataset']) == (
        'lisa_wor',
        1,
        ft_data,
    )


def test_k31_stages_are_the_plan(tmp_path):
    keep = study_plan.stage_specs('k31_keep', [100, 101])
    assert len(keep) == 24 and [s['seed'] for s in keep] == [100] * 12 + [101] * 12  # seed-major: complete pairs
    assert {(s['K'], s['beta1'], s['state']) for s in keep} == {
        (3, None, 'keep'),
        (6, None, 'keep'),
        (12, None, 'keep'),
        (25, None, 'keep'),
        (3, 0.5, 'keep'),
        (3, 0.0, 'keep'),
    }
    assert all(
        (s['n_layer'], s['gamma'], s['iters'], s['optimizer'], s['regime']) == (12, 3, 600, 'adamw', 'multi')
        for s in keep
    )
    assert [s['method'] for s in keep[:2]] == ['lisa', 'lisa_wor']
    k100 = study_plan.stage_specs('k31_k100', [100])
    assert [(s['K'], s['iters'], s['state'], s['regime']) for s in k100] == [(100, 10_000, 'keep', 'paper')] * 2
    assert k100[0]['iters'] // (12 // 3 * 100) == 25  # 25 cycles of M = 4 periods
    assert {s['state'] for s in study_plan.stage_specs('k31_drop', [100])} == {'drop'}
    runs = str(tmp_path / 'runs')
    args = study_plan.train_args(keep[-1], runs)  # beta1 0 reaches train.py, and train.py's config accepts it
    assert '--beta1=0.0' in args and runner.config_of(args)['beta1'] == 0.0
    assert not any(a.startswith('--beta1') for a in study_plan.train_args(keep[0], runs))
    assert f'--dataset={study_plan.multi_dataset(runs, study_plan.PAPER_TOKENS)}' in study_plan.train_args(
        k100[0], runs
    )
    assert study_plan.config_key(keep[-1]).endswith('-K3-g3-beta0.0') and study_plan.config_key(keep[0]).endswith(
        '-K3-g3'
    )
    assert len({study_plan.run_name(s) for s in keep}) == 24


def test_k31_tests_decide_as_the_plan_says(tmp_path):
    cells = {(3, None): 0.03, (6, None): -0.03, (12, None): -0.04, (25, None): -0.05, (3, 0.0): 0.001, (3, 0.5): 0.01}
    results = []
    for (K, b), v in cells.items():
        for i, seed in enumerate(range(100, 110)):
            s = dict(optimizer='adamw', **study_plan.K31_GEOMETRY, **study_plan.k31_cell(K=K, beta1=b), seed=seed)
            results.append(fake_result(study_plan.spec(method='lisa', **s), 2.5 + 0.01 * i))
            results.append(fake_result(study_plan.spec(method='lisa_wor', **s), 2.5 + 0.01 * i + v + 0.002 * (-1) ** i))
    for i, seed in enumerate(range(100, 102)):  # K = 100 under keep: 2 seeds, fewer than the plan's minimum of 3
        s = dict(
            optimizer='adamw',
            **study_plan.K31_GEOMETRY,
            **study_plan.k31_cell(regime='paper', iters=10_000, K=100),
            seed=seed,
        )
        results.append(fake_result(study_plan.spec(method='lisa', **s), 2.0))
        results.append(fake_result(study_plan.spec(method='lisa_wor', **s), 1.9))
    k = study_stats.k31_tests(results)
    t = {r['id']: r for r in k['tests']}
    assert t['H1a']['train']['mean'] == pytest.approx(0.03) and t['H1a']['train']['n'] == 10
    assert t['H1a']['verdict'] == 'confirmed' and t['H1b']['verdict'] == 'confirmed'
    # slope of D on log2 K: exact on these numbers (the noise is the same at every K for a seed)
    xs = [math.log2(K) for K in (3, 6, 12, 25)]
    want = study_stats.slope(xs, [0.03, -0.03, -0.04, -0.05])
    assert t['H1c']['train']['values'] == pytest.approx([want] * 10) and t['H1c']['verdict'] == 'confirmed'
    assert t['H2']['train']['mean'] == pytest.approx(0.029) and t['H2']['verdict'] == 'confirmed'
    assert t['H3']['verdict'] == 'not run' and t['H3']['train']['n'] == 2
    e = {r['id']: r for r in k['exploratory']}
    assert e['E2']['train']['mean'] == pytest.approx(0.02) and e['E1']['verdict'] == 'exploratory'
    assert e['E1']['train']['n'] == 0  # no drop runs
    # the decision rule itself
    assert study_stats.verdict(-0.02, -0.001, -1) == 'confirmed' and study_stats.verdict(0.001, 0.02, -1) == 'refuted'
    assert (
        study_stats.verdict(-0.009, 0.009, -1) == 'refuted' and study_stats.verdict(-0.02, 0.005, -1) == 'inconclusive'
    )
    assert study_stats.verdict(0.001, 0.02, +1) == 'confirmed' and study_stats.verdict(-0.009, 0.002, +1) == 'refuted'
    assert study_stats.verdict(None, None, +1) == 'not run'
    path = tmp_path / 'tests.md'
    study_report.write_k31(str(path), k, {'command': 'x', 'machine': 'm', 'torch': 't'})
    md = path.read_text()
    assert '| H1a | the K = 3 loss replicates: D(K 3, keep) > 0 | 10 | +0.0300 [' in md and '**confirmed**' in md
    assert '| H3 |' in md and 'not run (2 complete seeds)' in md
    assert '| K 3, keep, beta1 0.0 | 10 | +0.0010 [' in md


def test_stop_at_starts_nothing_after_the_deadline(tmp_path, monkeypatch, capsys):
    import datetime

    now = datetime.datetime(2026, 1, 2, 10, 50, tzinfo=datetime.timezone.utc)
    assert study.stop_time('10:42', now) == now.replace(minute=42).timestamp()  # passed: today's
    assert study.stop_time('11:05', now) == now.replace(hour=11, minute=5).timestamp()
    assert (
        study.stop_time('00:30', now.replace(hour=23))
        == datetime.datetime(2026, 1, 3, 0, 30, tzinfo=datetime.timezone.utc).timestamp()
    )
    monkeypatch.setattr(study_plan, 'PAPER_TOKENS', 3000)
    monkeypatch.setattr(study_report, 'SCHEDULES', ((4, 2, 2, 8),))  # the report's schedule tables: one tiny one
    monkeypatch.setattr(study_plan, 'M4_MULTI_TOKENS', 3000)
    calls = []
    monkeypatch.setattr(study, 'run_specs', lambda specs, *a, **k: calls.append(specs) or {})
    past = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=2)).strftime('%H:%M')
    argv = [
        '--stages=k31_k100',
        '--first_seed=100',
        '--seeds=2',
        '--jobs=1',
        f'--stop_at={past}',
        f'--runs_dir={tmp_path / "runs"}',
        f'--report_dir={tmp_path / "rep"}',
        '--name=k',
    ]
    assert study.main(argv) == 0 and calls == []
    assert '4 runs not started' in capsys.readouterr().out
    future = (datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=30)).strftime('%H:%M')
    assert study.main(argv[:4] + [f'--stop_at={future}'] + argv[5:]) == 0
    assert [[(s['seed'], s['method']) for s in c] for c in calls] == [
        [(100, 'lisa'), (100, 'lisa_wor')],
        [(101, 'lisa'), (101, 'lisa_wor')],
    ]
    with pytest.raises(SystemExit):
        study.main(argv[:4] + ['--stop_at=25:00'] + argv[5:])


def test_reports_are_written_again_from_the_json_and_compared_with_an_earlier_one(tmp_path):
    """A fresh checkout has no runs folder: --runs_from rewrites every report from the NAME.json the
    runs wrote, identically; --earlier compares the same runs run twice, run by run."""
    runs = tmp_path / 'runs'
    for seed in (100, 101, 102, 103):
        for m, shift in (('lisa', 0.0), ('lisa_wor', 0.01)):
            s = study_plan.spec(
                method=m, optimizer='adamw', **study_plan.K31_GEOMETRY, **study_plan.k31_cell(K=3), seed=seed
            )
            (runs / study_plan.run_name(s)).mkdir(parents=True)
            train = 2.5 + 0.001 * seed % 0.01 + shift + 0.003 * (seed % 2)
            (runs / study_plan.run_name(s) / 'result.json').write_text(json.dumps(fake_result(s, round(train, 4))))
    base = ['--report_only=True', '--first_seed=100', '--seeds=4', '--name=k', f'--runs_dir={runs}']
    assert study.main([*base, f'--report_dir={tmp_path / "a"}']) == 0
    assert study.main([*base, f'--report_dir={tmp_path / "b"}', f'--runs_from={tmp_path / "a" / "k.json"}']) == 0
    a, b = (json.loads((tmp_path / d / 'k.json').read_text()) for d in ('a', 'b'))
    assert a['k31'] == b['k31'] and a['rows'] == b['rows'] and a['runs'] == b['runs']
    assert a['runs'][0]['train_loss'] == [4.0, a['runs'][0]['train_loss'][-1]]  # the curves are kept
    # the same runs again, one final loss changed by 0.002: compared run by run
    earlier = json.loads((tmp_path / 'a' / 'k.json').read_text())
    row = next(r for r in earlier['rows'] if r['method'] == 'lisa_wor')
    row['train']['101'] += 0.002
    (tmp_path / 'earlier.json').write_text(json.dumps(earlier))
    assert study.main([*base, f'--report_dir={tmp_path / "c"}', f'--earlier={tmp_path / "earlier.json"}']) == 0
    c = json.loads((tmp_path / 'c' / 'k.json').read_text())['k31_earlier']
    assert c['agreement']['train']['n'] == 8 and c['agreement']['train']['equal_at_4_decimals'] == 7
    assert c['agreement']['train']['max_abs'] == pytest.approx(0.002) and c['agreement']['val']['max_abs'] == 0
    assert c['seeds'] == [100, 101, 102, 103] and [t['id'] for t in c['tests_now']][0] == 'H1a'
    md = (tmp_path / 'c' / 'k_tests.md').read_text()
    assert '| train | 8 | 7 | 0.0020 |' in md and '## The same seeds run before' in md
    # a report without its runs' curves cannot stand in for the runs folder: one line
    del earlier['runs'][0]['train_loss']
    (tmp_path / 'old.json').write_text(json.dumps(earlier))
    with pytest.raises(SystemExit, match='keeps no loss curves'):
        study.main([*base, f'--report_dir={tmp_path / "d"}', f'--runs_from={tmp_path / "old.json"}'])
    with pytest.raises(SystemExit, match=r'error: --runs_from writes reports .* add --report_only=True$'):
        study.main([f'--runs_from={tmp_path / "a" / "k.json"}', f'--report_dir={tmp_path / "e"}'])
    with pytest.raises(SystemExit, match=r"^error: cannot write the reports: FileNotFoundError: .*missing\.json"):
        study.main([*base, f'--report_dir={tmp_path / "f"}', f'--earlier={tmp_path / "missing.json"}'])
