import dataclasses
import io
import math
import os
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, PRESETS, config_from_preset, param_groups  # noqa: E402

torch.set_num_threads(1)  # the CPU is shared; tiny models don't need more


def tiny(arch, **kw):
    base = dict(arch=arch, block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32,
                dropout=0.0)
    base.update(kw)
    return GPTConfig(**base)


TINY = {
    'gpt2': lambda: tiny('gpt2'),
    'llama': lambda: tiny('llama', n_kv_head=2),  # grouped-query attention
}


def batch(cfg, b=2, t=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = t or cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    return x, y


@pytest.mark.parametrize('name,expected', [('gpt2', 124_439_808), ('llama-7b', 6_738_415_616)])
def test_param_counts_on_meta(name, expected):
    with torch.device('meta'):
        model = GPT(config_from_preset(name))
    assert model.get_num_params(non_embedding=False) == expected
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


def test_non_embedding_counts():
    with torch.device('meta'):
        g = GPT(config_from_preset('gpt2'))
        l = GPT(config_from_preset('llama-60m'))
    assert g.get_num_params() == 124_439_808 - 1024 * 768  # minus wpe only (wte is the head)
    assert l.get_num_params() == l.get_num_params(False) - 32000 * 512  # minus untied wte


def test_presets_build_valid_configs():
    for name in PRESETS:
        config_from_preset(name)
    assert config_from_preset('llama-7b').mlp_hidden == 11008
    # the LLaMA 8/3 rule reproduces 7b's hidden size when left at 0
    assert GPTConfig(arch='llama', n_embd=4096, n_head=32).mlp_hidden == 11008
    assert GPTConfig(arch='gpt2', n_embd=64, n_head=4).mlp_hidden == 256
    assert config_from_preset('llama-60m', block_size=512).block_size == 512


@pytest.mark.parametrize('kwargs, message', [
    (dict(arch='mamba'), 'arch must be'),
    (dict(n_embd=30, n_head=4), 'not divisible by n_head'),
    (dict(n_head=4, n_kv_head=3), 'must divide n_head'),
    (dict(arch='llama', n_embd=12, n_head=4), 'even head dimension'),
])
def test_bad_config_gives_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


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
    assert GPTConfig(**loaded['config']) == cfg


def all_logits(model, x):
    return model.lm_head(model.hidden_states(x))


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_forward_shapes_and_loss(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg)
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
    model = GPT(cfg)
    x, y = batch(cfg)
    y2 = y.clone()
    y2[:, ::2] = -1
    _, loss = model(x, y2)
    logits = all_logits(model, x)
    ref = torch.nn.functional.cross_entropy(logits[:, 1::2].reshape(-1, cfg.vocab_size),
                                            y[:, 1::2].reshape(-1))
    assert torch.allclose(loss, ref)


def test_layout_and_weight_tying():
    g = GPT(TINY['gpt2']())
    assert g.lm_head.weight is g.wte.weight
    assert isinstance(g.blocks, torch.nn.ModuleList) and len(g.blocks) == 2
    assert set(g.outer_modules()) == {'embed', 'pos', 'norm', 'head'}
    assert g.outer_modules()['pos'] is g.wpe

    l = GPT(TINY['llama']())
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
        m = GPT(TINY[arch]())
        ids = {id(p) for mod in m.outer_modules().values() for p in mod.parameters()}
        ids |= {id(p) for p in m.blocks.parameters()}
        assert ids == {id(p) for p in m.parameters()}


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_causal(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg).eval()
    x, _ = batch(cfg)
    x2 = x.clone()
    x2[:, -1] = (x[:, -1] + 1) % cfg.vocab_size
    l1, l2 = all_logits(model, x), all_logits(model, x2)
    assert torch.allclose(l1[:, :-1], l2[:, :-1], atol=1e-6)
    assert not torch.allclose(l1[:, -1], l2[:, -1])


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_activation_checkpointing_matches(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg).train()
    x, y = batch(cfg)

    def run():
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_ref, grads_ref = run()
    model.activation_checkpointing = True
    loss_ckpt, grads_ckpt = run()
    assert torch.allclose(loss_ref, loss_ckpt)
    for n in grads_ref:
        assert torch.allclose(grads_ref[n], grads_ckpt[n], atol=1e-6), n


def test_configure_optimizers_keeps_frozen_params():
    model = GPT(TINY['llama']())
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    in_opt = {id(p) for g in opt.param_groups for p in g['params']}
    assert in_opt == {id(p) for p in model.parameters()}
    assert any(not p.requires_grad for g in opt.param_groups for p in g['params'])
    decay, no_decay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and no_decay['weight_decay'] == 0.0
    assert all(p.dim() >= 2 for p in decay['params'])
    assert all(p.dim() < 2 for p in no_decay['params'])


def test_param_groups_dedupes_tied_weights():
    model = GPT(TINY['gpt2']())
    groups = param_groups(model, 0.1)
    ps = [p for g in groups for p in g['params']]
    assert len(ps) == len({id(p) for p in ps}) == len(list(model.parameters()))
    torch.optim.SGD(groups, lr=0.1)  # reusable by other optimizers


def test_from_pretrained_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, 'transformers', None)  # import now fails
    with pytest.raises(RuntimeError) as e:
        GPT.from_pretrained('gpt2')
    msg = str(e.value)
    assert 'pip install transformers' in msg and '\n' not in msg
    with pytest.raises(ValueError):
        GPT.from_pretrained('llama-7b')


