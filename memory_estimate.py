"""The memory of a training iteration: measure() runs one row of bench_memory.py (on a GPU, or on meta where
LiveBytes counts live tensor bytes op by op and MetaAsCuda allocates what a GPU would); check_rows makes the
benchmarks' rows (one train.py config per method x precision); check_fits refuses a model that cannot fit before it
is allocated. Not modelled: allocator rounding, cuBLAS workspaces, the CUDA context, fused AdamW."""

import gc
import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import builder
import dataloader
import train_config
from infra import memory_options
from model import DTYPES, Transformer, TransformerConfig, emulated_autocast
from trainer import Trainer, random_batches


def state_tensors(optimizer):
    """(param, key, tensor) of the optimizer state, less scalar 'step's and GaLore's projectors (counted apart)."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and key != 'projector':
                yield p, key, value


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_bytes(model, optimizer):
    """Exact bytes of parameters, gradients and optimizer state tensors (on any device)."""
    params = list(model.parameters())  # deduped: a tied weight counts once
    grads = nbytes(p.grad for p in params if p.grad is not None)
    return {'params': nbytes(params), 'grads': grads, 'optimizer': nbytes(v for _, _, v in state_tensors(optimizer))}


class LiveBytes(TorchDispatchMode):
    """Bytes of the live tensor storages on `device` (meta too) and their peak, op by op: a storage once, however
    many views, until freed; none made in `with tracker.host():`. (torch's MemTracker fails on frozen parameters.)"""

    def __init__(self, device):
        super().__init__()
        self.device = torch.device(device)
        self.entries = {}  # id(storage) -> [weakref, nbytes, host]
        self.current = self.peak = self.host_depth = 0

    def add(self, *tensors):
        """Track the tensors among `tensors` (any nesting): those made before entering, and each op's outputs."""
        for t in tree_leaves(tensors):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            st = t.untyped_storage()
            key, nbytes = id(st), st.nbytes()
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = [weakref.ref(st, partial(self._freed, key)), 0, self.host_depth > 0]
            if not entry[2]:  # a new storage, or one resized in place, unless in host memory
                self.current += nbytes - entry[1]
                self.peak = max(self.peak, self.current)
            entry[1] = nbytes

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

    def _freed(self, key, ref):
        entry = self.entries.get(key)
        if entry is not None and entry[0] is ref:
            del self.entries[key]
            if not entry[2]:
                self.current -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(out)
        return out


class MetaAsCuda(TorchFunctionMode):
    """A forward/backward on meta (or CPU) allocates what it would on a GPU: flash (bf16/fp16) or memory-efficient
    (fp32) attention; with dtype, CUDA autocast's casts (cache=True: trainable leaves' casts kept to the forward's
    end) and model.Linear's CUDA path. backward() runs the backward (cache=False: checkpointing recomputes)."""

    follow_cuda_linear = True  # off: model.Linear without its CUDA path (a test measures the difference)
    # cast to dtype: matmuls, as functions and as Tensor methods
    LOW = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm}
    LOW |= {torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.bmm}
    # cast to fp32: norms, softmax, losses and the reductions and pointwise ops autocast runs in fp32
    FP32 = {F.layer_norm, F.rms_norm, F.group_norm, F.cross_entropy, F.nll_loss}
    FP32 |= {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax}
    FP32 |= {torch.exp, torch.log, torch.rsqrt, torch.pow, torch.Tensor.pow, torch.sum}

    def __init__(self, dtype=None, cache=False):
        super().__init__()
        self.dtype, self.cache, self.casts = dtype, cache, {}

    def __enter__(self):
        self.emulation = ExitStack()
        if self.dtype is not None and self.follow_cuda_linear:
            self.emulation.enter_context(emulated_autocast(('meta', 'cpu'), self.dtype))
        return super().__enter__()

    def __exit__(self, *args):
        self.casts.clear()
        self.emulation.close()
        return super().__exit__(*args)

    def backward(self, loss):
        """loss.backward() with this mode on: the autograd engine directly (Tensor.backward would reach the mode)."""
        with self:
            torch.autograd.graph._engine_run_backward(
                (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
            )

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
        if self.dtype is not None and (func in self.LOW or func in self.FP32):
            dtype = self.dtype if func in self.LOW else torch.float32
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
        if self.dtype is not None:
            q, k, v = (self._cast(t, self.dtype) for t in (q, k, v))
        if enable_gqa and k.size(1) != q.size(1):
            k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))
        aten = torch.ops.aten
        if q.dtype in (torch.bfloat16, torch.float16):
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, False, dropout_p, is_causal, scale=scale)[0]


def available_bytes(device):
    """Free memory of `device`: the GPU's (cudaMemGetInfo) or the host's MemAvailable (Linux)."""
    device = torch.device(device)
    if device.type == 'cuda':
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open('/proc/meminfo') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith('MemAvailable:'))
    except (OSError, StopIteration):
        return None  # not Linux: no check


