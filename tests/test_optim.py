"""optim.py: the shared AdamW arithmetic and MasterAdamW (fp32 masters of low-precision weights)."""

import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import memory_estimate  # noqa: E402
import omgd  # noqa: E402
from infra import optimizer_offload  # noqa: E402
from model import Transformer, TransformerConfig  # noqa: E402
from optim import MasterAdamW, adamw, param_groups  # noqa: E402

LR, BETAS, EPS, WD = 0.01, (0.9, 0.95), 1e-8, 0.1
SHAPES = [(6, 4), (4,), (3, 5), (5,)]  # matrices decay, vectors do not (param_groups' split)


class Net(torch.nn.Module):
    def __init__(self, dtype, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES])


def grads(n_steps, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(n_steps)]


def run(opt, net, steps):
    for gs in steps:
        for p, g in zip(net.parameters(), gs):
            p.grad = None if g is None else g.clone()
        opt.step()


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert (
            (torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype)
            if torch.is_tensor(a[key])
            else a[key] == b[key]
        ), key


def test_fp32_params_are_torch_adamw_bitwise():
    ours, ref = Net(torch.float32), Net(torch.float32)
    opt = MasterAdamW(param_groups(ours, WD), lr=LR, betas=BETAS, eps=EPS)
    adamw = torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    steps = grads(5, torch.float32)
    run(opt, ours, steps)
    run(adamw, ref, steps)
    assert [g['weight_decay'] for g in opt.param_groups] == [WD, 0.0]
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(opt.state[p]['master'], q)
        assert torch.equal(opt.state[p]['exp_avg'], adamw.state[q]['exp_avg'])
        assert torch.equal(opt.state[p]['exp_avg_sq'], adamw.state[q]['exp_avg_sq'])
        assert opt.state[p]['step'] == adamw.state[q]['step'].item() == 5


def test_bf16_params_hold_the_rounded_fp32_adamw_trajectory():
    # the master follows fp32 AdamW from the bf16 initial weights with the bf16 grads widened;
    # the bf16 weight is only its rounding (it never feeds back into the update)
    ours = Net(torch.bfloat16)
    ref = Net(torch.bfloat16).float()
    opt = MasterAdamW(param_groups(ours, WD), lr=LR, betas=BETAS, eps=EPS)
    adamw = torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    steps = grads(5, torch.bfloat16)
    run(opt, ours, steps)
    run(adamw, ref, [[g.float() for g in gs] for gs in steps])
    for p, q in zip(ours.parameters(), ref.parameters()):
        state = opt.state[p]
        assert p.dtype == torch.bfloat16 and state['master'].dtype == state['exp_avg'].dtype == torch.float32
        assert torch.equal(state['master'], q) and torch.equal(p, q.bfloat16())
        assert torch.equal(state['exp_avg_sq'], adamw.state[q]['exp_avg_sq'])
    assert not torch.equal(opt.state[p]['master'], p.float())  # the master keeps bits bf16 drops


