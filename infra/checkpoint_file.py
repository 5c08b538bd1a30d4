"""The 'file' format, out_dir/ckpt.pt: one torch.save'd dict (state_dicts, values, each rank's RNG), never written
non-finite, synced, replacing the last atomically. And both formats' errors, weights_only read and RNG states."""

import contextlib
import io
import itertools
import os
import re
import zipfile
from pathlib import Path

import torch

from infra import distributed

INTACT = "the previous checkpoint is intact: free space or choose another --out_dir, then resume"


class CheckpointError(ValueError):
    """A checkpoint that is missing or cannot be read; the message is one line and says what to do."""


class NonFiniteState(CheckpointError):
    """The weights or the optimizer state hold inf or NaN: such a state is never saved."""


def read(path, map_location='cpu', mmap=False):
    """The checkpoint dict at `path`, or a one-line CheckpointError; mmap=True maps the tensors, not reads them."""
    mmap = mmap and zipfile.is_zipfile(path)  # not torch.save's format (nothing to map): torch's error names it
    if mmap:  # a mapped read trusts the records' headers it skips: damaged ones would map other bytes
        with open(path, 'rb') as f:
            check_archive(f, path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        raise unreadable(path, e) from None


def unreadable(path, e):
    reason = first_sentence(e)
    return CheckpointError(
        f"cannot read checkpoint {path} ({type(e).__name__}{': ' + reason if reason else ''}); it is corrupt, "
        f"truncated or from another program: restore a backup or train from scratch"
    )


def first_line(e):
    return (str(e).strip().splitlines() or [''])[0][:200]


def first_sentence(e):
    """torch's messages run to several sentences (advice to switch weights_only off, which we must not follow)."""
    return first_line(e).split('. ')[0].rstrip('.')


class _Slice(io.RawIOBase):
    """Bytes [start, start + size) of an open file, as a file of their own."""

    def __init__(self, f, start, size):
        self.f, self.start, self.size, self.pos = f, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = max(0, (0, self.pos, self.size)[whence] + pos)
        return self.pos

    def readinto(self, b):
        self.f.seek(self.start + self.pos)
        n = self.f.readinto(memoryview(b)[: max(0, self.size - self.pos)])
        self.pos += n
        return n


def check_archive(f, name, start=0, size=None):
    """A CheckpointError naming `name` when the torch.save archive in bytes [start, start + size) of the open file f
    is damaged: its directory, each record's header, the CRC of the records it unpickles (not the tensors')."""
    where = '' if size is None else f" (the record at byte {start})"
    size = os.fstat(f.fileno()).st_size - start if size is None else size
    try:
        with zipfile.ZipFile(_Slice(f, start, size)) as archive:
            for record in archive.infolist():
                with archive.open(record) as r:  # checks the record's header
                    if '/data/' not in record.filename:
                        r.read()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as e:
        raise CheckpointError(
            f"{name} is damaged{where}: {type(e).__name__}: {first_sentence(e)}; restore a backup or train from scratch"
        ) from None


def fsync(path):
    """Flush the file (or a folder's entries) at `path` to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path):
    """A hidden temporary file next to ``path``, made by this call (O_EXCL); on success it replaces ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():  # the pid keeps parallel writers apart
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}" + (f"-{n}" if n else ''))
        with contextlib.suppress(FileExistsError):
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode, as open() gives
            break
    try:
        yield tmp
        fsync(tmp)  # on disk before it replaces the old file: a power cut leaves one of the two
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def gather_rng(ranks, device_type):
    """Every rank's RNG state (dropout), in rank order; a collective."""
    cuda = torch.cuda.get_rng_state() if device_type == 'cuda' else None
    return ranks.gather({'torch': torch.get_rng_state(), 'cuda': cuda})


def check_finite(ranks, model, optimizer):
    """NonFiniteState on every rank (a collective vote) when any rank's weights or optimizer state are not finite."""
    tensors = list(model.parameters())
    # through state_dict(): its hooks wait for asynchronous copies of the state (optimizer_offload)
    states = optimizer.state_dict()['state'].values()
    tensors += [t for state in states for t in state.values() if torch.is_tensor(t) and t.is_floating_point()]
    finite = all(bool(torch.isfinite(t.to_local() if hasattr(t, 'to_local') else t).all()) for t in tensors)
    if ranks.any(not finite):
        raise NonFiniteState("the weights or optimizer state hold inf or NaN; no checkpoint was written")


