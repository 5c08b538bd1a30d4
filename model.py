"""GPT-2 (learned positions, fused q/k/v, GELU, LayerNorm, tied head) and LLaMA (rotary positions, grouped-query
attention, SwiGLU, RMSNorm, no biases) in one file, in the spirit of nanoGPT's model.py. Layer cycling relies on the
layout: the blocks are `model.blocks` (frozen by index), everything else is `model.outer_modules()`."""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F


class FrozenLinear(torch.autograd.Function):
    """F.linear of a frozen weight under autocast that saves the parameter, not autocast's low-precision copy."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(weight)
        ctx.dtype = dtype
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        dx = torch.matmul(grad.to(ctx.dtype), weight.to(ctx.dtype)) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


# device type -> the dtype of an autocast that is emulated there, not run (set only by emulated_autocast)
EMULATED_AUTOCAST = {}


@contextmanager
def emulated_autocast(device_types, dtype):
    """Linear and the loss act as under autocast in `dtype` on `device_types` (memory_estimate's meta device)."""
    saved = dict(EMULATED_AUTOCAST)  # put back on exit (the emulations nest)
    EMULATED_AUTOCAST.update(dict.fromkeys(device_types, dtype))
    try:
        yield
    finally:
        EMULATED_AUTOCAST.clear()
        EMULATED_AUTOCAST.update(saved)


# read once here: torch <= 2.11's dynamo cannot trace torch.amp.is_autocast_available (a graph break)
AUTOCAST_DEVICE_TYPES = frozenset(filter(torch.amp.is_autocast_available, ('cpu', 'cuda', 'xpu', 'mps', 'hpu', 'mtia')))


def autocast_dtype(device_type):
    """The dtype autocast (or its emulation) casts matmuls to on `device_type` now, or None."""
    if device_type in EMULATED_AUTOCAST:
        return EMULATED_AUTOCAST[device_type]
    if device_type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict); a frozen layer under autocast runs FrozenLinear."""

    def forward(self, x):
        frozen = not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)
        dtype = autocast_dtype(x.device.type) if frozen and torch.is_grad_enabled() else None
        if dtype is not None:
            return FrozenLinear.apply(x, self.weight, self.bias, dtype)
        return super().forward(x)


def cross_entropy_sum(logits, targets):
    """The summed fp32 cross-entropy of (N, V) logits against targets (-1: ignored), and each row's log-sum-exp."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(targets != -1, lse - picked, 0.0).sum(), lse


def cross_entropy_grad(logits, lse, targets, scale):
    """scale x (softmax - one_hot(target)), 0 on ignored rows: fp32, rounded once to the logits' dtype."""
    grad = logits.float().sub_(lse.unsqueeze(1)).exp_()
    valid = (targets != -1).unsqueeze(1)
    grad.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -valid.float())
    return grad.mul_(valid * scale).to(logits.dtype)


class LossKernels(NamedTuple):
    forward: Callable  # cross_entropy_sum
    backward: Callable  # cross_entropy_grad


# eager mode runs the two this many rows at a time, so their fp32 temporaries are (rows x vocab), not (tokens x vocab)
EAGER_ROWS = 1024


def _eager_cross_entropy_sum(logits, targets):
    parts = [cross_entropy_sum(*rows) for rows in zip(logits.split(EAGER_ROWS), targets.split(EAGER_ROWS))]
    return sum(total for total, _ in parts), torch.cat([lse for _, lse in parts])


def _eager_cross_entropy_grad(logits, lse, targets, scale):
    grad = torch.empty_like(logits)
    for i in range(0, logits.size(0), EAGER_ROWS):
        rows = slice(i, i + EAGER_ROWS)
        grad[rows] = cross_entropy_grad(logits[rows], lse[rows], targets[rows], scale)
    return grad


EAGER_LOSS_KERNELS = LossKernels(_eager_cross_entropy_sum, _eager_cross_entropy_grad)


