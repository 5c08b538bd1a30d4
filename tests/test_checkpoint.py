"""checkpoint.py: what is saved, what is never saved (a non-finite state), and a failed write that
leaves the previous checkpoint as it was; in-process, on a tiny model."""
import errno
import os

import pytest
import torch

import checkpoint
import training
from conftest import train_defaults
from distributed import Ranks

CFG = train_defaults(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def build():
    torch.manual_seed(0)
    model, optimizer, cycler = training.build(CFG, 'cpu')
    trainer = training.Trainer(CFG, model, optimizer, cycler, 'cpu')
    x = torch.randint(32, (2, 8))
    trainer.step(0, (x, x), lambda: (x, x))  # optimizer state exists
    return {'model': model, 'optimizer': optimizer, 'cycler': cycler, 'scaler': trainer.scaler}


def save(path, objects, iter_num=1):
    return checkpoint.save(str(path), Ranks(), objects, {'iter_num': iter_num, 'config': CFG, 'data': {}})


def test_round_trip_holds_every_objects_state(tmp_path):
    objects = build()
    assert save(tmp_path / 'ckpt.pt', objects)
    saved = checkpoint.read(str(tmp_path / 'ckpt.pt'))
    assert {'model', 'optimizer', 'cycler', 'scaler', 'iter_num', 'config', 'data', 'world_size', 'rng'} <= set(saved)
    fresh = build()
    with torch.no_grad():
        for p in fresh['model'].parameters():
            p.zero_()
    fresh['model'].load_state_dict(saved['model'])
    checkpoint.load_state(saved, fresh)
    for a, b in zip(objects['model'].parameters(), fresh['model'].parameters()):
        assert torch.equal(a, b)
    assert fresh['cycler'].state_dict()['active'] == objects['cycler'].state_dict()['active']
    assert os.listdir(tmp_path) == ['ckpt.pt']  # no temporary file left


@pytest.mark.parametrize('where', ['weight', 'optimizer state'])
def test_a_non_finite_state_is_never_saved(tmp_path, where):
    objects = build()
    save(tmp_path / 'ckpt.pt', objects)
    good = (tmp_path / 'ckpt.pt').read_bytes()
    with torch.no_grad():
        if where == 'weight':
            next(objects['model'].parameters())[0] = float('nan')
        else:
            state = next(iter(objects['optimizer'].state.values()))
            state['exp_avg_sq'].view(-1)[0] = float('inf')
    with pytest.raises(checkpoint.NonFiniteState):
        save(tmp_path / 'ckpt.pt', objects, iter_num=2)
    assert (tmp_path / 'ckpt.pt').read_bytes() == good  # the last good one stays
    assert os.listdir(tmp_path) == ['ckpt.pt']


def test_a_failed_write_says_so_and_keeps_the_previous_file(tmp_path, monkeypatch):
    objects = build()
    save(tmp_path / 'ckpt.pt', objects)
    good = (tmp_path / 'ckpt.pt').read_bytes()

    def disk_full(obj, path):
        with open(path, 'wb') as f:
            f.write(b'half')  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(torch, 'save', disk_full)
    with pytest.raises(checkpoint.CheckpointError) as e:
        save(tmp_path / 'ckpt.pt', objects, iter_num=2)
    assert 'No space left on device' in str(e.value) and 'previous checkpoint is intact' in str(e.value)
    assert '\n' not in str(e.value)
    assert (tmp_path / 'ckpt.pt').read_bytes() == good
    assert os.listdir(tmp_path) == ['ckpt.pt']  # the partial temporary file is gone


def test_the_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, 'fsync', lambda fd: (order.append('fsync'), real_fsync(fd))[1])
    monkeypatch.setattr(os, 'replace', lambda a, b: (order.append('replace'), real_replace(a, b))[1])
    save(tmp_path / 'ckpt.pt', build())
    assert order == ['fsync', 'replace']


def test_out_dir_checked_and_stale_temporaries_removed(tmp_path):
    (tmp_path / '.ckpt.pt.tmp-999').write_bytes(b'from a save that was killed')
    (tmp_path / 'ckpt.pt').write_bytes(b'kept')
    checkpoint.check_out_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']
    (tmp_path / 'file').write_text('x')
    with pytest.raises(checkpoint.CheckpointError, match="cannot hold checkpoints"):
        checkpoint.check_out_dir(str(tmp_path / 'file'))
