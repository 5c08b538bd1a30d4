"""
GPU memory of a training iteration, split like the OMGD paper's LLaMA-7B table: model weights,
gradients, optimizer state, and "others" (activations, temporaries, workspaces) = peak allocated
minus the other three.

$ python bench_memory.py --model=llama-7b --methods=full,galore,golore,lisa,lisa_wor --batch_size=16 --block_size=256
$ python bench_memory.py --model=gpt2 --dtype=bf16_autocast --activation_checkpointing=False \
      --batch_size=60 --block_size=1024 --gamma=3 --vocab_size=50304 --grad_accum=8

The defaults are the settings that make the paper's table consistent: pure bf16 weights, grads and
AdamW states (no fp32 master), micro-batch 16 x 256 tokens, activation checkpointing per block,
GaLore/GoLore rank 128 on every attention and MLP matrix (projectors not counted as optimizer
state), LISA/LISA-wor with 2 of 32 blocks plus embedding, final norm and head trained.

For every method: build the model, its optimizer over all parameters (torch AdamW, or
galore.build_optimizer), and an omgd.LayerCycler (LISA methods: `gamma` blocks; `.step(0)` freezes
the others exactly as in training). A warm-up step (zero gradients on the trainable parameters,
no forward) creates the optimizer state and GaLore's projectors as step 0 of training does. The
measured iteration is then the second one of a switching period, the costliest, since the state
already exists during the forward/backward: `micro_batches` (>= 2) forward/backward passes that
accumulate gradients, gradient clipping, the OMGD gradient scale, one optimizer step. Weights,
gradients and optimizer state are exact tensor bytes (omgd.memory_bytes; the optimizer column
leaves out GaLore's projectors and CPU-resident state, reported apart). Everything is freed
between methods.

The paper's 1.73 GiB for GaLore/GoLore comes out with GaLore's own convention: rank 128 on the
smaller side of all 7 matrices of every block (moments of 4096 x 128 for q/k/v/o, 11008 x 128 for
gate/up/down), full bf16 AdamW moments for the embedding, head and norms, projectors not counted:
2 x 2 bytes x (32 x 6,332,416 + 262,148,096) = 1.7314 GiB. LISA's 1.24/2.48 GiB are 2 blocks +
embedding + head + final norm (666,914,816 parameters) in bf16, times 1 and 2.

Where it runs (--device):
  cuda: measured. Peak = torch.cuda.max_memory_allocated over the measured iteration (after
        reset_peak_memory_stats), reserved = max_memory_reserved.
  meta (auto without a GPU): an ESTIMATE, labelled so in every output. The same code runs on
        meta tensors (shapes and dtypes, no data, no memory) in seconds, even for llama-7b.
        Weights, gradients and optimizer state are still exact: the real optimizer step runs on
        meta tensors and allocates its real state. The peak is counted by LiveBytes below, a
        TorchDispatchMode that adds up the bytes of every live tensor storage op by op, over
        the measured iteration; "others" = that peak minus weights, grads and state.
        So that the forward/backward allocates what it would on a GPU, MetaAsCuda replaces
        scaled_dot_product_attention by FlashAttention (bf16) or memory-efficient attention
        (fp32) kernels, which save the log-sum-exp, not T x T weights, and emulates CUDA bf16
        autocast at the torch-function level (matmuls cast to bf16, norms, softmax and
        cross-entropy to fp32, casts of trainable weights cached for the forward).
        Not modelled: the caching allocator's 512-byte rounding and fragmentation (hence no
        reserved figure), cuBLAS workspaces, and the fused AdamW kernel (meta runs the
        per-parameter AdamW, whose temporaries are one parameter's size at a time).
  cpu:  runs for real on the CPU, counted by LiveBytes (for tests of the non-meta code path).
On cuda LiveBytes runs too, and its peak is stored in the JSON ('tracked_peak') to check the
meta estimator against the measurement. (torch.distributed._tools.mem_tracker.MemTracker is not
used: it registers a gradient hook on every parameter it sees and fails on frozen ones.)

Methods: full, galore, golore, and any layer-cycling method of omgd.py (lisa, lisa_wor, ...).
A suffix changes where AdamW keeps its state (layer-cycling and full methods only; optim.MasterAdamW):
  +master   bf16 weights on the GPU, fp32 master copy and fp32 moments of the parameters that
            train now (created when a block is activated, freed with its state when it is frozen)
  +offload  the same, with the fp32 master copies, the moments and the AdamW arithmetic on the
            CPU (ZeRO-Offload style): the GPU keeps bf16 weights, bf16 grads and activations only.
--omgd_state: 'drop' and 'offload' leave the same bytes on the GPU in this measurement (frozen
blocks' state is absent or in CPU memory); 'keep' first runs one full cycle of switches so every
block has state, what 'keep' converges to.
"""
import gc
import json
import os
import sys
import time
import weakref
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import galore
import omgd
from configurator import ConfigError, configure
from model import GPT, GPTConfig, PRESETS, param_groups
from optim import MasterAdamW

