"""omgd.py: mask cycles, the LISA-wor pool, freezing, optimizer-state policies, scaling, resume."""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import omgd  # noqa: E402
from model import GPT, GPTConfig, param_groups  # noqa: E402


def tiny_gpt(n_layer=6, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=8, vocab_size=32, bias=False))


def batch(seed=0, size=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (size, 8), generator=g)
    return x, torch.roll(x, -1, dims=1)


def draws(method, n_units, gamma, periods, seed=0, ratio=0.5):
    units = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(n_units)]
    opt = torch.optim.SGD([p for u in units for p in u], lr=0.1)
    cycler = omgd.LayerCycler(units, opt, method, gamma=gamma, period=1, ratio=ratio, seed=seed)
    out = []
    for it in range(periods):
        cycler.step(it)
        out.append((cycler.schedule.cycle, tuple(cycler.active)))
    return out


def test_lisa_wor_cycle_activates_every_block_once_when_gamma_divides():
    seq = draws('lisa_wor', 12, 3, 40)
    for cycle in range(1, 10):
        groups = [active for c, active in seq if c == cycle]
        assert len(groups) == 4
        flat = [b for g in groups for b in g]
        assert sorted(flat) == list(range(12))


def test_lisa_wor_reset_rule_when_gamma_does_not_divide():
    # N_L=5, gamma=2: two draws use 4 blocks, 1 is left < gamma, so the pool resets
    seq = draws('lisa_wor', 5, 2, 30)
    cycles = [c for c, _ in seq]
    assert cycles == [1 + i // 2 for i in range(30)]
    for cycle in set(cycles):
        groups = [set(a) for c, a in seq if c == cycle]
        assert len(groups[0] | groups[1]) == 4  # disjoint within a cycle
    # over many cycles, the left-out block varies (every block gets its turn)
    left_out = {next(iter(set(range(5)) - set(seq[2 * k][1]) - set(seq[2 * k + 1][1]))) for k in range(15)}
    assert len(left_out) > 1


def test_lisa_draws_are_iid_and_repeat_within_a_cycle_length():
    seq = [set(a) for _, a in draws('lisa', 12, 3, 200)]
    assert all(len(s) == 3 for s in seq)
    windows = [seq[i:i + 4] for i in range(0, 200, 4)]
    overlapping = sum(len(set().union(*w)) < 12 for w in windows)
    assert overlapping > len(windows) // 2  # without replacement this would be 0
    counts = torch.zeros(12)
    for s in seq:
        counts[list(s)] += 1
    assert counts.min() > 20  # every block is drawn, roughly uniformly (mean 50)


def test_mask_cycle_sums_to_M_ones_and_pair_order_covers_product_once():
    g = torch.Generator().manual_seed(0)
    for d, ratio in [(10, 0.5), (10, 0.3), (7, 1.0), (13, 0.25)]:
        masks = omgd.mask_cycle(d, ratio, g)
        M = math.ceil(1 / ratio)
        assert masks.shape == (M, d)
        assert torch.equal(masks.sum(0), torch.full((d,), float(M)))
        assert torch.equal((masks > 0).sum(0), torch.ones(d, dtype=torch.long))  # disjoint
    order = omgd.pair_order(3, 5, g)
    assert order.shape == (15, 2)
    assert sorted(map(tuple, order.tolist())) == [(j, i) for j in range(3) for i in range(5)]


def test_tensor_wor_groups_are_complementary_and_balanced():
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters())
    cycler = omgd.build_cycler(model, opt, 'tensor_wor', ratio=0.5, period=1)
    n = len(cycler.units)
    cycler.step(0)
    first = set(cycler.active)
    cycler.step(1)
    second = set(cycler.active)
    assert first.isdisjoint(second) and first | second == set(range(n))
    sizes = [sum(cycler.units[i][0].numel() for i in s) for s in (first, second)]
    assert abs(sizes[0] - sizes[1]) <= max(p.numel() for p in model.parameters())
    assert cycler.scaling() == 2.0


