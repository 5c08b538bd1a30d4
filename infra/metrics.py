"""What a run reports: each event's log line and its record in out_dir/metrics.jsonl (and wandb), model FLOPs
utilization (over PEAK_BF16_FLOPS), and the stdout the log goes to."""

import json
import os
import re
import sys
import time

import torch

# A value's template on a log line, else `name value` (a float to 4 significant digits); None: recorded, never
# shown. A value of None is left off the line (and out of an iteration's record).
SHOWN = {
    'loss': 'loss {:.4f}',
    'train_loss': 'train loss {:.4f}',
    'val_loss': 'val loss {:.4f}',
    'mc_acc': 'mc acc {:.4f}',
    'mc_acc_norm': 'acc_norm {:.4f}',
    'lr': 'lr {:.2e}',
    'ms': 'time {:.1f}ms',
    'tok_per_s': 'tok/s {:,.0f}',
    'epoch': 'epoch {:.2f}',
    'mfu': 'mfu {:.2%}',
    'mem_alloc_gib': 'mem {:.2f} GiB allocated',
    'mem_reserved_gib': '{:.2f} GiB reserved',
    'ddp_rebuild_ms': 'DDP rebuilt in {:.1f} ms',
    'description': '{}',
    'active': None,  # a switch's: its description says it
    'trains': None,
}
# Peak dense bf16 FLOP/s per GPU, from NVIDIA's datasheets ("with sparsity" halved)
PEAK_BF16_FLOPS = {
    'H100': 989.4e12,  # SXM5; its name has no variant word ('NVIDIA H100 80GB HBM3')
    'H100 PCIe': 756e12,
    'H100 NVL': 835e12,
    'H200': 989e12,  # SXM ('NVIDIA H200')
    'H200 NVL': 835e12,
    'GH200': 989e12,
    'A100': 312e12,  # SXM4 and PCIe alike
    'B200': 2250e12,
    'L40S': 362e12,
    'L4': 121e12,
    'A10': 125e12,
    'A10G': 125e12,
    'RTX 4090': 165e12,
}


class Metrics:
    """train.py's reports, one method per event, called on every rank: each value shows on the line by its rule in
    SHOWN and goes as it is into the event's record, with its `kind` and `iter` (wandb gets 'eval' and 'iter'). Rank
    0 prints and writes (not when eval_only); a resume drops the records after the checkpoint's iteration."""

    def __init__(self, cfg, ranks, device, resumed_from=None):
        self.cfg, self.master, self.world_size = cfg, ranks.master, ranks.world_size
        self.cuda = device.startswith('cuda')
        self.peak_flops = peak_bf16_flops(device)
        self.path, self.writes = os.path.join(cfg['out_dir'], 'metrics.jsonl'), self.master and not cfg['eval_only']
        self.resumed_from, self.started, self.wandb = resumed_from, False, None
        self.running_mfu = None  # the logged iterations' moving average
        if cfg['wandb_log'] and self.master:  # imported here, before anything is built
            try:
                import wandb
            except ImportError:
                raise ImportError("wandb_log=True needs the wandb package: pip install wandb") from None
            self.wandb = wandb

    def start_wandb(self, run_id):
        """The wandb run's id (None without wandb); a resume continues the checkpoint's `run_id`."""
        wandb, cfg = self.wandb, self.cfg
        if wandb is not None:
            run_id = run_id or wandb.util.generate_id()
            wandb.init(project=cfg['wandb_project'], name=cfg['wandb_run_name'], config=cfg, id=run_id, resume='allow')
        return run_id

    def header(self, model, checkpointer, tokens_per_iter, warnings=()):
        """The head of the log: warnings, the config, the model, what the run starts from."""
        if not self.master:
            return
        cfg, resuming = self.cfg, checkpointer.init_from == 'resume'
        for line in warnings:
            print(f"warning: {line}", file=sys.stderr, flush=True)
        print('config:\n' + '\n'.join(f'  {k} = {v!r}' for k, v in cfg.items()))
        print(
            f"model: {cfg['arch']}, {cfg['n_layer']} blocks, {model.get_num_params() / 1e6:.2f}M parameters "
            f"(from {'a checkpoint' if resuming else checkpointer.init_from})"
        )
        print(f"tokens per iteration: {tokens_per_iter:,} ({self.world_size} rank{'s' * (self.world_size > 1)})")
        if resuming:
            print(f"resuming from iteration {checkpointer.iter_num} of {checkpointer.path}")

    def begin(self, model, tokens_per_iter, first_iter):
        self.model, self.tokens_per_iter, self.first_iter = model, tokens_per_iter, first_iter
        self.run_start, self.flops_per_token = time.time(), None

    def evaluation(self, it, **values):
        if self.master:
            print(f"step {it}: {shown(values)}")
            self.record('eval', iter=it, **values)

    def switch(self, it, description, **values):
        """`description`: what trains now."""
        self.flops_per_token = None  # counted again at the next logged iteration (it walks every parameter)
        if self.master:
            print(f"iter {it}: {shown(dict(description=description, **values))}")
            self.record('switch', iter=it, description=description, **values)

    def iteration(self, it, dt, seconds_per_iter, **values):
        """The values handed in, then time, throughput, MFU, CUDA memory, the time left at seconds_per_iter."""
        if not self.master:
            return
        if self.peak_flops and it - self.first_iter >= 5:  # MFU once the first iterations' warm-up is behind
            if self.flops_per_token is None:
                self.flops_per_token = self.model.estimate_flops_per_token()
            iter_mfu = mfu(self.flops_per_token, self.tokens_per_iter, dt, self.peak_flops, self.world_size)
            self.running_mfu = iter_mfu if self.running_mfu is None else 0.9 * self.running_mfu + 0.1 * iter_mfu
        fields = dict(values, ms=dt * 1000, tok_per_s=self.tokens_per_iter / dt, mfu=self.running_mfu)
        if self.cuda:
            fields.update(
                mem_alloc_gib=torch.cuda.max_memory_allocated() / 2**30,
                mem_reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
            )
        left = format_duration(seconds_per_iter * (self.cfg['max_iters'] - it - 1))
        print(f"iter {it}: {shown(fields)}, {it + 1}/{self.cfg['max_iters']}, {left} left", flush=True)
        self.record('iter', iter=it, **{k: v for k, v in fields.items() if v is not None})

    def save(self, it, path):
        if path is not None:
            self.record('save', iter=it, path=path)

    def end(self, it, stopped):
        if self.master:
            elapsed = time.time() - self.run_start
            took = format_duration(elapsed)
            print(f"{'stopped' if stopped else 'done'}: iterations {self.first_iter} to {it} in {took}")
            self.record('end', iter=it, seconds=elapsed, stopped=bool(stopped))

    def record(self, kind, **fields):
        if self.writes:
            try:
                # the file starts at the first record, not before: a run refused at start leaves it as it was
                kept = self._kept_records() if not self.started else []
                with open(self.path, 'a' if self.started else 'w') as f:
                    f.writelines(kept)
                    f.write(json.dumps({'kind': kind, **fields}) + '\n')
                self.started = True
            except OSError as e:  # a full disk, a read-only file, a folder of that name: the training goes on
                self.writes = False
                print(
                    f"warning: cannot write {self.path} ({e.strerror or e}): this run's records stop here, its "
                    f"checkpoints and log go on; free space or fix that path before the next run",
                    file=sys.stderr,
                    flush=True,
                )
        if self.wandb is not None and kind in ('eval', 'iter'):
            self.wandb.log(
                {f'{kind}/{k}': v for k, v in fields.items() if isinstance(v, (int, float))}, step=fields['iter']
            )

    def _kept_records(self):
        """A resume's: the records before the checkpoint's iteration and its save, not a line cut by a crash."""
        kept = []
        if self.resumed_from is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if rec['iter'] < self.resumed_from or (rec['iter'] == self.resumed_from and rec['kind'] == 'save'):
                        kept.append(line)
        return kept


