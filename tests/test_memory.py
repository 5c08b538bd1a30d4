"""infra/memory_options.py: the memory options (activation checkpointing, offload, chunked loss), and model.py's frozen
Linear; each must leave the numbers as they are and keep less."""

import math
import os
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import memory_options  # noqa: E402
from model import EMULATED_AUTOCAST, Linear, Transformer  # noqa: E402

torch.set_num_threads(1)  # the CPU is shared; tiny models don't need more

from conftest import TINY_MODELS as TINY  # noqa: E402
from conftest import random_batch as batch  # noqa: E402
from conftest import tiny_model_config as tiny  # noqa: E402


@pytest.mark.parametrize('arch', ['gpt2', 'llama'])
def test_activation_checkpointing_matches(arch):
    torch.manual_seed(0)
    cfg = TINY[arch]()
    model = Transformer(cfg).train()
    x, y = batch(cfg)

    def run():
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_ref, grads_ref = run()
    memory_options.apply(model, activation_checkpointing=True)
    loss_ckpt, grads_ckpt = run()
    assert torch.allclose(loss_ref, loss_ckpt)
    for n in grads_ref:
        assert torch.allclose(grads_ref[n], grads_ckpt[n], atol=1e-6), n


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
    model = Transformer(cfg).train()
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
    model = Transformer(cfg).train()
    x, y = batch(cfg)
    y[0, 3:] = -1  # ignored targets, across chunk boundaries and filling whole chunks
    # each case against the unchunked loss: all trainable, frozen head (no dW), only the head (no dx)
    for case in ('all', 'head frozen', 'head only'):
        if case == 'head frozen':
            model.lm_head.requires_grad_(False)
        elif case == 'head only':
            model.requires_grad_(False)
            model.lm_head.requires_grad_(True)
        memory_options.apply(model)
        loss_ref, grads_ref = run_grads(model, x, y)
        memory_options.apply(model, loss_chunk=chunk)
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
    model = Transformer(cfg).train()
    x, y = batch(cfg)
    y[0, 3:] = -1
    with torch.autocast('cpu', torch.bfloat16):
        loss_ref, grads_ref = run_grads(model, x, y)
        memory_options.apply(model, loss_chunk=7)
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
    model = Transformer(cfg)
    n, chunk, C, V = 64, 16, cfg.n_embd, cfg.vocab_size
    x = torch.randn(n, C, requires_grad=True)
    y = torch.randint(0, V, (n,))
    grads = (n + V) * C * 4  # dx and dW
    chunk_bytes = chunk * V * 4

    def measure(loss_chunk):
        memory_options.apply(model, loss_chunk=loss_chunk)
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
    exclude = {
        t.untyped_storage().data_ptr()
        for t in tree_leaves((list(module.parameters()), args))
        if isinstance(t, torch.Tensor)
    }
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
    model = Transformer(cfg)
    block = model.blocks[0]
    T = cfg.block_size
    x = torch.randn(2, T, cfg.n_embd, requires_grad=True)
    rope = model.rotary(T) if arch == 'llama' else None
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
    model = Transformer(cfg)
    block = model.blocks[0].requires_grad_(False)
    T = cfg.block_size
    x = torch.randn(2, T, cfg.n_embd, requires_grad=True)
    rope = model.rotary(T) if arch == 'llama' else None

    def run():
        x.grad = None
        with torch.autocast('cpu', torch.bfloat16):
            saved = saved_activation_bytes(block, x, rope)
            out = block(x, rope)
        out.float().square().sum().backward()
        return saved, x.grad

    saved, dx = run()
    monkeypatch.setattr(Linear, 'forward', torch.nn.Linear.forward)  # autograd's own linear
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
    model = Transformer(cfg).train()
    x, y = batch(cfg)
    for ckpt, chunk in ((False, 0), (True, 0), (False, 7), (True, 7)):
        memory_options.apply(model, activation_checkpointing=ckpt, loss_chunk=chunk)
        loss_ref, grads_ref = run_grads(model, x, y)
        memory_options.apply(model, activation_checkpointing=ckpt, loss_chunk=chunk, activation_offload=True)
        loss, grads = run_grads(model, x, y)
        assert torch.equal(loss, loss_ref)
        assert grads.keys() == grads_ref.keys()
        assert all(torch.equal(grads[n], grads_ref[n]) for n in grads), (ckpt, chunk)

    memory_options.apply(model)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss_ref, grads_ref = run_grads(model, x, y)
    activations = [t for t in saved if not memory_options.is_weight(t)]
    views = {(id(t.untyped_storage()), t.storage_offset(), t.shape, t.stride()) for t in activations}

    monkeypatch.setattr(memory_options.OffloadActivations, 'keep_on', ())
    copies = []
    memory_options.apply(model, activation_offload=True)
    with memory_options.offload_copies(
        'cpu', lambda t: copies.append(memory_options.to_host(t)) or copies[-1], memory_options.to_device
    ):
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
    model = Transformer(cfg).train()
    model.blocks[1].requires_grad_(False)  # frozen weights are saved too (for the input gradient)
    x, y = batch(cfg)
    shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape[::-1]) for p in model.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
            model(x, y)
    labels = [(tuple(t.shape), tuple(t.shape) in shapes, memory_options.is_weight(t)) for t in saved]
    assert [l for l in labels if l[1] != l[2]] == []
    assert any(l[1] for l in labels) and not all(l[1] for l in labels)
    if autocast:
        assert any(t.dtype == torch.bfloat16 and tuple(t.shape) in shapes for t in saved)