class LinearCrossEntropy(torch.autograd.Function):
    """F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1) with the matmuls in `dtype`, saving
    x and the logits in `dtype`, fp32 log-sum-exps and the weight. kernels: LossKernels, eager or compiled."""

    @staticmethod
    def forward(ctx, x, weight, targets, dtype, kernels):
        ctx.x_dtype = x.dtype
        x = x.to(dtype)
        logits = F.linear(x, weight.to(dtype))
        total, lse = kernels.forward(logits, targets)
        count = (targets != -1).sum()
        ctx.save_for_backward(x, weight, targets, logits, lse, count)
        ctx.kernels = kernels
        return total / count  # the mean over counted tokens, as ignore_index=-1 does

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, targets, logits, lse, count = ctx.saved_tensors
        dlogits = ctx.kernels.backward(logits, lse, targets, grad / count)
        need_x, need_w = ctx.needs_input_grad[:2]
        dx = dlogits.mm(weight.to(dlogits.dtype)).to(ctx.x_dtype) if need_x else None
        dw = dlogits.t().mm(x).to(weight.dtype) if need_w else None
        return dx, dw, None, None, None


@dataclass
class TransformerConfig:
    # plain types only: checkpoints store its asdict(), read with weights_only=True. Defaults: train.py's
    arch: str = 'gpt2'  # 'gpt2' or 'llama'
    block_size: int = 64  # tokens per sequence
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 6
    n_head: int = 4
    n_kv_head: int = 0  # 0 -> n_head; fewer gives LLaMA grouped-query attention
    n_embd: int = 128
    mlp_hidden: int = 0  # 0 -> 4*n_embd (gpt2) or the LLaMA 8/3 rule (llama)
    dropout: float = 0.0
    bias: bool = False  # gpt2 only: biases in Linears and LayerNorms
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    gelu: str = 'exact'  # gpt2's GELU: 'exact' (erf, nanoGPT's) or 'tanh' (GPT-2's own weights; set by hf.py)
    tie_embeddings: bool | None = None  # head = token embedding; None -> True for gpt2, False for llama

    def __post_init__(self):
        check_arch(self.arch)
        if self.gelu not in ('exact', 'tanh'):
            raise ValueError(f"gelu must be 'exact' or 'tanh', got {self.gelu!r}")
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch == 'gpt2'
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        # resolve the 0 defaults here so the saved config states what was built
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.arch == 'llama':
            if (self.n_embd // self.n_head) % 2 != 0:
                raise ValueError("rotary embeddings need an even head dimension")
            self.bias = False  # LLaMA has no biases anywhere
        if self.mlp_hidden == 0:  # LLaMA: 2/3 of 4*d keeps SwiGLU's 3 matrices at the cost of 2
            llama_hidden = 256 * math.ceil(int(2 * 4 * self.n_embd / 3) / 256)
            self.mlp_hidden = 4 * self.n_embd if self.arch == 'gpt2' else llama_hidden


# the config fields that give the weights their shapes (train.py's keys of the same names), and what a preset sets
SHAPE_KEYS = ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias')
PRESET_KEYS = (*SHAPE_KEYS, 'vocab_size', 'norm_eps', 'rope_theta')
# LLaMA sizes are GaLore's pre-training configs, with its sequence length of 256 (7b included)
_LLAMA = dict(arch='llama', vocab_size=32000, block_size=256, bias=False, norm_eps=1e-6)
_GPT2 = dict(arch='gpt2', vocab_size=50257, block_size=1024, bias=True)
PRESETS: dict[str, dict] = {
    'gpt2': dict(_GPT2, n_layer=12, n_head=12, n_embd=768),  # 124M
    'gpt2-medium': dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),  # 350M
    'gpt2-large': dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),  # 774M
    'gpt2-xl': dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),  # 1558M
    'llama-60m': dict(_LLAMA, n_layer=8, n_head=8, n_embd=512, mlp_hidden=1376),
    'llama-130m': dict(_LLAMA, n_layer=12, n_head=12, n_embd=768, mlp_hidden=2048),
    'llama-350m': dict(_LLAMA, n_layer=24, n_head=16, n_embd=1024, mlp_hidden=2736),
    'llama-1b': dict(_LLAMA, n_layer=24, n_head=32, n_embd=2048, mlp_hidden=5461),
    'llama-7b': dict(_LLAMA, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008),
}


