"""
The one builder and the one training step. train.py, bench.py, bench_memory.py and
experiments/compare.py all use them, so a benchmark measures the iteration that train.py runs.

Configs are dicts with train.py's keys. Precision (`precision`):
- 'amp': fp32 weights, gradients and optimizer state; the forward runs under autocast in `dtype`
  on CUDA (bfloat16, or float16 with loss scaling), in fp32 on CPU. nanoGPT's setting.
- 'bf16': everything in bf16: weights, gradients, AdamW moments (the paper's memory table).
- 'bf16_master': bf16 weights and gradients; the optimizer keeps an fp32 master copy and fp32
  moments of the parameters that train now only (BAdam's idea, optim.MasterAdamW), on the device
  or, with master_device='cpu', on the CPU together with the AdamW arithmetic (ZeRO-Offload style).
"""
import math
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import galore
import memory_options
import omgd
from model import Transformer, TransformerConfig, PRESETS
from optim import MasterAdamW, adamw, param_groups
from train_config import GALORE_METHODS, PTDTYPES

ARCH_KEYS = ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias', 'vocab_size', 'norm_eps',
             'rope_theta')


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


def gpt_kwargs(cfg, vocab_size=0):
    """TransformerConfig keywords from the config's model keys (a preset's architecture overrides them).
    vocab_size: the dataset's (0: the config's, else the preset's, else GPT-2's padded 50304)."""
    vocab_size = vocab_size or cfg['vocab_size']
    args = {k: cfg[k] for k in ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias',
                                'block_size', 'dropout')}
    args['vocab_size'] = vocab_size or 50304
    if cfg['preset']:
        args.update({k: v for k, v in PRESETS[cfg['preset']].items() if k in ARCH_KEYS})
        args['vocab_size'] = vocab_size or PRESETS[cfg['preset']]['vocab_size']
    return args


class RandomOnCPU(TorchDispatchMode):
    """In-place random fills (normal_, uniform_) of tensors that are not fp32 on the CPU are drawn
    on the CPU in fp32 from torch's default generator, then copied (cast) into the tensor: a model
    initialised on a GPU, or in bf16, gets bitwise the weights of a CPU fp32 build then cast, for
    the same seed, one tensor of host memory at a time."""
    FILLS = (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func in self.FILLS and (target.device.type != 'cpu' or target.dtype != torch.float32):
            drawn = func(torch.empty(target.shape, dtype=torch.float32, device='cpu'), *args[1:], **kwargs)
            return target.copy_(drawn)
        return func(*args, **kwargs)


def new_model(config, device, dtype=torch.float32, cpu_draws=True):
    """A freshly initialised GPT built directly on `device` with `dtype` weights: never a full fp32
    copy on the host (LLaMA-7B: 27 GB before it reached the GPU). Built on meta, then filled with
    the random draws of a CPU build in their order (the modules' constructors, then init_weights),
    so the weights are bitwise those of Transformer(config) cast to `dtype`, whatever the device.
    cpu_draws=False draws on `device` instead (the benchmarks, whose figures do not depend on the
    values: LLaMA-7B's 13 billion CPU draws take minutes)."""
    with torch.device('meta'):
        model = Transformer(config)
    if torch.device(device).type == 'meta':  # shapes only (bench_memory's estimate): nothing to draw
        return model.to(dtype)
    model.to(dtype).to_empty(device=device)
    if config.tie_embeddings:  # to_empty gives every parameter its own storage
        model.wte.weight = model.lm_head.weight
    with torch.no_grad(), RandomOnCPU() if cpu_draws else nullcontext():
        for module in model.modules():  # what the constructors drew, in their order
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.reset_parameters()
        model.init_weights()
    return model.to(dtype)  # the buffers init_weights recomputed in fp32 (LLaMA's rotary tables)


def configure_memory(model, cfg):
    """The model's activation-memory options (memory_options.py): checkpointing, offload to the host, chunked loss."""
    return memory_options.apply(model, activation_checkpointing=cfg['activation_checkpointing'],
                        checkpoint_sublayers=cfg['checkpoint_sublayers'],
                        activation_offload=cfg['activation_offload'], loss_chunk=cfg['loss_chunk'])


def weight_dtype(precision):
    """The dtype of the weights: fp32 under 'amp', bf16 under 'bf16' and 'bf16_master'."""
    return torch.float32 if precision == 'amp' else torch.bfloat16


def cast_model(model, precision):
    """bf16 weights for 'bf16' and 'bf16_master' (in place: the Parameter objects stay the same)."""
    if precision != 'amp':
        model.to(weight_dtype(precision))
    return model


def autocast_context(cfg, device_type):
    """'amp' on CUDA: autocast in cfg['dtype']. CPU, meta (bench_memory emulates CUDA), the bf16 precisions: none."""
    if cfg['precision'] != 'amp' or device_type != 'cuda' or cfg['dtype'] == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=PTDTYPES[cfg['dtype']])


