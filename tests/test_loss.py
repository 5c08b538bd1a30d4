"""model.LinearCrossEntropy: the loss of low-precision logits (bf16 autocast, bf16 weights) equals autograd's
F.cross_entropy(logits.float()), eager and compiled, and keeps the logits as they are, not fp32 log-probabilities."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import random_batch as batch  # noqa: E402
from conftest import tiny_model_config as tiny
from test_memory import LiveStorages  # noqa: E402

import builder  # noqa: E402
from model import EAGER_LOSS_KERNELS, LinearCrossEntropy, Transformer  # noqa: E402

CASES = ('all', 'head frozen', 'head only')


def reference(x, weight, targets, dtype):
    """What model.head_loss computed before LinearCrossEntropy: autocast's linear, then fp32 cross-entropy."""
    return F.cross_entropy(F.linear(x.to(dtype), weight.to(dtype)).float(), targets, ignore_index=-1)


def loss_and_grads(fn, x, weight, targets, case):
    x = x.detach().clone().requires_grad_(case != 'head only')
    weight = weight.detach().clone().requires_grad_(case != 'head frozen')
    loss = fn(x, weight, targets)
    inputs = [t for t in (x, weight) if t.requires_grad]
    grads = torch.autograd.grad(loss * 3.0, inputs)  # an upstream gradient other than 1 (accumulation, scaling)
    return loss, grads


def inputs(weight_dtype, n=96, C=24, V=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, generator=g).to(torch.float32 if weight_dtype == torch.float32 else weight_dtype)
    weight = (torch.randn(V, C, generator=g) * 0.3).to(weight_dtype)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[5:40:3] = -1  # ignored tokens
    return x, weight, targets


def compiled_kernels(**kwargs):
    model = Transformer(tiny('gpt2'))
    model.compile_loss(**kwargs)
    return model.loss_kernels


@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize(
    'dtype,weight_dtype',
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_equals_autograds_cross_entropy(dtype, weight_dtype, case):
    """Loss and every gradient within fp32 rounding of autograd's (the same bf16 matmuls, the softmax in
    fp32, rounded once); the gradients in their inputs' dtypes."""
    x, weight, targets = inputs(weight_dtype)
    ref_loss, ref_grads = loss_and_grads(lambda *a: reference(*a, dtype), x, weight, targets, case)
    loss, grads = loss_and_grads(
        lambda *a: LinearCrossEntropy.apply(*a, dtype, EAGER_LOSS_KERNELS), x, weight, targets, case
    )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads):
        assert g.dtype == r.dtype
        # one bf16 rounding of the same fp32 value can differ by one unit: 2^-8 of the largest entry
        assert (g.float() - r.float()).abs().max() <= 2**-8 * r.float().abs().max()


@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_compiled_kernels_equal_eager(backend):
    """compile=True's kernels (one graph each, no break) compute what the eager ones do."""
    x, weight, targets = inputs(torch.float32, seed=1)
    kernels = compiled_kernels(backend=backend, fullgraph=True)
    for case in CASES:
        eager = loss_and_grads(
            lambda *a: LinearCrossEntropy.apply(*a, torch.bfloat16, EAGER_LOSS_KERNELS), x, weight, targets, case
        )
        compiled = loss_and_grads(
            lambda *a: LinearCrossEntropy.apply(*a, torch.bfloat16, kernels), x, weight, targets, case
        )
        torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
        for g, e in zip(compiled[1], eager[1]):
            assert (g.float() - e.float()).abs().max() <= 2**-8 * e.float().abs().max(), case