def test_tensor_iid_draws_a_fresh_fraction_r_each_period():
    model = tiny_gpt(n_layer=4)
    cycler = omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), 'tensor_iid', ratio=0.3, period=1)
    numels = [u[0].numel() for u in cycler.units]
    total, largest = sum(numels), max(numels)
    draws_ = []
    for it in range(20):
        cycler.step(it)
        active = sum(numels[i] for i in cycler.active)
        assert 0.3 * total <= active < 0.3 * total + largest
        draws_.append(tuple(cycler.active))
    assert len(set(draws_)) > 10  # fresh draws, not a cycle of fixed groups
    assert cycler.scaling() == pytest.approx(1 / 0.3)


def test_frozen_parameters_bitwise_unchanged_and_without_grad():
    model = tiny_gpt()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=2, period=1)
    for it in range(3):
        cycler.step(it)
        frozen = [i for i in range(6) if i not in cycler.active]
        before = [p.detach().clone() for i in frozen for p in model.blocks[i].parameters()]
        active_before = [p.detach().clone() for i in cycler.active for p in model.blocks[i].parameters()]
        x, y = batch(it)
        model(x, y)[1].backward()
        cycler.scale_grads()
        opt.step()
        after = [p for i in frozen for p in model.blocks[i].parameters()]
        assert all(p.grad is None and not p.requires_grad for p in after)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
        changed = [p for i in cycler.active for p in model.blocks[i].parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(active_before, changed))
        opt.zero_grad(set_to_none=True)


def active_param_ids(model, cycler):
    outer = {id(p) for part in model.outer_modules().values() for p in part.parameters()}  # default always
    return outer | {id(p) for i in cycler.active for p in model.blocks[i].parameters()}


@pytest.mark.parametrize('optim', ['adamw', 'sgd'])
def test_drop_holds_state_only_for_active_and_memory_does_not_grow(optim):
    model = tiny_gpt()
    if optim == 'adamw':
        opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
        keys = ('exp_avg', 'exp_avg_sq')
    else:
        opt = torch.optim.SGD(param_groups(model, 0.1), lr=1e-2, momentum=0.9)
        keys = ('momentum_buffer',)
    per_param = len(keys)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=2, period=1, state_policy='drop')
    for it in range(50):
        cycler.step(it)
        x, y = batch(it)
        model(x, y)[1].backward()
        opt.step()
        active = active_param_ids(model, cycler)
        assert {id(p) for p in opt.state} == active
        need = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in active)
        used = omgd.memory_bytes(model, opt)
        assert used['grads'] == need and used['optimizer'] == per_param * need
        counted = [(id(p), key) for p, key, _ in omgd.state_tensors(opt)]  # 'step' is left out
        assert sorted(counted) == sorted((i, k) for i in active for k in keys)
        opt.zero_grad(set_to_none=True)


def offload_run(device):
    """Warm every block's AdamW state, freeze blocks 2 and 3 for three steps, then swap."""
    model = tiny_gpt(n_layer=4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=2, period=1, state_policy='offload')
    x, y = (t.to(device) for t in batch())
    model(x, y)[1].backward()
    opt.step()  # warm state for every block (nothing is frozen before the first switch)
    opt.zero_grad(set_to_none=True)
    frozen = [p for i in (2, 3) for p in model.blocks[i].parameters()]
    saved = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in frozen}
    weights = [p.detach().clone() for p in frozen]
    cycler.apply([0, 1])
    parked = {p: {k: v.device.type for k, v in opt.state[p].items() if v.dim() > 0} for p in frozen}
    for _ in range(3):  # the optimizer steps while they are frozen
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for p, w in zip(frozen, weights):
        assert p in cycler.offloaded and not p.requires_grad
        assert torch.equal(p, w)  # neither the weight ...
        assert all(torch.equal(opt.state[p][k].cpu(), saved[p][k].cpu()) for k in saved[p])  # ... nor its state moved
    cycler.apply([2, 3])
    if device == 'cuda':
        torch.cuda.synchronize()  # the copy back is non_blocking
    for p in frozen:
        assert p not in cycler.offloaded and p.requires_grad
        assert all(opt.state[p][k].device == saved[p][k].device for k in saved[p])
        assert all(torch.equal(opt.state[p][k], saved[p][k]) for k in saved[p])
    return parked


