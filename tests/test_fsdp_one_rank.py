"""FSDP2 on a one-rank gloo group, in this process: what the first CUDA runs (one H200, NCCL, one rank)
hit and the two-rank fp32 runs of tests/test_fsdp.py could not show."""

import itertools
import re

import pytest
import torch
import torch.distributed as dist
from conftest import train_defaults

import builder
from infra import ddp_check, distributed
from infra.distributed import ParallelModel, Ranks, fsdp_units, reshard_fsdp
from trainer import Trainer

CFG = train_defaults(
    n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32, omgd_gamma=1, omgd_period=1, omgd_state='drop'
)


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip('a process group exists already')
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Ranks(True, 0, 0, 1, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def sharded(ranks, param_dtype=None, cfg=CFG):
    torch.manual_seed(0)
    return builder.build(cfg, 'cpu', shard=lambda m: distributed.shard_fsdp(m, ranks, 'cpu', param_dtype))


def test_ddp_check_holds_on_one_fsdp_rank(one_rank):
    """FSDP2 of torch 2.11 (not 2.9) skips the reduce-scatter when there is one rank; the check expected
    one per active unit (`torchrun --nproc_per_node=1 --parallel=fsdp --ddp_check=True` failed at
    iteration 0 on an H200 with torch 2.11)."""
    model, opt, cycler = sharded(one_rank)
    parallel = ParallelModel(model, one_rank, 'cpu', fsdp=True)
    observer = ddp_check.Checker(one_rank, model, fsdp_units(model), parallel)
    x = torch.randint(32, (2, 8))
    trainer = Trainer(
        CFG, model, opt, cycler, itertools.repeat((x, x, None)), 'cpu', parallel=parallel, observer=observer
    )
    for _ in range(4):  # a switch at every iteration
        trainer.step()
    active = int(re.search(r'(\d+) active elements', observer.summary).group(1))
    sent = int(re.search(r'reduce-scattered (\d+) \(padded\)', observer.summary).group(1))
    assert active > 0 and sent in (0, active)  # skipped, or every active element (one rank pads nothing)


def test_mixed_precision_gradients_keep_the_shards_dtype_when_the_first_forward_is_frozen(one_rank):
    """bf16 all-gathers over fp32 shards (train.py's FSDP on CUDA): FSDP2 fixes a unit's gradient dtype
    at its first forward from the parameters that then require grad. A resume's first forward comes
    after the switch, so a frozen unit later got bf16 gradients for fp32 shards (torch 2.11: a
    RuntimeError in the backward; older versions: bf16 gradients in the fp32 optimizer)."""
    model, opt, cycler = sharded(one_rank, torch.bfloat16)
    for block in model.blocks[1:]:  # as a resume's first iteration: only block 0 trains
        block.requires_grad_(False)
    x = torch.randint(32, (2, 8))
    model(x, x)[1].backward()  # FSDP2's lazy init would happen here
    reshard_fsdp(model)
    model.zero_grad(set_to_none=True)
    model.blocks[0].requires_grad_(False)
    model.blocks[3].requires_grad_(True)  # the switch: a block frozen at the first forward trains
    model(x, x)[1].backward()
    grads = [p.grad for p in model.blocks[3].parameters()]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads), {g.dtype for g in grads}


def test_generation_on_sharded_blocks_gives_the_unsharded_models_tokens(one_rank):
    """Under FSDP2 generate() runs uncached (a cached step would skip the hooks that gather a block's weights; it
    ended in a Tensor/DTensor mix): the same greedy tokens as the same weights unsharded, with and without a cache."""
    torch.manual_seed(0)
    plain, _, _ = builder.build(CFG, 'cpu')
    model, _, _ = sharded(one_rank)  # the same seed: the same weights
    prompt = torch.randint(32, (1, 3))
    expected = plain.eval().generate(prompt, 6, top_k=1)
    assert torch.equal(model.eval().generate(prompt, 6, top_k=1), expected)
    assert torch.equal(model.generate(prompt, 6, top_k=1, use_cache=False), expected)
