"""omgd.py: the LISA-wor pool, tensor masks, freezing, optimizer-state policies and prefetch,
scaling, resume."""

import io
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import memory_estimate  # noqa: E402
import omgd  # noqa: E402
from model import Transformer, TransformerConfig  # noqa: E402
from optim import param_groups  # noqa: E402


def tiny_gpt(n_layer=6, seed=0):
    torch.manual_seed(seed)
    return Transformer(TransformerConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=8, vocab_size=32, bias=False))


def batch(seed=0, size=4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (size, 8), generator=g)
    return x, torch.roll(x, -1, dims=1)


def unit_params(n):
    units = [[torch.nn.Parameter(torch.zeros(1))] for _ in range(n)]
    return units, torch.optim.SGD([p for u in units for p in u], lr=0.1)


def draws(method, n_units, gamma, periods, seed=0, ratio=0.5):
    units, opt = unit_params(n_units)
    cycler = omgd.Cycler(units, opt, omgd.CyclerConfig(method, gamma=gamma, period=1, ratio=ratio, seed=seed))
    out = []
    for it in range(periods):
        cycler.step(it)
        out.append((cycler.schedule.partitions_drawn, tuple(cycler.active)))
    return out


@pytest.mark.parametrize('method', ['lisa_wor', 'lisa_wor_noscale'])
@pytest.mark.parametrize('n, gamma', [(12, 3), (12, 4), (6, 6), (12, 5), (7, 3), (5, 2), (7, 4)])
def test_lisa_wor_cycle_masks_sum_to_M_ones_only_when_gamma_divides(method, n, gamma):
    units, opt = unit_params(n)
    cycler = omgd.Cycler(units, opt, omgd.CyclerConfig(method, gamma=gamma, period=1))
    leftover, cycles = n % gamma, {}
    for it in range(30 * (n // gamma)):
        cycler.step(it)
        mask = torch.zeros(n)
        mask[cycler.active] = cycler.scaling()
        cycles.setdefault(cycler.schedule.partitions_drawn, []).append(mask)
    scale = n / gamma if method == 'lisa_wor' else 1.0
    for masks in cycles.values():
        assert len(masks) == n // gamma
        total = sum(masks)
        assert (total == 0).sum() == leftover  # exactly N_L mod gamma blocks sit out the cycle ...
        assert torch.equal(total[total != 0], torch.full((n - leftover,), scale))  # ... the others train once
    note = cycler.cycle_note()
    if leftover == 0:
        assert note is None
    else:
        s = 's sit' if leftover > 1 else ' sits'
        assert note == (
            f"{method} with N_L={n}, gamma={gamma}: N_L mod gamma = {leftover} random block{s} out "
            f"each cycle, so a cycle's masks do not sum to M x 1 (Algorithm 1 holds only when gamma "
            f"divides N_L)"
        )


def test_cycle_note_only_for_lisa_wor_methods():
    units, opt = unit_params(5)
    for method in omgd.METHODS:
        note = omgd.Cycler(units, opt, omgd.CyclerConfig(method, gamma=2)).cycle_note()
        assert (note is not None) == (method in ('lisa_wor', 'lisa_wor_noscale')), method


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
    windows = [seq[i : i + 4] for i in range(0, 200, 4)]
    overlapping = sum(len(set().union(*w)) < 12 for w in windows)
    assert overlapping > len(windows) // 2  # without replacement this would be 0
    counts = torch.zeros(12)
    for s in seq:
        counts[list(s)] += 1
    assert counts.min() > 20  # every block is drawn, roughly uniformly (mean 50)


def test_tensor_wor_groups_are_complementary_and_balanced():
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters())
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('tensor_wor', ratio=0.5, period=1))
    n = len(cycler.units)
    cycler.step(0)
    first = set(cycler.active)
    cycler.step(1)
    second = set(cycler.active)
    assert first.isdisjoint(second) and first | second == set(range(n))
    sizes = [sum(cycler.units[i][0].numel() for i in s) for s in (first, second)]
    assert abs(sizes[0] - sizes[1]) <= max(p.numel() for p in model.parameters())
    assert cycler.scaling() == 2.0


