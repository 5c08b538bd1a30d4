"""`--ddp_check=True`: layer cycling's invariants under DDP or FSDP2, compared across ranks after every optimizer step
(slow): active set, weights' SHA-256, counted collectives, the old DDP wrapper, frozen weights, gradients, state."""

import hashlib
import math

import torch
import torch.distributed as dist


class Checker:
    """With `parallel` (ParallelModel), the Trainer's observer: on_switch after each rebuild, check after every
    optimizer step (CheckFailed on every rank alike). fsdp_units: distributed.fsdp_units, or None (DDP, one process)."""

    def __init__(self, ranks, model, fsdp_units=None, parallel=None):
        self.ranks, self.model, self.fsdp_units = ranks, model, fsdp_units
        self.parallel, self.summary, self.switches_seen = parallel, None, 0
        self.comm = {'calls': 0, 'elements': 0} if fsdp_units else [0]
        for unit in fsdp_units or ():
            unit.set_custom_reduce_scatter(CountedReduceScatter(self.comm))
        self.old_wrapper, self.wrapper_in_gc_cycle, self.frozen_snapshot = None, False, []

    def on_switch(self, wrapper, old_wrapper=None, wrapper_in_gc_cycle=False):
        """After a switch, before the next forward: counts the new DDP `wrapper`'s all-reduces (None: no DDP)."""
        self.old_wrapper, self.wrapper_in_gc_cycle = old_wrapper, wrapper_in_gc_cycle
        if self.fsdp_units is None:
            self.comm = [0]  # all-reduces this step
            if wrapper is not None:
                wrapper.register_comm_hook(self.comm, counted_allreduce)
        self.frozen_snapshot = [
            (p, local_shard(p).detach().clone()) for p in self.model.parameters() if not p.requires_grad
        ]

    def check(self, wrapper, optimizer, cycler, state_policy):
        """After the optimizer step, gradients in place: (problems, summary) on every rank (a collective)."""
        ranks, comm, fsdp = self.ranks, self.comm, self.fsdp_units is not None
        params = list(self.model.parameters())  # deduplicated: the tied head is the embedding
        active = [p for p in params if p.requires_grad]
        weights = hashlib.sha256()
        for p in params:  # FSDP: the full weights, all-gathered (a collective, same order on every rank)
            full = p.full_tensor() if fsdp else p
            weights.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        frozen_untouched = all(torch.equal(local_shard(p), copy) for p, copy in self.frozen_snapshot)
        grads_where_active = all((p.grad is not None) == p.requires_grad for p in params)
        state_where_active = state_policy != 'drop' or {id(p) for p in optimizer.state} <= {id(p) for p in active}
        report = {
            'active': cycler.active,
            'weights': weights.hexdigest(),
            'the previous DDP wrapper is freed': self.old_wrapper is None or self.old_wrapper() is None,
            'by reference counting, without gc.collect()': not self.wrapper_in_gc_cycle,
            'frozen parameters are untouched': frozen_untouched,
            'gradients exist exactly for the active parameters': grads_where_active,
            'optimizer state exists only for the active parameters': state_where_active,
            'active elements': sum(p.numel() for p in active),
            'comm elements': None,
        }
        if wrapper is not None:
            buckets = wrapper.reducer._get_zeros_like_grad_buckets()
            report['DDP buckets hold exactly the active parameters'] = {
                id(p) for b in buckets for p in b.parameters()
            } == {id(p) for p in active}
            report['comm elements'] = sum(b.buffer().numel() for b in buckets)
            report['bucket elements == active elements'] = report['comm elements'] == report['active elements']
            report['one all-reduce per bucket per step'] = comm[0] == len(buckets)
            comm[0] = 0
        elif fsdp:
            # FSDP2 pads each parameter's first dimension to a multiple of the world size
            world = ranks.world_size
            padded = sum(math.ceil(p.shape[0] / world) * world * p[0].numel() if p.dim() else 1 for p in active)
            seen, units_with_active = set(), 0
            for unit in self.fsdp_units:  # the blocks first: the root's own parameters are those left
                own = [p for p in unit.parameters() if id(p) not in seen]
                seen.update(id(p) for p in own)
                units_with_active += any(p.requires_grad for p in own)
            if world == 1 and comm['calls'] == 0:  # newer FSDP2 skips one rank's reduce-scatter (2.9 runs it)
                padded = units_with_active = 0
            report['comm elements'] = comm['elements']
            report['reduce-scattered elements == padded active elements'] = comm['elements'] == padded
            report['one reduce-scatter per FSDP unit with active parameters per step'] = (
                comm['calls'] == units_with_active
            )
            comm['calls'] = comm['elements'] = 0
        reports = ranks.gather(report)
        problems = [k for k, v in report.items() if isinstance(v, bool) and not all(r[k] for r in reports)]
        problems += [f"ranks differ in {k}" for k in ('active', 'weights') if any(r[k] != report[k] for r in reports)]
        if fsdp:
            kind, sent = 'fsdp', f"reduce-scattered {report['comm elements']} (padded)"
            once = 'one reduce-scatter per unit with active parameters'
            last = 'optimizer state only for active parameters'
        else:
            kind, sent = 'ddp', f"DDP buckets {report['comm elements']}"
            once, last = 'one all-reduce per bucket', 'old wrapper freed'
        return problems, (
            f"{kind} check: {ranks.world_size} ranks agree on active {report['active']} and weights sha256 "
            f"{report['weights'][:16]}; {report['active elements']} active elements, {sent}; {once}; "
            f"frozen untouched, no frozen gradients, {last}"
        )

    def after_switch(self, trainer, switched):
        parallel = self.parallel
        if parallel.switches != self.switches_seen:  # rebuilt for this iteration
            self.switches_seen = parallel.switches
            self.on_switch(parallel.wrapper, parallel.old_wrapper, parallel.wrapper_in_gc_cycle)

    def before_zero_grad(self, trainer):
        cfg = trainer.cfg
        problems, self.summary = self.check(self.parallel.wrapper, trainer.optimizer, trainer.cycler, cfg['omgd_state'])
        if problems:
            raise CheckFailed('; '.join(problems))


def counted_allreduce(counter, bucket):
    """DDP's default all-reduce (its reference hook), counted: accumulation communicates on the last micro-step."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    counter[0] += 1
    return allreduce_hook(None, bucket)


class CountedReduceScatter:
    """FSDP2's reduce-scatter, counting calls and elements: only active gradients, on the last micro-step."""

    def __new__(cls, counter):
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        class Counted(ReduceScatter):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                counter['calls'] += 1
                counter['elements'] += input_tensor.numel()
                # reduce_scatter_single from torch 2.13, which deprecates reduce_scatter_tensor (2.9 to 2.12)
                collective = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor
                return collective(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

        return Counted()


def local_shard(t):  # this rank's shard of an FSDP parameter
    return t.to_local() if hasattr(t, 'to_local') else t


class CheckFailed(RuntimeError):
    """An invariant did not hold on every rank; the message lists what failed."""