def test_master_device_placement():
    net, same = Net(torch.bfloat16), Net(torch.bfloat16)
    opt = MasterAdamW(param_groups(net, WD), lr=LR, master_device='cpu')
    ref = MasterAdamW(param_groups(same, WD), lr=LR)
    steps = grads(3, torch.bfloat16)
    run(opt, net, steps)
    run(ref, same, steps)
    for p, q in zip(net.parameters(), same.parameters()):
        assert torch.equal(p, q)
        assert_same_state(opt.state[p], ref.state[q])
        assert all(v.device.type == 'cpu' and not v.is_pinned() for v in opt.state[p].values() if torch.is_tensor(v))
    # the rule: a device of another type than the parameter's is used as named; None or the
    # parameter's own type means the parameter's device (so 'cuda' is each rank's own GPU)
    meta = torch.empty(2, device='meta')
    assert MasterAdamW([torch.nn.Parameter(meta)], master_device='cpu').master_home(meta) == torch.device('cpu')
    assert MasterAdamW([torch.nn.Parameter(meta)]).master_home(meta) == meta.device
    cpu = torch.zeros(2)
    # 'cpu:0' stands for 'cuda' given to a parameter on cuda:1: the parameter's own device wins
    assert (
        MasterAdamW([torch.nn.Parameter(cpu)], master_device='cpu:0').master_home(cpu)
        == cpu.device
        != torch.device('cpu:0')
    )
    assert MasterAdamW([torch.nn.Parameter(cpu)], master_device='meta').master_home(cpu) == torch.device('meta')


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cpu_master_of_cuda_params():
    # CPU masters of CUDA weights: the same CPU arithmetic as a run on CPU weights, bit for bit;
    # state in pinned host memory, also after a checkpoint round trip
    on_gpu, on_cpu, gpu_master = Net(torch.bfloat16).cuda(), Net(torch.bfloat16), Net(torch.bfloat16).cuda()
    opt = MasterAdamW(param_groups(on_gpu, WD), lr=LR, master_device='cpu')
    ref = MasterAdamW(param_groups(on_cpu, WD), lr=LR)
    dev = MasterAdamW(param_groups(gpu_master, WD), lr=LR, master_device='cuda')
    steps = grads(3, torch.bfloat16)
    run(opt, on_gpu, [[g.cuda() for g in gs] for gs in steps])
    run(dev, gpu_master, [[g.cuda() for g in gs] for gs in steps])
    run(ref, on_cpu, steps)
    for p, q, r in zip(on_gpu.parameters(), on_cpu.parameters(), gpu_master.parameters()):
        assert p.is_cuda and torch.equal(p.cpu(), q)
        assert_same_state(opt.state[p], ref.state[q])
        assert not any(v.is_pinned() for v in opt.state[p].values() if torch.is_tensor(v))  # staged: pageable
        assert all(v.is_cuda for v in dev.state[r].values() if torch.is_tensor(v))
        torch.testing.assert_close(dev.state[r]['master'].cpu(), opt.state[p]['master'])  # CUDA kernels: ulps
    opt.load_state_dict(torch.load(save(opt), weights_only=True, map_location='cpu'))
    dev.load_state_dict(torch.load(save(dev), weights_only=True, map_location='cpu'))
    for p, r in zip(on_gpu.parameters(), gpu_master.parameters()):
        assert not opt.state[p]['master'].is_pinned() and opt.state[p]['master'].dtype == torch.float32
        assert dev.state[r]['master'].is_cuda and dev.state[r]['master'].dtype == torch.float32


def save(opt):
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return buf


def test_state_dict_round_trip_is_exact_and_keeps_fp32_masters():
    # torch's Optimizer.load_state_dict would cast the fp32 masters and moments to bf16
    steps = grads(6, torch.bfloat16)
    for s in steps[:3]:
        s[1] = None  # a frozen parameter: no state, a gap in the saved numbering
    a = Net(torch.bfloat16)
    opt_a = MasterAdamW(param_groups(a, WD), lr=LR, betas=BETAS)
    run(opt_a, a, steps[:3])
    saved = torch.load(save(opt_a), weights_only=True)
    b = Net(torch.bfloat16)
    b.load_state_dict(a.state_dict())
    opt_b = MasterAdamW(param_groups(b, 0.5), lr=1.0)  # groups' settings come from the checkpoint
    opt_b.load_state_dict(saved)
    assert [g['lr'] for g in opt_b.param_groups] == [LR, LR] and opt_b.param_groups[0]['weight_decay'] == WD
    assert list(b.parameters())[1] not in opt_b.state
    for p, q in zip(a.parameters(), b.parameters()):
        if p in opt_a.state:
            assert opt_b.state[q]['master'].dtype == torch.float32
            assert_same_state(opt_a.state[p], opt_b.state[q])
    run(opt_a, a, steps[3:])
    run(opt_b, b, steps[3:])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        assert_same_state(opt_a.state[p], opt_b.state[q])


