"""
Batches of token windows from a uint16 token file (train.bin / val.bin, as data/*/prepare.py
write them), in one of two orders:

- 'rr' (random reshuffling, the default): each epoch cuts the token stream into windows of
  block_size+1 tokens starting at a fresh random offset, permutes the windows and visits each
  exactly once. Micro-step c of an epoch uses the global slice perm[c*R*B : (c+1)*R*B] (R ranks,
  B windows each); rank r takes its r-th part, so ranks are disjoint and the windows of a step
  do not depend on how many ranks share them.
- 'iid': nanoGPT's sampling with replacement, kept as the baseline.

The order is a pure function of (seed, epoch), so the position (epoch, windows consumed) is all
a checkpoint needs to continue exactly. Because the position counts windows, not steps, a run can
resume on another number of ranks when the windows consumed are a whole number of its steps,
always so when batch_size x ranks is unchanged (the epoch's dropped tail, fewer than
batch_size x ranks windows, depends on that product too).
"""
import importlib
import os
import pickle

import numpy as np
import torch


def open_tokens(path, prepare_hint):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; run `{prepare_hint}` first")
    return np.memmap(path, dtype=np.uint16, mode='r')


class TokenBatches:

    def __init__(self, path, block_size, batch_size, sampling='rr', seed=1337, rank=0,
                 world_size=1, prepare_hint='python data/<dataset>/prepare.py'):
        if sampling not in ('rr', 'iid'):
            raise ValueError(f"sampling must be 'rr' or 'iid', got {sampling!r}")
        self.path, self.prepare_hint = path, prepare_hint
        self.block_size, self.batch_size, self.sampling = block_size, batch_size, sampling
        self.seed, self.rank, self.world_size = seed, rank, world_size
        n_tokens = len(open_tokens(path, prepare_hint))
        # every epoch has the same number of windows, whatever its offset in [0, block_size]
        self.windows_per_epoch = (n_tokens - block_size) // (block_size + 1)
        self.steps_per_epoch = self.windows_per_epoch // (batch_size * world_size)
        if n_tokens <= block_size or (sampling == 'rr' and self.steps_per_epoch == 0):
            raise ValueError(f"{path} has {n_tokens} tokens, too few for block_size={block_size} x "
                             f"{batch_size * world_size} windows per step; lower block_size or batch_size")
        # iid draws with replacement from any split; an 'epoch' (which only seeds the draws and
        # is logged) is then at least one step
        self.steps_per_epoch = max(1, self.steps_per_epoch)
        self.n_tokens = n_tokens
        self.epoch, self.step_in_epoch = 0, 0
        self._order = None

    def _epoch_order(self):
        """(offset, permutation of window indices) of the current epoch, cached."""
        if self._order is None or self._order[0] != self.epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            offset = int(torch.randint(self.block_size + 1, (1,), generator=g))
            perm = torch.randperm(self.windows_per_epoch, generator=g)
            self._order = (self.epoch, offset, perm)
        return self._order[1], self._order[2]

    def next_starts(self):
        """Token offsets of this rank's windows for the next micro-step."""
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch, self.step_in_epoch = self.epoch + 1, 0
        per_step = self.batch_size * self.world_size
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        step_first = self.step_in_epoch * per_step
        self.step_in_epoch += 1
        if self.sampling == 'iid':
            # one generator per global micro-step, so iid draws resume exactly and do not
            # depend on the rank split either
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + step_first)
            return torch.randint(self.n_tokens - self.block_size, (per_step,), generator=g)[mine]
        offset, perm = self._epoch_order()
        return offset + perm[step_first:step_first + per_step][mine] * (self.block_size + 1)

    def next_batch(self, device='cpu'):
        # a fresh memmap per batch avoids nanoGPT's leak; __init__ checked that the file exists
        data = np.memmap(self.path, dtype=np.uint16, mode='r')
        windows = np.stack([data[s:s + self.block_size + 1] for s in self.next_starts().tolist()])
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if device.startswith('cuda'):
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    def epochs(self):
        """Epochs of data consumed so far, as a fraction (iid: windows drawn / windows in the split)."""
        if self.sampling == 'rr':
            return self.epoch + self.step_in_epoch / self.steps_per_epoch
        drawn = (self.epoch * self.steps_per_epoch + self.step_in_epoch) * self.batch_size * self.world_size
        return drawn / max(1, self.windows_per_epoch)

    def state_dict(self):
        return {'sampling': self.sampling, 'seed': self.seed, 'epoch': self.epoch,
                'windows_consumed': self.step_in_epoch * self.batch_size * self.world_size,
                'windows_per_step': self.batch_size * self.world_size}

    def load_state_dict(self, state):
        if state['sampling'] != self.sampling or state['seed'] != self.seed:
            raise ValueError(f"checkpoint data order is sampling={state['sampling']!r} seed={state['seed']}; "
                             f"resume with the same sampling and seed")
        per_step = self.batch_size * self.world_size
        if state['windows_consumed'] % per_step:
            saved, ranks = state.get('windows_per_step', '?'), f"{self.world_size} rank{'s' * (self.world_size > 1)}"
            hint = f", i.e. --batch_size={saved // self.world_size} with {ranks}" \
                if isinstance(saved, int) and saved % self.world_size == 0 else ""
            raise ValueError(f"checkpoint stopped after {state['windows_consumed']} windows of the epoch, not a "
                             f"multiple of batch_size x ranks = {self.batch_size} x {self.world_size}; resume with "
                             f"the same batch_size x ranks as the checkpoint ({saved}){hint}")
        self.epoch, self.step_in_epoch = state['epoch'], state['windows_consumed'] // per_step


DATA_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
EMBEDDED = ('shakespeare', 'shakespeare_char')  # corpora shipped in packages: prepared on first use


def data_dir(dataset):
    """data/<dataset>, or `dataset` itself when it is a path."""
    return os.path.join(DATA_ROOT, dataset)


def prepare_if_embedded(dataset, verbose=True):
    """Prepare an embedded Shakespeare corpus on first use (call on one rank); any other dataset
    must have been prepared (TokenBatches then names the command)."""
    missing = [f for f in ('train.bin', 'val.bin') if not os.path.exists(os.path.join(data_dir(dataset), f))]
    if missing and dataset in EMBEDDED:
        if verbose:
            print(f"preparing data/{dataset} (first run)")
        importlib.import_module(f'data.{dataset}.prepare').prepare(data_dir(dataset))


def dataset_vocab(dataset, vocab_size=0):
    """The vocabulary a run uses: vocab_size, else the dataset's meta.pkl (character sets), else 0
    (training.model_args then takes the preset's, else GPT-2's padded 50304)."""
    meta = os.path.join(data_dir(dataset), 'meta.pkl')
    if vocab_size or not os.path.exists(meta):
        return vocab_size
    with open(meta, 'rb') as f:
        return pickle.load(f)['vocab_size']


def open_splits(dataset, block_size, batch_size, sampling, seed, rank=0, world_size=1):
    """(train batches in `sampling` order, {'train', 'val'}: evaluation batches). Evaluation draws
    the same fixed windows at every evaluation: rewind each with load_state_dict(its .start)."""
    def batches(split, order, seed):
        return TokenBatches(os.path.join(data_dir(dataset), f'{split}.bin'), block_size, batch_size, order, seed,
                            rank, world_size, f"python data/{dataset}/prepare.py")
    evaluation = {split: batches(split, 'iid', seed + 1) for split in ('train', 'val')}
    for split_batches in evaluation.values():
        split_batches.start = split_batches.state_dict()
    return batches('train', sampling, seed), evaluation
