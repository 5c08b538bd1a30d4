"""Smoke test of experiments/compare.py: 2 methods, 1 seed, a few iterations of a tiny GPT through train.py."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import compare  # noqa: E402
import runner  # noqa: E402

TINY = [
    '--n_layer=4',
    '--n_head=2',
    '--n_embd=32',
    '--block_size=32',
    '--batch_size=8',
    '--eval_iters=2',
    '--eval_interval=3',
    '--log_interval=1',
    '--warmup_iters=2',
    '--omgd_gamma=2',
    '--omgd_period=2',
]


def test_smoke_two_methods_one_seed(tmp_path, monkeypatch):
    out = tmp_path / 'results'
    result = subprocess.run(
        [
            sys.executable,
            'experiments/compare.py',
            '--methods=full,lisa_wor:iid',
            '--seeds=1',
            '--max_iters=6',
            f'--out_dir={out}',
            f'--runs_dir={tmp_path / "runs"}',
            *TINY,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ('compare.md', 'compare.json', 'compare_loss.png'):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / 'compare.json').read_text())
    rows = {r['name']: r for r in report['rows']}
    assert set(rows) == {'full', 'lisa_wor:iid'}
    assert rows['lisa_wor:iid']['sampling'] == 'iid' and rows['lisa_wor:iid']['method'] == 'lisa_wor'
    for r in rows.values():
        assert r['errors'] == [] and r['seeds_ok'] == [0]
        assert math.isfinite(r['final_val_mean'])
        assert r['val_curve']['iters'] == [0, 3, 6] and all(math.isfinite(v) for v in r['val_curve']['mean'])
    for run in report['runs']:
        assert '--sampling=' + ('iid' if run['variant'] == 'lisa_wor:iid' else 'rr') in run['command']
        assert '--seed=0 --data_seed=0 --omgd_seed=0' in run['command'] and '--compile=False' in run['command']
    lisa = [r for r in report['runs'] if r['method'] == 'lisa_wor'][0]
    assert lisa['switches'] == 3  # iterations 0, 2, 4
    # memory: exact grads + optimizer state, smaller for LISA-wor (2 of 4 blocks) than for full training
    mem = report['memory']
    assert 0 < mem['lisa_wor']['grads_plus_optimizer'] < mem['full']['grads_plus_optimizer']
    assert mem['full']['optimizer'] == 2 * mem['full']['grads'] == 2 * mem['full']['params']
    md = (out / 'compare.md').read_text()
    assert '| full | rr |' in md and '| lisa_wor:iid | iid |' in md and 'NOT an allocator peak' in md
    # --replot=True rewrites the table and plot from the JSON without training
    (out / 'compare.md').unlink()
    (out / 'compare_loss.png').unlink()
    replot = subprocess.run(
        [sys.executable, 'experiments/compare.py', '--replot=True', '--memory=False', f'--out_dir={out}'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert replot.returncode == 0, replot.stderr[-3000:]
    assert (out / 'compare_loss.png').stat().st_size > 0
    assert '| lisa_wor:iid | iid |' in (out / 'compare.md').read_text()
    # the finished runs in runs_dir are read back, not trained again (runner.run_all)
    monkeypatch.setattr(runner, 'run_train', lambda *a, **k: pytest.fail('a finished run was trained again'))
    args = compare.parse(['--methods=full,lisa_wor:iid', '--seeds=1', '--max_iters=6', *TINY])
    again = compare.run_all(
        [compare.parse_variant('full'), compare.parse_variant('lisa_wor:iid')], [0], args, str(tmp_path / 'runs')
    )
    assert [r['variant'] for r in again] == ['full', 'lisa_wor:iid']
    assert [r['val_loss'] for r in again] == [
        rows['full']['val_curve']['mean'],
        rows['lisa_wor:iid']['val_curve']['mean'],
    ]


def test_read_records_and_variants(tmp_path):
    records = [
        dict(kind='eval', iter=0, train_loss=4.2, val_loss=4.3),
        dict(kind='switch', iter=0, active=[1, 4], description='cycle 1: active blocks [1, 4], grad scale 4'),
        dict(kind='iter', iter=0, loss=4.1, ms=900.0, epoch=0.0),
        dict(kind='iter', iter=10, loss=3.0, ms=50.0, epoch=0.01),
        dict(kind='save', iter=20),
        dict(kind='eval', iter=20, train_loss=2.9, val_loss=2.95),
    ]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
    parsed = runner.read_records(tmp_path)
    assert parsed['eval_iters'] == [0, 20] and parsed['val_loss'] == [4.3, 2.95] and parsed['train_loss'] == [4.2, 2.9]
    assert parsed['median_ms_per_iter'] == 50.0 and parsed['switches'] == 1 and parsed['last_logged_epoch'] == 0.01
    assert parsed['first_switches'] == ['iter 0: cycle 1: active blocks [1, 4], grad scale 4']
    assert compare.parse_variant('full:iid') == {'name': 'full:iid', 'method': 'full', 'sampling': 'iid'}
    assert compare.parse_variant('lisa') == {'name': 'lisa', 'method': 'lisa', 'sampling': 'rr'}


def test_paired_differences():
    rows = [
        {'name': 'lisa_wor', 'final_val': {0: 2.0, 1: 2.1, 2: 2.2}},
        {'name': 'lisa', 'final_val': {0: 2.1, 1: 2.3, 2: 2.2}},
    ]
    p = compare.paired(rows, 'lisa_wor', 'lisa')
    assert p['a_wins'] == 2 and math.isclose(p['mean'], -0.1) and p['seeds'] == [0, 1, 2]
    assert (p['a'], p['b'], p['n']) == ('lisa_wor', 'lisa', 3) and math.isclose(p['sd'], 0.1)
    half = 4.302653 * 0.1 / math.sqrt(3)  # t_{0.975, 2} (the exact quantile; tables round it to 4.303)
    assert p['ci95'] == pytest.approx([p['mean'] - half, p['mean'] + half]) and not p['significant']
    assert compare.paired(rows, 'lisa_wor', 'galore') is None


def test_memory_builds_the_runs_own_config():
    """measure_memory measures the config the runs train: train_command's arguments, --train_args included
    (any train.py key), parsed by train.py's configurator; a key train.py refuses is refused here too."""
    from types import SimpleNamespace

    import torch

    from model import Transformer

    flags = {name: default for name, _, default in compare.TRAIN_FLAGS}
    flags.update(dataset='no_such_dataset', n_layer=2, n_embd=32, block_size=16, batch_size=2, omgd_gamma=1)
    args = SimpleNamespace(**flags, max_iters=40, train_arg=['--arch=llama', '--n_kv_head=2', '--omgd_warmup=5'])
    cfg, vocab = compare.train_config('lisa_wor', args)
    assert (cfg['method'], cfg['omgd_warmup'], cfg['n_layer'], cfg['device'], vocab) == ('lisa_wor', 5, 2, 'cpu', 0)
    config = compare.model_config(args)
    assert (config.arch, config.n_kv_head, config.vocab_size) == ('llama', 2, 50304)
    mem = compare.measure_memory('lisa_wor', args)
    with torch.device('meta'):
        assert 'error' not in mem and mem['n_params'] == sum(p.numel() for p in Transformer(config).parameters())
    assert compare.n_params(config, {'lisa_wor': mem}) == compare.n_params(config, {}) == mem['n_params']
    assert mem['params'] == 4 * mem['n_params']  # fp32: train.py's default precision='amp'
    args.train_arg.append('--precision=bf16')  # a key that is no model shape applies too
    bf16 = compare.measure_memory('lisa_wor', args)
    assert (bf16['params'], bf16['grads'], bf16['optimizer']) == (
        mem['params'] // 2,
        mem['grads'] // 2,
        mem['optimizer'] // 2,
    )
    args.train_arg = ['--omgd_gama=1']
    assert compare.measure_memory('full', args)['error'].startswith("ConfigError: unknown config key 'omgd_gama'")
    with pytest.raises(ValueError, match="unknown config key 'omgd_gama'"):
        compare.model_config(args)