# -----------------------------------------------------------------------------
# defaults: the paper's LLaMA-7B memory experiment (see the module docstring)
model = 'llama-7b'  # a preset of model.py, or 'tiny' (8 blocks, n_embd 256, vocab 8192)
methods = 'full,galore,golore,lisa,lisa_wor'  # comma-separated; suffixes +master, +offload
batch_size = 16  # micro-batch size
block_size = 256  # sequence length
vocab_size = 0  # 0: the preset's
grad_accum = 32  # gradient accumulation steps of the training run (the loss is divided by it)
micro_batches = 2  # micro-batches the measured iteration runs (0: zero grads, no forward: bytes only)
dtype = 'bf16_pure'  # bf16_pure: bf16 weights/grads/states; bf16_autocast: fp32 weights/grads/states + autocast
activation_checkpointing = True  # recompute each block's activations in the backward
gamma = 2  # LISA methods: active blocks
omgd_state = 'drop'  # optimizer state of frozen blocks: drop, offload, keep
omgd_always = 'embed,pos,norm,head'  # outer parts trained at every step by the LISA methods
galore_rank = 128
galore_update_proj_gap = 200
galore_scale = 0.25
learning_rate = 1e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0: no clipping
device = 'auto'  # auto (cuda if available, else meta), cuda, meta, cpu
out = ''  # output prefix for .md/.json/.png; '' -> out/memory_<model> (git-ignored; results/ only when named)
seed = 0
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if not k.startswith('_') and isinstance(v, (int, float, bool, str))}

GIB = 2 ** 30
TINY = dict(arch='llama', n_layer=8, n_head=8, n_embd=256, vocab_size=8192, block_size=256)
LOW_RANK = ('galore', 'golore')
VARIANTS = ('master', 'offload')
# the paper's Table (GiB), for comparison when the model is llama-7b
PAPER_LLAMA_7B = {'full': (12.55, 12.55, 25.10, 14.66, 64.86), 'galore': (12.55, 12.55, 1.73, 4.40, 31.23),
                  'golore': (12.55, 12.55, 1.73, 4.40, 31.23), 'lisa': (12.55, 1.24, 2.48, 3.29, 19.56),
                  'lisa_wor': (12.55, 1.24, 2.48, 3.29, 19.56)}


# -----------------------------------------------------------------------------
# counting live tensor memory, on any device


