"""
GaLore and GoLore: AdamW whose moments live in a low-rank subspace of each matrix's gradient.

GaLore (Zhao et al., 2024) projects the gradient G (m x n) of a weight matrix onto r directions
taken from its SVD, runs Adam on the small r-dimensional matrix and maps the normalised update
back, times `scale`. The subspace is refreshed every `update_proj_gap` steps. GoLore (He et al.,
2024) draws the refreshed subspace at random (uniform on the Stiefel manifold), which removes
GaLore's bias toward the dominant, noise-dominated directions; its reference code starts with SVD
projections and switches to random ones, and carries the first moment over into each new basis.

Why not `pip install galore-torch`: the package is unmaintained, pulls in transformers and
bitsandbytes for about 100 lines of algorithm, and keeps a Python projector object inside the
optimizer state (which neither torch.save(weights_only=True) nor memory accounting handle).

What the reference code does (jiaweizzhao/GaLore galore_torch/{adamw,galore_projector}.py and
pkumelon/Golore peft_pretraining/golore_torch/{adamw,golore_projector}.py, GoLore.py), and here:
- Projection on the smaller side ('std'): for m >= n the gradient is projected on the right,
  R = G Q with Q (n x r) (the references store Q^T = Vh[:r]), so the moments are m x r; otherwise
  on the left, R = P^T G with P = U[:, :r] (m x r), moments r x n. The update is back-projected
  (N Q^T or P N) and multiplied by `scale` (GaLore's scripts use 0.25; GoLore's scripts leave it
  at their default 1.0).
- The projection is computed at a parameter's own steps 0, gap, 2*gap, ... (counted before the
  step's increment), from that step's gradient.
- GaLore ('svd'): Adam's moments and step count are kept unchanged when the subspace changes.
- GoLore ('random'): a refresh at a parameter step s uses SVD while s < `svd_steps` and a random
  projection from then on (the reference's `rand = state["step"] >= group["rand_epoch"]`, with
  rand_epoch = rand_ratio * num_training_steps; its scripts and README use rand_ratio 0.8, i.e.
  svd_steps = ceil(0.8 * total steps)). At every refresh after the first, SVD or random, the first
  moment is re-expressed in the new basis, exp_avg <- P_new^T P_old exp_avg (left) or
  exp_avg Q_old^T Q_new (right); the second moment and the step count are kept as they are.
- The Adam arithmetic is the references' (transformers' AdamW, which both copy), op for op:
  galore_adamw_step_ below. eps (default 1e-6, as theirs and GaLore's training script) is added to
  the uncorrected sqrt(v), both bias corrections go into the step size lr * sqrt(1 - b2^t) / (1 - b1^t),
  and the decoupled weight decay p -= lr*wd*p comes after the update. Every group runs it, as in the
  references, where one optimizer trains all parameters. convention='torch' runs torch.optim.AdamW's
  arithmetic instead (optim.adamw_step_, shared with MasterAdamW: weight decay before the update, eps
  added to the bias-corrected sqrt(v)): a group without `rank` is then exactly (bitwise)
  torch.optim.AdamW(foreach=False), and GaLore can be set against an AdamW-trained method with
  nothing but the projection between them. The two differ at the scale of eps against sqrt(v) (at
  step 1 the uncorrected root is sqrt(1 - b2) times the corrected one) and of lr^2*wd.

Remaining differences from the reference code, on purpose:
- svd_steps defaults to 0 (random from the first refresh: the GoLore algorithm the paper analyses).
  The reference's group needs rand_epoch set, and its CLI default rand_ratio=2 never draws a random
  basis at all; a caller wanting the reference scripts' setting passes ceil(0.8 * total steps).
- GoLore's golore_torch/adamw.py re-projects into a local name (`exp_avg = ...`), so the stored
  exp_avg is never replaced: the re-projected moment serves that one step only, and the next step
  goes on from the old-basis moment without the refresh step's gradient. We store the re-projected
  moment, as GoLore.py (the ReLoRA-style version in the Golore README) does with .copy_(). We also
  form the r x r change of basis first ((P_new^T P_old) M rather than P_new^T (P_old M)): equal up
  to rounding, with no m x n temporary.
- The random basis: GoLore takes the polar factor Z (Z^T Z)^(-1/2) of a Gaussian Z from the global
  RNG; we take Q of Z = QR with R's diagonal made positive, which has the same (Haar) distribution,
  from a CPU torch.Generator seeded with (seed, parameter index, step), so runs are reproducible,
  resumed runs included, on any device, and the global RNG is left alone.
- The projector is kept in state['projector'] as a tensor (the references keep a Python projector
  object, and GoLore a second copy in state['matrix']), so state_dict() saves it and a resumed run
  goes on in the same subspace; the previous basis needed by the re-projection is that same tensor,
  read before it is replaced. It is not optimizer state in the GaLore papers' memory accounting:
  memory_estimate.memory_bytes() leaves it out, projector_bytes() counts it.
- master=True (train.py's precision='bf16_master'): bf16 weights, an fp32 master per trained
  parameter (optim.MasterWeights, shared with MasterAdamW), projector and moments computed from
  the fp32-widened grad; with master_device='cpu' all of it, and the arithmetic, on the CPU.
"""

import math
from contextlib import nullcontext

import torch

from configurator import above, at_least, check_rule
from optim import MasterWeights, adamw_step_, check_adamw_settings, param_groups

PROJECTIONS = ('svd', 'random')
CONVENTIONS = ('galore', 'torch')  # whose AdamW arithmetic: the references' or torch.optim.AdamW's