ARCHS = ('gpt2', 'llama')
# the dtypes of weights and autocast, by the names configs give them (train.py's dtype, eval.py's, hf.py's export)
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def check_arch(arch):
    if arch not in ARCHS:
        raise ValueError(f"arch must be {' or '.join(map(repr, ARCHS))}, got {arch!r}")


def check_preset(name):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def config_from_preset(name: str, **overrides) -> TransformerConfig:
    check_preset(name)
    return TransformerConfig(**{**PRESETS[name], **overrides})


def causal_attention(q, k, v, dropout):
    """Causal attention of (B, heads, T, head_dim) queries to (B, T, C); k, v: maybe fewer heads, S >= T positions."""
    # only ask for GQA when needed, so plain MHA keeps every SDPA backend available
    gqa = {'enable_gqa': True} if k.size(1) != q.size(1) else {}
    T, S = q.size(2), k.size(2)
    mask = None  # T == S: is_causal; T == 1 (a generated token): it sees every key
    if 1 < T < S:  # query i is position S - T + i: it sees keys 0 .. S - T + i (is_causal would align to the top)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=T == S, **gqa)
    B, n_head, T, head_dim = y.size()
    return y.transpose(1, 2).contiguous().view(B, T, n_head * head_dim)


class GPT2Attention(nn.Module):
    """GPT-2's multi-head attention: q, k and v from one fused matrix (its checkpoint layout, hf.py)."""

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope=None, cache=None):  # rope: unused, GPT-2's positions are in its embeddings
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:  # generation: the keys and values of the earlier positions too
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y))


def apply_rotary(x, cos, sin):
    # in fp32 (bf16 angles lose precision at large positions), halves split as HF's LLaMA checkpoints are
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat((-x2, x1), dim=-1) * sin).type_as(x)


