"""Everything torchrun brings: Ranks and the loop's collectives, joining and leaving the process group, the model
the Trainer runs and syncs (ParallelModel: DDP rebuilt at every switch, or FSDP2), full-state checkpoints of it."""

import contextlib
import datetime
import gc
import inspect
import json
import os
import re
import sys
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

SILENT_RANK_WAIT_S = 3  # report_error: a rank that leaves the line to another exits this much later
_last_barrier = []  # teardown's barrier work, kept until the process exits


@dataclass
class Ranks:
    """Who this process is. `enabled`: launched by torchrun (RANK is set), with a process group."""

    enabled: bool = False
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    cpu_group: object = None

    @property
    def master(self):
        return self.rank == 0

    def gather(self, obj):
        """A list of `obj` from every rank (in rank order), on every rank."""
        if not self.enabled:
            return [obj]
        objs = [None] * self.world_size
        dist.all_gather_object(objs, obj, group=self.cpu_group)
        return objs

    def any(self, flag):
        """True on every rank when `flag` is true on any rank (an all_reduce(MAX) on the CPU group)."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor(float(flag))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return t.item() > 0

    def mean(self, value, device):
        """The mean of a Python float over ranks (on the compute device's group)."""
        if not self.enabled:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / self.world_size


def setup(backend, device, timeout_s=600):
    """Join torchrun's process group when RANK is set: (Ranks, this rank's device). timeout_s: a collective's wait."""
    if int(os.environ.get('RANK', -1)) == -1:
        return Ranks(), device
    if backend == 'nccl' and not (device.startswith('cuda') and torch.cuda.is_available()):
        raise ValueError(
            f"backend=nccl needs CUDA GPUs and this run's device is {device!r}"
            f"{'' if torch.cuda.is_available() else ' (torch finds no CUDA GPU here)'}: pass "
            f"--backend=gloo to train on CPUs"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, timeout=timeout, **attempt_store(timeout))
    local_rank = int(os.environ['LOCAL_RANK'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    # control messages (stop flag, RNG states, ddp_check) go over a CPU group: a GPU flag read each step stalls the GPU
    cpu_group = dist.new_group(backend='gloo', timeout=timeout) if backend != 'gloo' else dist.group.WORLD
    return Ranks(True, dist.get_rank(), local_rank, dist.get_world_size(), cpu_group), device


def report_error(error, printed=True):
    """End a run in its `error:` line (printed unless another rank prints it); returns the exit status, 1. Under
    torchrun the line also goes to this rank's error file, the root cause of torchrun's failure summary."""
    line = f"error: {error}"
    if printed:
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if path:
        with contextlib.suppress(OSError), open(path, 'w') as f:  # on OSError: the line was printed
            json.dump({'message': line, 'timestamp': int(time.time())}, f)
        if not printed:  # torchrun stops every worker at the first exit: the rank that prints the line exits first
            time.sleep(SILENT_RANK_WAIT_S)
    return 1


def check_same_config(ranks, cfg):
    """A ValueError naming the first key unlike rank 0's (another seed trains apart silently, a max_iters hangs)."""
    configs = ranks.gather(cfg)  # [cfg] in one process
    for rank, other in enumerate(configs[1:], 1):
        for key in sorted(set(configs[0]) | set(other)):
            if other.get(key) != configs[0].get(key):
                raise ValueError(
                    f"rank {rank} was given {key}={other.get(key)!r} and rank 0 {key}="
                    f"{configs[0].get(key)!r}: every rank must run the same command and config"
                )


def attempt_store(timeout):
    """init_process_group's store, rank and world size for a restart by torchrun, else {} (env://): torchrun's agent
    store outlives restarts, where a rank would read a dead rank's address ('connectFullMesh failed'): a prefix each."""
    env = os.environ
    attempt = env.get('TORCHELASTIC_RESTART_COUNT')
    if attempt is None or env.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return {}  # not torchrun's agent store: a new store every launch, nothing stale in it
    world_size = int(env['WORLD_SIZE'])
    store = dist.TCPStore(env['MASTER_ADDR'], int(env['MASTER_PORT']), world_size, is_master=False, timeout=timeout)
    return dict(store=dist.PrefixStore(f'attempt_{attempt}', store), rank=int(env['RANK']), world_size=world_size)


def lost_rank(error):
    """Whether `error` is a collective that failed because another rank is stuck (timeout) or gone."""
    lost = r'[Tt]imed out|Connection (closed|reset) by peer|Broken pipe|NCCL communicator was aborted'
    return isinstance(error, RuntimeError) and dist.is_initialized() and re.search(lost, str(error)) is not None


def teardown(ranks):
    """Leave the process group, on every rank (a barrier). destroy_process_group alone can SIGABRT: a gloo thread
    freeing the last collective's work at exit dies in a noexcept destructor; the barrier's work is kept till then."""
    if not ranks.enabled:
        return
    work = dist.barrier(group=ranks.cpu_group, async_op=True)
    work.wait()
    _last_barrier[:] = [work]
    dist.destroy_process_group()


class ParallelModel:
    """What the Trainer runs and syncs: `model` is wrap_ddp's wrapper, rebuilt by on_switch(), or the model itself
    (FSDP2, resharded; one process). switches, old_wrapper, wrapper_in_gc_cycle: for ddp_check."""

    def __init__(self, raw_model, ranks, device_type, fsdp):
        self.raw_model, self.ranks, self.device_type, self.fsdp = raw_model, ranks, device_type, fsdp
        self.model = self.rebuild_ms = None  # rebuild_ms: the last DDP rebuild's
        self.switches, self.old_wrapper, self.wrapper_in_gc_cycle = 0, None, False

    def on_switch(self):
        if self.fsdp:
            self.model = reshard_fsdp(self.raw_model)  # FSDP2 reduce-scatters only the gradients that exist
        else:
            self.old_wrapper = weakref.ref(self.model) if self.ranks.enabled and self.model is not None else None
            self.model = None  # the last reference: its reducer's hooks and buckets go before the new ones exist
            self.wrapper_in_gc_cycle = self.old_wrapper is not None and self.old_wrapper() is not None
            if self.wrapper_in_gc_cycle:
                gc.collect()  # free its buckets before the new wrapper allocates (ddp_check verifies this)
            t = time.time()
            self.model = wrap_ddp(self.raw_model, self.ranks, self.device_type, init_sync=self.old_wrapper is None)
            self.rebuild_ms = (time.time() - t) * 1000
        self.switches += 1

    def sync(self, last):
        """Gradient sync on the last micro-step only."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
        else:
            self.model.require_backward_grad_sync = last

    @property
    def wrapper(self):  # the DDP wrapper, or None (one process, or FSDP, where the model itself is sharded)
        return self.model if self.ranks.enabled and not self.fsdp else None


def wrap_ddp(model, ranks, device_type, init_sync):
    """DDP over the parameters that train now (frozen blocks: no bucket, no communication); with init_sync=False a
    local rebuild of milliseconds (results/ddp_switch_cost.md). No buffer sync: the RoPE tables are constants."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not ranks.enabled:
        return model
    device_ids = [ranks.local_rank] if device_type == 'cuda' else None
    return DDP(model, device_ids=device_ids, init_sync=init_sync, gradient_as_bucket_view=True, **no_buffer_sync(DDP))


def no_buffer_sync(ddp_class):
    """DDP's keyword that turns off buffer broadcasts: forward_sync_buffers from torch 2.13, else broadcast_buffers."""
    if 'forward_sync_buffers' in inspect.signature(ddp_class.__init__).parameters:
        return {'forward_sync_buffers': False}
    return {'broadcast_buffers': False}


def fsdp_units(model):
    """The FSDP units of shard_fsdp, in sharding order: every block, then the root."""
    return [*model.blocks, model]


def reshard_fsdp(model):
    """At every switch, before the next forward: after a forward without backward (an evaluation) FSDP2's root
    keeps its gathered weights with their old requires_grad (a frozen root parameter would still train)."""
    for unit in fsdp_units(model):
        unit.reshard()
    return model


def shard_fsdp(model, ranks, device_type, param_dtype):
    """FSDP2 in place, one unit per block and the root; before the optimizer, the cycler and any compile.
    param_dtype: None (fp32) or the dtype of the gathered weights; gradients are reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (ranks.world_size,))
    mp = MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
    for unit in fsdp_units(model):  # the blocks first: the root's unit holds what they leave
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    # FSDP2 fixes each unit's gradient dtype at its lazy init from the parameters that then require grad: a unit
    # frozen then (a resume's first forward) would later get bf16 gradients for its fp32 shards. Now all train.
    model._get_fsdp_state()._lazy_init()
    return model


def param_names(model, optimizer):
    """Names of the optimizer's parameters in param_groups order, torch.optim's numbering (tied: its first name)."""
    names = {p: name for name, p in model.named_parameters()}
    return [names[p] for group in optimizer.param_groups for p in group['params']]


def numbered(state_dict, names):
    """An optimizer state dict keyed by parameter name, keyed as torch.optim's: by each name's position in `names`."""
    number = {name: i for i, name in enumerate(names)}
    return {
        'state': dict(sorted((number[name], s) for name, s in state_dict['state'].items())),
        'param_groups': [{**g, 'params': [number[name] for name in g['params']]} for g in state_dict['param_groups']],
    }


def full_state_dicts(model, optimizer):
    """(model, optimizer) full state dicts on rank 0's CPU (else empty), numbered as in one process; a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    return model_sd, numbered(optim_sd, param_names(model, optimizer)) if optim_sd else optim_sd


def load_optimizer_state(model, optimizer, state_dict):
    """Load a full torch.optim-format state dict (every rank passes it) into a sharded model's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names, options = param_names(model, optimizer), StateDictOptions(full_state_dict=True, strict=False)
    by_name = {
        'state': {names[i]: s for i, s in state_dict['state'].items()},
        'param_groups': [{**g, 'params': [names[i] for i in g['params']]} for g in state_dict['param_groups']],
    }
    # strict=False: frozen parameters may have no state; torch 2.9 still looks up every trainable one's (a KeyError)
    params = [p for g in optimizer.param_groups for p in g['params']]
    missing = [p for i, p in enumerate(params) if i not in state_dict['state']]
    stateless = [p for p in missing if p.requires_grad]
    for p in stateless:
        p.requires_grad_(False)
    try:
        set_optimizer_state_dict(model, optimizer, by_name, options=options)
    finally:
        for p in stateless:
            p.requires_grad_(True)
    # it creates state for every trainable parameter: a later one starts its state as in an uninterrupted run
    for p in missing:
        optimizer.state.pop(p, None)
