"""Trainer, the owner of one training iteration (train.py, the benchmarks and the experiments step the same one),
and what it needs around it: the learning rate (get_lr), autocast and the loss scaler."""

import math
from contextlib import nullcontext

import torch

from model import DTYPES


def get_lr(it, cfg):
    """The learning rate of iteration `it`: linear warm-up, then cosine decay to min_lr (nanoGPT's)."""
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it > cfg['lr_decay_iters']:
        return cfg['min_lr']
    decay_ratio = (it - cfg['warmup_iters']) / max(1, cfg['lr_decay_iters'] - cfg['warmup_iters'])
    return cfg['min_lr'] + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg['learning_rate'] - cfg['min_lr'])


def autocast_context(cfg, device_type):
    """'amp' on CUDA: autocast in cfg['dtype']; else (CPU, meta, the bf16 precisions) none."""
    if cfg['precision'] != 'amp' or device_type != 'cuda' or cfg['dtype'] == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=DTYPES[cfg['dtype']])


def grad_scaler(cfg, device_type):
    """nanoGPT's loss scaling for float16 autocast, a no-op otherwise."""
    enabled = cfg['precision'] == 'amp' and cfg['dtype'] == 'float16' and device_type != 'meta'  # meta: shapes only
    return torch.amp.GradScaler(device_type, enabled=enabled)


class Trainer:
    """One run's iteration. batches: (x, y, position) micro-batches, fetched one ahead. parallel: ParallelModel or
    None. grad_accum: this rank's micro-steps. autocast, backward: replace the config's (the meta device). observer:
    after_switch(trainer, switched) and/or before_zero_grad(trainer), called each step (--ddp_check, probes)."""

    def __init__(
        self,
        cfg,
        model,
        optimizer,
        cycler,
        batches,
        device_type='cpu',
        grad_accum=None,
        parallel=None,
        autocast=None,
        backward=None,
        observer=None,
        iter_num=0,
    ):
        self.cfg, self.model, self.optimizer, self.cycler, self.parallel = cfg, model, optimizer, cycler, parallel
        self.batches, self.batch = batches, None
        self.grad_accum = grad_accum or cfg['gradient_accumulation_steps']
        self.autocast = autocast if autocast is not None else autocast_context(cfg, device_type)
        self.scaler = grad_scaler(cfg, device_type)  # float16 gradients underflow without loss scaling
        self.backward, self.observer, self.iter_num = backward, observer, iter_num

    @property
    def data_position(self):
        return self.batch[2] if self.batch is not None else None

    def next_batch(self):
        x, y, position = self.batch = next(self.batches)
        return x, y

    def step(self, iter_num=None, micro_steps=None):
        """Iteration `iter_num` (default: the next); returns (the detached loss, whether the cycler switched)."""
        it = self.iter_num if iter_num is None else iter_num
        lr = get_lr(it, self.cfg)
        for group in self.optimizer.param_groups:  # a group's own lr_scale (optim.py) scales the schedule's rate
            group['lr'] = lr * group['lr_scale'] if 'lr_scale' in group else lr
        switched = self.cycler.step(it)
        self.cycler.prefetch(it)  # on a period's last iteration: start copying back the next group's offloaded state
        model, sync = self.model, None
        if self.parallel is not None:
            if switched or self.parallel.model is None:
                self.parallel.on_switch()
            model, sync = self.parallel.model, self.parallel.sync if self.parallel.ranks.enabled else None
        after_switch = getattr(self.observer, 'after_switch', None)
        if after_switch is not None:
            after_switch(self, switched)
        loss = self.train_step(model, sync, micro_steps)
        self.iter_num = it + 1
        return loss, switched

    def train_step(self, model, sync=None, micro_steps=None):
        """One optimizer step over grad_accum (or micro_steps) micro-batches; returns the last one's loss (detached,
        not synced). The next micro-batch is fetched right after each forward, while the GPU computes."""
        grad_accum, scaler = micro_steps or self.grad_accum, self.scaler
        grad_clip, scale_after_clip = self.cfg['grad_clip'], self.cfg['omgd_scale_after_clip']
        if self.batch is None:
            self.next_batch()
        X, Y = self.batch[:2]
        for micro_step in range(grad_accum):
            if sync is not None:
                sync(micro_step == grad_accum - 1)
            with self.autocast:
                loss = model(X, Y)[1] / grad_accum  # [1]: keep no reference to the logits
            X, Y = self.next_batch()
            scaled = scaler.scale(loss)
            scaled.backward() if self.backward is None else self.backward(scaled)
        scaler.unscale_(self.optimizer)  # the true gradients, for the clipping and the OMGD scale
        if not scale_after_clip:
            self.cycler.scale_grads()
        if grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)  # skips frozen parameters (grad None)
        if scale_after_clip:
            self.cycler.scale_grads()
        scaler.step(self.optimizer)  # with float16: skipped when a gradient overflowed, and the scale lowered
        scaler.update()
        before_zero_grad = getattr(self.observer, 'before_zero_grad', None)
        if before_zero_grad is not None:
            before_zero_grad(self)
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach() * grad_accum

    @torch.no_grad()
    def evaluate(self, eval_batches, eval_iters, ranks=None, device='cpu'):
        """{split: mean loss} over the same eval_iters batches of each split every time, averaged over ranks."""
        out = {}
        self.model.eval()
        for split, batches in eval_batches.items():
            batches.load_state_dict(batches.start)
            losses = torch.zeros(eval_iters, device=device)  # on the device: one sync per split, not per batch
            for k in range(eval_iters):
                X, Y = batches.next_batch(device)
                with self.autocast:
                    _, loss = self.model(X, Y)
                losses[k] = loss
            value = losses.mean().item()
            out[split] = ranks.mean(value, device) if ranks is not None else value  # mean: the value on one process
        self.model.train()
        return out

    def values(self):
        """The log's values beside the loss: `lr` as applied (`lr_g<i>` per group when they differ); a fork's too."""
        rates = [group['lr'] for group in self.optimizer.param_groups]
        if len(set(rates)) == 1:
            return {'lr': rates[0]}
        return {f'lr_g{i}': rate for i, rate in enumerate(rates)}

    def state_objects(self):
        """The objects whose state_dict() a checkpoint holds (infra/checkpoint.py)."""
        return {'model': self.model, 'optimizer': self.optimizer, 'cycler': self.cycler, 'scaler': self.scaler}


def random_batches(vocab_size, shape, device):
    """Endless random (x, y, None) micro-batches on `device`: the benchmarks' data."""
    while True:
        x, y = (torch.randint(0, vocab_size, shape, device=device) for _ in range(2))
        yield x, y, None