class LiveBytes(TorchDispatchMode):
    """Bytes of the live tensor storages on `device`, and their peak, counted op by op.

    Tensors made before entering must be registered with add(). A storage is counted once however
    many views it has, and uncounted when it is freed (weak reference). Storages created inside
    `with tracker.host():` stand for CPU memory (the meta device has no CPU) and are not counted.
    """

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.entries = {}  # id(storage) -> [weakref, nbytes, host]
        self.current = self.peak = 0
        self.host_depth = 0

    def add(self, *tensors):
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._track(t)

    @contextmanager
    def host(self):
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

    def is_host(self, t):
        entry = self.entries.get(id(t.untyped_storage()))
        return t.device != self.device or (entry is not None and entry[2])

    def reset_peak(self):
        self.peak = self.current

    def _track(self, t):
        if t.device != self.device:
            return
        st = t.untyped_storage()
        key, nbytes = id(st), st.nbytes()
        entry = self.entries.get(key)
        if entry is not None:
            if entry[1] != nbytes and not entry[2]:  # resized in place
                self._count(nbytes - entry[1])
            entry[1] = nbytes
            return
        host = self.host_depth > 0
        self.entries[key] = [weakref.ref(st, partial(self._freed, key)), nbytes, host]
        if not host:
            self._count(nbytes)

    def _count(self, delta):
        self.current += delta
        self.peak = max(self.peak, self.current)

    def _freed(self, key, ref):
        entry = self.entries.get(key)
        if entry is not None and entry[0] is ref:
            del self.entries[key]
            if not entry[2]:
                self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class MetaAsCuda(TorchFunctionMode):
    """Makes a forward/backward on meta (or CPU) tensors allocate what it would on a GPU.

    - scaled_dot_product_attention runs the FlashAttention kernel (bf16/fp16) or the memory-
      efficient one (fp32), which save a log-sum-exp per row, not the T x T attention weights
      that the math fallback used off-GPU would keep;
    - with autocast=True, CUDA bf16 autocast's casts: matmuls to bf16, norms, softmax and
      cross-entropy to fp32, and (cache=True, the forward) casts of leaf tensors that require
      grad kept until the forward ends, like autocast's weight cache.
    Run the backward with backward() below (cache=False): activation checkpointing recomputes there.
    """
    LOW = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
           torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm}
    FP32 = {F.layer_norm, F.rms_norm, F.group_norm, F.softmax, F.log_softmax, torch.softmax,
            torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax, F.cross_entropy,
            F.nll_loss, torch.exp, torch.log, torch.rsqrt, torch.pow, torch.Tensor.pow, torch.sum}

    def __init__(self, autocast=False, cache=False):
        super().__init__()
        self.autocast, self.cache = autocast, cache
        self.casts = {}

    def __exit__(self, *args):
        self.casts.clear()
        return super().__exit__(*args)

    def backward(self, loss):
        """loss.backward() with this mode on. (Tensor.backward would hand itself to the mode, and a
        mode is off while it handles a call, so call the autograd engine directly.)"""
        with self:
            torch.autograd.graph._engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                                                      allow_unreachable=True, accumulate_grad=True)

    def _cast(self, x, dtype):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype):
            return x
        if self.cache and x.is_leaf and x.requires_grad:
            if id(x) not in self.casts:
                self.casts[id(x)] = x.to(dtype)
            return self.casts[id(x)]
        return x.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if self.autocast and (func in self.LOW or func in self.FP32):
            dtype = torch.bfloat16 if func in self.LOW else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
        if self.autocast:
            q, k, v = (self._cast(t, torch.bfloat16) for t in (q, k, v))
        if enable_gqa and k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        if q.dtype in (torch.bfloat16, torch.float16):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, False, dropout_p, is_causal, scale=scale)[0]


# -----------------------------------------------------------------------------
# one method


def parse_method(name):
    base, _, variant = name.partition('+')
    if base not in LOW_RANK and base not in omgd.METHODS:
        raise ValueError(f"unknown method {base!r}; choose from {', '.join(LOW_RANK + tuple(omgd.METHODS))}")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown suffix +{variant} in {name!r}; choose +master or +offload")
    if variant and base in LOW_RANK:
        raise ValueError(f"{name!r}: +{variant} applies to AdamW methods, not to {base}")
    return base, variant


def resolve_device(name):
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else 'meta'
    if name not in ('cuda', 'meta', 'cpu'):
        raise ValueError(f"device must be auto, cuda, meta or cpu, got {name!r}")
    if name == 'cuda' and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available; use device=meta for an estimate")
    if name == 'cuda':  # with its index: tensors report cuda:N, and LiveBytes compares devices
        return torch.device('cuda', torch.cuda.current_device())
    return torch.device(name)


def model_config(cfg):
    """The GPTConfig of cfg['model'] at cfg['block_size']; optional n_layer/n_head/n_embd/vocab_size
    keys of cfg (bench.py has them) override the preset when non-zero."""
    if cfg['model'] == 'tiny':
        args = dict(TINY)
    elif cfg['model'] in PRESETS:
        args = dict(PRESETS[cfg['model']])
    else:
        raise ValueError(f"unknown model {cfg['model']!r}; choose tiny or one of {', '.join(PRESETS)}")
    args['block_size'] = cfg['block_size']
    for key in ('n_layer', 'n_head', 'n_embd', 'vocab_size'):
        if cfg.get(key):
            args[key] = cfg[key]
    if cfg.get('n_embd'):
        args.pop('mlp_hidden', None)  # derive the MLP width from the new n_embd
    try:
        return GPTConfig(**args)
    except ValueError as e:
        raise ValueError(f"model shape: {e}") from None


