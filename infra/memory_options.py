"""The model's memory options (apply: activation checkpointing, activation offload, chunked loss), its regional
compilation (compile_blocks) and the CUDA allocator's setting. None changes a parameter name, the state_dict or
what the model computes (up to the order of sums in the chunked loss) (docs/memory.md)."""

import os
import weakref
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from configurator import at_least, check_rule

RULES = {'loss_chunk': at_least(0, '>= 0 tokens (0: the whole micro-batch at once)')}
VOCAB_SLICES = 8  # a low-precision head's dW is summed in fp32 an eighth of the vocabulary at a time
# grad_fn chains from a saved tensor back to a parameter through these are weights, not activations
_WEIGHT_VIEWS = {'TBackward0', 'ToCopyBackward0', 'ViewBackward0', 'TransposeBackward0', 'PermuteBackward0'}
_WEIGHT_VIEWS |= {'ExpandBackward0', 'UnsafeViewBackward0', 'AliasBackward0'}
OFFLOAD_COPIES = {}  # device type -> the (to_host, to_device) used instead of this module's, set by offload_copies


def apply(model, activation_checkpointing=False, checkpoint_sublayers=False, activation_offload=False, loss_chunk=0):
    """Set the memory options of a Transformer, replacing any earlier choice; returns the model. Each shadows one
    method (a block's forward, the model's forward, head_loss) by an instance attribute: the module stays ordinary."""
    check_rule('loss_chunk', loss_chunk, RULES['loss_chunk'])
    model.memory_options = {k: v for k, v in locals().items() if k != 'model'}  # what was applied: the arguments
    for block in model.blocks:
        forward = partial(checkpointed_forward, block, checkpoint_sublayers)
        _shadow(block, 'forward', forward if activation_checkpointing else None)
    _shadow(model, 'forward', partial(offloaded_forward, model) if activation_offload else None)
    _shadow(model, 'head_loss', partial(chunked_head_loss, model, loss_chunk) if loss_chunk > 0 else None)
    return model


def compile_blocks(model, *, per_tensor=False, **kwargs):
    """compile=True: each block compiled on its own (kwargs go to torch.compile), after apply and FSDP; returns
    the model. A graph per requires_grad pattern: a block meets two, a whole model one per switch. per_tensor
    (2^tensors patterns): modules that hold parameters run eagerly, the graphs hold what lies between them."""
    for block in model.blocks:
        if per_tensor:
            for module in block.modules():
                if next(module.parameters(recurse=False), None) is not None and 'forward' not in vars(module):
                    module.forward = torch.compiler.disable(module.forward)
        block.compile(**kwargs)
    model.compile_loss(**kwargs)  # the cross-entropy of low-precision logits, its own region
    return model


def cuda_allocator(environ=os.environ):
    """Expandable segments for the CUDA allocator (memory freed at a switch is reused whatever the sizes) unless the
    user set one; call before CUDA's first allocation. Returns the log's line."""
    for name in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'):
        if environ.get(name):
            return f"CUDA allocator: {name}={environ[name]} (set by you)"
    environ['PYTORCH_CUDA_ALLOC_CONF'] = setting = 'expandable_segments:True'
    return f"CUDA allocator: {setting} (set PYTORCH_CUDA_ALLOC_CONF to choose otherwise)"


def _shadow(module, name, method):
    """module.<name> = method over the class's method; None removes a shadow set before."""
    vars(module).pop(name, None)
    if method is not None:
        setattr(module, name, method)


def checkpointed_forward(block, sublayers, x, rope=None):
    """The block's forward, its activations recomputed in the backward. sublayers: attention and MLP apart (half a
    block's activations at a time). block.eval() runs the plain forward."""
    if not block.training:
        return type(block).forward(block, x, rope)
    if sublayers:
        x = checkpoint(block.attention_part, x, rope, use_reentrant=False)
        return checkpoint(block.mlp_part, x, use_reentrant=False)
    return checkpoint(type(block).forward, block, x, rope, use_reentrant=False)


def offloaded_forward(model, idx, targets=None):
    """The model's forward with the tensors saved for the backward in host memory (OffloadActivations)."""
    with OffloadActivations() if torch.is_grad_enabled() else nullcontext():
        return type(model).forward(model, idx, targets)


def chunked_head_loss(model, chunk, x, targets):
    """The model's head_loss `chunk` tokens at a time (ChunkedLinearCE)."""
    x, targets = x.reshape(-1, x.size(-1)), targets.reshape(-1)
    if chunk >= x.size(0):
        return type(model).head_loss(model, x, targets)
    return ChunkedLinearCE.apply(x, model.lm_head.weight, targets, chunk)


