"""Sharded checkpoints (infra/checkpoint_dcp.py): checkpoint_format='dcp', the default under torchrun.

What is checked, and how:
- Exact resume: 2 FSDP ranks, N iterations + resume + N more end bit for bit where a straight 2N
  run ends (AdamW, dropout), on the consolidated states.
- The shards are the full state: a straight run writing step folders and the same run writing
  ckpt.pt (gathered on rank 0) hold bitwise the same state (FSDP and DDP), and resuming either on
  one process (resharded by DCP from 2 ranks to 1) continues bitwise alike, from the same data
  position and cycler.
- A crash in the middle of a save (rank 1 SIGKILLs itself while writing its shards, under async
  save) leaves the previous complete checkpoint the newest: the same command again removes the
  broken folder, resumes the previous one and ends bitwise where an uninterrupted run ends.
- keep_last prunes the oldest complete folders; an overwrite=True run removes the earlier run's.
- A non-finite state is never saved; a .metadata that would unpickle code, and a config that cannot
  continue a step folder, are refused in one line.
- sample.py, export.py and eval.py read an out_dir of step folders.
"""

import json
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    DDP_TINY,
    ONE_RANK,
    ROOT,
    TWO_RANKS,
    assert_one_line_error,
    assert_same_state,
    copy_checkpoint,
    forked_torchrun,
    load,
    run_script,
    run_train,
)
from conftest import (
    torchrun_train as train,
)

pytestmark = pytest.mark.torchrun  # launches torchrun (deselect with -m "not torchrun")

RESUME = ['--dropout=0.1', '--omgd_period=4', *TWO_RANKS]  # AdamW; dropout: per-rank RNG streams
FSDP = ['--parallel=fsdp']
STRAIGHT = 16


def folders(out_dir):
    return sorted(n for n in os.listdir(out_dir) if n.startswith('step_'))


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """One torchrun launch (tests/test_ddp.py's runner): straight runs under FSDP and DDP, each
    writing step folders (dcp) and ckpt.pt (file), and the first part of the resumed FSDP run (a normal end at 6)."""
    root = tmp_path_factory.mktemp('dcp')
    runs = [
        (
            f'{parallel}_{fmt}',
            [
                f'--out_dir={root / parallel / fmt}',
                f'--max_iters={STRAIGHT}',
                f'--parallel={parallel}',
                f'--checkpoint_format={fmt}',
                '--eval_interval=4',
                *RESUME,
                # async where the weights are on a GPU: forced here under FSDP, auto (sync) under DDP
                *(['--checkpoint_async=yes'] if parallel == 'fsdp' else []),
            ],
        )
        for parallel in ('fsdp', 'ddp')
        for fmt in ('dcp', 'file')
    ]
    runs.append(('first', [f'--out_dir={root / "first"}', '--max_iters=6', *RESUME, *FSDP, '--checkpoint_format=dcp']))
    run = forked_torchrun('tests/test_ddp.py', env={'DDP_TEST_RUNS': json.dumps(runs)}, timeout=400)
    assert run.proc.returncode == 0, run.out[-3000:]
    logs = dict(re.findall(r'=== (\w+)\n(.*?)(?==== |\Z)', run.out, flags=re.S))
    return root, logs


def test_step_folders_are_kept_complete_and_written_in_the_background_where_asked(runs):
    root, logs = runs
    straight = root / 'fsdp' / 'dcp'
    # saved at 4, 8, 12, 16; keep_last=3 keeps the newest three; no ckpt.pt, no temporary folder
    assert folders(straight) == ['step_0000008', 'step_0000012', 'step_0000016'] and not (straight / 'ckpt.pt').exists()
    assert all((straight / f / '.complete').exists() for f in folders(straight))
    assert 'written to disk in the background' in logs['fsdp_dcp']
    assert 'saved checkpoint to' in logs['ddp_dcp'] and 'in the background' not in logs['ddp_dcp']  # auto on a CPU