def test_from_pretrained_maps_hf_names(monkeypatch):
    # a stand-in for transformers that serves a GPT-2-layout state_dict (Conv1D = transposed)
    import types
    src = GPT(config_from_preset('gpt2', n_layer=1))
    conv1d = ('c_attn.weight', 'c_proj.weight', 'c_fc.weight')
    sd_hf = {}
    for k, v in src.state_dict().items():
        k_hf = 'lm_head.weight' if k == 'lm_head.weight' else 'transformer.' + k.replace('blocks.', 'h.')
        sd_hf[k_hf] = v.t() if k.endswith(conv1d) else v
    sd_hf['transformer.h.0.attn.bias'] = torch.ones(1)  # HF's causal-mask buffer

    class FakeHF:
        @classmethod
        def from_pretrained(cls, name):
            return types.SimpleNamespace(state_dict=lambda: sd_hf)

    monkeypatch.setitem(sys.modules, 'transformers', types.SimpleNamespace(GPT2LMHeadModel=FakeHF))
    monkeypatch.setitem(PRESETS, 'gpt2', dict(PRESETS['gpt2'], n_layer=1))
    model = GPT.from_pretrained('gpt2', {'dropout': 0.1})
    assert model.config.dropout == 0.1 and model.lm_head.weight is model.wte.weight
    for k, v in src.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_generate_shape(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg).eval()
    idx = torch.zeros(2, 3, dtype=torch.long)
    out = model.generate(idx, max_new_tokens=20, temperature=0.8, top_k=5)  # grows past block_size
    assert out.shape == (2, 23)
    assert out.min() >= 0 and out.max() < cfg.vocab_size


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_crop_block_size(arch):
    cfg = TINY[arch]()
    model = GPT(cfg).eval()
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
        model = GPT(cfg)
    model.to_empty(device='cpu')
    model.init_weights()
    x, y = batch(cfg)
    _, loss = model(x, y)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    ref = GPT(cfg)
    assert torch.equal(model.rope_cos, ref.rope_cos)


def test_flops_per_token_counts_frozen_blocks_at_4N():
    cfg = config_from_preset('gpt2')
    with torch.device('meta'):
        model = GPT(cfg)
    N = model.get_num_params()  # wpe excluded; blocks + the tied wte/head + ln_f
    attention = 12 * 12 * 12 * 64 * 1024
    ln_f = 2 * 768
    assert model.estimate_flops_per_token() == 6 * (N - ln_f) + attention
    frozen = sum(p.numel() for p in model.blocks[3].parameters())
    model.blocks[3].requires_grad_(False)
    assert model.estimate_flops_per_token() == 6 * (N - ln_f) - 2 * frozen + attention

