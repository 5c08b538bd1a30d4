"""
The optimizer state of layer cycling's frozen units, and the memory that state takes.

When a unit freezes, its optimizer state follows the policy `omgd_state`:
  keep     stays where it is (no saving; the paper's GPT-2 setting)
  drop     is deleted; the unit restarts from zero moments and step 0 when it trains again
  offload  is parked in CPU memory (pinned under CUDA) and copied back when the unit trains again;
           prefetch() starts that copy a period's last iteration early, on a side stream under CUDA,
           so it overlaps compute

omgd.Cycler calls release() and restore() for every parameter at a switch, and prefetch() on
the parameters of the next group. memory_bytes() counts parameters, gradients and optimizer state.
"""
import torch

STATE_POLICIES = ('drop', 'offload', 'keep')


class StatePolicy:
    """What happens to the optimizer state of a parameter that freezes, and what brings it back."""

    def __init__(self, optimizer, policy):
        self.optimizer, self.policy = optimizer, policy
        self.offloaded = {}  # param -> {state key: original device}
        self.prefetched = {}  # param -> {state key: its copy back, started by prefetch()}
        self.streams, self.events, self.sources = {}, {}, []  # CUDA: per device; pinned tensors being read

    def release(self, p):
        """The parameter froze: drop or park its state (nothing under 'keep')."""
        state = self.optimizer.state.get(p)
        if not state or self.policy == 'keep' or p in self.offloaded:
            return
        if self.policy == 'drop':
            del self.optimizer.state[p]
            return
        # offload: park the moments (not scalar 'step's) in CPU memory, pinned under CUDA so the copy back
        # overlaps compute; the copy out blocks, so a checkpoint saved right after reads finished data.
        devices = {}
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                if value.device.type == 'cpu' and p.device.type != 'cpu':
                    continue  # a master or moment in host memory already (master_device='cpu'): it stays
                devices[key] = value.device
                parked = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.is_cuda)
                state[key] = parked.copy_(value)
        self.offloaded[p] = devices

    def restore(self, p):
        """The parameter trains again: put its parked state back, the prefetched copy if there is one."""
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

    def prefetch(self, params):
        """Under 'offload', start copying back the parked state of `params` (the next group's): on a
        side stream under CUDA, at once elsewhere (the same path on every device)."""
        if self.policy != 'offload':
            return
        for event in self.events.values():  # the previous copies, done a period ago: free their sources
            event.synchronize()
        self.sources = []
        for p in (p for p in params if p in self.offloaded and p not in self.prefetched):
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

    def wait_for_prefetch(self):
        """Before a switch: the compute stream waits for the prefetched copies."""
        for device, event in self.events.items():
            torch.cuda.current_stream(device).wait_event(event)

    def forget_prefetched(self):
        """After a switch: copies of units left frozen (a switch made by hand) are not needed."""
        self.prefetched = {}


# -----------------------------------------------------------------------------
# memory accounting


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
