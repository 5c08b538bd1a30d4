"""
Cost of a layer switch under DDP: train.py drops its DistributedDataParallel wrapper and builds a
new one over the parameters that train after the switch (wrap_ddp, whose docstring
says why a rebuild beats one wrapper plus a hand-written all-reduce).

$ torchrun --standalone --nproc_per_node=2 experiments/bench_ddp_switch.py                        # GPT-2 124M
$ torchrun --standalone --nproc_per_node=2 experiments/bench_ddp_switch.py --preset=tiny --gamma=2

It runs on the CPU with gloo (the ranks' processes on one machine); there is no GPU/NCCL path.

For several LISA-wor switches this times, as the slowest rank sees it:
- switch:  cycler.step (requires_grad flags) plus dropping the old wrapper (its reducer, hooks and
           buckets) and building the new one with wrap_ddp, as train.py does
           (init_sync=False after the first wrapper);
- first:   the first forward+backward after the switch, in which DDP re-orders its buckets;
- steady:  the next forward+backward, for comparison;
- reduce:  one all_reduce of as many float32 elements as there are active ones, which is what the
           steady backward communicates (and, once, of all the model's elements, for comparison).
Rank 0 prints one row per switch and the medians.
"""

import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's modules
import omgd  # noqa: E402
from configurator import at_least, command_line  # noqa: E402
from infra import distributed  # noqa: E402
from infra.distributed import wrap_ddp  # noqa: E402
from model import Transformer, TransformerConfig, config_from_preset  # noqa: E402

DEFAULTS = dict(preset='gpt2', gamma=3, switches=5, batch_size=1, block_size=64)
MEANINGS = dict(
    preset="a model.py preset, or 'tiny' (the tests' 4x32 model)",
    gamma='active blocks per period (the GPT-2 config: 3 of 12)',
    switches='switches timed',
)
RULES = {k: at_least(1) for k in ('gamma', 'switches', 'batch_size', 'block_size')}
args = SimpleNamespace(**command_line(sys.argv[1:], DEFAULTS, RULES, __doc__, MEANINGS))

ranks, _ = distributed.setup('gloo', 'cpu')
if not ranks.enabled:
    raise SystemExit(
        "error: run under torchrun, e.g. torchrun --standalone --nproc_per_node=2 experiments/bench_ddp_switch.py"
    )
rank, world = ranks.rank, ranks.world_size
torch.manual_seed(0)
if args.preset == 'tiny':
    config = TransformerConfig(n_layer=4, n_head=2, n_embd=32, block_size=args.block_size, vocab_size=80)
else:
    config = config_from_preset(args.preset, block_size=args.block_size, vocab_size=50304)
model = Transformer(config)
opt = torch.optim.SGD(model.parameters(), lr=0.0)  # never stepped: only there for build_cycler's check
cycler = omgd.build_cycler(model, opt, omgd.CyclerConfig('lisa_wor', gamma=args.gamma, period=1))
x = torch.randint(config.vocab_size, (args.batch_size, args.block_size))


def slowest(seconds):
    """Milliseconds on the slowest rank (a collective step waits for it)."""
    t = torch.tensor(seconds * 1000)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(fn):
    dist.barrier()
    t = time.perf_counter()
    fn()
    return slowest(time.perf_counter() - t)


def forward_backward():
    _, loss = ddp(x, x)
    loss.backward()
    for p in model.parameters():
        p.grad = None


ddp = None
rows = []
for i in range(args.switches + 1):

    def switch():
        global ddp
        cycler.step(i)
        ddp = None  # the last reference: the old reducer goes now
        ddp = wrap_ddp(model, ranks, 'cpu', init_sync=(i == 0))

    cost = timed(switch)
    first, steady = timed(forward_backward), timed(forward_backward)
    active = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flat = torch.zeros(active)
    reduce = timed(lambda: dist.all_reduce(flat))
    if i > 0:  # the first wrapper also broadcasts the weights; train.py pays that once per run
        rows.append((cycler.active, active, cost, first, steady, reduce))

total = sum(p.numel() for p in model.parameters())
flat = torch.zeros(total)
reduce_all = statistics.median(timed(lambda: dist.all_reduce(flat)) for _ in range(3))
if rank == 0:
    print(
        f"{args.preset}: {total / 1e6:.1f}M parameters, LISA-wor gamma={args.gamma} of {config.n_layer}, "
        f"{world} ranks, gloo, batch {args.batch_size}x{args.block_size}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank"
    )
    print(
        "| active blocks | active params | switch (ms) | first fwd+bwd (ms) | steady fwd+bwd (ms) | "
        "all_reduce of the active grads (ms) |"
    )
    print("|---|---|---|---|---|---|")
    for blocks, active, cost, first, steady, reduce in rows:
        print(f"| {blocks} | {active / 1e6:.2f}M | {cost:.1f} | {first:.1f} | {steady:.1f} | {reduce:.1f} |")
    med = [statistics.median(r[k] for r in rows) for k in (2, 3, 4, 5)]
    print(f"| median | | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {med[3]:.1f} |")
    print(f"all_reduce of all {total / 1e6:.2f}M elements, as without layer cycling: {reduce_all:.1f} ms (median of 3)")
distributed.teardown(ranks)  # a barrier, then destroy_process_group (infra/distributed.py: why)