def test_tensor_iid_draws_fresh_nonempty_sets_each_period():
    model = tiny_gpt(n_layer=4)
    config = omgd.CyclerConfig('tensor_iid', ratio=0.3, period=1)
    cycler = omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), config)
    n = len(cycler.units)
    seen = set()
    for it in range(20):
        cycler.step(it)
        assert 0 < len(cycler.active) <= n
        seen.add(tuple(cycler.active))
    assert len(seen) > 10  # fresh draws, not a cycle of fixed groups
    assert cycler.scaling() == (1 - 0.7**n) / 0.3  # 1/r, corrected for the redrawn empty set


def gpt2_tensor_sizes():
    """numel of GPT-2 124M's 148 tensors; the head is tied to the 38.6M-element embedding."""
    d = 768
    block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return [50257 * d, 1024 * d] + block * 12 + [d, d]


@pytest.mark.parametrize('sizes', [gpt2_tensor_sizes(), [5, 1, 1000]], ids=['gpt2', 'three'])
def test_tensor_iid_mask_is_unbiased_for_every_tensor(sizes):
    """E[S] = 1 for every tensor. The old shortest-prefix draw gave GPT-2's embedding 1.44 (and the
    1000-element tensor of 'three' 2.0); redrawing empty sets but scaling by 1/r gives 'three' 8/7."""
    ratio, n_draws = 0.5, 20000
    units = [[torch.nn.Parameter(torch.empty(size, device='meta'))] for size in sizes]  # sizes, no memory
    cycler = omgd.Cycler(units, torch.optim.SGD([u[0] for u in units]), omgd.CyclerConfig('tensor_iid', ratio=ratio))
    cycler.step(0)
    kept = list(cycler.active)
    for _ in range(n_draws - 1):
        kept += cycler.schedule.next()  # what step() applies, without touching 148 parameters a draw
    mean_S = torch.bincount(torch.tensor(kept), minlength=len(sizes)) * cycler.scaling() / n_draws
    # S is c * Bernoulli(q), q = P(kept | not empty), c q = 1 if unbiased: Var S = (1 - q) / q.
    # 5 standard errors: a false alarm on any of 148 tensors has probability < 1e-4.
    q = ratio / (1 - (1 - ratio) ** len(sizes))
    tolerance = 5 * math.sqrt((1 - q) / q / n_draws)  # 0.035 for GPT-2
    assert (mean_S - 1).abs().max().item() < tolerance, mean_S


def test_frozen_parameters_bitwise_unchanged_and_without_grad():
    model = tiny_gpt()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=1))
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
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=1, state='drop'))
    for it in range(50):
        cycler.step(it)
        x, y = batch(it)
        model(x, y)[1].backward()
        opt.step()
        active = active_param_ids(model, cycler)
        assert {id(p) for p in opt.state} == active
        need = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in active)
        used = memory_estimate.memory_bytes(model, opt)
        assert used['grads'] == need and used['optimizer'] == per_param * need
        counted = [(id(p), key) for p, key, _ in memory_estimate.state_tensors(opt)]  # 'step' is left out
        assert sorted(counted) == sorted((i, k) for i in active for k in keys)
        opt.zero_grad(set_to_none=True)


def offload_run(device):
    """Warm every block's AdamW state, freeze blocks 2 and 3 for three steps, then swap."""
    model = tiny_gpt(n_layer=4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=1, state='offload'))
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
        assert p in cycler.optimizer_state.offloaded and not p.requires_grad
        assert torch.equal(p, w)  # neither the weight ...
        assert all(torch.equal(opt.state[p][k].cpu(), saved[p][k].cpu()) for k in saved[p])  # ... nor its state moved
    cycler.apply([2, 3])
    if device == 'cuda':
        torch.cuda.synchronize()  # the copy back is non_blocking
    for p in frozen:
        assert p not in cycler.optimizer_state.offloaded and p.requires_grad
        assert all(opt.state[p][k].device == saved[p][k].device for k in saved[p])
        assert all(torch.equal(opt.state[p][k], saved[p][k]) for k in saved[p])
    return parked


