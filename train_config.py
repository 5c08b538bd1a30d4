"""train.py's config, a plain dict (what checkpoints store): each key's default and `--help` comment, the rule each
value follows, the checks of values that cannot train together, and a resume's merge with its checkpoint's config:
load(argv) reads the command line, run_config(cfg, given, saved) gives the values the run trains with."""

import ast
import dataclasses
import io
import math
import os
import tokenize

import torch

import dataloader
import galore
import omgd
import optim
from configurator import above, at_least, between, check_rule, configure, one_of
from infra import memory_options
from infra.checkpoint import of_type
from model import DTYPES, PRESETS, SHAPE_KEYS, TransformerConfig, check_arch
from model import check_preset as check_preset_name


def machine_defaults(cuda):
    """The keys whose default depends on whether the machine has CUDA (or, where --device is given, the run)."""
    if cuda:
        return dict(device='cuda', dtype='bfloat16', compile=True, backend='nccl')
    return dict(device='cpu', dtype='float32', compile=False, backend='gloo')


# -----------------------------------------------------------------------------
# default config values: a small GPT on character-level Shakespeare with LISA-wor, minutes on CPU
# I/O
out_dir = 'out'  # where checkpoints go (ckpt.pt or step_NNNNNNN/ folders, see checkpoint_format)
eval_interval = 100  # iterations between evaluations (and checkpoint saves)
log_interval = 10  # iterations between log lines
eval_iters = 20  # batches per split and evaluation
eval_only = False  # evaluate once and exit
eval_mc_path = ''  # a HellaSwag-format jsonl file scored at every evaluation (acc, acc_norm; infra/multiple_choice.py)
eval_mc_limit = 0  # score its first N examples only (0: all)
always_save_checkpoint = True  # if False, save only when the val loss improves
checkpoint_format = 'auto'  # 'file': out_dir/ckpt.pt; 'dcp': sharded step_NNNNNNN/ folders; 'auto': dcp on >1 rank
keep_last = 3  # dcp: how many of the newest step folders to keep (0: all)
checkpoint_async = 'auto'  # dcp: save step folders in a background thread: 'auto' (weights on a GPU), 'yes' or 'no'
init_from = 'scratch'  # 'scratch', 'resume' (out_dir's), 'auto' (resume if out_dir has one), GPT-2 name or HF dir
overwrite = False  # let a run that does not resume replace the checkpoint already in out_dir
sample_tokens = 300  # length of the sample printed at the end (0: none)
wandb_log = False  # log to Weights & Biases (needs `pip install wandb`)
wandb_project = 'omgd'  # wandb project
wandb_run_name = 'run'  # wandb run name
# data
dataset = 'shakespeare_char'  # a folder of data/ (or a path) with train.bin and val.bin
sampling = 'rr'  # 'rr': random reshuffling (each window once per epoch), 'iid': nanoGPT's sampling with replacement
data_seed = 1337  # seeds the data order, independent of the model's init
gradient_accumulation_steps = 1  # micro-steps per optimizer step, summed over all ranks
batch_size = 32  # micro-batch size per rank
# model: a preset ('gpt2', 'llama-60m', ...) sets the architecture keys
block_size = TransformerConfig.block_size  # tokens per sequence
preset = ''  # a preset of model.py's PRESETS, or '' for the keys below
arch = TransformerConfig.arch  # 'gpt2' or 'llama'
n_layer = TransformerConfig.n_layer  # transformer blocks
n_head = TransformerConfig.n_head  # attention heads
n_kv_head = TransformerConfig.n_kv_head  # llama grouped-query attention; 0 means n_head
n_embd = TransformerConfig.n_embd  # model width
mlp_hidden = TransformerConfig.mlp_hidden  # 0: 4*n_embd for gpt2, LLaMA's rule for llama
dropout = TransformerConfig.dropout  # dropout probability
bias = TransformerConfig.bias  # biases in linears and LayerNorms (gpt2)
vocab_size = 0  # 0: the dataset's (meta.pkl), else the preset's, else TransformerConfig's (GPT-2's, padded)
activation_checkpointing = False  # recompute each block's activations in the backward
checkpoint_sublayers = False  # activation_checkpointing of attention and MLP apart: a lower peak, more saved inputs
activation_offload = False  # keep the tensors saved for the backward in host memory
loss_chunk = 0  # >0: head and cross-entropy this many tokens at a time; the full logits never exist (slower)
# optimizer
optimizer = 'adamw'  # 'adamw' or 'sgd' (with momentum); method='galore'/'golore' use galore.py
learning_rate = 2e-3  # peak learning rate
max_iters = 1000  # optimizer steps of the run
weight_decay = 0.1  # decoupled weight decay of matrices (norms, biases and embeddings of LLaMA excluded)
beta1 = 0.9  # AdamW's first-moment decay
beta2 = 0.99  # AdamW's second-moment decay
momentum = 0.9  # sgd only
grad_clip = 1.0  # clip the gradient norm to this; 0 disables clipping
# learning rate schedule: linear warm-up, then cosine decay to min_lr
decay_lr = True  # False: constant learning_rate
warmup_iters = 50  # linear warm-up iterations
lr_decay_iters = 1000  # iterations of the cosine decay (then min_lr)
min_lr = 2e-4  # the learning rate at the end of the decay
# layer cycling (omgd.py); see the README's table of methods
method = omgd.CyclerConfig.method  # a method of omgd.METHODS (the README's table of methods), galore or golore
omgd_gamma = omgd.CyclerConfig.gamma  # active middle blocks per period
omgd_period = omgd.CyclerConfig.period  # K: iterations between switches
omgd_warmup = omgd.CyclerConfig.warmup  # iterations of full training before cycling starts
omgd_ratio = omgd.CyclerConfig.ratio  # tensor_wor: 1/M, each group's share; tensor_iid: each tensor's keep probability
omgd_state = omgd.CyclerConfig.state  # optimizer state of frozen parameters: 'drop', 'offload' (to CPU) or 'keep'
omgd_seed = omgd.CyclerConfig.seed  # seeds block selection (same on every rank), independent of the data order
omgd_scale_after_clip = True  # the paper's code clips the gradient norm first, then scales
omgd_always = ','.join(omgd.CyclerConfig.always)  # parts trained at every step
# galore / golore (galore.py)
galore_rank = 128  # rank of the gradient projection
galore_update_proj_gap = 200  # iterations between projection refreshes
galore_scale = 0.25  # scale of the projected update
golore_svd_fraction = 0.0  # golore: share of max_iters with SVD (GaLore) projections, then random (GoLore's: 0.8)
# system
_machine = machine_defaults(torch.cuda.is_available())
device = _machine['device']  # 'cpu', 'cuda' or 'cuda:N' (torchrun: each rank's); sets dtype/compile/backend defaults
precision = 'amp'  # 'amp' (fp32 weights, autocast), 'bf16' (all bf16) or 'bf16_master' (bf16 + fp32 active masters)
master_device = ''  # bf16_master: masters and moments on '' (the weights' device) or 'cpu' (with the AdamW step)
dtype = _machine['dtype']  # amp's autocast dtype: float32, bfloat16 or float16 (loss-scaled); CPU runs in float32
compile = _machine['compile']  # torch.compile each block separately (regional compilation)
backend = _machine['backend']  # torch.distributed backend under torchrun: 'nccl' or 'gloo'
parallel = 'ddp'  # under torchrun: 'ddp' (replicated weights) or 'fsdp' (FSDP2, weights sharded per block)
gpu_config = False  # a config for GPUs (config/*.py of large runs): refused without CUDA unless --device is given
seed = 1337  # seeds the model's init (and dropout)
dist_timeout_s = 600  # under torchrun: a collective waiting this long for a stuck or dead rank ends the run
ddp_check = False  # assert the DDP or FSDP invariants at every iteration on every rank (tests; hashes all weights)
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in dict(globals()).items() if not k.startswith('_') and isinstance(v, (int, float, str))}

