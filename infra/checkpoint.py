"""A run's checkpoints in out_dir: Checkpointer starts, resumes and saves train.py's run; read_any() reads the newest
for the other scripts. Formats: 'file', out_dir/ckpt.pt (checkpoint_file.py, the default in one process), and 'dcp',
sharded step folders (checkpoint_dcp.py, the default under torchrun); a resume may use any number of ranks."""

import fcntl
import os
import socket
import sys
import tempfile
import time

import torch

from infra import checkpoint_dcp, checkpoint_file
from infra.checkpoint_file import CheckpointError, NonFiniteState, load_state, read, restore_rng, save


def warn(message):
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """out_dir's checkpoints for one run of train.py, on every rank; what it refuses is a one-line CheckpointError."""

    def __init__(self, out_dir, ranks, device, writes=True):
        self.out_dir, self.ranks, self.writes = out_dir, ranks, writes  # writes: not eval_only
        self.device_type = 'cuda' if device.startswith('cuda') else 'cpu'
        self.lock = None  # rank 0's lock_out_dir()
        self.made_out_dir = ranks.master and not os.path.exists(out_dir)  # removed if the run fails before a save
        self.init_from, self.found, self.saved, self.fsdp, self.seed = None, None, None, False, None
        self.iter_num, self.best_val_loss, self.wandb_id = 0, 1e9, None  # where the run starts
        self.path, self.saved_iter = None, None  # the last good checkpoint, which an error names
        self.replaced = []  # an earlier run's checkpoints (overwrite=True), removed once this run saved one
        self.saver = None  # the step folders' writer (checkpoint_dcp.Saver); None: ckpt.pt

    def start(self, cfg, configure, fsdp=False):
        """Start or resume the run: returns configure(saved values or None, their path), the run's config."""
        master, out_dir = self.ranks.master, self.out_dir
        if master and self.writes:
            self.lock = lock_out_dir(out_dir)
        self.candidates, self.fsdp = candidates(out_dir), fsdp  # listed once: each ckpt.pt's iteration is a read
        self.found = find(out_dir, self.candidates)
        self.init_from = cfg['init_from']
        if self.init_from == 'auto':  # a restarted job resumes; the first launch starts from scratch
            self.init_from = 'resume' if self.found else 'scratch'
        if self.init_from == 'resume':
            self.saved = self._read_newest()
        elif self.found and self.writes:
            self._replace(cfg['overwrite'])
        cfg = configure(self.saved, None if self.saved is None else self.found[1])
        if self.saved is not None:  # where the run starts: the checkpoint's values, once configure has checked them
            self.path, self.iter_num, self.saved_iter = self.found[1], self.saved['iter_num'], self.saved['iter_num']
            self.best_val_loss, self.wandb_id = self.saved['best_val_loss'], self.saved.get('wandb_id')
        if master and self.writes:  # the writer (it holds the lock): an unusable out_dir is found now
            check_out_dir(out_dir)
            removed, left = checkpoint_dcp.remove_incomplete(out_dir)  # what a crash in the middle of a save left
            if removed:
                print(f"removed {', '.join(removed)} from {out_dir}: left incomplete by an interrupted save")
            if left:
                warn(f"{', '.join(left)} in {out_dir}: not resumable, nor a save of train.py cut short; left as it is")
        self.seed = cfg['seed']
        fmt = cfg['checkpoint_format']  # 'auto': one file in one process; sharded folders on several ranks
        if fmt == 'dcp' or (fmt == 'auto' and self.ranks.world_size > 1):
            in_background = checkpoint_dcp.background(cfg['checkpoint_async'], self.device_type)
            self.saver = checkpoint_dcp.Saver(out_dir, self.ranks, cfg['keep_last'], in_background, self.replaced)
            if master and self.writes:
                self._refuse_foreign_steps(cfg['max_iters'])
        return cfg

    def _refuse_foreign_steps(self, max_iters):
        """Refuse now what a save would refuse later: a step folder this run did not write where it may save."""
        steps = [(int(m[1]), m[0]) for m in map(checkpoint_dcp.STEP.match, os.listdir(self.out_dir)) if m]
        for it, name in sorted(steps):
            path = os.path.join(self.out_dir, name)
            if self.iter_num <= it <= max_iters and path not in self.replaced and path != self.path:
                raise CheckpointError(
                    f"{path} was not written by this run and it would save iteration {it} there; move that folder "
                    f"out of out_dir (or restore its .complete file if it is a whole checkpoint), then run again"
                )

    def _read_newest(self):
        """The newest readable checkpoint's values (rank 0 decides); a newer one is warned of, kept as NAME.damaged."""
        if self.found is None:
            raise no_checkpoint(self.out_dir, " to resume from; train with init_from='scratch' first")
        try:
            chosen, saved, skipped = newest_readable(self.out_dir, self._read, self.candidates)
        except CheckpointError:  # none loads: the newest's own error, below, on every rank alike
            chosen, saved, skipped = self.found, None, []
        mine = tuple(chosen)
        chosen, skipped = self.ranks.gather((chosen, skipped))[0]
        if skipped and self.ranks.master:
            kept = []
            for path, _ in skipped:
                aside = path + '.damaged'
                if self.writes and not os.path.exists(aside):
                    os.replace(path, aside)
                    path = aside
                kept.append(path)
            warn(
                f"cannot resume from {'; '.join(f'{p} ({why})' for p, why in skipped)}: resuming from "
                f"{chosen[1]} instead; kept as {', '.join(kept)}"
            )
        self.ranks.gather(None)  # every rank reads on once the damaged are moved aside
        self.found = tuple(chosen)
        return saved if saved is not None and mine == self.found else self._read(*self.found[:2])

    def _read(self, fmt, path):
        if fmt == 'file':  # mapped for a GPU (a node's ranks share the pages), not on a CPU (would pin the file)
            return read(path, map_location='cpu', mmap=self.device_type != 'cpu')
        return checkpoint_dcp.check_readable(path)

    def _replace(self, overwrite):
        """A new run saves over out_dir's checkpoints: losing a long run to a re-typed command must be asked for."""
        _, path, it = self.found
        earlier = f"iteration {it} of an earlier run" if it >= 0 else "an unreadable checkpoint"
        if not overwrite:
            raise CheckpointError(
                f"{path} holds {earlier}; continue it with --init_from=resume, choose another --out_dir, or pass "
                f"--overwrite=True to replace it (--init_from=auto resumes when there is one)"
            )
        self.replaced = [path for _, path, _ in self.candidates]
        if self.ranks.master:
            print(f"{path} holds {earlier}; this run's first save replaces it (overwrite=True)")

    def load(self, objects, data):
        """A resume's state into the objects built since and the data loader `data`; a collective."""
        if self.saved is None:
            return
        checkpoint, (fmt, path, _), ranks = self.saved, self.found, self.ranks
        model, optimizer, objects = objects['model'], objects['optimizer'], {**objects, 'data': data}
        try:
            if fmt == 'dcp':  # each rank reads its shards, whatever the ranks that wrote them
                checkpoint_dcp.load(path, checkpoint, model, optimizer, ranks.cpu_group)
                objects = {k: v for k, v in objects.items() if k not in ('model', 'optimizer')}
            load_state(checkpoint, objects, self.fsdp)
        except ValueError as e:  # the loaders' own refusals, each saying what to do
            raise CheckpointError(f"cannot resume from {path}: {e}") from None
        except (KeyError, TypeError, AttributeError, IndexError) as e:  # a state that is not its object's
            raise CheckpointError(
                f"cannot resume from {path}: {type(e).__name__}: {str(e)[:200]}; the file is damaged "
                f"or not train.py's: restore a backup or train from scratch"
            ) from None
        try:
            checkpoint_file.check_finite(ranks, model, optimizer)
        except NonFiniteState:
            raise CheckpointError(
                f"{path} holds weights or optimizer state that are not finite (iteration {self.iter_num}): it cannot "
                f"be resumed; restore a backup of it, or start again with --init_from=scratch --overwrite=True"
            ) from None
        saved_tokens = checkpoint['data'].get('n_tokens')
        if saved_tokens is not None and saved_tokens != data.n_tokens and ranks.master:
            warn(
                f"{data.path} has {data.n_tokens:,} tokens, the checkpoint's data had {saved_tokens:,}: "
                f"the file changed, and the saved position now points into another order of windows"
            )
        try:
            same_ranks = restore_rng(checkpoint, ranks, self.device_type, self.seed, self.iter_num)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as e:  # set_rng_state's
            raise CheckpointError(
                f"cannot resume from {path}: its random number states cannot be restored "
                f"({type(e).__name__}: {str(e)[:200]}); restore a backup or train from scratch"
            ) from None
        if not same_ranks and ranks.master:
            print(
                f"resuming a {checkpoint.get('world_size', 1)}-rank checkpoint on {ranks.world_size} "
                f"rank{'s' * (ranks.world_size > 1)}: same data position, not bitwise the run it would have been"
            )
        self.saved = None  # free memory

    def save(self, objects, values):
        """Save values['iter_num']'s checkpoint; a collective refusing non-finite state. Rank 0: the path, else None."""
        try:
            if self.saver is not None:  # every rank writes its shards of a step folder
                path, wrote = self.saver.save(objects, values, self.device_type), self.ranks.master
            else:  # rank 0 writes out_dir/ckpt.pt
                path = os.path.join(self.out_dir, 'ckpt.pt')
                wrote = save(path, self.ranks, objects, values, self.fsdp, self.device_type)
        except NonFiniteState:
            raise CheckpointError(
                f"the weights or optimizer state are not finite at iteration {values['iter_num']}; "
                f"{self.last_good()}; lower learning_rate or raise warmup_iters"
            ) from None
        self.path, self.saved_iter = path, values['iter_num']
        if not wrote:
            return None
        if self.saver is None:  # an earlier run's step folders (overwrite=True) go with the first save
            checkpoint_dcp.remove_checkpoints([p for p in self.replaced if p != path])
            self.replaced = []
        background = self.saver is not None and self.saver.use_async
        note = ' (copied to host memory, written to disk in the background)' if background else ''
        print(f"saved checkpoint to {path}{note}")
        return path

    def last_good(self):  # for a failing run's error line
        if self.saved_iter is None:
            return "this run saved no checkpoint"
        return f"kept the last good checkpoint {self.path} (iteration {self.saved_iter})"

    def finish(self):
        """On every rank at the end: the last background save is on disk (or its failure raised)."""
        if self.saver is not None:
            self.saver.finish()

    def close(self, failed=False):
        """Let go of out_dir; failed=True (no collective): end a background save, remove an empty out_dir it made."""
        if failed and self.saver is not None:
            self.saver.finish(failed=True)
        if self.lock is not None:  # rank 0, the writer
            if failed and self.made_out_dir and os.path.isdir(self.out_dir) and os.listdir(self.out_dir) == ['.lock']:
                os.remove(self.lock.name)
                os.rmdir(self.out_dir)
            self.lock.close()