def estimate_iteration(cfg, vocab_size=0):
    """measure's row (bytes) of an iteration of train.py's `cfg` on one device, estimated on meta (seconds for 7B)."""
    cfg = {**cfg, 'vocab_size': vocab_size or cfg['vocab_size'], 'micro_batches': 0, 'compile': False}
    return measure(cfg, torch.device('meta'))


def unit_params(config):
    """(parameters of the largest block, outside the blocks) of Transformer(config): the FSDP2 units of shard_fsdp."""
    with torch.device('meta'):
        model = Transformer(config)
    in_blocks = {id(p) for p in model.blocks.parameters()}
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)  # parameters() dedupes a tie
    return block, root


def per_rank_peak(row, config, world_size=1, fsdp=False, bytes_per_weight=4):
    """One rank's peak bytes from estimate_iteration's `row`. Under FSDP2 an APPROXIMATION: params, grads and optimizer
    / world_size, 'others' whole, plus the unsharded units (bytes_per_weight each): the root twice (weights from
    forward to backward, full gradients) and three blocks (computing, prefetched, one's full gradients)."""
    if not fsdp or world_size <= 1:
        return row['peak']
    block, root = unit_params(config)
    sharded = (row['params'] + row['grads'] + row['optimizer']) / world_size
    gathered = (2 * root + 3 * block) * bytes_per_weight
    return int(sharded + gathered + row['others'])


def check_fits(config, device, bytes_per_weight, estimate=None, world_size=1, fsdp=False):
    """Refuse (ValueError, one line) a model whose weights (`bytes_per_weight` each, whole on every rank before
    shard_fsdp) exceed the free memory of `device`. Over an eighth of it (AdamW alone makes 4x fp32 weights),
    estimate() is compared too: estimate_iteration's row (per_rank_peak under FSDP) or one device's peak bytes."""
    device = torch.device(device)
    free = None if device.type == 'meta' else available_bytes(device)
    if free is None:
        return
    with torch.device('meta'):
        n_params = sum(p.numel() for p in Transformer(config).parameters())
    need = bytes_per_weight * n_params
    if need > free:
        raise ValueError(
            f"the model has {n_params / 1e9:.2f}B parameters: {need / 2**30:.1f} GiB of weights ({bytes_per_weight} "
            f"bytes each), more than the {free / 2**30:.1f} GiB free on {device.type}; choose a smaller model or a "
            f"machine with more memory (bench_memory.py --device=meta estimates any size)"
        )
    if estimate is not None and need > free / 8:
        peak, sharded = estimate(), fsdp and world_size > 1
        if isinstance(peak, dict):  # a row: split into one rank's share
            peak = per_rank_peak(peak, config, world_size, fsdp, bytes_per_weight)
        elif sharded:  # one device's peak bytes cannot be split
            return
        if peak > free:
            raise ValueError(
                f"the model has {n_params / 1e9:.2f}B parameters and an iteration needs about {peak / 2**30:.1f} GiB"
                f"{f' per rank of {world_size} under FSDP' if sharded else ''} (meta-device estimate), more than the "
                f"{free / 2**30:.1f} GiB free on {device.type}; choose a smaller model or batch, a memory option "
                f"(docs/memory.md), {'more ranks' if sharded else '--parallel=fsdp over several GPUs'}, or more memory"
            )


def model_config(cfg):
    """The TransformerConfig builder.build makes of cfg (one-line error for an impossible shape)."""
    try:
        vocab = dataloader.dataset_vocab(cfg['dataset'], cfg['vocab_size'])
        return TransformerConfig(**builder.transformer_kwargs(cfg, vocab))
    except (ValueError, TypeError) as e:
        raise ValueError(f"model shape: {e}") from None


def precision_label(precision, master_device):
    return f"{precision}:{master_device}" if master_device else precision


def check_rows(cfg, devices=('cuda', 'meta', 'cpu'), without_cuda='meta'):
    """The benchmarks' checks of cfg (one-line ValueErrors, before any allocation). Returns the torch.device (auto:
    cuda, else `without_cuda`), one train.py config per method x precision ('': cfg's own) and the TransformerConfig."""
    name = cfg['device']
    if name == 'auto':
        name = 'cuda' if torch.cuda.is_available() else without_cuda
    if name not in devices:
        raise ValueError(f"device must be auto, {', '.join(devices)}, got {name!r}")
    if name == 'cuda' and not torch.cuda.is_available():
        estimate = " for an estimate" if without_cuda == 'meta' else ""
        raise ValueError(f"device=cuda but CUDA is not available; use --device={without_cuda}{estimate}")
    # with its index: tensors report cuda:N, and LiveBytes compares devices
    device = torch.device('cuda', torch.cuda.current_device()) if name == 'cuda' else torch.device(name)
    train_config.check_preset(cfg)
    config = model_config(cfg)
    check_fits(config, device, builder.weight_dtype(cfg['precision']).itemsize)  # before a row allocates it
    methods = list(dict.fromkeys(m for m in cfg['methods'].split(',') if m)) if cfg['methods'] else [cfg['method']]
    specs = [p.partition(':')[::2] for p in cfg['precisions'].split(',') if p]  # 'bf16_master:cpu' -> (.., 'cpu')
    precisions = list(dict.fromkeys(specs)) if cfg['precisions'] else [(cfg['precision'], cfg['master_device'])]
    if not methods:
        raise ValueError("methods lists no method; name at least one, e.g. --methods=full,lisa_wor")
    if not precisions:
        raise ValueError("precisions lists no precision; name at least one, e.g. --precisions=bf16,bf16_master")
    rows = [{**cfg, 'method': m, 'precision': p, 'master_device': d} for p, d in precisions for m in methods]
    for row in rows:
        train_config.check(row)
    return device, rows, config


