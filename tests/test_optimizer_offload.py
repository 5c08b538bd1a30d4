"""optimizer_offload.OffloadedState's ordering, on the CPU: copies that land only when a reader waits for them
(as CUDA's side-stream copies land only when their stream gets there) still train bit for bit like 'keep', so
every reader of the parked state waits: the copy back of a restore, the prefetch, and a checkpoint's state_dict()."""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_omgd import assert_same_training, make_cycling, run_cycling  # noqa: E402

from infra import optimizer_offload  # noqa: E402


class DeferredCopies(optimizer_offload.ImmediateCopies):
    """A side stream that runs its copies only when an event recorded after them is waited for. Until then a
    copy's destination holds NaN, so a reader that does not wait trains on NaN (or checkpoints it)."""

    def __init__(self, device=None):
        self.queue, self.done, self.waits = [], 0, 0

    def to_host(self, pairs):
        for value, buffer in pairs:
            buffer.fill_(math.nan)
            self.queue.append((buffer, value))

    def to_device(self, parked, device):
        copies = [torch.full_like(t, math.nan, device=device) for t in parked]
        self.queue += list(zip(copies, parked))
        return copies

    def record(self):
        return len(self.queue)

    def _run_until(self, event):
        self.waits += 1
        for dst, src in self.queue[self.done : event]:
            dst.copy_(src)
        self.done = max(self.done, event)

    def wait_on_host(self, event):
        self._run_until(event)

    def wait_on_compute(self, event, device):
        if event is not None:
            self._run_until(event)


def deferred(cycler):
    state = cycler.optimizer_state
    state.make_copies = DeferredCopies
    return state


@pytest.mark.parametrize('prefetch', [True, False])  # False: every restore copies back without a prefetch
def test_deferred_copies_train_like_keep(prefetch):
    runs = []
    for policy in ('keep', 'offload'):
        model, opt, cycler = make_cycling('lisa_wor', policy)
        if policy == 'offload':
            copies = deferred(cycler)
        run_cycling(model, opt, cycler, range(15), prefetch=prefetch)  # 7 switches
        runs.append((model, opt))
    assert copies.copies[torch.device('cpu')].waits > 0
    pending = copies.copies[torch.device('cpu')]
    if prefetch:  # (without, the last switch's restores waited for its copies out)
        assert pending.done < len(pending.queue)  # the last switch's copies out have not landed yet ...
    keep_sd, offload_sd = (opt.state_dict() for _, opt in runs)  # ... a checkpoint's read waits for them
    assert pending.done == len(pending.queue)
    for i, state in keep_sd['state'].items():
        assert all(torch.equal(state[k], offload_sd['state'][i][k]) for k in state)
    assert_same_training(*runs)


def test_a_released_unit_is_parked_in_reused_buffers():
    """The host buffers are allocated at a unit's first release and reused by every later one."""
    model, opt, cycler = make_cycling('lisa_wor', 'offload', n_layer=4)
    seen = {}
    for it in range(12):
        run_cycling(model, opt, cycler, [it])
        for p, buffers in cycler.optimizer_state.buffers.items():
            ids = {k: b.data_ptr() for k, b in buffers.items()}
            assert seen.setdefault(p, ids) == ids
    assert set(seen) == {p for block in model.blocks for p in block.parameters()}  # every block was parked
