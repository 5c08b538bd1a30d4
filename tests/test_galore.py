import copy
import io
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import galore
import memory_estimate  # noqa: E402
from model import Transformer, TransformerConfig  # noqa: E402

LR, BETAS, EPS, WD, SCALE = 0.1, (0.9, 0.95), 1e-8, 0.1, 0.5


def galore_by_hand(
    w, grads, rank, gap, scale, lr=LR, betas=BETAS, eps=EPS, wd=WD, golore_bases=None, convention='galore'
):
    """GaLore-AdamW written out step by step from its definition, for one matrix (rank=None: a plain
    AdamW parameter of any shape). With golore_bases (refresh step -> the random basis drawn there;
    other refreshes use SVD) it is GoLore as in its reference code: at each refresh the first moment
    is mapped back to m x n and onto the new basis. convention 'galore': galore_torch/adamw.py's
    formulas (eps added to sqrt(v), the bias corrections in the step size, weight decay after the
    update); 'torch': torch.optim.AdamW's (weight decay first, eps added to sqrt(v_hat))."""
    w = w.clone()
    right = w.dim() == 2 and w.shape[0] >= w.shape[1]
    exp_avg = exp_avg_sq = proj = None
    for t, g in enumerate(grads, start=1):
        if rank is None:
            pass
        elif (t - 1) % gap == 0:
            if golore_bases is not None and t - 1 in golore_bases:
                new = golore_bases[t - 1]
            else:
                U, S, Vh = torch.linalg.svd(g, full_matrices=False)
                new = Vh[:rank].T if right else U[:, :rank]  # Q (n x r) or P (m x r)
            if golore_bases is not None and proj is not None:
                full = exp_avg @ proj.T if right else proj @ exp_avg  # old coordinates -> m x n
                exp_avg = full @ new if right else new.T @ full
            proj = new
        back = (lambda u: u) if rank is None else (lambda u: u @ proj.T) if right else (lambda u: proj @ u)
        r = g if rank is None else g @ proj if right else proj.T @ g
        if exp_avg is None:
            exp_avg, exp_avg_sq = torch.zeros_like(r), torch.zeros_like(r)
        exp_avg = betas[0] * exp_avg + (1 - betas[0]) * r
        exp_avg_sq = betas[1] * exp_avg_sq + (1 - betas[1]) * r * r
        if convention == 'galore':
            step_size = lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t)
            w = w - step_size * scale * back(exp_avg / (exp_avg_sq.sqrt() + eps))
            w = w - lr * wd * w
        else:
            m_hat = exp_avg / (1 - betas[0] ** t)
            v_hat = exp_avg_sq / (1 - betas[1] ** t)
            w = w * (1 - lr * wd) - lr * scale * back(m_hat / (v_hat.sqrt() + eps))
    return w, exp_avg, exp_avg_sq, proj


@pytest.mark.parametrize('convention', galore.CONVENTIONS)
@pytest.mark.parametrize('gap', [200, 2])  # 2: a refresh at step 2, where GaLore keeps its moments
@pytest.mark.parametrize('shape', [(6, 4), (4, 6)])
def test_step_matches_hand_computation(shape, gap, convention):
    torch.manual_seed(0)
    w0 = torch.randn(shape, dtype=torch.float64)
    grads = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
    expected, exp_avg, exp_avg_sq, proj = galore_by_hand(w0, grads, rank=2, gap=gap, scale=SCALE, convention=convention)

    p = torch.nn.Parameter(w0.clone())
    opt = galore.GaLoreAdamW(
        [{'params': [p], 'rank': 2, 'update_proj_gap': gap, 'scale': SCALE}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        convention=convention,
    )
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), expected)
    state = opt.state[p]
    # moments are r x n or m x r: projected on the smaller side
    assert state['exp_avg'].shape == ((6, 2) if shape == (6, 4) else (2, 6))
    torch.testing.assert_close(state['exp_avg'], exp_avg)
    torch.testing.assert_close(state['exp_avg_sq'], exp_avg_sq)
    torch.testing.assert_close(state['projector'], proj)
    assert state['step'] == 3


