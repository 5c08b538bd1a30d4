"""
GPT-2 and LLaMA language models in one file, in the spirit of nanoGPT.

The two architectures differ in their parts, chosen per architecture in Block and Transformer:
GPT-2: learned position embeddings, fused q/k/v attention (GPT2Attention), GELU MLP, LayerNorm,
       head tied to the token embedding (config.tie_embeddings' default);
LLaMA: rotary positions (Rotary), grouped-query attention (LlamaAttention), SwiGLU, RMSNorm,
       no biases, a separate head by default.
The layout is what layer cycling (OMGD / LISA-wor) relies on: the transformer
blocks live in `model.blocks` so a sampler can freeze/unfreeze them by index,
and everything outside the blocks is reachable through `model.outer_modules()`.
The memory options (activation checkpointing, offload, chunked loss) are applied from outside
by memory_options.apply; optimizers are built in optim.py. generate() keeps the keys and values of past
positions in a KVCache, so each step runs the model on the new token only.

References:
1) nanoGPT: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) LLaMA (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention)
3) GaLore's LLaMA pre-training configs (sizes in PRESETS below)
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F

# -----------------------------------------------------------------------------
# the linear layer of every matrix: nn.Linear that keeps no low-precision copy of a frozen weight
# under autocast (what makes a frozen block cheap in memory under amp)


class FrozenLinear(torch.autograd.Function):
    """F.linear of a frozen weight (and bias) under autocast. The input gradient needs only the
    weight; autograd's own linear saves the low-precision copy autocast made of it, a weight-sized
    tensor per matrix kept until the backward (13.5 MiB per GPT-2 block in bf16). This saves the
    parameter itself and casts it again in the backward."""

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
    """While it is on, Linear and the loss take the paths of an autocast in `dtype` on `device_types`, which
    is emulated, not run: memory_estimate.MetaAsCuda emulates CUDA's autocast on the meta device (which has
    none of its own), so the estimate counts what a CUDA run allocates (FrozenLinear, LinearCrossEntropy)."""
    saved = dict(EMULATED_AUTOCAST)  # put back on exit (the emulations nest)
    EMULATED_AUTOCAST.update(dict.fromkeys(device_types, dtype))
    try:
        yield
    finally:
        EMULATED_AUTOCAST.clear()
        EMULATED_AUTOCAST.update(saved)


# the device types autocast exists for: a fixed fact, read once here, because the dynamo of torch 2.11
# and older cannot trace torch.amp.is_autocast_available in a compiled block (a graph break), and
# torch.compiler.assume_constant_result would import dynamo (about a second) in every process
AUTOCAST_DEVICE_TYPES = frozenset(
    t for t in ('cpu', 'cuda', 'xpu', 'mps', 'hpu', 'mtia') if torch.amp.is_autocast_available(t)
)


def autocast_dtype(device_type):
    """The dtype autocast casts matmuls to on `device_type` now (or emulates: EMULATED_AUTOCAST), or None."""
    if device_type in EMULATED_AUTOCAST:
        return EMULATED_AUTOCAST[device_type]
    if device_type in AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) that routes a frozen layer under autocast through
    FrozenLinear."""

    def forward(self, x):
        if (
            not self.weight.requires_grad
            and (self.bias is None or not self.bias.requires_grad)
            and torch.is_grad_enabled()
        ):
            dtype = autocast_dtype(x.device.type)
            if dtype is not None:
                return FrozenLinear.apply(x, self.weight, self.bias, dtype)
        return super().forward(x)


# -----------------------------------------------------------------------------
# the loss of low-precision logits (bf16 autocast, bf16 weights): the head and cross-entropy in one
# autograd function that keeps the logits as they are. F.cross_entropy(logits.float()) keeps fp32
# log-probabilities (twice the logits' bytes) and takes about six passes over the (tokens x vocab)
# logits in eager mode: 17% of GPT-2 124M's iteration on an H200 (results/gpu_validation_NVIDIA_H200.md).


def cross_entropy_sum(logits, targets):
    """The summed cross-entropy of (N, V) logits against targets (-1: ignored), in fp32 math, and each
    row's log-sum-exp (what the backward needs besides the logits)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(targets != -1, lse - picked, 0.0).sum(), lse


def cross_entropy_grad(logits, lse, targets, scale):
    """scale x d(summed cross-entropy)/d(logits) = scale x (softmax - one_hot(target)), 0 on ignored rows,
    in the logits' dtype; fp32 until the one rounding."""
    grad = logits.float().sub_(lse.unsqueeze(1)).exp_()
    valid = (targets != -1).unsqueeze(1)
    grad.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -valid.float())
    return grad.mul_(valid * scale).to(logits.dtype)


