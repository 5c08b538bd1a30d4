"""
The checkpoint that train.py writes (out_dir/ckpt.pt): saving it, reading it (train.py and
sample.py alike), and resuming from it.

A checkpoint is one torch.save'd dict: the state_dict() of each object train.py hands over
(model, optimizer, cycler, scaler), and plain values (data position, model_args, iter_num,
best_val_loss, config), plus world_size and every rank's RNG. It is never written with a
non-finite weight or optimizer state, goes to disk (fsync) before it atomically replaces the
previous one, and is read with weights_only=True, so a file from elsewhere cannot run code.
"""
import contextlib
import glob
import os
import zipfile
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing or cannot be read; the message is one line and says what to do."""


def read(path, map_location='cpu', mmap=False):
    """The checkpoint dict at `path`, or a CheckpointError naming the problem in one line.

    mmap=True maps the tensors instead of reading them: cheap enough to look at iter_num of a
    multi-GB checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}; train one first: python train.py "
                              f"--out_dir={os.path.dirname(path) or '.'}")
    if mmap and not zipfile.is_zipfile(path):  # not torch.save's format (nothing to map): torch's error names it
        mmap = False
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        # torch's messages run to several sentences (advice to switch weights_only off, which we must not
        # follow); the first names the problem
        reason = str(e).strip().splitlines()[0].split('. ')[0].rstrip('.') if str(e).strip() else ''
        raise CheckpointError(f"cannot read checkpoint {path} ({type(e).__name__}: {reason[:200]}); it is "
                              f"corrupt, truncated or from another program: restore a backup or train from "
                              f"scratch") from None


