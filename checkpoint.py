"""
Reading the checkpoint that train.py writes (out_dir/ckpt.pt), for train.py and sample.py alike.

A checkpoint is one torch.save'd dict: model, optimizer, cycler, data position, model_args,
iter_num, best_val_loss, config, world_size, rng, scaler. It is read with weights_only=True, so a
file from elsewhere cannot run code.
"""
import os

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