class LossKernels(NamedTuple):
    forward: Callable  # cross_entropy_sum
    backward: Callable  # cross_entropy_grad


# eager mode runs the two over this many rows at a time: their fp32 temporaries are then (rows x vocab), not
# (tokens x vocab) (GPT-2 at 12 x 1024 tokens: 0.2 GiB each, not 2.3); compiled, each is one fused pass
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
    """F.cross_entropy(F.linear(x, weight).float(), targets, ignore_index=-1) with the matmuls in `dtype`,
    as autocast runs them. Keeps the logits in `dtype` and one fp32 log-sum-exp per token (autograd's
    own keeps fp32 log-probabilities), x in `dtype`, and the weight itself (cast again in the backward,
    as FrozenLinear does). kernels: the two elementwise passes, eager or compiled (Transformer.compile_loss)."""

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


# -----------------------------------------------------------------------------


@dataclass
class TransformerConfig:
    # Plain types only: the config is stored as dataclasses.asdict() inside
    # checkpoints that are read back with torch.load(weights_only=True).
    arch: str = 'gpt2'  # 'gpt2' or 'llama'
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 0  # 0 -> n_head; fewer gives LLaMA grouped-query attention
    n_embd: int = 768
    mlp_hidden: int = 0  # 0 -> 4*n_embd (gpt2) or the LLaMA 8/3 rule (llama)
    dropout: float = 0.0
    bias: bool = True  # gpt2 only: biases in Linears and LayerNorms
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # gpt2's MLP: 'exact' (erf) GELU, nanoGPT's and every scratch run's; 'tanh', the approximation
    # GPT-2's own weights were trained with (hf.py sets it for imported GPT-2 checkpoints)
    gelu: str = 'exact'
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
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.arch == 'llama':
            if (self.n_embd // self.n_head) % 2 != 0:
                raise ValueError("rotary embeddings need an even head dimension")
            self.bias = False  # LLaMA has no biases anywhere
        if self.mlp_hidden == 0:
            if self.arch == 'gpt2':
                self.mlp_hidden = 4 * self.n_embd
            else:  # LLaMA: 2/3 of 4*d keeps SwiGLU's 3 matrices at the cost of 2
                self.mlp_hidden = 256 * math.ceil(int(2 * 4 * self.n_embd / 3) / 256)


# LLaMA sizes follow GaLore's pre-training configs. GaLore trained all of them
# with a sequence length of 256, so that is the default here, 7b included;
# override with config_from_preset('llama-7b', block_size=2048) for longer contexts.
# the config fields that give the weights their shapes (train.py's keys of the same names), and what a preset
# sets: those, the vocabulary and the architecture's constants
SHAPE_KEYS = ('arch', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'mlp_hidden', 'bias')
PRESET_KEYS = (*SHAPE_KEYS, 'vocab_size', 'norm_eps', 'rope_theta')
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


def check_arch(arch):
    """The one check of the arch key (train.py's config checks it too, before anything is built)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be {' or '.join(map(repr, ARCHS))}, got {arch!r}")


def check_preset(name):
    """The one check of a preset name (train.py's preset key, the benchmarks' --preset)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


def config_from_preset(name: str, **overrides) -> TransformerConfig:
    check_preset(name)
    return TransformerConfig(**{**PRESETS[name], **overrides})


def causal_attention(q, k, v, dropout):
    """Causal scaled dot-product attention of (B, heads, T, head_dim) queries, keys and values, the
    heads concatenated back to (B, T, C). Keys and values may have fewer heads (grouped-query).
    With a KV cache the keys and values hold S >= T positions, the queries the last T of them."""
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


def rotate_half(x):
    # HF's half-split convention, so LLaMA checkpoints could be imported unpermuted
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    # rotate in fp32: bf16 angles lose precision at large positions
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)


class Rotary(nn.Module):
    """LLaMA's rotary position embedding: the cos and sin of every position's angles, (block_size,
    head_dim) tables that LlamaAttention applies to queries and keys. Derived data: non-persistent
    buffers, outside the state_dict, computed on the device of the buffers (meta stays meta)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim, self.theta = config.n_embd // config.n_head, config.rope_theta
        self.register_buffer('cos', torch.empty(config.block_size, self.head_dim), persistent=False)
        self.register_buffer('sin', torch.empty(config.block_size, self.head_dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self, block_size=None):
        """(Re)compute the tables in fp32, for block_size positions (default: as many as now)."""
        device, block_size = self.cos.device, block_size or self.cos.size(0)
        inv_freq = 1.0 / (
            self.theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim)
        )
        t = torch.arange(block_size, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # registered names: they stay buffers

    def forward(self, T, start=0):
        """The tables of positions start .. start + T - 1 (start > 0: generation with a KV cache)."""
        return self.cos[start : start + T], self.sin[start : start + T]


class LlamaAttention(nn.Module):
    """LLaMA's attention: rotary positions on q and k, grouped-query attention when n_kv_head < n_head."""

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
    """GELU MLP for gpt2."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.approximate = 'tanh' if config.gelu == 'tanh' else 'none'

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class SwiGLU(nn.Module):
    """Gated SiLU MLP for llama."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up_proj = Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down_proj = Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