def test_offload_keeps_state_of_frozen_blocks_through_optimizer_steps():
    offload_run('cpu')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA: on CPU nothing is moved')
def test_offload_parks_state_on_cpu_and_restores_it_to_cuda_bitwise():
    parked = offload_run('cuda')
    assert all(device == 'cpu' for keys in parked.values() for device in keys.values())


@pytest.mark.parametrize('method', ['lisa', 'lisa_wor', 'tensor_wor', 'tensor_iid'])
def test_prefetch_draws_the_same_groups_as_not_prefetching(method):
    def run(prefetch):
        units, opt = unit_params(7)  # lisa_wor: gamma=2 leaves one out, the pool empties every 3rd period
        cycler = omgd.Cycler(units, opt, omgd.CyclerConfig(method, gamma=2, period=3, warmup=2, ratio=0.3, seed=1))
        seq = []
        for it in range(150):
            cycler.step(it)
            if prefetch:
                cycler.prefetch(it)
            seq.append((tuple(cycler.active), cycler.scaling(), cycler.describe()))
        return seq

    assert run(True) == run(False)


def make_cycling(method, policy, n_layer=6, device='cpu'):
    model = tiny_gpt(n_layer=n_layer).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    config = omgd.CyclerConfig(method, gamma=2, period=2, ratio=0.5, state=policy, seed=3)
    return model, opt, omgd.build_cycler(model, opt, config)


def run_cycling(model, opt, cycler, iters, prefetch=True, check=None):
    """train.py's loop: step, prefetch, forward/backward, scale, optimizer step."""
    for it in iters:
        cycler.step(it)
        if prefetch:
            cycler.prefetch(it)
        if check:
            check(it)
        model(*(t.to(next(model.parameters()).device) for t in batch(it)))[1].backward()
        cycler.scale_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)


def assert_same_training(a, b):
    (model_a, opt_a), (model_b, opt_b) = a, b
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state.get(pb, {})
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize('method', ['lisa_wor', 'lisa', 'tensor_iid'])
def test_offload_with_prefetch_trains_bitwise_like_keep(method):
    runs = []
    for policy in ('keep', 'offload'):
        model, opt, cycler = make_cycling(method, policy)
        run_cycling(model, opt, cycler, range(15))  # 8 switches
        runs.append((model, opt))
    # every unit trained and parked
    assert cycler.optimizer_state.offloaded and len(opt.state) == len(list(model.parameters()))
    assert_same_training(*runs)


def test_offload_prefetch_moves_exactly_the_next_groups_state():
    model, opt, cycler = make_cycling('lisa_wor', 'offload', n_layer=4)
    blocks = {p: i for i, b in enumerate(model.blocks) for p in b.parameters()}
    seen = {'copies': {}, 'checked': 0}

    states = cycler.optimizer_state

    def check(it):
        for p, copies in seen['copies'].items():  # the switch installed last iteration's copies ...
            assert all(opt.state[p][k] is t for k, t in copies.items())
            assert blocks[p] in cycler.active
        frozen = {p for p, i in blocks.items() if i not in cycler.active}
        assert set(states.offloaded) == {p for p in frozen if p in opt.state}  # ... parked: exactly the frozen
        if it % 2 == 1:  # the last iteration of a period: copies of the next group's parked state
            after_switch = set(cycler.schedule.peek())
            assert set(states.prefetched) == {p for p in states.offloaded if blocks[p] in after_switch}
            for p, copies in states.prefetched.items():
                assert copies.keys() == {'exp_avg', 'exp_avg_sq'}  # the moments; 'step' is a scalar
                for key, t in copies.items():
                    assert torch.equal(t, opt.state[p][key]) and t.data_ptr() != opt.state[p][key].data_ptr()
            seen['checked'] += bool(states.prefetched)
        else:
            assert not states.prefetched
        seen['copies'] = dict(states.prefetched)

    run_cycling(model, opt, cycler, range(40), check=check)
    assert seen['checked'] >= 15  # after the first cycle, every switch brings back parked state


