"""GaLore and GoLore: AdamW whose moments live in a low-rank subspace of each matrix's gradient. GaLore (Zhao et al.,
2024) projects the gradient G (m x n) on its smaller side onto r directions of its SVD (R = G Q for m >= n, else
P^T G), runs Adam on R and maps the update back, times `scale`; GoLore (He et al., 2024) draws the subspace at
random from step `svd_steps` on. Its arithmetic, and where it departs from the references: docs/methods.md."""

import math
from contextlib import nullcontext

import torch

from configurator import above, at_least, check_rule, one_of
from optim import MasterWeights, adamw_step_, check_adamw_settings, param_groups

GROUP_DEFAULTS = {'update_proj_gap': 200, 'scale': 0.25, 'projection': 'svd', 'svd_steps': 0}  # a projected group's
CONVENTIONS = ('galore', 'torch')  # whose AdamW arithmetic: the references' or torch.optim.AdamW's
RULES = {'galore_rank': at_least(1), 'galore_update_proj_gap': at_least(1), 'galore_scale': above(0)}


def galore_adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, back=None, scale=1.0):
    """optim.adamw_step_ with galore_torch/adamw.py's arithmetic, op for op: eps on the uncorrected root, both
    bias corrections in the step size, weight decay after the update."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt().add_(eps)  # eps against the uncorrected root
    step_size = lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
    update = exp_avg / denom
    if back is not None:
        update = back(update) * scale
    param.add_(update, alpha=-step_size)
    if weight_decay > 0.0:
        param.add_(param, alpha=-lr * weight_decay)  # after the update


class GaLoreAdamW(MasterWeights, torch.optim.Optimizer):
    """AdamW; 2-D parameters in a group with `rank` (and GROUP_DEFAULTS' keys) get GaLore/GoLore projected moments.
    master=True: fp32 masters, moments and projector (as optim.MasterAdamW); False: state in the grad's dtype."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.01,
        seed=0,
        master=False,
        master_device=None,
        host_scope=nullcontext,
        convention='galore',
    ):
        check_adamw_settings(lr, betas, eps, weight_decay)
        if master_device is not None and not master:
            raise ValueError(f"master_device={master_device!r} needs master=True")
        check_rule('convention', convention, one_of(*CONVENTIONS, described=f"one of {CONVENTIONS}"))
        self.adamw_step_ = galore_adamw_step_ if convention == 'galore' else adamw_step_
        self.seed, self.master = seed, bool(master)
        self._init_master(master_device, host_scope)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, group):
        if 'rank' in group:
            for key, value in GROUP_DEFAULTS.items():
                group.setdefault(key, value)
            for key in ('rank', 'update_proj_gap', 'scale'):
                check_rule(f'galore_{key}', group[key], RULES[f'galore_{key}'])
            check_rule('projection', group['projection'], one_of('svd', 'random'))
            check_rule('svd_steps', group['svd_steps'], (lambda v: isinstance(v, int) and v >= 0, 'an int >= 0'))
        super().add_param_group(group)

    def _projector(self, grad, group, index, step, right):
        """P (m x r) for a left projection or Q (n x r) for a right one, in the grad's dtype."""
        m, n = grad.shape
        r = min(group['rank'], m, n)
        if group['projection'] == 'svd' or step < group['svd_steps']:
            exact = grad if grad.dtype in (torch.float32, torch.float64) else grad.float()  # no bf16 SVD
            U, _, Vh = torch.linalg.svd(exact, full_matrices=False)
            basis = Vh[:r].T if right else U[:, :r]
        else:
            size = (n if right else m, r)
            if grad.device.type == 'meta':  # shapes only (memory estimates): no numbers to draw
                gauss = torch.empty(size, device='meta')
            else:
                gen = torch.Generator().manual_seed(hash((self.seed, index, step)) & (2**63 - 1))
                gauss = torch.randn(size, generator=gen).to(grad.device)
            Q, R = torch.linalg.qr(gauss)
            basis = Q * torch.sign(torch.diagonal(R))  # sign fix: Haar-distributed, not just orthonormal
        return basis.to(grad.dtype).contiguous()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        for group in self.param_groups:
            for p in group['params']:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GaLoreAdamW does not support sparse gradients")
                with self.host_scope() if self.master else nullcontext():
                    target = self._update(p, group, index)
                if self.master:
                    self._round_into(p, target)
        return loss

    def _update(self, p, group, index):
        """One step of p's state and of its target: the fp32 master, or p itself; returns the target."""
        state = self.state[p]
        step = state.get('step', 0)
        if self.master:
            target = self._master(p, state)
            grad = self._widened_grad(p, target)  # projector and moments fp32, on master_home(p)
        else:
            target, grad = p, p.grad
        projected = 'rank' in group and p.dim() == 2
        if projected:
            right = grad.shape[0] >= grad.shape[1]  # project on the smaller side
            if step % group['update_proj_gap'] == 0 or 'projector' not in state:
                new = self._projector(grad, group, index, step, right)
                if group['projection'] == 'random' and 'projector' in state and 'exp_avg' in state:
                    # GoLore: the first moment into the new basis (the second is kept, as in the reference)
                    change = new.T @ state['projector']  # r x r: new coordinates of the old basis
                    avg = state['exp_avg']
                    avg.copy_(avg @ change.T if right else change @ avg)
                state['projector'] = new  # on the grad's device: master_home(p) under master=True
            proj = state['projector']
            grad = grad @ proj if right else proj.T @ grad
        if 'exp_avg' not in state:
            for key in ('exp_avg', 'exp_avg_sq'):
                state[key] = self._state_zeros(p, grad.shape) if self.master else torch.zeros_like(grad)
        step += 1
        state['step'] = step  # a Python int: no .item() syncs, and works on meta tensors
        back = None
        if projected:  # the normalised low-rank update, mapped back to the matrix
            back = (lambda u: u @ proj.T) if right else (lambda u: proj @ u)
        settings = (group['lr'], group['betas'], group['eps'], group['weight_decay'])
        scale = group.get('scale', 1.0)
        self.adamw_step_(target, grad, state['exp_avg'], state['exp_avg_sq'], step, *settings, back=back, scale=scale)
        return target


def projector_bytes(optimizer):
    """Bytes of the GaLore/GoLore projection matrices (0 for other optimizers)."""
    return sum(s['projector'].nbytes for s in optimizer.state.values() if torch.is_tensor(s.get('projector')))


def build_optimizer(model, weight_decay, lr, betas, rank=128, **kwargs):
    """GaLore (projection='svd') or GoLore ('random') on every matrix in model.blocks, optim.param_groups' AdamW
    elsewhere; over all parameters. kwargs: GROUP_DEFAULTS' keys for the projected group, GaLoreAdamW's others."""
    settings = {key: kwargs.pop(key) for key in GROUP_DEFAULTS if key in kwargs}  # the rest: GaLoreAdamW's
    projected = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    ids = {id(p) for p in projected}
    groups = [{**g, 'params': [p for p in g['params'] if id(p) not in ids]} for g in param_groups(model, weight_decay)]
    groups = [g for g in groups if g['params']]  # a group left empty goes
    if projected:
        groups.append({'params': projected, 'weight_decay': weight_decay, 'rank': rank, **settings})
    return GaLoreAdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)