GALORE_METHODS = ('galore', 'golore')  # galore.py's optimizers; every block trains
METHOD_NAMES = (*omgd.METHODS, *GALORE_METHODS)
RESUMING = ('resume', 'auto')  # init_from values whose config is known only once out_dir's checkpoint is read

RULES = {  # the rule each value follows on its own (configurator.py checks them); combinations are check()'s
    'out_dir': at_least(1, 'a non-empty path', len),
    'dataset': at_least(1, 'a non-empty name', len),
    **dict.fromkeys(('eval_interval', 'log_interval', 'eval_iters', 'batch_size', 'dist_timeout_s'), at_least(1)),
    **dict.fromkeys(('gradient_accumulation_steps', 'block_size', 'n_layer', 'n_head', 'n_embd'), at_least(1)),
    **dict.fromkeys(('sample_tokens', 'max_iters', 'warmup_iters', 'lr_decay_iters', 'keep_last'), at_least(0)),
    **dict.fromkeys(('eval_mc_limit', 'n_kv_head', 'mlp_hidden', 'vocab_size', 'weight_decay'), at_least(0)),
    **dict.fromkeys(('grad_clip', 'min_lr'), at_least(0)),
    **dict.fromkeys(('dropout', 'beta1', 'beta2', 'momentum'), between(0, 1)),
    'learning_rate': above(0),
    'init_from': (
        lambda v: v in ('scratch', *RESUMING) or v.startswith('gpt2') or os.path.isdir(v),
        "'scratch', 'resume', 'auto', a GPT-2 name or a Hugging Face model directory",
    ),
    'method': one_of(*METHOD_NAMES, label='method'),
    'golore_svd_fraction': between(0, 1, closed=True),
    'precision': one_of('amp', 'bf16', 'bf16_master', label='precision'),
    'master_device': one_of('', 'cpu', described="'' (the weights' device) or 'cpu'"),
    'dtype': one_of(*DTYPES, label='dtype'),
    'backend': one_of('nccl', 'gloo'),
    'parallel': one_of('ddp', 'fsdp'),
    'checkpoint_format': one_of('auto', 'file', 'dcp'),
    'checkpoint_async': one_of('auto', 'yes', 'no'),
    **omgd.RULES,  # the libraries' own keys, each rule written once, there
    **optim.RULES,
    **galore.RULES,
    **dataloader.RULES,
    **memory_options.RULES,
}

