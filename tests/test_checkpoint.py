"""infra/checkpoint.py: what is saved, what is never saved (a non-finite state), and a failed write that
leaves the previous checkpoint as it was; in-process, on a tiny model."""

import errno
import itertools
import os

import pytest
import torch
from conftest import cpu_checkpoint_after_one_step, train_defaults

import builder
from infra import checkpoint, checkpoint_file
from infra.distributed import Ranks
from trainer import Trainer

CFG = train_defaults(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)


def build():
    torch.manual_seed(0)
    model, optimizer, cycler = builder.build(CFG, 'cpu')
    x = torch.randint(32, (2, 8))
    trainer = Trainer(CFG, model, optimizer, cycler, itertools.repeat((x, x, None)), 'cpu')
    trainer.step()  # optimizer state exists
    return trainer.state_objects()


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


def test_a_full_disk_inside_torch_save_is_one_line_too(tmp_path, monkeypatch):
    """torch.save's zip writer reports ENOSPC as a RuntimeError, not an OSError."""
    objects = build()
    save(tmp_path / 'ckpt.pt', objects)
    good = (tmp_path / 'ckpt.pt').read_bytes()

    def zip_writer_fails(obj, path):
        raise RuntimeError(
            "[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
            "data/3: file write failed"
        )

    monkeypatch.setattr(torch, 'save', zip_writer_fails)
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"^cannot write .*ckpt.pt \(\[enforce fail at .*file write "
        r"failed\); the previous checkpoint is intact",
    ):
        save(tmp_path / 'ckpt.pt', objects, iter_num=2)
    assert (tmp_path / 'ckpt.pt').read_bytes() == good and os.listdir(tmp_path) == ['ckpt.pt']


def test_the_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, 'fsync', lambda fd: (order.append('fsync'), real_fsync(fd))[1])
    monkeypatch.setattr(os, 'replace', lambda a, b: (order.append('replace'), real_replace(a, b))[1])
    save(tmp_path / 'ckpt.pt', build())
    assert order == ['fsync', 'replace']


def test_out_dir_checked_and_the_temporary_of_a_killed_save_removed(tmp_path):
    """A killed save leaves its temporary file and the record naming it (name, device, inode): both go. A file
    of the same form that no record names (a user's, a copy's) stays, and so does anything a record names that
    is not a temporary of ckpt.pt in this folder, or not the file the save created (replaced since)."""
    record = tmp_path / '.ckpt.pt.writing'
    (tmp_path / '.ckpt.pt.tmp-999').write_bytes(b'from a save that was killed')
    record.write_text(checkpoint_file.record_text(tmp_path / '.ckpt.pt.tmp-999'))  # what the save wrote
    (tmp_path / '.ckpt.pt.tmp-1000').write_bytes(b'no record names it')
    (tmp_path / 'ckpt.pt').write_bytes(b'kept')
    checkpoint.check_out_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ['.ckpt.pt.tmp-1000', 'ckpt.pt']
    # the name a save's record gave, now another file (its inode differs): the file stays, the record goes
    (tmp_path / '.ckpt.pt.tmp-1').write_bytes(b'replaced')
    record.write_text(checkpoint_file.record_text(tmp_path / '.ckpt.pt.tmp-1'))
    (tmp_path / '.ckpt.pt.tmp-1').rename(tmp_path / 'moved')
    (tmp_path / '.ckpt.pt.tmp-1').write_bytes(b'someone else wrote this')
    checkpoint.check_out_dir(str(tmp_path))
    assert (tmp_path / '.ckpt.pt.tmp-1').read_bytes() == b'someone else wrote this' and not record.exists()
    (tmp_path / 'moved').unlink()
    (tmp_path / '.ckpt.pt.tmp-1').unlink()
    identity = checkpoint_file.record_text(tmp_path / '.ckpt.pt.tmp-1000').split()[1:]
    # not a save's record: a name alone, or not a temporary of ckpt.pt in this folder; nothing removed
    for text in ('.ckpt.pt.tmp-1000', 'ckpt.pt', '../ckpt.pt.tmp-1', ' '.join(['.ckpt.pt.tmp-1000/', *identity])):
        record.write_text(text)
        checkpoint.check_out_dir(str(tmp_path))
        assert sorted(os.listdir(tmp_path)) == ['.ckpt.pt.tmp-1000', '.ckpt.pt.writing', 'ckpt.pt'], text