@contextlib.contextmanager
def atomic_path(path: Path):
    """Yield a hidden temporary path next to ``path``; on success it replaces ``path``.

    On any error the temporary file is removed and ``path`` keeps its old content, so a failed
    write never leaves a half-written file behind. The pid keeps parallel writers apart.
    (data/common.py's prepare scripts write their files through it too.)
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, 'rb+') as f:  # on disk before it replaces the old file: a power cut leaves one of the two
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            os.remove(tmp)
        raise


def gather_rng(ranks, device_type):
    """Every rank's RNG state (dropout), in rank order; a collective, call on every rank."""
    return ranks.gather({'torch': torch.get_rng_state(),
                         'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})


class NonFiniteState(CheckpointError):
    """The weights or the optimizer state hold inf or NaN: such a state is never saved."""


def all_finite(model, optimizer):
    """Whether every weight and every optimizer-state tensor of this rank (its shards) is finite."""
    tensors = [p for p in model.parameters()]
    # through state_dict(): its hooks wait for asynchronous copies of the state (optimizer_offload)
    tensors += [t for state in optimizer.state_dict()['state'].values() for t in state.values()
                if torch.is_tensor(t) and t.is_floating_point()]
    return all(bool(torch.isfinite(t.to_local() if hasattr(t, 'to_local') else t).all()) for t in tensors)


def check_out_dir(out_dir):
    """Refuse (CheckpointError) an out_dir that cannot hold a checkpoint, before any training; remove
    the temporary files an interrupted save left there."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f'.write-test-{os.getpid()}')
        with open(probe, 'wb'):
            pass
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"out_dir={out_dir!r} cannot hold checkpoints ({e.strerror or e}); choose a writable "
                              f"directory with --out_dir") from None
    for stale in glob.glob(os.path.join(glob.escape(out_dir), '.ckpt.pt.tmp-*')):
        os.remove(stale)


def save(path, ranks, objects, values, fsdp=False, device_type='cpu'):
    """Write {name: obj.state_dict() for objects} and `values` (plain data) to `path`.

    Call on every rank (collectives: the finiteness vote, the RNG states, FSDP's full state
    dicts); rank 0 writes. objects holds 'model' and 'optimizer' (gathered from their shards under
    FSDP) and whatever else has a state_dict. Raises NonFiniteState, on every rank alike, before
    anything is written; a failed write (disk full, read-only) raises CheckpointError and leaves
    the previous file as it was (atomic_path). Returns whether this rank wrote the file."""
    model, optimizer = objects['model'], objects['optimizer']
    if ranks.any(not all_finite(model, optimizer)):
        raise NonFiniteState(f"the weights or optimizer state hold inf or NaN; {path} was not written")
    rank_rngs = gather_rng(ranks, device_type)
    if fsdp:  # gathered to rank 0 (a collective); the same file format as one process writes
        import distributed
        states = dict(zip(('model', 'optimizer'), distributed.full_state_dicts(model, optimizer)))
    else:
        states = {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}
    if not ranks.master:
        return False
    states.update({name: obj.state_dict() for name, obj in objects.items() if name not in states})
    checkpoint = {**states, **values, 'world_size': ranks.world_size, 'rng': {'ranks': rank_rngs}}
    try:
        with atomic_path(Path(path)) as tmp_path:
            torch.save(checkpoint, tmp_path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0][:200]
        raise CheckpointError(f"cannot write {path} ({reason}); the previous checkpoint is intact: free "
                              f"space or choose another --out_dir, then resume") from None
    return True


class ResumeRefused(ValueError):
    """The config cannot continue the checkpoint; the message is one line and says what to pass."""


def check_resume(checkpoint, config, given):
    """Refuse (ResumeRefused) a config that cannot continue `checkpoint`: architecture overrides
    that conflict with it, another block_size, another precision."""
    from builder import ARCH_KEYS
    model_args = checkpoint['model_args']
    for k in ARCH_KEYS:
        if k != 'vocab_size' and k in given and config[k] != model_args[k]:
            raise ResumeRefused(f"{k}={config[k]!r} conflicts with the checkpoint's {model_args[k]!r}; "
                                f"drop the override")
    # The data position counts windows of block_size+1 tokens, so another length would continue on
    # another window grid (and gpt2's learned positions have the checkpoint's length in the
    # weights and the optimizer state): an exact resume needs the same block_size.
    if config['block_size'] != model_args['block_size']:
        raise ResumeRefused(f"block_size={config['block_size']} differs from the checkpoint's "
                            f"{model_args['block_size']} (the data position counts windows of block_size+1 "
                            f"tokens); resume with --block_size={model_args['block_size']}")
    # the cycler's saved groups, scale and draw, and the data position, belong to these values
    for key in ('dataset', 'method', 'omgd_gamma', 'omgd_ratio', 'omgd_always'):
        saved = checkpoint['config'].get(key, config[key])
        if saved != config[key]:
            raise ResumeRefused(f"{key}={config[key]!r} differs from the checkpoint's {saved!r} (its layer schedule "
                                f"and data position belong to it); resume with --{key}={saved}, or start a new "
                                f"run with --init_from=scratch in another --out_dir")
    saved_precision = checkpoint['config'].get('precision', 'amp')  # older checkpoints: amp
    if saved_precision != config['precision']:
        raise ResumeRefused(f"precision={config['precision']!r} differs from the checkpoint's {saved_precision!r} "
                            f"(its optimizer state is kept in that precision); resume with "
                            f"--precision={saved_precision}")


def earlier_run(path):
    """What the checkpoint at `path` holds, in words, for the message that refuses to replace it."""
    try:
        return f"iteration {read(path, mmap=True)['iter_num']} of an earlier run"
    except (CheckpointError, KeyError):
        return "an unreadable checkpoint"


def resume(path, device, config, given):
    """(checkpoint, model) to resume from `path`, the model on `device` in the checkpoint's weight dtype;
    a one-line ValueError when there is none, it does not load, or the config cannot continue it
    (load_model).

    The checkpoint is read into host memory, never onto `device`: the RNG states must stay CPU
    tensors (torch.set_rng_state and torch.cuda.set_rng_state take nothing else), the optimizer
    state goes where its parameters are when load_state loads it (torch's loading, and
    optim.MasterWeights' for master_device='cpu', which keeps its masters in host memory), and no
    rank holds the whole file on its GPU. So a file written on one device type resumes on any
    other, through this same path. For a GPU the file is mapped (mmap: the ranks of a node share
    its pages, and no rank reads it whole), since everything is copied out of it; a CPU run reads
    it, as its optimizer state would stay the file's pages (torch's loading keeps a tensor that is
    on the right device already), holding the replaced file's disk space after the next save."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path} to resume from; train with init_from='scratch' first")
    checkpoint = read(path, map_location='cpu', mmap=torch.device(device).type != 'cpu')
    model = load_model(checkpoint, path, config, given)
    from builder import weight_dtype
    # cast where it was read, then moved once: a bf16 run never holds fp32 weights on the device
    model.to(weight_dtype(config['precision'])).to(device)  # check_resume: the saved precision
    if model.config.tie_embeddings:  # a move to a device of another kind (meta) gives each module its own
        model.wte.weight = model.lm_head.weight
    return checkpoint, model


def load_model(checkpoint, path, config, given):
    """The GPT saved in `checkpoint`, with the config's dropout, after check_resume: ResumeRefused,
    or a one-line CheckpointError for a checkpoint that does not load."""
    from model import Transformer, TransformerConfig
    try:
        check_resume(checkpoint, config, given)
        model_args = checkpoint['model_args']
        model_args['dropout'] = config['dropout']
        model = Transformer(TransformerConfig(**model_args))
        model.load_state_dict(checkpoint['model'])
    except ResumeRefused:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"it is corrupt or from another version: start from scratch or restore a backup") from None
    return model


def load_state(checkpoint, objects, fsdp=False):
    """Load each object's state from `checkpoint` (the model is loaded when it is built: not here).
    ValueError or KeyError when it does not fit. A scaler loads only when loss scaling is on and
    the checkpoint has its state (saved with float16)."""
    for name, obj in objects.items():
        if name == 'optimizer' and fsdp:  # the file holds full tensors; each rank keeps its shards
            import distributed
            distributed.load_optimizer_state(objects['model'], obj, checkpoint['optimizer'])
        elif name == 'scaler':
            if obj.is_enabled() and checkpoint.get('scaler'):
                obj.load_state_dict(checkpoint['scaler'])
        elif name != 'model':
            obj.load_state_dict(checkpoint[name])


def restore_rng(checkpoint, ranks, device_type, seed, iter_num):
    """Continue each rank's dropout stream from `checkpoint`; returns False when it was saved on
    another number of ranks. Then (the data loader accepted the position, see dataloader.py) the
    run goes on from the same weights, schedule and windows, but the per-rank dropout streams
    cannot continue, and the gradient sum runs in another order, so it is not bitwise: each rank
    is seeded afresh."""
    rank_rngs = checkpoint['rng'].get('ranks', [])
    if len(rank_rngs) != ranks.world_size:
        torch.manual_seed(seed + ranks.rank + 1_000_003 * iter_num)
        return False
    torch.set_rng_state(rank_rngs[ranks.rank]['torch'])
    if device_type == 'cuda' and rank_rngs[ranks.rank]['cuda'] is not None:
        torch.cuda.set_rng_state(rank_rngs[ranks.rank]['cuda'])
    return True


class OutDirLock:
    """One writer per out_dir: rank 0 of a run holds an exclusive flock on out_dir/.lock until it
    exits. The kernel releases it when the process dies, however it dies, so a crash never leaves
    the folder locked. The file names the holder for the message that refuses a second writer."""

    def __init__(self, out_dir):
        self.out_dir, self.path, self.file = out_dir, os.path.join(out_dir, '.lock'), None

    def acquire(self):
        """Take the lock, or raise CheckpointError naming the run that holds it."""
        import fcntl
        import socket
        import time
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            self.file = open(self.path, 'a+')
        except OSError as e:
            raise CheckpointError(f"out_dir={self.out_dir!r} cannot hold checkpoints ({e.strerror or e}); choose a "
                                  f"writable directory with --out_dir") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or 'another process'
            self.file.close()
            raise CheckpointError(f"out_dir={self.out_dir!r} is in use by {holder}; wait for that run to end or stop "
                                  f"it, or choose another --out_dir") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"the run of pid {os.getpid()} on {socket.gethostname()}, started "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.file.flush()
        return self

    def release(self, remove=False):
        """Let go (remove=True also deletes the file: only for an out_dir the run leaves empty)."""
        if self.file is not None:
            if remove:
                os.remove(self.path)
            self.file.close()
            self.file = None


# -----------------------------------------------------------------------------
# any format: ckpt.pt or sharded step folders (checkpoint_dcp.py), for the readers of a run


def read_any(out_dir, map_location='cpu', mmap=False, optimizer=True):
    """(checkpoint dict, path) of out_dir's newest checkpoint, ckpt.pt's format whatever was written:
    out_dir/ckpt.pt, or the newest complete step folder (checkpoint_dcp.py) consolidated in host
    memory (optimizer=False reads its weights only), whichever holds the later iteration. A
    one-line CheckpointError when there is none or it cannot be read."""
    import checkpoint_dcp
    found = checkpoint_dcp.find(out_dir)
    if found is None or found[0] == 'file':
        path = os.path.join(out_dir, 'ckpt.pt')
        return read(path, map_location=map_location, mmap=mmap), path
    path = found[1]
    checkpoint = checkpoint_dcp.consolidate(path, optimizer=optimizer)
    if torch.device(map_location).type != 'cpu':
        checkpoint['model'] = {k: v.to(map_location) for k, v in checkpoint['model'].items()}
    return checkpoint, path