# the values a resume reads besides the states of the objects (every checkpoint of train.py has them), by type
RESUME_KEYS = dict(config=dict, model_args=dict, iter_num=int, best_val_loss=(int, float), data=dict, rng=dict)
FIXED_ON_RESUME = {  # what a resume cannot change, and why: they belong to its schedule, data, state or weights
    **{k: 'its layer schedule and data position belong to it' for k in ('dataset', 'method')},
    **{k: 'its data position is a place in that order' for k in ('sampling', 'data_seed')},
    **omgd.FIXED_ON_RESUME,  # the libraries' own keys, each written there
    'block_size': 'the data position counts windows of block_size+1 tokens',
    'precision': 'its optimizer state is kept in that precision',
    **optim.FIXED_ON_RESUME,
    # every TransformerConfig field with a key of its own (a fork's new one too) but the data's vocab_size and dropout
    **{
        f.name: 'the weights have that shape' if f.name in SHAPE_KEYS else 'its model was built with it'
        for f in dataclasses.fields(TransformerConfig)
        if f.name in DEFAULTS and f.name not in ('vocab_size', 'dropout', 'block_size')
    },
}
# taken from this command (or this machine's defaults), never from the checkpoint
THIS_COMMAND = ('init_from', 'out_dir', 'overwrite', 'eval_only', 'checkpoint_async', *machine_defaults(False))


def load(argv, defaults=None, given=None):
    """The config of these command-line arguments (configurator.configure, type-checked) and its device; check_run
    too unless init_from may resume (run_config checks the merged values). Raises a one-line ValueError."""
    given = set() if given is None else given
    cfg = configure(defaults or DEFAULTS, argv, given=given)
    check_device(cfg['device'])
    follow_device(cfg, given)
    if cfg['init_from'] not in RESUMING:
        check_run(cfg)
    return cfg