def test_chunked_loss_sums_a_bf16_weight_gradient_in_fp32():
    """Pure bf16 (no autocast): the head's weight gradient is summed over the chunks in fp32 and
    rounded to bf16 once (memory_options.VOCAB_SLICES slices of the vocabulary at a time), so its error
    against fp32 arithmetic on the same bf16 numbers stays that of the unchunked head however many
    chunks there are; summed in bf16, every chunk would round the running sum and the error would
    grow with their number. The input gradient, summed over the slices in fp32, keeps the unchunked
    head's error too."""
    torch.manual_seed(0)
    n, C, V = 2048, 32, 256
    x = torch.randn(n, C).bfloat16()
    weight = (0.1 * torch.randn(V, C)).bfloat16()
    y = torch.randint(0, V, (n,))
    y[::5] = -1  # ignored targets
    ref_x, ref_w = x.float().requires_grad_(), weight.float().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(ref_x, ref_w), y, ignore_index=-1)
    ref_loss.backward()

    def errors(chunks):
        xs, w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunks == 1:  # the unchunked head, as Transformer.head_loss computes it
            loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(xs, w).float(), y, ignore_index=-1)
        else:
            loss = memory_options.ChunkedLinearCE.apply(xs, w, y, n // chunks)
        loss.backward()
        assert w.grad.dtype == xs.grad.dtype == torch.bfloat16
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=0)
        return [
            ((g.float() - ref.grad).norm() / ref.grad.norm()).item() for g, ref in ((w.grad, ref_w), (xs.grad, ref_x))
        ]

    (w1, x1), (w16, x16), (w128, x128) = (errors(chunks) for chunks in (1, 16, 128))
    assert w1 > 0 and x1 > 0  # bf16 rounding is there to be compared
    # each chunk's product is still rounded to bf16 before the fp32 sum: a bounded extra error, the
    # same for 16 chunks as for 128 (summed in bf16: 0.0052 at 16 chunks, 0.0131 at 128, 5 times unchunked)
    assert w128 <= 1.2 * w16 and w128 <= 2 * w1, (w1, w16, w128)
    assert max(x16, x128) <= 1.5 * x1, (x1, x16, x128)


# -----------------------------------------------------------------------------
# memory_estimate.check_fits under FSDP: the estimate of one rank, not of one device


def test_check_fits_under_fsdp_counts_this_ranks_shards(monkeypatch):
    """An iteration whose weights, gradients and AdamW state need 10 GiB on one device, with 1 GiB of
    activations, on ranks with 4 GiB free: refused on one device and under DDP (every rank holds all),
    accepted under FSDP over 8 ranks (about 10/8 + 1 GiB, plus the units gathered at once)."""
    import memory_estimate

    cfg = tiny('llama', n_layer=8)
    gib = 2**30
    row = dict(params=2 * gib, grads=2 * gib, optimizer=6 * gib, others=gib)
    row['peak'] = sum(row.values())
    monkeypatch.setattr(memory_estimate, 'available_bytes', lambda device: 4 * gib)
    # the model's 4-byte weights are tiny: make them count as over a quarter of the free memory
    bytes_per_weight = gib // sum(p.numel() for p in Transformer(cfg).parameters()) + 1
    calls = []

    def estimate():
        calls.append(1)
        return row

    for world_size, fsdp in ((1, False), (8, False), (1, True)):
        with pytest.raises(ValueError, match=r'an iteration needs about 11\.0 GiB \(meta-device estimate\)'):
            memory_estimate.check_fits(cfg, 'cpu', bytes_per_weight, estimate, world_size=world_size, fsdp=fsdp)
    memory_estimate.check_fits(cfg, 'cpu', bytes_per_weight, estimate, world_size=8, fsdp=True)
    assert len(calls) == 4
    block, root = memory_estimate.unit_params(cfg)
    peak = memory_estimate.per_rank_peak(row, cfg, 8, True, bytes_per_weight)
    assert peak == int(10 * gib / 8 + gib + (2 * root + 3 * block) * bytes_per_weight) < 4 * gib
    # over 2 ranks each still holds 5 GiB of shards: refused, and the message says per rank
    with pytest.raises(ValueError, match=r'needs about 6\.\d GiB per rank of 2 under FSDP'):
        memory_estimate.check_fits(cfg, 'cpu', bytes_per_weight, estimate, world_size=2, fsdp=True)
    # a bare number (one device's peak) cannot be split: no refusal under FSDP, as before without it
    memory_estimate.check_fits(cfg, 'cpu', bytes_per_weight, lambda: row['peak'], world_size=8, fsdp=True)
    with pytest.raises(ValueError, match='meta-device estimate'):
        memory_estimate.check_fits(cfg, 'cpu', bytes_per_weight, lambda: row['peak'])


