"""train.py end to end on CPU: falling loss, exact resume, and its one-line refusals."""

import contextlib
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import (
    ROOT,
    TINY,
    assert_one_line_error,
    assert_same_state,
    load,
    records,
    run_train,
    train_defaults,
)

import builder
import train_config
from dataloader import TokenBatches
from trainer import get_lr


def test_short_run_loss_falls_with_visible_switching(tmp_path):
    """The records of each kind, field by field (the log line's format is tests/test_metrics.py's one test)."""
    out = run_train(f'--out_dir={tmp_path}', '--max_iters=60', '--eval_interval=30', '--learning_rate=3e-3').stdout
    evals = records(tmp_path, 'eval')
    assert [r['iter'] for r in evals] == [0, 30, 60] and evals[-1]['val_loss'] < evals[0]['val_loss'] - 0.5
    assert all(0 < r['train_loss'] < 5 for r in evals)
    switches = records(tmp_path, 'switch')
    assert [s['iter'] for s in switches] == list(range(0, 60, 3))
    for s in switches:  # every part that trains: the outer parts (omgd_always) and the 2 cycled blocks
        assert s['trains'] == {'outer': ['embed', 'pos', 'norm', 'head'], 'blocks': s['active']}
        assert len(s['active']) == 2 and s['ddp_rebuild_ms'] is None
        assert f"iter {s['iter']}: {s['description']}\n" in out
    iters = {r['iter']: r for r in records(tmp_path, 'iter')}
    assert sorted(iters) == list(range(60))
    cfg = load(tmp_path)['config']
    for it, r in iters.items():  # the rate the optimizer applied, which the schedule gives
        assert r['lr'] == get_lr(it, cfg) and r['ms'] > 0 and r['tok_per_s'] > 0 and 0 < r['epoch'] < 1
        assert r['loss'] > 0
    saves = records(tmp_path, 'save')
    assert [(r['iter'], r['path']) for r in saves] == [(30, str(tmp_path / 'ckpt.pt')), (60, str(tmp_path / 'ckpt.pt'))]
    [end] = records(tmp_path, 'end')
    assert end['iter'] == 60 and end['stopped'] is False and end['seconds'] > 0


@pytest.mark.parametrize(
    'precision', [[], ['--precision=bf16'], ['--precision=bf16_master', '--master_device=cpu', '--omgd_state=offload']]
)
def test_resume_is_bitwise_exact(tmp_path, precision):
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    common = ['--eval_interval=5', '--dropout=0.1', '--omgd_period=4', *precision]
    run_train(f'--out_dir={straight}', '--max_iters=12', *common)
    run_train(f'--out_dir={split}', '--max_iters=6', *common)
    first = load(split)
    assert first['iter_num'] == 6 and first['config']['max_iters'] == 6
    assert all(not k.startswith('_orig_mod') for k in first['model'])
    run_train(f'--out_dir={split}', '--max_iters=12', '--init_from=resume', *common)
    a, b = load(straight), load(split)
    assert a['iter_num'] == b['iter_num'] == 12
    assert_same_state(a, b)


