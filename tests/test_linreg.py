"""Tests of experiments/linreg.py: the least-squares example of the paper (Figure 2)."""

import math
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import linreg  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope='module')
def prob():
    return linreg.make_problem(n=1000, d=10, seed=0)


def test_theta_star_solves_normal_equations(prob):
    X, y, A, b, ts = prob['X'], prob['y'], prob['A'], prob['b'], prob['theta_star']
    n = len(y)
    assert np.allclose(A, 2 / n * X.T @ X) and np.allclose(b, 2 / n * X.T @ y)
    assert np.allclose(A @ ts, b, rtol=0, atol=1e-12)
    assert np.allclose(ts, np.linalg.lstsq(X, y, rcond=None)[0], atol=1e-10)  # the least-squares fit
    assert prob['lam'][0] > 0 and np.allclose(prob['Q'] @ np.diag(prob['lam']) @ prob['Q'].T, A)


def test_mask_cycle_sums_to_M_ones_and_pair_order_covers_product_once():
    g = torch.Generator().manual_seed(0)
    for d, ratio in [(10, 0.5), (10, 0.3), (7, 1.0), (13, 0.25)]:
        masks = linreg.mask_cycle(d, ratio, g)
        M = math.ceil(1 / ratio)
        assert masks.shape == (M, d)
        assert torch.equal(masks.sum(0), torch.full((d,), float(M)))
        assert torch.equal((masks > 0).sum(0), torch.ones(d, dtype=torch.long))  # disjoint
    order = linreg.pair_order(3, 5, g)
    assert order.shape == (15, 2)
    assert sorted(map(tuple, order.tolist())) == [(j, i) for j in range(3) for i in range(5)]


def test_wor_schedule_is_algorithm_1(prob, monkeypatch):
    """RR_mask_wor's steps are exactly mask_cycle's masks in pair_order's order."""
    made = {'masks': [], 'orders': []}
    real_mask_cycle, real_pair_order = linreg.mask_cycle, linreg.pair_order

    def mask_cycle(d, ratio, generator):
        made['masks'].append(real_mask_cycle(d, ratio, generator))
        return made['masks'][-1]

    def pair_order(M, N, generator):
        made['orders'].append(real_pair_order(M, N, generator))
        return made['orders'][-1]

    monkeypatch.setattr(linreg, 'mask_cycle', mask_cycle)
    monkeypatch.setattr(linreg, 'pair_order', pair_order)
    X = prob['X']
    n, d = X.shape
    ratio, warmup = 0.5, 100
    M = math.ceil(1 / ratio)
    sched = linreg.make_schedules(['RR_mask_wor'], [3], X, ratio, warmup)[0]
    idx, U, mask = sched.take(warmup + 2 * M * n)
    assert len(made['masks']) == len(made['orders']) == 2  # two cycles, each from mask_cycle and pair_order
    assert np.allclose(U, mask * X[idx])  # u_t = S_t * x_t: the update direction uses the mask

    # warm-up: plain SGD on distinct samples (a partial RR epoch)
    assert np.all(mask[:warmup] == 1) and len(set(idx[:warmup].tolist())) == warmup
    for k in range(2):
        sl = slice(warmup + k * M * n, warmup + (k + 1) * M * n)
        masks = made['masks'][k].double().numpy()
        order = made['orders'][k].numpy()
        assert np.array_equal(idx[sl], order[:, 1]) and np.array_equal(mask[sl], masks[order[:, 0]])
        # the cycle's masks: M of them, values in {0, M}, summing to M * ones
        assert masks.shape == (M, d) and set(np.unique(masks)) <= {0.0, float(M)}
        assert np.array_equal(masks.sum(0), M * np.ones(d))
        # every (mask, sample) pair exactly once
        mask_id = np.array([np.flatnonzero((masks == row).all(1))[0] for row in mask[sl]])
        pairs = set(zip(mask_id.tolist(), idx[sl].tolist()))
        assert len(pairs) == M * n
        # so every sample gets every mask once: its masks sum to M * ones
        per_sample = np.zeros((n, d))
        np.add.at(per_sample, idx[sl], mask[sl])
        assert np.array_equal(per_sample, np.full((n, d), float(M)))
    assert sched.cycles == 2

    # run() draws its RR_mask_wor cycles from mask_cycle too: ceil((T - warmup) / (M n)) per seed
    made['masks'].clear()
    linreg.run(['RR_mask_wor'], T=warmup + 2 * M * n + 1, seeds=2, warmup=warmup, problem=prob, decompose=False)
    assert len(made['masks']) == 2 * 3