def test_flops_per_token_skip_the_backward_below_every_trainable_parameter():
    model = GPT(TINY['llama']())  # untied head: the embedding can freeze alone
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


# -----------------------------------------------------------------------------
# memory: logits, chunked loss, frozen blocks, activation offload


class LiveStorages(TorchDispatchMode):
    """The storages that ops under it create and that are still alive (weak references), and the
    peak of their bytes, op by op: a CPU run's allocations without an allocator to ask. Storages of
    the tensors passed in existed before and are not counted (nor are views of them)."""

    def __init__(self, *before):
        super().__init__()
        self.before = [t.untyped_storage() for t in tree_leaves(before) if isinstance(t, torch.Tensor)]
        self.live, self.current, self.peak = {}, 0, 0

    def _freed(self, key, _):
        self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key not in self.live and not any(st is b for b in self.before):
                    self.live[key] = (weakref.ref(st, lambda ref, key=key: self._freed(key, ref)), st.nbytes())
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
        return out

    def sizes(self):
        return [nbytes for _, nbytes in self.live.values()]


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_training_forward_holds_no_logits(arch):
    """train.py's `_, loss = model(X, Y)` keeps `_` until its next forward: it must not be the logits."""
    torch.manual_seed(0)
    # the vocabulary is wider than the MLP and there are more tokens than n_embd, so only the
    # logits (and the log-probabilities) reach tokens x vocab floats, not a weight gradient
    cfg = tiny(arch, vocab_size=512, block_size=32)
    model = GPT(cfg).train()
    x, y = batch(cfg)
    logits_bytes = x.numel() * cfg.vocab_size * 4
    tracker = LiveStorages(list(model.parameters()), list(model.buffers()), x, y)
    with tracker:
        _, loss = model(x, y)
        loss.backward()
        del loss
    assert tracker.peak >= logits_bytes  # they did exist, in the forward
    assert max(tracker.sizes()) < logits_bytes, 'a tokens x vocab tensor outlives the backward'
    assert sum(tracker.sizes()) == sum(p.grad.untyped_storage().nbytes() for p in model.parameters())  # all else freed


def run_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
@pytest.mark.parametrize('chunk', [7, 16])  # 32 tokens: a remainder chunk; two even ones
def test_chunked_loss_matches_full(arch, chunk):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg).train()
    x, y = batch(cfg)
    y[0, 3:] = -1  # ignored targets, across chunk boundaries and filling whole chunks
    # each case against the unchunked loss: all trainable, frozen head (no dW), only the head (no dx)
    for case in ('all', 'head frozen', 'head only'):
        if case == 'head frozen':
            model.lm_head.requires_grad_(False)
        elif case == 'head only':
            model.requires_grad_(False)
            model.lm_head.requires_grad_(True)
        model.loss_chunk = 0
        loss_ref, grads_ref = run_grads(model, x, y)
        model.loss_chunk = chunk
        loss, grads = run_grads(model, x, y)
        # not bitwise: the chunks' losses and dW are summed in another order than one big reduction
        torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
        assert grads.keys() == grads_ref.keys() and grads
        for n in grads:
            torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-5, atol=1e-7, msg=f'{case}: {n}')
        with torch.no_grad():  # evaluation runs the chunks too
            torch.testing.assert_close(model(x, y)[1], loss_ref, rtol=1e-6, atol=0)


