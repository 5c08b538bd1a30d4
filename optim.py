"""The optimizers of the model's parameters: nanoGPT's decay split and AdamW; AdamW's arithmetic, once
(adamw_step_, bitwise torch.optim.AdamW's); MasterAdamW, AdamW on fp32 master weights of low-precision
parameters (MasterWeights, shared with galore.GaLoreAdamW; docs/precision.md)."""

from contextlib import nullcontext

import torch

from configurator import one_of

RULES = {'optimizer': one_of('adamw', 'sgd')}
FIXED_ON_RESUME = {'optimizer': 'its optimizer state is that optimizer\'s'}


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's decay split: matrices and embeddings decay, biases and norm weights don't. Every parameter,
    frozen or not (layer cycling unfreezes them later). A fork's group may carry 'lr_scale' (Trainer.step)."""
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{'params': decay, 'weight_decay': weight_decay}, {'params': no_decay, 'weight_decay': 0.0}]


def adamw(model, weight_decay, learning_rate, betas, device_type):
    extra_args = dict(fused=True) if device_type == 'cuda' else dict()
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=learning_rate, betas=betas, **extra_args)


def check_adamw_settings(lr, betas, eps, weight_decay):
    if lr < 0 or eps < 0 or weight_decay < 0 or len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"invalid AdamW settings lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")


def adamw_foreach_(params, grads, exp_avgs, exp_avg_sqs, steps, lr, betas, eps, weight_decay):
    """adamw_step_ (without `back`) on lists of tensors, op for op: bitwise where foreach_bitwise says so."""
    beta1, beta2 = betas
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denoms, [(1 - beta2**step) ** 0.5 for step in steps])
    torch._foreach_add_(denoms, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1**step) for step in steps])


def foreach_bitwise(device):
    """Whether adamw_foreach_ on `device` is bitwise adamw_step_: the CPU (meta stands in for CUDA)."""
    return torch.device(device).type == 'cpu'


def adamw_step_(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay, back=None, scale=1.0):
    """One AdamW step in place, torch.optim.AdamW(foreach=False)'s op for op; `step` counts from 1. With `back`
    (GaLore) grad and moments are projected: back() maps the update exp_avg / denom to param's shape, times `scale`."""
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)  # ** 0.5 as torch writes it
    if back is None:
        param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    else:
        param.add_(back(exp_avg / denom), alpha=-lr * scale / bias_correction1)


class HostStaging:
    """Pinned host buffers per (shape, dtype, slot), kept across steps, for copies between CUDA parameters and
    their CPU masters (pin=False: ordinary host memory, the tests' CPU seam)."""

    def __init__(self, pin=True):
        self.pin = pin
        self.buffers = {}  # (shape, dtype, slot) -> host tensor
        self.uploads = {}  # (shape, dtype, slot) -> the event recorded after its last copy up (CUDA)

    def buffer(self, shape, dtype, slot=0):
        """The buffer, free for the CPU to write (earlier copies up done)."""
        key = (tuple(shape), dtype, slot)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(key[0], dtype=dtype, pin_memory=self.pin)
        event = self.uploads.pop(key, None)
        if event is not None:
            event.synchronize()
        return self.buffers[key]

    def download(self, t, slot=0):
        """Start copying device tensor `t` into its buffer; wait() before reading it."""
        return self.buffer(t.shape, t.dtype, slot).copy_(t, non_blocking=True)

    @staticmethod
    def wait(device):
        if device.type == 'cuda':
            torch.cuda.current_stream(device).synchronize()

    def upload(self, buf, target, slot=0):
        """Copy `buf` (one of ours) into device tensor `target`, asynchronously from CUDA."""
        target.copy_(buf, non_blocking=True)
        if target.is_cuda:
            self.uploads[(tuple(buf.shape), buf.dtype, slot)] = torch.cuda.current_stream(target.device).record_event()


