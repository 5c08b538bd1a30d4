"""
Omni-Masked Gradient Descent (OMGD) and its LLM instance, LISA-wor layer cycling.

Paper: "Omni-Masked Gradient Descent: Memory-Efficient Optimization via Mask Traversal with
Improved Convergence" (Yang, Ren, Jiang, Tian, Peng). Algorithm 1 traverses (mask, sample) pairs without
replacement: a cycle's M masks are disjoint and sum to M * ones, and every mask meets every
sample once. Algorithm 2 (LISA-wor) applies that to transformer blocks: every K iterations,
gamma middle blocks are drawn from a pool of blocks not yet used in this cycle (the pool is
refilled when fewer than gamma remain), the others are frozen, and the gradients of the
active blocks are scaled by N_L / gamma.

Frozen here means what saves memory: requires_grad=False, grad=None, and (policy 'drop') no
optimizer state. Blocks are chosen by their index in model.blocks, never by parameter names,
so nothing changes under DDP or torch.compile.
"""
import math
from typing import NamedTuple

import torch


class Method(NamedTuple):
    unit: str  # what is switched on and off together: 'block' (one of model.blocks) or 'tensor'
    with_replacement: bool  # every period draws afresh (LISA, i.i.d. masks), or cycles (OMGD)
    scaled: bool  # active gradients multiplied by the inverse keep ratio


METHODS = {
    'full': None,
    'lisa': Method('block', with_replacement=True, scaled=False),
    'lisa_scale': Method('block', with_replacement=True, scaled=True),
    'lisa_wor': Method('block', with_replacement=False, scaled=True),
    'lisa_wor_noscale': Method('block', with_replacement=False, scaled=False),
    'tensor_wor': Method('tensor', with_replacement=False, scaled=True),
    'tensor_iid': Method('tensor', with_replacement=True, scaled=True),
}
STATE_POLICIES = ('drop', 'offload', 'keep')
OUTER_PARTS = ('embed', 'pos', 'norm', 'head')

# -----------------------------------------------------------------------------
# Algorithm 1: masks of a cycle and the order of (mask, sample) pairs


def random_partition(n, sizes, generator):
    """Disjoint random groups of range(n) with the given sizes (their sum may be < n)."""
    perm = torch.randperm(n, generator=generator).tolist()
    groups, start = [], 0
    for size in sizes:
        groups.append(sorted(perm[start:start + size]))
        start += size
    return groups


def mask_cycle(d, ratio, generator):
    """The M = ceil(1/ratio) masks of one cycle as an (M, d) tensor.

    Coordinates are split at random into M disjoint groups of near-equal size, and mask j
    is M on group j and 0 elsewhere, so the masks sum to M * ones (the paper's eq. 3).
    """
    M = math.ceil(1 / ratio)
    sizes = [len(c) for c in torch.arange(d).tensor_split(M)]
    masks = torch.zeros(M, d)
    for j, group in enumerate(random_partition(d, sizes, generator)):
        masks[j, group] = M
    return masks


