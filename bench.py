"""
Training speed of full AdamW, LISA, LISA-wor and GaLore on the same model and batch, in one run,
like nanoGPT's bench.py: time per iteration, tokens/s, MFU (on a GPU of known peak) and peak memory.

$ python bench.py --model=gpt2 --vocab_size=50304 --batch_size=12 --block_size=1024 --gamma=3   # one GPU, compiled
$ python bench.py --model=tiny --device=cpu --compile=False --steps=10                          # CPU

(the GPU command is the one of experiments/gpu_benchmarks.sh: GPT-2 124M with the padded vocabulary
and 3 of 12 active blocks of config/gpt2_lisa_wor.py)

Each method gets a fresh model (same seed) and optimizer, built as train.py builds them (AdamW,
fused on CUDA, over all parameters; galore.build_optimizer for GaLore/GoLore; omgd.build_cycler
for the layer-cycling methods, switching every omgd_period iterations). With --compile every
block is compiled on its own (regional compilation, as train.py does). `warmup_steps` iterations
(compilation included) are run before `steps` timed ones, whose median time gives ms/iter, tokens/s
and MFU (the mean is shown too); the data is one random batch reused. With --interleave the methods
are stepped round-robin, so that other processes on a shared machine slow them all alike.
MFU counts the FLOPs an iteration executes as train.py does: 6N per token for trainable matrices,
4N for frozen blocks (no weight-gradient GEMMs), 2N for frozen blocks below every trainable
parameter (forward only), plus attention.
"""
import gc
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch

import bench_memory
from configurator import ConfigError, configure
from model import peak_bf16_flops

# -----------------------------------------------------------------------------
model = 'tiny'  # a preset of model.py, or 'tiny' (llama, 8 blocks, n_embd 256, vocab 8192)
n_layer = 0  # overrides of the model's shape; 0 keeps the model's
n_head = 0
n_embd = 0
vocab_size = 0
batch_size = 8
block_size = 256
grad_accum = 1  # micro-batches per iteration
methods = 'full,lisa,lisa_wor,galore'  # full, galore, golore or any layer-cycling method of omgd.py
steps = 20  # timed iterations per method
warmup_steps = 5  # untimed iterations first (compilation happens here)
compile = torch.cuda.is_available()  # torch.compile each block separately
interleave = False  # step the methods round-robin (all models resident; no per-method peak memory)
device = 'auto'  # auto (cuda if available, else cpu), cuda, cpu
dtype = 'auto'  # autocast dtype: auto = bfloat16 on cuda, none (float32) on cpu, as train.py; float32, bfloat16
activation_checkpointing = False
gamma = 2  # LISA methods: active blocks
omgd_period = 10  # iterations between block switches
omgd_state = 'drop'
omgd_always = 'embed,pos,norm,head'
galore_rank = 128
galore_update_proj_gap = 200
galore_scale = 0.25
learning_rate = 1e-4
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
seed = 0
out = ''  # also write the Markdown table to this file
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in dict(globals()).items()
            if not k.startswith('_') and isinstance(v, (int, float, bool, str))}

class MethodRun:
    """One method's model, optimizer and cycler, stepped one training iteration at a time."""

    def __init__(self, cfg, method, device, autocast_dtype, config):
        base, _ = bench_memory.parse_method(method)
        self.cfg, self.method, self.device = cfg, method, device
        torch.manual_seed(cfg['seed'])
        self.net = bench_memory.build_model(config, device, torch.float32, cfg['activation_checkpointing'])
        self.opt = bench_memory.build_optimizer(self.net, base, '', cfg, device)
        self.cycler = bench_memory.build_cycler(self.net, self.opt, base, cfg, cfg['omgd_period'])
        self.n_params = sum(p.numel() for p in self.net.parameters())
        if cfg['compile']:
            for block in self.net.blocks:
                block.compile()
        gen = torch.Generator().manual_seed(cfg['seed'])
        self.x = torch.randint(0, config.vocab_size, (cfg['batch_size'], cfg['block_size']), generator=gen).to(device)
        self.y = torch.roll(self.x, -1, dims=1)
        self.autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        self.tokens = cfg['batch_size'] * cfg['block_size'] * cfg['grad_accum']
        self.times, self.flops, self.loss = [], [], None

    def sync(self):
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)

    def step(self, it, timed):
        cfg, net = self.cfg, self.net
        self.sync()
        t0 = time.perf_counter()
        self.cycler.step(it)
        for _ in range(cfg['grad_accum']):
            with self.autocast:
                _, loss = net(self.x, self.y)
                loss = loss / cfg['grad_accum']
            loss.backward()
        if cfg['grad_clip']:
            torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], cfg['grad_clip'])
        self.cycler.scale_grads()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()
        if timed:
            self.times.append(time.perf_counter() - t0)
            self.flops.append(net.estimate_flops_per_token() * self.tokens)
            self.loss = loss.item() * cfg['grad_accum']

    def row(self, peak_flops, memory):
        # the median iteration: robust to the odd slow step (a switch, another process on the machine)
        dt = statistics.median(self.times)
        row = dict(method=self.method, ms=1000 * dt, mean_ms=1000 * sum(self.times) / len(self.times),
                   tokens_per_s=self.tokens / dt, loss=self.loss,
                   mfu=sum(self.flops) / len(self.flops) / dt / peak_flops if peak_flops else None,
                   peak_gib=None, reserved_gib=None, n_params=self.n_params)
        if memory:
            row['peak_gib'] = torch.cuda.max_memory_allocated(self.device) / 2**30
            row['reserved_gib'] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return row