def tied_parameters(net):
    """[[name, name, ...], ...]: the names under which each shared parameter of `net` is registered."""
    names = {}
    for name, p in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def build_model(config, device, param_dtype, activation_checkpointing):
    """Built on meta (no memory, no init cost), then materialised and initialised off meta."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(param_dtype)  # parameters in param_dtype; rope tables stay fp32
    try:
        with torch.device('meta'):
            net = GPT(config)
    finally:
        torch.set_default_dtype(default)
    if device.type != 'meta':
        ties = tied_parameters(net)
        net.to_empty(device=device)  # one new tensor per module: it unties GPT-2's embedding and head
        for first, *others in ties:
            shared = net.get_parameter(first)
            for name in others:
                module, _, attr = name.rpartition('.')
                setattr(net.get_submodule(module), attr, shared)
        net.init_weights()
    net.activation_checkpointing = activation_checkpointing
    net.train()
    return net


def build_optimizer(net, base, variant, cfg, device, tracker=None):
    betas, lr, wd = (cfg['beta1'], cfg['beta2']), cfg['learning_rate'], cfg['weight_decay']
    if base in LOW_RANK:
        return galore.build_optimizer(net, wd, lr, betas, rank=cfg['galore_rank'],
                                      update_proj_gap=cfg['galore_update_proj_gap'], scale=cfg['galore_scale'],
                                      projection='svd' if base == 'galore' else 'random', seed=cfg['seed'])
    groups = param_groups(net, wd)
    if variant == 'master':
        return MasterAdamW(groups, lr=lr, betas=betas)
    if variant == 'offload':
        if device.type == 'cuda':
            return MasterAdamW(groups, lr=lr, betas=betas, master_device=torch.device('cpu'))
        return MasterAdamW(groups, lr=lr, betas=betas, host_scope=tracker.host)
    # as train.py: fused on CUDA; elsewhere the per-parameter loop (fused and foreach are
    # unavailable on meta, and foreach's temporaries span all parameters, unlike fused)
    extra = dict(fused=True) if device.type == 'cuda' else dict(foreach=False)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **extra)


def build_cycler(net, opt, base, cfg, period):
    """omgd.build_cycler for method `base` (AdamW and GaLore/GoLore get the 'full' cycler, which
    trains everything), with cfg's gamma, omgd_state, omgd_always and seed."""
    always = [part for part in cfg['omgd_always'].split(',') if part]
    return omgd.build_cycler(net, opt, base if base in omgd.METHODS else 'full', cfg['gamma'], period, 0, 0.5,
                             cfg['omgd_state'], cfg['seed'], always=always)


def measure(cfg, method, device):
    """Build, warm up, run one measured iteration; return the breakdown in bytes."""
    base, variant = parse_method(method)
    autocast = cfg['dtype'] == 'bf16_autocast'
    param_dtype = torch.float32 if autocast and not variant else torch.bfloat16
    config = model_config(cfg)
    cuda = device.type == 'cuda'
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    tracker = LiveBytes(device)
    torch.manual_seed(cfg['seed'])
    net = build_model(config, device, param_dtype, cfg['activation_checkpointing'])
    opt = build_optimizer(net, base, variant, cfg, device, tracker)
    cycler = build_cycler(net, opt, base, cfg, period=1)
    cycler.step(0)
    shape = (cfg['batch_size'], cfg['block_size'])
    batches = [(torch.randint(0, config.vocab_size, shape, device=device),
                torch.randint(0, config.vocab_size, shape, device=device)) for _ in range(max(1, cfg['micro_batches']))]
    if device.type != 'meta':
        forward_ctx = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=autocast)
        backward = torch.Tensor.backward
    else:
        forward_ctx = partial(MetaAsCuda, autocast=autocast, cache=True)
        backward = MetaAsCuda(autocast=autocast, cache=False).backward

    def iteration(n_micro):
        if n_micro == 0:  # bytes only: gradients of the trainable parameters, no activations
            for p in net.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        for x, y in batches[:n_micro]:
            with forward_ctx():
                _, loss = net(x, y)
                loss = loss / cfg['grad_accum']
            backward(loss)
            del loss
        if cfg['grad_clip']:
            torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], cfg['grad_clip'])
        cycler.scale_grads()
        opt.step()

    tracker.add(list(net.parameters()), list(net.buffers()), batches)
    t0 = time.time()
    with tracker:
        # warm-up: step 0 of training creates the optimizer state (and GaLore's projectors);
        # under 'keep' one full cycle of switches leaves state on every block
        switches = len(net.blocks) // cfg['gamma'] if cfg['omgd_state'] == 'keep' and cycler.schedule else 1
        for i in range(switches):
            if i:
                cycler.step(i)
            iteration(0)
            opt.zero_grad(set_to_none=True)
        # measured: the second iteration of a switching period
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        tracker.reset_peak()
        iteration(cfg['micro_batches'])
        if cuda:
            torch.cuda.synchronize(device)
    seconds = time.time() - t0
    sizes = omgd.memory_bytes(net, opt)
    states = [v for _, _, v in omgd.state_tensors(opt)]
    row = dict(method=method, params=sizes['params'], grads=sizes['grads'],
               optimizer=sum(v.numel() * v.element_size() for v in states if not tracker.is_host(v)),
               cpu_state=sum(v.numel() * v.element_size() for v in states if tracker.is_host(v)),
               projectors=galore.projector_bytes(opt), tracked_peak=tracker.peak, seconds=round(seconds, 2),
               active_blocks=list(cycler.active) if cycler.schedule else 'all')
    if cuda:
        row['peak'] = torch.cuda.max_memory_allocated(device)
        row['reserved'] = torch.cuda.max_memory_reserved(device)
    else:
        row['peak'], row['reserved'] = tracker.peak, None
    row['others'] = row['peak'] - row['params'] - row['grads'] - row['optimizer']
    row['n_params'] = sum(p.numel() for p in net.parameters())
    del net, opt, cycler, batches, states
    return row


