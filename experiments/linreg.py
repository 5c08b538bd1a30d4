"""
The paper's illustrative example (Section "Illustrative Example", Figure 2, appendix
"Synthetic Experiments"): least squares with random reshuffling (RR), OMGD masks (Algorithm 1),
i.i.d. masks and i.i.d. random projections, under the step size eta_t = c / (t + t0).

Problem: n samples x ~ N(0, I_d), w_gen ~ U[0,1]^d, y ~ N(x^T w_gen, 1),
f(theta; x, y) = (x^T theta - y)^2, A = (2/n) sum x x^T, b = (2/n) sum x y, theta* = A^{-1} b,
theta_0 = 0. Every update is theta_{t+1} = theta_t - eta_t g_t with g_t = 2 (x_t^T theta_t - y_t) u_t,
where u_t = C_t x_t is the sample's feature vector after the method's compression C_t:

  RR           u = x, samples in a fresh random order every epoch (no compression)
  RR_mask_wor  OMGD, Algorithm 1: per cycle M = ceil(1/r) masks from mask_cycle (values M,
               summing to M * ones) and the order of the M*n (mask, sample) pairs from
               pair_order; u = S^(j) * x^(i)
  RR_mask_iid  RR samples; every step a fresh uniform mask of k = r*d coordinates with value d/k
  RR_proj      RR samples; every step a fresh P uniform on the Stiefel manifold St(d, k)
               (Gram-Schmidt of a Gaussian d x k matrix); u = (d/k) P P^T x
  IID          samples drawn with replacement (no compression), for reference

All methods run plain SGD for the first `warmup` steps (a partial RR epoch; i.i.d. draws for IID);
their own epochs / cycles start at t = warmup (the paper activates compression after 100 steps).

Decomposition (the paper's display before Figure 2's discussion, written as recursions):
theta_{t+1} - theta* = (I - eta_t A)(theta_t - theta*) + eta_t (grad F(theta_t) - grad f(theta_t; z_t))
                                                      + eta_t (grad f(theta_t; z_t) - g_t),
so e_t = D_t + R_t + C_t with D_0 = theta_0 - theta*, R_0 = C_0 = 0 and
  decay         D_{t+1} = (I - eta_t A) D_t
  data-reshuffle R_{t+1} = (I - eta_t A) R_t + eta_t (A e_t - 2 r_t x_t)
  compression   C_{t+1} = (I - eta_t A) C_t + eta_t 2 r_t (x_t - u_t)
with r_t = x_t^T theta_t - y_t evaluated on the method's own trajectory. They are computed in
A's eigenbasis, where I - eta A is diagonal, a chunk of steps at a time (scaled cumulative sums),
and D + R + C = e is checked.

Speed: the only sequential part is the update itself; it runs as one tight numpy loop over steps
whose vector dimension is every (method, seed) row at once (theta is augmented with a -1 so that
the residual is one row-wise dot product). Schedules, gathers and the decomposition are
vectorised per chunk; --decompose=False skips the decomposition.

    python experiments/linreg.py --out_dir=results    # T = 1e6, 10 seeds, all methods: results/linreg.*
    python experiments/linreg.py --T=1e5 --seeds=4    # writes out/linreg.* (the default, git-ignored)
"""

import contextlib
import json
import math
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import omgd  # noqa: E402  (the random partition of layer cycling's pool also splits the coordinates)
from configurator import above, at_least, command_line  # noqa: E402

METHODS = ('RR', 'RR_mask_wor', 'RR_mask_iid', 'RR_proj', 'IID')
COMPRESSED = ('RR_mask_wor', 'RR_mask_iid', 'RR_proj')
DEFAULTS = dict(
    T=10**6, seeds=10, n=1000, d=10, ratio=0.5, warmup=100, c=2.0, t0=100.0, data_seed=0, n_log=300, chunk=4000
)


# -----------------------------------------------------------------------------
# problem