def grad_scaler(cfg, device_type):
    """nanoGPT's loss scaling for float16 autocast, a no-op otherwise. On CPU (fp32 compute) it
    only scales by a power of two and back, which lets tests run this path."""
    enabled = cfg['precision'] == 'amp' and cfg['dtype'] == 'float16' and device_type != 'meta'  # meta: shapes only
    return torch.amp.GradScaler(device_type, enabled=enabled)


def build_optimizer(model, cfg, device_type, host_scope=nullcontext):
    """The optimizer over ALL parameters, built before anything is frozen, so every block can train
    later (LMFlow's bug: an optimizer over the trainable parameters only never trains the others)."""
    betas, lr, wd = (cfg['beta1'], cfg['beta2']), cfg['learning_rate'], cfg['weight_decay']
    master = cfg['precision'] == 'bf16_master'
    if cfg['method'] in GALORE_METHODS:
        svd_steps = math.ceil(cfg['golore_svd_fraction'] * cfg['max_iters']) if cfg['method'] == 'golore' else 0
        return galore.build_optimizer(model, wd, lr, betas, rank=cfg['galore_rank'],
                                      update_proj_gap=cfg['galore_update_proj_gap'], scale=cfg['galore_scale'],
                                      projection='svd' if cfg['method'] == 'galore' else 'random',
                                      seed=cfg['omgd_seed'], svd_steps=svd_steps, master=master,
                                      master_device=cfg['master_device'] or None, host_scope=host_scope)
    if master:
        return MasterAdamW(param_groups(model, wd), lr=lr, betas=betas, master_device=cfg['master_device'] or None,
                           host_scope=host_scope)
    if cfg['optimizer'] == 'adamw':
        return adamw(model, wd, lr, betas, device_type)
    return torch.optim.SGD(param_groups(model, wd), lr=lr, momentum=cfg['momentum'])


def build_cycler(model, optimizer, cfg):
    """omgd's layer cycler for the config's method ('full' for GaLore/GoLore: every block trains)."""
    method = 'full' if cfg['method'] in GALORE_METHODS else cfg['method']
    config = omgd.CyclerConfig(method, cfg['omgd_gamma'], cfg['omgd_period'], cfg['omgd_warmup'], cfg['omgd_ratio'],
                               cfg['omgd_state'], cfg['omgd_seed'],
                               tuple(part for part in cfg['omgd_always'].split(',') if part))
    return omgd.build_cycler(model, optimizer, config)


def build(cfg, device, vocab_size=0, model=None, shard=None, cpu_draws=True, host_scope=nullcontext):
    """The model, its optimizer and its cycler, as every script trains them.

    model: an already built model (a resume, a pretrained import); None builds one from scratch,
    directly on `device` in its weight dtype (new_model; seed the RNG before: the init draws from it). shard(model): a hook that runs after the model
    is on its device and before the optimizer sees its parameters (train.py's FSDP2 sharding).
    cpu_draws: new_model's. host_scope: the fp32 masters' (optim.MasterWeights): the memory estimate
    counts what is allocated inside it as host memory."""
    if model is None:
        model = new_model(TransformerConfig(**gpt_kwargs(cfg, vocab_size)), device, weight_dtype(cfg['precision']), cpu_draws)
    cast_model(configure_memory(model, cfg), cfg['precision']).to(device)
    if shard is not None:
        shard(model)
    optimizer = build_optimizer(model, cfg, torch.device(device).type, host_scope)  # over ALL parameters
    return model, optimizer, build_cycler(model, optimizer, cfg)


