"""
Checkpoint save and load under torchrun: today's single file (ckpt.pt: the full state gathered and
written by rank 0) against sharded step folders (infra/checkpoint_dcp.py: every rank writes its shards),
as train.py saves and resumes them. Prints seconds and each rank's peak host memory (VmHWM, reset
before each phase through /proc/self/clear_refs) for a model of a preset, AdamW state for every
parameter (method 'full': the largest state a checkpoint holds).

$ OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 experiments/bench_checkpoint.py \\
    --preset=gpt2 --parallel=fsdp

Keys: preset, vocab_size, parallel ('fsdp' or 'ddp'), out_dir (where the checkpoints go), formats
(comma-separated: file, dcp (written before save returns), dcp_async (returns once the state is
copied to host memory; the write goes on in a thread)), phase: 'both' (save, then load, in this
process; out_dir emptied first and removed at the end), or 'save' then 'load' in fresh processes
(memory a phase freed stays in the process's allocator, so a later phase's peak in the same
process reads low). results/checkpoint_formats.md.
"""

import gc
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import builder  # noqa: E402
import train_config  # noqa: E402
from configurator import command_line  # noqa: E402
from infra import checkpoint as ckpt_io  # noqa: E402
from infra import checkpoint_dcp, distributed  # noqa: E402
from trainer import grad_scaler  # noqa: E402

DEFAULTS = dict(
    preset='gpt2',
    vocab_size=50304,
    parallel='fsdp',
    out_dir='bench-checkpoint',
    formats='file,dcp,dcp_async',
    phase='both',
)


def rss_kib(field):
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith(field + ':'):
                return int(line.split()[1])
    return 0


def reset_peak():
    """Reset VmHWM to the current RSS (Linux: clear_refs 5)."""
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')