def test_all_ignored_gives_nan_as_autograd_does():
    x, weight, targets = inputs(torch.float32)
    targets[:] = -1
    assert reference(x, weight, targets, torch.bfloat16).isnan()
    assert LinearCrossEntropy.apply(x, weight, targets, torch.bfloat16, EAGER_LOSS_KERNELS).isnan()


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_model_under_autocast_takes_it_and_fp32_does_not(arch):
    """Under bf16 autocast the model's loss is LinearCrossEntropy's (within rounding of the old path); in fp32
    it is autograd's cross-entropy, bit for bit what it was (train.py's CPU runs are unchanged)."""
    torch.manual_seed(0)
    model = Transformer(tiny(arch, vocab_size=128))
    x, y = batch(model.config)
    y[0, 2:5] = -1
    hidden = model.hidden_states(x).detach().reshape(-1, model.config.n_embd)
    with torch.autocast('cpu', torch.bfloat16):
        loss = model.head_loss(hidden, y)
    assert loss.grad_fn.name() == 'LinearCrossEntropyBackward'
    torch.testing.assert_close(
        loss, reference(hidden, model.lm_head.weight, y.reshape(-1), torch.bfloat16), rtol=1e-6, atol=1e-6
    )
    loss = model.head_loss(hidden, y)
    assert loss.grad_fn.name() != 'LinearCrossEntropyBackward'
    assert torch.equal(loss, F.cross_entropy(model.lm_head(hidden).float(), y.reshape(-1), ignore_index=-1))


def test_keeps_low_precision_logits_not_fp32_log_probabilities():
    """Between forward and backward the bf16 path keeps the logits in bf16 (n x V x 2 bytes) and a log-sum-exp per
    token; autograd's keeps fp32 log-probabilities (n x V x 4). Its peak in the backward stays under autograd's."""
    torch.manual_seed(0)
    n, C, V = 256, 32, 1024
    x = torch.randn(n, C, requires_grad=True)
    weight = torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (n,))

    def measure(fn):
        tracker = LiveStorages(x, weight, targets)
        with tracker:
            loss = fn()
            kept = tracker.current
            loss.backward()
        return kept, tracker.peak

    with torch.autocast('cpu', torch.bfloat16):
        kept_ref, peak_ref = measure(lambda: reference(x, weight, targets, torch.bfloat16))
        kept, peak = measure(lambda: LinearCrossEntropy.apply(x, weight, targets, torch.bfloat16, EAGER_LOSS_KERNELS))
    assert kept_ref >= n * V * 4
    # the bf16 logits, the log-sum-exps, x in bf16, a few scalars
    assert n * V * 2 <= kept <= n * V * 2 + n * 4 + n * C * 2 + 256
    assert peak < peak_ref


def test_compile_blocks_compiles_the_loss():
    model = Transformer(tiny('gpt2'))
    assert model.loss_kernels is EAGER_LOSS_KERNELS
    builder.compile_blocks(model, 'full', backend='aot_eager')
    assert model.loss_kernels is not EAGER_LOSS_KERNELS
    x, y = batch(model.config)
    with torch.autocast('cpu', torch.bfloat16):
        loss = model(x, y)[1]
    loss.backward()
    assert loss.isfinite() and model.lm_head.weight.grad is not None


def test_eager_kernels_take_the_logits_a_block_of_rows_at_a_time(monkeypatch):
    """Eager mode's fp32 temporaries are (EAGER_ROWS x vocab), not (tokens x vocab): the forward's peak stays near
    the bf16 logits it keeps; loss and gradients are those of one block (within the order of the sums)."""
    import model

    torch.manual_seed(0)
    n, C, V, rows = 512, 16, 1024, 64
    x = torch.randn(n, C, requires_grad=True)
    weight = torch.randn(V, C, requires_grad=True)
    targets = torch.randint(0, V, (n,))
    targets[::5] = -1
    ref = loss_and_grads(
        lambda *a: LinearCrossEntropy.apply(*a, torch.bfloat16, EAGER_LOSS_KERNELS), x, weight, targets, 'all'
    )  # n rows: one block
    monkeypatch.setattr(model, 'EAGER_ROWS', rows)
    tracker = LiveStorages(x, weight, targets)
    with tracker:
        LinearCrossEntropy.apply(x, weight, targets, torch.bfloat16, EAGER_LOSS_KERNELS)
    # kept: bf16 logits, x in bf16, a log-sum-exp per row; beyond them, a few blocks of fp32 temporaries
    kept = n * V * 2 + n * C * 2 + n * 4
    assert kept <= tracker.peak <= kept + 3 * rows * V * 4 + 4096
    blocked = loss_and_grads(
        lambda *a: LinearCrossEntropy.apply(*a, torch.bfloat16, EAGER_LOSS_KERNELS), x, weight, targets, 'all'
    )
    torch.testing.assert_close(blocked[0], ref[0], rtol=1e-6, atol=0)
    for g, r in zip(blocked[1], ref[1]):
        assert torch.equal(g, r)