@pytest.mark.parametrize('convention', galore.CONVENTIONS)
@pytest.mark.parametrize('shape', [(6, 4), (4, 6)])
def test_golore_matches_hand_computation_across_refreshes(shape, convention):
    # refreshes at steps 0 and 2 use SVD (step < svd_steps = 4), at 4 and 6 random bases
    torch.manual_seed(4)
    w0 = torch.randn(shape, dtype=torch.float64)
    grads = [torch.randn(shape, dtype=torch.float64) for _ in range(7)]
    p = torch.nn.Parameter(w0.clone())
    opt = galore.GaLoreAdamW(
        [{'params': [p], 'rank': 2, 'update_proj_gap': 2, 'scale': SCALE, 'projection': 'random', 'svd_steps': 4}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        seed=5,
        convention=convention,
    )
    bases = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        bases.append(opt.state[p]['projector'].clone())
    # the random draws are taken from the optimizer; check they are orthonormal and not the SVD's
    drawn = {4: bases[4], 6: bases[6]}
    right = shape[0] >= shape[1]
    for s, q in drawn.items():
        torch.testing.assert_close(q.T @ q, torch.eye(2, dtype=torch.float64), atol=1e-6, rtol=0)
        U, _, Vh = torch.linalg.svd(grads[s], full_matrices=False)
        top = Vh[:2].T if right else U[:, :2]
        assert (top.T @ q).abs().max() < 0.999  # not spanning the top singular directions
    expected, exp_avg, exp_avg_sq, proj = galore_by_hand(
        w0, grads, rank=2, gap=2, scale=SCALE, golore_bases=drawn, convention=convention
    )
    state = opt.state[p]
    torch.testing.assert_close(p.detach(), expected)
    torch.testing.assert_close(state['exp_avg'], exp_avg)
    torch.testing.assert_close(state['exp_avg_sq'], exp_avg_sq)
    torch.testing.assert_close(state['projector'], proj)
    assert state['step'] == 7
    # and it is not GaLore's keep-the-moments rule with the same bases (the re-projection matters)
    kept, *_ = galore_by_hand(w0, grads[:3], rank=2, gap=2, scale=SCALE)
    moved, *_ = galore_by_hand(w0, grads[:3], rank=2, gap=2, scale=SCALE, golore_bases={})
    assert not torch.allclose(kept, moved)


def test_default_follows_galore_torch_over_20_steps():
    """The defaults (convention 'galore', eps 1e-6) follow galore_torch/adamw.py's formulas, written
    out by hand, over 20 steps with refreshes every 5, for both projection sides and a plain-AdamW
    vector. Gradients of 1e-3 put sqrt(v) near eps, where the two conventions part: torch's
    arithmetic misses the reference by far more than the tolerance."""
    torch.manual_seed(6)
    shapes, steps, gap, wd = [(6, 4), (4, 6), (5,)], 20, 5, 0.1
    w0 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    grads = [[1e-3 * torch.randn(s, dtype=torch.float64) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = galore.GaLoreAdamW(
        [{'params': params[:2], 'rank': 2, 'update_proj_gap': gap, 'scale': SCALE}, {'params': params[2:]}],
        lr=LR,
        betas=BETAS,
        weight_decay=wd,
    )
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    for i, (p, w) in enumerate(zip(params, w0)):
        rank = 2 if i < 2 else None
        per_param = [gs[i] for gs in grads]
        expected, exp_avg, exp_avg_sq, _ = galore_by_hand(
            w, per_param, rank, gap, SCALE if rank else 1.0, eps=1e-6, wd=wd
        )
        torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(opt.state[p]['exp_avg'], exp_avg, rtol=1e-12, atol=1e-20)
        torch.testing.assert_close(opt.state[p]['exp_avg_sq'], exp_avg_sq, rtol=1e-12, atol=1e-20)
        other, *_ = galore_by_hand(w, per_param, rank, gap, SCALE if rank else 1.0, eps=1e-6, wd=wd, convention='torch')
        assert (other - expected).abs().max() > 1e-6 * expected.abs().max(), i


def test_group_without_rank_is_torch_adamw():
    # bitwise: with convention='torch' a group without `rank` runs optim.adamw_step_, torch's
    # single-tensor arithmetic
    torch.manual_seed(1)
    a = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ours = galore.GaLoreAdamW(
        [{'params': a[:1]}, {'params': a[1:], 'weight_decay': 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        convention='torch',
    )
    ref = torch.optim.AdamW(
        [{'params': b[:1]}, {'params': b[1:], 'weight_decay': 0.0}],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
        foreach=False,
    )
    for _ in range(4):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        ours.step()
        ref.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(ours.state[p]['exp_avg'], ref.state[q]['exp_avg'])
        assert torch.equal(ours.state[p]['exp_avg_sq'], ref.state[q]['exp_avg_sq'])
        assert 'projector' not in ours.state[p]


def test_projection_refreshed_every_gap_steps():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(8, 5))
    opt = galore.GaLoreAdamW([{'params': [p], 'rank': 2, 'update_proj_gap': 3}], lr=1e-3)
    projectors = []
    for _ in range(7):
        p.grad = torch.randn(8, 5)
        opt.step()
        projectors.append(opt.state[p]['projector'].clone())
    same = [torch.equal(projectors[i], projectors[i + 1]) for i in range(6)]
    # new projections at steps 0, 3, 6: before the 4th and the 7th call
    assert same == [True, True, False, True, True, False]


def test_golore_projection_orthonormal_and_reproducible():
    def projector(seed, shape=(20, 12), global_seed=123):
        p = torch.nn.Parameter(torch.zeros(shape))
        opt = galore.GaLoreAdamW([{'params': [p], 'rank': 4, 'projection': 'random'}], lr=1e-3, seed=seed)
        torch.manual_seed(global_seed)  # sets both the gradient and the global RNG's state
        p.grad = torch.randn(shape)
        opt.step()
        return opt.state[p]['projector']

    q = projector(0)
    assert q.shape == (12, 4)
    torch.testing.assert_close(q.T @ q, torch.eye(4), atol=1e-5, rtol=0)
    # same seed: same projection, whatever the gradient and the global RNG
    torch.testing.assert_close(projector(0, global_seed=456), q)
    assert not torch.allclose(projector(1), q)
    left = projector(0, shape=(7, 30))
    assert left.shape == (7, 4)
    torch.testing.assert_close(left.T @ left, torch.eye(4), atol=1e-5, rtol=0)


def test_none_grads_skipped_and_accounting_excludes_projector():
    frozen = torch.nn.Parameter(torch.randn(6, 4))
    p = torch.nn.Parameter(torch.randn(6, 4))
    bias = torch.nn.Parameter(torch.randn(4))
    opt = galore.GaLoreAdamW([{'params': [frozen, p], 'rank': 2}, {'params': [bias]}], lr=1e-3)
    p.grad, bias.grad = torch.randn(6, 4), torch.randn(4)
    opt.step()
    assert frozen not in opt.state
    # moments: 2 x (6 x 2) for p, 2 x 4 for the bias; the 4 x 2 projector counted apart
    holder = torch.nn.ParameterList([frozen, p, bias])
    assert memory_estimate.memory_bytes(holder, opt)['optimizer'] == 4 * (2 * 12 + 2 * 4)
    assert sorted(k for _, k, _ in memory_estimate.state_tensors(opt)) == [
        'exp_avg',
        'exp_avg',
        'exp_avg_sq',
        'exp_avg_sq',
    ]
    assert galore.projector_bytes(opt) == 4 * 8


def test_state_dict_resume_is_exact():
    torch.manual_seed(3)
    grads = [torch.randn(6, 9) for _ in range(6)]

    def make():
        p = torch.nn.Parameter(torch.ones(6, 9))
        return p, galore.GaLoreAdamW(
            [{'params': [p], 'rank': 3, 'update_proj_gap': 2, 'projection': 'random', 'svd_steps': 4}], lr=1e-2
        )

    p, opt = make()
    for g in grads:
        p.grad = g.clone()
        opt.step()
    q, opt2 = make()
    for g in grads[:3]:
        q.grad = g.clone()
        opt2.step()
    saved = copy.deepcopy(opt2.state_dict())
    # only tensors and numbers in the state: it loads with torch.load(weights_only=True)
    assert all(torch.is_tensor(v) or isinstance(v, int) for s in saved['state'].values() for v in s.values())
    r, opt3 = make()
    with torch.no_grad():
        r.copy_(q)
    opt3.load_state_dict(saved)
    for g in grads[3:]:
        r.grad = g.clone()
        opt3.step()
    torch.testing.assert_close(r, p)


def tiny_gpt(arch='llama'):
    torch.manual_seed(0)
    return Transformer(
        TransformerConfig(arch=arch, n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, bias=False)
    )


def test_build_optimizer_groups():
    model = tiny_gpt()
    opt = galore.build_optimizer(
        model, 0.1, 1e-3, (0.9, 0.95), rank=4, update_proj_gap=10, scale=0.25, projection='random', svd_steps=30
    )
    seen = [id(p) for g in opt.param_groups for p in g['params']]
    assert sorted(seen) == sorted(id(p) for p in model.parameters())
    (low_rank,) = [g for g in opt.param_groups if 'rank' in g]
    expected = {id(p) for b in model.blocks for p in b.parameters() if p.dim() == 2}
    assert {id(p) for p in low_rank['params']} == expected and len(expected) == 2 * 7
    assert low_rank['projection'] == 'random' and low_rank['update_proj_gap'] == 10
    assert low_rank['svd_steps'] == 30
    outer = {id(model.wte.weight), id(model.lm_head.weight)}
    assert outer.isdisjoint(expected)


@pytest.mark.parametrize('arch,projection', [('llama', 'svd'), ('gpt2', 'random')])
def test_tiny_gpt_training_lowers_loss(arch, projection):
    model = tiny_gpt(arch)
    opt = galore.build_optimizer(
        model, 0.0, 3e-3, (0.9, 0.95), rank=8, update_proj_gap=10, scale=1.0, projection=projection
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (8, 16), generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize(
    'group, kwargs, message',
    [
        (dict(rank=2, projection='qr'), {}, 'projection'),
        (dict(rank=0), {}, 'rank'),
        (dict(rank=2, update_proj_gap=0), {}, 'galore_update_proj_gap must be >= 1'),
        (dict(rank=2, projection='random', svd_steps=-1), {}, 'svd_steps'),
        (dict(rank=2, projection='random', svd_steps=2.5), {}, 'svd_steps'),
        ({}, dict(lr=-1.0), 'invalid AdamW settings'),
        ({}, dict(betas=(0.9, 1.0)), 'invalid AdamW settings'),
        ({}, dict(weight_decay=-0.1), 'invalid AdamW settings'),
        ({}, dict(convention='transformers'), 'convention must be one of'),
    ],
)
def test_invalid_settings(group, kwargs, message):
    p = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(ValueError, match=message):
        galore.GaLoreAdamW([{'params': [p], **group}], **kwargs)


# --- master=True: fp32 master weights of bf16 parameters (optim.MasterWeights, shared with MasterAdamW)

MASTER_SHAPES = [(6, 4), (4, 6), (4,)]  # right and left projections, and a plain-AdamW bias


def master_groups(params, projection):
    # refreshes at steps 0, 2, 4; GoLore uses SVD at 0 and random bases (re-projecting exp_avg) after
    return [
        {
            'params': params[:2],
            'rank': 2,
            'update_proj_gap': 2,
            'scale': SCALE,
            'projection': projection,
            'svd_steps': 2,
        },
        {'params': params[2:], 'weight_decay': 0.0},
    ]


def master_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in MASTER_SHAPES]


def master_grads(n_steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).bfloat16() for s in MASTER_SHAPES] for _ in range(n_steps)]


def run_steps(opt, params, steps):
    for gs in steps:
        for p, g in zip(params, gs):
            p.grad = None if g is None else g.to(p.dtype)  # bf16 grads widened exactly for fp32 params
        opt.step()


def make_master(params, projection, **kwargs):
    return galore.GaLoreAdamW(
        master_groups(params, projection), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, seed=7, master=True, **kwargs
    )


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert (
            (torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype)
            if torch.is_tensor(a[key])
            else a[key] == b[key]
        ), key


@pytest.mark.parametrize('projection', ['svd', 'random'])
def test_master_is_the_fp32_galore_trajectory(projection):
    # the master follows GaLoreAdamW on fp32 weights (bf16 initial weights widened) fed the widened
    # bf16 grads, bit for bit: same fp32 ops on the same inputs; the bf16 weight is its rounding
    ours, ref = master_params(torch.bfloat16), master_params(torch.bfloat16)
    ref = [torch.nn.Parameter(q.detach().float()) for q in ref]
    opt = make_master(ours, projection)
    fp32 = galore.GaLoreAdamW(master_groups(ref, projection), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, seed=7)
    steps = master_grads(5)
    run_steps(opt, ours, steps)
    run_steps(fp32, ref, steps)
    for p, q in zip(ours, ref):
        state, kept = opt.state[p], fp32.state[q]
        assert p.dtype == torch.bfloat16
        assert torch.equal(state['master'], q) and torch.equal(p, q.bfloat16())
        assert_same_state({k: v for k, v in state.items() if k != 'master'}, kept)  # moments, projector fp32
    assert not torch.equal(opt.state[ours[0]]['master'], ours[0].float())  # bits bf16 drops are kept


def test_master_false_keeps_bf16_state():
    # without masters nothing changes: pure bf16 state, updated in place on the bf16 weight
    params = master_params(torch.bfloat16)
    opt = galore.GaLoreAdamW(master_groups(params, 'svd'), lr=LR)
    run_steps(opt, params, master_grads(2))
    for state in opt.state.values():
        assert 'master' not in state
        assert {v.dtype for v in state.values() if torch.is_tensor(v)} == {torch.bfloat16}
    with pytest.raises(ValueError, match='needs master=True'):
        galore.GaLoreAdamW(master_groups(master_params(torch.bfloat16), 'svd'), master_device='cpu')


def test_master_device_cpu_placement():
    # on CPU parameters master_device='cpu' is their own device: same state as None, unpinned;
    # where another device type would go is MasterWeights.master_home's rule, shared with MasterAdamW
    params, same = master_params(torch.bfloat16), master_params(torch.bfloat16)
    opt, ref = make_master(params, 'random', master_device='cpu'), make_master(same, 'random')
    steps = master_grads(3)
    run_steps(opt, params, steps)
    run_steps(ref, same, steps)
    for p, q in zip(params, same):
        assert torch.equal(p, q)
        assert_same_state(opt.state[p], ref.state[q])
        tensors = [v for v in opt.state[p].values() if torch.is_tensor(v)]
        assert all(v.device.type == 'cpu' and v.dtype == torch.float32 and not v.is_pinned() for v in tensors)
    meta = torch.empty(2, 2, device='meta')
    assert opt.master_home(meta) == torch.device('cpu') and ref.master_home(meta) == meta.device


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
@pytest.mark.parametrize('projection', ['svd', 'random'])
def test_cpu_master_of_cuda_params(projection):
    # CPU masters of CUDA weights: the CPU run's arithmetic bit for bit, every state tensor
    # (projector included) pinned fp32 on the CPU, also after a checkpoint round trip
    on_gpu, on_cpu = (
        [torch.nn.Parameter(p.detach().cuda()) for p in master_params(torch.bfloat16)],
        master_params(torch.bfloat16),
    )
    opt, ref = make_master(on_gpu, projection, master_device='cpu'), make_master(on_cpu, projection)
    steps = master_grads(5)
    run_steps(opt, on_gpu, [[g.cuda() for g in gs] for gs in steps[:3]])
    run_steps(ref, on_cpu, steps[:3])
    opt.load_state_dict(torch.load(save(opt), weights_only=True, map_location='cuda'))
    run_steps(opt, on_gpu, [[g.cuda() for g in gs] for gs in steps[3:]])
    run_steps(ref, on_cpu, steps[3:])
    for p, q in zip(on_gpu, on_cpu):
        assert p.is_cuda and torch.equal(p.cpu(), q)
        assert_same_state(opt.state[p], ref.state[q])
        tensors = [v for v in opt.state[p].values() if torch.is_tensor(v)]
        assert all(not v.is_pinned() and v.dtype == torch.float32 for v in tensors)  # staged: pageable masters


def save(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize('projection', ['svd', 'random'])
def test_master_state_dict_round_trip_is_exact(projection):
    # torch's Optimizer.load_state_dict would cast fp32 masters, moments and projectors to bf16
    steps = master_grads(6)
    for s in steps[:3]:
        s[2] = None  # a frozen parameter: no state, a gap in the saved numbering
    a = master_params(torch.bfloat16)
    opt_a = make_master(a, projection)
    run_steps(opt_a, a, steps[:3])
    saved = torch.load(save(opt_a), weights_only=True)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = make_master(b, projection)
    opt_b.load_state_dict(saved)
    assert b[2] not in opt_b.state
    for p, q in zip(a[:2], b[:2]):
        assert {v.dtype for v in opt_b.state[q].values() if torch.is_tensor(v)} == {torch.float32}
        assert_same_state(opt_a.state[p], opt_b.state[q])
    run_steps(opt_a, a, steps[3:])  # through a refresh (step 4) and the frozen parameter's first step
    run_steps(opt_b, b, steps[3:])
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert_same_state(opt_a.state[p], opt_b.state[q])


@pytest.mark.parametrize('projection', ['svd', 'random'])
def test_dropped_master_restarts_from_the_bf16_weight(projection):
    # omgd's 'drop' deletes optimizer.state[p]; the next step starts from the bf16 weight widened:
    # a fresh fp32 GaLoreAdamW on that weight, one step (SVD projector at step 0, zero moments)
    params = master_params(torch.bfloat16)
    opt = make_master(params, projection)
    steps = master_grads(4)
    run_steps(opt, params, steps[:3])
    for i in (0, 2):
        del opt.state[params[i]]
    refs = [torch.nn.Parameter(p.detach().float()) for p in params]
    fresh = galore.GaLoreAdamW(master_groups(refs, projection), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, seed=7)
    run_steps(fresh, refs, [[g if i in (0, 2) else None for i, g in enumerate(steps[3])]])
    run_steps(opt, params, steps[3:])
    for i in (0, 2):
        p, q = params[i], refs[i]
        assert opt.state[p]['step'] == 1 and torch.equal(opt.state[p]['master'], q)
        assert_same_state({k: v for k, v in opt.state[p].items() if k != 'master'}, fresh.state[q])
        assert torch.equal(p, q.bfloat16())
    assert opt.state[params[1]]['step'] == 4


def test_master_accounting_counts_master_and_moments_not_projector():
    params = master_params(torch.bfloat16)
    opt = make_master(params, 'svd')
    run_steps(opt, params, [[g if i != 1 else None for i, g in enumerate(gs)] for gs in master_grads(2)])
    # (6, 4): fp32 master 24 + moments 2 x (6 x 2); bias (4,): master 4 + moments 2 x 4; projector 4 x 2
    sizes = memory_estimate.memory_bytes(torch.nn.ParameterList(params), opt)
    assert sizes['optimizer'] == 4 * (24 + 2 * 12 + 4 + 2 * 4)
    assert sizes['params'] == 2 * (24 + 24 + 4)
    assert sorted(k for _, k, _ in memory_estimate.state_tensors(opt)) == sorted(
        ['master', 'exp_avg', 'exp_avg_sq'] * 2
    )
    assert galore.projector_bytes(opt) == 4 * 8


def test_build_optimizer_master():
    model = tiny_gpt()
    opt = galore.build_optimizer(model, 0.1, 1e-3, (0.9, 0.95), rank=4, master=True, master_device='cpu')
    assert opt.master and opt.master_device == torch.device('cpu')
    assert not galore.build_optimizer(model, 0.1, 1e-3, (0.9, 0.95), rank=4).master