def size_of(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


class Phase:
    """Seconds (from a barrier to a barrier) and this rank's RSS before and peak RSS during."""

    def __init__(self, ranks):
        self.ranks = ranks

    def __enter__(self):
        gc.collect()
        if self.ranks.enabled:
            dist.barrier(group=self.ranks.cpu_group)
        reset_peak()
        self.before = rss_kib('VmRSS')
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.seconds_here = time.perf_counter() - self.t0  # this rank's own time (async: until it returned)
            if self.ranks.enabled:
                dist.barrier(group=self.ranks.cpu_group)
            self.seconds = time.perf_counter() - self.t0
            self.peak = rss_kib('VmHWM')


def main(argv):
    cfg = command_line(argv, DEFAULTS, usage=__doc__)
    ranks, device = distributed.setup('gloo', 'cpu')
    fsdp = ranks.enabled and cfg['parallel'] == 'fsdp'
    train_cfg = {
        **train_config.DEFAULTS,
        **train_config.machine_defaults(cuda=False),
        'preset': cfg['preset'],
        'vocab_size': cfg['vocab_size'],
        'method': 'full',
        'parallel': cfg['parallel'],
        'compile': False,
        'out_dir': cfg['out_dir'],
        'dropout': 0.0,
        'block_size': 1024,
    }
    shard = (lambda m: distributed.shard_fsdp(m, ranks, 'cpu', None)) if fsdp else None
    out_dir = cfg['out_dir']
    if ranks.master and cfg['phase'] in ('both', 'save'):
        shutil.rmtree(out_dir, ignore_errors=True)
        os.makedirs(out_dir)
    rows = []

    def report(name, phase, extra=''):
        stats = ranks.gather((phase.before, phase.peak, phase.seconds_here))
        if ranks.master:
            rows.append((name, phase.seconds, stats, extra))
            r0 = stats[0]
            others = ', '.join(f"rank {r}: {s[1] / 2**20:.2f} GiB" for r, s in enumerate(stats) if r)
            print(
                f"{name:<22} {phase.seconds:7.2f} s  rank 0: RSS {r0[0] / 2**20:.2f} GiB before, peak "
                f"{r0[1] / 2**20:.2f} GiB (+{(r0[1] - r0[0]) / 2**20:.2f})"
                f"{f'; peak {others}' if others else ''}{extra}",
                flush=True,
            )

    formats = cfg['formats'].split(',')
    where = {
        fmt: os.path.join(out_dir, 'ckpt.pt')
        if fmt == 'file'
        else checkpoint_dcp.complete_steps(os.path.join(out_dir, fmt))[-1][1]
        for fmt in formats
    }
    if cfg['phase'] == 'load':
        return load_phase(cfg, ranks, train_cfg, shard, fsdp, formats, where, report)
    # the model and a full AdamW state, built as train.py builds them (sharded under fsdp)
    torch.manual_seed(0)
    model, optimizer, cycler = builder.build(
        train_cfg,
        'cpu',
        model=builder.new_model(
            __import__('model').TransformerConfig(**builder.transformer_kwargs(train_cfg, cfg['vocab_size'])), 'cpu'
        ),
        shard=shard,
    )
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the global one
    if ranks.master:
        print(
            f"{cfg['preset']} ({n_params / 1e6:.1f}M parameters), AdamW state for all, {cfg['parallel']} on "
            f"{ranks.world_size} gloo rank(s), torch {torch.__version__}",
            flush=True,
        )
    objects = {'model': model, 'optimizer': optimizer, 'cycler': cycler, 'scaler': grad_scaler(train_cfg, 'cpu')}
    import dataclasses

    values = {
        'data': {},
        'model_args': dataclasses.asdict(model.config),
        'iter_num': 1,
        'best_val_loss': 0.0,
        'config': train_cfg,
        'wandb_id': None,
    }
    for fmt in formats:
        if fmt == 'file':
            path = os.path.join(out_dir, 'ckpt.pt')
            with Phase(ranks) as phase:
                ckpt_io.save(path, ranks, objects, values, fsdp, 'cpu')
            report('save file', phase, f"; {size_of(path) / 2**20:.0f} MiB on disk")
        else:
            sub = os.path.join(out_dir, fmt)
            if ranks.master:
                os.makedirs(sub, exist_ok=True)
            saver = checkpoint_dcp.Saver(sub, ranks, keep_last=1, use_async=fmt == 'dcp_async')
            with Phase(ranks) as phase:
                path = saver.save(objects, values, 'cpu')
                if fmt == 'dcp_async':
                    returned = ranks.gather(time.perf_counter() - phase.t0)
                    saver.finish()
            extra = f"; {size_of(path) / 2**20:.0f} MiB on disk"
            if fmt == 'dcp_async':
                extra += f"; save returned after {max(returned):.2f} s (the write went on in the background)"
            else:
                saver.finish()
            report(f'save {fmt}', phase, extra)
        where[fmt] = path
    del objects, model, optimizer, cycler
    gc.collect()
    if cfg['phase'] == 'save':
        distributed.teardown(ranks)
        return 0
    return load_phase(cfg, ranks, train_cfg, shard, fsdp, formats, where, report)


def load_phase(cfg, ranks, train_cfg, shard, fsdp, formats, where, report):
    # resume as train.py does: file: read (mapped) on every rank, full model, shard, optimizer state;
    # dcp: a new model, shard, each rank reads its shards
    for fmt in formats:
        path = where[fmt]
        with Phase(ranks) as phase:
            if fmt == 'file':
                checkpoint = ckpt_io.read(path)
                raw = builder.resumed_model(checkpoint, train_cfg, 'cpu', path)
                model, optimizer, _ = builder.build(train_cfg, 'cpu', model=raw, shard=shard)
                ckpt_io.load_state(checkpoint, {'model': model, 'optimizer': optimizer}, fsdp)
            else:
                checkpoint = checkpoint_dcp.check_readable(path)
                raw = builder.resumed_model(checkpoint, train_cfg, 'cpu', path)
                model, optimizer, _ = builder.build(train_cfg, 'cpu', model=raw, shard=shard)
                checkpoint_dcp.load(path, checkpoint, model, optimizer, ranks.cpu_group)
            del checkpoint, raw
        report(f'load {fmt}', phase)
        del model, optimizer
        gc.collect()
    if ranks.master and cfg['phase'] == 'both':
        shutil.rmtree(cfg['out_dir'], ignore_errors=True)
    distributed.teardown(ranks)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
