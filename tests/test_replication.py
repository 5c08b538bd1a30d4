"""experiments/replication_k100.py (issue 42's pre-registered K = 100 replication): the plan's runs and
their order, the power calculation against the noncentral t, the decision rule, resume and stop
with a fake launcher, and the report (intervals, wins, the combined answer, the reproduction of
seeds 100-102) on made-up results. In process, no train.py run."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import replication_k100 as rep  # noqa: E402
import runner  # noqa: E402
import study  # noqa: E402
import study_plan  # noqa: E402


def fake(s, train, val=None, host='h'):
    return {
        **s,
        'returncode': 0,
        'eval_iters': [0, s['iters']],
        'train_loss': [4.0, train],
        'val_loss': [4.0, train + 0.2 if val is None else val],
        'median_ms_per_iter': 13.0,
        'wall_s': 140.0,
        'host': host,
        'machine': 'AMD EPYC',
        'torch': '2.13.0+cpu',
        'code': 'test',
    }


def test_the_plan_is_the_studys_cells_on_fresh_seeds_seed_major():
    specs = rep.plan_specs()
    assert len(specs) == 6 + 4 * 34 + 6 and len({study_plan.run_name(s) for s in specs}) == len(specs)
    assert [(s['seed'], s['state'], s['method']) for s in specs[:10]] == [
        (100, 'keep', 'lisa'),
        (100, 'keep', 'lisa_wor'),
        (101, 'keep', 'lisa'),
        (101, 'keep', 'lisa_wor'),
        (102, 'keep', 'lisa'),
        (102, 'keep', 'lisa_wor'),
        (1000, 'keep', 'lisa'),
        (1000, 'keep', 'lisa_wor'),
        (1000, 'drop', 'lisa'),
        (1000, 'drop', 'lisa_wor'),
    ]
    assert [s['seed'] for s in specs[-6:]] == [100, 100, 101, 101, 102, 102] and {s['state'] for s in specs[-6:]} == {
        'drop'
    }
    fresh = {s['seed'] for s in specs} - set(rep.REPRO_SEEDS)
    assert fresh == set(range(1000, 1034))
    assert not fresh & (set(range(0, 5)) | set(range(100, 110)) | set(range(200, 205)) | {1337})  # seeds used before
    for s in specs:  # exactly issue 31's K = 100 stages' runs
        stage = 'k31_k100' if s['state'] == 'keep' else 'k31_k100_drop'
        assert s in study_plan.stage_specs(stage, [s['seed']])
    assert study_plan.run_name(specs[7]) == 'L12-paper10000-adamw-lisa_wor-keep-rr-K100-g3_s1000'
    pairs = rep.pairs_of(specs)
    assert all(len(p) == 2 and p[0]['method'] == 'lisa' and p[1]['method'] == 'lisa_wor' for p in pairs)


def test_power_is_the_noncentral_t():
    # scipy.stats.nct: P(|T'| > t_{0.975, n-1}), noncentrality 0.5 sqrt(n)
    assert rep.power(34) == pytest.approx(0.8078, abs=1e-4) and rep.power(33) == pytest.approx(0.7954, abs=1e-4)
    assert rep.power(10) == pytest.approx(0.2932, abs=1e-4) and rep.power(13, 0.023) == pytest.approx(0.7185, abs=1e-4)
    assert rep.pairs_needed() == 34


@pytest.mark.parametrize(
    'lo, hi, verdict, study_rule',
    [
        (-0.03, -0.001, 'replicated', 'confirmed'),
        (-0.012, -0.001, 'replicated', 'confirmed'),  # a win smaller than the margin is still a win
        (-0.014, 0.006, 'refuted', 'inconclusive'),  # rules out a win of 0.015; the study's rule cannot tell
        (-0.009, 0.008, 'refuted', 'refuted'),
        (0.002, 0.03, 'refuted', 'refuted'),  # LISA-wor worse
        (-0.02, 0.005, 'cannot tell', 'inconclusive'),
        (None, None, 'not run', 'not run'),
    ],
)
def test_decision_rule(lo, hi, verdict, study_rule):
    assert rep.decide(lo, hi) == verdict and rep.study_rule(lo, hi) == study_rule


def test_runs_resume_pair_by_pair_and_stop_at_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(study, 'make_multi_dataset', lambda *a, **k: None)
    runs = str(tmp_path / 'runs')
    calls = []

    def launch(s, out_dir, runs_dir):
        calls.append((s['seed'], s['state'], s['method']))
        return fake(s, 2.0)

    import datetime

    past = (datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=2)).strftime('%H:%M')
    assert rep.run(runs, n_seeds=2, stop_at=past, launch=launch) == (0, [], 20) and calls == []
    done, failed, _ = rep.run(runs, n_seeds=2, launch=launch)
    assert (
        done == 20
        and not failed
        and calls[:8]
        == [
            (100, 'keep', 'lisa'),
            (100, 'keep', 'lisa_wor'),
            (101, 'keep', 'lisa'),
            (101, 'keep', 'lisa_wor'),
            (102, 'keep', 'lisa'),
            (102, 'keep', 'lisa_wor'),
            (1000, 'keep', 'lisa'),
            (1000, 'keep', 'lisa_wor'),
        ]
    )
    victim = rep.cell_spec('drop', 'lisa_wor', 1001)
    os.remove(runner.result_path(runs, study_plan.run_name(victim)))
    calls.clear()
    assert rep.run(runs, n_seeds=2, launch=launch)[0] == 20 and calls == [(1001, 'drop', 'lisa_wor')]


def test_jobs_2_runs_the_two_runs_of_a_pair_side_by_side_and_never_two_pairs(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(study, 'make_multi_dataset', lambda *a, **k: None)
    met = threading.Barrier(2, timeout=60)  # both runs of a pair must be running at once to pass it
    calls = []

    def launch(s, out_dir, runs_dir):
        met.wait()
        calls.append((s['seed'], s['state']))
        return fake(s, 2.0)

    done, failed, _ = rep.run(str(tmp_path / 'runs'), n_seeds=1, launch=launch, jobs=2)
    pairs = [(s[0]['seed'], s[0]['state']) for s in rep.pairs_of(rep.plan_specs(1))]
    assert done == 16 and not failed and calls == [p for p in pairs for _ in range(2)]
    with pytest.raises(SystemExit, match='jobs'):
        rep.main(['--jobs=3', '--report_only=True'])


def results_for(d_keep, d_drop=None, base=1.9, host='h'):
    out = []
    for seed, d in d_keep.items():
        out += [
            fake(rep.cell_spec('keep', 'lisa', seed), base, host=host),
            fake(rep.cell_spec('keep', 'lisa_wor', seed), base + d, host=host),
        ]
    for seed, d in (d_drop or {}).items():
        out += [
            fake(rep.cell_spec('drop', 'lisa', seed), base),
            fake(rep.cell_spec('drop', 'lisa_wor', seed), base + d),
        ]
    return out


def test_report_intervals_combined_and_reproduction(tmp_path):
    d = {1000 + i: v for i, v in enumerate((-0.03, -0.02, -0.025, -0.01, -0.035))}
    results = results_for(d, {1000: 0.01, 1001: -0.01})
    study_runs = results_for({100: -0.043, 101: -0.0178, 102: -0.0039, 103: -0.0387})
    results += results_for({100: -0.043, 101: -0.0178})  # seeds 100, 101 re-run: the same finals...
    results[-1] = fake(
        rep.cell_spec('keep', 'lisa_wor', 101), 1.9 - 0.0178 + 0.002, val=1.9 - 0.0178 + 0.2
    )  # one moved
    a, md = rep.report(results, study_runs, str(tmp_path), command='cmd', source='src')
    t = a['tests']['keep_train']
    assert t['n'] == 5 and t['wins'] == 5 and t['mean'] == pytest.approx(-0.024) and t['verdict'] == 'replicated'
    assert t['values'] == pytest.approx(list(d.values())) and a['pairs_done'] == {'keep': 5, 'drop': 2}
    assert a['tests']['drop_train']['ci95'] is None and a['tests']['drop_train']['verdict'] == 'not run'
    assert a['tests']['keep_val']['mean'] == pytest.approx(-0.024)  # val = train + 0.2 for both methods
    c = a['combined']
    assert c['n'] == 11 and c['wins'] == 3 + 5
    assert c['mean'] == pytest.approx((sum(rep.EARLIER_FRESH) + sum(d.values())) / 11)
    assert a['everything']['n'] == 4 + 6 + 5  # the study's seeds (here 4) + the earlier 6 + fresh
    r = a['reproduction']
    assert r['n'] == 8 and r['equal'] == 7 and r['max_abs'] == pytest.approx(0.002) and not r['reproduces']
    assert [(x['seed'], round(x['d_then'], 4), round(x['d_now'], 4)) for x in r['per_seed']] == [
        (100, -0.043, -0.043),
        (101, -0.0178, -0.0158),
    ]
    assert 'interim: 5 of 34 keep pairs' in md and '| PRIMARY: keep, train loss | 5 | -0.0240 [' in md
    assert '**replicated**' in md and '7 of 8 final losses equal' in md and '**does not reproduce**' in md
    assert '| 1000 | 1.9000 | 1.8700 | -0.0300 | -0.0300 | 1.9000 | 1.9100 | +0.0100 | +0.0100 |' in md
    # the JSON keeps the runs: the same report without the runs folder
    saved = rep.load_runs(str(tmp_path / 'replication_k100.json'))
    again = rep.analyse(saved, study_runs)
    assert (
        again['tests'] == a['tests']
        and again['combined'] == a['combined']
        and again['reproduction'] == a['reproduction']
    )


def test_a_pair_split_across_hosts_is_flagged():
    results = results_for({1000: -0.01, 1001: 0.0})
    results[1] = fake(rep.cell_spec('keep', 'lisa_wor', 1000), 1.89, host='other')
    results[3] = {**results[3], 'machine': 'AMD EPYC, Linux 6.18.44-fc-v782'}  # same host name, another VM
    a = rep.analyse(results)
    assert a['split_pairs'] == [(1000, 'keep'), (1001, 'keep')] and 'different machines' in rep.markdown(a)


def test_command_line_reports_from_a_json(tmp_path, capsys):
    results = results_for({1000 + i: -0.02 + 0.005 * i for i in range(4)})
    (tmp_path / 'r.json').write_text(json.dumps({'runs': results}))
    (tmp_path / 'study.json').write_text(json.dumps({'runs': results_for({100: -0.04})}))
    assert (
        rep.main(['--report_only=True', f'--runs_from={tmp_path / "r.json"}', f'--study={tmp_path / "study.json"}'])
        == 0
    )
    out = capsys.readouterr().out
    assert '| PRIMARY: keep, train loss | 4 | -0.0125 [' in out and 'Not run yet.' in out
    with pytest.raises(SystemExit, match='add --report_only=True'):
        rep.main([f'--runs_from={tmp_path / "r.json"}'])


def test_a_lost_runs_folder_is_restored_from_the_report_and_not_run_again(tmp_path, monkeypatch, capsys):
    """--restore_from=results/replication_k100.json writes the runs the report keeps into an empty runs folder:
    the runner skips them (nothing of them runs again), the report counts them, and a run the folder holds
    keeps its own result."""
    monkeypatch.setattr(study, 'make_multi_dataset', lambda *a, **k: None)
    kept = results_for({1000: -0.02, 1001: 0.01})
    (tmp_path / 'r.json').write_text(json.dumps({'runs': [{k: r[k] for k in rep.RUN_FIELDS if k in r} for r in kept]}))
    runs = str(tmp_path / 'runs')
    own = rep.cell_spec('keep', 'lisa', 1001)
    os.makedirs(os.path.join(runs, study_plan.run_name(own)))
    with open(runner.result_path(runs, study_plan.run_name(own)), 'w') as f:
        json.dump(fake(own, 1.5), f)
    assert len(rep.restore(runs, str(tmp_path / 'r.json'))) == 3 and rep.restore(runs, str(tmp_path / 'r.json')) == []
    assert runner.load_result(runs, study_plan.run_name(own))['train_loss'][-1] == 1.5
    calls = []

    def launch(s, out_dir, runs_dir):
        calls.append((s['seed'], s['state'], s['method']))
        return fake(s, 2.0)

    rep.run(runs, n_seeds=2, launch=launch)
    assert not [c for c in calls if c[0] in (1000, 1001) and c[1] == 'keep']  # the restored pairs did not run again
    assert (1000, 'drop', 'lisa') in calls
    fresh = str(tmp_path / 'fresh')
    assert (
        rep.main(
            [
                '--report_only=True',
                f'--runs_dir={fresh}',
                f'--restore_from={tmp_path / "r.json"}',
                f'--study={tmp_path / "r.json"}',
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        f"restored 4 run(s) of {tmp_path / 'r.json'} into {fresh}" in out and '| PRIMARY: keep, train loss | 2 |' in out
    )


def test_a_restore_from_a_file_that_is_not_a_report_is_one_line(tmp_path):
    (tmp_path / 'bad.json').write_text('{"not": "a report"}')
    for path in (tmp_path / 'bad.json', tmp_path / 'missing.json'):
        with pytest.raises(
            SystemExit, match=rf"^error: cannot restore the runs of {path}: (KeyError|FileNotFoundError)"
        ):
            rep.main(['--report_only=True', f'--runs_dir={tmp_path / "runs"}', f'--restore_from={path}'])