def shown(values):
    parts = []
    for name, value in values.items():
        template = SHOWN.get(name, f"{name} {{:.4g}}" if isinstance(value, float) else f"{name} {{}}")
        if template is not None and value is not None:
            parts.append(template.format(value))
    return ', '.join(parts)


def format_duration(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


class LogOutlivesItsReader:
    """stdout that survives its reader: after `python train.py | head`, the rest of the log goes to
    /dev/null and the run trains on, instead of dying of BrokenPipeError at its next print."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self):
        os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())  # also for the flush at exit

    def __getattr__(self, name):
        return getattr(self.stream, name)

    @classmethod
    def install(cls):  # sys.stdout becomes one when it is a real file (not closed, not a test's StringIO)
        try:
            sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # not a real file: nothing can break
            return
        sys.stdout = cls(sys.stdout)


def peak_for_name(name):
    """PEAK_BF16_FLOPS' figure for the entry whose words are all whole words of `name` ('H100' is not one of 'GH100'),
    the most words winning ('NVIDIA H100 NVL' gets 'H100 NVL'); None for no entry or a tie (no MFU, not a wrong one)."""
    words = lambda text: set(re.findall(r'[a-z0-9]+', text.lower()))
    matches = [key for key in PEAK_BF16_FLOPS if words(key) <= words(name)]
    most = max((len(words(key)) for key in matches), default=0)
    flops = {PEAK_BF16_FLOPS[key] for key in matches if len(words(key)) == most}
    return flops.pop() if len(flops) == 1 else None


def peak_bf16_flops(device):
    """The GPU's peak FLOP/s, or None (CPU, an unknown GPU: no MFU)."""
    device = torch.device(device)
    return peak_for_name(torch.cuda.get_device_name(device)) if device.type == 'cuda' else None


def mfu(flops_per_token, tokens_per_iter, dt, peak_flops, world_size=1):
    """The share of `world_size` GPUs' peak FLOP/s that an iteration of `dt` seconds used."""
    return flops_per_token * tokens_per_iter / dt / (peak_flops * world_size)