class MasterWeights:
    """fp32 master weights, a mixin for torch.optim.Optimizer subclasses (call _init_master() before its __init__):
    state['master'] is made from the weight at its first step (again after 'drop'), the grad widened to fp32 there,
    the master rounded back into the parameter. Every state tensor lives on master_home(p)."""

    master = True
    stage = None  # staging (HostStaging): None for CUDA parameters with CPU masters; True forces it (tests)

    def _init_master(self, master_device=None, host_scope=nullcontext):
        self.master_device = None if master_device is None else torch.device(master_device)
        self.host_scope = host_scope
        self.staging = None  # HostStaging, made at the first staged copy
        self.staged = {}  # param -> (its gradient's host buffer, slot), between _stage_grads and _round_into

    def master_home(self, p):
        """master_device, unless None or of p's own device type ('cuda' for p on cuda:1 means cuda:1)."""
        if self.master_device is None or self.master_device.type == p.device.type:
            return p.device
        return self.master_device

    def _stages(self, p):
        return (p.is_cuda and self.master_home(p).type == 'cpu') if self.stage is None else self.stage

    def _staging(self, p):
        if self.staging is None:
            self.staging = HostStaging(pin=p.is_cuda)
        return self.staging

    def _stage_grads(self, params):
        """Start copying the gradient of every staged parameter into its own host buffer, then wait once."""
        self.staged, slots, devices = {}, {}, set()
        for p in params:
            if p.grad is not None and self._stages(p):
                key = (tuple(p.grad.shape), p.grad.dtype)
                slot = slots[key] = slots.get(key, -1) + 1  # same-shaped parameters: a buffer each
                self.staged[p] = (self._staging(p).download(p.grad, slot), slot)
                devices.add(p.device)
        for device in devices:
            self.staging.wait(device)

    def _state_zeros(self, p, shape):  # a moment of p (shape: p's, or GaLore's projected one)
        return torch.zeros(shape, dtype=torch.float32, device=self.master_home(p))

    def _master(self, p, state):
        if 'master' not in state:  # first step, or the first after 'drop' freed the state
            weight = p.detach()
            if self._stages(p):  # down in the weight's dtype through a buffer of its own (slot -1)
                weight = self._staging(p).download(weight, slot=-1)
                self.staging.wait(p.device)
            state['master'] = torch.empty(p.shape, dtype=torch.float32, device=self.master_home(p)).copy_(weight)
        return state['master']

    def _widened_grad(self, p, master):
        """p's gradient in fp32 where the master is: across in the grad's dtype, then widened."""
        if not self._stages(p):
            return p.grad.to(master.device).float()
        if p not in self.staged:  # not staged by _stage_grads (GaLoreAdamW): this one alone, now
            self.staged[p] = (self._staging(p).download(p.grad), 0)
            self.staging.wait(p.device)
        return self.staged[p][0].to(torch.float32, copy=True)  # the buffer carries the rounded weight up next

    def _round_into(self, p, master):
        if self._stages(p):
            buf, slot = self.staged.pop(p, (None, 0))
            if buf is None or buf.dtype != p.dtype:
                buf = self.staging.buffer(p.shape, p.dtype, slot)
            with self.host_scope():
                buf.copy_(master)  # rounded where the master is (as master.to(p.dtype)), into the buffer
            self.staging.upload(buf, p.detach(), slot)
            return
        with self.host_scope():
            rounded = master.to(p.dtype)  # rounded where the master is: fewer bytes to copy
        p.copy_(rounded)  # outside the scope: the parameter stays device memory for LiveBytes

    def load_state_dict(self, state_dict):
        """As torch's, but the state keeps its dtype (torch casts fp32 masters to bf16) and goes to master_home(p)."""
        if not self.master:
            return super().load_state_dict(state_dict)
        super().load_state_dict({**state_dict, 'state': {}})
        saved_ids = [i for g in state_dict['param_groups'] for i in g['params']]
        params = [p for g in self.param_groups for p in g['params']]
        for i, p in zip(saved_ids, params):
            if i in state_dict['state']:
                self.state[p] = {  # .to(): no copy when already there, as torch's loading
                    key: value.to(self.master_home(p)) if torch.is_tensor(value) else value
                    for key, value in state_dict['state'][i].items()
                }


class MasterAdamW(MasterWeights, torch.optim.Optimizer):
    """AdamW on fp32 masters (state 'master', 'exp_avg', 'exp_avg_sq' on master_home(p), an int 'step') of parameters
    that keep their dtype. host_scope wraps the state's allocation and arithmetic (memory_estimate: host memory).
    foreach=True: adamw_foreach_ on FOREACH_BYTES of gradients at once where bitwise (off: a lower peak)."""

    FOREACH_BYTES = 256 * 2**20

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        master_device=None,
        host_scope=nullcontext,
        foreach=False,
    ):
        check_adamw_settings(lr, betas, eps, weight_decay)
        self._init_master(master_device, host_scope)
        self.foreach = foreach
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group['params'] if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("MasterAdamW does not support sparse gradients")
        self._stage_grads(params)  # the gradients of CUDA parameters with CPU masters come down together
        for group in self.param_groups:
            settings = (group['lr'], group['betas'], group['eps'], group['weight_decay'])
            batch, nbytes = [], 0
            for p in group['params']:
                if p.grad is None:  # frozen (e.g. by layer cycling): no state, no update
                    continue
                state = self.state[p]
                with self.host_scope():
                    if 'master' not in state:
                        state.update(
                            exp_avg=self._state_zeros(p, p.shape), exp_avg_sq=self._state_zeros(p, p.shape), step=0
                        )
                    master = self._master(p, state)
                    state['step'] += 1
                    grad = self._widened_grad(p, master)
                if self.foreach and foreach_bitwise(master.device):
                    batch.append((p, master, grad, state))
                    nbytes += grad.numel() * grad.element_size()
                    if nbytes >= self.FOREACH_BYTES:
                        self._update_together(batch, settings)
                        batch, nbytes = [], 0
                    continue
                with self.host_scope():
                    adamw_step_(master, grad, state['exp_avg'], state['exp_avg_sq'], state['step'], *settings)
                    del grad
                self._round_into(p, master)
            self._update_together(batch, settings)
        return loss

    def _update_together(self, batch, settings):
        """adamw_foreach_ on a batch of (param, master, widened grad, state), then each rounded into its param."""
        if not batch:
            return
        by_device = {}
        for item in batch:
            by_device.setdefault(item[1].device, []).append(item)
        with self.host_scope():
            for items in by_device.values():
                adamw_foreach_(
                    [m for _, m, _, _ in items],
                    [g for _, _, g, _ in items],
                    [s['exp_avg'] for *_, s in items],
                    [s['exp_avg_sq'] for *_, s in items],
                    [s['step'] for *_, s in items],
                    *settings,
                )
        for p, master, _, _ in batch:
            self._round_into(p, master)
        batch.clear()  # the widened gradients go
