"""memory_options.compile_blocks (compile=True): per-block compilation whose graphs do not multiply with layer
cycling's requires_grad patterns, for every method, and that computes what eager mode computes.
CPU, dynamo with the aot_eager backend (its guards, and so its recompiles, do not depend on the backend)."""

import pytest
import torch

import builder
import omgd
from model import Transformer, TransformerConfig
from train_config import GALORE_METHODS

METHODS = [*omgd.METHODS, *GALORE_METHODS]


def tiny(arch, n_layer=3):
    torch.manual_seed(0)
    return Transformer(
        TransformerConfig(
            arch=arch,
            n_layer=n_layer,
            n_head=2,
            n_embd=16,
            block_size=8,
            vocab_size=32,
            bias=True,
            **({'n_kv_head': 1} if arch == 'llama' else {}),
        )
    )


def batch(it):
    g = torch.Generator().manual_seed(it)
    x = torch.randint(0, 32, (2, 8), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(method, arch, compiled, iters):
    """The gradients of `iters` iterations of layer cycling, and the model."""
    model = tiny(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kind = omgd.METHODS.get(method)
    config = omgd.CyclerConfig(
        'full' if method in GALORE_METHODS else method,
        period=1,
        **({'gamma': 2} if kind and kind.unit == 'block' else {}),
    )
    cycler = omgd.build_cycler(model, opt, config)
    if compiled:
        builder.compile_blocks(model, method, backend='aot_eager')
    grads = []
    for it in range(iters):
        cycler.step(it)
        model(*batch(it))[1].backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():  # an evaluation: grad mode off, one more variant of each graph
        model(*batch(iters))
    return grads


@pytest.mark.parametrize('method, arch', [*((m, 'gpt2') for m in METHODS), ('tensor_wor', 'llama')])
def test_compiled_blocks_do_not_recompile_per_pattern_and_match_eager(method, arch):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    iters = 10
    eager = train(method, arch, False, iters)
    # a recompile past the limit raises, instead of falling back to eager mode with a warning
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        compiled = train(method, arch, True, iters)
    for a, b in zip(eager, compiled):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)
    graphs = counters['stats']['unique_graphs']
    kind = omgd.METHODS.get(method)
    if kind is None:  # every block trains: one graph for training, one for the evaluation
        assert graphs == 2
    elif kind.unit == 'block':  # trainable or frozen, in training and in the evaluation
        assert graphs == 4
    else:  # the parameter-free pieces between the eager Linears and norms, a few variants each
        assert graphs <= 40, graphs
    torch._dynamo.reset()