class MatmulDtypes(TorchDispatchMode):
    """The dtypes of the operands of every matmul run under it (dtypes: a set, count: how many)."""

    def __enter__(self):
        self.dtypes, self.count = set(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_chunked_loss_under_autocast(arch):
    """Under bf16 autocast the chunks' matmuls run in bf16 as the unchunked head's do, the weight
    gradient accumulates in the weight's fp32: within bf16 rounding of the unchunked result
    (bf16 against fp32 differs by up to 1.5% here)."""
    torch.manual_seed(0)
    cfg = tiny(arch, vocab_size=512, block_size=32)
    model = GPT(cfg).train()
    x, y = batch(cfg)
    y[0, 3:] = -1
    with torch.autocast('cpu', torch.bfloat16):
        loss_ref, grads_ref = run_grads(model, x, y)
        model.loss_chunk = 7
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
    with MatmulDtypes() as backward:  # the backward runs outside autocast, as train.py's does
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    # every matmul of the backward is in bf16, the head's recomputation and products included
    assert backward.count >= 3 * math.ceil(x.numel() / 7) and backward.dtypes == {torch.bfloat16}
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    for n in grads_ref:
        assert grads[n].dtype == torch.float32
        assert (grads[n] - grads_ref[n]).abs().max() <= 1e-2 * grads_ref[n].abs().max(), n


def test_chunked_loss_keeps_one_chunk_of_logits():
    """The head on given hidden states, forward and backward: unchunked, tokens x vocab floats are
    saved; chunked, nothing of that size is saved, and beyond dx and dW at most two chunk x vocab
    buffers exist at once (the chunk's logits and their gradient)."""
    torch.manual_seed(0)
    cfg = tiny('llama', vocab_size=512)
    model = GPT(cfg)
    n, chunk, C, V = 64, 16, cfg.n_embd, cfg.vocab_size
    x = torch.randn(n, C, requires_grad=True)
    y = torch.randint(0, V, (n,))
    grads = (n + V) * C * 4  # dx and dW
    chunk_bytes = chunk * V * 4

    def measure(loss_chunk):
        model.loss_chunk = loss_chunk
        model.zero_grad(set_to_none=True)
        x.grad = None
        tracker = LiveStorages(x, y, list(model.parameters()))
        with tracker:
            loss = model.head_loss(x, y)
            after_forward = tracker.current
            loss.backward()
        return after_forward, tracker.peak

    after_forward, peak = measure(0)
    assert after_forward >= n * V * 4 and peak >= grads + 2 * n * V * 4
    after_forward, peak = measure(chunk)
    assert after_forward < 64  # a few scalars: the token count, the loss
    # slack: the chunk's dx (chunk x n_embd) and its target masks
    assert grads + chunk_bytes < peak <= grads + 2 * chunk_bytes + chunk * C * 4 + 1024


def saved_activation_bytes(module, *args):
    """Bytes of the distinct storages autograd saves for the backward in module(*args); storages of
    parameters and of the tensors in args (inputs, rotary tables) are not activations of the block."""
    exclude = {t.untyped_storage().data_ptr() for t in tree_leaves((list(module.parameters()), args))
               if isinstance(t, torch.Tensor)}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            saved[st.data_ptr()] = st.nbytes()  # storages stay alive while `out` holds the graph
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args)
    del out
    return sum(saved.values())


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_frozen_block_saves_only_what_its_input_gradient_needs(arch):
    """A frozen block above a trainable part (its input needs a gradient) must not keep the inputs
    of its linear layers, which only serve their weight gradients; PyTorch's mm saves an operand
    only for the other operand's gradient."""
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg)
    block = model.blocks[0]
    T = cfg.block_size
    x = torch.randn(2, T, cfg.n_embd, requires_grad=True)
    rope = (model.rope_cos[:T], model.rope_sin[:T]) if arch == 'llama' else None
    trainable = saved_activation_bytes(block, x, rope)
    block.requires_grad_(False)
    frozen = saved_activation_bytes(block, x, rope)
    C, H = cfg.n_embd, cfg.mlp_hidden
    # per token, saved only for weight gradients: the inputs of the attention's and the MLP's first
    # linears (the norms' outputs, C each) and of the MLP's last one (H). The output projection's
    # input is the attention output, which SDPA saves anyway. LLaMA's RMSNorm also saves its
    # normalised input (C each) for its weight's gradient; LayerNorm recomputes it from mean and rstd.
    weight_grad_only = 2 * C + H if arch == 'gpt2' else 4 * C + H
    assert trainable - frozen == x.numel() // C * weight_grad_only * 4


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_frozen_block_under_autocast_keeps_no_weight_copies(arch, monkeypatch):
    """Under bf16 autocast, autograd's own linear keeps the bf16 copy of a frozen weight until the
    backward; model.Linear saves the parameter instead: a frozen block saves exactly the bf16 bytes
    of its matrices less, with the same input gradient bitwise."""
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg)
    block = model.blocks[0].requires_grad_(False)
    T = cfg.block_size
    x = torch.randn(2, T, cfg.n_embd, requires_grad=True)
    rope = (model.rope_cos[:T], model.rope_sin[:T]) if arch == 'llama' else None

    def run():
        x.grad = None
        with torch.autocast('cpu', torch.bfloat16):
            saved = saved_activation_bytes(block, x, rope)
            out = block(x, rope)
        out.float().square().sum().backward()
        return saved, x.grad

    saved, dx = run()
    monkeypatch.setattr(model_module.Linear, 'forward', torch.nn.Linear.forward)  # autograd's own linear
    saved_ref, dx_ref = run()
    matrices = sum(p.numel() for p in block.parameters() if p.dim() == 2)
    assert saved_ref - saved == matrices * 2
    assert torch.equal(dx, dx_ref)


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_activation_offload(arch, monkeypatch):
    """On CPU the offload keeps tensors where they are: the gradients are the same bitwise, with
    activation checkpointing and the chunked loss too. Then CPU tensors are offloaded as if from a
    device (keep_on emptied): every saved activation is copied to a new host tensor, each distinct
    view once, and the backward on those copies still gives the same gradients bitwise."""
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = GPT(cfg).train()
    x, y = batch(cfg)
    for ckpt, chunk in ((False, 0), (True, 0), (False, 7), (True, 7)):
        model.activation_checkpointing, model.loss_chunk = ckpt, chunk
        model.activation_offload = False
        loss_ref, grads_ref = run_grads(model, x, y)
        model.activation_offload = True
        loss, grads = run_grads(model, x, y)
        assert torch.equal(loss, loss_ref)
        assert grads.keys() == grads_ref.keys()
        assert all(torch.equal(grads[n], grads_ref[n]) for n in grads), (ckpt, chunk)

    model.activation_checkpointing, model.loss_chunk, model.activation_offload = False, 0, False
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss_ref, grads_ref = run_grads(model, x, y)
    activations = [t for t in saved if not model_module._is_weight(t)]
    views = {(id(t.untyped_storage()), t.storage_offset(), t.shape, t.stride()) for t in activations}

    monkeypatch.setattr(model_module.OffloadActivations, 'keep_on', ())
    copies = []
    to_host = model_module.OffloadActivations.to_host
    monkeypatch.setattr(model_module.OffloadActivations, 'to_host', staticmethod(
        lambda t: copies.append(to_host(t)) or copies[-1]))
    model.activation_offload = True
    loss, grads = run_grads(model, x, y)
    assert len(copies) == len(views) > 0
    assert all(c.device.type == 'cpu' for c in copies)
    assert torch.equal(loss, loss_ref) and all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    with torch.no_grad():
        model(x, y)  # nothing is saved without grad: no hooks, no copies
    assert len(copies) == len(views)


@pytest.mark.parametrize('autocast', [False, True])
def test_offload_leaves_weights_in_place(autocast):
    """Offloading copies activations, not weights: a parameter, a view of it (the transposed weight
    that mm saves) and, under autocast, the cached low-precision copy of a trainable one stay on the
    device. Here a saved tensor is a weight iff it has a parameter's shape (24 tokens: no activation
    does)."""
    torch.manual_seed(0)
    cfg = tiny('llama', n_kv_head=2, block_size=12)
    model = GPT(cfg).train()
    model.blocks[1].requires_grad_(False)  # frozen weights are saved too (for the input gradient)
    x, y = batch(cfg)
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
            model(x, y)
    labels = [(tuple(t.shape), tuple(t.shape) in shapes, model_module._is_weight(t)) for t in saved]
    assert [l for l in labels if l[1] != l[2]] == []
    assert any(l[1] for l in labels) and not all(l[1] for l in labels)
    if autocast:
        assert any(t.dtype == torch.bfloat16 and tuple(t.shape) in shapes for t in saved)