# -----------------------------------------------------------------------------
# outputs


def gib(n):
    return None if n is None else n / GIB


def notes_for(cfg, device, estimate, n_params):
    lines = []
    if estimate:
        how = ("attention as FlashAttention/memory-efficient kernels, CUDA autocast emulated"
               if device.type == 'meta' else "the CPU's own kernels")
        lines.append(f"ESTIMATE on the {device.type} device, not a GPU measurement. Weights, gradients and "
                     "optimizer state are exact tensor bytes; Others = the peak of live tensor bytes counted op "
                     f"by op (LiveBytes in bench_memory.py; {how}) minus those three. Allocator "
                     "rounding/fragmentation, cuBLAS workspaces and the CUDA context are not included; no "
                     "reserved figure.")
    else:
        lines.append("Measured on the GPU: Total = torch.cuda.max_memory_allocated over the measured iteration, "
                     "Reserved = max_memory_reserved; Others = Total - Model - Gradients - Optimizer.")
    config = model_config(cfg)
    lines.append(f"Model {cfg['model']}: {config.arch}, {config.n_layer} blocks, n_embd {config.n_embd}, MLP "
                 f"{config.mlp_hidden}, vocab {config.vocab_size}, {n_params:,} parameters.")
    prec = {'bf16_pure': 'pure bf16 weights, gradients and AdamW states (no fp32 master)',
            'bf16_autocast': 'fp32 weights, gradients and AdamW states with bf16 autocast (nanoGPT style)'}
    lines.append(f"{prec[cfg['dtype']]}; micro-batch {cfg['batch_size']} x {cfg['block_size']} tokens "
                 f"(of {cfg['grad_accum']} accumulation steps; the measured iteration runs {cfg['micro_batches']}); "
                 f"activation checkpointing {'on' if cfg['activation_checkpointing'] else 'off'}.")
    lines.append(f"LISA methods: {cfg['gamma']} active blocks plus {cfg['omgd_always']}, state policy "
                 f"'{cfg['omgd_state']}'. GaLore/GoLore: rank {cfg['galore_rank']} on every attention and MLP "
                 f"matrix, projected on the smaller side; embeddings, head and norms have full AdamW state. "
                 f"Projection matrices are not counted as optimizer state (they are inside Others).")
    lines.append("+master: bf16 weights, fp32 master copy and moments for the trainable parameters on the GPU "
                 "(counted as optimizer state). +offload: the same on the CPU, with the AdamW step on the CPU "
                 "(CPU state column, not GPU memory).")
    lines.append("Measured iteration = the second of a switching period (optimizer state already exists); "
                 "the peak is over forward/backward of every micro-batch, clipping, scaling and the step.")
    return lines