def follow_device(cfg, given):
    """A --device given (cpu, cuda, cuda:N) sets, in place, the dtype, compile and backend not given with it."""
    if 'device' in given and (cfg['device'] == 'cpu' or cfg['device'].startswith('cuda')):
        cfg.update({k: v for k, v in machine_defaults(cfg['device'] != 'cpu').items() if k not in given})


def check_run(cfg):
    """check(), and under torchrun (distributed.setup) what its ranks cannot train, before they join."""
    check(cfg)
    if int(os.environ.get('RANK', -1)) != -1:
        check_parallel(cfg, int(os.environ.get('WORLD_SIZE', 1)), cfg['parallel'] == 'fsdp')


def run_config(cfg, given, saved=None, path=None):
    """The config the run trains with, checked once: load()'s, or a resume's: the checkpoint's config (`saved`, the
    values of the checkpoint at `path`; None: nothing to resume) with the keys this command gave (`given`) on top."""
    if saved is not None:
        check_saved(saved, path)
        cfg = check_resume(saved['config'], saved['model_args'], cfg, given)
    if cfg['init_from'] in RESUMING:
        check_run(cfg)
    return cfg


def check_saved(saved, path):
    """Refuse (one-line ValueError) a checkpoint lacking a value of RESUME_KEYS, or with a value (of model_args and
    config too) of another type than train.py writes."""
    missing = [k for k in RESUME_KEYS if not isinstance(saved, dict) or k not in saved]
    if missing:
        raise ValueError(
            f"cannot resume from {path}: it lacks {', '.join(map(repr, missing))}, which every "
            f"checkpoint of train.py holds; restore a backup or train from scratch"
        )
    wrong = [
        f'{k}={v!r}'[:80]
        for k, kind in RESUME_KEYS.items()
        if not of_type(v := saved[k], kind) or k == 'iter_num' and v < 0
    ]
    fields = {f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.default is not None}
    for name, defaults in (('model_args', fields), ('config', DEFAULTS)):
        kinds = {k: (int, float) if type(d) is float else type(d) for k, d in defaults.items()}  # an int is a float
        values = saved[name].items() if isinstance(saved[name], dict) else ()
        wrong += [f"{name}['{k}']={v!r}"[:80] for k, v in values if k in kinds and not of_type(v, kinds[k])]
    if wrong:
        raise ValueError(
            f"cannot resume from {path}: its {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not what "
            f"train.py writes (a damaged file or not train.py's); restore a backup or train from scratch"
        )


def check(cfg):
    """Raise a one-line ValueError for a value that breaks its rule, or values that cannot train together."""
    for key, rule in RULES.items():
        check_rule(key, cfg[key], rule)
    check_preset(cfg)
    check_arch(cfg['arch'])
    omgd.check_always([part for part in cfg['omgd_always'].split(',') if part])
    if cfg['min_lr'] > cfg['learning_rate']:
        raise ValueError(f"min_lr={cfg['min_lr']} is above learning_rate={cfg['learning_rate']}: lower --min_lr")
    if cfg['decay_lr'] and cfg['lr_decay_iters'] < cfg['warmup_iters']:
        raise ValueError(
            f"lr_decay_iters={cfg['lr_decay_iters']} ends before warmup_iters={cfg['warmup_iters']}; "
            f"raise --lr_decay_iters (usually max_iters)"
        )
    if cfg['master_device'] and cfg['precision'] != 'bf16_master':
        raise ValueError(
            f"master_device={cfg['master_device']!r} places fp32 master weights, which only "
            f"precision='bf16_master' has; add --precision=bf16_master"
        )
    if cfg['precision'] != 'amp' and cfg['dtype'] == 'float16':
        raise ValueError(
            "dtype='float16' is the autocast dtype of precision='amp' only; drop --dtype or use --precision=amp"
        )
    if cfg['precision'] == 'bf16_master' and cfg['optimizer'] == 'sgd' and cfg['method'] not in GALORE_METHODS:
        raise ValueError(
            "precision='bf16_master' keeps AdamW's fp32 master weights; use --optimizer=adamw or --precision=bf16 (SGD)"
        )
    # a shape no machine holds is refused here, before building it takes forever or overflows in torch
    width, depth, vocab = max(cfg['n_embd'], 1), cfg['n_layer'], cfg['vocab_size'] or 50304
    if cfg['preset'] == '' and depth * 12 * width**2 + 2 * vocab * width > 10**14:
        raise ValueError(
            f"n_layer={depth}, n_embd={width} and vocab_size={vocab} make a model of over 10^14 "
            f"parameters; lower --n_layer or --n_embd"
        )
    if cfg['checkpoint_sublayers'] and not cfg['activation_checkpointing']:
        raise ValueError(
            "checkpoint_sublayers=True splits activation checkpointing: add --activation_checkpointing=True or drop it"
        )