# once: a normal end's step folders resumed under FSDP, bitwise, is checked on every torch by test_fsdp.py's
# resume test (and here by the crash test's resume); this one adds an eval_interval changed on resume
@pytest.mark.once
def test_fsdp_resume_from_step_folders_is_exact(runs, tmp_path):
    root, _ = runs
    straight, tmp_path = root / 'fsdp' / 'dcp', tmp_path / 'run'
    shutil.copytree(root / 'first', tmp_path)  # a normal end at 6 (the runs fixture), then resume
    run = train(
        f'--out_dir={tmp_path}',
        f'--max_iters={STRAIGHT}',
        '--init_from=resume',
        *RESUME,
        *FSDP,
        '--checkpoint_format=dcp',
        '--eval_interval=5',
    )
    assert f"resuming from iteration 6 of {tmp_path / 'step_0000006'}" in run.out
    assert_same_state(load(straight), load(tmp_path))


@pytest.mark.parametrize('parallel', ['fsdp', 'ddp'])
def test_shards_hold_the_full_state_and_reshard_to_one_process(runs, tmp_path, parallel):
    root, _ = runs
    dcp_run, file_run = root / parallel / 'dcp', root / parallel / 'file'
    assert folders(file_run) == [] and (file_run / 'ckpt.pt').exists()
    consolidated = load(dcp_run)
    assert consolidated['world_size'] == 2 and consolidated['iter_num'] == STRAIGHT
    assert_same_state(consolidated, load(file_run))  # the shards of every rank are the whole state
    assert consolidated['optimizer']['param_groups'] == load(file_run)['optimizer']['param_groups']
    ends = {}
    for fmt, src in (('dcp', dcp_run), ('file', file_run)):
        copy_checkpoint(src, tmp_path / fmt)
        run = train(
            f'--out_dir={tmp_path / fmt}',
            f'--max_iters={STRAIGHT + 3}',
            '--init_from=resume',
            *ONE_RANK,
            f'--parallel={parallel}',
            ranks=1,
        )
        assert 'resuming a 2-rank checkpoint on 1 rank: same data position' in run.out
        ends[fmt] = load(tmp_path / fmt)
    # one process resumed from the 2-rank shards continues exactly as from the gathered file
    assert_same_state(ends['dcp'], ends['file'])
    assert ends['dcp']['data']['windows_consumed'] == consolidated['data']['windows_consumed'] + 3 * 8


@pytest.fixture(scope='module')
def four_ranks(runs):
    """One 4-rank torchrun launch (tests/test_ddp.py's runner): the FSDP and the DDP run's step folders resumed."""
    root, _ = runs
    resumed = []
    for parallel in ('fsdp', 'ddp'):
        copy_checkpoint(root / parallel / 'dcp', root / 'four' / parallel)
        args = [
            f'--out_dir={root / "four" / parallel}',
            f'--max_iters={STRAIGHT + 3}',
            '--init_from=resume',
            '--batch_size=2',
            '--gradient_accumulation_steps=4',
            f'--parallel={parallel}',
        ]
        resumed.append((parallel, args))
    run = forked_torchrun('tests/test_ddp.py', ranks=4, env={'DDP_TEST_RUNS': json.dumps(resumed)})
    assert run.proc.returncode == 0, run.out[-3000:]
    return dict(re.findall(r'=== (\w+)\n(.*?)(?==== |\Z)', run.out, flags=re.S))


@pytest.mark.parametrize('parallel', ['fsdp', 'ddp'])
def test_a_two_rank_checkpoint_resumes_on_four_ranks(runs, four_ranks, parallel):
    """The same global batch (8 windows an iteration) over 4 ranks: the next windows of the same order,
    none repeated or skipped."""
    root, _ = runs
    saved, log = load(root / parallel / 'dcp'), four_ranks[parallel]
    assert 'resuming a 2-rank checkpoint on 4 ranks: same data position' in log, log[-2000:]
    after = load(root / 'four' / parallel)
    assert after['world_size'] == 4 and after['iter_num'] == STRAIGHT + 3
    assert after['data']['windows_consumed'] == saved['data']['windows_consumed'] + 3 * 8


