"""Faults beyond a bad value: a second writer into a running run's out_dir, a writer that crashed,
a reader of the log that goes away. Each ends in one `error:` line (or a clean exit) and loses nothing."""

import os
import re
import signal
import subprocess
import sys

from conftest import ROOT, TINY, Launch, assert_one_line_error, load, run_train


def test_a_second_writer_is_refused_and_a_crashed_one_leaves_no_lock(tmp_path):
    out = tmp_path / 'run'
    first = Launch([sys.executable, 'train.py', *TINY, f'--out_dir={out}', '--max_iters=100000', '--eval_interval=5'])
    try:
        first.wait_for(r'saved checkpoint to ')
        saved = (out / 'ckpt.pt').read_bytes()
        for args in (['--overwrite=True'], ['--init_from=resume'], ['--init_from=auto']):
            result = run_train(f'--out_dir={out}', '--max_iters=3', *args, expect_ok=False)
            assert_one_line_error(
                result,
                rf"out_dir='{out}' is in use by the run of pid {first.proc.pid} on .*, "
                rf"started .*; wait for that run to end or stop it, or choose another --out_dir",
            )
        # evaluating beside it writes nothing, so it is let through, and removes none of its files
        os.kill(first.proc.pid, signal.SIGSTOP)  # no save of the first run between the two reads
        try:
            saved = (out / 'ckpt.pt').read_bytes()
            run_train(f'--out_dir={out}', '--eval_only=True', '--init_from=resume')
            assert (out / 'ckpt.pt').read_bytes() == saved
        finally:
            os.kill(first.proc.pid, signal.SIGCONT)
    finally:
        os.kill(first.proc.pid, signal.SIGKILL)  # a crash: no clean-up, the lock file stays behind
        first.proc.wait()
    iteration = load(out)['iter_num']
    resumed = run_train(f'--out_dir={out}', '--init_from=auto', f'--max_iters={iteration + 2}')
    assert f'resuming from iteration {iteration}' in resumed.stdout


def test_a_lock_that_cannot_be_written_is_refused_before_training(tmp_path):
    """No byte can be written (a full disk, a quota; here the file size limit, which fails a write as a full
    disk does): the lock file's first write fails, and the run stops there in one line naming the lock, not
    at the first save after the training time is spent."""
    import dataloader

    dataloader.prepare_if_embedded('shakespeare_char', verbose=False)  # before the limit: reading needs no writes
    out = tmp_path / 'run'
    limited = (
        "import resource, runpy, signal, sys, torch; sys.path.insert(0, '.'); import builder; "
        "from infra import checkpoint; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); sys.argv = sys.argv[1:]; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, '-c', limited, 'train.py', *TINY, f'--out_dir={out}', '--max_iters=2'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(
        result,
        rf"out_dir='{out}' cannot hold checkpoints: its lock file {out}/\.lock cannot be "
        r"written \(File too large\); free space or choose another --out_dir",
    )
    assert 'iter ' not in result.stdout  # nothing trained