def test_other_schedules(prob):
    X = prob['X']
    n, d = X.shape
    s_rr, s_iid_mask, s_proj, s_iid = linreg.make_schedules(['RR', 'RR_mask_iid', 'RR_proj', 'IID'], [0], X, 0.5, 0)
    idx, U, mask = s_rr.take(2 * n)
    assert all(sorted(idx[e * n : (e + 1) * n].tolist()) == list(range(n)) for e in range(2))
    assert np.array_equal(U, X[idx]) and np.all(mask == 1)
    idx, U, mask = s_iid_mask.take(n)
    assert sorted(idx.tolist()) == list(range(n))
    assert np.all((mask != 0).sum(1) == 5) and set(np.unique(mask)) == {0.0, 2.0}
    assert np.allclose(U, mask * X[idx])
    assert np.allclose(mask.mean(0), 1, atol=0.15)  # unbiased: E[S] = 1
    idx, U, mask = s_proj.take(n)
    assert mask is None and sorted(idx.tolist()) == list(range(n))
    # u = 2 P P^T x with P P^T a rank-5 orthogonal projection: x.u = 2 |P^T x|^2 = |u|^2 / 2
    x = X[idx]
    assert np.allclose((x * U).sum(1), (U**2).sum(1) / 2)
    assert np.all((U**2).sum(1) / 4 <= (x**2).sum(1) + 1e-9)
    idx, U, mask = s_iid.take(n)
    assert len(set(idx.tolist())) < n  # with replacement: 1000 draws of 1000 repeat some
    # different seeds, different streams
    a = linreg.make_schedules(['RR'], [0, 1], X, 0.5, 0)
    assert not np.array_equal(a[0].take(n)[0], a[1].take(n)[0])


