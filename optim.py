"""
The optimizers of the model's parameters: nanoGPT's decay split (param_groups) and its AdamW
(configure_optimizers); AdamW's arithmetic, once; MasterWeights, the fp32 master weights of
low-precision parameters, once; and MasterAdamW: AdamW on those masters (GaLoreAdamW(master=True)
in galore.py uses the same mixin).

adamw_step_ is torch.optim.AdamW's single-tensor step (decoupled weight decay on the weight before
the update, bias-corrected moments, eps added to sqrt(v_hat)), so every optimizer built on it is
torch's AdamW wherever it does not project: MasterAdamW calls it on fp32 masters, and
GaLoreAdamW(convention='torch') (galore.py) with `back`, the map of its low-rank update to the
weight's shape.

MasterAdamW keeps the model's weights in bf16 (or any dtype) and, for each parameter that trains,
an fp32 master copy and fp32 moments as its optimizer state. The state is made lazily at a
parameter's first step with a gradient, so frozen parameters get none, and omgd.Cycler's
policies act on it like on torch AdamW's: 'drop' deletes optimizer.state[p] and the next step
after reactivation starts again from the bf16 weight (which holds the rounded master) with zero
moments and step 0; 'offload' parks the tensors on the CPU and puts them back. omgd_state.memory_bytes
counts master and moments (state tensors with dim > 0).
master_device='cpu' keeps masters, moments and the AdamW arithmetic on the CPU (ZeRO-Offload
style), in pinned memory when the parameters are on CUDA: the device holds bf16 weights and grads.
"""
from contextlib import nullcontext

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's decay split: matrices and embeddings decay, biases and norm weights don't.

    Every parameter is returned whether or not it currently requires grad
    (parameters() already dedupes the tied embedding/head).
    """
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {'params': decay, 'weight_decay': weight_decay},
        {'params': no_decay, 'weight_decay': 0.0},
    ]


def configure_optimizers(model, weight_decay, learning_rate, betas, device_type):
    """nanoGPT's AdamW over param_groups (fused on CUDA)."""
    # frozen parameters are included on purpose: layer cycling unfreezes them later,
    # and an optimizer that never saw them would silently skip those blocks
    groups = param_groups(model, weight_decay)
    extra_args = dict(fused=True) if device_type == 'cuda' else dict()
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra_args)


def check_adamw_settings(lr, betas, eps, weight_decay):
    if lr < 0 or eps < 0 or weight_decay < 0 or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"invalid AdamW settings lr={lr}, betas={betas}, eps={eps}, "
                         f"weight_decay={weight_decay}")


def adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, back=None, scale=1.0):
    """One AdamW step in place on param, exp_avg and exp_avg_sq; `step` counts this step (1 first).

    Without `back` it is torch.optim.AdamW(foreach=False)'s arithmetic, op for op (bitwise equal).
    With `back` (GaLore), grad and moments live in a projected space: the normalised update
    exp_avg / denom is mapped to param's shape by back() and multiplied by `scale`."""
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)  # ** 0.5 as torch writes it
    if back is None:
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    else:
        param.add_(back(exp_avg / denom), alpha=-lr * scale / bias_correction1)


