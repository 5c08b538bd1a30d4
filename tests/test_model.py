import dataclasses
import io
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from model import PRESETS, Transformer, TransformerConfig, config_from_preset  # noqa: E402

torch.set_num_threads(1)  # the CPU is shared; tiny models don't need more

from conftest import TINY_MODELS as TINY  # noqa: E402
from conftest import random_batch as batch  # noqa: E402


@pytest.mark.parametrize('name,expected', [('gpt2', 124_439_808), ('llama-7b', 6_738_415_616)])
def test_param_counts_on_meta(name, expected):
    with torch.device('meta'):
        model = Transformer(config_from_preset(name))
    assert model.get_num_params(non_embedding=False) == expected
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_non_embedding_counts():
    with torch.device('meta'):
        g = Transformer(config_from_preset('gpt2'))
        l = Transformer(config_from_preset('llama-60m'))
    assert g.get_num_params() == 124_439_808 - 1024 * 768  # minus wpe only (wte is the head)
    assert l.get_num_params() == l.get_num_params(False) - 32000 * 512  # minus untied wte


def test_presets_build_valid_configs():
    for name in PRESETS:
        config_from_preset(name)
    assert config_from_preset('llama-7b').mlp_hidden == 11008
    # the LLaMA 8/3 rule reproduces 7b's hidden size when left at 0
    assert TransformerConfig(arch='llama', n_embd=4096, n_head=32).mlp_hidden == 11008
    assert TransformerConfig(arch='gpt2', n_embd=64, n_head=4).mlp_hidden == 256
    assert config_from_preset('llama-60m', block_size=512).block_size == 512


@pytest.mark.parametrize(
    'kwargs, message',
    [
        (dict(arch='mamba'), 'arch must be'),
        (dict(n_embd=30, n_head=4), 'not divisible by n_head'),
        (dict(n_head=4, n_kv_head=3), 'must divide n_head'),
        (dict(arch='llama', n_embd=12, n_head=4), 'even head dimension'),
    ],
)
def test_bad_config_gives_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)


def test_unknown_preset_names_valid_ones():
    with pytest.raises(ValueError) as e:
        config_from_preset('gpt5')
    msg = str(e.value)
    assert 'gpt5' in msg and 'gpt2-medium' in msg and 'llama-7b' in msg
    assert '\n' not in msg