@pytest.mark.parametrize('method', ['lisa_wor', 'lisa'])
def test_state_dict_round_trip_after_the_pre_draw_resumes_bitwise(method):
    straight = make_cycling(method, 'offload')
    run_cycling(*straight, range(16))
    first = make_cycling(method, 'offload')
    run_cycling(*first, range(6))  # iteration 5 ends a period (and a lisa_wor cycle): the next group is drawn
    assert first[2].schedule.ahead is not None
    buffer = io.BytesIO()
    torch.save({'model': first[0].state_dict(), 'opt': first[1].state_dict(), 'cycler': first[2].state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = make_cycling(method, 'offload')
    resumed[0].load_state_dict(checkpoint['model'])
    resumed[1].load_state_dict(checkpoint['opt'])
    resumed[2].load_state_dict(checkpoint['cycler'])
    run_cycling(*resumed, range(6, 16))
    assert (
        resumed[2].state_dict()['schedule']['partitions_drawn']
        == straight[2].state_dict()['schedule']['partitions_drawn']
    )
    assert_same_training(straight[:2], resumed[:2])


def test_a_cycler_state_written_with_the_old_key_cycle_resumes_the_same():
    """Checkpoints written before the schedule's count was saved as 'partitions_drawn' name it 'cycle'."""
    straight = make_cycling('lisa_wor', 'drop')
    run_cycling(*straight, range(16))
    first = make_cycling('lisa_wor', 'drop')
    run_cycling(*first, range(7))
    state = first[2].state_dict()
    state['schedule']['cycle'] = state['schedule'].pop('partitions_drawn')
    resumed = make_cycling('lisa_wor', 'drop')
    resumed[0].load_state_dict(first[0].state_dict())
    resumed[1].load_state_dict(first[1].state_dict())
    resumed[2].load_state_dict(state)
    assert resumed[2].schedule.partitions_drawn == first[2].schedule.partitions_drawn > 0
    run_cycling(*resumed, range(7, 16))
    assert resumed[2].describe() == straight[2].describe()
    assert_same_training(straight[:2], resumed[:2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA: copies on a side stream')
def test_prefetch_copies_on_a_side_stream_and_the_switch_installs_them():
    model, opt, cycler = make_cycling('lisa_wor', 'offload', n_layer=4, device='cuda')
    device = next(model.parameters()).device
    seen = {'copies': {}, 'checked': 0}

    states = cycler.optimizer_state

    def check(it):
        for p, copies in seen['copies'].items():
            assert all(opt.state[p][k] is t and t.is_cuda for k, t in copies.items())
        if states.prefetched:
            assert states.copies[device].stream != torch.cuda.current_stream(device)
            states.prefetch_done[device].synchronize()  # only so this test can read them
            for p, copies in states.prefetched.items():
                for key, t in copies.items():
                    parked = opt.state[p][key]
                    assert t.is_cuda and parked.device.type == 'cpu' and parked.is_pinned()
                    assert torch.equal(t.cpu(), parked)
            seen['checked'] += 1
        seen['copies'] = dict(states.prefetched)

    run_cycling(model, opt, cycler, range(40), check=check)
    torch.cuda.synchronize()
    assert seen['checked'] >= 15


def test_keep_policy_keeps_state():
    model = tiny_gpt(n_layer=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=1, period=1, state='keep'))
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
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=1, period=1))
    cycler.apply([3])
    before = [p.detach().clone() for p in model.blocks[3].parameters()]
    model(*batch())[1].backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.blocks[3].parameters()))
    trainable_only = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match='must be in the optimizer'):
        omgd.build_cycler(model, trainable_only, omgd.CyclerConfig('lisa_wor', gamma=1, period=1))