CRASH_ARGS = [
    *DDP_TINY,
    *RESUME,
    *FSDP,
    f'--max_iters={STRAIGHT}',
    '--eval_interval=4',
    '--init_from=auto',
    '--checkpoint_format=dcp',
    '--checkpoint_async=yes',
]


def test_a_crash_in_the_middle_of_a_save_resumes_the_previous_checkpoint_exactly(runs, tmp_path):
    """Rank 1 is SIGKILLed while writing its shards of step 8 (under async save): torchrun stops the
    job; the same command again (a requeue; torchrun's own --max-restarts cannot re-form a 2-rank
    gloo group here) removes the broken folder, resumes step 4 and ends where a straight run ends."""
    root, _ = runs
    out = tmp_path / 'crashed'
    args = ['tests/test_dcp.py', *CRASH_ARGS, f'--out_dir={out}']
    crashed = forked_torchrun(*args, env={'CRASH_IN_SAVE': 'step_0000008'})
    assert crashed.proc.returncode != 0 and 'rank 1 killed while writing step_0000008' in crashed.out, crashed.out[
        -3000:
    ]
    assert folders(out) == ['step_0000004', 'step_0000008.tmp'], folders(out)
    run = forked_torchrun(*args)
    assert run.proc.returncode == 0, run.out[-3000:]
    assert f'removed step_0000008.tmp from {out}' in run.out and 'resuming from iteration 4' in run.out, run.out[-3000:]
    assert_same_state(load(root / 'fsdp' / 'dcp'), load(out))


