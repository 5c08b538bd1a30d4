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

import galore
import omgd
from model import GPT, GPTConfig, PRESETS, param_groups
from optim import MasterAdamW

PRECISIONS = ('amp', 'bf16', 'bf16_master')
GALORE_METHODS = ('galore', 'golore')  # galore.py's optimizers; every block trains
METHOD_NAMES = (*omgd.METHODS, *GALORE_METHODS)
PTDTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
ARCH_KEYS = ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias', 'vocab_size', 'norm_eps',
             'rope_theta')


def check_config(cfg):
    """Raise a one-line ValueError for values that cannot train together (nothing is built yet)."""
    if cfg['parallel'] not in ('ddp', 'fsdp'):
        raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {cfg['parallel']!r}")
    if cfg['init_from'] not in ('scratch', 'resume') and not cfg['init_from'].startswith('gpt2'):
        raise ValueError(f"init_from must be 'scratch', 'resume' or a GPT-2 name, got {cfg['init_from']!r}")
    if cfg['preset'] and cfg['preset'] not in PRESETS:
        raise ValueError(f"unknown preset {cfg['preset']!r}; choose one of {', '.join(PRESETS)}")
    if cfg['method'] not in METHOD_NAMES:
        raise ValueError(f"unknown method {cfg['method']!r}; choose one of {', '.join(METHOD_NAMES)}")
    if cfg['optimizer'] not in ('adamw', 'sgd'):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {cfg['optimizer']!r}")
    if cfg['dtype'] not in PTDTYPES:
        raise ValueError(f"unknown dtype {cfg['dtype']!r}; choose one of {', '.join(PTDTYPES)}")
    if cfg['precision'] not in PRECISIONS:
        raise ValueError(f"unknown precision {cfg['precision']!r}; choose one of {', '.join(PRECISIONS)}")
    if cfg['master_device'] not in ('', 'cpu'):
        raise ValueError(f"master_device must be '' (the weights' device) or 'cpu', got {cfg['master_device']!r}")
    if cfg['master_device'] and cfg['precision'] != 'bf16_master':
        raise ValueError(f"master_device={cfg['master_device']!r} places fp32 master weights, which only "
                         f"precision='bf16_master' has; add --precision=bf16_master")
    if cfg['precision'] != 'amp' and cfg['dtype'] == 'float16':
        raise ValueError(f"dtype='float16' is the autocast dtype of precision='amp'; precision={cfg['precision']!r} "
                         f"trains bf16 weights: drop --dtype or use --precision=amp")
    if cfg['precision'] == 'bf16_master' and cfg['optimizer'] == 'sgd' and cfg['method'] not in GALORE_METHODS:
        raise ValueError("precision='bf16_master' keeps AdamW's fp32 master weights; use --optimizer=adamw, "
                         "or --precision=bf16 for SGD on bf16 weights")
    if not 0 <= cfg['golore_svd_fraction'] <= 1:
        raise ValueError(f"golore_svd_fraction must be in [0, 1], got {cfg['golore_svd_fraction']}")
    if cfg['loss_chunk'] < 0:
        raise ValueError(f"loss_chunk must be >= 0 tokens (0: the whole micro-batch at once), got {cfg['loss_chunk']}")
    if cfg['gradient_accumulation_steps'] < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {cfg['gradient_accumulation_steps']}")


def check_parallel(cfg, world_size, fsdp):
    """Raise a one-line ValueError for values that cannot train on `world_size` ranks, sharded with
    FSDP2 (fsdp=True) or not; known once the process group is up (distributed.setup)."""
    if fsdp and cfg['dtype'] == 'float16':
        # GradScaler's overflow check would see only this rank's gradient shards, so ranks could disagree
        raise ValueError("dtype='float16' is not supported with parallel='fsdp' (its loss scaling sees only local "
                         "shards); use --dtype=bfloat16")
    if fsdp and cfg['omgd_state'] == 'offload':
        raise ValueError("omgd_state='offload' is not supported with parallel='fsdp' (the sharded optimizer state "
                         "stays on its device); use --omgd_state=drop or --omgd_state=keep")
    if fsdp and cfg['precision'] == 'bf16_master':
        raise ValueError("precision='bf16_master' is not supported with parallel='fsdp' (FSDP2 keeps fp32 shards and "
                         "computes in bf16 under precision='amp', which is its own master-weight scheme); use "
                         "--precision=amp")
    if fsdp and cfg['method'] in GALORE_METHODS:
        raise ValueError(f"method={cfg['method']!r} is not supported with parallel='fsdp' (its projections need "
                         f"whole gradients); use --parallel=ddp")
    steps = cfg['gradient_accumulation_steps']
    if steps % world_size:
        raise ValueError(f"gradient_accumulation_steps={steps} counts micro-steps summed over all ranks and must be "
                         f"a multiple of the {world_size} ranks, e.g. --gradient_accumulation_steps="
                         f"{world_size * math.ceil(steps / world_size)} (tokens per iteration = "
                         f"gradient_accumulation_steps x batch_size x block_size)")


def model_args(cfg, vocab_size=0):
    """GPTConfig keywords from the config's model keys (a preset's architecture overrides them).
    vocab_size: the dataset's (0: the config's, else the preset's, else GPT-2's padded 50304)."""
    vocab_size = vocab_size or cfg['vocab_size']
    args = {k: cfg[k] for k in ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias',
                                'block_size', 'dropout')}
    args['vocab_size'] = vocab_size or 50304
    if cfg['preset']:
        args.update({k: v for k, v in PRESETS[cfg['preset']].items() if k in ARCH_KEYS})
        args['vocab_size'] = vocab_size or PRESETS[cfg['preset']]['vocab_size']
    return args


