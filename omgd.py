"""Omni-Masked Gradient Descent (Yang et al.) and its LLM instance, LISA-wor layer cycling (Algorithm 2): every K
iterations gamma blocks are drawn from a pool not yet used in this cycle, the others are frozen (no gradient; under
omgd_state='drop' no optimizer state), and active gradients are scaled by N_L / gamma. Blocks are chosen by index in
model.blocks, so DDP and torch.compile change nothing. Algorithm 1 on least squares: experiments/linreg.py."""

import itertools
import math
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from configurator import above, at_least, check_rule, one_of
from infra.optimizer_offload import OffloadedState


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
OUTER_PARTS = ('embed', 'pos', 'norm', 'head')
STATE_POLICIES = ('drop', 'offload', 'keep')  # what a frozen unit's optimizer state does (StatePolicy)
# the rule of each train.py key a cycler reads (train_config.py checks a config with them)
RULES = {
    'omgd_gamma': at_least(1),
    'omgd_period': at_least(1),
    'omgd_warmup': at_least(0),
    'omgd_ratio': above(0, upper=1),
    'omgd_state': one_of(*STATE_POLICIES),
}
FIXED_ON_RESUME = {
    k: 'its layer schedule and data position belong to it' for k in ('omgd_gamma', 'omgd_ratio', 'omgd_always')
}


def check_always(parts):
    unknown = [part for part in parts if part not in OUTER_PARTS]
    if unknown:
        raise ValueError(f"unknown omgd_always part(s) {unknown}; choose from {','.join(OUTER_PARTS)}")


@dataclass(frozen=True)
class CyclerConfig:
    """train.py's `method` and `omgd_*` keys, without the prefix; their defaults are these."""

    method: str = 'lisa_wor'
    gamma: int = 2  # block methods: active blocks per period
    period: int = 25  # K: iterations between switches
    warmup: int = 0  # iterations of full training before the first switch
    ratio: float = 0.5  # tensor methods: 1/M of tensor_wor, the keep probability of tensor_iid
    state: str = 'drop'  # the optimizer state policy of frozen units (omgd.STATE_POLICIES)
    seed: int = 0  # seeds the draws, independent of the global RNG
    always: tuple = OUTER_PARTS  # block methods: the outer parts that train at every step

    @classmethod
    def from_config(cls, cfg, method=None):
        values = {f.name: cfg[f'omgd_{f.name}'] for f in fields(cls) if f'omgd_{f.name}' in cfg}
        if isinstance(values.get('always'), str):  # 'embed,pos,norm,head' on the command line
            values['always'] = tuple(part for part in values['always'].split(',') if part)
        return cls(method or cfg['method'], **values)

    def check(self, n_units):
        """Raise a one-line ValueError for a configuration that cannot run on n_units units."""
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        for key, rule in RULES.items():  # a field a fork adds is checked by its rule there
            check_rule(key, getattr(self, key.removeprefix('omgd_')), rule)
        check_always(self.always)
        if METHODS[self.method] and METHODS[self.method].unit == 'block' and self.gamma > n_units:
            raise ValueError(f"omgd_gamma must be in 1..{n_units} (the model's number of blocks), got {self.gamma}")


def build_cycler(model, optimizer, config):
    """A Cycler over model.blocks, the outer parts not in config.always frozen, or (tensor methods) every tensor."""
    outer = model.outer_modules()
    if METHODS.get(config.method) and METHODS[config.method].unit == 'tensor':
        if not set(outer) <= set(config.always):
            raise ValueError(
                f"{config.method} cycles every tensor, outer parts included; omgd_always must be "
                f"{','.join(outer)} (the default), got {','.join(config.always) or 'nothing'}"
            )
        return Cycler([[p] for p in model.parameters()], optimizer, config)  # parameters() dedupes the tied head
    units = [list(block.parameters()) for block in model.blocks]
    cycler = Cycler(units, optimizer, config)  # checks the config before anything is frozen
    trained = {id(p) for part in config.always if part in outer for p in outer[part].parameters()}
    trained |= {id(p) for unit in units for p in unit}
    for p in model.parameters():
        if id(p) not in trained:
            p.requires_grad_(False)
    return cycler