def test_offload_keeps_state_of_frozen_blocks_through_optimizer_steps():
    offload_run('cpu')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA: on CPU nothing is moved')
def test_offload_parks_state_on_cpu_and_restores_it_to_cuda_bitwise():
    parked = offload_run('cuda')
    assert all(device == 'cpu' for keys in parked.values() for device in keys.values())


def test_keep_policy_keeps_state():
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=1, period=1, state_policy='keep')
    model(*batch())[1].backward()
    opt.step()
    cycler.step(0)
    assert len(opt.state) == len(list(model.parameters()))


def test_parameters_frozen_when_the_optimizer_was_built_still_train():
    """LMFlow's bug: an optimizer built while blocks were frozen never trains them."""
    model = tiny_gpt(n_layer=4)
    for p in model.blocks[3].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-2)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=1, period=1)
    cycler.apply([3])
    before = [p.detach().clone() for p in model.blocks[3].parameters()]
    model(*batch())[1].backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.blocks[3].parameters()))
    trainable_only = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match='must be in the optimizer'):
        omgd.build_cycler(model, trainable_only, 'lisa_wor', gamma=1, period=1)


def test_active_gradients_are_scaled_by_NL_over_gamma():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=2, period=1)
    cycler.step(0)
    model(*batch())[1].backward()
    raw = {p: p.grad.clone() for p in model.parameters() if p.grad is not None}
    cycler.scale_grads()
    active = {id(p) for i in cycler.active for p in model.blocks[i].parameters()}
    assert cycler.scaling() == 3.0
    for p, g in raw.items():
        expected = g * 3.0 if id(p) in active else g  # outer parts are not scaled
        assert torch.equal(p.grad, expected)
    other = tiny_gpt()
    noscale = omgd.build_cycler(other, torch.optim.SGD(other.parameters()), 'lisa_wor_noscale', gamma=2)
    noscale.step(0)
    assert noscale.scaling() == 1.0


def test_gradient_accumulation_matches_one_large_batch_and_scale_does_not_compound():
    x, y = batch(size=8)
    updated = []
    for accum in (1, 4):
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=2, period=1, seed=3)
        cycler.step(0)
        chunks = list(zip(x.chunk(accum), y.chunk(accum)))
        micro = []  # each micro-step's gradient on its own, unscaled
        for xs, ys in chunks:
            (model(xs, ys)[1] / accum).backward()
            micro.append({p: p.grad.clone() for p in model.parameters() if p.grad is not None})
            opt.zero_grad(set_to_none=True)
        for xs, ys in chunks:
            (model(xs, ys)[1] / accum).backward()
        cycler.scale_grads()
        in_blocks = {p for b in model.blocks for p in b.parameters()}
        for p in model.parameters():
            if p in in_blocks and not p.requires_grad:
                assert p.grad is None
                continue
            scale = 3.0 if p in in_blocks else 1.0  # N_L / gamma on active blocks; outer parts unscaled
            torch.testing.assert_close(p.grad, sum(m[p] for m in micro) * scale)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        updated.append(([p.detach().clone() for p in model.parameters()], grads))
    for a, b in zip(updated[0][1], updated[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(updated[0][0], updated[1][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_warmup_trains_everything_then_cycles():
    model = tiny_gpt()
    cycler = omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), 'lisa_wor', gamma=2, period=5, warmup=10)
    switches = [it for it in range(30) if cycler.step(it)]
    assert switches == [10, 15, 20, 25]
    assert len(cycler.active) == 2


def test_state_dict_round_trip_resumes_the_same_sequence():
    def make():
        model = tiny_gpt()
        return omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), 'lisa_wor', gamma=2, period=3,
                                 seed=7)
    straight = make()
    seq = []
    for it in range(40):
        straight.step(it)
        seq.append(tuple(straight.active))
    first = make()
    for it in range(17):
        first.step(it)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    assert tuple(resumed.active) == seq[16]
    for it in range(17, 40):
        resumed.step(it)
        assert tuple(resumed.active) == seq[it]
    with pytest.raises(ValueError, match='method'):
        other = tiny_gpt()
        omgd.build_cycler(other, torch.optim.AdamW(other.parameters()), 'lisa', gamma=2).load_state_dict(state)


