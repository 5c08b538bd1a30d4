"""The one builder: the model, its optimizer and its layer cycler of a config (a dict of train.py's keys), as every
script trains them, so a benchmark measures what train.py runs."""

import dataclasses
import math
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import galore
import omgd
from infra import memory_options
from infra.checkpoint import of_type, read_any, trained_dataset
from model import PRESET_KEYS, PRESETS, Transformer, TransformerConfig
from optim import MasterAdamW, adamw, param_groups
from train_config import GALORE_METHODS


def transformer_kwargs(cfg, vocab_size=0):
    """TransformerConfig keywords of the config's keys (a preset's PRESET_KEYS win); vocab_size: the dataset's."""
    # every TransformerConfig field that is a train.py key: a fork's new field (qk_norm) needs no list here
    args = {f.name: cfg[f.name] for f in dataclasses.fields(TransformerConfig) if f.name in cfg}
    preset = PRESETS[cfg['preset']] if cfg['preset'] else {}
    args.update({k: v for k, v in preset.items() if k in PRESET_KEYS})
    args['vocab_size'] = vocab_size or cfg['vocab_size'] or preset.get('vocab_size', TransformerConfig.vocab_size)
    return args


class RandomOnCPU(TorchDispatchMode):
    """Random fills (normal_, uniform_) of a tensor not fp32 on the CPU are drawn there in fp32, then cast in."""

    FILLS = (torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS and (args[0].device.type, args[0].dtype) != ('cpu', torch.float32):
            drawn = func(torch.empty(args[0].shape, dtype=torch.float32, device='cpu'), *args[1:], **kwargs)
            return args[0].copy_(drawn)
        return func(*args, **kwargs)


def new_model(config, device, dtype=torch.float32, cpu_draws=True):
    """A new Transformer on `device` in `dtype` (never a full fp32 copy on the host), bitwise Transformer(config)'s
    cast to `dtype`. cpu_draws=False draws on `device` instead (the benchmarks, which need no such values)."""
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


def resumed_model(saved, cfg, device, path):
    """A resume's model of the checkpoint's model_args and the config's dropout and dtype, with ckpt.pt's weights
    when `saved` holds them (a step folder's come with Checkpointer.load). A one-line ValueError if they do not load."""
    try:
        config = TransformerConfig(**{**saved['model_args'], 'dropout': cfg['dropout']})
        model = new_model(config, device, weight_dtype(cfg['precision']))
        if 'model' in saved:
            model.load_state_dict(saved['model'])
    except Exception as e:
        raise ValueError(
            f"cannot load checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            f"it is corrupt or from another version: start from scratch or restore a backup"
        ) from None
    return model


def compile_blocks(model, method, **kwargs):
    """compile=True's regional compilation (memory_options.compile_blocks) for the method's unit of switching."""
    kind = omgd.METHODS.get(method)  # None: full, and GaLore's methods (every block trains)
    return memory_options.compile_blocks(model, per_tensor=kind is not None and kind.unit == 'tensor', **kwargs)


def weight_dtype(precision):
    return torch.float32 if precision == 'amp' else torch.bfloat16


def build_optimizer(model, cfg, device_type, host_scope=nullcontext):
    """The optimizer over ALL parameters, built before anything is frozen, so every block can train later
    (LMFlow's bug: an optimizer over the trainable parameters only never trains the others)."""
    betas, lr, wd = (cfg['beta1'], cfg['beta2']), cfg['learning_rate'], cfg['weight_decay']
    master = cfg['precision'] == 'bf16_master'
    masters = dict(master_device=cfg['master_device'] or None, host_scope=host_scope)
    if cfg['method'] in GALORE_METHODS:
        return galore.build_optimizer(
            model,
            wd,
            lr,
            betas,
            rank=cfg['galore_rank'],
            update_proj_gap=cfg['galore_update_proj_gap'],
            scale=cfg['galore_scale'],
            projection='svd' if cfg['method'] == 'galore' else 'random',
            seed=cfg['omgd_seed'],
            svd_steps=math.ceil(cfg['golore_svd_fraction'] * cfg['max_iters']) if cfg['method'] == 'golore' else 0,
            master=master,
            **masters,
        )
    if master:
        return MasterAdamW(param_groups(model, wd), lr=lr, betas=betas, **masters)
    if cfg['optimizer'] == 'adamw':
        return adamw(model, wd, lr, betas, device_type)
    return torch.optim.SGD(param_groups(model, wd), lr=lr, momentum=cfg['momentum'])


def build_cycler(model, optimizer, cfg):
    method = 'full' if cfg['method'] in GALORE_METHODS else cfg['method']
    return omgd.build_cycler(model, optimizer, omgd.CyclerConfig.from_config(cfg, method))


def build(cfg, device, vocab_size=0, model=None, shard=None, cpu_draws=True, host_scope=nullcontext):
    """The model, its optimizer and its cycler. model: one already built, or None: new_model's (seed the RNG first).
    shard(model): once on its device, before the optimizer sees it (FSDP2). host_scope: the masters' (the estimate)."""
    if model is None:
        config = TransformerConfig(**transformer_kwargs(cfg, vocab_size))
        model = new_model(config, device, weight_dtype(cfg['precision']), cpu_draws)
    keys = ('activation_checkpointing', 'checkpoint_sublayers', 'activation_offload', 'loss_chunk')
    memory_options.apply(model, **{k: cfg[k] for k in keys})  # activation memory: the keys of those names
    if cfg['precision'] != 'amp':  # in place: the Parameter objects stay the same
        model.to(weight_dtype(cfg['precision']))
    model.to(device)
    if shard is not None:
        shard(model)
    optimizer = build_optimizer(model, cfg, torch.device(device).type, host_scope)  # over ALL parameters
    return model, optimizer, build_cycler(model, optimizer, cfg)


def trained_model(out_dir, dataset=True):
    """(Transformer on the CPU, checkpoint dict, its path) of out_dir's newest checkpoint, weights only (read
    mapped): the model sample.py, eval.py and export (dataset=False: no config needed) read. A one-line ValueError
    for a file that is not train.py's or weights that are not finite."""
    checkpoint, path = read_any(out_dir, map_location='cpu', mmap=True, optimizer=False)
    try:
        model = Transformer(TransformerConfig(**checkpoint['model_args']))
        model.load_state_dict(checkpoint['model'])
        if dataset and trained_dataset(checkpoint) is None:
            raise TypeError("its config records no dataset")
        config = checkpoint['config'] if dataset else {}
        checkpoint['iter_num']  # what eval.py reads besides: iter_num, and these integers when the file has them
        integers = {k: config[k] for k in ('batch_size', 'eval_iters', 'data_seed') if k in config}
        integers['world_size'] = checkpoint.get('world_size', 1)
        wrong = [f'{k}={v!r}' for k, v in integers.items() if not of_type(v, int)]
        if wrong:
            raise TypeError(f"it holds {wrong[0]}")
    except Exception as e:  # a readable file that is not one of train.py's checkpoints
        raise ValueError(  # load_state_dict's message runs over several lines: joined
            f"{path} is not a checkpoint of train.py ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
            f"give the out_dir of a train.py run"
        ) from None
    bad = [k for k, t in checkpoint['model'].items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:  # Checkpointer.save refuses them: every logit would be NaN, and nothing would say why
        raise ValueError(
            f"{path} holds NaN or inf weights ({len(bad)} tensor(s), e.g. {bad[0]}), which train.py never saves: the "
            f"file is damaged or not train.py's; restore a backup or use an earlier checkpoint"
        )
    return model, checkpoint, path