def test_keep_last_prunes_and_an_overwrite_removes_the_earlier_run(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=5', '--eval_interval=1', '--checkpoint_format=dcp', '--keep_last=2')
    assert folders(tmp_path) == ['step_0000004', 'step_0000005']
    run_train(
        f'--out_dir={tmp_path}',
        '--max_iters=3',
        '--eval_interval=1',
        '--checkpoint_format=dcp',
        '--keep_last=0',
        '--overwrite=True',
    )
    assert folders(tmp_path) == ['step_0000001', 'step_0000002', 'step_0000003']  # the earlier run's are gone
    assert load(tmp_path)['iter_num'] == 3
    # ckpt.pt and step folders in one out_dir: the later iteration resumes, whatever its format
    run = run_train(
        f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4', '--init_from=resume', '--checkpoint_format=file'
    )  # else the checkpoint's own (a resume takes its config)
    assert f"resuming from iteration 3 of {tmp_path / 'step_0000003'}" in run.stdout and (tmp_path / 'ckpt.pt').exists()
    run = run_train(
        f'--out_dir={tmp_path}', '--max_iters=5', '--eval_interval=5', '--init_from=resume', '--checkpoint_format=dcp'
    )
    assert f"resuming from iteration 4 of {tmp_path / 'ckpt.pt'}" in run.stdout
    assert load(tmp_path)['iter_num'] == 5 and folders(tmp_path)[-1] == 'step_0000005'


def test_an_incomplete_folder_never_resumes_and_only_what_a_save_wrote_is_removed(tmp_path):
    """A save or a removal of this code cut short leaves its marker (checkpoint_dcp.WRITING, REMOVING): the
    next writer removes such folders. A folder it did not write stays, whatever its name, and one that looks
    like a checkpoint is named in a warning: a copy that skipped dotfiles (no .complete), a user's backups."""
    import shutil

    from infra import checkpoint_dcp

    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=2', '--checkpoint_format=dcp')
    for name, marker in (('step_0000006.tmp', checkpoint_dcp.WRITING), ('step_0000008', checkpoint_dcp.REMOVING)):
        shutil.copytree(tmp_path / 'step_0000004', tmp_path / name)  # cut short: shards without .complete
        os.remove(tmp_path / name / '.complete')
        (tmp_path / name / marker).write_text('cut short\n')
    foreign = ['step_0000010', 'step_20', 'step_0000020.bak', 'step_0000010_before_lr_change', 'step_notes']
    for name in foreign[:-1]:
        shutil.copytree(tmp_path / 'step_0000004', tmp_path / name)
    os.remove(tmp_path / 'step_0000010' / '.complete')  # an intact copy that skipped dotfiles
    (tmp_path / 'step_notes').mkdir()
    (tmp_path / 'step_notes' / 'README.txt').write_text('my notes\n')
    run = run_train(f'--out_dir={tmp_path}', '--max_iters=5', '--eval_interval=5', '--init_from=auto')
    assert f"resuming from iteration 4 of {tmp_path / 'step_0000004'}" in run.stdout
    assert 'removed step_0000006.tmp, step_0000008 from' in run.stdout
    warning = [line for line in run.stderr.splitlines() if line.startswith('warning: ') and 'left as it is' in line]
    assert len(warning) == 1 and all(name in warning[0] for name in foreign[:-1]), run.stderr
    assert 'step_notes' not in warning[0]  # it does not look like a checkpoint
    assert folders(tmp_path) == sorted(['step_0000002', 'step_0000004', 'step_0000005', *foreign])
    assert (tmp_path / 'step_notes' / 'README.txt').read_text() == 'my notes\n'
    # a config that cannot continue the step folder is refused in one line, as for ckpt.pt
    refused = run_train(
        f'--out_dir={tmp_path}',
        '--max_iters=8',
        '--init_from=resume',
        '--n_layer=6',
        '--block_size=16',
        expect_ok=False,
    )
    assert_one_line_error(refused, r"^error: block_size=16 differs from the checkpoint's 32 .*; n_layer=6 conflicts")


def stepped_saver(out_dir):
    """(a Saver of out_dir, the objects and values of one trained step) for the in-process save tests."""
    import itertools

    from conftest import train_defaults

    import builder
    from infra import checkpoint_dcp
    from infra.distributed import Ranks
    from trainer import Trainer

    cfg = train_defaults(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    model, optimizer, cycler = builder.build(cfg, 'cpu')
    x = torch.randint(32, (2, 8))
    trainer = Trainer(cfg, model, optimizer, cycler, itertools.repeat((x, x, None)), 'cpu')
    trainer.step()
    values = {'iter_num': 1, 'config': cfg, 'data': {}, 'model_args': {}}
    return checkpoint_dcp.Saver(str(out_dir), Ranks(), keep_last=3), trainer, optimizer, values


def test_a_step_folder_no_save_wrote_is_never_replaced_by_a_save(tmp_path):
    """A step folder missing its .complete (a copy that dropped dot-files, another run's iteration) is left as
    it is: a run that would save that iteration is refused before training, naming it, and a save that meets
    such a folder anyway leaves it and fails in one line (it used to remove the folder by its name)."""
    import filecmp
    import shutil

    from infra import checkpoint

    run_train(
        f'--out_dir={tmp_path}',
        '--max_iters=4',
        '--eval_interval=2',
        '--checkpoint_format=dcp',
        '--always_save_checkpoint=True',
    )
    os.remove(tmp_path / 'step_0000004' / '.complete')
    shutil.copytree(tmp_path / 'step_0000004', tmp_path / 'kept')
    for init_from in ('auto', 'resume'):
        refused = run_train(f'--out_dir={tmp_path}', '--max_iters=6', f'--init_from={init_from}', expect_ok=False)
        assert_one_line_error(
            refused,
            rf"^error: {re.escape(str(tmp_path / 'step_0000004'))} was not written by this "
            r"run and it would save iteration 4 there; move that folder out of out_dir",
        )
    assert not filecmp.dircmp(tmp_path / 'step_0000004', tmp_path / 'kept').diff_files
    assert sorted(os.listdir(tmp_path / 'step_0000004')) == sorted(os.listdir(tmp_path / 'kept'))
    # a run that stops before that iteration leaves it and saves beside it
    run = run_train(f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3', '--init_from=auto')
    assert 'left as it is' in run.stderr and folders(tmp_path) == ['step_0000002', 'step_0000003', 'step_0000004']
    # the save itself never removes a folder it did not write (nor one overwrite=True did not hand over)
    out = tmp_path / 'save'
    shutil.copytree(tmp_path / 'kept', out / 'step_0000001')
    saver, trainer, _, values = stepped_saver(out)
    with pytest.raises(checkpoint.CheckpointError, match=r"step_0000001 exists and this run did not write it"):
        saver.save(trainer.state_objects(), values)
    assert sorted(os.listdir(out / 'step_0000001')) == sorted(os.listdir(tmp_path / 'kept'))
    assert not filecmp.dircmp(out / 'step_0000001', tmp_path / 'kept').diff_files


def test_a_non_finite_state_is_never_saved(tmp_path):
    from infra import checkpoint

    saver, trainer, optimizer, values = stepped_saver(tmp_path)
    saver.save(trainer.state_objects(), values)
    state = next(iter(optimizer.state.values()))
    state['exp_avg_sq'].view(-1)[0] = float('inf')
    with pytest.raises(checkpoint.NonFiniteState):
        saver.save(trainer.state_objects(), {**values, 'iter_num': 2})
    assert folders(tmp_path) == ['step_0000001']
    # a .metadata that would run code when unpickled is refused, in one line
    import pickle

    with open(tmp_path / 'step_0000001' / '.metadata', 'wb') as f:
        pickle.dump(os.system, f)
    with pytest.raises(checkpoint.CheckpointError, match=r"posix.system is not part of a checkpoint index"):
        checkpoint.read_any(str(tmp_path))


def test_sample_export_and_eval_read_step_folders(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4', '--checkpoint_format=dcp')
    assert folders(tmp_path) == ['step_0000004'] and not (tmp_path / 'ckpt.pt').exists()
    result = run_script('sample.py', [f'--out_dir={tmp_path}', '--start=ROMEO:', '--max_new_tokens=20'])
    assert result.returncode == 0 and result.stdout.startswith('ROMEO:'), result.stderr
    result = run_script('export.py', [f'--out_dir={tmp_path}', f'--hf_dir={tmp_path / "hf"}'])
    assert result.returncode == 0 and 'iteration 4 of' in result.stdout, result.stderr
    assert (tmp_path / 'hf' / 'model.safetensors').exists()
    result = run_script('eval.py', [f'--out_dir={tmp_path}', '--eval_iters=1'])
    assert result.returncode == 0, result.stderr[-2000:]
    assert_one_line_error(run_script('sample.py', [f'--out_dir={tmp_path / "none"}']), r'^error: no checkpoint at')


if __name__ == '__main__':
    # the worker torchrun starts for the crash test: train.py's main, where rank 1 writes part of its
    # shards of the folder $CRASH_IN_SAVE and is SIGKILLed (no clean-up); without $CRASH_IN_SAVE, train.py
    import signal

    sys.path.insert(0, ROOT)
    from torch.distributed.checkpoint import filesystem

    import train as train_script

    write_data = filesystem.FileSystemWriter.write_data

    def write_or_die(self, plan, planner):
        if (
            os.path.basename(str(self.path)).startswith(os.environ.get('CRASH_IN_SAVE', '-'))
            and os.environ.get('RANK') == '1'
        ):
            with open(os.path.join(self.path, '__1_0.distcp'), 'wb') as f:
                f.write(b'half a shard')
            print(f"rank 1 killed while writing {os.environ['CRASH_IN_SAVE']}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return write_data(self, plan, planner)

    filesystem.FileSystemWriter.write_data = write_or_die
    sys.exit(train_script.main(sys.argv[1:]))


def test_checkpoint_async_is_the_background_on_a_gpu_and_what_is_asked_elsewhere():
    from infra import checkpoint_dcp

    assert checkpoint_dcp.background('auto', 'cuda') and not checkpoint_dcp.background('auto', 'cpu')
    assert checkpoint_dcp.background('yes', 'cpu') and not checkpoint_dcp.background('no', 'cuda')


@pytest.mark.parametrize('script', ['sample.py', 'eval.py', 'export.py'])
def test_a_step_folder_with_a_short_shard_is_named_by_every_reader(tmp_path, script):
    """sample.py, eval.py and export.py read the newest step folder: a shard cut short is named, with its size
    and the size the index needs (DCP's own error said only 'CheckpointException ranks:dict_keys([0])')."""
    run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', '--checkpoint_format=dcp')
    shard = sorted((tmp_path / 'step_0000002').glob('*.distcp'))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    extra = {
        'sample.py': ['--max_new_tokens=2'],
        'eval.py': ['--eval_iters=1'],
        'export.py': [f'--hf_dir={tmp_path}/hf'],
    }
    result = run_script(script, [f'--out_dir={tmp_path}', *extra[script]])
    assert_one_line_error(
        result,
        rf"step_0000002: shard {shard.name} is 100 bytes, the index needs \d+ \(a copy cut "
        r"short or a lost file\): restore a backup or train from scratch$",
    )


@pytest.mark.parametrize('damage', ['truncated shard', 'missing shard', 'zeroed index', 'truncated ckpt.pt'])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_that_loads(tmp_path, damage):
    """--init_from=auto (what a requeued job runs) resumes from the newest checkpoint that loads, names the
    damaged one and why in a warning, and keeps it, moved aside so that this run's save of the same
    iteration does not replace it."""
    fmt = 'file' if damage == 'truncated ckpt.pt' else 'dcp'
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=2', '--checkpoint_format=dcp')
    newest = tmp_path / 'step_0000004'
    if fmt == 'file':  # a ckpt.pt of iteration 6 beside the folders, cut short
        run_train(
            f'--out_dir={tmp_path}',
            '--max_iters=6',
            '--eval_interval=6',
            '--init_from=resume',
            '--checkpoint_format=file',
        )
        newest = tmp_path / 'ckpt.pt'
        newest.write_bytes(newest.read_bytes()[:5000])
    else:
        shards = sorted(newest.glob('*.distcp'))
        if damage == 'truncated shard':
            shards[0].write_bytes(shards[0].read_bytes()[:100])
        elif damage == 'missing shard':
            shards[0].unlink()
        else:
            (newest / '.metadata').write_bytes(bytes(len((newest / '.metadata').read_bytes())))
    damaged = sorted(p.name for p in newest.rglob('*')) if newest.is_dir() else newest.read_bytes()
    run = run_train(f'--out_dir={tmp_path}', '--max_iters=8', '--eval_interval=4', '--init_from=auto')
    resumed = tmp_path / 'step_0000004' if fmt == 'file' else tmp_path / 'step_0000002'
    assert f"resuming from iteration {4 if fmt == 'file' else 2} of {resumed}" in run.stdout, run.stdout[-2000:]
    warning = [line for line in run.stderr.splitlines() if line.startswith('warning: cannot resume from')]
    assert len(warning) == 1 and str(newest) in warning[0] and f'kept as {newest}.damaged' in warning[0], run.stderr
    aside = tmp_path / f'{newest.name}.damaged'
    assert (sorted(p.name for p in aside.rglob('*')) if aside.is_dir() else aside.read_bytes()) == damaged
    assert load(tmp_path)['iter_num'] == 8