def test_a_log_reader_that_goes_away_does_not_kill_the_run(tmp_path):
    """`python train.py | head -1`: the log is cut, the run trains on and saves."""
    cmd = f"{sys.executable} train.py {' '.join(TINY)} --out_dir={tmp_path} --max_iters=6 --eval_interval=6 | head -1"
    result = subprocess.run(
        ['bash', '-o', 'pipefail', '-c', cmd], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and 'BrokenPipeError' not in result.stderr, result.stderr[-2000:]
    assert result.stdout.count('\n') == 1
    assert load(tmp_path)['iter_num'] == 6


# -----------------------------------------------------------------------------
# legal but almost surely a mistake: a warning line, and the run goes on


def warnings_of(result):
    return [line for line in result.stderr.splitlines() if line.startswith('warning: ')]


def test_values_longer_than_the_run_are_named_in_a_warning(tmp_path):
    result = run_train(f'--out_dir={tmp_path / "a"}', '--max_iters=4', '--omgd_period=6', '--warmup_iters=2')
    assert warnings_of(result) == [
        "warning: omgd_period=6 is as long as the cycling part of the run (4 iterations): "
        "the active set never switches, so most blocks never train; lower --omgd_period"
    ]
    result = run_train(
        f'--out_dir={tmp_path / "b"}', '--max_iters=4', '--omgd_warmup=4', '--warmup_iters=5', '--lr_decay_iters=8'
    )
    assert warnings_of(result) == [
        "warning: omgd_warmup=4 covers the whole run (max_iters=4): every block trains at every step and lisa_wor "
        "never starts; lower --omgd_warmup",
        "warning: warmup_iters=5 is as long as the run (max_iters=4): the learning rate never reaches "
        "learning_rate=0.002; lower --warmup_iters",
    ]
    assert load(tmp_path / 'b')['iter_num'] == 4  # the runs trained
    assert not warnings_of(run_train(f'--out_dir={tmp_path / "c"}', '--max_iters=8'))
    assert warnings_of(run_train(f'--out_dir={tmp_path / "d"}', '--max_iters=0', '--warmup_iters=0')) == [
        "warning: max_iters=0: this run evaluates the initial model and trains nothing; raise --max_iters"
    ]
    assert warnings_of(
        run_train(
            f'--out_dir={tmp_path / "e"}', '--max_iters=8', '--learning_rate=10', '--warmup_iters=0', expect_ok=False
        )
    ) == [
        "warning: learning_rate=10.0 is above 1, where training diverges (AdamW's usual values are 1e-4 to 1e-2); "
        "lower --learning_rate"
    ]


def test_a_resume_that_would_train_nothing_says_what_it_does(tmp_path):
    """It said "evaluates and trains nothing", then evaluated and printed a sample: it says both, and does them."""
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4')
    saved = (tmp_path / 'ckpt.pt').read_bytes()
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=3', '--sample_tokens=5')
    assert (
        "warning: the checkpoint is at iteration 4 and max_iters=3: this run trains nothing and saves no checkpoint: "
        "it evaluates the checkpoint (2 batches of each split), prints a sample of 5 tokens (--sample_tokens=0: none) "
        "and ends; raise --max_iters to train on"
    ) in warnings_of(result)
    assert re.search(r'^step 4: .*\n(.*\n)*sample:\n', result.stdout, re.M) and 'iter 4: ' not in result.stdout
    assert (tmp_path / 'ckpt.pt').read_bytes() == saved
    assert "sample" not in warnings_of(run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=3'))[-1]


# -----------------------------------------------------------------------------
# a checkpoint or a data file that changed or went bad since it was saved


def test_a_checkpoint_with_non_finite_weights_is_refused_by_name(tmp_path):
    import torch

    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4')
    ckpt = load(tmp_path)
    next(iter(ckpt['model'].values())).view(-1)[0] = float('nan')
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    before = (tmp_path / 'ckpt.pt').read_bytes()
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--max_iters=8', expect_ok=False)
    assert_one_line_error(
        result,
        rf"^error: {tmp_path / 'ckpt.pt'} holds weights or optimizer state that are not "
        r"finite \(iteration 4\): it cannot be resumed; restore a backup",
    )
    assert (tmp_path / 'ckpt.pt').read_bytes() == before


def own_dataset(tmp_path):
    """A copy of the prepared character-level Shakespeare, to change under a run."""
    import shutil

    import dataloader

    dataloader.prepare_if_embedded('shakespeare_char', verbose=False)
    shutil.copytree(dataloader.data_dir('shakespeare_char'), tmp_path / 'ds')
    return tmp_path / 'ds'


def test_a_data_file_that_changed_since_the_checkpoint(tmp_path):
    ds = own_dataset(tmp_path)
    run = [f'--out_dir={tmp_path / "run"}', f'--dataset={ds}', '--eval_interval=4']
    run_train(*run, '--max_iters=4')
    train_bin = ds / 'train.bin'
    data = train_bin.read_bytes()
    train_bin.write_bytes(data[: len(data) // 2])  # shorter, the position still inside: a warning
    result = run_train(*run, '--init_from=resume', '--max_iters=5')
    assert len(warnings_of(result)) == 1 and re.search(
        r"^warning: .*train.bin has [\d,]+ tokens, the checkpoint's "
        r"data had [\d,]+: the file changed",
        warnings_of(result)[0],
    )
    train_bin.write_bytes(data[:1000])  # 500 tokens, shorter than the saved position: one line, not numpy's words
    result = run_train(*run, '--init_from=resume', '--max_iters=6', expect_ok=False)
    assert_one_line_error(
        result,
        r"the checkpoint's data position \(\d+ windows into epoch 0\) lies beyond the \d+ "
        r"windows of .*train.bin \(500 tokens, [\d,]+ when it was saved\): the file changed",
    )


def test_a_cpu_index_is_refused(tmp_path):
    result = run_train(f'--out_dir={tmp_path}', '--device=cpu:7', expect_ok=False)
    assert_one_line_error(result, r"^error: device='cpu:7': torch counts the CPU as one device; use --device=cpu$")


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    """wandb (faked: the package is optional) gets the run id the checkpoint saved, with resume='allow',
    so a restart continues the same wandb run instead of starting a new one."""
    import types

    inits, logged = [], []
    fake = types.SimpleNamespace(
        init=lambda **kw: inits.append(kw),
        log=lambda data, step: logged.append(step),
        util=types.SimpleNamespace(generate_id=lambda: f'id{len(inits)}'),
    )
    monkeypatch.setitem(sys.modules, 'wandb', fake)
    run_train(f'--out_dir={tmp_path}', '--wandb_log=True', '--max_iters=4', '--eval_interval=4')
    run_train(f'--out_dir={tmp_path}', '--wandb_log=True', '--max_iters=6', '--eval_interval=4', '--init_from=auto')
    assert [(kw['id'], kw['resume']) for kw in inits] == [('id0', 'allow'), ('id0', 'allow')]
    assert load(tmp_path)['wandb_id'] == 'id0' and logged[-1] == 6


def test_a_resume_takes_the_checkpoints_config_and_names_every_conflict(tmp_path):
    """Resuming needs only the out_dir: the checkpoint's config (TINY's model, batch, schedule) comes
    back, and the run ends bitwise where a straight run ends; keys that cannot change are all named."""
    from conftest import assert_same_state, run_script

    run_train(f'--out_dir={tmp_path / "straight"}', '--max_iters=6', '--eval_interval=3')
    run_train(f'--out_dir={tmp_path / "resumed"}', '--max_iters=3', '--eval_interval=3')
    # --device: the machine's keys are this command's (a GPU machine would resume on its GPU, in bf16)
    resume = [f'--out_dir={tmp_path / "resumed"}', '--init_from=resume', '--max_iters=6', '--device=cpu']
    result = run_script('train.py', resume)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_state(load(tmp_path / 'straight'), load(tmp_path / 'resumed'))
    result = run_script(
        'train.py',
        [f'--out_dir={tmp_path / "resumed"}', '--init_from=resume', '--n_layer=6', '--block_size=16', '--method=lisa'],
    )
    assert_one_line_error(
        result,
        r"^error: method='lisa' differs from the checkpoint's 'lisa_wor' .*; block_size=16 "
        r"differs from the checkpoint's 32 .*; n_layer=6 conflicts with the checkpoint's 4 ",
    )


def test_a_gpu_config_on_a_machine_without_a_gpu_is_refused_at_once():
    import pytest
    import torch
    from conftest import run_script

    if torch.cuda.is_available():
        pytest.skip('this machine has a GPU')
    result = run_script('train.py', ['config/llama7b_lisa_wor.py', '--dataset=c4'])
    assert_one_line_error(
        result,
        r"^error: this is a GPU config \(gpu_config=True\) and this machine has no CUDA GPU "
        r".*; run it on a GPU, or pass --device=cpu to run it on the CPU anyway$",
    )
    assert 'config:' not in result.stdout  # before anything is read or built


def test_sizes_no_machine_holds_are_named_at_once(tmp_path):
    for arg in ('--n_layer=1000000000000', '--n_embd=1000000000000'):
        result = run_train(f'--out_dir={tmp_path}', arg, '--n_head=1', expect_ok=False)
        assert_one_line_error(result, r"make a model of over 10\^14 parameters; lower --n_layer or --n_embd$")


def test_a_large_data_seed_trains():
    import tempfile

    import numpy as np
    import torch

    from dataloader import TokenBatches

    with tempfile.TemporaryDirectory() as d:
        np.arange(5000, dtype=np.uint16).tofile(f'{d}/t.bin')
        for sampling in ('rr', 'iid'):
            starts = TokenBatches(f'{d}/t.bin', 15, 4, sampling, seed=10**18).next_starts()
            assert len(starts) == 4 and torch.all(starts < 5000)


def test_records_that_cannot_be_written_stop_with_a_warning_and_the_run_goes_on(tmp_path):
    """out_dir/metrics.jsonl not writable (here a folder of that name): one warning, then the run trains and
    saves as it would (was: an IsADirectoryError traceback at the first record)."""
    (tmp_path / 'metrics.jsonl').mkdir()
    result = run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2')
    assert [w for w in warnings_of(result) if 'metrics.jsonl' in w] == [
        f"warning: cannot write {tmp_path / 'metrics.jsonl'} (Is a directory): this run's records stop here, its "
        f"checkpoints and log go on; free space or fix that path before the next run"
    ]
    assert load(tmp_path)['iter_num'] == 2


def test_ctrl_c_during_the_setup_is_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C before the loop installs its own stop (here while the data is opened): one error line, exit 130,
    no traceback, and no out_dir left behind by a run that saved nothing."""
    import train

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, 'open_data', interrupted)
    from conftest import TINY

    status = train.main([*TINY, f'--out_dir={tmp_path / "run"}'])
    err = capsys.readouterr().err
    assert status == 130 and not (tmp_path / 'run').exists()
    assert err.strip().splitlines()[-1] == "error: interrupted (Ctrl-C); the last checkpoint, if any, is as it was"
    assert 'Traceback' not in err


def test_a_shard_zeroed_inside_falls_back_in_every_reader(tmp_path, capsys):
    """64 KiB zeroed inside the newest step folder's shard (same size, index intact): the readers (read_any:
    sample.py, eval.py, export.py) and a resume read the older folder, each naming both in one warning (the
    resume ended in 'cannot read checkpoint ... restore a backup or train from scratch'); the folder set aside
    draws no second warning calling it incomplete."""
    from infra import checkpoint

    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=2', '--checkpoint_format=dcp')
    shard = sorted((tmp_path / 'step_0000004').glob('*.distcp'))[0]
    size = shard.stat().st_size
    with open(shard, 'r+b') as f:
        f.seek(size // 2)
        f.write(bytes(65536))
    assert shard.stat().st_size == size
    capsys.readouterr()
    saved, path = checkpoint.read_any(str(tmp_path), optimizer=False)
    warned = capsys.readouterr().err.strip().splitlines()
    assert saved['iter_num'] == 2 and path == str(tmp_path / 'step_0000002')
    assert len(warned) == 1 and re.fullmatch(
        rf"warning: cannot read {tmp_path / 'step_0000004'} \(shard {shard.name} is damaged \(the record at byte "
        rf"\d+\): .*\): reading {path} \(iteration 2\) instead",
        warned[0],
    ), warned
    run = run_train(f'--out_dir={tmp_path}', '--max_iters=6', '--eval_interval=2', '--init_from=auto')
    assert f"resuming from iteration 2 of {path}" in run.stdout
    assert [w.split(' (')[0] for w in warnings_of(run)] == [f"warning: cannot resume from {shard.parent}"], run.stderr
    assert (tmp_path / 'step_0000004.damaged' / shard.name).stat().st_size == size
    assert load(tmp_path)['iter_num'] == 6


def test_step_folders_without_their_complete_file_are_named_for_what_they_are(tmp_path):
    """Every step folder lacks .complete (a copy that dropped dot-files): a resume and sample.py name the folders
    and the missing file, instead of 'no checkpoint at .../ckpt.pt' (a file the run never had) with advice to train
    from scratch; an out_dir that is a file is named as one."""
    from conftest import run_script

    for step in ('step_0000010', 'step_0000020'):
        (tmp_path / step).mkdir()
        (tmp_path / step / 'values.pt').write_bytes(b'')
    expected = (
        rf"^error: no complete checkpoint in {tmp_path}: it holds step_0000010 \(no \.complete file\), step_0000020 "
        r"\(no \.complete file\); restore the \.complete file of a step folder that is whole"
    )
    assert_one_line_error(run_train(f'--out_dir={tmp_path}', '--init_from=resume', expect_ok=False), expected)
    assert_one_line_error(run_script('sample.py', [f'--out_dir={tmp_path}']), expected)
    assert sorted(os.listdir(tmp_path / 'step_0000020')) == ['values.pt']
    (tmp_path / 'a_file').write_text('x')
    assert_one_line_error(
        run_script('sample.py', [f'--out_dir={tmp_path / "a_file"}']),
        rf"out_dir='{tmp_path / 'a_file'}' is a file, not a directory; give the --out_dir of a train\.py run",
    )
