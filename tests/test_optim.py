"""optim.py: the shared AdamW arithmetic and MasterAdamW (fp32 masters of low-precision weights)."""
import io
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import omgd  # noqa: E402
import omgd_state  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from optim import MasterAdamW, configure_optimizers, param_groups  # noqa: E402

LR, BETAS, EPS, WD = 0.01, (0.9, 0.95), 1e-8, 0.1
SHAPES = [(6, 4), (4,), (3, 5), (5,)]  # matrices decay, vectors do not (param_groups' split)


class Net(torch.nn.Module):
    def __init__(self, dtype, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype))
                                          for s in SHAPES])


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
        assert (torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype) if torch.is_tensor(a[key]) \
            else a[key] == b[key], key


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
    assert MasterAdamW([torch.nn.Parameter(cpu)], master_device='cpu:0').master_home(cpu) == cpu.device != torch.device('cpu:0')
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
        assert all(v.is_pinned() for v in opt.state[p].values() if torch.is_tensor(v))
        assert all(v.is_cuda for v in dev.state[r].values() if torch.is_tensor(v))
        torch.testing.assert_close(dev.state[r]['master'].cpu(), opt.state[p]['master'])  # CUDA kernels: ulps
    opt.load_state_dict(torch.load(save(opt), weights_only=True, map_location='cpu'))
    dev.load_state_dict(torch.load(save(dev), weights_only=True, map_location='cpu'))
    for p, r in zip(on_gpu.parameters(), gpu_master.parameters()):
        assert opt.state[p]['master'].is_pinned() and opt.state[p]['master'].dtype == torch.float32
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
    cycler = omgd.Cycler([[p] for p in params], opt, omgd.CyclerConfig('lisa_wor', gamma=1, state=policy))
    steps = grads(3, torch.bfloat16)
    alone = Net(torch.bfloat16)  # parameter 0 trained on its own for the same steps
    alone_opt = MasterAdamW([list(alone.parameters())[0]], lr=LR, betas=BETAS, weight_decay=WD)
    cycler.apply([0])
    run(opt, net, [[g if p.requires_grad else None for p, g in zip(params, steps[0])]])
    run(alone_opt, alone, [steps[0][:1]])
    assert set(opt.state) == {params[0]}
    assert omgd_state.memory_bytes(net, opt)['optimizer'] == 3 * 4 * params[0].numel()  # master + 2 moments, fp32
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
    sizes = omgd_state.memory_bytes(net, opt)
    assert sizes['optimizer'] == 3 * 4 * n and sizes['params'] == 2 * sum(p.numel() for p in params)
    assert sorted(k for _, k, _ in omgd_state.state_tensors(opt)) == sorted(['master', 'exp_avg', 'exp_avg_sq'] * 2)


@pytest.mark.parametrize('kwargs, message', [
    (dict(lr=-1.0), 'invalid AdamW settings'),
    (dict(betas=(0.9, 1.0)), 'invalid AdamW settings'),
    (dict(eps=-1e-8), 'invalid AdamW settings'),
    (dict(weight_decay=-0.1), 'invalid AdamW settings'),
])
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


def test_configure_optimizers_keeps_frozen_params():
    model = GPT(GPTConfig(arch='llama', **TINY))
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    opt = configure_optimizers(model, 0.1, 1e-3, (0.9, 0.95), 'cpu')
    in_opt = {id(p) for g in opt.param_groups for p in g['params']}
    assert in_opt == {id(p) for p in model.parameters()}
    assert any(not p.requires_grad for g in opt.param_groups for p in g['params'])
    decay, no_decay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params'])
    assert all(p.dim() < 2 for p in no_decay['params'])


def test_param_groups_dedupes_tied_weights():
    model = GPT(GPTConfig(arch='gpt2', **TINY))
    groups = param_groups(model, 0.1)
    ps = [p for g in groups for p in g['params']]
    assert len(ps) == len({id(p) for p in ps}) == len(list(model.parameters()))
    torch.optim.SGD(groups, lr=0.1)  # reusable by other optimizers
