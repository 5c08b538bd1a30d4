"""omgd_state='offload': a frozen unit's optimizer state parked in host memory, copied back a period before it
trains again. On CUDA the copies run on a side stream into pinned buffers kept between switches, and every reader
of the parked state (a copy back, a checkpoint) waits for the copies out, as torchao's CPU-offload optimizer does."""

import weakref

import torch


class ImmediateCopies:
    """Copies done when asked (CPU, meta). to_host takes [(value, host buffer)], to_device [host tensor];
    record() returns the event the waits take."""

    def to_host(self, pairs):
        for value, buffer in pairs:
            buffer.copy_(value)

    def to_device(self, parked, device):
        return [t.to(device, copy=True) for t in parked]

    def record(self):  # every copy is done when asked: no event
        return None

    def wait_on_host(self, event):
        pass

    def wait_on_compute(self, event, device):
        pass

    def adopt(self, copy, device):
        return copy


class CudaCopies(ImmediateCopies):
    """Every copy on one side stream, in the order asked; a switch's copies out go as one batch."""

    def __init__(self, device):
        self.stream = torch.cuda.Stream(device)

    def to_host(self, pairs):
        if not pairs:
            return
        self.stream.wait_stream(torch.cuda.current_stream(pairs[0][0].device))  # after the step that wrote them
        with torch.cuda.stream(self.stream):
            for value, buffer in pairs:
                buffer.copy_(value, non_blocking=True)
        for value, _ in pairs:
            value.record_stream(self.stream)  # its memory is not reused until the copy has read it

    def to_device(self, parked, device):
        with torch.cuda.stream(self.stream):
            return [t.to(device, non_blocking=True) for t in parked]

    def record(self):
        return self.stream.record_event()

    def wait_on_host(self, event):
        if event is not None:
            event.synchronize()

    def wait_on_compute(self, event, device):
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)

    def adopt(self, copy, device):
        copy.record_stream(torch.cuda.current_stream(device))  # made on the side stream, used on this one from now on
        return copy


class OffloadedState:
    """A period before a switch, prefetch(ps) starts copying back the next group's state; the switch calls
    wait_for_prefetch(), restore(p) for each unit that trains again, release(p) for each that froze, and
    finish_switch(), which parks the released moments (not scalar 'step's)."""

    def __init__(self, optimizer):
        self.optimizer, self.copies = optimizer, {}  # device -> its copier (make_copies)
        self.offloaded = {}  # param -> {state key: original device}
        self.buffers = {}  # param -> {state key: host buffer}, reused at every release
        self.releasing = []  # params released in this switch, parked by finish_switch()
        self.prefetched = {}  # param -> {state key: its copy back, started by prefetch()}
        self.parked = {}  # device -> the event after its last copy out
        self.prefetch_done = {}  # device -> the event after its last prefetch
        # a checkpoint reads the state once the copies out have landed; weak, so the optimizer does not keep self alive
        wait = weakref.WeakMethod(self.wait_parked)
        optimizer.register_state_dict_pre_hook(lambda optimizer: wait() and wait()())

    def make_copies(self, device):  # a test swaps in its own
        return CudaCopies(device) if device.type == 'cuda' else ImmediateCopies()

    def _copies(self, device):
        if device not in self.copies:
            self.copies[device] = self.make_copies(device)
        return self.copies[device]

    def release(self, p):
        if self.optimizer.state.get(p) and p not in self.offloaded:
            self.releasing.append(p)
            self.offloaded[p] = {}  # its keys, once parked

    def finish_switch(self):
        by_device = {}
        for p in self.releasing:
            state, buffers = self.optimizer.state[p], self.buffers.setdefault(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.device.type == 'cpu' and p.device.type != 'cpu':
                        continue  # a master or moment in host memory already (master_device='cpu'): it stays
                    self.offloaded[p][key] = value.device
                    if key not in buffers:
                        buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                    by_device.setdefault(p.device, []).append((value, buffers[key]))
                    state[key] = buffers[key]
        for device, pairs in by_device.items():
            copies = self._copies(device)
            copies.to_host(pairs)
            self.parked[device] = copies.record()
        self.releasing = []
        self.prefetched = {}  # copies of units left frozen are dropped

    def restore(self, p):
        devices = self.offloaded.pop(p, None)
        if devices is None:
            return
        state, ready = self.optimizer.state[p], self.prefetched.pop(p, {})
        copies = self._copies(p.device)
        for key, device in devices.items():
            if key in ready:
                state[key] = copies.adopt(ready[key], device)
            else:  # not prefetched (e.g. right after a resume): copied here, once the copy out has landed
                copies.wait_on_compute(self.parked.get(p.device), device)
                state[key] = state[key].to(device, non_blocking=True, copy=True)

    def prefetch(self, params):
        by_device = {}
        for p in (p for p in params if p in self.offloaded and p not in self.prefetched):
            by_device.setdefault(p.device, []).append(p)
        for device, ps in by_device.items():
            copies = self._copies(device)  # its stream orders these after the copies out
            keys = [(p, key) for p in ps for key in self.offloaded[p]]  # each moment lives on its parameter's device
            made = copies.to_device([self.optimizer.state[p][key] for p, key in keys], device)
            for (p, key), copy in zip(keys, made):
                self.prefetched.setdefault(p, {})[key] = copy
            self.prefetch_done[device] = copies.record()

    def wait_for_prefetch(self):
        for device, event in self.prefetch_done.items():
            self._copies(device).wait_on_compute(event, device)

    def wait_parked(self):  # the host waits for every copy out
        for device, event in self.parked.items():
            self._copies(device).wait_on_host(event)