def pair_order(M, N, generator):
    """RandomPermutation([M] x [N]) as an (M*N, 2) tensor of (mask j, sample i) rows."""
    flat = torch.randperm(M * N, generator=generator)
    return torch.stack([flat // N, flat % N], dim=1)


def balanced_partition(sizes, num_groups, generator):
    """Split items at random into num_groups groups of about equal total size.

    Items are visited in random order and each goes to the currently lightest group, so the
    split is random, disjoint and complete, and the groups' sizes differ by at most one item.
    """
    groups, totals = [[] for _ in range(num_groups)], [0] * num_groups
    for i in torch.randperm(len(sizes), generator=generator).tolist():
        lightest = totals.index(min(totals))
        groups[lightest].append(i)
        totals[lightest] += sizes[i]
    return [sorted(g) for g in groups]


def bernoulli_subset(n, ratio, generator):
    """The paper's i.i.d. mask on n items: each kept independently with probability `ratio`.

    An empty draw is redrawn: a period with nothing to train cannot run (backward reaches no
    parameter). That raises P(kept) to r / (1 - (1-r)^n), so UnitMask scales by
    (1 - (1-r)^n) / r, not 1/r: E[S] = 1 exactly for every item (float64: P(u < r) = r to 2^-53).
    """
    while True:
        kept = (torch.rand(n, generator=generator, dtype=torch.float64) < ratio).nonzero().flatten()
        if len(kept):
            return [kept.tolist()]


class GroupSchedule:
    """Hands out one group of units per period.

    Without replacement (OMGD) the groups of a cycle are one random partition of the units,
    used one after the other; when none is left a new cycle draws a new partition. For
    LISA-wor the partition is floor(N_L/gamma) groups of gamma blocks: exactly Algorithm 2's
    pool, whose leftover (< gamma blocks) is dropped by the reset. With replacement (LISA,
    i.i.d. masks) every period draws a fresh partition and uses only its first group.
    peek() tells the next group a period early (for prefetching) without changing the draws.
    partitions_drawn: the cycle number without replacement, the period number with it (key 'cycle').
    """

    def __init__(self, partition, replacement, generator):
        self.partition, self.replacement, self.generator = partition, replacement, generator
        self.pending, self.partitions_drawn = [], 0
        self.ahead = None  # the next partition, when peek() had to draw it early

    def next(self):
        if self.replacement or not self.pending:
            self.pending = self.ahead if self.ahead is not None else self.partition(self.generator)
            self.ahead, self.partitions_drawn = None, self.partitions_drawn + 1
        group = self.pending.pop(0)
        if self.replacement:
            self.pending = []
        return group

    def peek(self):
        """The group next() will return. A partition drawn here is the one next() would draw
        (same generator, same order), so peeking never changes which groups are chosen."""
        if not self.replacement and self.pending:
            return self.pending[0]
        if self.ahead is None:
            self.ahead = self.partition(self.generator)
        return self.ahead[0]

    def state_dict(self):
        return {'pending': self.pending, 'cycle': self.partitions_drawn, 'rng': self.generator.get_state(),
                'ahead': self.ahead}  # the generator has moved past it: a resume must not redraw

    def load_state_dict(self, state):
        self.pending, self.partitions_drawn = [list(g) for g in state['pending']], state['cycle']
        self.ahead = [list(g) for g in state['ahead']] if state.get('ahead') else None  # older: absent
        self.generator.set_state(state['rng'])


# -----------------------------------------------------------------------------
# The mask on a model and its optimizer: freezing, state policies, gradient scale


def check_config(method, gamma, period, warmup, ratio, state_policy, n_units):
    """Raise a one-line ValueError for a configuration that cannot run."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if state_policy not in STATE_POLICIES:
        raise ValueError(f"unknown omgd_state {state_policy!r}; choose one of {', '.join(STATE_POLICIES)}")
    if period <= 0:
        raise ValueError(f"omgd_period must be a positive number of iterations, got {period}")
    if warmup < 0:
        raise ValueError(f"omgd_warmup must be >= 0, got {warmup}")
    if method == 'full':
        return
    if METHODS[method].unit == 'block' and not 0 < gamma <= n_units:
        raise ValueError(f"omgd_gamma must be in 1..{n_units} (the model's number of blocks), got {gamma}")
    if METHODS[method].unit == 'tensor' and not 0 < ratio <= 1:
        raise ValueError(f"omgd_ratio must be in (0, 1], got {ratio}")


class UnitMask:
    """The mask of a method over a model's units (blocks or tensors), drawn by a GroupSchedule:
    freezes and unfreezes the units, sets their optimizer state policy, scales active gradients.

    units: list of parameter lists that are switched on and off together. Parameters in no
    unit are left alone (build_cycler sets which of them train).
    """

    def __init__(self, units, optimizer, method='lisa_wor', gamma=1, period=1, warmup=0,
                 ratio=0.5, state_policy='drop', seed=0):
        check_config(method, gamma, period, warmup, ratio, state_policy, len(units))
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group['params']}
        if any(id(p) not in in_optimizer for unit in units for p in unit):
            # else the blocks frozen when the optimizer was built would never train
            raise ValueError("every parameter layer cycling may activate must be in the optimizer; "
                             "build the optimizer over all parameters before freezing anything")
        self.units, self.optimizer, self.state_policy = units, optimizer, state_policy
        self.method, self.gamma, self.period, self.warmup = method, gamma, period, warmup
        self.active = list(range(len(units)))  # everything trains until the first switch
        self.last_switch, self.scale = -1, 1.0
        self.offloaded = {}  # param -> {state key: original device}
        self.prefetched = {}  # param -> {state key: its copy back, started by prefetch()}
        self.streams, self.events, self.sources = {}, {}, []  # CUDA: per device; pinned tensors being read
        if method == 'full':
            self.schedule = None
            return
        kind, n = METHODS[method], len(units)
        if kind.unit == 'block':
            partition = lambda g: random_partition(n, [gamma] * (n // gamma), g)
            self.scale = n / gamma if kind.scaled else 1.0
        elif kind.with_replacement:  # tensor_iid: each tensor kept with probability r (see bernoulli_subset)
            partition = lambda g: bernoulli_subset(n, ratio, g)
            self.scale = (1 - (1 - ratio) ** n) / ratio
        else:  # tensor_wor: M complementary groups; the masks sum to M * ones
            M = math.ceil(1 / ratio)
            numels = [sum(p.numel() for p in unit) for unit in units]
            partition = lambda g: balanced_partition(numels, M, g)
            self.scale = float(M)
        self.schedule = GroupSchedule(partition, kind.with_replacement, torch.Generator().manual_seed(seed))

    def cycle_note(self):
        """A line for the log when LISA-wor's cycles leave blocks out, else None."""
        k, kind = len(self.units) % self.gamma, METHODS[self.method]
        if self.schedule is None or kind.unit != 'block' or kind.with_replacement or k == 0:
            return None
        return (f"{self.method} with N_L={len(self.units)}, gamma={self.gamma}: N_L mod gamma = {k} random "
                f"block{'s sit' if k > 1 else ' sits'} out each cycle, so a cycle's masks do not sum to "
                f"M x 1 (Algorithm 1 holds only when gamma divides N_L)")

    def _switches_at(self, iter_num):
        if self.schedule is None or iter_num < self.warmup or iter_num == self.last_switch:
            return False
        period_starts = (iter_num - self.warmup) % self.period == 0
        never_switched = self.last_switch < self.warmup  # e.g. a run that starts mid-period
        return period_starts or never_switched

    def step(self, iter_num):
        """Call at the start of every iteration; returns True when the active set changed."""
        if not self._switches_at(iter_num):
            return False
        self.last_switch = iter_num
        self.apply(self.schedule.next())
        return True

    def prefetch(self, iter_num):
        """Call once per iteration, after step(iter_num). On a period's last iteration, draw the next
        group (the same draws step would make) and, under 'offload', start copying its parked state
        back: on a side stream under CUDA, at once elsewhere (the same path on every device)."""
        if not self._switches_at(iter_num + 1):
            return
        group = self.schedule.peek()
        if self.state_policy != 'offload':
            return
        for event in self.events.values():  # the previous copies, done a period ago: free their sources
            event.synchronize()
        self.sources = []
        for p in (p for i in group for p in self.units[i] if p in self.offloaded and p not in self.prefetched):
            self.prefetched[p] = {key: self._copy_back(self.optimizer.state[p][key], device)
                                  for key, device in self.offloaded[p].items()}
        self.events = {device: stream.record_event() for device, stream in self.streams.items()}

    def _copy_back(self, parked, device):
        if device.type != 'cuda':
            return parked.to(device, copy=True)
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        self.sources.append(parked)  # keep the source alive until the copy has read it
        with torch.cuda.stream(self.streams[device]):
            return parked.to(device, non_blocking=True)

    def scaling(self):
        """The gradient scale of the active units (1 during warm-up and for 'full')."""
        return self.scale if self.last_switch >= self.warmup else 1.0  # 'full' never switches

    def apply(self, active):
        """Make exactly the units in `active` trainable and set their optimizer state policy."""
        for device, event in self.events.items():  # the compute stream waits for prefetched copies
            torch.cuda.current_stream(device).wait_event(event)
        self.active = sorted(active)
        active_set = set(self.active)
        for i, unit in enumerate(self.units):
            for p in unit:
                p.requires_grad_(i in active_set)
                if i in active_set:
                    self._restore_state(p)
                else:
                    p.grad = None
                    self._release_state(p)
        self.prefetched = {}  # copies of units left frozen (apply called by hand) are not needed

    def _release_state(self, p):
        state = self.optimizer.state.get(p)
        if not state or self.state_policy == 'keep' or p in self.offloaded:
            return
        if self.state_policy == 'drop':
            del self.optimizer.state[p]
            return
        # offload: park the moments (not scalar 'step's) in CPU memory, pinned under CUDA so the copy back
        # overlaps compute; the copy out blocks, so a checkpoint saved right after reads finished data.
        devices = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                devices[key] = value.device
                parked = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                state[key] = parked.copy_(value)
        self.offloaded[p] = devices

    def _restore_state(self, p):
        devices = self.offloaded.pop(p, None)
        if devices is None:
            return
        state, ready = self.optimizer.state[p], self.prefetched.pop(p, {})
        for key, device in devices.items():
            if key in ready:
                if ready[key].is_cuda:  # made on the side stream, used on this one from now on
                    ready[key].record_stream(torch.cuda.current_stream(device))
                state[key] = ready[key]
            else:  # not prefetched (e.g. right after a resume)
                state[key] = state[key].to(device, non_blocking=True, copy=True)

    def scale_grads(self):
        """Multiply the gradients of the active units by the method's scale (once per step)."""
        scale = self.scaling()
        if scale == 1.0:
            return
        for p in (p for i in self.active for p in self.units[i] if p.grad is not None):
            p.grad.mul_(scale)

    def describe(self):
        if self.schedule is None:
            return 'full training'
        unit = METHODS[self.method].unit
        if self.last_switch < self.warmup:
            return f'warm-up: all {len(self.units)} {unit}s train'
        active = self.active if unit == 'block' else f'{len(self.active)} of {len(self.units)}'
        return f'cycle {self.schedule.partitions_drawn}: active {unit}s {active}, grad scale {self.scaling():g}'

    def state_dict(self):
        return {'method': self.method, 'active': self.active, 'last_switch': self.last_switch,
                'schedule': self.schedule.state_dict() if self.schedule else None}

    def load_state_dict(self, state):
        """Restore the schedule and re-apply the active set (call after loading the optimizer)."""
        if state['method'] != self.method:
            raise ValueError(f"checkpoint was trained with method={state['method']!r}, not {self.method!r}; "
                             f"resume with --method={state['method']}")
        self.last_switch = state['last_switch']
        if self.schedule is not None:
            self.schedule.load_state_dict(state['schedule'])
        self.apply(state['active'])


def build_cycler(model, optimizer, method='lisa_wor', gamma=1, period=1, warmup=0, ratio=0.5,
                 state_policy='drop', seed=0, always=OUTER_PARTS):
    """A UnitMask over model.blocks (LISA methods) or over every tensor (tensor methods).

    `always` names the outer parts that train at every step under the LISA methods; the
    parts it leaves out stay frozen for the whole run. Tensor methods cycle the outer parts
    too, so they accept only the default (every outer part of the model).
    """
    unknown = set(always) - set(OUTER_PARTS)
    if unknown:
        raise ValueError(f"unknown omgd_always part(s) {sorted(unknown)}; choose from {', '.join(OUTER_PARTS)}")
    outer = model.outer_modules()
    if METHODS.get(method) and METHODS[method].unit == 'tensor':
        if not set(outer) <= set(always):
            raise ValueError(f"{method} cycles every tensor, outer parts included; omgd_always must be "
                             f"{','.join(outer)} (the default), got {','.join(always) or 'nothing'}")
        units = [[p] for p in model.parameters()]  # parameters() dedupes the tied head
        return UnitMask(units, optimizer, method, gamma, period, warmup, ratio, state_policy, seed)
    units = [list(block.parameters()) for block in model.blocks]
    trained = {id(p) for part in always if part in outer for p in outer[part].parameters()}
    trained |= {id(p) for unit in units for p in unit}
    for p in model.parameters():
        if id(p) not in trained:
            p.requires_grad_(False)
    return UnitMask(units, optimizer, method, gamma, period, warmup, ratio, state_policy, seed)


def state_tensors(optimizer):
    """(param, key, tensor) of the optimizer state counted as memory: not scalar 'step' counters,
    nor GaLore's projectors (counted apart, as in the paper's table: galore.projector_bytes)."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and key != 'projector':
                yield p, key, value


def memory_bytes(model, optimizer):
    """Exact bytes of parameters, gradients and optimizer state tensors (on any device)."""
    params = list(model.parameters())  # deduped: a tied weight counts once
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    state = sum(v.numel() * v.element_size() for _, _, v in state_tensors(optimizer))
    return {'params': sum(p.numel() * p.element_size() for p in params), 'grads': grads, 'optimizer': state}
