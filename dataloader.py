"""Batches of token windows from train.bin / val.bin, in the order 'rr' (random reshuffling: each epoch visits every
window of block_size+1 tokens once, from a random offset) or 'iid' (nanoGPT's sampling with replacement). The order
is a function of (seed, epoch), so a run resumes on any number of ranks and batch_size (docs/distributed.md)."""

import importlib
import os

import numpy as np
import torch

from configurator import check_rule, one_of
from data.tokenizer import read_meta

RULES = {'sampling': one_of('rr', 'iid')}

SCAN_LIMIT = 1 << 28  # ids check_vocab scans at start (512 MiB of uint16, about a second)


def open_tokens(path, prepare_hint, dtype='uint16', n_ids=None):
    """The ids of a .bin file, memory-mapped; an error for a file missing, empty, cut or of ids not `dtype` wide."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found; run `{prepare_hint}` first")
    again = f"run `{prepare_hint}` again"
    if not os.path.isfile(path):  # /dev/zero, a named pipe, a socket: no size to check, and a pipe blocks the read
        what = 'a directory' if os.path.isdir(path) else 'not a regular file (a device, pipe or socket)'
        raise ValueError(f"{path} is {what}, not a file of token ids; {again}")
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size == 0 or size % itemsize:
        raise ValueError(
            f"{path} has {size} bytes, not a whole number of {dtype} ids ({itemsize} bytes each): "
            f"it is empty, cut short or of another dataset; {again}"
        )
    other = {'uint16': 'uint32', 'uint32': 'uint16'}[dtype]
    if n_ids and size == n_ids * np.dtype(other).itemsize:  # another length: the file changed (a resume warns)
        raise ValueError(
            f"{path} holds the {n_ids} ids meta.pkl records as {other} ({size} bytes), but meta.pkl "
            f"says dtype={dtype}; {again}, or fix meta.pkl's dtype"
        )
    ids = np.memmap(path, dtype=dtype, mode='r')
    head = ids[: min(len(ids), 1 << 16) // 2 * 2]
    if dtype == 'uint16' and len(head) >= 2048 and not head[1::2].any() and head[0::2].any():
        raise ValueError(
            f"{path} looks like uint32 ids (every second uint16 is 0) but meta.pkl says dtype=uint16 "
            f"(or there is no meta.pkl); {again}, or fix meta.pkl's dtype"
        )
    return ids


class TokenBatches:
    def __init__(
        self,
        path,
        block_size,
        batch_size,
        sampling='rr',
        seed=1337,
        rank=0,
        world_size=1,
        prepare_hint='python data/<dataset>/prepare.py',
        dtype='uint16',
        n_ids=None,
    ):
        check_rule('sampling', sampling, RULES['sampling'])
        self.path, self.prepare_hint, self.dtype = path, prepare_hint, dtype
        self.block_size, self.batch_size, self.sampling = block_size, batch_size, sampling
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.per_step = batch_size * world_size  # windows per micro-step, of every rank together
        self.vocab_size = None  # set by check_vocab when this file is too large to scan at start
        self.n_tokens = n_tokens = len(open_tokens(path, prepare_hint, dtype, n_ids))
        # every epoch has the same number of windows, whatever its offset in [0, block_size]
        self.windows_per_epoch = (n_tokens - block_size) // (block_size + 1)
        self.steps_per_epoch = self.windows_per_epoch // self.per_step
        if n_tokens <= block_size or (sampling == 'rr' and self.steps_per_epoch == 0):
            raise ValueError(
                f"{path} has {n_tokens} tokens, too few for block_size={block_size} x "
                f"{self.per_step} windows per step; lower block_size or batch_size"
            )
        # iid draws with replacement from any split; its 'epoch' (which seeds the draws) is at least a step
        self.steps_per_epoch = max(1, self.steps_per_epoch)
        self.epoch, self.windows_done = 0, 0  # windows of the epoch consumed, by every rank together
        self._order = None
        self.start = self.state_dict()  # evaluation batches rewind to it at each evaluation (load_state_dict)

    def next_starts(self):
        """Token offsets of this rank's windows for the next micro-step: the rank-th part of the step's windows."""
        per_step = self.per_step
        if self.windows_done + per_step > self.steps_per_epoch * per_step:  # the rest is the dropped tail
            self.epoch, self.windows_done = self.epoch + 1, 0
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        step_first = self.windows_done
        self.windows_done += per_step
        if self.sampling == 'iid':
            # one generator per global micro-step: iid draws resume exactly and do not depend on the ranks
            g = torch.Generator().manual_seed(((self.seed * 1_000_003 + self.epoch) * 1_000_003 + step_first) % 2**64)
            return torch.randint(self.n_tokens - self.block_size, (per_step,), generator=g)[mine]
        if self._order is None or self._order[0] != self.epoch:  # the epoch's offset and window order, drawn once
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)  # a large data_seed wraps
            offset = int(torch.randint(self.block_size + 1, (1,), generator=g))
            self._order = (self.epoch, offset, torch.randperm(self.windows_per_epoch, generator=g))
        _, offset, perm = self._order
        return offset + perm[step_first : step_first + per_step][mine] * (self.block_size + 1)

    def next_batch(self, device='cpu'):
        # a fresh memmap per batch avoids nanoGPT's leak; __init__ checked that the file exists
        data = np.memmap(self.path, dtype=self.dtype, mode='r')
        windows = np.stack([data[s : s + self.block_size + 1] for s in self.next_starts().tolist()])
        if self.vocab_size is not None and int(windows.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.path} holds token id {int(windows.max())}, not below the model's vocab_size={self.vocab_size}: "
                f"the file is corrupt or of another tokenizer; run `{self.prepare_hint}` again"
            )
        windows = torch.from_numpy(windows.astype(np.int64))
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if device.startswith('cuda'):
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    def iterate(self, device='cpu'):
        """Endless (x, y, position) micro-batches; load_state_dict(position) continues with that batch."""
        while True:
            position = self.state_dict()
            yield (*self.next_batch(device), position)

    def epochs(self):
        """Epochs of data consumed so far, as a fraction (iid: windows drawn / windows in the split)."""
        if self.sampling == 'rr':
            return self.epoch + self.windows_done / (self.steps_per_epoch * self.per_step)
        return (self.epoch * self.steps_per_epoch * self.per_step + self.windows_done) / max(1, self.windows_per_epoch)

    def state_dict(self):
        return {
            'sampling': self.sampling,
            'seed': self.seed,
            'epoch': self.epoch,
            'windows_consumed': self.windows_done,
            'windows_per_step': self.per_step,
            'n_tokens': self.n_tokens,
        }

    def load_state_dict(self, state):
        if state['sampling'] != self.sampling or state['seed'] != self.seed:
            raise ValueError(
                f"checkpoint data order is sampling={state['sampling']!r} seed={state['seed']}; "
                f"resume with the same sampling and seed"
            )
        if state['windows_consumed'] > self.windows_per_epoch:
            raise ValueError(
                f"the checkpoint's data position ({state['windows_consumed']} windows into epoch {state['epoch']}) "
                f"lies beyond the {self.windows_per_epoch} windows of {self.path} ({self.n_tokens:,} tokens, "
                f"{state.get('n_tokens', 'unknown')} when it was saved): the file changed; resume on the original data"
            )
        self.epoch, self.windows_done = state['epoch'], state['windows_consumed']


SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')  # the checkout's data/<name>/prepare.py
DATA_ROOT = os.environ.get('OMGD_DATA_ROOT') or SCRIPTS  # where dataset names are looked up (a shared disk, tests)
EMBEDDED = ('shakespeare', 'shakespeare_char')  # corpora shipped in packages: prepared on first use


def data_dir(dataset):
    """data/<dataset>, or `dataset` when it is a path."""
    return os.path.join(DATA_ROOT, dataset)


def prepare_advice(dataset):
    """What to do about a dataset with no prepared splits: run its prepare script, or (mistyped) which there are."""
    if os.path.isfile(os.path.join(SCRIPTS, dataset, 'prepare.py')):
        return f"run `python data/{dataset}/prepare.py` first"
    names = set()
    for root, has in ((SCRIPTS, ('prepare.py',)), (DATA_ROOT, ('train.bin', 'val.bin'))):
        if os.path.isdir(root):
            names.update(d for d in os.listdir(root) if any(os.path.isfile(os.path.join(root, d, f)) for f in has))
    return (
        f"there is no data/{dataset}/prepare.py either: the datasets are {', '.join(sorted(names)) or 'none'} "
        f"(or give the path of a prepared folder)"
    )


def prepare_if_embedded(dataset, verbose=True):
    """Prepare an embedded Shakespeare corpus on first use (call on one rank)."""
    missing = [f for f in ('train.bin', 'val.bin') if not os.path.exists(os.path.join(data_dir(dataset), f))]
    name = os.path.basename(os.path.normpath(dataset))
    if missing and name in EMBEDDED:
        if verbose:
            print(f"preparing {data_dir(dataset)} (first run)")
        importlib.import_module(f'data.{name}.prepare').prepare(data_dir(dataset))


def dataset_vocab(dataset, vocab_size=0):
    """vocab_size, else meta.pkl's (a character set, a Hugging Face tokenizer), else 0 (GPT-2 BPE: the builder's)."""
    if vocab_size:
        return vocab_size
    meta = read_meta(data_dir(dataset))
    return 0 if meta['tokenizer'] == 'gpt2' else meta['vocab_size']


def check_vocab(dataset, vocab_size, *batches):
    """A ValueError for ids vocab_size cannot embed: meta.pkl's, files of up to SCAN_LIMIT ids; larger: each batch."""
    meta = read_meta(data_dir(dataset))
    if os.path.exists(os.path.join(data_dir(dataset), 'meta.pkl')) and meta['vocab_size'] > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the vocabulary of {data_dir(dataset)} ({meta['vocab_size']} "
            f"ids, tokenizer {meta['tokenizer']}): set --vocab_size={meta['vocab_size']} or more"
        )
    scanned = set()
    for b in batches:
        if b.n_tokens > SCAN_LIMIT:
            b.vocab_size = vocab_size  # checked batch by batch
        elif b.path not in scanned:  # the training order and the evaluation batches share train.bin
            scanned.add(b.path)
            top = int(np.memmap(b.path, dtype=b.dtype, mode='r').max())
            if top >= vocab_size:
                raise ValueError(
                    f"{b.path} holds token id {top}, not below vocab_size={vocab_size}: the file is corrupt or of "
                    f"another tokenizer; run `{b.prepare_hint}` again"
                )


def open_splits(dataset, block_size, batch_size, sampling, seed, rank=0, world_size=1):
    """(train batches in `sampling` order, {'train', 'val'}: evaluation batches); a ValueError for unusable data."""
    advice = prepare_advice(dataset)
    if not os.path.exists(os.path.join(data_dir(dataset), 'train.bin')) and not advice.startswith('run '):
        raise ValueError(f"dataset {dataset!r} has no prepared splits in {data_dir(dataset)}; {advice}")  # mistyped
    meta, hint = read_meta(data_dir(dataset)), f"python data/{dataset}/prepare.py"

    def batches(split, order, seed):
        path, n_ids = os.path.join(data_dir(dataset), f'{split}.bin'), meta.get('n_ids', {}).get(split)
        return TokenBatches(path, block_size, batch_size, order, seed, rank, world_size, hint, meta['dtype'], n_ids)

    evaluation = {split: batches(split, 'iid', seed + 1) for split in ('train', 'val')}
    return batches('train', sampling, seed), evaluation
