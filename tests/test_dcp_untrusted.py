"""A step folder from elsewhere runs no code (issue 44). Its .metadata passes the index unpickler
(DCP's own classes only) yet declares a weight as a BytesStorageMetadata item pointing at a pickle
in an extra .distcp file; DCP's default planner would read it with torch.load(weights_only=False).
Every reader of step folders (train.py --init_from=resume and auto, in one process and under
torchrun; sample.py, eval.py, export.py) refuses it in one `error:` line naming the folder: the
payload never runs, and nothing in out_dir is removed."""

import os
import pickle
import re

import pytest
import torch
from conftest import assert_one_line_error, run_script, run_train, torchrun_train
from test_foreign_files import digest

REFUSED = (
    r"\.metadata declares 'model\.[\w.]+' a pickled Python object, which train\.py never saves and which "
    r"could run code when read: refused; restore a backup or train from scratch$"
)


class Payload:
    """What an attacker pickles: unpickling it calls open(marker, 'w'), creating the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, 'w')


def plant(folder, marker):
    """Rewrite the step folder's .metadata as an attacker would: its first weight becomes a bytes item
    read from an extra __9_0.distcp holding Payload (torch.save's format, as DCP writes bytes items)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(folder / '.metadata', 'rb') as f:
        index = pickle.load(f)  # our own test's file: trusted here
    key = next(k for k in index.state_dict_metadata if k.startswith('model.'))
    with open(folder / '__9_0.distcp', 'wb') as f:
        torch.save(Payload(marker), f)
    index.state_dict_metadata[key] = BytesStorageMetadata()
    index.storage_data[MetadataIndex(key)] = _StorageInfo('__9_0.distcp', 0, os.path.getsize(folder / '__9_0.distcp'))
    with open(folder / '.metadata', 'wb') as f:
        pickle.dump(index, f)


@pytest.fixture(scope='module')
def planted(tmp_path_factory):
    """(out_dir, its step folder, the marker path): a tiny run's step folder, then planted."""
    out = tmp_path_factory.mktemp('untrusted') / 'run'
    run_train(f'--out_dir={out}', '--max_iters=2', '--eval_interval=2', '--checkpoint_format=dcp')
    folder = out / 'step_0000002'
    marker = out.parent / 'payload_ran'
    plant(folder, marker)
    return out, folder, marker


def unrun(planted):
    """The digest of out_dir before a read, the marker of an earlier test's read removed."""
    out, _, marker = planted
    if marker.exists():
        os.remove(marker)
    return digest(out)


def assert_refused(result, planted, before):
    out, folder, marker = planted
    assert not marker.exists(), 'the pickle in the step folder ran'
    assert_one_line_error(result, REFUSED)
    assert str(folder) in result.stderr.strip().splitlines()[-1]
    assert digest(out) == before  # nothing removed or rewritten


@pytest.mark.parametrize('init_from', ['resume', 'auto'])
def test_train_refuses_a_step_folder_whose_index_declares_pickled_bytes(planted, init_from):
    out = planted[0]
    before = unrun(planted)
    result = run_train(f'--out_dir={out}', '--max_iters=4', f'--init_from={init_from}', expect_ok=False)
    assert_refused(result, planted, before)


@pytest.mark.parametrize(
    'script, argv',
    [
        ('sample.py', ['--start=ROMEO:', '--max_new_tokens=5']),
        ('eval.py', ['--eval_iters=1']),
        ('export.py', ['--hf_dir={hf}']),
    ],
)
def test_sample_eval_and_export_refuse_it(planted, tmp_path, script, argv):
    out = planted[0]
    before = unrun(planted)
    result = run_script(script, [f'--out_dir={out}', *(a.format(hf=tmp_path / 'hf') for a in argv)])
    assert_refused(result, planted, before)
    assert not (tmp_path / 'hf').exists()


def test_the_read_path_itself_never_unpickles_bytes(planted, monkeypatch):
    """Belt and braces, past the index check: the reader refuses a bytes item before reading it
    (whatever the planner: DCP's own would unpickle it), and the planner refuses to unpickle one
    (whatever the reader); through dcp.load, the same one line."""
    import io

    import torch.distributed.checkpoint as dcp

    from infra import checkpoint, checkpoint_dcp

    _, folder, marker = planted
    unrun(planted)
    monkeypatch.setattr(checkpoint_dcp, '_tensors_only', lambda path, index: None)
    index = checkpoint_dcp.SafeReader(str(folder)).read_metadata()
    key = next(k for k in index.state_dict_metadata if k.startswith('model.'))
    state = {key: torch.empty(0)}
    planner = dcp.DefaultLoadPlanner()
    planner.set_up_planner(state, index)
    plan = planner.create_local_plan()
    reader = checkpoint_dcp.SafeReader(str(folder))
    reader.set_up_storage_reader(index, True)
    with pytest.raises(checkpoint.CheckpointError, match=REFUSED):
        reader.read_data(plan, planner)
    planner = checkpoint_dcp._TensorsOnly(str(folder))
    planner.set_up_planner(state, index)
    with pytest.raises(checkpoint.CheckpointError, match=REFUSED):
        planner.load_bytes(plan.items[0], io.BytesIO((folder / '__9_0.distcp').read_bytes()))
    with pytest.raises(checkpoint.CheckpointError, match=REFUSED):
        checkpoint_dcp._load(state, str(folder))
    assert not marker.exists()


@pytest.mark.torchrun
def test_a_two_rank_resume_refuses_it_on_every_rank(planted):
    """Under torchrun (what a requeued job runs): every rank stops with the one line, none hangs."""
    out, folder, marker = planted
    before = unrun(planted)
    run = torchrun_train(
        f'--out_dir={out}',
        '--max_iters=4',
        '--init_from=auto',
        '--batch_size=4',
        '--gradient_accumulation_steps=2',
        expect_ok=False,
    )
    assert run.proc.returncode != 0 and not marker.exists(), run.out[-3000:]
    assert not re.search(r'\[rank\d\]: Traceback', run.out), run.out[-3000:]  # torchrun's own report aside
    errors = [line for line in run.out.splitlines() if line.startswith('error: ')]
    # torchrun stops the other rank once one exits with an error, at times before that rank printed its line
    assert 1 <= len(errors) <= 2, run.out[-3000:]
    assert all(re.search(REFUSED, line) and str(folder) in line for line in errors), run.out[-3000:]
    assert digest(out) == before