def bench(cfg, names, device, autocast_dtype, config):
    """Time every method; one after the other (peak memory per method on CUDA), or interleaved."""
    cuda = device.type == 'cuda'
    peak_flops = peak_bf16_flops(device)
    total = cfg['warmup_steps'] + cfg['steps']
    if cfg['interleave']:
        # round-robin: load from other processes on a shared machine hits every method alike
        runs = [MethodRun(cfg, name, device, autocast_dtype, config) for name in names]
        for it in range(total):
            for run in runs:
                run.step(it, timed=it >= cfg['warmup_steps'])
        return [run.row(peak_flops, memory=False) for run in runs]
    rows = []
    for name in names:
        run = MethodRun(cfg, name, device, autocast_dtype, config)
        for it in range(total):
            if it == cfg['warmup_steps'] and cuda:
                torch.cuda.reset_peak_memory_stats(device)
            run.step(it, timed=it >= cfg['warmup_steps'])
        rows.append(run.row(peak_flops, memory=cuda))
        r = rows[-1]
        print(f"{name}: {r['ms']:.1f} ms/iter, {r['tokens_per_s']:,.0f} tokens/s, loss {r['loss']:.3f}", flush=True)
        del run
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def describe_machine(device):
    if device.type == 'cuda':
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    return (f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")


def markdown(cfg, rows, device, config, argv):
    full = next((r for r in rows if r['method'] == 'full'), None)
    n_params = rows[0]['n_params']
    out = [f"Machine: {describe_machine(device)}",
           f"Model: {cfg['model']} ({config.arch}, {config.n_layer} blocks, n_embd {config.n_embd}, vocab "
           f"{config.vocab_size}, {n_params / 1e6:.1f}M parameters); batch {cfg['batch_size']} x "
           f"{cfg['block_size']} tokens x {cfg['grad_accum']} micro-batches; compile={cfg['compile']}; "
           f"{'methods interleaved step by step; ' if cfg['interleave'] else ''}"
           f"{cfg['steps']} timed iterations after {cfg['warmup_steps']} warm-up; LISA: {cfg['gamma']} "
           f"blocks, switching every {cfg['omgd_period']}",
           f"Command: `python bench.py {' '.join(argv)}`", '',
           '| Method | ms/iter (median) | ms/iter (mean) | tokens/s | vs full | MFU | peak alloc GiB | peak reserved GiB |',
           '|---|---|---|---|---|---|---|---|']
    for r in rows:
        speed = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else '–'
        mfu = '–' if r['mfu'] is None else f"{100 * r['mfu']:.1f}%"
        mem = ['–' if r[k] is None else f"{r[k]:.2f}" for k in ('peak_gib', 'reserved_gib')]
        out.append(f"| {r['method']} | {r['ms']:.1f} | {r['mean_ms']:.1f} | {r['tokens_per_s']:,.0f} | {speed} | {mfu} | "
                   f"{mem[0]} | {mem[1]} |")
    return '\n'.join(out) + '\n'


def main(argv):
    try:
        cfg = configure(DEFAULTS, argv)
        if cfg['device'] == 'auto':
            cfg['device'] = 'cuda' if torch.cuda.is_available() else 'cpu'
        if cfg['device'] not in ('cuda', 'cpu') or (cfg['device'] == 'cuda' and not torch.cuda.is_available()):
            raise ValueError(f"device must be auto, cuda (when available) or cpu, got {cfg['device']!r}")
        device = torch.device(cfg['device'])
        dtypes = {'float32': None, 'bfloat16': torch.bfloat16,
                  'auto': torch.bfloat16 if device.type == 'cuda' else None}
        if cfg['dtype'] not in dtypes:
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {cfg['dtype']!r}")
        if cfg['steps'] < 1 or cfg['warmup_steps'] < 0:
            raise ValueError("steps must be >= 1 and warmup_steps >= 0")
        names = [m for m in cfg['methods'].split(',') if m]
        if not names:
            raise ValueError("methods is empty; name at least one, e.g. --methods=full,lisa_wor")
        for name in names:
            if bench_memory.parse_method(name)[1]:
                raise ValueError(f"bench.py times plain methods; {name!r} has a suffix")
        config = bench_memory.model_config(cfg)
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    if device.type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    rows = bench(cfg, names, device, dtypes[cfg['dtype']], config)
    text = markdown(cfg, rows, device, config, argv)
    print(text, end='')
    if cfg['out']:
        os.makedirs(os.path.dirname(cfg['out']) or '.', exist_ok=True)
        with open(cfg['out'], 'w') as f:
            f.write(text)


if __name__ == '__main__':
    main(sys.argv[1:])
