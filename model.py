"""
GPT-2 and LLaMA language models in one file, in the spirit of nanoGPT.

The layout is what layer cycling (OMGD / LISA-wor) relies on: the transformer
blocks live in `model.blocks` so a sampler can freeze/unfreeze them by index,
and everything outside the blocks is reachable through `model.outer_modules()`.

References:
1) nanoGPT: https://github.com/karpathy/nanoGPT/blob/master/model.py
2) LLaMA (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention)
3) GaLore's LLaMA pre-training configs (sizes in PRESETS below)
"""

import math
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
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

    def __post_init__(self):
        if self.arch not in ('gpt2', 'llama'):
            raise ValueError(f"arch must be 'gpt2' or 'llama', got {self.arch!r}")
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
_LLAMA = dict(arch='llama', vocab_size=32000, block_size=256, bias=False, norm_eps=1e-6)
_GPT2 = dict(arch='gpt2', vocab_size=50257, block_size=1024, bias=True)
PRESETS: dict[str, dict] = {
    'gpt2':        dict(_GPT2, n_layer=12, n_head=12, n_embd=768),    # 124M
    'gpt2-medium': dict(_GPT2, n_layer=24, n_head=16, n_embd=1024),   # 350M
    'gpt2-large':  dict(_GPT2, n_layer=36, n_head=20, n_embd=1280),   # 774M
    'gpt2-xl':     dict(_GPT2, n_layer=48, n_head=25, n_embd=1600),   # 1558M
    'llama-60m':   dict(_LLAMA, n_layer=8, n_head=8, n_embd=512, mlp_hidden=1376),
    'llama-130m':  dict(_LLAMA, n_layer=12, n_head=12, n_embd=768, mlp_hidden=2048),
    'llama-350m':  dict(_LLAMA, n_layer=24, n_head=16, n_embd=1024, mlp_hidden=2736),
    'llama-1b':    dict(_LLAMA, n_layer=24, n_head=32, n_embd=2048, mlp_hidden=5461),
    'llama-7b':    dict(_LLAMA, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008),
}


def config_from_preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return GPTConfig(**{**PRESETS[name], **overrides})


def rotate_half(x):
    # HF's half-split convention, so LLaMA checkpoints could be imported unpermuted
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    # rotate in fp32: bf16 angles lose precision at large positions
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)


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
        weight, = ctx.saved_tensors
        dx = torch.matmul(grad.to(ctx.dtype), weight.to(ctx.dtype)) if ctx.needs_input_grad[0] else None
        return dx, None, None, None


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) that routes a frozen layer under autocast through
    FrozenLinear."""

    def forward(self, x):
        device = x.device.type
        if (not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)
                and torch.is_grad_enabled() and torch.amp.is_autocast_available(device)
                and torch.is_autocast_enabled(device)):
            return FrozenLinear.apply(x, self.weight, self.bias, torch.get_autocast_dtype(device))
        return super().forward(x)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.is_llama = config.arch == 'llama'
        if self.is_llama:
            # separate q/k/v: GQA makes k/v narrower, and GaLore projects each matrix
            kv_dim = self.n_kv_head * self.head_dim
            self.q_proj = Linear(config.n_embd, config.n_embd, bias=False)
            self.k_proj = Linear(config.n_embd, kv_dim, bias=False)
            self.v_proj = Linear(config.n_embd, kv_dim, bias=False)
            self.o_proj = Linear(config.n_embd, config.n_embd, bias=False)
        else:
            # fused q/k/v matches GPT-2's checkpoint layout (from_pretrained)
            self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope=None):
        B, T, C = x.size()
        if self.is_llama:
            q = self.q_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        else:
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # only ask for GQA when needed, so plain MHA keeps every SDPA backend available
        gqa = {'enable_gqa': True} if self.n_kv_head != self.n_head else {}
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0,
            is_causal=True, **gqa)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.o_proj(y) if self.is_llama else self.c_proj(y))


class MLP(nn.Module):
    """GELU MLP for gpt2."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


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
    if config.arch == 'llama':
        return nn.RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = make_norm(config)
        self.mlp = SwiGLU(config) if config.arch == 'llama' else MLP(config)

    def forward(self, x, rope=None):
        x = self.attention_part(x, rope)
        return self.mlp_part(x)

    def attention_part(self, x, rope=None):
        return x + self.attn(self.ln_1(x), rope)

    def mlp_part(self, x):
        return x + self.mlp(self.ln_2(x))


