"""Transformer.generate with a KV cache (model.KVCache): the tokens of the uncached loop, for GPT-2 and LLaMA
(grouped-query attention included), across the block_size crop, under infra/memory_options.py's wrappers."""

import pytest
import torch
from conftest import tiny_model_config

from model import KVCache, Transformer

ARCHS = {
    'gpt2': dict(arch='gpt2'),
    'llama': dict(arch='llama'),
    'llama-gqa': dict(arch='llama', n_kv_head=2),  # n_head=4: two query heads per key/value head
}


def tiny(name, seed=0, **kw):
    torch.manual_seed(seed)
    model = Transformer(tiny_model_config(**{**ARCHS[name], **kw})).eval()
    # larger weights than the init's: peaked distributions, so the greedy tokens vary along a sequence
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8)
    return model


def prompt(model, b=2, t=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, t), generator=g)


@pytest.mark.parametrize('name', ARCHS)
def test_greedy_tokens_match_uncached_across_the_block_size_crop(name):
    model = tiny(name)  # block_size 16: 5 + 30 tokens cross it at step 12
    idx = prompt(model)
    uncached = model.generate(idx, 30, top_k=1, use_cache=False)
    cached = model.generate(idx, 30, top_k=1)
    assert torch.equal(cached, uncached)
    assert len(set(uncached[0, 5:].tolist())) > 3  # the test would be weak on a constant sequence


@pytest.mark.parametrize('name', ARCHS)
def test_cached_steps_give_the_logits_of_full_forwards(name):
    model = tiny(name)
    idx = prompt(model, t=3)
    cache = KVCache(model.config.n_layer, model.config.block_size)
    for t in range(3, model.config.block_size + 1):
        new = idx[:, cache.length : t]  # the prompt at the first step, one token after
        cached = model.lm_head(model.hidden_states(new, cache))[:, -1]
        full = model(idx[:, :t])[0][:, -1]
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
        idx = torch.cat([idx, cached.argmax(-1, keepdim=True)], dim=1) if t == idx.size(1) else idx
    assert cache.length == model.config.block_size


@pytest.mark.parametrize('name', ARCHS)
def test_chunks_after_a_cache_see_their_causal_past(name):
    """Several new positions at once after cached ones (1 < T < S): each sees the cache and the chunk up to itself."""
    model = tiny(name)
    idx = prompt(model, t=12)
    cache = KVCache(model.config.n_layer, 12)
    first = model.hidden_states(idx[:, :7], cache)
    second = model.hidden_states(idx[:, 7:], cache)
    torch.testing.assert_close(torch.cat([first, second], dim=1), model.hidden_states(idx), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match='length 13, the KV cache holds 12'):
        model.hidden_states(idx[:, :1], cache)


def test_gqa_caches_only_the_key_value_heads():
    model = tiny('llama-gqa')
    cache = KVCache(model.config.n_layer, 10)
    model.hidden_states(prompt(model, b=3, t=4), cache)
    head_dim = model.config.n_embd // model.config.n_head
    assert [tuple(layer.k.shape) for layer in cache.layers] == [(3, 2, 10, head_dim)] * model.config.n_layer


@pytest.mark.parametrize('name', ['gpt2', 'llama-gqa'])
def test_sampling_draws_the_same_tokens(name):
    """Sampling takes one draw per step either way: the same seed gives the same sample."""
    model = tiny(name)
    idx = prompt(model)
    torch.manual_seed(7)
    uncached = model.generate(idx, 25, temperature=0.8, top_k=5, use_cache=False)
    torch.manual_seed(7)
    assert torch.equal(model.generate(idx, 25, temperature=0.8, top_k=5), uncached)


def test_long_prompt_and_memory_wrappers():
    """A prompt longer than block_size crops as before; infra/memory_options.py's wrapped forwards leave the
    cache alone."""
    from infra import memory_options

    model = tiny('llama-gqa')
    long_prompt = prompt(model, t=20)
    assert torch.equal(
        model.generate(long_prompt, 6, top_k=1), model.generate(long_prompt, 6, top_k=1, use_cache=False)
    )
    idx = prompt(model)
    expected = model.generate(idx, 20, top_k=1, use_cache=False)
    memory_options.apply(
        model, activation_checkpointing=True, checkpoint_sublayers=True, activation_offload=True, loss_chunk=4
    )
    assert torch.equal(model.generate(idx, 20, top_k=1), expected)


def test_bench_generate_runs_both_ways(tmp_path):
    """experiments/bench_generate.py (a benchmark, not timed here): both rates, their ratio, the same tokens."""
    from dataclasses import asdict

    from conftest import assert_one_line_error, run_script

    model = tiny('llama-gqa')
    torch.save({'model_args': asdict(model.config), 'model': model.state_dict()}, tmp_path / 'ckpt.pt')
    result = run_script(
        'experiments/bench_generate.py',
        [f'--out_dir={tmp_path}', '--prompt_tokens=3', '--new_tokens=20', '--batch_size=2', '--device=cpu'],
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith('note: beyond 16 tokens both ways run the cropped window afresh')
    assert lines[2].startswith('uncached: ') and lines[3].startswith('cached: ') and lines[2].endswith(' tokens/s')
    assert lines[4].startswith('speed-up (cached / uncached tokens/s): ') and lines[4].endswith('same tokens: yes')
    assert_one_line_error(run_script('experiments/bench_generate.py', ['--preset=gpt3']), r"unknown preset 'gpt3'")