def test_active_gradients_are_scaled_by_NL_over_gamma():
    model = tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=1))
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
    noscale = omgd.build_cycler(other, torch.optim.SGD(other.parameters()), omgd.CyclerConfig('lisa_wor_noscale', 2, 1))
    noscale.step(0)
    assert noscale.scaling() == 1.0


def test_gradient_accumulation_matches_one_large_batch_and_scale_does_not_compound():
    x, y = batch(size=8)
    updated = []
    for accum in (1, 4):
        model = tiny_gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=2, period=1, seed=3))
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
    config = omgd.CyclerConfig('lisa_wor', gamma=2, period=5, warmup=10)
    cycler = omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), config)
    switches = [it for it in range(30) if cycler.step(it)]
    assert switches == [10, 15, 20, 25]
    assert len(cycler.active) == 2


def test_state_dict_round_trip_resumes_the_same_sequence():
    def make():
        model = tiny_gpt()
        config = omgd.CyclerConfig('lisa_wor', gamma=2, period=3, seed=7)
        return omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), config)

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
        lisa = omgd.build_cycler(other, torch.optim.AdamW(other.parameters()), omgd.CyclerConfig('lisa', gamma=2))
        lisa.load_state_dict(state)


def test_same_seed_same_draws_different_seed_different_draws():
    assert draws('lisa_wor', 12, 3, 20, seed=5) == draws('lisa_wor', 12, 3, 20, seed=5)
    assert draws('lisa_wor', 12, 3, 20, seed=5) != draws('lisa_wor', 12, 3, 20, seed=6)
    # the selection generator is independent of the global RNG (data order, dropout)
    torch.manual_seed(0)
    a = draws('lisa', 12, 3, 10, seed=1)
    torch.manual_seed(99)
    assert draws('lisa', 12, 3, 10, seed=1) == a


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(method='lisa_wor', gamma=0), 'omgd_gamma'),
        (dict(method='lisa_wor', gamma=7), 'omgd_gamma'),
        (dict(method='lisa_wor', gamma=2, period=0), 'omgd_period'),
        (dict(method='tensor_wor', ratio=0.0), 'omgd_ratio'),
        (dict(method='tensor_iid', ratio=1.5), 'omgd_ratio'),
        (dict(method='lisa_wr'), 'unknown method'),
        (dict(method='lisa', gamma=1, state='free'), 'omgd_state'),
        (dict(method='lisa_wor', gamma=2, warmup=-1), 'omgd_warmup must be >= 0'),
        (dict(method='lisa_wor', gamma=2, always=('embed', 'lm_head')), r'unknown omgd_always part\(s\)'),
        (dict(method='tensor_wor', always=('embed', 'pos', 'norm')), 'omgd_always must be'),
    ],
)
def test_bad_config_gives_clear_error(kwargs, message):
    model = tiny_gpt()
    with pytest.raises(ValueError, match=message):
        omgd.build_cycler(model, torch.optim.AdamW(model.parameters()), omgd.CyclerConfig(**kwargs))


def test_tensor_methods_accept_every_outer_part_of_the_model():
    model = Transformer(TransformerConfig(arch='llama', n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    opt = torch.optim.AdamW(model.parameters())
    # no 'pos' in llama
    cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('tensor_iid', period=1, always=('embed', 'norm', 'head')))
    assert len(cycler.units) == len(list(model.parameters()))
    with pytest.raises(ValueError, match='omgd_always must be embed,norm,head'):
        omgd.build_cycler(model, opt, omgd.CyclerConfig('tensor_iid', always=('embed', 'norm')))


def test_per_block_compile_no_recompile_storm_and_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    models, cyclers, opts = [], [], []
    for compiled in (False, True):
        model = tiny_gpt(n_layer=12)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=3, period=1))
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
