"""
The checkpoint that train.py writes (out_dir/ckpt.pt): saving it, reading it (train.py and
sample.py alike), and resuming from it.

A checkpoint is one torch.save'd dict: model, optimizer, cycler, data position, model_args,
iter_num, best_val_loss, config, world_size, rng, scaler. It is written atomically and read with
weights_only=True, so a file from elsewhere cannot run code.
"""
import contextlib
import os
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint that is missing or cannot be read; the message is one line and says what to do."""


def read(path, map_location='cpu', mmap=False):
    """The checkpoint dict at `path`, or a CheckpointError naming the problem in one line.

    mmap=True maps the tensors instead of reading them: cheap enough to look at iter_num of a
    multi-GB checkpoint."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path}; train first (python train.py)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:
        # torch's messages run to several sentences (advice about weights_only=False we must not
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
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            os.remove(tmp)
        raise


def gather_rng(ranks, device_type):
    """Every rank's RNG state (dropout), in rank order; a collective, call on every rank."""
    return ranks.gather({'torch': torch.get_rng_state(),
                         'cuda': torch.cuda.get_rng_state() if device_type == 'cuda' else None})


def save(path, ranks, model, optimizer, cycler, data, model_args, iter_num, best_val_loss, config, scaler,
         fsdp, device_type):
    """Call on every rank (collectives: the RNG states, FSDP's full state dicts); rank 0 writes.
    Model, optimizer, schedule and data position are the same on every rank; the dropout RNG is
    not, so each rank's state is gathered into the file. Atomic (atomic_path): a crash never
    leaves a broken ckpt.pt or a stray temporary file. Returns whether this rank wrote it."""
    import distributed
    rank_rngs = gather_rng(ranks, device_type)
    if fsdp:  # gathered to rank 0 (a collective); the same file format as below
        model_state, optimizer_state = distributed.full_state_dicts(model, optimizer)
    else:
        model_state, optimizer_state = model.state_dict(), optimizer.state_dict()
    if not ranks.master:
        return False
    checkpoint = {
        'model': model_state, 'optimizer': optimizer_state, 'cycler': cycler.state_dict(),
        'data': data, 'model_args': model_args, 'iter_num': iter_num,
        'best_val_loss': best_val_loss, 'config': config, 'world_size': ranks.world_size,
        'rng': {'ranks': rank_rngs}, 'scaler': scaler.state_dict(),
    }
    with atomic_path(Path(path)) as tmp_path:
        torch.save(checkpoint, tmp_path)
    return True


class ResumeRefused(ValueError):
    """The config cannot continue the checkpoint; the message is one line and says what to pass."""


def check_resume(checkpoint, config, defaults):
    """Refuse (ResumeRefused) a config that cannot continue `checkpoint`: architecture overrides
    that conflict with it, another block_size, another precision."""
    from training import ARCH_KEYS
    model_args = checkpoint['model_args']
    for k in ARCH_KEYS:
        if k != 'vocab_size' and k in config and config[k] != defaults[k] and config[k] != model_args[k]:
            raise ResumeRefused(f"{k}={config[k]!r} conflicts with the checkpoint's {model_args[k]!r}; "
                                f"drop the override")
    # The data position counts windows of block_size+1 tokens, so another length would continue on
    # another window grid (and gpt2's learned positions have the checkpoint's length in the
    # weights and the optimizer state): an exact resume needs the same block_size.
    if config['block_size'] != model_args['block_size']:
        raise ResumeRefused(f"block_size={config['block_size']} differs from the checkpoint's "
                            f"{model_args['block_size']} (the data position counts windows of block_size+1 "
                            f"tokens); resume with --block_size={model_args['block_size']}")
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


def resume(path, map_location, config, defaults):
    """(checkpoint, model) to resume from `path`; a one-line ValueError when there is none, it does
    not load, or the config cannot continue it (load_model)."""
    if not os.path.exists(path):
        raise CheckpointError(f"no checkpoint at {path} to resume from; train with init_from='scratch' first")
    checkpoint = read(path, map_location=map_location)
    return checkpoint, load_model(checkpoint, path, config, defaults)


def load_model(checkpoint, path, config, defaults):
    """The GPT saved in `checkpoint`, with the config's dropout, after check_resume: ResumeRefused,
    or a one-line CheckpointError for a checkpoint that does not load."""
    from model import GPT, GPTConfig
    try:
        check_resume(checkpoint, config, defaults)
        model_args = checkpoint['model_args']
        model_args['dropout'] = config['dropout']
        model = GPT(GPTConfig(**model_args))
        model.load_state_dict(checkpoint['model'])
    except ResumeRefused:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                              f"it is corrupt or from another version: start from scratch or restore a backup") from None
    return model


def load_state(checkpoint, model, optimizer, cycler, train_batches, scaler, fsdp):
    """Load the training state (optimizer, cycler, data position, loss scale) of `checkpoint` into
    what train.py built; ValueError or KeyError when it does not fit."""
    if fsdp:  # the file holds full tensors; each rank keeps its shards
        import distributed
        distributed.load_optimizer_state(model, optimizer, checkpoint['optimizer'])
    else:
        optimizer.load_state_dict(checkpoint['optimizer'])
    cycler.load_state_dict(checkpoint['cycler'])
    train_batches.load_state_dict(checkpoint['data'])
    if scaler.is_enabled() and checkpoint.get('scaler'):  # absent or empty: saved without float16
        scaler.load_state_dict(checkpoint['scaler'])


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