def newest_readable(out_dir, read, found=None):
    """((format, path, iter_num), read(format, path), [(path, why)] of each newer one) of the newest checkpoint of
    out_dir (or of `found`, its candidates()) that reads; none reads: the newest's CheckpointError."""
    skipped, first = [], None
    for fmt, path, it in candidates(out_dir) if found is None else found:
        try:
            return (fmt, path, it), read(fmt, path), skipped
        except CheckpointError as e:
            skipped.append((path, str(e).split('; ')[0].removeprefix(f'{path}: ')))
            first = first or e
    raise first or no_checkpoint(out_dir, f"; train one first: python train.py --out_dir={out_dir}")


def no_checkpoint(out_dir, then):
    """The CheckpointError for an out_dir without a checkpoint: what it holds instead, or `then`."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return CheckpointError(
            f"no checkpoint at {path}: out_dir={out_dir!r} is a file, not a directory; give the --out_dir of a "
            f"train.py run (the folder that holds its ckpt.pt or step folders)"
        )
    kept = checkpoint_dcp.not_resumable(out_dir)
    if kept:
        return CheckpointError(
            f"no complete checkpoint in {out_dir}: it holds {', '.join(f'{n} ({why})' for n, why in kept)}; restore "
            f"the .complete file of a step folder that is whole, or restore a backup"
        )
    return CheckpointError(f"no checkpoint at {path}{then}")


def find(out_dir, found=None):
    """(format, path, iter_num) of the checkpoint a resume of out_dir (or of `found`, its candidates()) continues,
    or None; an unreadable ckpt.pt (iter_num -1) only when alone, so that the resume names its fault."""
    found = candidates(out_dir) if found is None else found
    return ([c for c in found if c[2] >= 0] or found or [None])[0]


def of_type(value, kind):
    """isinstance, but a bool is no number (True would pass for an iteration)."""
    return isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)


def candidates(out_dir):
    """[(format, path, iter_num)] of out_dir's checkpoints, newest first (the folder on a tie); an unreadable
    ckpt.pt (iter_num -1) first of all: it may be the newest, so a fall-back names it."""
    found = [(it, 1, 'dcp', path) for it, path in checkpoint_dcp.complete_steps(out_dir)]
    path = os.path.join(out_dir, 'ckpt.pt')
    if os.path.exists(path):
        try:
            it = read(path, mmap=True)['iter_num']
        except (CheckpointError, KeyError, TypeError, IndexError):
            it = -1
        found.append((it if of_type(it, int) and it >= 0 else -1, 0, 'file', path))
    return [(fmt, path, it) for it, _, fmt, path in sorted(found, key=lambda f: (f[0] < 0, f[:2]), reverse=True)]


def trained_dataset(checkpoint):
    """config['dataset'] of a checkpoint (whose tokenizer reads its ids), or None when it records no such name."""
    config = checkpoint.get('config') if isinstance(checkpoint, dict) else None
    dataset = config.get('dataset') if isinstance(config, dict) else None
    return dataset if isinstance(dataset, str) else None


def check_out_dir(out_dir):
    """Refuse an out_dir that cannot hold a checkpoint; remove what a killed save of ckpt.pt left there."""
    try:
        tempfile.TemporaryFile(dir=out_dir).close()  # a file can be made there (lock_out_dir made the folder)
    except OSError as e:
        raise CheckpointError(
            f"out_dir={out_dir!r} cannot hold checkpoints ({e.strerror or e}); choose a writable --out_dir"
        ) from None
    checkpoint_file.remove_interrupted_write(os.path.join(out_dir, 'ckpt.pt'))


def lock_out_dir(out_dir):
    """One writer per out_dir: the open out_dir/.lock, flocked (freed however the process dies), naming its holder."""
    path, f = os.path.join(out_dir, '.lock'), None
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(
            f"out_dir={out_dir!r} cannot hold checkpoints: it is a file, not a directory; choose a directory"
        )
    try:
        os.makedirs(out_dir, exist_ok=True)
        f = open(path, 'a+b', buffering=0)  # unbuffered: a failed write fails there, not in close()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().decode(errors='replace').strip() or 'another process'
            f.close()
            raise CheckpointError(
                f"out_dir={out_dir!r} is in use by {holder}; wait for that run to end or stop "
                f"it, or choose another --out_dir"
            ) from None
        f.truncate(0)  # appends: written from byte 0
        started = time.strftime('%Y-%m-%d %H:%M:%S')
        f.write(f"the run of pid {os.getpid()} on {socket.gethostname()}, started {started}".encode())
        return f
    except OSError as e:  # a read-only place, a .lock that is a folder, a full disk: now, not at the first save
        if f is not None:
            f.close()
        raise CheckpointError(
            f"out_dir={out_dir!r} cannot hold checkpoints: its lock file {path} cannot be written "
            f"({e.strerror or e}); free space or choose another --out_dir, or remove what is at {path}"
        ) from None


def read_any(out_dir, map_location='cpu', mmap=False, optimizer=True):
    """(checkpoint dict in ckpt.pt's format, path) of out_dir's newest readable checkpoint (optimizer=False: a step
    folder's weights only); a newer unreadable one is named in a warning."""

    def read_one(fmt, path):
        if fmt == 'file':
            return read(path, map_location=map_location, mmap=mmap)
        checkpoint = checkpoint_dcp.consolidate(path, optimizer=optimizer)
        if torch.device(map_location).type != 'cpu':
            checkpoint['model'] = {k: v.to(map_location) for k, v in checkpoint['model'].items()}
        return checkpoint

    (_, path, it), checkpoint, skipped = newest_readable(out_dir, read_one)
    if skipped:
        warn(f"cannot read {'; '.join(f'{p} ({why})' for p, why in skipped)}: reading {path} (iteration {it}) instead")
    return checkpoint, path