def configure_memory(model, cfg):
    """The model's activation-memory options (model.py): checkpointing, offload to the host, chunked loss."""
    model.activation_checkpointing = cfg['activation_checkpointing']
    model.checkpoint_sublayers = cfg['checkpoint_sublayers']
    model.activation_offload = cfg['activation_offload']
    model.loss_chunk = cfg['loss_chunk']
    return model


def cast_model(model, precision):
    """bf16 weights for 'bf16' and 'bf16_master' (in place: the Parameter objects stay the same)."""
    if precision != 'amp':
        model.to(torch.bfloat16)
    return model


def autocast(cfg, device_type):
    """'amp' on CUDA: autocast in cfg['dtype']. CPU, and the bf16 precisions: none."""
    if cfg['precision'] != 'amp' or device_type == 'cpu' or cfg['dtype'] == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=PTDTYPES[cfg['dtype']])


def grad_scaler(cfg, device_type):
    """nanoGPT's loss scaling for float16 autocast, a no-op otherwise. On CPU (fp32 compute) it
    only scales by a power of two and back, which lets tests run this path."""
    return torch.amp.GradScaler(device_type, enabled=cfg['precision'] == 'amp' and cfg['dtype'] == 'float16')


def build_optimizer(model, cfg, device_type):
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
                                      master_device=cfg['master_device'] or None)
    if master:
        return MasterAdamW(param_groups(model, wd), lr=lr, betas=betas, master_device=cfg['master_device'] or None)
    if cfg['optimizer'] == 'adamw':
        return model.configure_optimizers(wd, lr, betas, device_type)
    return torch.optim.SGD(param_groups(model, wd), lr=lr, momentum=cfg['momentum'])


def build_cycler(model, optimizer, cfg):
    """omgd's layer cycler for the config's method ('full' for GaLore/GoLore: every block trains)."""
    method = 'full' if cfg['method'] in GALORE_METHODS else cfg['method']
    return omgd.build_cycler(model, optimizer, method, cfg['omgd_gamma'], cfg['omgd_period'], cfg['omgd_warmup'],
                             cfg['omgd_ratio'], cfg['omgd_state'], cfg['omgd_seed'],
                             always=[part for part in cfg['omgd_always'].split(',') if part])


def build(cfg, device, vocab_size=0):
    """A scratch model, its optimizer and its cycler, as train.py builds them (one process)."""
    model = GPT(GPTConfig(**model_args(cfg, vocab_size)))
    cast_model(configure_memory(model, cfg), cfg['precision']).to(device)
    optimizer = build_optimizer(model, cfg, torch.device(device).type)
    return model, optimizer, build_cycler(model, optimizer, cfg)


def train_step(model, optimizer, cycler, batch, next_batch, grad_accum, grad_clip, scale_after_clip,
               autocast=nullcontext(), scaler=None, sync=None, backward=None, before_zero_grad=None):
    """One optimizer step over grad_accum micro-batches; returns (loss, the next batch).

    batch: this step's first (X, Y); next_batch() fetches the following one right after each
    forward, so the host prepares data while the GPU computes. The OMGD scale goes once per step,
    after all micro-steps, before or after clipping (scale_after_clip: the paper's code clips
    first). loss: the last micro-batch's, as a detached tensor (no sync here).
    sync(last): DDP/FSDP gradient sync on the last micro-step only. backward(loss): replaces
    loss.backward() (bench_memory's meta device). before_zero_grad(): sees the gradients.
    """
    scaler = scaler or torch.amp.GradScaler(enabled=False)
    X, Y = batch
    for micro_step in range(grad_accum):
        if sync is not None:
            sync(micro_step == grad_accum - 1)
        with autocast:
            loss = model(X, Y)[1] / grad_accum  # [1]: keep no reference to the logits
        X, Y = next_batch()
        scaled = scaler.scale(loss)
        scaled.backward() if backward is None else backward(scaled)
    scaler.unscale_(optimizer)  # the true gradients, for the clipping and the OMGD scale
    if not scale_after_clip:
        cycler.scale_grads()
    if grad_clip != 0.0:
        # frozen parameters hold no gradient (None), which clip_grad_norm_ skips
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if scale_after_clip:
        cycler.scale_grads()
    scaler.step(optimizer)  # with float16: skipped when a gradient overflowed, and the scale lowered
    scaler.update()
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach() * grad_accum, (X, Y)


# -----------------------------------------------------------------------------
# model FLOPs utilization (MFU), as in the log line of train.py and in bench.py

# peak dense bf16 tensor FLOP/s per GPU, matched in this order against torch.cuda.get_device_name()
PEAK_BF16_FLOPS = {'H200': 989e12, 'H100 PCIe': 756e12, 'H100': 989e12, 'A100': 312e12,
                   'B200': 2250e12, 'L40S': 362e12, 'A10G': 125e12, 'RTX 4090': 165e12}


def peak_bf16_flops(device):
    """The GPU's peak from PEAK_BF16_FLOPS, or None (CPU, unknown GPU: no MFU is reported)."""
    device = torch.device(device)
    if device.type != 'cuda':
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(flops_per_token, tokens_per_iter, dt, peak_flops, world_size=1):
    """The share of `world_size` GPUs' peak FLOP/s that an iteration of `dt` seconds used."""
    return flops_per_token * tokens_per_iter / dt / (peak_flops * world_size)
