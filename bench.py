r"""
Training speed of the methods on the same model and batch, like nanoGPT's bench.py: time per iteration, tokens/s,
MFU (on a GPU of known peak) and peak memory. Each row builds a fresh model (same seed) and runs Trainer.step,
train.py's iteration, at learning_rate on one random batch reused.

$ python bench.py --methods=full,lisa,lisa_wor,galore --preset=gpt2 --vocab_size=50304 --batch_size=12 \
      --block_size=1024 --omgd_gamma=3                                   # one GPU, compiled
$ python bench.py --methods=full,lisa_wor --arch=llama --n_layer=8 --n_head=8 --n_embd=256 \
      --vocab_size=8192 --batch_size=4 --block_size=128 --steps=10      # CPU, a small LLaMA-layout model
$ python bench.py config/gpt2_lisa_wor.py --methods=lisa_wor --precisions=amp,bf16,bf16_master

Every key of train.py is accepted, with its meaning and default; device is auto (cuda if available, else cpu), cuda or
cpu. Its own keys: methods and precisions (the rows, as in bench_memory.py), steps (timed iterations), warmup_steps (run
first, compilation included), interleave (rows stepped round-robin: other processes slow all alike), out (the report's
file), profile (PREFIX: one more iteration per row under torch.profiler, to PREFIX_METHOD_PRECISION.txt).

ms/iter is the median of the timed iterations; 'switch ms/iter' the mean of those that switched (what the median
hides); 'FLOP limit vs full' is full's FLOPs per token over the row's, the speed-up the FLOP count allows.
"""

import gc
import itertools
import os
import platform
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

import builder
import memory_estimate
import train_config
from configurator import at_least, command_line
from infra import memory_options
from infra.metrics import mfu, peak_bf16_flops
from trainer import Trainer

# keys of this script only (train.py has none of these names); `device` has its own values here
OWN_KEYS = dict(methods='', precisions='', steps=20, warmup_steps=5, interleave=False, out='', profile='')
assert not set(OWN_KEYS) & set(train_config.DEFAULTS)
DEFAULTS = {**train_config.DEFAULTS, 'device': 'auto', **OWN_KEYS}
RULES = {**train_config.RULES, 'steps': at_least(1), 'warmup_steps': at_least(0)}