class Trainer:
    """One run's iteration and everything it touches: config, model, optimizer, layer cycler, the
    parallel model that syncs gradients, loss scaler, the training batches and their position, and the
    iteration counter. train.py, the benchmarks and the experiments drive the same object.

    batches: an iterator of (x, y, position) micro-batches (dataloader.TokenBatches.iterate; the
    benchmarks yield random ones with position None). The step fetches one micro-batch ahead, so
    `data_position` is the position of the batch held for the next step: what a checkpoint stores.
    parallel: distributed.ParallelModel (DDP/FSDP); None trains `model` in this process.
    grad_accum: micro-steps of this rank per iteration (default: the config's).
    autocast, backward: replace the config's autocast and loss.backward() (bench_memory's meta device).
    observer: an object with after_switch(trainer, switched) and/or before_zero_grad(trainer),
    called inside each step (--ddp_check, the experiments' probes); None in a plain run.
    """

    def __init__(self, cfg, model, optimizer, cycler, batches, device_type='cpu', grad_accum=None, parallel=None,
                 autocast=None, backward=None, observer=None):
        self.cfg, self.model, self.optimizer, self.cycler, self.parallel = cfg, model, optimizer, cycler, parallel
        self.batches, self.batch = batches, None
        self.grad_accum = grad_accum or cfg['gradient_accumulation_steps']
        self.autocast = autocast if autocast is not None else autocast_context(cfg, device_type)
        self.scaler = grad_scaler(cfg, device_type)  # float16 gradients underflow without loss scaling
        self.backward, self.observer = backward, observer
        self.iter_num = 0

    @property
    def data_position(self):
        """Where the training data continues: the position of the batch fetched for the next step."""
        return self.batch[2] if self.batch is not None else None

    def next_batch(self):
        x, y, position = self.batch = next(self.batches)
        return x, y

    def step(self):
        """Iteration `iter_num`: learning rate, switch, prefetch, DDP rebuild, then train_step.
        Returns (the loss as a detached tensor, whether the cycler switched)."""
        it = self.iter_num
        for group in self.optimizer.param_groups:
            group['lr'] = get_lr(it, self.cfg)
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
        loss = self.train_step(model, sync)
        self.iter_num += 1
        return loss, switched

    def train_step(self, model, sync=None):
        """One optimizer step over grad_accum micro-batches; returns the loss (detached tensor).

        The next micro-batch is fetched right after each forward, so the host prepares data while
        the GPU computes. The OMGD scale goes once per step, after all micro-steps, before or after
        clipping (cfg's omgd_scale_after_clip: the paper's code clips first). loss: the last
        micro-batch's (no sync here). sync(last): DDP/FSDP gradient sync on the last micro-step only.
        """
        grad_accum, scaler = self.grad_accum, self.scaler or torch.amp.GradScaler(enabled=False)
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
            # frozen parameters hold no gradient (None), which clip_grad_norm_ skips
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
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
        """{split: mean loss} over eval_iters fixed batches of each split (the same windows at
        every evaluation), averaged over ranks; the model is left in training mode."""
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
            out[split] = ranks.mean(value, device) if ranks is not None else value
        self.model.train()
        return out

    def state_objects(self):
        """The objects whose state_dict() a checkpoint holds (checkpoint.py)."""
        return {'model': self.model, 'optimizer': self.optimizer, 'cycler': self.cycler, 'scaler': self.scaler}


def random_batches(vocab_size, shape, device):
    """Endless random (x, y, None) micro-batches on `device`: the benchmarks' data."""
    while True:
        yield (torch.randint(0, vocab_size, shape, device=device), torch.randint(0, vocab_size, shape, device=device),
               None)


# -----------------------------------------------------------------------------
# model FLOPs utilization (MFU), as in the log line of train.py and in bench.py

# peak dense bf16 tensor FLOP/s per GPU, from NVIDIA's datasheets (their "with sparsity" figures
# halved). An entry matches a GPU when each of its words is a word of torch.cuda.get_device_name()
# (case-insensitive, in any order, whole words: 'H100' is not a word of 'GH100'), and the matching
# entry with the most words wins, so a variant's entry beats its family's: 'NVIDIA H100 NVL' gets
# 'H100 NVL', 'NVIDIA H100 80GB HBM3' (the SXM part) gets 'H100'. Two best matches of the same
# length are ambiguous: no MFU, rather than a wrong one.
PEAK_BF16_FLOPS = {
    'H100': 989.4e12,  # SXM5; its name has no variant word ('NVIDIA H100 80GB HBM3')
    'H100 PCIe': 756e12, 'H100 NVL': 835e12,
    'H200': 989e12,  # SXM ('NVIDIA H200')
    'H200 NVL': 835e12, 'GH200': 989e12,
    'A100': 312e12,  # SXM4 and PCIe alike
    'B200': 2250e12, 'L40S': 362e12, 'L4': 121e12, 'A10': 125e12, 'A10G': 125e12, 'RTX 4090': 165e12,
}


def _words(name):
    import re
    return re.findall(r'[a-z0-9]+', name.lower())


def peak_for_name(name):
    """PEAK_BF16_FLOPS' figure for a GPU named `name`, or None (no entry, or an ambiguous name)."""
    words = set(_words(name))
    matches = [(len(_words(key)), flops) for key, flops in PEAK_BF16_FLOPS.items() if set(_words(key)) <= words]
    if not matches:
        return None
    best = max(n for n, _ in matches)
    flops = {f for n, f in matches if n == best}
    return flops.pop() if len(flops) == 1 else None


def peak_bf16_flops(device):
    """The GPU's peak from PEAK_BF16_FLOPS, or None (CPU, unknown GPU: no MFU is reported)."""
    device = torch.device(device)
    if device.type != 'cuda':
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def mfu(flops_per_token, tokens_per_iter, dt, peak_flops, world_size=1):
    """The share of `world_size` GPUs' peak FLOP/s that an iteration of `dt` seconds used."""
    return flops_per_token * tokens_per_iter / dt / (peak_flops * world_size)