def make_problem(n=1000, d=10, seed=0):
    """The appendix's data set and the quadratic it defines (float64 numpy arrays)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d))
    w_gen = rng.uniform(0.0, 1.0, d)
    y = X @ w_gen + rng.standard_normal(n)
    A = 2.0 / n * X.T @ X
    b = 2.0 / n * X.T @ y
    theta_star = np.linalg.solve(A, b)
    lam, Q = np.linalg.eigh(A)
    return dict(X=X, y=y, w_gen=w_gen, A=A, b=b, theta_star=theta_star, lam=lam, Q=Q)


def step_sizes(t, c, t0):
    """eta_t = c / (t + t0) for integer steps t (numpy array)."""
    return c / (np.asarray(t, dtype=np.float64) + t0)


# -----------------------------------------------------------------------------
# sample and compression schedules


def mask_cycle(d, ratio, generator):
    """Algorithm 1's M = ceil(1/ratio) masks of one cycle as an (M, d) tensor.

    Coordinates are split at random into M disjoint groups of near-equal size, and mask j
    is M on group j and 0 elsewhere, so the masks sum to M * ones (the paper's eq. 3).
    """
    M = math.ceil(1 / ratio)
    sizes = [len(c) for c in torch.arange(d).tensor_split(M)]
    masks = torch.zeros(M, d)
    for j, group in enumerate(omgd.random_partition(d, sizes, generator)):
        masks[j, group] = M
    return masks


def pair_order(M, N, generator):
    """Algorithm 1's RandomPermutation([M] x [N]) as an (M*N, 2) tensor of (mask j, sample i) rows."""
    flat = torch.randperm(M * N, generator=generator)
    return torch.stack([flat // N, flat % N], dim=1)


def stiefel_project(Z, x):
    """P P^T x for P = Gram-Schmidt(Z), Z of shape (L, d, k): P is uniform on St(d, k) when Z is
    Gaussian (it is the Q of the QR decomposition with a positive diagonal R)."""
    L, d, k = Z.shape
    Qs, out = [], np.zeros((L, d))
    for j in range(k):
        v = Z[:, :, j].copy()
        for q in Qs:
            v -= np.einsum('ld,ld->l', q, v)[:, None] * q
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        Qs.append(v)
        out += np.einsum('ld,ld->l', v, x)[:, None] * v
    return out


class Schedule:
    """The sequence of (sample index, compressed feature u_t = C_t x_t) of one method and seed.

    take(L) returns (idx (L,) int64, U (L, d) float64, mask (L, d) float64 or None); mask is the
    coordinate mask S_t (all ones for RR and IID, None for RR_proj). The first `warmup` steps are
    plain SGD; the method's epochs / cycles start right after them.
    """

    def __init__(self, method, X, ratio, warmup, generator):
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.method, self.X, self.ratio, self.gen = method, X, ratio, generator
        # torch generator: RR permutations, IID draws and Algorithm 1's masks / pair order;
        # numpy generator: the i.i.d. masks' and projections' random numbers (faster)
        self.rng = np.random.default_rng(generator.initial_seed())
        self.n, self.d = X.shape
        self.k = max(1, round(ratio * self.d))  # coordinates kept by RR_mask_iid / rank of RR_proj
        self.M = math.ceil(1 / ratio)  # masks per OMGD cycle
        self.cycles = 0  # OMGD cycles generated so far
        self.pieces, self.pos = [], 0
        if warmup > 0:
            if method == 'IID':
                idx = torch.randint(self.n, (warmup,), generator=generator).numpy()
            else:
                idx = torch.randperm(self.n, generator=generator)[:warmup].numpy()
            self.pieces.append((idx, X[idx], np.ones((len(idx), self.d))))

    def _block(self):
        n, d, gen, X = self.n, self.d, self.gen, self.X
        if self.method == 'IID':
            idx = torch.randint(n, (n,), generator=gen).numpy()
            return idx, X[idx], np.ones((n, d))
        if self.method == 'RR_mask_wor':  # one cycle of Algorithm 1
            masks = mask_cycle(d, self.ratio, gen).double().numpy()
            order = pair_order(masks.shape[0], n, gen).numpy()
            self.cycles += 1
            idx, mask = order[:, 1], masks[order[:, 0]]
            return idx, mask * X[idx], mask
        idx = torch.randperm(n, generator=gen).numpy()  # one RR epoch
        x = X[idx]
        if self.method == 'RR':
            return idx, x, np.ones((n, d))
        if self.method == 'RR_mask_iid':
            keep = self.rng.random((n, d)).argsort(axis=1)[:, : self.k]
            mask = np.zeros((n, d))
            np.put_along_axis(mask, keep, d / self.k, axis=1)
            return idx, mask * x, mask
        Z = self.rng.standard_normal((n, d, self.k))  # RR_proj
        return idx, (d / self.k) * stiefel_project(Z, x), None

    def take(self, L):
        idx, U, mask, got = [], [], [], 0
        while got < L:
            if not self.pieces:
                self.pieces, self.pos = [self._block()], 0
            p_idx, p_U, p_mask = self.pieces[0]
            m = min(L - got, len(p_idx) - self.pos)
            sl = slice(self.pos, self.pos + m)
            idx.append(p_idx[sl])
            U.append(p_U[sl])
            mask.append(None if p_mask is None else p_mask[sl])
            got, self.pos = got + m, self.pos + m
            if self.pos == len(p_idx):
                self.pieces.pop(0)
                self.pos = 0
        mask = None if any(m is None for m in mask) else np.concatenate(mask)
        return np.concatenate(idx), np.concatenate(U), mask


def stream_seed(seed, method):
    """Seed of the torch generator of one (seed, method) row."""
    return int(np.random.SeedSequence([seed, METHODS.index(method)]).generate_state(1)[0])


def make_schedules(methods, seeds, X, ratio, warmup):
    """One Schedule per (method, seed) row, method-major: the rows run() updates."""
    return [
        Schedule(m, X, ratio, warmup, torch.Generator().manual_seed(stream_seed(s, m))) for m in methods for s in seeds
    ]


# -----------------------------------------------------------------------------
# the run


def log_times(T, n_log):
    return np.unique(np.round(np.logspace(0, math.log10(T), n_log)).astype(np.int64))


def run(
    methods=METHODS,
    T=DEFAULTS['T'],
    seeds=DEFAULTS['seeds'],
    *,
    n=DEFAULTS['n'],
    d=DEFAULTS['d'],
    ratio=DEFAULTS['ratio'],
    warmup=DEFAULTS['warmup'],
    c=DEFAULTS['c'],
    t0=DEFAULTS['t0'],
    data_seed=DEFAULTS['data_seed'],
    n_log=DEFAULTS['n_log'],
    chunk=DEFAULTS['chunk'],
    seed_offset=0,
    decompose=True,
    problem=None,
):
    """Run every method on `seeds` seeds for T steps (one vectorised loop over all of them).

    Returns a dict with 't' (the logged steps), 'err' / 'reshuffle' / 'compression' as
    {method: (seeds, len(t)) array of squared norms}, 'decay' ((len(t),), common to all methods),
    'decomp_residual' (max ||D+R+C-e|| / max(||e||, 1e-300) at the logged steps), the problem's
    'lambda_min', 'lambda_max', 'theta_star', and the run's 'params'.
    """
    methods = list(methods)
    prob = problem or make_problem(n, d, data_seed)
    X, y, ts, lam, Q = prob['X'], prob['y'], prob['theta_star'], prob['lam'], prob['Q']
    n, d = X.shape
    if c * lam[0] <= 2:
        print(f"warning: c * lambda_min = {c * lam[0]:.3f} <= 2: the O(t^-2) theorem does not apply")
    if c * lam[-1] / t0 >= 1:
        raise ValueError(f"eta_0 * lambda_max = {c * lam[-1] / t0:.3f} >= 1; raise t0")
    scheds = make_schedules(methods, range(seed_offset, seed_offset + seeds), X, ratio, warmup)
    B = len(scheds)
    times = log_times(T, n_log)
    nt = len(times)
    err = np.zeros((B, nt))
    res_sq = np.zeros((B, nt))
    cmp_sq = np.zeros((B, nt))
    decay = np.zeros(nt)
    resid = 0.0

    theta = np.zeros((B, d + 1))
    theta[:, d] = -1.0  # augmented: [theta, -1] . [x, y] = x^T theta - y
    reshuffle_term = np.zeros((B, d))  # data-reshuffle term, eigen-coordinates
    compression_term = np.zeros((B, d))  # compression-error term, eigen-coordinates
    decay_term = Q.T @ (0.0 - ts)  # decay term, eigen-coordinates (theta_0 = 0)
    sub = np.subtract
    for c0 in range(0, T, chunk):
        L = min(chunk, T - c0)
        parts = [s.take(L) for s in scheds]
        idx = np.stack([p[0] for p in parts], axis=1)  # (L, B)
        U = np.stack([p[1] for p in parts], axis=1)  # (L, B, d)
        eta = step_sizes(np.arange(c0, c0 + L), c, t0)
        two_eta = 2.0 * eta
        xy = np.concatenate([X[idx], y[idx][..., None]], axis=2)  # (L, B, d+1)
        step_vec = np.zeros((L, B, d + 1))  # 2 eta_s u_s, padded to the augmented theta
        step_vec[:, :, :d] = two_eta[:, None, None] * U
        thetas = np.empty((L + 1, B, d + 1))
        thetas[0] = theta
        # per-step views: a list index costs less than an array index in the sequential loop
        xy_at, step_vec_at, theta_at = list(xy), list(step_vec), list(thetas)
        for s in range(L):  # the sequential part: theta_{s+1} = theta_s - 2 eta_s r_s u_s
            th = theta_at[s]
            sub(th, (xy_at[s] * th).sum(1, keepdims=True) * step_vec_at[s], out=theta_at[s + 1])
        theta = thetas[L].copy()
        if not np.all(np.isfinite(theta)):
            raise FloatingPointError(f"divergence before step {c0 + L}; lower c or raise t0")

        sel = (times > c0) & (times <= c0 + L)
        s_log = times[sel] - c0  # positions in thetas (1..L)
        E = thetas[s_log, :, :d] - ts  # (nl, B, d)
        err[:, sel] = (E**2).sum(-1).T
        a = 1.0 - eta[:, None] * lam  # (L, d)
        P = np.concatenate([np.ones((1, d)), np.cumprod(a, axis=0)])  # prod_{u<s} (1 - eta_u lam)
        decay[sel] = ((P[s_log] * decay_term) ** 2).sum(-1)
        if decompose:
            r = np.einsum('lbi,lbi->lb', xy, thetas[:L])  # residual x^T theta - y at theta_s
            Et = (thetas[:L, :, :d] - ts) @ Q  # e_s, eigen-coordinates
            Xt = X[idx] @ Q
            reshuffle_input = eta[:, None, None] * lam * Et - (two_eta[:, None] * r)[..., None] * Xt
            compression_input = (two_eta[:, None] * r)[..., None] * (Xt - U @ Q)
            zs = []
            cuts = np.concatenate([[0], s_log[s_log < L], [L]])  # segment ends: logged steps, L
            for Z0, F in ((reshuffle_term, reshuffle_input), (compression_term, compression_input)):
                # cs at s in cuts[1:]: sum_{u<s} F_u / prod_{i<=u} a_i, from segment sums
                cs = np.cumsum(np.add.reduceat(F / P[1:, None, :], cuts[:-1], axis=0), axis=0)
                zs.append(P[s_log, None, :] * (Z0 + cs[np.searchsorted(cuts[1:], s_log)]))
                Z0[:] = P[L] * (Z0 + cs[-1])
            res_sq[:, sel] = (zs[0] ** 2).sum(-1).T
            cmp_sq[:, sel] = (zs[1] ** 2).sum(-1).T
            if s_log.size:
                full = P[s_log, None, :] * decay_term + zs[0] + zs[1]
                gap = np.linalg.norm(full - E @ Q, axis=-1) / np.maximum(np.linalg.norm(E, axis=-1), 1e-300)
                resid = max(resid, float(gap.max()))
        decay_term = P[L] * decay_term

    out = dict(
        t=times,
        decay=decay,
        decomp_residual=resid if decompose else None,
        lambda_min=float(lam[0]),
        lambda_max=float(lam[-1]),
        theta_star=ts,
        err={},
        reshuffle={},
        compression={},
        params=dict(
            methods=methods,
            T=T,
            seeds=seeds,
            seed_offset=seed_offset,
            n=n,
            d=d,
            ratio=ratio,
            warmup=warmup,
            c=c,
            t0=t0,
            data_seed=data_seed,
            alpha=float(c * lam[0]),
            chunk=chunk,
        ),
    )
    for i, m in enumerate(methods):
        rs = slice(i * seeds, (i + 1) * seeds)
        out['err'][m] = err[rs]
        if decompose:
            out['reshuffle'][m] = res_sq[rs]
            out['compression'][m] = cmp_sq[rs]
    return out


def fit_slope(t, v, lo, hi):
    """Least-squares slope of log v against log t over lo <= t <= hi."""
    t, v = np.asarray(t, dtype=np.float64), np.asarray(v, dtype=np.float64)
    keep = (t >= lo) & (t <= hi) & (v > 0)
    if keep.sum() < 2:
        return float('nan')
    return float(np.polyfit(np.log(t[keep]), np.log(v[keep]), 1)[0])


def summarize(res):
    """Per method: slopes over the last decade of t and final values (means over seeds)."""
    t, T = res['t'], res['params']['T']
    lo = T / 10
    rows = {}
    for m, e in res['err'].items():
        row = dict(
            slope=fit_slope(t, e.mean(0), lo, T),
            final=float(e.mean(0)[-1]),
            slope_seeds=[fit_slope(t, es, lo, T) for es in e],
        )
        if m in res['reshuffle']:
            row['reshuffle_slope'] = fit_slope(t, res['reshuffle'][m].mean(0), lo, T)
            row['compression_slope'] = fit_slope(t, res['compression'][m].mean(0), lo, T) if m in COMPRESSED else None
        rows[m] = row
    return dict(fit_range=[lo, T], methods=rows, decay_slope=fit_slope(t, res['decay'], lo, T))


# -----------------------------------------------------------------------------
# outputs

COLORS = {
    'RR': 'tab:blue',
    'RR_mask_wor': 'tab:red',
    'RR_mask_iid': 'tab:green',
    'RR_proj': 'tab:orange',
    'IID': 'tab:gray',
}


def _reference_slopes(ax, t, anchors):
    """Dashed t^-1 and t^-2 lines through the given (t, value) anchor points."""
    tt = np.array([t[0] if t[0] > 10 else 10, t[-1]], dtype=np.float64)
    for p, (ta, va) in anchors.items():
        ax.loglog(tt, va * (tt / ta) ** (-p), 'k--' if p == 1 else 'k:', lw=1, label=f'$t^{{-{p}}}$ reference')


def plot_error(res, path):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    t, T = res['t'], res['params']['T']
    for m, e in res['err'].items():
        ax.loglog(t, e.mean(0), color=COLORS.get(m), label=m)
    j = int(np.searchsorted(t, T / 10))  # t is sorted and unique (log_times)
    anchor_t = t[j]
    up = max(e.mean(0)[j] for e in res['err'].values())
    low = min(e.mean(0)[j] for e in res['err'].values())
    _reference_slopes(ax, t, {1: (anchor_t, 3 * up), 2: (anchor_t, low / 3)})
    p = res['params']
    ax.set_xlabel('iteration t')
    ax.set_ylabel(r'$\|\theta_t-\theta^*\|^2$ (mean over %d seeds)' % p['seeds'])
    ax.set_title(
        f"least squares n={p['n']}, d={p['d']}, r={p['ratio']}, $\\eta_t$={p['c']:g}/(t+{p['t0']:g})", fontsize=9
    )
    ax.legend(fontsize=8)
    ax.grid(True, which='major', alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130, format='png')
    plt.close(fig)


def plot_decomposition(res, path):
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    t = res['t']
    panels = [
        ('err', r'(a) $\|\theta_t-\theta^*\|^2$'),
        ('decay', '(b) decay term'),
        ('reshuffle', '(c) data-reshuffle term'),
        ('compression', '(d) compression-error term'),
    ]
    for ax, (key, title) in zip(axes, panels):
        if key == 'decay':
            ax.loglog(t, res['decay'], color='k', label='all methods (deterministic)')
        else:
            for m, v in res[key].items():
                if key == 'compression' and m not in COMPRESSED:
                    continue  # identically zero (no compression)
                mean = v.mean(0)
                ax.loglog(t, np.where(mean > 0, mean, np.nan), color=COLORS.get(m), label=m)
        ax.set_title(title + ' (squared norm)', fontsize=10)
        ax.set_xlabel('iteration t')
        ax.grid(True, which='major', alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format='png')
    plt.close(fig)


def _fmt(x):
    return 'n/a' if x is None or (isinstance(x, float) and math.isnan(x)) else f'{x:.2f}'


def table(summary):
    lo, hi = summary['fit_range']
    lines = [
        f"slopes of log ||.||^2 vs log t over t in [{lo:.0f}, {hi:.0f}] (mean over seeds)",
        '',
        '| method | error slope | per-seed slopes (min..max) | final error | '
        'data-reshuffle slope | compression slope |',
        '|---|---|---|---|---|---|',
    ]
    for m, r in summary['methods'].items():
        ps = r['slope_seeds']
        lines.append(
            f"| {m} | {_fmt(r['slope'])} | {min(ps):.2f}..{max(ps):.2f} | {r['final']:.3e} | "
            f"{_fmt(r.get('reshuffle_slope'))} | "
            f"{_fmt(r.get('compression_slope')) if r.get('compression_slope') is not None else '0 (none)'} |"
        )
    lines.append(f"\ndecay term slope: {summary['decay_slope']:.2f} (common to all methods)")
    return '\n'.join(lines)


TERMS_DOC = """Definitions. Every step is theta_{t+1} = theta_t - eta_t g_t with g_t = 2 (x_t^T theta_t - y_t) u_t,
u_t = C_t x_t (x_t for RR / IID, S_t * x_t for masks, (d/k) P_t P_t^T x_t for RR_proj). The
paper's decomposition e_t = theta_t - theta* = D_t + R_t + C_t, as recursions with
D_0 = theta_0 - theta*, R_0 = C_0 = 0:

- decay: D_{t+1} = (I - eta_t A) D_t (deterministic, the same for every method; ~ t^{-2 c lambda_min})
- data-reshuffle: R_{t+1} = (I - eta_t A) R_t + eta_t (grad F(theta_t) - grad f(theta_t; z_t))
- compression-error: C_{t+1} = (I - eta_t A) C_t + eta_t (grad f(theta_t; z_t) - g_t) (zero for RR, IID)

evaluated on each method's own trajectory; plotted are squared norms averaged over seeds.
Every method runs plain SGD for the warm-up steps (a partial RR epoch; i.i.d. draws for IID); its
own epochs / OMGD cycles (M n steps, M = ceil(1/r)) start at t = warm-up. Single-time values of
RR-type methods oscillate with the epoch / cycle phase (the error is smallest at epoch ends),
so per-seed slopes scatter; the table's slope is fitted to the seed-mean curve at log-spaced t.
"""


def verdict(summary):
    """One line per claim of the paper: O(t^-2) for RR and RR_mask_wor, O(t^-1) for i.i.d."""
    rows, lines = summary['methods'], []
    for m, claim in (('RR', -2), ('RR_mask_wor', -2), ('RR_mask_iid', -1), ('RR_proj', -1), ('IID', -1)):
        if m not in rows:
            continue
        slope = rows[m]['slope']
        measured = -2 if slope < -1.5 else -1
        lines.append(
            f"- {m}: paper O(t^{claim}), measured slope {slope:.2f} -> {'agrees' if measured == claim else 'DISAGREES'}"
        )
    return 'Versus the paper (threshold -1.5 between the two rates):\n\n' + '\n'.join(lines)


COMMAND_DEFAULTS = dict(DEFAULTS, T=float(DEFAULTS['T']), methods=','.join(METHODS), decompose=True, out_dir='out')
MEANINGS = dict(
    T='iterations (1e6 is read as a number)',
    ratio='keep ratio r',
    c='eta_t = c / (t + t0)',
    n_log='log-spaced logged steps',
    decompose="the paper's Figure 2 error decomposition (slower)",
    out_dir='default out/ (git-ignored); results/ only when named',
)
RULES = {
    **{k: at_least(1) for k in ('T', 'seeds', 'n', 'd', 'n_log', 'chunk')},
    'warmup': at_least(0),
    'ratio': above(0, 1),  # a mask keeps a share of the coordinates: 0 keeps none, above 1 is no share
    'methods': (
        (lambda v: bool(v.strip(',')) and all(m in METHODS for m in v.split(',') if m)),
        f"a comma list of {', '.join(METHODS)}",
    ),
}


def write_text(path, text):
    with open(path, 'w') as f:
        f.write(text)


def write_reports(out_dir, writers):
    """Each {file name: writer(path)} writes a hidden file beside its name, and only when all are written do
    they replace the earlier report: a disk that fills half-way leaves that report whole. A one-line exit."""
    written = []  # (temporary, final) paths; each temporary file created here, exclusively, so removing it is safe
    try:
        for name, write in writers.items():
            fd, tmp = tempfile.mkstemp(prefix=f'.{name}.tmp-', dir=out_dir)
            os.close(fd)
            written.append((tmp, os.path.join(out_dir, name)))
            write(tmp)
        for tmp, path in written:
            os.replace(tmp, path)
    except OSError as e:
        for tmp, _ in written:
            with contextlib.suppress(FileNotFoundError):  # already moved into place
                os.remove(tmp)
        sys.exit(
            f"error: cannot write the report into --out_dir={out_dir} ({e.strerror or e}); free space or allow "
            f"writing there, or give another --out_dir (the table above is this run's result; an earlier report "
            f"there is kept)"
        )


def main(argv=None):
    args = SimpleNamespace(
        **command_line(sys.argv[1:] if argv is None else argv, COMMAND_DEFAULTS, RULES, __doc__, MEANINGS)
    )
    try:  # before the run, not after it: a folder it can write
        os.makedirs(args.out_dir, exist_ok=True)
    except OSError as e:
        sys.exit(f"error: --out_dir={args.out_dir} cannot hold the report ({e.strerror or e}); choose a folder")
    torch.set_num_threads(1)
    T = int(args.T)
    methods = [m for m in args.methods.split(',') if m]
    start = time.time()
    res = run(
        methods,
        T,
        args.seeds,
        n=args.n,
        d=args.d,
        ratio=args.ratio,
        warmup=args.warmup,
        c=args.c,
        t0=args.t0,
        data_seed=args.data_seed,
        n_log=args.n_log,
        chunk=args.chunk,
        decompose=args.decompose,
    )
    runtime = time.time() - start
    summ = summarize(res)
    tab = table(summ)
    p = res['params']
    print(
        f"lambda_min(A) = {res['lambda_min']:.4f}, lambda_max(A) = {res['lambda_max']:.4f}, "
        f"c * lambda_min = {p['alpha']:.3f}"
    )
    print(tab)
    print(f"decomposition check max ||D+R+C-e||/||e|| = {res['decomp_residual']}")
    print(f"runtime {runtime:.1f} s")

    cmd = 'python experiments/linreg.py ' + ' '.join(sys.argv[1:] if argv is None else argv)
    mean = lambda dct: {m: v.mean(0).tolist() for m, v in dct.items()}
    blob = dict(
        command=cmd.strip(),
        runtime_s=round(runtime, 1),
        params=p,
        lambda_min=res['lambda_min'],
        lambda_max=res['lambda_max'],
        decomp_residual=res['decomp_residual'],
        summary=summ,
        curves=dict(
            t=res['t'].tolist(),
            err=mean(res['err']),
            decay=res['decay'].tolist(),
            reshuffle=mean(res['reshuffle']),
            compression=mean(res['compression']),
        ),
    )
    markdown = (
        f"# Least squares: convergence rates of RR / OMGD / i.i.d. compression\n\n"
        f"Command: `{cmd.strip()}` ({runtime:.0f} s)\n\n"
        f"n={p['n']}, d={p['d']}, r={p['ratio']}, warm-up {p['warmup']} steps, T={T}, "
        f"{p['seeds']} seeds, data seed {p['data_seed']}, eta_t = {p['c']:g}/(t+{p['t0']:g}); "
        f"lambda_min(A)={res['lambda_min']:.3f}, lambda_max(A)={res['lambda_max']:.3f}, "
        f"c*lambda_min={p['alpha']:.2f} (> 2, the condition of the paper's O(t^-2) theorem for RR and "
        f"RR_mask_wor).\n\n"
        f"{tab}\n\nmax ||D+R+C-e||/||e|| at the logged steps: {res['decomp_residual']}\n\n"
        f"{verdict(summ)}\n\n{TERMS_DOC}\n"
        f"Plots: `linreg_error.png` (error, t^-1 and t^-2 reference lines), "
        f"`linreg_decomposition.png` (the paper's Figure 2 a-d).\n"
    )
    writers = {'linreg_error.png': lambda path: plot_error(res, path)}
    if args.decompose:
        writers['linreg_decomposition.png'] = lambda path: plot_decomposition(res, path)
    writers['linreg.json'] = lambda path: write_text(path, json.dumps(blob, indent=1))
    writers['linreg.md'] = lambda path: write_text(path, markdown)
    write_reports(args.out_dir, writers)
    return res, summ


if __name__ == '__main__':
    main()