def test_same_seed_same_draws_different_seed_different_draws():
    assert draws('lisa_wor', 12, 3, 20, seed=5) == draws('lisa_wor', 12, 3, 20, seed=5)
    assert draws('lisa_wor', 12, 3, 20, seed=5) != draws('lisa_wor', 12, 3, 20, seed=6)
    # the selection generator is independent of the global RNG (data order, dropout)
    torch.manual_seed(0)
    a = draws('lisa', 12, 3, 10, seed=1)
    torch.manual_seed(99)
    assert draws('lisa', 12, 3, 10, seed=1) == a


@pytest.mark.parametrize('kwargs, message', [
    (dict(method='lisa_wor', gamma=0), 'omgd_gamma'),
    (dict(method='lisa_wor', gamma=7), 'omgd_gamma'),
    (dict(method='lisa_wor', gamma=2, period=0), 'omgd_period'),
    (dict(method='tensor_wor', ratio=0.0), 'omgd_ratio'),
    (dict(method='tensor_iid', ratio=1.5), 'omgd_ratio'),
    (dict(method='lisa_wr'), 'unknown method'),
    (dict(method='lisa', gamma=1, state_policy='free'), 'omgd_state'),
    (dict(method='lisa_wor', gamma=2, warmup=-1), 'omgd_warmup must be >= 0'),
    (dict(method='lisa_wor', gamma=2, always=('embed', 'lm_head')), r'unknown omgd_always part\(s\)'),
    (dict(method='tensor_wor', always=('embed', 'pos', 'norm')), 'omgd_always must be'),
])
def test_bad_config_gives_clear_error(kwargs, message):
    model = tiny_gpt()
    with pytest.raises(ValueError, match=message):
        omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), **kwargs)


def test_tensor_methods_accept_every_outer_part_of_the_model():
    model = GPT(GPTConfig(arch='llama', n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    opt = torch.optim.AdamW(model.parameters())
    cycler = omgd.build_cycler(model, opt, 'tensor_iid', always=('embed', 'norm', 'head'))  # no 'pos' in llama
    assert len(cycler.units) == len(list(model.parameters()))
    with pytest.raises(ValueError, match='omgd_always must be embed,norm,head'):
        omgd.build_cycler(model, opt, 'tensor_iid', always=('embed', 'norm'))


def test_per_block_compile_no_recompile_storm_and_matches_eager():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    models, cyclers, opts = [], [], []
    for compiled in (False, True):
        model = tiny_gpt(n_layer=12)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cycler = omgd.build_cycler(model, opt, 'lisa_wor', gamma=3, period=1)
        if compiled:
            for block in model.blocks:
                block.compile(backend='aot_eager')  # dynamo's guards do not depend on the backend
        models.append(model), cyclers.append(cycler), opts.append(opt)
    for it in range(30):
        grads = []
        for model, cycler, opt in zip(models, cyclers, opts):
            cycler.step(it)
            model(*batch(it))[1].backward()
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert len(grads[0]) == len(grads[1])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # one graph per block variant (trainable, frozen) over 30 switches, as the README says
    assert counters['stats']['unique_graphs'] == 2
    torch._dynamo.reset()