class Rotary(nn.Module):
    """LLaMA's rotary embedding: (block_size, head_dim) cos and sin tables, non-persistent, computed on their device."""

    def __init__(self, config):
        super().__init__()
        self.head_dim, self.theta = config.n_embd // config.n_head, config.rope_theta
        self.register_buffer('cos', torch.empty(config.block_size, self.head_dim), persistent=False)
        self.register_buffer('sin', torch.empty(config.block_size, self.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, block_size=None):  # in fp32, for block_size positions (default: as many as now)
        device, block_size = self.cos.device, block_size or self.cos.size(0)
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / self.theta**exponents
        freqs = torch.outer(torch.arange(block_size, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # registered names: they stay buffers

    def forward(self, T, start=0):  # positions start .. start + T - 1 (start > 0: generation with a KV cache)
        return self.cos[start : start + T], self.sin[start : start + T]


class LlamaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # separate q/k/v: GQA makes k/v narrower, and GaLore projects each matrix
        kv_dim = self.n_kv_head * self.head_dim
        self.q_proj = Linear(config.n_embd, config.n_embd, bias=False)
        self.k_proj = Linear(config.n_embd, kv_dim, bias=False)
        self.v_proj = Linear(config.n_embd, kv_dim, bias=False)
        self.o_proj = Linear(config.n_embd, config.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope, cache=None):
        B, T, C = x.size()
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:  # generation: the keys and values of the earlier positions too (rotated already)
            k, v = cache.append(k, v)
        y = causal_attention(q, k, v, self.dropout if self.training else 0.0)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = 'tanh' if config.gelu == 'tanh' else 'none'

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class SwiGLU(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up_proj = Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down_proj = Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def make_norm(config):
    if config.arch == 'llama':
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """A pre-norm residual block; its halves are methods (memory_options recomputes them apart, generation caches)."""

    def __init__(self, config):
        super().__init__()
        llama = config.arch == 'llama'
        self.ln_1 = make_norm(config)
        self.attn = LlamaAttention(config) if llama else GPT2Attention(config)
        self.ln_2 = make_norm(config)
        self.mlp = SwiGLU(config) if llama else MLP(config)

    def forward(self, x, rope=None):
        # two statements: nested, a graph break in attention_part makes torch 2.9's dynamo recompile every call
        x = self.attention_part(x, rope)
        return self.mlp_part(x)

    def attention_part(self, x, rope=None, cache=None):
        return x + self.attn(self.ln_1(x), rope, cache)

    def mlp_part(self, x):
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """Every attention layer's keys and values so far (up to max_len): a generation step runs its new token only."""

    def __init__(self, n_layer, max_len):
        self.max_len = max_len
        self.layers = [LayerCache(max_len) for _ in range(n_layer)]

    @property
    def length(self):  # positions held, by every layer between forwards
        return self.layers[0].length


class LayerCache:
    def __init__(self, max_len):
        self.max_len, self.length, self.k, self.v = max_len, 0, None, None

    def append(self, k, v):
        """Store the keys and values (B, kv_heads, T, head_dim) of T new positions; return all so far."""
        if self.k is None:  # allocated at the first write: the batch, heads, dtype (autocast) and device of k
            B, H, _, D = k.shape
            self.k, self.v = k.new_empty(B, H, self.max_len, D), v.new_empty(B, H, self.max_len, D)
        end = self.length + k.size(2)
        self.k[:, :, self.length : end], self.v[:, :, self.length : end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


# weights that write into the residual stream get the GPT-2 1/sqrt(2L) scaling
_RESIDUAL_PROJ = ('attn.c_proj.weight', 'mlp.c_proj.weight', 'o_proj.weight', 'down_proj.weight')


class Transformer(nn.Module):
    """A GPT-2 or a LLaMA decoder, as config.arch says: nanoGPT's `GPT`, named for both."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        llama = config.arch == 'llama'
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if llama else nn.Embedding(config.block_size, config.n_embd)
        self.rotary = Rotary(config) if llama else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = make_norm(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:  # as GPT-2; LLaMA keeps a separate head unless its checkpoint ties them
            self.wte.weight = self.lm_head.weight
        self.loss_kernels = EAGER_LOSS_KERNELS  # compile_loss() replaces them
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialise all parameters and buffers in place (again after `to_empty()` of a meta model)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)
            if isinstance(module, (nn.LayerNorm, nn.RMSNorm, Rotary)):
                module.reset_parameters()
        for pn, p in self.named_parameters():
            if pn.endswith(_RESIDUAL_PROJ):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def outer_modules(self) -> dict[str, nn.Module]:
        """Everything outside `blocks`; the head is listed even when tied to the embedding."""
        out = {'embed': self.wte, 'pos': self.wpe, 'norm': self.ln_f, 'head': self.lm_head}
        return {name: module for name, module in out.items() if module is not None}

    def get_num_params(self, non_embedding=True):
        """non_embedding leaves out the lookup-only tables (positions, an untied token embedding): no FLOPs."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding and self.wpe is not None:
            n_params -= self.wpe.weight.numel()
        if non_embedding and not self.config.tie_embeddings:
            n_params -= self.wte.weight.numel()
        return n_params

    def forward(self, idx, targets=None):
        """With targets: (None, mean cross-entropy); no logits, which `_, loss = model(X, Y)` would keep alive.
        Without: (the last position's logits, None); `model.lm_head(model.hidden_states(idx))` gives all."""
        x = self.hidden_states(idx)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None  # [-1] as a list keeps the time dim
        return None, self.head_loss(x, targets)

    def hidden_states(self, idx, cache=None):
        """The final-norm output (b, t, n_embd). With a KVCache, idx holds the t positions after the cache's."""
        b, t = idx.size()
        start = 0 if cache is None else cache.length  # the position of idx[:, 0]
        if start + t > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {start + t}, block size is {self.config.block_size}")
        if cache is not None and start + t > cache.max_len:
            raise ValueError(f"cannot forward a sequence of length {start + t}, the KV cache holds {cache.max_len}")
        x = self.wte(idx)  # (b, t, n_embd)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + t, dtype=torch.long, device=idx.device))
        rope = self.rotary(t, start) if self.rotary is not None else None
        x = self.drop(x)
        if cache is None:
            for block in self.blocks:
                x = block(x, rope)
        else:  # the halves, called directly: a block's forward may be wrapped for training (memory_options.py)
            for block, layer_cache in zip(self.blocks, cache.layers):
                x = block.mlp_part(block.attention_part(x, rope, layer_cache))
        return self.ln_f(x)

    def head_loss(self, x, targets):
        """Mean cross-entropy of the head on hidden states x against targets (-1 = ignored)."""
        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        weight = self.lm_head.weight
        dtype = autocast_dtype(x.device.type) or (weight.dtype if weight.element_size() < 4 else None)
        if dtype is None:  # fp32 logits
            return F.cross_entropy(self.lm_head(x), targets, ignore_index=-1)
        return LinearCrossEntropy.apply(x, weight, targets, dtype, self.loss_kernels)

    def compile_loss(self, **kwargs):
        """torch.compile the low-precision loss kernels (kwargs go to torch.compile): one fused pass each."""
        self.loss_kernels = LossKernels(*(torch.compile(f, **kwargs) for f in (cross_entropy_sum, cross_entropy_grad)))

    def crop_block_size(self, block_size):
        # model surgery: e.g. GPT-2's pretrained weights (block size 1024) for a shorter context
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if self.wpe is not None:
            self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])
        else:
            self.rotary.reset_parameters(block_size)

    def estimate_flops_per_token(self):
        """Training FLOPs per token as frozen now (nanoGPT's 6N + attention): blocks below every trainable one run
        forward only (2 per weight); above, a trainable weight costs 6, a frozen one 4 (its input gradient)."""
        attention = 12 * self.config.n_embd * self.config.block_size  # per layer, forward + backward
        trains = lambda module: module is not None and any(p.requires_grad for p in module.parameters())
        backward = trains(self.wte) or trains(self.wpe)  # does anything at or below here train?
        flops = 0
        for block in self.blocks:
            backward = backward or trains(block)
            if backward:
                flops += sum((6 if p.requires_grad else 4) * p.numel() for p in block.parameters()) + attention
            else:
                flops += 2 * sum(p.numel() for p in block.parameters()) + attention // 3
        backward = backward or trains(self.ln_f)
        head = self.lm_head.weight
        return flops + (6 if head.requires_grad else 4 if backward else 2) * head.numel()

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """Complete the (b, t) token indices idx with max_new_tokens sampled tokens (call model.eval() first).
        use_cache: each step runs its new token only (KVCache), same tokens; beyond block_size (and FSDP): uncached."""
        block_size = self.config.block_size
        if torch.distributed.is_available():  # FSDP2's forward hooks gather a block's weights: a cached step skips them
            from torch.distributed.fsdp import FSDPModule

            use_cache = use_cache and not isinstance(self.blocks[0], FSDPModule)
        cache = None
        if use_cache and idx.size(1) <= block_size:
            cache = KVCache(self.config.n_layer, min(block_size, idx.size(1) + max_new_tokens))
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= block_size:
                # the cache holds every position but the newest token's (at the first step: none, the prompt)
                x = self.hidden_states(idx[:, cache.length :], cache)
                logits = self.lm_head(x[:, [-1], :])
            else:  # the last block_size tokens
                logits, _ = self(idx[:, -block_size:])
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