class MasterWeights:
    """The fp32 master weights of MasterAdamW and GaLoreAdamW(master=True), in one place.

    A mixin for torch.optim.Optimizer subclasses; call _init_master() before Optimizer.__init__.
    state['master'] is made lazily from the weight as it is now (a parameter's first step with a
    grad, or the first after omgd's 'drop' deleted its state), the grad is widened to fp32 where
    the master lives, and the updated master is rounded into the parameter. Every state tensor
    (master, moments, a GaLore projector) lives on master_home(p), pinned for CUDA parameters with
    CPU masters. `master` False (GaLoreAdamW's default) leaves torch's state loading in charge.
    """
    master = True

    def _init_master(self, master_device=None, host_scope=nullcontext):
        self.master_device = None if master_device is None else torch.device(master_device)
        self.host_scope = host_scope

    def master_home(self, p):
        """Where p's master and moments live: master_device, unless it is None or of p's own device
        type ('cuda' for a parameter on cuda:1 means cuda:1, so one setting serves every rank)."""
        if self.master_device is None or self.master_device.type == p.device.type:
            return p.device
        return self.master_device

    def _pinned(self, p):
        # pinned host memory makes the copies to and from a CUDA device DMA transfers
        return p.is_cuda and self.master_home(p).type == 'cpu'

    def _state_zeros(self, p, shape):
        """fp32 zeros on master_home(p): a moment of p (shape: p's, or GaLore's projected one)."""
        return torch.zeros(shape, dtype=torch.float32, device=self.master_home(p), pin_memory=self._pinned(p))

    def _master(self, p, state):
        """state['master'], first made as an fp32 copy of the weight as it is now."""
        if 'master' not in state:  # first step, or the first after 'drop' freed the state
            state['master'] = torch.empty(p.shape, dtype=torch.float32, device=self.master_home(p),
                                          pin_memory=self._pinned(p)).copy_(p.detach())
        return state['master']

    @staticmethod
    def _widened_grad(p, master):
        return p.grad.to(master.device).float()  # across in the grad's dtype, then widen

    def _round_into(self, p, master):
        with self.host_scope():
            rounded = master.to(p.dtype)  # rounded where the master is: fewer bytes to copy
        p.copy_(rounded)  # outside the scope: the parameter stays device memory for LiveBytes

    def _place(self, value, p):
        value = value.to(self.master_home(p))  # no copy when already there, as torch's loading
        return value.pin_memory() if self._pinned(p) and not value.is_pinned() else value

    def load_state_dict(self, state_dict):
        """torch's loading of the groups, with the state tensors kept in their saved dtype.

        torch.optim.Optimizer.load_state_dict casts every floating state tensor but 'step' to the
        parameter's dtype (fp32 masters and moments would come back bf16), and calls
        Optimizer._process_value_according_to_param_policy by class name, so overriding that
        does nothing. The groups go through torch's checks; the state goes to master_home(p)."""
        if not self.master:
            return super().load_state_dict(state_dict)
        super().load_state_dict({**state_dict, 'state': {}})
        saved_ids = [i for g in state_dict['param_groups'] for i in g['params']]
        params = [p for g in self.param_groups for p in g['params']]
        for i, p in zip(saved_ids, params):
            if i in state_dict['state']:
                self.state[p] = {key: self._place(value, p) if torch.is_tensor(value) else value
                                 for key, value in state_dict['state'][i].items()}


class MasterAdamW(MasterWeights, torch.optim.Optimizer):
    """AdamW on fp32 master copies of the parameters that train; the parameters keep their dtype.

    State per parameter with a gradient: 'master', 'exp_avg', 'exp_avg_sq' (fp32, on
    master_home(p)) and 'step' (an int). Gradients of any dtype are widened to fp32; the updated
    master is rounded into the parameter. master_device: None or the parameters' device type
    (e.g. 'cuda': on each parameter's own device) or 'cpu' (the update runs on the CPU; pinned
    memory for CUDA parameters). host_scope: a context manager entered around the state's
    allocation and arithmetic (memory_tools.LiveBytes marks those tensors as host memory when
    it emulates offloading on a single device).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 master_device=None, host_scope=nullcontext):
        check_adamw_settings(lr, betas, eps, weight_decay)
        self._init_master(master_device, host_scope)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is None:  # frozen (e.g. by layer cycling): no state, no update
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MasterAdamW does not support sparse gradients")
                state = self.state[p]
                with self.host_scope():
                    if 'master' not in state:
                        state.update(exp_avg=self._state_zeros(p, p.shape),
                                     exp_avg_sq=self._state_zeros(p, p.shape), step=0)
                    master = self._master(p, state)
                    state['step'] += 1
                    grad = self._widened_grad(p, master)
                    adamw_step_(master, grad, state['exp_avg'], state['exp_avg_sq'], state['step'],
                                group['lr'], group['betas'], group['eps'], group['weight_decay'])
                    del grad
                self._round_into(p, master)
        return loss