def test_a_save_never_replaces_or_removes_a_record_it_did_not_write(tmp_path, monkeypatch):
    """A .ckpt.pt.writing that no save wrote (check_out_dir leaves it): the save goes on without a record of its
    own, and the file stays, byte for byte, during the save and after it."""
    (tmp_path / '.ckpt.pt.writing').write_text('ckpt.pt')
    seen = []
    real_save = torch.save

    def save_and_look(obj, f):
        real_save(obj, f)
        seen.append((tmp_path / '.ckpt.pt.writing').read_text())

    monkeypatch.setattr(torch, 'save', save_and_look)
    save(tmp_path / 'ckpt.pt', build())
    assert seen == ['ckpt.pt'] and (tmp_path / '.ckpt.pt.writing').read_text() == 'ckpt.pt'
    assert sorted(os.listdir(tmp_path)) == ['.ckpt.pt.writing', 'ckpt.pt']


def test_a_save_records_its_temporary_file_until_it_is_in_place(tmp_path, monkeypatch):
    """What a kill in the middle of torch.save leaves (the record and the temporary it names) is what
    check_out_dir removes; a save that ends, well or not, leaves neither."""
    seen = []
    real_save = torch.save

    def save_and_look(obj, f):
        real_save(obj, f)
        seen.append(sorted(os.listdir(tmp_path)))
        seen.append((tmp_path / '.ckpt.pt.writing').read_text())

    monkeypatch.setattr(torch, 'save', save_and_look)
    save(tmp_path / 'ckpt.pt', build())
    tmp_name = f'.ckpt.pt.tmp-{os.getpid()}'
    assert seen[0] == sorted(['.ckpt.pt.writing', tmp_name]) and seen[1].split()[0] == tmp_name
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']

    def disk_full(obj, f):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(torch, 'save', disk_full)
    with pytest.raises(checkpoint.CheckpointError, match='No space left'):
        save(tmp_path / 'ckpt.pt', build())
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt']
    (tmp_path / 'file').write_text('x')
    with pytest.raises(checkpoint.CheckpointError, match="cannot hold checkpoints"):
        checkpoint.check_out_dir(str(tmp_path / 'file'))


def test_a_save_never_writes_or_removes_a_temporary_name_it_did_not_create(tmp_path, monkeypatch):
    """A file already at the save's temporary name (another program's, or a save's of a recycled pid) is not
    written over, and is left when the save fails as when it succeeds: the save writes a name of its own."""
    foreign = tmp_path / f'.ckpt.pt.tmp-{os.getpid()}'
    foreign.write_bytes(b'not ours')
    real_save, used = torch.save, []

    def disk_full(obj, f):
        used.append(os.path.basename(f))
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(torch, 'save', disk_full)
    with pytest.raises(checkpoint.CheckpointError, match='No space left'):
        save(tmp_path / 'ckpt.pt', build())
    assert used == [f'.ckpt.pt.tmp-{os.getpid()}-1'] and foreign.read_bytes() == b'not ours'
    assert sorted(os.listdir(tmp_path)) == [foreign.name]
    monkeypatch.setattr(torch, 'save', real_save)
    save(tmp_path / 'ckpt.pt', build())
    assert foreign.read_bytes() == b'not ours' and sorted(os.listdir(tmp_path)) == [foreign.name, 'ckpt.pt']