def test_dropped_state_restarts_from_the_bf16_weight():
    # the Cycler's 'drop' deletes optimizer.state[p]; on reactivation the master is the bf16
    # weight widened, with zero moments and step 1, as if the parameter were new
    net = Net(torch.bfloat16)
    opt = MasterAdamW(param_groups(net, WD), lr=LR, betas=BETAS)
    steps = grads(4, torch.bfloat16)
    run(opt, net, steps[:3])
    p = list(net.parameters())[0]
    del opt.state[p]
    weight = p.detach().float()
    ref = torch.nn.Parameter(weight.clone())
    adamw = torch.optim.AdamW([ref], lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    ref.grad = steps[3][0].float()
    adamw.step()
    run(opt, net, steps[3:])
    assert opt.state[p]['step'] == 1 and torch.equal(opt.state[p]['master'], ref)
    assert torch.equal(p, ref.bfloat16())


@pytest.mark.parametrize('policy', ['drop', 'offload'])
def test_cycler_policies_act_on_masters(policy):
    # through omgd.Cycler: frozen units keep no state on the device ('drop': none at all);
    # 'offload' brings the master back and the trajectory goes on as if never frozen
    net = Net(torch.bfloat16)
    params = list(net.parameters())
    opt = MasterAdamW(param_groups(net, WD), lr=LR, betas=BETAS)
    cycler = omgd.Cycler([[p] for p in params], opt, omgd.CyclerConfig('lisa_wor', gamma=1, period=1, state=policy))
    steps = grads(3, torch.bfloat16)
    alone = Net(torch.bfloat16)  # parameter 0 trained on its own for the same steps
    alone_opt = MasterAdamW([list(alone.parameters())[0]], lr=LR, betas=BETAS, weight_decay=WD)
    cycler.apply([0])
    run(opt, net, [[g if p.requires_grad else None for p, g in zip(params, steps[0])]])
    run(alone_opt, alone, [steps[0][:1]])
    assert set(opt.state) == {params[0]}
    assert memory_estimate.memory_bytes(net, opt)['optimizer'] == 3 * 4 * params[0].numel()  # master + 2 moments, fp32
    cycler.apply([1])
    run(opt, net, [[g if p.requires_grad else None for p, g in zip(params, steps[1])]])
    assert (params[0] in opt.state) == (policy == 'offload')
    cycler.apply([0])
    run(opt, net, [[g if p.requires_grad else None for p, g in zip(params, steps[2])]])
    run(alone_opt, alone, [steps[2][:1]])
    state, kept = opt.state[params[0]], alone_opt.state[list(alone.parameters())[0]]
    if policy == 'offload':
        assert_same_state(state, kept)
    else:
        assert state['step'] == 1 and not torch.equal(state['master'], kept['master'])


def test_frozen_params_get_no_state_and_accounting_counts_masters():
    net = Net(torch.bfloat16)
    params = list(net.parameters())
    opt = MasterAdamW(param_groups(net, WD), lr=LR)
    steps = grads(2, torch.bfloat16)
    run(opt, net, [[g if i in (0, 3) else None for i, g in enumerate(gs)] for gs in steps])
    assert set(opt.state) == {params[0], params[3]}
    assert torch.equal(params[1], Net(torch.bfloat16).ws[1])  # untouched, weight decay included
    n = params[0].numel() + params[3].numel()
    sizes = memory_estimate.memory_bytes(net, opt)
    assert sizes['optimizer'] == 3 * 4 * n and sizes['params'] == 2 * sum(p.numel() for p in params)
    assert sorted(k for _, k, _ in memory_estimate.state_tensors(opt)) == sorted(
        ['master', 'exp_avg', 'exp_avg_sq'] * 2
    )


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(lr=-1.0), 'invalid AdamW settings'),
        (dict(betas=(0.9, 1.0)), 'invalid AdamW settings'),
        (dict(eps=-1e-8), 'invalid AdamW settings'),
        (dict(weight_decay=-0.1), 'invalid AdamW settings'),
    ],
)
def test_invalid_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MasterAdamW([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_grads_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = MasterAdamW([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match='does not support sparse gradients'):
        opt.step()


# --- the model's optimizer groups

TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)


def test_adamw_keeps_frozen_params():
    model = Transformer(TransformerConfig(arch='llama', **TINY))
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    opt = adamw(model, 0.1, 1e-3, (0.9, 0.95), 'cpu')
    in_opt = {id(p) for g in opt.param_groups for p in g['params']}
    assert in_opt == {id(p) for p in model.parameters()}
    assert any(not p.requires_grad for g in opt.param_groups for p in g['params'])
    decay, no_decay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params'])
    assert all(p.dim() < 2 for p in no_decay['params'])


def test_param_groups_dedupes_tied_weights():
    model = Transformer(TransformerConfig(arch='gpt2', **TINY))
    groups = param_groups(model, 0.1)
    ps = [p for g in groups for p in g['params']]
    assert len(ps) == len({id(p) for p in ps}) == len(list(model.parameters()))
    torch.optim.SGD(groups, lr=0.1)  # reusable by other optimizers


# --- master_device='cpu' for CUDA parameters: the copies go through reused host buffers (optim.HostStaging);
# stage=True forces that path on CPU parameters (the CPU seam: the same code, ordinary host memory)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float32])
def test_staged_copies_are_the_same_arithmetic_through_reused_buffers(dtype, monkeypatch):
    import optim

    staged, plain = Net(dtype), Net(dtype)
    opt = MasterAdamW(param_groups(staged, WD), lr=LR, betas=BETAS, master_device='cpu')
    opt.stage = True
    ref = MasterAdamW(param_groups(plain, WD), lr=LR, betas=BETAS)
    waits = []
    monkeypatch.setattr(optim.HostStaging, 'wait', staticmethod(lambda device: waits.append(device)))
    steps = grads(4, dtype)
    run(opt, staged, steps[:2])
    buffers = {k: v.data_ptr() for k, v in opt.staging.buffers.items()}
    run(opt, staged, steps[2:])
    run(ref, plain, steps)
    for p, q in zip(staged.parameters(), plain.parameters()):
        assert torch.equal(p, q) and p.dtype == dtype
        assert_same_state(opt.state[p], ref.state[q])
    # the same buffers at every step, no more than the step needs: one per gradient (two parameters
    # share a shape with none here), and one for the weights that make the masters at the first step
    assert {k: v.data_ptr() for k, v in opt.staging.buffers.items()} == buffers
    assert sorted(buffers) == sorted([(s, dtype, 0) for s in SHAPES] + [(s, dtype, -1) for s in SHAPES])
    # one wait for all the gradients of a step, one per master made at the first step
    assert len(waits) == 4 + len(SHAPES) and not opt.staged


def test_staged_gradients_of_one_shape_get_a_buffer_each():
    import optim

    net = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(3, 2).bfloat16()) for _ in range(3)])
    opt = MasterAdamW(list(net), lr=LR, master_device='cpu')
    opt.stage = True
    ref_net = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in net])
    ref = MasterAdamW(list(ref_net), lr=LR)
    for step in range(2):
        gs = [torch.randn(3, 2, generator=torch.Generator().manual_seed(10 * step + i)).bfloat16() for i in range(3)]
        for p, q, g in zip(net, ref_net, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert all(torch.equal(p, q) for p, q in zip(net, ref_net))
    assert sorted(k[2] for k in opt.staging.buffers if k[2] >= 0) == [0, 1, 2]
    assert isinstance(opt.staging, optim.HostStaging) and not opt.staging.pin  # CPU parameters: not pinned


def test_staged_galore_masters_match_unstaged():
    import galore

    torch.manual_seed(0)
    nets = [
        torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(8, 6).bfloat16()), torch.nn.Parameter(torch.randn(6).bfloat16())]
        )
        for _ in range(2)
    ]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [
        galore.GaLoreAdamW(
            [{'params': [n[0]], 'rank': 2, 'update_proj_gap': 2}, {'params': [n[1]]}],
            lr=LR,
            master=True,
            master_device='cpu',
            convention='torch',
        )
        for n in nets
    ]
    opts[0].stage = True
    for step in range(5):
        g = [
            torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).bfloat16(),
            torch.randn(6, generator=torch.Generator().manual_seed(100 + step)).bfloat16(),
        ]
        for net, opt in zip(nets, opts):
            for p, gp in zip(net, g):
                p.grad = gp.clone()
            opt.step()
    for p, q in zip(*nets):
        assert torch.equal(p, q)
        assert_same_state(opts[0].state[p], opts[1].state[q])
    assert opts[0].staging is not None and opts[1].staging is None


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_foreach_update_is_the_per_tensor_arithmetic_bitwise(dtype, monkeypatch):
    """foreach=True (adamw_foreach_) on CPU masters: bitwise the per-tensor adamw_step_ and torch's AdamW,
    also across batches (FOREACH_BYTES) and with parameters at different step counts."""
    nets = [Net(dtype) for _ in range(3)]
    opts = [
        MasterAdamW(param_groups(n, WD), lr=LR, betas=BETAS, eps=EPS, foreach=f)
        for n, f in zip(nets, (True, False, True))
    ]
    monkeypatch.setattr(opts[2], 'FOREACH_BYTES', 1)  # a batch of one at a time
    ref = Net(dtype).float()
    adamw = torch.optim.AdamW(param_groups(ref, WD), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    steps = grads(5, dtype)
    for s in steps[:2]:
        s[1] = None  # a parameter that starts later: another step count in the same batch
    for net, opt in zip(nets, opts):
        run(opt, net, steps)
    run(adamw, ref, [[None if g is None else g.float() for g in gs] for gs in steps])
    for ps in zip(*(n.parameters() for n in nets), ref.parameters()):
        *ours, q = ps
        for p, opt in zip(ours, opts):
            assert torch.equal(p, ours[1]) and torch.equal(opt.state[p]['master'], q)
            assert torch.equal(opt.state[p]['exp_avg_sq'], adamw.state[q]['exp_avg_sq'])
            assert opt.state[p]['step'] == adamw.state[q]['step'].item()
    import optim

    assert optim.foreach_bitwise('cpu') and not optim.foreach_bitwise('cuda') and not optim.foreach_bitwise('meta')


def test_offload_leaves_host_masters_of_device_parameters_in_place():
    """omgd_state's 'offload' parks state in host memory; the masters and moments of master_device='cpu'
    are there already: a switch neither copies them (CPU to CPU) nor moves them."""
    p = torch.nn.Parameter(torch.empty(4, 3, device='meta', dtype=torch.bfloat16))  # stands for a CUDA weight
    opt = MasterAdamW([p], master_device='cpu')
    state = {'master': torch.randn(4, 3), 'exp_avg': torch.randn(4, 3), 'exp_avg_sq': torch.rand(4, 3), 'step': 3}
    opt.state[p] = dict(state)
    policy = optimizer_offload.OffloadedState(opt)
    policy.release(p)
    assert all(opt.state[p][k] is v for k, v in state.items())
    policy.prefetch([p])
    policy.restore(p)
    assert all(opt.state[p][k] is v for k, v in state.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_cuda_staging_is_asynchronous_and_exact():
    """On a GPU: the staging buffers are pinned, the masters match a CPU run bit for bit (as
    test_cpu_master_of_cuda_params), and adamw_foreach_ on CUDA tensors against adamw_step_ reports
    whether the fused kernels are bitwise (foreach_bitwise says they are not assumed to be)."""
    import optim

    on_gpu, on_cpu = Net(torch.bfloat16).cuda(), Net(torch.bfloat16)
    opt = MasterAdamW(param_groups(on_gpu, WD), lr=LR, master_device='cpu')
    ref = MasterAdamW(param_groups(on_cpu, WD), lr=LR)
    steps = grads(4, torch.bfloat16)
    run(opt, on_gpu, [[g.cuda() for g in gs] for gs in steps])
    run(ref, on_cpu, steps)
    torch.cuda.synchronize()
    assert all(b.is_pinned() for b in opt.staging.buffers.values())
    for p, q in zip(on_gpu.parameters(), on_cpu.parameters()):
        assert torch.equal(p.cpu(), q)
        assert_same_state(opt.state[p], ref.state[q])
    ts = [[torch.randn(5, 7, device='cuda') for _ in range(4)] for _ in range(2)]
    a, b = [[t.clone() for t in group] for group in ts], [[t.clone() for t in group] for group in ts]
    for i in range(2):
        optim.adamw_step_(a[i][0], a[i][1], a[i][2], a[i][3].abs(), 3, LR, BETAS, EPS, WD)
    optim.adamw_foreach_(
        [t[0] for t in b], [t[1] for t in b], [t[2] for t in b], [t[3].abs() for t in b], [3, 3], LR, BETAS, EPS, WD
    )
    print('foreach bitwise on CUDA:', all(torch.equal(x[0], y[0]) for x, y in zip(a, b)))