# the rule of each train.py key a projected group reads (train_config.py checks a whole config with them)
RULES = {'galore_rank': at_least(1), 'galore_update_proj_gap': at_least(1), 'galore_scale': above(0)}


def galore_adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, back=None, scale=1.0):
    """One AdamW step in place, galore_torch/adamw.py's arithmetic op for op (GoLore's is the same),
    with optim.adamw_step_'s arguments: `back` maps the normalised low-rank update to param's shape."""
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
    """AdamW; 2-D parameters in a group with `rank` get GaLore/GoLore projected moments.

    A projected group may carry rank, update_proj_gap (default 200), scale (default 0.25),
    projection ('svd' for GaLore, 'random' for GoLore) and svd_steps (GoLore only, default 0: a
    refresh at a parameter step below it uses SVD; the reference's rand_epoch). Parameters whose
    grad is None are skipped (they are frozen, e.g. by layer cycling).

    master=True (optim.MasterWeights, as MasterAdamW): each parameter that trains gets an fp32
    state['master'], made from the weight at its first step (again after 'drop'); projector and
    moments are computed from the fp32-widened grad, the update goes to the master, which is
    rounded into the parameter. master_device / host_scope: as MasterAdamW's (master, moments,
    projector and the arithmetic on master_home(p)). master=False: the update acts on the
    parameter in its own dtype, state in the grad's dtype, as before.

    convention: 'galore' (galore_adamw_step_, the references' AdamW) or 'torch' (optim.adamw_step_,
    torch.optim.AdamW's), for every group; see the module docstring.
    """

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
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
        self.convention = convention
        self.adamw_step_ = galore_adamw_step_ if convention == 'galore' else adamw_step_
        self.seed = seed
        self.master = bool(master)
        self._init_master(master_device, host_scope)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def add_param_group(self, group):
        if 'rank' in group:
            group.setdefault('update_proj_gap', 200)
            group.setdefault('scale', 0.25)
            group.setdefault('projection', 'svd')
            group.setdefault('svd_steps', 0)
            for key in ('rank', 'update_proj_gap', 'scale'):
                check_rule(f'galore_{key}', group[key], RULES[f'galore_{key}'])
            if group['projection'] not in PROJECTIONS:
                raise ValueError(f"projection must be one of {PROJECTIONS}, got {group['projection']!r}")
            if not isinstance(group['svd_steps'], int) or group['svd_steps'] < 0:
                raise ValueError(f"svd_steps must be an int >= 0, got {group['svd_steps']!r}")
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
                    # GoLore: carry the first moment into the new basis (old coordinates would
                    # be noise there); the second moment is kept as it is, as in the reference
                    change = new.T @ state['projector']  # r x r: new coordinates of the old basis
                    avg = state['exp_avg']
                    avg.copy_(avg @ change.T if right else change @ avg)
                state['projector'] = self._place(new, p) if self.master else new
            proj = state['projector']
            grad = grad @ proj if right else proj.T @ grad
        if 'exp_avg' not in state:
            if self.master:
                state['exp_avg'], state['exp_avg_sq'] = (
                    self._state_zeros(p, grad.shape),
                    self._state_zeros(p, grad.shape),
                )
            else:
                state['exp_avg'] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                state['exp_avg_sq'] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        step += 1
        state['step'] = step  # a Python int: no .item() syncs, and works on meta tensors
        back = None
        if projected:  # the normalised low-rank update, mapped back to the matrix
            back = (lambda u: u @ proj.T) if right else (lambda u: proj @ u)
        self.adamw_step_(
            target,
            grad,
            state['exp_avg'],
            state['exp_avg_sq'],
            step,
            group['lr'],
            group['betas'],
            group['eps'],
            group['weight_decay'],
            back=back,
            scale=group.get('scale', 1.0),
        )
        return target


def projector_bytes(optimizer):
    """Bytes of the GaLore/GoLore projection matrices (0 for other optimizers)."""
    return sum(
        s['projector'].numel() * s['projector'].element_size()
        for s in optimizer.state.values()
        if torch.is_tensor(s.get('projector'))
    )


def build_optimizer(
    model,
    weight_decay,
    lr,
    betas,
    rank=128,
    update_proj_gap=200,
    scale=0.25,
    projection='svd',
    eps=1e-6,
    seed=0,
    svd_steps=0,
    master=False,
    master_device=None,
    convention='galore',
    host_scope=nullcontext,
):
    """GaLore (projection='svd') or GoLore ('random') on every matrix inside model.blocks (the
    attention and MLP weights), plain AdamW with optim.param_groups' decay split elsewhere
    (embeddings, head, norms, biases). Built over all parameters, frozen ones included.
    GoLore's reference switches from SVD to random projections after a fraction rand_ratio of
    training: svd_steps = math.ceil(rand_ratio * total_steps) gives its `step >= rand_ratio * T`.
    master, master_device, host_scope: fp32 master weights (GaLoreAdamW's), for train.py's precision='bf16_master'."""
    projected = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    ids = {id(p) for p in projected}
    groups = []
    for group in param_groups(model, weight_decay):
        rest = [p for p in group['params'] if id(p) not in ids]
        if rest:
            groups.append({**group, 'params': rest})
    if projected:
        groups.append(
            {
                'params': projected,
                'weight_decay': weight_decay,
                'rank': rank,
                'update_proj_gap': update_proj_gap,
                'scale': scale,
                'projection': projection,
                'svd_steps': svd_steps,
            }
        )
    return GaLoreAdamW(
        groups,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        seed=seed,
        master=master,
        master_device=master_device,
        convention=convention,
        host_scope=host_scope,
    )
