"""
Host time of the parts of train.py's loop around Trainer.step that run while a logging GPU waits
(after the logged loss's .item() the GPU's queue is empty until the host queues the next iteration):
the logged iteration's report (infra.metrics.Metrics.iteration, MFU included) at GPT-2 124M, and one
12 x 1024 training batch from dataloader.TokenBatches beside nanoGPT's get_batch. CPU only (the model
is on the meta device); the figures are this machine's host time, not the GPU machine's.

    python experiments/loop_host_time.py
"""

import contextlib
import io
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataloader import TokenBatches  # noqa: E402
from infra import metrics  # noqa: E402
from model import PRESETS, Transformer, TransformerConfig  # noqa: E402


def timed(f, n=300, warmup=20):
    """(median, min) milliseconds of n calls of f after warmup calls."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[n // 2] * 1e3, times[0] * 1e3


def report_time(scratch):
    with torch.device('meta'):
        model = Transformer(TransformerConfig(**{**PRESETS['gpt2'], 'vocab_size': 50304}))  # GPT-2 124M
    cfg = dict(out_dir=scratch, eval_only=False, wandb_log=False, max_iters=10**6, decay_lr=False, learning_rate=6e-4)
    m = metrics.Metrics(cfg, SimpleNamespace(master=True, world_size=1), 'cpu')
    m.peak_flops = 989e12  # an H100's: the MFU is computed as on a GPU
    m.begin(model, tokens_per_iter=12 * 1024, first_iter=0)
    it = iter(range(10, 10**6))
    with contextlib.redirect_stdout(io.StringIO()):
        report = timed(lambda: m.iteration(next(it), 0.03, 0.03, loss=3.0, lr=6e-4, epoch=0.0))
        return report, timed(model.estimate_flops_per_token, n=50)


def batch_times(scratch, block_size=1024, batch_size=12):
    path = os.path.join(scratch, 'train.bin')
    np.random.default_rng(0).integers(0, 50257, 20_000_000, dtype=np.uint16).tofile(path)
    ours = TokenBatches(path, block_size, batch_size)
    ours.vocab_size = 50304  # the id check of a file too large to scan at start, as train.py sets it
    batches = ours.iterate('cpu')

    def nanogpt_get_batch():  # nanoGPT's train.py, less the pinning and the copy to the GPU
        data = np.memmap(path, dtype=np.uint16, mode='r')
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x, y

    return timed(lambda: next(batches)), timed(nanogpt_get_batch)


def main():
    with tempfile.TemporaryDirectory() as scratch:
        (report, flops), (ours, nanogpt) = report_time(scratch), batch_times(scratch)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPU(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}"
    )
    print(f"Metrics.iteration (log line, record, MFU), GPT-2 124M: median {report[0]:.3f} ms, min {report[1]:.3f} ms")
    print(
        f"counting the MFU's FLOPs (estimate_flops_per_token; once a switch, no longer at every logged "
        f"iteration): median {flops[0]:.3f} ms"
    )
    print(f"a 12 x 1024 batch, dataloader.TokenBatches: median {ours[0]:.3f} ms, min {ours[1]:.3f} ms")
    print(f"a 12 x 1024 batch, nanoGPT's get_batch: median {nanogpt[0]:.3f} ms, min {nanogpt[1]:.3f} ms")


if __name__ == '__main__':
    main()