def check_preset(cfg):
    """Refuse a shape key changed next to a preset, which would be silently ignored (vocab_size overrides it)."""
    if cfg['preset']:
        check_preset_name(cfg['preset'])
        preset = PRESETS[cfg['preset']]
        changed = [k for k in SHAPE_KEYS if k in preset and cfg[k] not in (DEFAULTS[k], preset[k])]
        if changed:
            raise ValueError(
                f"preset={cfg['preset']!r} sets the architecture, so {changed[0]}={cfg[changed[0]]!r} "
                f"would be ignored; pass --preset='' to give the shape by its keys"
            )


def check_resume(saved, model_args, cfg, given):
    """The config of a resume: the checkpoint's (`saved`, `model_args`) with the keys this command gave (`given`) on
    top. Refuses (one-line ValueError, all at once) the keys given that cannot continue it."""
    # a key newer than the checkpoint: it trained as that key's default does (precision: amp)
    truth = {
        **{k: DEFAULTS[k] for k in FIXED_ON_RESUME if k in DEFAULTS},
        **saved,
        **{k: v for k, v in model_args.items() if k in FIXED_ON_RESUME},
    }
    conflicts = []
    for k, why in FIXED_ON_RESUME.items():
        if k in given and k in truth and cfg[k] != truth[k]:
            verb = 'conflicts with' if k in model_args and k != 'block_size' else 'differs from'
            new_run = ', or start a new run with --init_from=scratch in another --out_dir' if 'schedule' in why else ''
            conflicts.append(
                f"{k}={cfg[k]!r} {verb} the checkpoint's {truth[k]!r} ({why}); resume with --{k}={truth[k]}{new_run}"
            )
    if conflicts:  # a resume takes the checkpoint's config: dropping them is enough
        raise ValueError('; '.join(conflicts))
    return {**cfg, **{k: v for k, v in truth.items() if k in cfg and k not in given and k not in THIS_COMMAND}}