@pytest.mark.parametrize('precision', ['amp', 'bf16_master'])
def test_a_checkpoint_resumes_on_another_device_type(tmp_path, precision):
    """Written on the CPU, resumed with the model on another device (meta stands in for a GPU: a load
    that put the file's tensors there, as map_location=device did, fails as it does on a GPU): the
    file is read into host memory, the RNG states stay CPU tensors (torch.set_rng_state takes
    nothing else), the optimizer state follows its parameters, and CPU masters (master_device='cpu')
    stay in host memory, bitwise what was saved."""
    cfg = {**CFG, 'precision': precision, 'master_device': 'cpu' if precision == 'bf16_master' else ''}
    path = str(tmp_path / 'ckpt.pt')
    model, optimizer = cpu_checkpoint_after_one_step(cfg, path)
    rng = torch.get_rng_state()
    torch.manual_seed(123)  # another state, which the resume must replace

    saved = checkpoint.read(path, mmap=True)  # as Checkpointer reads it for a GPU
    resumed = builder.resumed_model(saved, cfg, 'meta', path)
    assert all(p.device.type == 'meta' and p.dtype == builder.weight_dtype(precision) for p in resumed.parameters())
    assert all(t.device.type == 'cpu' for t in torch.utils._pytree.tree_leaves(saved) if torch.is_tensor(t))
    resumed, opt, cyc = builder.build(cfg, 'meta', model=resumed)
    checkpoint.load_state(saved, {'model': resumed, 'optimizer': opt, 'cycler': cyc})
    assert checkpoint.restore_rng(saved, Ranks(), 'meta', cfg['seed'], 1)
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(opt.state) == len(optimizer.state) > 0
    for p, q in zip(resumed.parameters(), model.parameters()):
        if q not in optimizer.state:
            continue
        for key, value in opt.state[p].items():
            if key == 'master':  # on the CPU, as saved
                assert value.device.type == 'cpu' and torch.equal(value, optimizer.state[q]['master'])
            elif torch.is_tensor(value) and value.dim() > 0:
                assert value.device == (torch.device('cpu') if precision == 'bf16_master' else p.device), key


def test_a_mapped_read_names_a_bad_file_as_a_plain_read_does(tmp_path):
    """resume maps the file for a GPU (mmap): a file that is not torch.save's zip gets the same one-line
    message as without (torch's mmap error would only say to save with the zip format)."""
    path = tmp_path / 'ckpt.pt'
    path.write_bytes(b'not a checkpoint')
    messages = []
    for mmap in (False, True):
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.read(str(path), mmap=mmap)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and 'UnpicklingError: Weights only load failed' in messages[1]


def test_the_resume_rules_are_one_rule_for_every_reader(tmp_path):
    """train_config.check_resume is the only place the rules are written: a config saved before the
    precision key (amp then) resumes as amp and refuses a given --precision=bf16, and a checkpoint's values
    (run_config, what train.py's Checkpointer hands them to) refuse a given key that cannot continue it;
    keys not given are the checkpoint's, and the builder builds its model."""
    import train_config

    saved = {k: v for k, v in CFG.items() if k != 'precision'}
    model_args = builder.transformer_kwargs(CFG, CFG['vocab_size'])
    assert train_config.check_resume(saved, model_args, {**CFG, 'precision': 'bf16'}, set())['precision'] == 'amp'
    with pytest.raises(ValueError, match=r"^precision='bf16' differs from the checkpoint's 'amp' .*--precision=amp$"):
        train_config.check_resume(saved, model_args, {**CFG, 'precision': 'bf16'}, {'precision'})
    path = str(tmp_path / 'ckpt.pt')
    cpu_checkpoint_after_one_step(CFG, path)
    saved, cfg = {**checkpoint.read(path), 'best_val_loss': 9.0}, {**CFG, 'n_layer': 3, 'init_from': 'resume'}
    with pytest.raises(
        ValueError, match=r"^n_layer=3 conflicts with the checkpoint's 2 \(the weights have that shape\)"
    ):
        train_config.run_config(cfg, {'n_layer'}, saved, path)
    cfg = train_config.run_config(cfg, set(), saved, path)
    assert cfg['n_layer'] == builder.resumed_model(saved, cfg, 'cpu', path).config.n_layer == 2