class ChunkedLinearCE(torch.autograd.Function):
    """F.cross_entropy(F.linear(x, weight), targets, ignore_index=-1), `chunk` rows of x at a time (one chunk's logits
    at most); the backward recomputes each chunk's logits and turns them into their gradient in place."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        # the backward redoes the forward's matmuls, so under the autocast state the forward ran in;
        # the weight is cast once, not per chunk (autocast caches no cast of a frozen weight)
        device = x.device.type
        available = torch.amp.is_autocast_available(device)  # meta has no autocast
        ctx.cast = torch.get_autocast_dtype(device) if available and torch.is_autocast_enabled(device) else None
        ctx.autocast = torch.autocast(device, ctx.cast, enabled=ctx.cast is not None) if available else nullcontext()
        vocab = weight.size(0)
        sliced = ctx.needs_input_grad[1] and weight.element_size() < 4
        ctx.rows = -(-vocab // VOCAB_SLICES) if sliced else vocab  # vocabulary rows per backward slice
        w = weight.to(ctx.cast) if ctx.cast else weight
        total, lse = 0, []
        for i in range(0, x.size(0), chunk):
            logits = F.linear(x[i : i + chunk], w).float()
            total = total + F.cross_entropy(logits, targets[i : i + chunk], ignore_index=-1, reduction='sum')
            if sliced:
                lse.append(torch.logsumexp(logits, -1))
        del logits
        count = (targets != -1).sum()
        ctx.save_for_backward(x, weight, targets, count, torch.cat(lse) if sliced else None)
        ctx.chunk = chunk
        return total / count  # the mean over counted tokens, as ignore_index=-1 does

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, targets, count, lse = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        chunk, rows = ctx.chunk, ctx.rows
        sliced = lse is not None
        if need_x:  # summed over the slices in fp32 too
            dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if sliced else torch.empty_like(x)
        if need_w:
            dw = torch.empty_like(weight) if sliced else torch.zeros_like(weight)
        scale = grad / count
        with ctx.autocast:
            w = weight.to(ctx.cast) if ctx.cast else weight
            for r in range(0, w.size(0), rows):
                w_r = w[r : r + rows]
                if need_w:  # sliced: this slice's dW, in fp32 until it is complete
                    dw_r = torch.zeros(w_r.shape, dtype=torch.float32, device=w.device) if sliced else dw
                for i in range(0, x.size(0), chunk):
                    xc, yc = x[i : i + chunk], targets[i : i + chunk]
                    logits = F.linear(xc, w_r)
                    dtype = logits.dtype
                    # d(summed CE)/dlogits = softmax - one_hot(target), 0 on ignored rows; written in place
                    # so a chunk costs 2 (chunk x vocab) buffers at most (autograd's cross-entropy backward, 5)
                    if sliced:  # the slice's columns of the softmax
                        dlogits = logits.float().sub_(lse[i : i + chunk, None]).exp_()
                    else:
                        dlogits = torch.softmax(logits, -1, dtype=torch.float32)
                    del logits
                    valid = (yc != -1).unsqueeze(1)
                    col = yc - r  # the target's column in this slice, if it is in it
                    hit = valid & ((col >= 0) & (col < w_r.size(0))).unsqueeze(1)
                    dlogits.scatter_add_(1, col.clamp(0, w_r.size(0) - 1).unsqueeze(1), -hit.float())
                    dlogits = dlogits.mul_(valid * scale).to(dtype)
                    if need_x:
                        if sliced:
                            dx[i : i + chunk] += dlogits.mm(w_r)
                        else:
                            dx[i : i + chunk] = dlogits.mm(w_r)
                    if need_w:
                        if dlogits.dtype == xc.dtype == dw_r.dtype:
                            dw_r.addmm_(dlogits.t(), xc)  # in place: no weight-sized product
                        else:  # autocast or sliced: the product in bf16, its sum in fp32
                            dw_r += dlogits.t().mm(xc)
                    del dlogits  # before the next chunk's logits exist
                if need_w and sliced:
                    dw[r : r + rows] = dw_r  # the one rounding of this slice of dW
        return (dx.to(x.dtype) if need_x else None), (dw if need_w else None), None, None


def is_weight(t):
    """A parameter, a view of one, or (autocast) a cast of a trainable one: it outlives the backward anyway."""
    if isinstance(t._base if t._base is not None else t, nn.Parameter):
        return True
    fn = t.grad_fn
    while fn is not None and fn.name() in _WEIGHT_VIEWS:
        fn = fn.next_functions[0][0]
    return fn is not None and fn.name() == 'torch::autograd::AccumulateGrad'


def to_host(t):
    """A saved tensor's copy in host memory: pinned, and asynchronous from CUDA."""
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
    return host.copy_(t, non_blocking=t.is_cuda)


def to_device(host, device):
    return host.to(device, non_blocking=True)


@contextmanager
def offload_copies(device_type, to_host, to_device):
    """While on, OffloadActivations copies tensors of `device_type` with these (meta has no data to copy)."""
    OFFLOAD_COPIES[device_type] = (to_host, to_device)
    try:
        yield
    finally:
        del OFFLOAD_COPIES[device_type]


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """torch.autograd.graph.save_on_cpu less the weights (is_weight) and the duplicates: a view saved twice
    while its storage lives is copied once (log_softmax's and nll_loss's)."""

    keep_on = ('cpu',)  # device types whose tensors are in host memory already

    def __init__(self):
        self.copies = {}  # (storage, view) -> (weak reference to the storage, host copy)
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        if t.device.type in self.keep_on or is_weight(t):
            return t
        st = t.untyped_storage()
        key = (id(st), t.storage_offset(), t.shape, t.stride(), t.dtype)
        hit = self.copies.get(key)
        if hit is None or hit[0]() is not st:
            # forgotten when the storage dies, so a later storage at the same id never matches
            hit = (
                weakref.ref(st, lambda _, key=key: self.copies.pop(key, None)),
                OFFLOAD_COPIES.get(t.device.type, (to_host, to_device))[0](t),
            )
            self.copies[key] = hit
        return t.device, hit[1]

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return OFFLOAD_COPIES.get(device.type, (to_host, to_device))[1](host, device)