def markdown(result):
    cfg, rows, estimate = result['config'], result['rows'], result['estimate']
    title = f"Memory breakdown (GiB), {cfg['model']}, one {'device' if estimate else result['device']}"
    out = [f"# {title}" + (f" — ESTIMATE ({result['device']} device, no GPU)" if estimate else ''), '']
    out += [f"- {line}" for line in result['notes']]
    out += ['', f"Command: `{result['command']}`", '']
    extra = [('projectors', 'GaLore proj. (in Others)'), ('cpu_state', 'CPU state')]
    extra = [(k, h) for k, h in extra if any(r[k] for r in rows)]
    head = ['Method', 'Model', 'Gradients', 'Optimizer', 'Others', 'Total', 'Reserved'] + [h for _, h in extra]
    if estimate:
        head[5] = 'Total (est.)'
    out += ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        cells = [r['method']] + [f"{gib(r[k]):.2f}" for k in ('params', 'grads', 'optimizer', 'others', 'peak')]
        cells.append('–' if r['reserved'] is None else f"{gib(r['reserved']):.2f}")
        cells += [f"{gib(r[k]):.2f}" for k, _ in extra]
        out.append('| ' + ' | '.join(cells) + ' |')
    if cfg['model'] == 'llama-7b':
        out += ['', "The paper's table (GiB), for comparison. Its Others/Total were measured on an RTX PRO 6000 "
                "with its own code; a commented-out passage of the paper's source says the full-parameter row "
                "was estimated from proportions after running out of memory.", '',
                '| Method | Model | Gradients | Optimizer | Others | Total |', '|---|---|---|---|---|---|']
        for name, values in PAPER_LLAMA_7B.items():
            out.append(f"| {name} | " + ' | '.join(f"{v:.2f}" for v in values) + ' |')
    return '\n'.join(out) + '\n'


def plot(result, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    rows = result['rows']
    parts = [('params', 'Model'), ('grads', 'Gradients'), ('optimizer', 'Optimizer'), ('others', 'Others')]
    colors = ['#4c72b0', '#dd8452', '#55a868', '#c44e52']
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2.5, 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for (key, label), color in zip(parts, colors):
        values = [max(0.0, gib(r[key])) for r in rows]
        ax.bar(x, values, bottom=bottom, label=label, color=color, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{gib(r['peak']):.2f}", ha='center', va='bottom', fontsize=9)
    ax.set_xticks(list(x), [r['method'] for r in rows], rotation=20)
    ax.set_ylabel('GiB')
    title = f"GPU memory, {result['config']['model']}"
    if result['estimate']:
        title += f" (ESTIMATE, {result['device']} device)"
    ax.set_title(title)
    ax.set_ylim(0, max(bottom) * 1.12)
    ax.legend(loc='upper right', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg, argv=()):
    """Measure every method of cfg['methods']; return the result dict (nothing written)."""
    if cfg['dtype'] not in ('bf16_pure', 'bf16_autocast'):
        raise ValueError(f"dtype must be bf16_pure or bf16_autocast, got {cfg['dtype']!r}")
    if cfg['micro_batches'] < 0 or cfg['batch_size'] < 1 or cfg['grad_accum'] < 1:
        raise ValueError("batch_size and grad_accum must be >= 1 and micro_batches >= 0")
    device = resolve_device(cfg['device'])
    names = [m for m in cfg['methods'].split(',') if m]
    if not names:
        raise ValueError("methods is empty; name at least one, e.g. --methods=full,lisa_wor")
    for name in names:
        parse_method(name)
    rows = [measure(cfg, name, device) for name in names]
    estimate = device.type != 'cuda'
    return dict(estimate=estimate, device=device.type if estimate else torch.cuda.get_device_name(device),
                torch=torch.__version__, config=cfg, command=' '.join(['python bench_memory.py', *argv]),
                notes=notes_for(cfg, device, estimate, rows[0]['n_params']), rows=rows)


def write(result, prefix):
    os.makedirs(os.path.dirname(prefix) or '.', exist_ok=True)
    text = markdown(result)
    with open(prefix + '.md', 'w') as f:
        f.write(text)
    rows = [{**r, **{f'{k}_gib': (None if r[k] is None else round(gib(r[k]), 4))
                     for k in ('params', 'grads', 'optimizer', 'others', 'peak', 'reserved', 'projectors',
                               'cpu_state', 'tracked_peak')}} for r in result['rows']]
    with open(prefix + '.json', 'w') as f:
        json.dump({**result, 'rows': rows}, f, indent=1)
    plot(result, prefix + '.png')
    return text


def output_prefix(cfg):
    """Where main writes: --out, else out/memory_<model> (git-ignored), never results/ unless named."""
    return cfg['out'] or os.path.join('out', f"memory_{cfg['model']}")


def main(argv):
    try:
        cfg = configure(DEFAULTS, argv)
        result = run(cfg, argv)
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    prefix = output_prefix(cfg)
    print(write(result, prefix), end='')
    print(f"wrote {prefix}.md, {prefix}.json, {prefix}.png")


if __name__ == '__main__':
    main(sys.argv[1:])