class MethodRun:
    """One row's model, optimizer and cycler, stepped one train.py iteration at a time."""

    def __init__(self, cfg, device):
        self.cfg, self.device = cfg, device
        self.label = memory_estimate.precision_label(cfg['precision'], cfg['master_device'])
        torch.manual_seed(cfg['seed'])
        self.net, self.opt, self.cycler = memory_estimate.build(cfg, device)
        if cfg['compile']:
            builder.compile_blocks(self.net, cfg['method'])  # train.py's regional compilation
        gen = torch.Generator().manual_seed(cfg['seed'])
        vocab = self.net.config.vocab_size
        x = torch.randint(0, vocab, (cfg['batch_size'], cfg['block_size']), generator=gen).to(device)
        batches = itertools.repeat((x, torch.roll(x, -1, dims=1), None))  # the same batch every micro-step
        # train.py's iteration; the learning rate stays at learning_rate (no schedule)
        self.trainer = Trainer({**cfg, 'decay_lr': False}, self.net, self.opt, self.cycler, batches, device.type)
        self.tokens = cfg['batch_size'] * cfg['block_size'] * cfg['gradient_accumulation_steps']
        self.times, self.switch_times, self.flops, self.loss = [], [], [], None

    def sync(self):
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)

    def step(self, it, timed):
        self.sync()
        t0 = time.perf_counter()
        loss, switched = self.trainer.step(it)
        self.sync()
        if timed:
            self.times.append(time.perf_counter() - t0)
            if switched:  # a switch iteration: its cost is what the median hides
                self.switch_times.append(self.times[-1])
            self.flops.append(self.net.estimate_flops_per_token())
            self.loss = loss.item()

    def profile(self, it, prefix):
        """Iteration `it` under torch.profiler: its operators by GPU time (on CUDA), then by host time (a switch's
        host work, the CUDA runtime's calls), in PREFIX_METHOD_PRECISION.txt."""
        cuda = self.device.type == 'cuda'
        with torch.profiler.profile() as prof:  # the host's activity and, on a machine with CUDA, the GPU's
            self.step(it, timed=False)
        with open(f"{prefix}_{self.cfg['method']}_{self.label}.txt", 'w') as f:
            for key, what in [*([('self_device_time_total', 'GPU')] if cuda else []), ('self_cpu_time_total', 'host')]:
                f.write(f"iteration {it}, by {what} time\n{prof.key_averages().table(sort_by=key, row_limit=30)}\n")

    def row(self, peak_flops, with_memory):
        dt, flops = statistics.median(self.times), statistics.mean(self.flops)  # median: robust to an odd slow step
        return dict(
            method=self.cfg['method'],
            precision=self.label,
            ms=1000 * dt,
            mean_ms=1000 * sum(self.times) / len(self.times),
            tokens_per_s=self.tokens / dt,
            loss=self.loss,
            mfu=mfu(flops, self.tokens, dt, peak_flops) if peak_flops else None,
            peak_gib=torch.cuda.max_memory_allocated(self.device) / 2**30 if with_memory else None,
            reserved_gib=torch.cuda.max_memory_reserved(self.device) / 2**30 if with_memory else None,
            n_params=sum(p.numel() for p in self.net.parameters()),
            flops_per_token=flops,
            switch_ms=1000 * statistics.mean(self.switch_times) if self.switch_times else None,
        )


def bench(row_cfgs, device):
    """Time every row: one after the other (peak memory per row on CUDA) or interleaved; a progress bar on stderr."""
    cfg, cuda = row_cfgs[0], device.type == 'cuda'
    total, rows = cfg['warmup_steps'] + cfg['steps'], []
    with tqdm(total=total * len(row_cfgs), desc='timing', unit='iter') as bar:
        for group in [row_cfgs] if cfg['interleave'] else [[row_cfg] for row_cfg in row_cfgs]:
            runs = [MethodRun(row_cfg, device) for row_cfg in group]
            bar.set_postfix_str(', '.join(f"{run.cfg['method']} ({run.label})" for run in runs))
            for it in range(total):
                if it == cfg['warmup_steps'] and cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                for run in runs:
                    run.step(it, timed=it >= cfg['warmup_steps'])
                    bar.update()
            for run in runs:
                rows.append(run.row(peak_bf16_flops(device), with_memory=cuda and not cfg['interleave']))
                if cfg['profile']:  # after the timing and the memory peak, so neither includes the profiler
                    run.profile(total, cfg['profile'])
                if not cfg['interleave']:
                    r = rows[-1]
                    bar.write(
                        f"{r['method']} ({r['precision']}): {r['ms']:.1f} ms/iter, {r['tokens_per_s']:,.0f} "
                        f"tokens/s, loss {r['loss']:.3f}",
                        file=sys.stdout,
                    )
                    sys.stdout.flush()
            del runs, run
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
    return rows


