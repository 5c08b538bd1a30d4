"""
GaLore and GoLore: AdamW whose moments live in a low-rank subspace of each matrix's gradient.

GaLore (Zhao et al., 2024) projects the gradient G (m x n) of a weight matrix onto r directions
taken from its SVD, runs Adam on the small r-dimensional matrix and maps the normalised update
back, times `scale`. The subspace is refreshed every `update_proj_gap` steps. GoLore (He et al.,
2024) is the same with a random orthonormal projection (QR of a Gaussian matrix), which removes
GaLore's bias toward the dominant subspace.

Why not `pip install galore-torch`: the package is unmaintained, pulls in transformers and
bitsandbytes for about 100 lines of algorithm, and keeps a Python projector object inside the
optimizer state (which neither torch.save(weights_only=True) nor memory accounting handle).

Conventions, as in GaLore's code unless noted:
- Projection on the smaller side: for m >= n the gradient is projected on the right, R = G Q with
  Q (n x r), so the moments are m x r; otherwise on the left, R = P^T G with P (m x r), moments
  r x n. The update is Q-back-projected (N Q^T or P N) and multiplied by `scale`.
- The projection is computed at a parameter's steps 0, gap, 2*gap, ... (its own step count);
  Adam's moments are kept, not reset, when the subspace changes.
- The Adam arithmetic is torch.optim.AdamW's (decoupled weight decay on the whole matrix before the
  update, eps added to the bias-corrected sqrt(v)), so a group without `rank` is exactly AdamW.
  GaLore's reference code uses transformers' AdamW variant, which differs only at the scale of eps.
- The projector is kept in state['projector'], so state_dict() saves it and a resumed run goes on
  in the same subspace. It is not optimizer state in the GaLore papers' memory accounting:
  omgd.memory_bytes() leaves it out, projector_bytes() counts it.
- GoLore's projection for a parameter is drawn from a CPU torch.Generator seeded with
  (seed, parameter index, step), so runs are reproducible, resumed runs included, on any device.
"""
import math

import torch

from model import param_groups

PROJECTIONS = ('svd', 'random')


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW; 2-D parameters in a group with `rank` get GaLore/GoLore projected moments.

    A projected group may carry rank, update_proj_gap (default 200), scale (default 0.25) and
    projection ('svd' for GaLore, 'random' for GoLore). Parameters whose grad is None are skipped
    (they are frozen, e.g. by layer cycling).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, seed=0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid AdamW settings lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self.seed = seed
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, group):
        if 'rank' in group:
            group.setdefault('update_proj_gap', 200)
            group.setdefault('scale', 0.25)
            group.setdefault('projection', 'svd')
            if group['rank'] < 1 or group['update_proj_gap'] < 1:
                raise ValueError(f"GaLore needs rank >= 1 and update_proj_gap >= 1, got "
                                 f"{group['rank']} and {group['update_proj_gap']}")
            if group['projection'] not in PROJECTIONS:
                raise ValueError(f"projection must be one of {PROJECTIONS}, got {group['projection']!r}")
        super().add_param_group(group)

    def _projector(self, grad, group, index, step, right):
        """P (m x r) for a left projection or Q (n x r) for a right one, in the grad's dtype."""
        m, n = grad.shape
        r = min(group['rank'], m, n)
        if group['projection'] == 'svd':
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
            beta1, beta2 = group['betas']
            lr, wd, eps = group['lr'], group['weight_decay'], group['eps']
            for p in group['params']:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("GaLoreAdamW does not support sparse gradients")
                state = self.state[p]
                step = state.get('step', 0)
                grad = p.grad
                projected = 'rank' in group and p.dim() == 2
                if projected:
                    right = grad.shape[0] >= grad.shape[1]  # project on the smaller side
                    if step % group['update_proj_gap'] == 0 or 'projector' not in state:
                        state['projector'] = self._projector(grad, group, index, step, right)
                    proj = state['projector']
                    grad = grad @ proj if right else proj.T @ grad
                if 'exp_avg' not in state:
                    state['exp_avg'] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                    state['exp_avg_sq'] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                exp_avg, exp_avg_sq = state['exp_avg'], state['exp_avg_sq']
                step += 1
                state['step'] = step  # a Python int: no .item() syncs, and works on meta tensors
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                p.mul_(1 - lr * wd)
                if projected:
                    update = exp_avg / denom
                    update = update @ proj.T if right else proj @ update
                    p.add_(update, alpha=-lr * group['scale'] / bias_correction1)
                else:
                    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        return loss


def projector_bytes(optimizer):
    """Bytes of the GaLore/GoLore projection matrices (0 for other optimizers)."""
    return sum(s['projector'].numel() * s['projector'].element_size()
               for s in optimizer.state.values() if torch.is_tensor(s.get('projector')))


def build_optimizer(model, weight_decay, lr, betas, rank=128, update_proj_gap=200, scale=0.25,
                    projection='svd', eps=1e-8, seed=0):
    """GaLore (projection='svd') or GoLore ('random') on every matrix inside model.blocks (the
    attention and MLP weights), plain AdamW with model.param_groups' decay split elsewhere
    (embeddings, head, norms, biases). Built over all parameters, frozen ones included."""
    projected = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    ids = {id(p) for p in projected}
    groups = []
    for group in param_groups(model, weight_decay):
        rest = [p for p in group['params'] if id(p) not in ids]
        if rest:
            groups.append({**group, 'params': rest})
    if projected:
        groups.append({'params': projected, 'weight_decay': weight_decay, 'rank': rank,
                       'update_proj_gap': update_proj_gap, 'scale': scale, 'projection': projection})
    return GaLoreAdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, seed=seed)