def test_config_roundtrips_through_weights_only_load():
    cfg = config_from_preset('llama-130m')
    buf = io.BytesIO()
    torch.save({'config': dataclasses.asdict(cfg)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert TransformerConfig(**loaded['config']) == cfg


def all_logits(model, x):
    return model.lm_head(model.hidden_states(x))


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_forward_shapes_and_loss(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = Transformer(cfg)
    x, y = batch(cfg)
    logits, loss = model(x, y)
    assert logits is None  # a training forward returns no logits (see test_training_forward_holds_no_logits)
    full = all_logits(model, x)
    assert full.shape == (2, cfg.block_size, cfg.vocab_size)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(full.view(-1, cfg.vocab_size), y.view(-1)))
    # nanoGPT init gives near-uniform predictions
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    logits, loss = model(x)
    assert logits.shape == (2, 1, cfg.vocab_size) and loss is None
    assert torch.allclose(logits[:, 0], full[:, -1], atol=1e-6)
    with pytest.raises(ValueError, match='block size'):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_ignore_index():
    torch.manual_seed(0)
    cfg = TINY['gpt2']()
    model = Transformer(cfg)
    x, y = batch(cfg)
    y2 = y.clone()
    y2[:, ::2] = -1
    _, loss = model(x, y2)
    logits = all_logits(model, x)
    ref = torch.nn.functional.cross_entropy(logits[:, 1::2].reshape(-1, cfg.vocab_size), y[:, 1::2].reshape(-1))
    assert torch.allclose(loss, ref)


def test_layout_and_weight_tying():
    g = Transformer(TINY['gpt2']())
    assert g.lm_head.weight is g.wte.weight
    assert isinstance(g.blocks, torch.nn.ModuleList) and len(g.blocks) == 2
    assert set(g.outer_modules()) == {'embed', 'pos', 'norm', 'head'}
    assert g.outer_modules()['pos'] is g.wpe

    l = Transformer(TINY['llama']())
    assert l.lm_head.weight is not l.wte.weight
    assert l.wpe is None
    assert set(l.outer_modules()) == {'embed', 'norm', 'head'}
    assert isinstance(l.ln_f, torch.nn.RMSNorm)
    assert not any(n.endswith('bias') for n, _ in l.named_parameters())
    # rotary tables are derived data, never checkpointed
    assert not any('rope' in k for k in l.state_dict())
    assert l.blocks[0].attn.k_proj.weight.shape == (16, 32)  # 2 kv heads * head_dim 8


def test_outer_modules_plus_blocks_cover_all_params():
    for arch in TINY:
        m = Transformer(TINY[arch]())
        ids = {id(p) for mod in m.outer_modules().values() for p in mod.parameters()}
        ids |= {id(p) for p in m.blocks.parameters()}
        assert ids == {id(p) for p in m.parameters()}


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_causal(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = Transformer(cfg).eval()
    x, _ = batch(cfg)
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % cfg.vocab_size
    l1, l2 = all_logits(model, x), all_logits(model, x2)
    assert torch.allclose(l1[:, :-1], l2[:, :-1], atol=1e-6)
    assert not torch.allclose(l1[:, -1], l2[:, -1])


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_generate_shape(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = Transformer(cfg).eval()
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(idx, max_new_tokens=20, temperature=0.8, top_k=5)  # grows past block_size
    assert out.shape == (2, 23)
    assert out.min() >= 0 and out.max() < cfg.vocab_size


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_crop_block_size(arch):
    cfg = TINY[arch]()
    model = Transformer(cfg).eval()
    x, _ = batch(cfg, t=8)
    before = all_logits(model, x)
    model.crop_block_size(8)
    after = all_logits(model, x)
    assert model.config.block_size == 8
    assert torch.allclose(before, after, atol=1e-6)
    with pytest.raises(ValueError):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_meta_build_then_materialize():
    cfg = TINY['llama']()
    with torch.device('meta'):
        model = Transformer(cfg)
    model.to_empty(device='cpu')
    model.init_weights()
    x, y = batch(cfg)
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    ref = Transformer(cfg)
    assert torch.equal(model.rotary.cos, ref.rotary.cos) and torch.equal(model.rotary.sin, ref.rotary.sin)


def test_flops_per_token_counts_frozen_blocks_at_4N():
    cfg = config_from_preset('gpt2')
    with torch.device('meta'):
        model = Transformer(cfg)
    N = model.get_num_params()  # wpe excluded; blocks + the tied wte/head + ln_f
    attention = 12 * 12 * 12 * 64 * 1024
    ln_f = 2 * 768
    assert model.estimate_flops_per_token() == 6 * (N - ln_f) + attention
    frozen = sum(p.numel() for p in model.blocks[3].parameters())
    model.blocks[3].requires_grad_(False)
    assert model.estimate_flops_per_token() == 6 * (N - ln_f) - 2 * frozen + attention


def test_flops_per_token_skip_the_backward_below_every_trainable_parameter():
    model = Transformer(TINY['llama']())  # untied head: the embedding can freeze alone
    cfg = model.config
    B = sum(p.numel() for p in model.blocks[0].parameters())
    H = model.lm_head.weight.numel()
    A = 12 * cfg.n_embd * cfg.block_size  # attention per layer; a third of it is forward
    assert model.estimate_flops_per_token() == 6 * (2 * B + H) + 2 * A  # nanoGPT's 6N + attention
    model.wte.requires_grad_(False)
    model.blocks[0].requires_grad_(False)  # bottom block, nothing below trains: forward only
    assert model.estimate_flops_per_token() == (2 * B + A // 3) + (6 * B + A) + 6 * H
    model.blocks[0].requires_grad_(True)
    model.blocks[1].requires_grad_(False)  # above a trainable block: input gradient, no weight gradient
    assert model.estimate_flops_per_token() == (6 * B + A) + (4 * B + A) + 6 * H
    model.blocks[0].requires_grad_(False)  # everything below the head frozen
    assert model.estimate_flops_per_token() == 2 * (2 * B + A // 3) + 6 * H
    model.lm_head.requires_grad_(False)
    model.ln_f.requires_grad_(False)
    assert model.estimate_flops_per_token() == 2 * (2 * B + A // 3) + 2 * H
    model.wte.requires_grad_(True)  # a trainable embedding needs the backward of every block
    assert model.estimate_flops_per_token() == 2 * (4 * B + A) + 4 * H