def build(cfg, device, host_scope=nullcontext):
    """builder.build with the model's random weights drawn on `device` (on meta: no memory, no cost)."""
    vocab = dataloader.dataset_vocab(cfg['dataset'], cfg['vocab_size'])
    return builder.build(cfg, device, vocab, cpu_draws=False, host_scope=host_scope)


def measure(cfg, device):
    """Build cfg's model (a check_rows row) as train.py does, warm up, measure one Trainer.step; bytes, broken down."""
    cuda = device.type == 'cuda'
    compiled = cuda and cfg['compile']
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
    tracker = LiveBytes(device)
    torch.manual_seed(cfg['seed'])
    if cfg['master_device'] == 'cpu' and not cuda:
        # no second memory to offload to: the masters stay on the one device, counted as host memory
        net, opt, cycler = build({**cfg, 'master_device': ''}, device, host_scope=tracker.host)
    else:
        net, opt, cycler = build(cfg, device)
    if compiled:  # train.py's regional compilation
        builder.compile_blocks(net, cfg['method'])
    if cuda:  # the fp32 copy a bf16 build went through is cached, not in use: give it back
        gc.collect()
        torch.cuda.empty_cache()

    autocast, backward, offload = None, None, nullcontext()
    if device.type == 'meta':  # the GPU's kernels and autocast, emulated on shapes
        dtype = DTYPES[cfg['dtype']] if cfg['precision'] == 'amp' and cfg['dtype'] != 'float32' else None
        autocast, backward = MetaAsCuda(dtype, cache=True), MetaAsCuda(dtype, cache=False).backward

        def to_host(t):  # activation offload's copy out: a meta tensor counted as host memory
            with tracker.host():
                return torch.empty_like(t)

        offload = memory_options.offload_copies('meta', to_host, lambda host, device: torch.empty_like(host))
    gas = cfg['gradient_accumulation_steps']
    micro = min(cfg['micro_batches'] or gas, gas)
    sizes = {}

    def at_zero_grad(trainer):  # the step is done, the gradients still held (the measured iteration is the last)
        if cuda:
            torch.cuda.synchronize(device)
        states = [v for _, _, v in state_tensors(opt)]
        projectors = [s['projector'] for s in opt.state.values() if torch.is_tensor(s.get('projector'))]
        sizes.update(
            memory_bytes(net, opt),
            optimizer=nbytes(v for v in states if not tracker.is_host(v)),
            cpu_state=nbytes(v for v in states + projectors if tracker.is_host(v)),
            projectors=nbytes(v for v in projectors if not tracker.is_host(v)),
        )

    # train.py's iteration, on a fresh batch per micro-step, on the device, as train.py's loader gives
    batches = random_batches(net.config.vocab_size, (cfg['batch_size'], cfg['block_size']), device)
    observer = SimpleNamespace(before_zero_grad=at_zero_grad)
    trainer = Trainer(
        cfg, net, opt, cycler, batches, device.type, autocast=autocast, backward=backward, observer=observer
    )
    tracker.add(list(net.parameters()), list(net.buffers()))
    period, start = cfg['omgd_period'], cfg['omgd_warmup']
    t0 = time.time()
    with tracker if not compiled else nullcontext(), offload:
        # warm-up: the first switch and its step create the optimizer state (and GaLore's projectors);
        # under 'keep' one iteration at every switch of a full cycle leaves state on every block
        switches = len(net.blocks) // cfg['omgd_gamma'] if cfg['omgd_state'] == 'keep' and cycler.schedule else 1
        for i in range(switches):
            trainer.step(start + i * period, micro_steps=1)
        # measured: the next iteration, the second of a switching period
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        tracker.peak = tracker.current
        trainer.step(start + (switches - 1) * period + 1, micro_steps=micro)
        if cuda:
            torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else tracker.peak
    return dict(
        {key: cfg[key] for key in ('method', 'precision', 'master_device')},
        **sizes,  # params, grads, optimizer, cpu_state, projectors
        tracked_peak=None if compiled else tracker.peak,
        seconds=round(time.time() - t0, 2),
        micro_batches=micro,
        active_blocks=list(cycler.active) if cycler.schedule else 'all',
        peak=peak,
        reserved=torch.cuda.max_memory_reserved(device) if cuda else None,
        others=peak - sizes['params'] - sizes['grads'] - sizes['optimizer'],
        n_params=sum(p.numel() for p in net.parameters()),
    )  # the model, optimizer and cycler are freed with this frame


def model_name(cfg):
    return cfg['preset'] or 'custom'