class ChunkedLinearCE(torch.autograd.Function):
    """F.cross_entropy(F.linear(x, weight), targets, ignore_index=-1), `chunk` rows of x at a time,
    so that at most one chunk of (chunk x vocab) logits exists, in forward and backward. Saves x,
    weight and targets only; the backward recomputes each chunk's logits (one more head matmul),
    turns them into their gradient in place and adds its dx and dW into one buffer each.
    torch.utils.checkpoint per chunk recomputes the same, but autograd then sums one weight-sized
    gradient per chunk: 3 weight-sized buffers at its peak (GPT-2's head, 512 tokens in chunks of
    64: 444 MiB, against 173 MiB here and 295 MiB unchunked)."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        # the backward redoes the forward's matmuls, so under the autocast state the forward ran in;
        # the weight is cast once, not per chunk (autocast caches no cast of a frozen weight)
        device = x.device.type
        available = torch.amp.is_autocast_available(device)  # meta has no autocast
        ctx.cast = torch.get_autocast_dtype(device) if available and torch.is_autocast_enabled(device) else None
        ctx.autocast = torch.autocast(device, ctx.cast, enabled=ctx.cast is not None) if available else nullcontext()
        w = weight.to(ctx.cast) if ctx.cast else weight
        total = 0
        for i in range(0, x.size(0), chunk):
            logits = F.linear(x[i:i + chunk], w)
            total = total + F.cross_entropy(logits.float(), targets[i:i + chunk], ignore_index=-1, reduction='sum')
        del logits
        count = (targets != -1).sum()
        ctx.save_for_backward(x, weight, targets, count)
        ctx.chunk = chunk
        return total / count  # the mean over counted tokens, as ignore_index=-1 does

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, targets, count = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        dx = torch.empty_like(x) if need_x else None
        dw = torch.zeros_like(weight) if need_w else None
        scale = grad / count
        with ctx.autocast:
            w = weight.to(ctx.cast) if ctx.cast else weight
            for i in range(0, x.size(0), ctx.chunk):
                xc, yc = x[i:i + ctx.chunk], targets[i:i + ctx.chunk]
                logits = F.linear(xc, w)
                dtype = logits.dtype
                # d(summed CE)/dlogits = softmax - one_hot(target), 0 on ignored rows; written in place
                # so a chunk costs 2 (chunk x vocab) buffers at most (autograd's cross-entropy backward, 5)
                dlogits = torch.softmax(logits, -1, dtype=torch.float32)
                del logits
                valid = (yc != -1).unsqueeze(1)
                dlogits.scatter_add_(1, yc.clamp(min=0).unsqueeze(1), -valid.float())
                dlogits = dlogits.mul_(valid * scale).to(dtype)
                if need_x:
                    dx[i:i + ctx.chunk] = dlogits.mm(w)
                if need_w:
                    if dlogits.dtype == xc.dtype == dw.dtype:
                        dw.addmm_(dlogits.t(), xc)  # in place: no chunk-sized dW
                    else:  # autocast: the product is in the compute dtype
                        dw += dlogits.t().mm(xc)
                del dlogits  # before the next chunk's logits exist
        return dx, dw, None, None


# grad_fn chains from a saved tensor back to a parameter through these are weights, not activations
_WEIGHT_VIEWS = {'TBackward0', 'ToCopyBackward0', 'ViewBackward0', 'TransposeBackward0', 'PermuteBackward0',
                 'ExpandBackward0', 'UnsafeViewBackward0', 'AliasBackward0'}


def _is_weight(t):
    """A parameter, a view of one, or (autocast) a cast of a trainable one: it outlives the backward
    anyway, so offloading it would only copy every weight to the host and back each micro-batch."""
    if isinstance(t._base if t._base is not None else t, nn.Parameter):
        return True
    fn = t.grad_fn
    while fn is not None and fn.name() in _WEIGHT_VIEWS:
        fn = fn.next_functions[0][0]
    return fn is not None and fn.name() == 'torch::autograd::AccumulateGrad'


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """torch.autograd.graph.save_on_cpu, less the weights and the duplicates: tensors saved for the
    backward are copied to host memory (pinned and asynchronous from CUDA) and back when the backward
    needs them. Weights stay where they are (save_on_cpu copies them all: 471.5 MiB of GPT-2's per
    micro-batch, each way), and a view saved twice while its storage lives is copied once
    (cross-entropy's log-probabilities are saved by log_softmax and nll_loss)."""

    keep_on = ('cpu',)  # device types whose tensors are in host memory already

    def __init__(self):
        self.copies = {}  # (storage, view) -> (weak reference to the storage, host copy)
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        if t.device.type in self.keep_on or _is_weight(t):
            return t
        st = t.untyped_storage()
        key = (id(st), t.storage_offset(), t.shape, t.stride(), t.dtype)
        hit = self.copies.get(key)
        if hit is None or hit[0]() is not st:
            # forgotten when the storage dies, so a later storage at the same id never matches
            hit = weakref.ref(st, lambda _, key=key: self.copies.pop(key, None)), self.to_host(t)
            self.copies[key] = hit
        return t.device, hit[1]

    @staticmethod
    def to_host(t):
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
        return host.copy_(t, non_blocking=t.is_cuda)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)