def describe_machine(device):
    if device.type == 'cuda':
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core CPU ({cpu}), {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def markdown(cfg, rows, device, config, argv):
    # what precision=amp computes in (autocast_context)
    autocast = f"{cfg['dtype']} autocast" if device.type == 'cuda' and cfg['dtype'] != 'float32' else "fp32 compute"
    amp = f" (amp: {autocast})" if any(r['precision'] == 'amp' for r in rows) else ''
    out = [
        f"Machine: {describe_machine(device)}",
        f"Model: {memory_estimate.model_name(cfg)} ({config.arch}, {config.n_layer} blocks, n_embd {config.n_embd}, "
        f"vocab {config.vocab_size}, {rows[0]['n_params'] / 1e6:.1f}M parameters); batch {cfg['batch_size']} x "
        f"{cfg['block_size']} tokens x {cfg['gradient_accumulation_steps']} micro-batches; "
        f"precision {', '.join(dict.fromkeys(r['precision'] for r in rows))}{amp}; "
        f"compile={cfg['compile']}; {'rows interleaved step by step; ' if cfg['interleave'] else ''}"
        f"{cfg['steps']} timed iterations after {cfg['warmup_steps']} warm-up; LISA: {cfg['omgd_gamma']} "
        f"blocks, switching every {cfg['omgd_period']}, omgd_state '{cfg['omgd_state']}'",
        f"Command: `python bench.py {' '.join(argv)}`",
        '',
        '| Method | Precision | ms/iter (median) | ms/iter (mean) | switch ms/iter | tokens/s | vs full '
        '| FLOP limit vs full | MFU | peak alloc GiB | peak reserved GiB |',
        '|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in rows:
        full = next((f for f in rows if f['method'] == 'full' and f['precision'] == r['precision']), None)
        speed = f"{r['tokens_per_s'] / full['tokens_per_s']:.2f}x" if full else '–'  # full at the same precision
        limit = f"{full['flops_per_token'] / r['flops_per_token']:.2f}x" if full else '–'
        switch = '–' if r['switch_ms'] is None else f"{r['switch_ms']:.1f} ({r['switch_ms'] / r['ms'] - 1:+.0%})"
        mfu_shown = '–' if r['mfu'] is None else f"{100 * r['mfu']:.1f}%"
        mem = ['–' if r[k] is None else f"{r[k]:.2f}" for k in ('peak_gib', 'reserved_gib')]
        out.append(
            f"| {r['method']} | {r['precision']} | {r['ms']:.1f} | {r['mean_ms']:.1f} | {switch} "
            f"| {r['tokens_per_s']:,.0f} | {speed} | {limit} | {mfu_shown} | {mem[0]} | {mem[1]} |"
        )
    return '\n'.join(out) + '\n'


def check(cfg):
    """One-line ValueErrors for bad input; returns (device, row configs, TransformerConfig)."""
    return memory_estimate.check_rows(cfg, ('cuda', 'cpu'), without_cuda='cpu')


def setup(cfg, given=()):
    """check(cfg) or its one error line, with train.py's CUDA allocator and TF32; given: the command line's keys."""
    train_config.follow_device(cfg, given)
    if cfg['device'] in ('auto', 'cuda') and torch.cuda.is_available():  # before CUDA's first allocation
        print(memory_options.cuda_allocator(), flush=True)
    try:
        device, row_cfgs, config = check(cfg)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if device.type == 'cuda':  # as train.py
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, row_cfgs, config


def main(argv):
    given = set()
    cfg = command_line(argv, DEFAULTS, RULES, __doc__, train_config.meanings(), given)
    device, row_cfgs, config = setup(cfg, given)
    try:
        rows = bench(row_cfgs, device)
    except RuntimeError as e:  # torch.OutOfMemoryError (CUDA), or the CPU allocator refusing a size
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        sys.exit(
            f"error: a row does not fit in the memory of {device.type} ({str(e).strip().splitlines()[0][:160]}); "
            f"lower --batch_size or --block_size, or choose a smaller model"
        )
    text = markdown(cfg, rows, device, config, argv)
    print(text, end='')
    if out := cfg['out']:
        try:
            os.makedirs(os.path.dirname(out) or '.', exist_ok=True)
            with open(out, 'w') as f:
                f.write(text)
        except OSError as e:  # a full disk, a read-only folder, a file where a folder should be
            sys.exit(f"error: cannot write the report {out} ({e.strerror or e}); free space or choose another --out")


if __name__ == '__main__':
    main(sys.argv[1:])