def warnings(cfg, resumed_at=None):
    """Lines for legal values that are almost surely mistakes: the run still starts, but says so. resumed_at: the
    iteration a resume continues from (at or past max_iters the run only evaluates)."""
    lines, run = [], cfg['max_iters']
    cycles = cfg['method'] in omgd.METHODS and cfg['method'] != 'full'
    if cycles and cfg['omgd_warmup'] >= run > 0:
        lines.append(
            f"omgd_warmup={cfg['omgd_warmup']} covers the whole run (max_iters={run}): every block trains "
            f"at every step and {cfg['method']} never starts; lower --omgd_warmup"
        )
    elif cycles and cfg['omgd_period'] >= run - cfg['omgd_warmup'] > 0:
        lines.append(
            f"omgd_period={cfg['omgd_period']} is as long as the cycling part of the run ({run - cfg['omgd_warmup']} "
            f"iterations): the active set never switches, so most blocks never train; lower --omgd_period"
        )
    if cfg['decay_lr'] and cfg['warmup_iters'] >= run > 0:
        lines.append(
            f"warmup_iters={cfg['warmup_iters']} is as long as the run (max_iters={run}): the learning rate "
            f"never reaches learning_rate={cfg['learning_rate']}; lower --warmup_iters"
        )
    if run == 0 and cfg['init_from'] != 'resume' and not cfg['eval_only']:
        lines.append("max_iters=0: this run evaluates the initial model and trains nothing; raise --max_iters")
    if cfg['learning_rate'] > 1:  # AdamW and SGD alike: steps of that size diverge at once
        lines.append(
            f"learning_rate={cfg['learning_rate']} is above 1, where training diverges (AdamW's usual "
            f"values are 1e-4 to 1e-2); lower --learning_rate"
        )
    if resumed_at is not None and resumed_at >= run and not cfg['eval_only']:
        does = [f"evaluates the checkpoint ({cfg['eval_iters']} batches of each split)"]
        if cfg['eval_mc_path']:
            does.append("scores its multiple-choice benchmark")
        if cfg['sample_tokens'] > 0:
            does.append(f"prints a sample of {cfg['sample_tokens']} tokens (--sample_tokens=0: none)")
        lines.append(
            f"the checkpoint is at iteration {resumed_at} and max_iters={run}: this run trains nothing and saves no "
            f"checkpoint: it {', '.join(does)} and ends; raise --max_iters to train on"
        )
    return lines


def check_device(device):
    """Refuse a device train.py cannot train on (the benchmarks' meta and auto are theirs)."""
    if device.split(':')[0] not in ('cpu', 'cuda'):
        raise ValueError(f"device={device!r} is not a training device; use 'cpu', 'cuda' or 'cuda:N'")
    if device.startswith('cpu:'):
        raise ValueError(f"device={device!r}: torch counts the CPU as one device; use --device=cpu")
    if device.startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but this machine has no CUDA GPU (torch {torch.__version__}); "
            f"use --device=cpu or install a CUDA build of torch"
        )


def check_parallel(cfg, world_size, fsdp):
    """Raise a one-line ValueError for values that cannot train on `world_size` ranks, with FSDP2 or not."""

    def refuse(value, why, fix):
        raise ValueError(f"{value} is not supported with parallel='fsdp' ({why}); {fix}")

    if fsdp and cfg['dtype'] == 'float16':  # ranks' overflow checks would disagree
        refuse("dtype='float16'", 'its loss scaling sees only local shards', 'use --dtype=bfloat16')
    if fsdp and cfg['omgd_state'] == 'offload':
        refuse("omgd_state='offload'", 'sharded optimizer state stays on its device', 'use --omgd_state=drop or keep')
    if fsdp and cfg['precision'] == 'bf16_master':
        refuse("precision='bf16_master'", 'under amp FSDP2 keeps fp32 shards, computes in bf16', 'use --precision=amp')
    if fsdp and cfg['eval_mc_path']:
        refuse('eval_mc_path', 'its scoring calls the sharded head', 'use eval.py --mc_path, or --parallel=ddp')
    if fsdp and cfg['method'] in GALORE_METHODS:
        refuse(f"method={cfg['method']!r}", 'its projections need whole gradients', 'use --parallel=ddp')
    steps = cfg['gradient_accumulation_steps']
    if steps % world_size:
        raise ValueError(
            f"gradient_accumulation_steps={steps} counts micro-steps summed over all ranks and must be a multiple of "
            f"the {world_size} ranks, e.g. --gradient_accumulation_steps={world_size * math.ceil(steps / world_size)} "
            "(tokens per iteration = gradient_accumulation_steps x batch_size x block_size)"
        )


def meanings(path=__file__):
    """{key: its comment}: what `--help` says of each key, the comment on its assignment (on its line, or inside the
    parentheses ruff format wraps a long line in)."""
    source = open(path, encoding='utf-8').read()
    comments = {
        tok.start[0]: tok.string[1:].strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    return {
        n.targets[0].id: ' '.join(comments[i] for i in range(n.lineno, n.end_lineno + 1) if i in comments)
        for n in ast.parse(source).body
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name) and n.targets[0].id in DEFAULTS
    }