def save(path, ranks, objects, values, fsdp=False, device_type='cpu'):
    """Write each object's state_dict() and `values` to `path` on rank 0 (a collective); True on the rank that wrote."""
    model, optimizer = objects['model'], objects['optimizer']
    check_finite(ranks, model, optimizer)
    rank_rngs = gather_rng(ranks, device_type)
    if fsdp:  # gathered to rank 0 (a collective); the same file format as one process writes
        states = dict(zip(('model', 'optimizer'), distributed.full_state_dicts(model, optimizer)))
    else:
        states = {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}
    if not ranks.master:
        return False
    states.update({name: obj.state_dict() for name, obj in objects.items() if name not in states})
    checkpoint = {**states, **values, 'world_size': ranks.world_size, 'rng': {'ranks': rank_rngs}}
    record, ours = write_record(path), False
    try:
        with atomic_path(Path(path)) as tmp_path:
            # names the temporary file, for the next run if this one is killed; never over a record no save wrote
            with contextlib.suppress(FileExistsError), open(record, 'x') as f:
                ours = True
                f.write(record_text(tmp_path))
            torch.save(checkpoint, tmp_path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
        reason = getattr(e, 'strerror', None) or first_line(e)
        raise CheckpointError(f"cannot write {path} ({reason}); {INTACT}") from None
    finally:
        if ours:  # only the record this save wrote, never one found under its name
            os.remove(record)
    return True


def write_record(path):
    """The file a save of `path` writes first and removes last: it names the save's temporary file."""
    return os.path.join(os.path.dirname(path), f'.{os.path.basename(path)}.writing')


def record_text(tmp):
    """What the record holds: the temporary file's name and identity (device, inode), which atomic_path created."""
    st = os.lstat(tmp)
    return f'{os.path.basename(tmp)} {st.st_dev} {st.st_ino}'


def remove_interrupted_write(path):
    """Remove the temporary file a killed save of `path` left: only the very file its record names (name, inode)."""
    record = write_record(path)
    if not os.path.isfile(record):
        return
    written = Path(record).read_text(errors='replace').split()
    # only a record in the form a save writes, naming atomic_path's form in the same folder, is ours
    if len(written) == 3 and re.fullmatch(rf'\.{re.escape(os.path.basename(path))}\.tmp-\d+(-\d+)?', written[0]):
        tmp = os.path.join(os.path.dirname(path), written[0])
        with contextlib.suppress(FileNotFoundError):
            if record_text(tmp).split() == written:
                os.remove(tmp)
        os.remove(record)


def load_state(checkpoint, objects, fsdp=False):
    """Load each object's state but the model's (a scaler's only when on and saved); ValueError or KeyError if unfit."""
    for name, obj in objects.items():
        if name == 'optimizer' and fsdp:  # the file holds full tensors; each rank keeps its shards
            distributed.load_optimizer_state(objects['model'], obj, checkpoint['optimizer'])
        elif name == 'scaler':
            if obj.is_enabled() and checkpoint.get('scaler'):
                obj.load_state_dict(checkpoint['scaler'])
        elif name != 'model':
            obj.load_state_dict(checkpoint[name])


def restore_rng(checkpoint, ranks, device_type, seed, iter_num):
    """Continue each rank's dropout stream; False when saved on another number of ranks: each is seeded afresh."""
    rank_rngs = checkpoint['rng'].get('ranks', [])
    if len(rank_rngs) != ranks.world_size:
        torch.manual_seed(seed + ranks.rank + 1_000_003 * iter_num)
        return False
    torch.set_rng_state(rank_rngs[ranks.rank]['torch'])
    if device_type == 'cuda' and rank_rngs[ranks.rank]['cuda'] is not None:
        torch.cuda.set_rng_state(rank_rngs[ranks.rank]['cuda'])
    return True