# weights that write into the residual stream get the GPT-2 1/sqrt(2L) scaling
_RESIDUAL_PROJ = ('attn.c_proj.weight', 'mlp.c_proj.weight', 'o_proj.weight', 'down_proj.weight')


class GPT(nn.Module):

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.is_llama = config.arch == 'llama'
        # memory options, off by default (not in GPTConfig: they change no weight and a resume may flip them)
        self.activation_checkpointing: bool = False
        # with checkpointing: recompute attention and MLP apart, so the backward holds half a block's
        # activations at a time, at the cost of saving the input of each half (pair with activation_offload)
        self.checkpoint_sublayers: bool = False
        # tensors saved for the backward go to host memory (OffloadActivations) during a forward with grad
        self.activation_offload: bool = False
        # >0: head + loss this many tokens at a time, each chunk's logits recomputed in the backward
        # (ChunkedLinearCE), so the (tokens x vocab) logits never exist all at once
        self.loss_chunk: int = 0

        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if self.is_llama else nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = make_norm(config)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if not self.is_llama:
            # weight tying as in GPT-2; LLaMA keeps a separate head
            self.wte.weight = self.lm_head.weight
        self.init_weights()

    def _build_rope(self):
        # buffers are derived data: non-persistent so they stay out of the state_dict;
        # created on the device of the weights so a meta build stays allocation-free
        device = self.wte.weight.device
        hd = self.config.n_embd // self.config.n_head
        inv_freq = 1.0 / (self.config.rope_theta ** (
            torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        t = torch.arange(self.config.block_size, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer('rope_cos', emb.cos(), persistent=False)
        self.register_buffer('rope_sin', emb.sin(), persistent=False)

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
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                module.reset_parameters()
        for pn, p in self.named_parameters():
            if pn.endswith(_RESIDUAL_PROJ):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        if self.is_llama:
            self._build_rope()

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
        the untied token embedding for llama.
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if self.wpe is not None:
                n_params -= self.wpe.weight.numel()
            if self.is_llama:
                n_params -= self.wte.weight.numel()
        return n_params

    def forward(self, idx, targets=None):
        """With targets (training/evaluation): (None, mean cross-entropy). The full logits are not
        returned: a caller's `_, loss = model(X, Y)` would keep (tokens x vocab) floats alive until
        its next forward. Without targets: (logits of the last position, None), as in nanoGPT;
        `model.lm_head(model.hidden_states(idx))` gives every position's logits."""
        offload = self.activation_offload and torch.is_grad_enabled()
        with OffloadActivations() if offload else nullcontext():
            x = self.hidden_states(idx)
            if targets is None:
                # inference-time mini-optimization: only forward the lm_head on the very last position
                return self.lm_head(x[:, [-1], :]), None  # note: using list [-1] to preserve the time dim
            return None, self.head_loss(x, targets)

    def hidden_states(self, idx):
        """The final-norm output (b, t, n_embd) that the head turns into logits."""
        b, t = idx.size()
        if t > self.config.block_size:
            raise ValueError(f"cannot forward a sequence of length {t}, "
                             f"block size is only {self.config.block_size}")
        x = self.wte(idx)  # (b, t, n_embd)
        rope = None
        if self.is_llama:
            rope = (self.rope_cos[:t], self.rope_sin[:t])
        else:
            x = x + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            if self.activation_checkpointing and self.training and self.checkpoint_sublayers:
                x = checkpoint(block.attention_part, x, rope, use_reentrant=False)
                x = checkpoint(block.mlp_part, x, use_reentrant=False)
            elif self.activation_checkpointing and self.training:
                # recompute activations in backward: trades ~1/3 more compute for memory
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        return self.ln_f(x)

    def head_loss(self, x, targets):
        """Mean cross-entropy of the head on hidden states x against targets (-1 = ignored),
        loss_chunk tokens at a time when loss_chunk > 0."""
        x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
        n, chunk = x.size(0), self.loss_chunk
        if chunk <= 0 or chunk >= n:
            # in fp32 also for bf16 weights: a bf16 loss is rounded to 3 significant digits
            return F.cross_entropy(self.lm_head(x).float(), targets, ignore_index=-1)
        return ChunkedLinearCE.apply(x, self.lm_head.weight, targets, chunk)

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size if necessary
        # e.g. we may load the GPT2 pretrained model checkpoint (block size 1024)
        # but want to use a smaller block size for some smaller, simpler model
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        if self.wpe is not None:
            self.wpe.weight = nn.Parameter(self.wpe.weight[:block_size])
        else:
            self._build_rope()

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        if model_type not in ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'):
            raise ValueError(f"from_pretrained supports gpt2, gpt2-medium, gpt2-large, gpt2-xl; "
                             f"got {model_type!r}")
        override_args = override_args or {}
        # only dropout can be overridden; everything else must match the checkpoint
        assert all(k == 'dropout' for k in override_args)
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise RuntimeError(f"from_pretrained({model_type!r}) needs Hugging Face transformers: "
                               f"pip install transformers (and the weights in the HF cache "
                               f"or network access)") from None
        try:
            model_hf = GPT2LMHeadModel.from_pretrained(model_type)
        except OSError as e:
            raise RuntimeError(f"could not load {model_type!r} weights: they must be in the "
                               f"Hugging Face cache or downloadable ({e})") from None

        config = config_from_preset(model_type, **override_args)
        model = GPT(config)
        sd = model.state_dict()
        sd_hf = model_hf.state_dict()
        # the HF checkpoint uses Conv1D modules, whose weights are transposed w.r.t. nn.Linear
        transposed = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
        loaded = set()
        for k_hf, w in sd_hf.items():
            if k_hf.endswith(('.attn.masked_bias', '.attn.bias')):
                continue  # causal-mask buffers, not parameters
            k = k_hf.removeprefix('transformer.')
            if k.startswith('h.'):
                k = 'blocks.' + k[2:]
            if k not in sd:
                raise RuntimeError(f"unexpected key {k_hf!r} in the Hugging Face checkpoint")
            w = w.t() if k.endswith(transposed) else w
            if w.shape != sd[k].shape:
                raise RuntimeError(f"shape mismatch for {k}: {tuple(w.shape)} vs {tuple(sd[k].shape)}")
            with torch.no_grad():
                sd[k].copy_(w)
            loaded.add(k)
        # the tied head may be listed under either name; they share storage
        missing = set(sd) - loaded - {'lm_head.weight', 'wte.weight'}
        if missing or not loaded & {'lm_head.weight', 'wte.weight'}:
            raise RuntimeError(f"Hugging Face checkpoint is missing {sorted(missing)}")
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # frozen parameters are included on purpose: layer cycling unfreezes them later,
        # and an optimizer that never saw them would silently skip those blocks
        groups = param_groups(self, weight_decay)
        extra_args = dict(fused=True) if device_type == 'cuda' else dict()
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **extra_args)

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

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """
        Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        Most likely you'll want to make sure to be in model.eval() mode of operation for this.
        """
        for _ in range(max_new_tokens):
            # if the sequence context is growing too long we must crop it at block_size
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's decay split: matrices and embeddings decay, biases and norm weights don't.

    Every parameter is returned whether or not it currently requires grad
    (parameters() already dedupes the tied embedding/head).
    """
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {'params': decay, 'weight_decay': weight_decay},
        {'params': no_decay, 'weight_decay': 0.0},
    ]