def make_norm(config):
    """RMSNorm for llama, LayerNorm (with a bias when config.bias) for gpt2."""
    if config.arch == 'llama':
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """A pre-norm residual block, x + attention(norm(x)) then x + mlp(norm(x)), with the parts of
    config.arch. The two halves are methods of their own (infra/memory_options.py can recompute them apart)."""

    def __init__(self, config):
        super().__init__()
        llama = config.arch == 'llama'
        self.ln_1 = make_norm(config)
        self.attn = LlamaAttention(config) if llama else GPT2Attention(config)
        self.ln_2 = make_norm(config)
        self.mlp = SwiGLU(config) if llama else MLP(config)

    def forward(self, x, rope=None):
        x = self.attention_part(x, rope)
        return self.mlp_part(x)

    def attention_part(self, x, rope=None, cache=None):
        return x + self.attn(self.ln_1(x), rope, cache)

    def mlp_part(self, x):
        return x + self.mlp(self.ln_2(x))


class KVCache:
    """The keys and values every attention layer computed for the positions seen so far, so that a
    generation step runs the model on its new token only (Transformer.generate). One per generate call: it
    holds max_len positions of one batch."""

    def __init__(self, n_layer, max_len):
        self.max_len = max_len
        self.layers = [LayerCache(max_len) for _ in range(n_layer)]

    @property
    def length(self):
        """Positions held (by every layer, between forwards)."""
        return self.layers[0].length