def test_run_matches_plain_sgd_loop_and_decomposition(prob):
    """run()'s vectorised loop and chunked decomposition equal a step-by-step reference."""
    T, seeds, c, t0, warmup = 2500, 2, 2.0, 100.0, 100
    res = linreg.run(
        linreg.METHODS, T=T, seeds=seeds, c=c, t0=t0, warmup=warmup, n_log=40, chunk=700, problem=prob
    )  # chunk boundaries inside the run
    X, y, A, ts = prob['X'], prob['y'], prob['A'], prob['theta_star']
    d = X.shape[1]
    scheds = linreg.make_schedules(linreg.METHODS, range(seeds), X, 0.5, warmup)
    t_log = {int(t): j for j, t in enumerate(res['t'])}
    assert res['decomp_residual'] < 1e-9
    for row, sched in enumerate(scheds):
        m, s = linreg.METHODS[row // seeds], row % seeds
        idx, U, _ = sched.take(T)
        theta, D, R, C = np.zeros(d), -ts.copy(), np.zeros(d), np.zeros(d)
        for t in range(T):
            eta = c / (t + t0)
            x, yy = X[idx[t]], y[idx[t]]
            grad = 2 * x * (x @ theta - yy)
            g = 2 * U[t] * (x @ theta - yy)
            full = A @ (theta - ts)
            D, R, C = D - eta * A @ D, R - eta * A @ R + eta * (full - grad), C - eta * A @ C + eta * (grad - g)
            theta = theta - eta * g
            j = t_log.get(t + 1)
            if j is not None:
                e = theta - ts
                assert np.isclose(res['err'][m][s, j], e @ e, rtol=1e-8)
                assert np.isclose(res['decay'][j], D @ D, rtol=1e-8)
                assert np.isclose(res['reshuffle'][m][s, j], R @ R, rtol=1e-6, atol=1e-14)
                assert np.isclose(res['compression'][m][s, j], C @ C, rtol=1e-6, atol=1e-14)
                assert np.allclose(D + R + C, e, atol=1e-10)
        if m in ('RR', 'IID'):
            assert np.all(res['compression'][m] == 0)


@pytest.fixture(scope='module')
def short_run(prob):
    return linreg.run(linreg.METHODS, T=50_000, seeds=4, problem=prob)


def test_rates_short_run(short_run):
    """T = 5e4, 4 seeds: the paper's ordering. Margins checked over 10-20 seed offsets:
    final-error ratio >= 22, RR / RR_mask_wor slopes <= -1.97, i.i.d. compression in [-1.29, -0.81]."""
    res, summ = short_run, linreg.summarize(short_run)['methods']
    t = res['t']
    j100 = int(np.searchsorted(t, 100))
    for m, e in res['err'].items():
        mean = e.mean(0)
        assert mean[-1] < 0.02 * mean[j100], m  # decreases for all methods
        late, mid = (t >= 5000), (t >= 500) & (t < 5000)
        assert mean[late].mean() < mean[mid].mean(), m
    fin = {m: r['final'] for m, r in summ.items()}
    assert max(fin['RR'], fin['RR_mask_wor']) * 5 < min(fin['RR_mask_iid'], fin['RR_proj'])
    for m in ('RR', 'RR_mask_wor'):
        assert summ[m]['slope'] < -1.7, (m, summ[m])  # O(t^-2)
    for m in ('RR_mask_iid', 'RR_proj'):
        assert -1.5 < summ[m]['slope'] < -0.6, (m, summ[m])  # O(t^-1)
    # the decomposition: RR keeps the data-reshuffle term at ~t^-2 for every RR method; the
    # compression-error term is ~t^-2 for OMGD and ~t^-1 for i.i.d. masks / projections
    for m in ('RR', 'RR_mask_wor', 'RR_mask_iid', 'RR_proj'):
        assert summ[m]['reshuffle_slope'] < -1.7, (m, summ[m])
    assert summ['IID']['reshuffle_slope'] > -1.5
    assert summ['RR_mask_wor']['compression_slope'] < -1.7
    for m in ('RR_mask_iid', 'RR_proj'):
        assert summ[m]['compression_slope'] > -1.5, (m, summ[m])
    assert res['decomp_residual'] < 1e-8


def test_cli_writes_outputs(tmp_path):
    linreg.main(['--T=3000', '--seeds=2', '--n_log=60', f'--out_dir={tmp_path}'])
    for name in ('linreg_error.png', 'linreg_decomposition.png', 'linreg.json', 'linreg.md'):
        assert (tmp_path / name).stat().st_size > 0
    import json

    blob = json.loads((tmp_path / 'linreg.json').read_text())
    assert set(blob['summary']['methods']) == set(linreg.METHODS)
    assert blob['params']['T'] == 3000 and len(blob['curves']['t']) == len(blob['curves']['err']['RR'])


def test_default_out_dir_is_not_results():
    """Run without --out_dir (from the repository root), linreg.py must not overwrite results/linreg.*."""
    out_dir = linreg.COMMAND_DEFAULTS['out_dir']
    path, results = (os.path.realpath(os.path.join(ROOT, p)) for p in (out_dir, 'results'))
    assert os.path.commonpath([path, results]) != results, out_dir
    assert os.path.normpath(out_dir) == 'out'  # git-ignored (out*/ in .gitignore)
    from configurator import configure

    assert configure(linreg.COMMAND_DEFAULTS, ['--out_dir=results'])['out_dir'] == 'results'


def test_a_disk_that_fills_while_the_report_is_written_is_one_line_and_keeps_the_earlier_report(
    tmp_path, monkeypatch, capsys
):
    """The plot's write fails half-way with ENOSPC (as on a full disk): one `error:` line, exit 1, and the
    earlier report left byte for byte, with no half-written or temporary file beside it."""
    import errno

    from matplotlib.figure import Figure

    argv = ['--T=300', '--seeds=1', '--decompose=False', f'--out_dir={tmp_path}']
    linreg.main(argv)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_savefig = Figure.savefig

    def savefig_on_a_full_disk(self, path, **kwargs):
        real_savefig(self, path, **kwargs)
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, 'savefig', savefig_on_a_full_disk)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        linreg.main(['--T=400', *argv[1:]])
    assert str(e.value) == (
        f"error: cannot write the report into --out_dir={tmp_path} (No space left on device); free space or "
        f"allow writing there, or give another --out_dir (the table above is this run's result; an earlier "
        f"report there is kept)"
    )
    assert '| RR |' in capsys.readouterr().out  # the run's table was printed before
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_out_dir_that_cannot_be_written_is_one_line():
    """/proc/self exists but takes no files, even for root (a read-only folder does for root)."""
    if not os.path.isdir('/proc/self'):
        pytest.skip('no /proc (not Linux)')
    with pytest.raises(SystemExit, match=r"^error: cannot write the report into --out_dir=/proc/self \("):
        linreg.main(['--T=200', '--seeds=1', '--decompose=False', '--out_dir=/proc/self'])
