"""infra/metrics.py's MFU: the peak FLOP/s of the GPU a run is on, looked up by its name (fake names here:
no GPU needed)."""

import pytest
import torch

from infra import metrics
from infra.metrics import PEAK_BF16_FLOPS, mfu, peak_bf16_flops, peak_for_name


@pytest.mark.parametrize(
    'name, tflops',
    [
        ('NVIDIA H100 80GB HBM3', 989.4),  # the SXM part
        ('NVIDIA H100 PCIe', 756),
        ('NVIDIA H100 NVL', 835),
        ('NVIDIA NVL H100', 835),  # order does not matter
        ('NVIDIA H200', 989),
        ('NVIDIA H200 NVL', 835),
        ('NVIDIA GH200 480GB', 989),  # not H200's by substring, its own entry
        ('NVIDIA A100-SXM4-80GB', 312),
        ('NVIDIA A100 80GB PCIe', 312),
        ('NVIDIA A10G', 125),
        ('NVIDIA A10', 125),
        ('NVIDIA L40S', 362),
        ('NVIDIA L4', 121),
        ('NVIDIA GeForce RTX 4090', 165),
        ('NVIDIA B200', 2250),
        ('NVIDIA GeForce RTX 3060', None),  # unknown: no MFU
        ('Tesla V100-SXM2-16GB', None),
    ],
)
def test_peak_by_exact_variant_whatever_the_order_of_the_table(name, tflops, monkeypatch):
    expected = None if tflops is None else tflops * 1e12
    for table in (dict(PEAK_BF16_FLOPS), dict(reversed(list(PEAK_BF16_FLOPS.items())))):
        monkeypatch.setattr(metrics, 'PEAK_BF16_FLOPS', table)
        assert peak_for_name(name) == expected, (name, list(table)[0])
        # what train.py and bench.py call, with the name torch would report
        monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: name)
        assert peak_bf16_flops('cuda') == expected


def test_no_peak_off_gpu_and_for_ambiguous_names(monkeypatch):
    assert peak_bf16_flops('cpu') is None and peak_bf16_flops('meta') is None
    monkeypatch.setattr(metrics, 'PEAK_BF16_FLOPS', {'X1': 1e12, 'Y1': 2e12})
    assert peak_for_name('X1 Y1') is None  # two entries of one length: no guess
    assert peak_for_name('X1') == 1e12


def test_mfu_is_the_share_of_the_peak():
    # 1e9 FLOPs per token, 1e4 tokens in 0.1 s on two GPUs of 1e14: 1e14 / 2e14
    assert mfu(1e9, 1e4, 0.1, 1e14, world_size=2) == pytest.approx(0.5)


def test_the_flops_of_the_mfu_are_counted_once_per_switch(tmp_path):
    """A logged iteration's MFU uses the FLOPs of the blocks that train now, counted after each switch and not at
    every logged iteration (a walk over every parameter while the GPU waits): two counts for a switch among five
    logged iterations, and each record's MFU is the one of the FLOPs at its iteration."""
    import json
    from types import SimpleNamespace

    from model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, vocab_size=32))
    counts = []
    count_flops = model.estimate_flops_per_token
    model.estimate_flops_per_token = lambda: counts.append(count_flops()) or counts[-1]
    cfg = dict(out_dir=str(tmp_path), eval_only=False, wandb_log=False, max_iters=100)
    m = metrics.Metrics(cfg, SimpleNamespace(master=True, world_size=1), 'cpu')
    m.peak_flops = 1e9  # a GPU of known peak, on the CPU
    m.begin(model, tokens_per_iter=80, first_iter=0)
    for it in (10, 11, 12):
        m.iteration(it, 0.5, 0.5, loss=2.0)
    for p in model.blocks[0].parameters():  # the cycler freezes block 0: the FLOPs fall
        p.requires_grad_(False)
    m.switch(13, 'block 0 frozen', active=[1, 2])
    for it in (13, 14):
        m.iteration(it, 0.5, 0.5, loss=2.0)
    assert len(counts) == 2 and counts[1] < counts[0]
    logged = [r['mfu'] for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if r['kind'] == 'iter']
    expected, running = [], None
    for flops in [counts[0]] * 3 + [counts[1]] * 2:
        running = mfu(flops, 80, 0.5, 1e9) if running is None else 0.9 * running + 0.1 * mfu(flops, 80, 0.5, 1e9)
        expected.append(running)
    assert logged == pytest.approx(expected, rel=1e-12)