class Cycler:
    """A method's mask over units (lists of parameters switched together), drawn by a GroupSchedule.
    Per iteration: step(it), prefetch(it), forward/backward, scale_grads(), optimizer step."""

    def __init__(self, units, optimizer, config):
        config.check(len(units))
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group['params']}
        if any(id(p) not in in_optimizer for unit in units for p in unit):  # else they would never train
            raise ValueError("every cycled parameter must be in the optimizer: build it over all parameters first")
        self.units, self.config = units, config
        policy = config.state
        self.optimizer_state = OffloadedState(optimizer) if policy == 'offload' else StatePolicy(optimizer, policy)
        self.active = list(range(len(units)))  # everything trains until the first switch
        self.last_switch, self.scale = -1, 1.0
        self.schedule = None if config.method == 'full' else self._schedule()

    def _schedule(self):
        """The method's GroupSchedule; sets the gradient scale (the inverse keep ratio)."""
        kind, n, gamma, ratio = METHODS[self.config.method], len(self.units), self.config.gamma, self.config.ratio
        if kind.unit == 'block':
            partition = lambda g: random_partition(n, [gamma] * (n // gamma), g)
            self.scale = n / gamma if kind.scaled else 1.0
        elif kind.with_replacement:  # tensor_iid: each tensor kept with probability r (see bernoulli_subset)
            partition = lambda g: bernoulli_subset(n, ratio, g)
            self.scale = (1 - (1 - ratio) ** n) / ratio
        else:  # tensor_wor: M complementary groups; the masks sum to M * ones
            M = math.ceil(1 / ratio)
            numels = [sum(p.numel() for p in unit) for unit in self.units]
            partition = lambda g: balanced_partition(numels, M, g)
            self.scale = float(M)
        return GroupSchedule(partition, kind.with_replacement, torch.Generator().manual_seed(self.config.seed))

    def cycle_note(self):
        """A line for the log when LISA-wor's cycles leave blocks out, else None."""
        method, gamma = self.config.method, self.config.gamma
        k, kind = len(self.units) % gamma, METHODS[method]
        if self.schedule is None or kind.unit != 'block' or kind.with_replacement or k == 0:
            return None
        return (
            f"{method} with N_L={len(self.units)}, gamma={gamma}: N_L mod gamma = {k} random "
            f"block{'s sit' if k > 1 else ' sits'} out each cycle, so a cycle's masks do not sum to "
            f"M x 1 (Algorithm 1 holds only when gamma divides N_L)"
        )

    def _switches_at(self, iter_num):
        warmup = self.config.warmup
        if self.schedule is None or iter_num < warmup or iter_num == self.last_switch:
            return False
        period_starts = (iter_num - warmup) % self.config.period == 0
        never_switched = self.last_switch < warmup  # e.g. a run that starts mid-period
        return period_starts or never_switched

    def step(self, iter_num):
        """Call at the start of every iteration; returns True when the active set changed."""
        if not self._switches_at(iter_num):
            return False
        self.last_switch = iter_num
        self.apply(self.schedule.next())
        return True

    def prefetch(self, iter_num):
        """After step(iter_num): on a period's last iteration, 'offload' starts copying the next group's state back."""
        if not self._switches_at(iter_num + 1):
            return
        group = self.schedule.peek()
        self.optimizer_state.prefetch([p for i in group for p in self.units[i]])

    def scaling(self):
        """The gradient scale of the active units (1 during warm-up and for 'full')."""
        return self.scale if self.last_switch >= self.config.warmup else 1.0  # 'full' never switches

    def apply(self, active):
        """Make exactly the units in `active` trainable and set their optimizer state policy."""
        self.optimizer_state.wait_for_prefetch()
        self.active = sorted(active)
        active_set = set(self.active)
        for i, unit in enumerate(self.units):
            for p in unit:
                p.requires_grad_(i in active_set)
                if i in active_set:
                    self.optimizer_state.restore(p)
                else:
                    p.grad = None
                    self.optimizer_state.release(p)
        self.optimizer_state.finish_switch()

    def scale_grads(self):  # once per step
        scale = self.scaling()
        if scale == 1.0:
            return
        for p in (p for i in self.active for p in self.units[i] if p.grad is not None):
            p.grad.mul_(scale)

    def report(self, model):
        """A switch's log line and record: `active`, the cycled units on; `trains`, every part that trains now."""
        trains = lambda module: any(p.requires_grad for p in module.parameters())
        parts = {
            'outer': [name for name, module in model.outer_modules().items() if trains(module)],
            'blocks': [i for i, block in enumerate(model.blocks) if trains(block)],
        }
        blocks = f"blocks {parts['blocks']}" if parts['blocks'] else 'no block'
        names = ', '.join(parts['outer']) + (' and ' if parts['outer'] else '') + blocks
        return f'{self.describe()}; trains {names}', {'active': list(self.active), 'trains': parts}

    def describe(self):
        if self.schedule is None:
            return 'full training'
        unit = METHODS[self.config.method].unit
        if self.last_switch < self.config.warmup:
            return f'warm-up: all {len(self.units)} {unit}s train'
        active = self.active if unit == 'block' else f'{len(self.active)} of {len(self.units)}'
        return f'cycle {self.schedule.partitions_drawn}: active {unit}s {active}, grad scale {self.scaling():g}'

    def state_dict(self):
        return {
            'method': self.config.method,
            'active': self.active,
            'last_switch': self.last_switch,
            'schedule': self.schedule.state_dict() if self.schedule else None,
        }

    def load_state_dict(self, state):
        """Restore the schedule and re-apply the active set (call after loading the optimizer)."""
        saved = state['method']
        if saved != self.config.method:
            raise ValueError(f"checkpoint was trained with method={saved!r}; resume with --method={saved}")
        self.last_switch = state['last_switch']
        if self.schedule is not None:
            self.schedule.load_state_dict(state['schedule'])
        self.apply(state['active'])


class StatePolicy:
    """A frozen parameter's optimizer state: 'keep' leaves it (the paper's GPT-2 setting), 'drop' deletes it
    (zero moments and step 0 when it trains again). 'offload': optimizer_offload.OffloadedState, same methods."""

    def __init__(self, optimizer, policy):
        self.optimizer, self.policy = optimizer, policy

    def release(self, p):
        if self.policy == 'drop':
            self.optimizer.state.pop(p, None)

    restore = prefetch = wait_for_prefetch = finish_switch = lambda self, *args: None  # only 'offload' needs these


class GroupSchedule:
    """One group of units per period: without replacement (OMGD) a cycle uses one random partition's groups in turn
    (LISA-wor: Algorithm 2's pool); with replacement every period draws a partition and uses its first group."""

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
        """The group next() will return; peeking never changes which groups are chosen."""
        if not self.replacement and self.pending:
            return self.pending[0]
        if self.ahead is None:
            self.ahead = self.partition(self.generator)
        return self.ahead[0]

    def state_dict(self):
        return {
            'pending': self.pending,
            'partitions_drawn': self.partitions_drawn,
            'rng': self.generator.get_state(),
            'ahead': self.ahead,  # the generator has moved past it: a resume must not redraw
        }

    def load_state_dict(self, state):
        self.pending = [list(g) for g in state['pending']]
        self.partitions_drawn = state['partitions_drawn'] if 'partitions_drawn' in state else state['cycle']  # older
        self.ahead = [list(g) for g in state['ahead']] if state.get('ahead') else None  # older: absent
        self.generator.set_state(state['rng'])


def random_partition(n, sizes, generator):
    """Disjoint random groups of range(n) with the given sizes (their sum may be < n)."""
    perm = torch.randperm(n, generator=generator).tolist()
    starts = itertools.accumulate(sizes, initial=0)
    return [sorted(perm[start : start + size]) for start, size in zip(starts, sizes)]


def balanced_partition(sizes, num_groups, generator):
    """Items into num_groups groups of about equal total size: in random order, each to the lightest group."""
    groups, totals = [[] for _ in range(num_groups)], [0] * num_groups
    for i in torch.randperm(len(sizes), generator=generator).tolist():
        lightest = totals.index(min(totals))
        groups[lightest].append(i)
        totals[lightest] += sizes[i]
    return [sorted(g) for g in groups]


def bernoulli_subset(n, ratio, generator):
    """The paper's i.i.d. mask on n items, each kept with probability `ratio`. An empty draw is redrawn, which
    raises P(kept) to r / (1 - (1-r)^n): the Cycler scales by its inverse."""
    while True:
        kept = (torch.rand(n, generator=generator, dtype=torch.float64) < ratio).nonzero().flatten()
        if len(kept):
            return [kept.tolist()]