def test_resume_refuses_another_block_size_and_eval_only_evaluates(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=6', '--eval_interval=4')
    ckpt = load(tmp_path)
    assert ckpt['model_args']['block_size'] == 32 and ckpt['model']['wpe.weight'].shape[0] == 32
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--block_size=16', expect_ok=False)
    assert_one_line_error(result, r"block_size=16 differs from the checkpoint's 32 .*--block_size=32$")
    # eval_only evaluates even at an iteration that is no multiple of eval_interval, and saves nothing
    before = (tmp_path / 'ckpt.pt').read_bytes()
    out = run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--eval_interval=4', '--eval_only=True').stdout
    assert re.search(r'^step 6: ', out, re.M), out
    assert (tmp_path / 'ckpt.pt').read_bytes() == before


def test_float16_trains_with_loss_scaling_and_resumes(tmp_path):
    # CPU computes in float32, but the GradScaler path (scale, unscale, step, update, resume) runs
    run_train(f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3', '--dtype=float16')
    assert load(tmp_path)['scaler']['scale'] == 65536.0
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4', '--dtype=float16', '--init_from=resume')
    assert load(tmp_path)['iter_num'] == 4
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', '--precision=bf16', expect_ok=False)
    assert_one_line_error(result, r"precision='bf16' differs from the checkpoint's 'amp' .*--precision=amp$")


def test_missing_data_names_the_prepare_command(tmp_path):
    result = run_train(f'--out_dir={tmp_path}', '--dataset=openwebtext', expect_ok=False)  # a script, no data yet
    assert_one_line_error(result, r'openwebtext/train.bin not found; run `python data/openwebtext/prepare.py` first$')
    # a name with no prepare script (mistyped): the datasets there are, not a command that cannot run
    result = run_train(f'--out_dir={tmp_path}', '--dataset=openwebtext_missing', expect_ok=False)
    assert_one_line_error(result, r"no data/openwebtext_missing/prepare.py either: the datasets are c4, openwebtext, ")


def refusal(*args, world_size=1, fsdp=False):
    """The message of train.py's one-line error for these arguments, found in-process, in
    train.py's order: the config (train_config.load: types, rules, combinations), those of the
    launch (train_config.check_parallel), the data loader's, the model's and the cycler's."""
    try:
        cfg = train_config.load([*TINY, *args], defaults=train_defaults())
        train_config.check_parallel(cfg, world_size, fsdp)
        with contextlib.suppress(FileNotFoundError):  # only the arguments are checked here, no data read
            TokenBatches(os.path.join(ROOT, 'no such data.bin'), cfg['block_size'], cfg['batch_size'], cfg['sampling'])
        builder.build(cfg, 'cpu', vocab_size=65)
    except ValueError as e:  # configurator.ConfigError is one
        return str(e)


@pytest.mark.parametrize(
    'arg, pattern',
    [
        ('--lerning_rate=1e-3', r"unknown config key 'lerning_rate'.*learning_rate"),
        ('--max_iters=ten', r"max_iters='ten' is not a valid int"),
        ('--max_iters=1.5', r'expected int'),
        ('--compile=maybe', r'not a valid bool'),
        ('--method=lisa_wr', r"unknown method 'lisa_wr'; choose one of full, lisa, .*, tensor_iid, galore, golore$"),
        ('--omgd_gamma=9', r'omgd_gamma must be in 1\.\.4'),
        ('--n_head=3', r'n_embd=32 is not divisible by n_head=3'),
        ('--dtype=fp16', r"unknown dtype 'fp16'; choose one of float32, bfloat16, float16"),
        ('--gradient_accumulation_steps=0', r'gradient_accumulation_steps must be >= 1, got 0'),
        ('--parallel=zero', r"parallel must be 'ddp' or 'fsdp', got 'zero'"),
        ('--preset=gpt5', r"unknown preset 'gpt5'; choose one of .*gpt2"),
        # TINY's --n_layer=4 beside a preset would be ignored (the preset sets the architecture)
        (
            '--preset=llama-60m',
            r"preset='llama-60m' sets the architecture, so n_layer=4 would be ignored; pass --preset=''",
        ),
        (
            '--init_from=bert',
            r"init_from must be 'scratch', 'resume', 'auto', a GPT-2 name or a Hugging Face model directory, "
            r"got 'bert'",
        ),
        ('--optimizer=lion', r"optimizer must be 'adamw' or 'sgd', got 'lion'"),
        ('--sampling=seq', r"sampling must be 'rr' or 'iid', got 'seq'"),
        ('--golore_svd_fraction=1.5', r'golore_svd_fraction must be in \[0, 1\], got 1\.5'),
        ('--omgd_warmup=-1', r'omgd_warmup must be >= 0, got -1'),
        ('--omgd_always=embed,tail', r"unknown omgd_always part\(s\) \['tail'\]"),
        ('CONFIG_WITH_SYNTAX_ERROR', r"config file .*bad\.py', line 2: SyntaxError"),
    ],
)
def test_bad_config_is_one_line_error(tmp_path, arg, pattern):
    if arg == 'CONFIG_WITH_SYNTAX_ERROR':
        arg = str(tmp_path / 'bad.py')
        (tmp_path / 'bad.py').write_text("max_iters = 10\nmethod = 'lisa\n")
    message = refusal(arg)
    assert message is not None and '\n' not in message and re.search(pattern, message), message
    assert refusal() is None  # TINY itself trains


@pytest.mark.parametrize(
    'args, world_size, fsdp, pattern',
    [
        (['--dtype=float16'], 2, True, r"dtype='float16' is not supported with parallel='fsdp'.*--dtype=bfloat16$"),
        (['--omgd_state=offload'], 2, True, r"omgd_state='offload' is not supported with parallel='fsdp'"),
        (['--eval_mc_path=mc.jsonl'], 2, True, r"eval_mc_path is not supported with parallel='fsdp'"),
        (
            ['--precision=bf16_master'],
            2,
            True,
            r"precision='bf16_master' is not supported with parallel='fsdp'.*"
            r"--precision=amp$",
        ),
        (['--method=galore'], 2, True, r"method='galore' is not supported with parallel='fsdp'.*--parallel=ddp$"),
        (
            ['--gradient_accumulation_steps=3'],
            2,
            False,
            r"gradient_accumulation_steps=3 counts micro-steps summed over "
            r"all ranks and must be a multiple of the 2 ranks, e\.g\. "
            r"--gradient_accumulation_steps=4 \(tokens per iteration",
        ),
    ],
)
def test_launch_refuses_what_its_ranks_cannot_train(args, world_size, fsdp, pattern):
    message = refusal(*args, world_size=world_size, fsdp=fsdp)
    assert message is not None and '\n' not in message and re.search(pattern, message), message
    assert refusal(*args) is None  # what one process trains


def test_train_py_turns_a_refusal_into_one_line(tmp_path):
    # the in-process checks above are what train.py prints, as `error: ...` with a non-zero exit
    result = run_train(f'--out_dir={tmp_path}', '--method=lisa_wr', expect_ok=False)
    assert_one_line_error(result, r"^error: unknown method 'lisa_wr'; choose one of full, lisa, .*, golore$")
    assert not (tmp_path / 'ckpt.pt').exists()


def test_missing_and_corrupt_checkpoint_on_resume(tmp_path):
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', expect_ok=False)
    assert_one_line_error(result, r'no checkpoint at .*ckpt\.pt')
    (tmp_path / 'ckpt.pt').write_bytes(b'not a checkpoint')
    result = run_train(f'--out_dir={tmp_path}', '--init_from=resume', expect_ok=False)
    # the whole sentence: torch's own message used to be cut mid-sentence
    assert_one_line_error(
        result,
        r"cannot read checkpoint .*ckpt\.pt \(UnpicklingError: Weights only load failed\); "
        r"it is corrupt, truncated or from another program: restore a backup or train "
        r"from scratch$",
    )
    assert (tmp_path / 'ckpt.pt').read_bytes() == b'not a checkpoint'


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=2')
    good = (tmp_path / 'ckpt.pt').read_bytes()
    result = run_train(
        f'--out_dir={tmp_path}',
        '--max_iters=8',
        '--eval_interval=2',
        '--init_from=resume',
        '--learning_rate=1e30',
        expect_ok=False,
    )  # finite, and diverges at once
    assert_one_line_error(
        result,
        rf"loss is nan at iteration \d+; kept the last good checkpoint "
        rf"{tmp_path / 'ckpt.pt'} \(iteration 4\); lower learning_rate",
    )
    assert (tmp_path / 'ckpt.pt').read_bytes() == good
    # a run that saved nothing says so (the message used to name a checkpoint that did not exist)
    result = run_train(
        f'--out_dir={tmp_path / "fresh"}', '--max_iters=8', '--eval_interval=2', '--learning_rate=1e30', expect_ok=False
    )
    assert_one_line_error(result, r"loss is nan at iteration \d+; this run saved no checkpoint; lower learning_rate")
    assert not (tmp_path / 'fresh' / 'ckpt.pt').exists()


def test_new_run_does_not_silently_replace_a_checkpoint(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3')
    first = (tmp_path / 'ckpt.pt').read_bytes()
    result = run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', expect_ok=False)
    assert_one_line_error(
        result,
        rf"{tmp_path / 'ckpt.pt'} holds iteration 3 of an earlier run; continue it with "
        rf"--init_from=resume, choose another --out_dir, or pass --overwrite=True",
    )
    assert (tmp_path / 'ckpt.pt').read_bytes() == first
    out = run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2', '--overwrite=True').stdout
    assert 'holds iteration 3 of an earlier run; this run\'s first save replaces it' in out
    assert load(tmp_path)['iter_num'] == 2
    out = run_train(f'--out_dir={tmp_path}', '--max_iters=3', '--eval_interval=3', '--init_from=resume').stdout
    assert f"resuming from iteration 2 of {tmp_path / 'ckpt.pt'}" in out


@pytest.mark.parametrize('signame', ['SIGTERM', 'SIGHUP'])  # SIGHUP: a closed terminal or ssh session
def test_sigterm_saves_and_exits_with_the_signal_status(tmp_path, signame):
    import signal

    sig = getattr(signal, signame)
    proc = subprocess.Popen(
        [sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', '--max_iters=100000', '--eval_interval=100000'],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith('iter 3: loss'):
            proc.send_signal(sig)
            break
    out = ''.join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 128 + sig, out[-2000:]  # 143 (129): not a finished run
    stopped = int(re.search(r'rank 0: stop requested, stopping at iteration (\d+)', out).group(1))
    assert load(tmp_path)['iter_num'] == stopped > 3


def test_iid_sampling_on_a_split_smaller_than_one_batch(tmp_path):
    data = tmp_path / 'small'
    data.mkdir()
    for split in ('train', 'val'):
        np.arange(50, dtype=np.uint16).tofile(data / f'{split}.bin')  # 4 windows of 9 tokens, batch of 8
    run_train(
        f'--out_dir={tmp_path}',
        f'--dataset={data}',
        '--block_size=8',
        '--vocab_size=64',
        '--sampling=iid',
        '--max_iters=3',
        '--eval_interval=3',
    )  # was a ZeroDivisionError
    # 4 batches of 8 windows drawn (3 trained, 1 prefetched) from 4 windows of data
    assert records(tmp_path, 'iter')[-1]['epoch'] == 8.0


def test_llama_resume_refuses_another_block_size(tmp_path):
    llama = ['--arch=llama', '--max_iters=2', '--eval_interval=2']
    run_train(f'--out_dir={tmp_path}', *llama)
    result = run_train(f'--out_dir={tmp_path}', *llama, '--init_from=resume', '--block_size=16', expect_ok=False)
    assert_one_line_error(
        result,
        r"block_size=16 differs from the checkpoint's 32 \(the data position counts "
        r"windows of block_size\+1 tokens\); resume with --block_size=32$",
    )


def test_block_size_larger_than_data(tmp_path):
    data = tmp_path / 'tiny'
    data.mkdir()
    for split in ('train', 'val'):
        np.arange(50, dtype=np.uint16).tofile(data / f'{split}.bin')
    result = run_train(
        f'--out_dir={tmp_path}', f'--dataset={data}', '--block_size=64', '--vocab_size=64', expect_ok=False
    )
    assert_one_line_error(result, r'has 50 tokens, too few for block_size=64')


def test_every_method_runs_from_config(tmp_path):
    # one process per method would cost seconds each; two short runs cover the switch paths
    for method in ('full', 'lisa', 'tensor_wor'):
        run_train(
            f'--out_dir={tmp_path / method}',
            '--max_iters=4',
            f'--method={method}',
            '--eval_interval=100',
            '--optimizer=sgd' if method == 'tensor_wor' else '--optimizer=adamw',
        )
        assert [r['iter'] for r in records(tmp_path / method, 'eval')] == [0, 4]


def test_golore_svd_fraction_sets_the_svd_steps(tmp_path):
    run_train(
        f'--out_dir={tmp_path}',
        '--method=golore',
        '--galore_rank=4',
        '--golore_svd_fraction=0.5',
        '--max_iters=5',
        '--eval_interval=5',
    )
    groups = load(tmp_path)['optimizer']['param_groups']
    assert [g['svd_steps'] for g in groups if 'rank' in g] == [3]  # ceil(0.5 x 5)


def test_leftover_blocks_are_named_at_start(tmp_path):
    out = run_train(f'--out_dir={tmp_path}', '--omgd_gamma=3', '--max_iters=1', '--eval_interval=1').stdout
    assert (
        "lisa_wor with N_L=4, gamma=3: N_L mod gamma = 1 random block sits out each cycle, so a cycle's "
        "masks do not sum to M x 1 (Algorithm 1 holds only when gamma divides N_L)\n"
    ) in out
    assert 'sits out' not in run_train(f'--out_dir={tmp_path / "even"}', '--max_iters=1', '--eval_interval=1').stdout