class LayerCache:
    """One attention layer's keys and values, (B, kv_heads, max_len, head_dim) buffers filled from the left."""

    def __init__(self, max_len):
        self.max_len, self.length, self.k, self.v = max_len, 0, None, None

    def append(self, k, v):
        """Store the keys and values (B, kv_heads, T, head_dim) of T new positions; return those of all
        positions so far. GQA keeps its n_kv_head heads: the cache is n_head / n_kv_head times smaller."""
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
        # positions: GPT-2 adds a learned embedding to the tokens', LLaMA rotates queries and keys
        self.wpe = None if llama else nn.Embedding(config.block_size, config.n_embd)
        self.rotary = Rotary(config) if llama else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = make_norm(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # weight tying as in GPT-2; LLaMA keeps a separate head unless its checkpoint ties them
            self.wte.weight = self.lm_head.weight
        self.loss_kernels = EAGER_LOSS_KERNELS  # compile_loss() replaces them
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """(Re)initialise all parameters and buffers in place.

        Called by __init__; call it again after `model.to_empty(device=...)` when
        the model was built on the meta device (to_empty leaves garbage memory).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, Rotary)):
                module.reset_parameters()
        for pn, p in self.named_parameters():
            if pn.endswith(_RESIDUAL_PROJ):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def outer_modules(self) -> dict[str, nn.Module]:
        """Everything outside `blocks`; the head is listed even when tied to the embedding."""
        out = {'embed': self.wte}
        if self.wpe is not None:
            out['pos'] = self.wpe
        out['norm'] = self.ln_f
        out['head'] = self.lm_head
        return out

    def get_num_params(self, non_embedding=True):
        """
        Return the number of parameters in the model (parameters() dedupes the tied head).
        With non_embedding, lookup-only tables are subtracted since they cost no FLOPs:
        the position embedding for gpt2 (its tied token embedding is the head's matmul),
        an untied token embedding (llama's, unless its checkpoint ties it to the head).
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:
                n_params -= self.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n_params -= self.wte.weight.numel()
        return n_params

    def forward(self, idx, targets=None):
        """With targets (training/evaluation): (None, mean cross-entropy). The full logits are not
        returned: a caller's `_, loss = model(X, Y)` would keep (tokens x vocab) floats alive until
        its next forward. Without targets: (logits of the last position, None), as in nanoGPT;
        `model.lm_head(model.hidden_states(idx))` gives every position's logits."""
        x = self.hidden_states(idx)
        if targets is None:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            return self.lm_head(x[:, [-1], :]), None  # note: using list [-1] to preserve the time dim
        return None, self.head_loss(x, targets)

    def hidden_states(self, idx, cache=None):
        """The final-norm output (b, t, n_embd) that the head turns into logits. With a KVCache
        (generate), idx holds the t positions that follow the cache's, and their keys and values join it."""
        b, t = idx.size()
        start = 0 if cache is None else cache.length  # the position of idx[:, 0]
        if start + t > self.config.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {start + t}, block size is only {self.config.block_size}"
            )
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
        # the blocks' halves, called directly: a block's forward may be wrapped for training (infra/memory_options.py)
        else:
            for block, layer_cache in zip(self.blocks, cache.layers):
                x = block.mlp_part(block.attention_part(x, rope, layer_cache))
        return self.ln_f(x)

    def head_loss(self, x, targets):
        """Mean cross-entropy of the head on hidden states x against targets (-1 = ignored).
        memory_options.apply's loss_chunk computes it a chunk of tokens at a time."""
        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        weight = self.lm_head.weight
        dtype = autocast_dtype(x.device.type) or (weight.dtype if weight.element_size() < 4 else None)
        if dtype is None:  # fp32 logits
            return F.cross_entropy(self.lm_head(x), targets, ignore_index=-1)
        # low-precision logits: their cross-entropy in fp32 math, without an fp32 copy of them (LinearCrossEntropy)
        return LinearCrossEntropy.apply(x, weight, targets, dtype, self.loss_kernels)

    def compile_loss(self, **kwargs):
        """torch.compile the cross-entropy of low-precision logits (compile=True; kwargs go to torch.compile):
        each direction one fused pass over the logits instead of several eager ones."""
        self.loss_kernels = LossKernels(*(torch.compile(f, **kwargs) for f in (cross_entropy_sum, cross_entropy_grad)))

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size if necessary
        # e.g. we may load the GPT2 pretrained model checkpoint (block size 1024)
        # but want to use a smaller block size for some smaller, simpler model
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if self.wpe is not None:
            self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])
        else:
            self.rotary.reset_parameters(block_size)

    def estimate_flops_per_token(self):
        """Training FLOPs per token as the model is frozen now (nanoGPT's 6N + attention, after
        PaLM appendix B). A matmul weight costs 2 FLOPs per token forward, 2 for its input
        gradient and 2 for its weight gradient. Walking up from the embedding: blocks below
        every trainable parameter run forward only (2N, a third of the attention); from the
        first block with a trainable parameter (or above a trainable wte/wpe) on, a trainable
        weight costs 6 and a frozen one 4. Block granularity: the input gradient a bottom block's
        first layer skips is still counted. The embedding lookup is not a matmul."""
        cfg = self.config
        attention = 12 * cfg.n_embd * cfg.block_size  # per layer, forward + backward
        trains = lambda module: module is not None and any(p.requires_grad for p in module.parameters())
        backward = trains(self.wte) or trains(self.wpe)  # does anything at or below here train?
        flops = 0
        for block in self.blocks:
            params = list(block.parameters())
            backward = backward or trains(block)
            if backward:
                flops += sum((6 if p.requires_grad else 4) * p.numel() for p in params) + attention
            else:
                flops += 2 * sum(p.numel() for p in params) + attention // 3
        backward = backward or trains(self.ln_f)
        head = self.lm_head.weight
        return flops + (6 if head.requires_grad else 4 if backward else 2) * head.numel()

    def fsdp_sharded(self):
        """Whether FSDP2 shards the blocks (distributed.shard_fsdp): their weights are then gathered by
        hooks on their forward, which the cached generation (it calls the blocks' halves) would skip."""
        if not torch.distributed.is_available():
            return False
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.blocks[0], FSDPModule)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, use_cache=True):
        """
        Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        Most likely you'll want to make sure to be in model.eval() mode of operation for this.

        use_cache: keep the keys and values of past positions (KVCache) and run the model on the
        new token only, the same tokens as without (greedy decoding, top_k=1, picks them alike; see
        tests/test_generate.py). Once the sequence outgrows block_size each step runs the last
        block_size tokens afresh, as without a cache: the window then slides at every step, changing
        each kept token's position and context, which cached keys cannot follow. FSDP-sharded models
        generate without a cache.
        """
        block_size = self.config.block_size
        cache = None
        if use_cache and idx.size(1) <= block_size and not self.fsdp_sharded():
            cache = KVCache(self.config.n_layer, min(block_size, idx.size(1) + max_new_tokens))
        for _ in range(max_new_tokens):
            if cache is not None and idx.size(1) <= block_size:
                # the cache holds every position but the newest token's (at the first step: none, the prompt)
                x = self.hidden_states(idx[:, cache.length :], cache)
                logits = self.lm_head(x[:, [-1], :])
            else:
                # if the sequence context is growing too long we must crop it at block_size
                idx_cond = idx if idx.size(1) <= block_size else idx[:, -block_size:]
                logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