def test_default_out_dir_is_not_results():
    """Run without --out_dir, compare.py must not overwrite the committed results/compare.*."""
    out_dir = os.path.realpath(compare.parse([]).out_dir)
    results = os.path.realpath(os.path.join(ROOT, 'results'))
    assert os.path.commonpath([out_dir, results]) != results, out_dir
    assert out_dir == os.path.realpath(os.path.join(ROOT, 'out'))  # git-ignored (out*/ in .gitignore)
    assert compare.parse(['--out_dir=results']).out_dir == 'results'


@pytest.mark.parametrize(
    'content, message',
    [
        (None, r"nothing\.json, which does not exist: run the comparison first \(without --replot\)"),
        ('{"rows": [', r"nothing\.json cannot be read \(JSONDecodeError: .*\); run the comparison again"),
        ('{"rows": []}', r"nothing\.json is not a report of compare\.py \(it lacks 'command'\)"),
    ],
)
def test_replot_without_a_report_is_one_line(tmp_path, content, message):
    import re

    if content is not None:
        (tmp_path / 'nothing.json').write_text(content)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        compare.main(['--replot=True', f'--out_dir={tmp_path}', '--name=nothing'])
    assert str(e.value.code).startswith('error: ') and re.search(message, str(e.value.code)), e.value.code
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, the damaged file kept as it was


@pytest.mark.parametrize(
    'argv, message',
    [
        # the mistyped method is named first, whatever else is wrong (the schedule here)
        (
            ['--methods=full,lisa_wro', '--max_iters=2'],
            r"^error: --methods: unknown method 'lisa_wro' \(did you mean 'lisa_wor'\?\); choose from full, lisa, .*"
            r"golore, each as METHOD or METHOD:SAMPLING \(rr or iid\)$",
        ),
        (['--methods=full,xyz:iid'], r"^error: --methods: unknown method 'xyz'; choose from full, "),
        # compare.py's own keys, not train.py's --lr_decay_iters (which compare.py sets to max_iters)
        (
            ['--methods=full,lisa_wor', '--max_iters=2'],
            r"^error: --max_iters=2 ends inside the learning-rate warm-up \(--warmup_iters=20\), .*; raise "
            r"--max_iters to 20 or more, or lower --warmup_iters \(e\.g\. --warmup_iters=2\)$",
        ),
    ],
)
def test_a_bad_method_or_a_run_shorter_than_its_warmup_is_one_line_in_compares_keys(tmp_path, argv, message):
    import re

    with pytest.raises(SystemExit) as e:
        compare.main([*argv, '--seeds=1', f'--out_dir={tmp_path / "out"}', f'--runs_dir={tmp_path / "runs"}'])
    assert re.search(message, str(e.value.code)), e.value.code
    assert os.listdir(tmp_path) == []  # refused before any run or report