def test_train_hands_check_fits_the_estimated_row(tmp_path, monkeypatch):
    """train.py gives check_fits estimate_iteration's row, not its peak alone: only a row can be split into one
    rank's share under FSDP (a bare number skips the check there, as the test above shows)."""
    from conftest import TINY as TRAIN_TINY

    import train

    seen = []

    def check_fits(config, device, bytes_per_weight, estimate=None, world_size=1, fsdp=False):
        seen.append(estimate())
        raise ValueError('refused here')

    monkeypatch.setattr(train, 'check_fits', check_fits)
    assert train.main([*TRAIN_TINY, f'--out_dir={tmp_path / "run"}', '--max_iters=2']) == 1
    assert isinstance(seen[0], dict) and {'params', 'grads', 'optimizer', 'others', 'peak'} <= set(seen[0]), seen


def test_unit_params_and_the_estimate_of_one_device():
    from conftest import train_defaults

    import builder
    import memory_estimate
    from model import TransformerConfig

    train_cfg = train_defaults(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=64, batch_size=2)
    cfg = TransformerConfig(**builder.transformer_kwargs(train_cfg))
    model = Transformer(cfg)
    block, root = memory_estimate.unit_params(cfg)
    assert block == sum(p.numel() for p in model.blocks[0].parameters())
    assert root + 3 * block == sum(p.numel() for p in model.parameters())  # a tied head counted once
    row = memory_estimate.estimate_iteration(train_cfg)
    assert row['params'] == 4 * sum(p.numel() for p in model.parameters())
    assert (
        memory_estimate.per_rank_peak(row, cfg) == memory_estimate.per_rank_peak(row, cfg, 4, fsdp=False) == row['peak']
    )
    assert memory_estimate.per_rank_peak(row, cfg, 4, fsdp=True) < memory_estimate.per_rank_peak(row, cfg, 2, fsdp=True)


def test_meta_estimate_takes_the_frozen_linear_path_of_cuda(monkeypatch):
    """Under CUDA autocast a frozen block's Linears go through FrozenLinear and keep no bf16 copy of
    their weights; the meta device has no autocast, so MetaAsCuda tells model.Linear it emulates
    one (model.EMULATED_AUTOCAST). Without that seam the amp estimate counts one bf16 copy of every
    frozen block's matrices more, and the loss's fp32 log-probabilities; the bf16 precision (no autocast) does
    not change."""
    import bench_memory
    import memory_estimate
    from configurator import configure

    small = dict(
        preset='',
        arch='gpt2',
        bias=True,
        n_layer=6,
        n_head=4,
        n_embd=64,
        vocab_size=512,
        block_size=32,
        batch_size=2,
        micro_batches=1,
        omgd_gamma=2,
        device='meta',
        methods='lisa_wor,full',
        precisions='amp,bf16',
    )

    def estimate():
        rows = bench_memory.run({**configure(bench_memory.DEFAULTS, []), **small})['rows']
        return {(r['method'], r['precision']): r['peak'] for r in rows}

    cuda_path = estimate()
    assert EMULATED_AUTOCAST == {}  # set only while the mode is on
    monkeypatch.setattr(memory_estimate.MetaAsCuda, 'follow_cuda_linear', False)
    without = estimate()
    frozen_blocks = 6 - 2
    matrices = 64 * 3 * 64 + 64 * 64 + 2 * 64 * 4 * 64  # c_attn, attention c_proj, c_fc, MLP c_proj
    # the loss of bf16 logits follows CUDA too (model.LinearCrossEntropy keeps no fp32 log-probabilities), for
    # every method alike
    head = without[('full', 'amp')] - cuda_path[('full', 'amp')]
    assert head > 0
    assert without[('lisa_wor', 'amp')] - cuda_path[('lisa_wor', 'amp')] == frozen_blocks * matrices * 2 + head
    for key in (('lisa_wor', 'bf16'), ('full', 'bf16')):
        assert without[key] == cuda_path[key], key


def test_cuda_allocator_sets_expandable_segments_unless_the_user_chose():
    environ = {}
    line = memory_options.cuda_allocator(environ)
    assert environ == {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'} and 'expandable_segments:True' in line
    for name in ('PYTORCH_CUDA_ALLOC_CONF', 'PYTORCH_ALLOC_CONF'):
        environ = {name: 'max_split_size_mb:128'}
        line = memory_options.cuda_allocator(environ)
        assert environ == {name: 'max_split_size_mb:128'} and line.endswith('max_split_size_mb:128 (set by you)')
