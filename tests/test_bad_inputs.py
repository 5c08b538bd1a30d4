"""Every entry point, given bad input or a fault: a non-zero exit, one `error:` line naming what to
do, no traceback, and an existing checkpoint and existing reports left byte for byte as they were.
In-process (conftest.run_script): the scripts' own checks are under test, not Python's start-up."""

import hashlib
import json
import os
import re
import shutil

import pytest
import torch
from conftest import TINY, assert_one_line_error, run_script


def digest(folder):
    """{file name: sha256} of every file in `folder` but the out_dir lock (it names its last holder, no data)."""
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), 'rb').read()).hexdigest()
        for name in sorted(os.listdir(folder))
        if name != '.lock'
    }


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A finished tiny run: out_dir with its ckpt.pt."""
    out = tmp_path_factory.mktemp('trained')
    result = run_script('train.py', [*TINY, f'--out_dir={out}', '--max_iters=4', '--eval_interval=2'])
    assert result.returncode == 0, result.stderr[-2000:]
    return out


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    """Bad files the probes name: config files, a plain file where a folder is expected, ..."""
    d = tmp_path_factory.mktemp('files')
    (d / 'syntax.py').write_text("max_iters = 10\nmethod = 'lisa\n")
    (d / 'latin1.py').write_bytes("method = 'lisa'  # caf\xe9\n".encode('latin-1'))
    (d / 'exits.py').write_text("import sys\nsys.exit(0)\n")
    (d / 'unknown_key.py').write_text("lerning_rate = 1e-3\n")
    (d / 'wrong_type.py').write_text("max_iters = 'many'\n")
    (d / 'a_file').write_text('not a folder')
    (d / 'reports').mkdir()
    (d / 'reports' / 'report.md').write_text('an earlier report\n')
    (d / 'start.bin').write_bytes(b'\xff\xfe\x00bad')
    (d / 'empty.txt').write_text('')
    (d / 'blank.txt').write_text(' \n\n')
    (d / 'one_char.txt').write_text('a')  # 0 characters in the 90% train split
    return d


# (argv after the script, pattern of the error line); {out} is the trained run, {files} the bad files
TRAIN = [
    ('--batch_size=0', r'batch_size must be >= 1, got 0'),
    ('--batch_size=-3', r'batch_size must be >= 1, got -3'),
    ('--eval_interval=0', r'eval_interval must be >= 1, got 0'),
    ('--log_interval=0', r'log_interval must be >= 1'),
    ('--eval_iters=0', r'eval_iters must be >= 1'),
    ('--n_head=0', r'n_head must be >= 1'),
    ('--n_layer=0', r'n_layer must be >= 1'),
    ('--n_embd=0', r'n_embd must be >= 1'),
    ('--n_kv_head=-1', r'n_kv_head must be >= 0'),
    ('--block_size=0', r'block_size must be >= 1'),
    ('--max_iters=-5', r'max_iters must be >= 0, got -5'),
    ('--grad_clip=-1', r'grad_clip must be >= 0, got -1\.0'),
    ('--weight_decay=-0.1', r'weight_decay must be >= 0'),
    ('--learning_rate=0', r'learning_rate must be > 0'),
    ('--learning_rate=-1e-3', r'learning_rate must be > 0'),
    ('--beta1=1.0', r'beta1 must be in \[0, 1\)'),
    ('--beta2=-0.5', r'beta2 must be in \[0, 1\)'),
    ('--momentum=1.5', r'momentum must be in \[0, 1\)'),
    ('--dropout=1.0', r'dropout must be in \[0, 1\)'),
    ('--dropout=-0.1', r'dropout must be in \[0, 1\)'),
    ('--min_lr=1.0', r'min_lr=1\.0 is above learning_rate'),
    ('--warmup_iters=-1', r'warmup_iters must be >= 0'),
    ('--warmup_iters=20 --lr_decay_iters=10', r'lr_decay_iters=10 ends before warmup_iters=20'),
    ('--omgd_gamma=0', r'omgd_gamma must be >= 1'),
    ('--omgd_gamma=99', r'omgd_gamma must be in 1\.\.4'),
    ('--omgd_period=0', r'omgd_period must be >= 1'),
    ('--omgd_ratio=0', r'omgd_ratio must be in \(0, 1\]'),
    ('--omgd_ratio=1.5', r'omgd_ratio must be in \(0, 1\]'),
    ('--omgd_state=cpu', r"omgd_state must be one of 'drop', 'offload', 'keep', got 'cpu'"),
    ('--omgd_always=embed,tail', r"unknown omgd_always part\(s\) \['tail'\]"),
    ('--method=lisa_wr', r"unknown method 'lisa_wr'; choose one of full, "),
    ('--optimizer=lion', r"optimizer must be 'adamw' or 'sgd', got 'lion'"),
    ('--precision=fp8', r"unknown precision 'fp8'"),
    ('--dtype=fp16', r"unknown dtype 'fp16'"),
    ('--master_device=gpu', r"master_device must be '' \(the weights' device\) or 'cpu', got 'gpu'"),
    ('--master_device=cpu', r"master_device='cpu' places fp32 master weights.*--precision=bf16_master"),
    ('--precision=bf16 --dtype=float16', r"dtype='float16' is the autocast dtype of precision='amp'"),
    ('--precision=bf16_master --optimizer=sgd', r"precision='bf16_master' keeps AdamW's fp32 master weights"),
    ('--checkpoint_sublayers=True', r'checkpoint_sublayers=True .*--activation_checkpointing=True'),
    ('--loss_chunk=-1', r'loss_chunk must be >= 0 tokens'),
    ('--galore_rank=0', r'galore_rank must be >= 1'),
    ('--galore_update_proj_gap=0', r'galore_update_proj_gap must be >= 1'),
    ('--galore_scale=0', r'galore_scale must be > 0'),
    ('--golore_svd_fraction=1.5', r'golore_svd_fraction must be in \[0, 1\]'),
    ('--device=cuda', r"device='cuda' but this machine has no CUDA GPU"),
    ('--device=tpu', r"device='tpu' is not a training device"),
    ('--device=meta', r"device='meta' is not a training device"),
    ('--backend=mpi', r"backend must be 'nccl' or 'gloo', got 'mpi'"),
    ('--parallel=zero', r"parallel must be 'ddp' or 'fsdp', got 'zero'"),
    ('--sampling=seq', r"sampling must be 'rr' or 'iid', got 'seq'"),
    ('--arch=bert', r"arch must be 'gpt2' or 'llama', got 'bert'"),
    ('--preset=gpt5', r"unknown preset 'gpt5'"),
    ('--vocab_size=-1', r'vocab_size must be >= 0'),
    ('--vocab_size=10', r'vocab_size=10'),
    ('--n_embd=31', r'n_embd=31 is not divisible by n_head=2'),
    ('--mlp_hidden=-1', r'mlp_hidden must be >= 0'),
    ('--sample_tokens=-1', r'sample_tokens must be >= 0'),
    ('--gradient_accumulation_steps=0', r'gradient_accumulation_steps must be >= 1, got 0'),
    ('--lerning_rate=1e-3', r"unknown config key 'lerning_rate'; did you mean learning_rate"),
    ('--max_iters=ten', r"max_iters='ten' is not a valid int"),
    ('--max_iters=1.5', r'expected int'),
    ('--compile=maybe', r'not a valid bool'),
    ('--max_iters', r"expected --key=value, got '--max_iters'"),
    ('--dataset=', r'dataset must be a non-empty name'),
    # a mistyped name: the datasets there are, not a prepare script that does not exist
    (
        '--dataset=no_such_dataset',
        r"dataset 'no_such_dataset' has no prepared splits in .*no_such_dataset; there is "
        r"no data/no_such_dataset/prepare\.py either: the datasets are c4, openwebtext, "
        r"shakespeare, shakespeare_char(, [\w.-]+)* \(or give the path of a prepared "
        r"folder\)$",
    ),
    ('{files}/syntax.py', r"syntax\.py', line 2: SyntaxError"),
    ('{files}/latin1.py', r'latin1\.py.* is not UTF-8 text'),
    ('{files}/exits.py', r'exits\.py.* calls exit\(\); a config file only assigns keys'),
    ('{files}/unknown_key.py', r"unknown config key 'lerning_rate'"),
    ('{files}/wrong_type.py', r"max_iters='many' is not a valid int"),
    ('{files}/missing.py', r"cannot read config file .*missing\.py'"),
    # integers beyond torch's 64 bits, and floats beyond float's range: the key named, not torch's words
    ('--seed=18446744073709551616', r'seed=18446744073709551616 does not fit in 64 bits .*give a seed in that range'),
    ('--seed=-9223372036854775809', r'seed=-9223372036854775809 does not fit in 64 bits'),
    ('--omgd_seed=18446744073709551616', r'omgd_seed=18446744073709551616 does not fit in 64 bits'),
    ('--vocab_size=100000000000000000000', r'vocab_size=100000000000000000000 does not fit in 64 bits'),
    ('--learning_rate=1e400', r'learning_rate=inf is not a finite number'),
]
# the probes that name an out_dir of their own (the others train into {out}: refused before they save)
OUT_DIR = [
    ('--out_dir=', r'out_dir must be a non-empty path'),
    ('--out_dir={files}/a_file', r"out_dir=.*a_file' cannot hold checkpoints"),
    ('--out_dir={files}/a_file/sub', r"out_dir=.*a_file/sub' cannot hold checkpoints"),
    ('--out_dir={files}/empty --init_from=resume', r'no checkpoint at .*empty/ckpt\.pt to resume from'),
    ('--out_dir={files}/locked', r'its lock file .*locked/\.lock cannot be written \(Is a directory\)'),
    (
        '--out_dir={files}/bins --dataset={files}/dir_bin --vocab_size=96',
        r'dir_bin/train\.bin is a directory, not a file of token ids',
    ),
]
# against the trained run in {out}
RESUME = [
    ('', r'holds iteration 4 of an earlier run; continue it with --init_from=resume'),
    ('--init_from=resume --omgd_gamma=1', r"omgd_gamma=1 differs from the checkpoint's 2"),
    ('--init_from=resume --method=lisa', r"method='lisa' differs from the checkpoint's 'lisa_wor'"),
    ('--init_from=resume --dataset=shakespeare', r"dataset='shakespeare' differs from the checkpoint's"),
    ('--init_from=resume --precision=bf16', r"precision='bf16' differs from the checkpoint's 'amp'"),
    ('--init_from=resume --block_size=16', r"block_size=16 differs from the checkpoint's 32"),
    (
        '--init_from=resume --n_layer=6',
        r"n_layer=6 conflicts with the checkpoint's 4",
    ),  # 6 is the default: given all the same
    ('--init_from=resume --n_embd=64', r"n_embd=64 conflicts with the checkpoint's 32"),
    ('--init_from=resume --omgd_always=embed', r"omgd_always='embed' differs from the checkpoint's"),
    # refused by the data loader only after the model was built, in a line that named no key
    (
        '--init_from=resume --data_seed=5',
        r"data_seed=5 differs from the checkpoint's 1337 \(its data position is a place "
        r"in that order\); resume with --data_seed=1337$",
    ),
    (
        '--init_from=resume --sampling=iid',
        r"sampling='iid' differs from the checkpoint's 'rr' .*; resume with --sampling=rr$",
    ),
    # AdamW's state loaded into SGD was a KeyError: 'momentum' traceback at the first step
    (
        '--init_from=resume --optimizer=sgd',
        r"optimizer='sgd' differs from the checkpoint's 'adamw' \(its optimizer "
        r"state is that optimizer's\); resume with --optimizer=adamw$",
    ),
    ('--wandb_log=True --init_from=resume --max_iters=6', r'wandb_log=True needs the wandb package'),
]
SAMPLE = [
    ('--temperature=0', r'temperature must be > 0, got 0'),
    ('--temperature=-1', r'temperature must be > 0'),
    ('--top_k=-1', r'top_k must be >= 0'),
    ('--start=', r'start must be a non-empty prompt'),
    ('--num_samples=0', r'num_samples must be >= 1'),
    ('--max_new_tokens=0', r'max_new_tokens must be >= 1'),
    ('--device=cuda', r"device='cuda' but this machine has no CUDA GPU"),
    ('--tmperature=1', r"unknown config key 'tmperature'; did you mean temperature"),
    ('--start=FILE:{files}/nothing.txt', r'cannot read it'),
    ('--start=FILE:{files}/start.bin', r'cannot read it .*UTF-8'),
    ('--start=ROMEO{{}}', r'--start: characters'),
    ('--out_dir={files}/empty', r'no checkpoint at .*; train one first: python train\.py --out_dir='),
    ('--out_dir={files}/a_file', r'no checkpoint at'),
    ('--seed=18446744073709551616', r'seed=18446744073709551616 does not fit in 64 bits'),
]
BENCH = [
    (
        '--out={files}/a_file/report.md',
        r"cannot write the report .*a_file/report.md \(.*\); free space or choose another --out$",
    ),
    ('--methods=adam', r"unknown method 'adam'"),
    ('--methods=,', r'methods lists no method'),
    ('--steps=0', r'steps must be >= 1'),
    ('--warmup_steps=-1', r'warmup_steps must be >= 0'),
    ('--device=meta', r'device must be auto, cuda, cpu'),
    ('--device=cuda', r'device=cuda but CUDA is not available; use --device=cpu$'),
    ('--batch_size=0', r'batch_size must be >= 1'),
    ('--precisions=fp8', r"unknown precision 'fp8'"),
    # 644 GiB of fp32 weights: more than any host holds (LLaMA-7B's 25 GiB fit a GPU machine's 125)
    ('--n_layer=200 --n_embd=8192 --n_head=64 --device=cpu', r'the model has 161\.\d+B parameters: .* GiB free on cpu'),
    ('--preset=gpt2 --n_layer=2', r"preset='gpt2' sets the architecture"),
    ('--stepz=3', r"unknown config key 'stepz'"),
]
BENCH_MEMORY = [
    (
        '--out={files}/a_file/report',
        r"cannot write the report .*a_file/report\.\* \(.*\); free space or choose another --out$",
    ),
    ('--micro_batches=-1', r'micro_batches must be >= 0'),
    ('--device=tpu', r'device must be auto, cuda, meta, cpu'),
    ('--device=cuda', r'device=cuda but CUDA is not available; use --device=meta for an estimate$'),
    ('--methods=,', r'methods lists no method'),
    # 644 GiB of fp32 weights: more than any host holds (LLaMA-7B's 25 GiB fit a GPU machine's 125)
    ('--n_layer=200 --n_embd=8192 --n_head=64 --device=cpu', r'the model has 161\.\d+B parameters: .* GiB free on cpu'),
    ('--precisions=bf16:cpu', r"master_device='cpu' places fp32 master weights"),
    ('--precisions=bf16_master:gpu', r"master_device must be ''"),
    ('--omgd_gamma=0', r'omgd_gamma must be >= 1'),
    ('{files}/exits.py', r'calls exit\(\)'),
]
COMPARE = [
    ('--methods=lisa_wr', r"unknown method 'lisa_wr'"),
    ('--methods=lisa:seq', r"sampling must be one of"),
    ('--methods=,', r'--methods names no method'),
    ('--seeds=x', r"--seeds='x': give a count N or a list"),
    ('--max_iters=0', r'max_iters must be >= 1'),
    ('--jobs=0', r'jobs must be >= 1'),
    ('--max_iters=ten', r"max_iters='ten' is not a valid int"),
    ('--bogus=1', r"unknown config key 'bogus'"),
    ('--train_args=--lerning_rate=1', r"unknown config key 'lerning_rate'"),
    ('--train_args=--batch_size=0', r'batch_size must be >= 1'),
    (
        '--replot=True --name=nothing',
        r'nothing\.json, which does not exist: run the comparison first \(without --replot\)',
    ),
    ('--max_iters=40 --out_dir={files}/a_file', r'--out_dir=.*a_file cannot hold the reports'),
]
LINREG = [
    ('--ratio=0', r'ratio must be in \(0, 1\], got 0'),
    ('--ratio=2', r'ratio must be in \(0, 1\], got 2'),
    ('--methods=bogus', r'methods must be a comma list of RR, '),
    ('--methods=,', r'methods must be a comma list'),
    ('--warmup=-1', r'warmup must be >= 0'),
    ('--out_dir={files}/a_file', r'--out_dir=.*a_file cannot hold the report'),
]
STUDY = [
    ('--stages=bogus', r"unknown stage 'bogus'; choose from"),
    ('--layers=x', r"--layers='x': give numbers of blocks"),
    ('--seeds=0', r'seeds must be >= 1'),
    ('--jobs=0', r'jobs must be >= 1'),
    ('--bogus', r'expected --key=value'),
]
EXPORT = [
    ('--hf_dir=', r'--hf_dir is required'),
    ('--hf_dir={files}/a_file', r'is a file; give a directory'),
    ('--hf_dir={files}/a_file/sub', r'cannot create --hf_dir=.*a_file/sub'),
    ('--hf_dir={files}/hf --dtype=fp8', r"dtype must be '' \(the checkpoint's\) or one of"),
    ('--hf_dir={files}/hf --out_dir={files}/empty', r'no checkpoint at'),
    ('--hf_dir={files}/hf --bogus=1', r"unknown config key 'bogus'"),
    ('--hf_dir={files}/hf --tokenizer=gpt3', r"tokenizer must be '' \(the dataset's\) or 'none'"),
]
PREPARE = [
    ('data/shakespeare_char/prepare.py', '--input={files}/missing.txt', r'input file not found'),
    ('data/shakespeare_char/prepare.py', '--input={files}/start.bin', r'UTF-8|utf-8'),
    ('data/shakespeare_char/prepare.py', '--tokenizer={files}/empty', r'no tokenizer\.json there'),
    ('data/shakespeare/prepare.py', '--tokenizer=bogus', r'no tokenizer\.json there'),
    ('data/shakespeare/prepare.py', '--bogus=1', r"unknown config key 'bogus'"),
    ('data/c4/prepare.py', '--json_files={files}/none*.json.gz', r"no files match --json_files="),
    ('data/c4/prepare.py', '--json_files={files}/a_file', r'no validation shard'),
    ('data/c4/prepare.py', '--json_files={files}/a_file --max_docs=-1', r'--max_docs=-1: give a number of at least 0'),
    ('data/c4/prepare.py', '--json_files={files}/a_file --num_proc=-1', r'give numbers of at least 1'),
    ('data/c4/prepare.py', '--max_tokens=many', r"max_tokens='many' is not a valid int"),
    # a dataset of 0 tokens, which no run can read a window of
    ('data/shakespeare_char/prepare.py', '--input={files}/empty.txt', r'empty\.txt holds no text; give a UTF-8 text'),
    ('data/shakespeare/prepare.py', '--input={files}/empty.txt', r'empty\.txt holds no text'),
    ('data/shakespeare_char/prepare.py', '--input={files}/blank.txt', r'blank\.txt holds no text'),
    (
        'data/shakespeare_char/prepare.py',
        '--input={files}/one_char.txt',
        r'train\.bin would hold no tokens .* give a '
        r'longer text',
    ),
    ('data/shakespeare/prepare.py', '--input={files}/one_char.txt', r'train\.bin would hold no tokens'),
]
SMALL_BENCH = [
    '--n_layer=2',
    '--n_head=2',
    '--n_embd=32',
    '--block_size=16',
    '--vocab_size=64',
    '--batch_size=2',
    '--steps=1',
    '--warmup_steps=0',
    '--compile=False',
]
SHAPE = ('n_layer', 'n_head', 'n_embd', 'vocab_size')  # a preset sets them
# TRAIN's probes run with --overwrite=True against the trained run: even then, a refused run loses nothing
PROBES = (
    [('train.py', f'--overwrite=True {a}', p) for a, p in TRAIN]
    + [('train.py', *p) for p in OUT_DIR + RESUME]
    + [('sample.py', *p) for p in SAMPLE]
    + [('bench.py', *p) for p in BENCH]
    + [('bench_memory.py', *p) for p in BENCH_MEMORY]
    + [('experiments/compare.py', *p) for p in COMPARE]
    + [('experiments/study.py', *p) for p in STUDY]
    + [('export.py', *p) for p in EXPORT]
    + [('experiments/linreg.py', *p) for p in LINREG]
    + PREPARE
)


def argv_of(script, args, out, files):
    argv = args.format(out=out, files=files).split()
    if script == 'train.py':
        named = any(a.startswith('--out_dir=') for a in argv)
        return [*TINY, *([] if named else [f'--out_dir={out}']), *argv]
    if script == 'sample.py':
        named = any(a.startswith('--out_dir=') for a in argv)
        return [*([] if named else [f'--out_dir={out}']), '--max_new_tokens=2', *argv]
    small = (
        [a for a in SMALL_BENCH if not any(a.startswith(f'--{k}=') for k in SHAPE)]
        if any(a.startswith('--preset=') for a in argv)
        else SMALL_BENCH
    )
    if script == 'experiments/compare.py':
        return ['--seeds=1', '--max_iters=4', '--memory=False', f'--out_dir={files}/reports', '--name=report', *argv]
    if script == 'experiments/linreg.py':
        return ['--T=200', '--seeds=1', '--decompose=False', f'--out_dir={files}/reports', *argv]
    if script == 'experiments/study.py':
        return [f'--runs_dir={files}/study_runs', f'--report_dir={files}/reports', '--name=report', *argv]
    if script == 'export.py':
        named = any(a.startswith('--out_dir=') for a in argv)
        return [*([] if named else [f'--out_dir={out}']), *argv]
    if script.startswith('data/'):
        return [f'--out_dir={files}/reports', *argv]
    if script == 'bench.py':
        return [*small, f'--out={files}/reports/report.md', *argv]
    return [*small[:-3], '--device=meta', f'--out={files}/reports/report', *argv]


def test_there_are_over_a_hundred_probes():
    assert len(PROBES) >= 100, len(PROBES)


@pytest.mark.parametrize('script, args, pattern', PROBES, ids=[f'{s} {a}' for s, a, _ in PROBES])
def test_bad_input_is_one_line_error_and_loses_nothing(script, args, pattern, trained, files):
    import re

    if '--device=cuda' in args and torch.cuda.is_available():
        pytest.skip('the refusal of a machine without CUDA; this one has a GPU')
    before, reports = digest(trained), digest(files / 'reports')
    if '{files}/empty' in args:
        (files / 'empty').mkdir(exist_ok=True)
    if '{files}/locked' in args:  # a .lock that is a folder
        (files / 'locked' / '.lock').mkdir(parents=True, exist_ok=True)
    if '{files}/dir_bin' in args:  # train.bin a folder
        (files / 'dir_bin' / 'train.bin').mkdir(parents=True, exist_ok=True)
        (files / 'dir_bin' / 'val.bin').write_bytes(bytes(200))
    result = run_script(script, argv_of(script, args, trained, files))
    assert result.returncode != 0, result.stdout[-1500:]
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith('error: ') and re.search(pattern, lines[-1]), result.stderr[-1500:]
    assert digest(trained) == before  # the checkpoint of the earlier run is untouched
    assert digest(files / 'reports') == reports  # and so are earlier reports


def test_a_run_that_fails_before_saving_leaves_no_empty_out_dir(tmp_path):
    out = tmp_path / 'new_run'
    result = run_script('train.py', [*TINY, f'--out_dir={out}', '--vocab_size=10'])
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith('error: ')
    assert not out.exists()


@pytest.mark.parametrize('key', ['iter_num', 'rng', 'best_val_loss', 'data', 'config'])
def test_a_checkpoint_missing_a_value_is_one_line_naming_it(trained, tmp_path, key):
    """A ckpt.pt without one of the values every checkpoint of train.py holds (a hand-edited or foreign
    file): the resume names the missing key in one line (rng was a KeyError traceback) and changes nothing."""
    import torch

    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    checkpoint = torch.load(out / 'ckpt.pt', weights_only=True)
    del checkpoint[key]
    torch.save(checkpoint, out / 'ckpt.pt')
    before = digest(out)
    result = run_script('train.py', [*TINY, f'--out_dir={out}', '--init_from=resume', '--max_iters=6'])
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        f"error: cannot resume from {out}/ckpt.pt: it lacks {key!r}, which every checkpoint of train.py holds; "
        f"restore a backup or train from scratch"
    ], result.stderr[-2000:]
    assert digest(out) == before


@pytest.mark.parametrize(
    'edit, message',
    [
        # each was a traceback: a TypeError at the loop's first comparison, an AttributeError, a misleading line
        (dict(iter_num='x'), r"its iter_num='x' is not what train\.py writes"),
        (dict(iter_num=-3), r"its iter_num=-3 is not what train\.py writes"),
        (dict(best_val_loss='x', rng=5), r"its best_val_loss='x', rng=5 are not what train\.py writes"),
        (dict(model_args={'n_embd': 'x'}), r"its model_args\['n_embd'\]='x' is not what train\.py writes"),
        (dict(config={'learning_rate': 'x'}), r"its config\['learning_rate'\]='x' is not what train\.py writes"),
        (dict(rng={'ranks': [5]}), r"its random number states cannot be restored \(TypeError: "),
        (
            dict(cycler=None),
            r"TypeError: 'NoneType' object is not subscriptable; the file is damaged or not train\.py's",
        ),
    ],
)
def test_a_checkpoint_value_of_the_wrong_type_is_one_line(trained, tmp_path, edit, message):
    """A ckpt.pt whose values are not of the types train.py writes (hand-edited, or another program's): the resume
    ends in one line that says so, with --init_from=resume as with auto, and changes nothing."""
    import torch

    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    checkpoint = torch.load(out / 'ckpt.pt', weights_only=True)
    for key, value in edit.items():
        checkpoint[key] = {**checkpoint[key], **value} if key in ('model_args', 'config') else value
    torch.save(checkpoint, out / 'ckpt.pt')
    before = digest(out)
    for init_from in ('resume', 'auto'):
        result = run_script('train.py', [*TINY, f'--out_dir={out}', f'--init_from={init_from}', '--max_iters=6'])
        assert_one_line_error(
            result,
            rf"^error: cannot resume from {re.escape(str(out))}/ckpt\.pt: .*{message}.*restore "
            rf"a backup or train from scratch$",
        )
    assert digest(out) == before


@pytest.mark.parametrize('config', [5, {'dataset': 3}])
def test_a_foreign_config_is_one_line_for_every_reader(trained, tmp_path, config):
    """sample.py, eval.py and export.py read a checkpoint's config for its dataset: a config that is not a dict,
    or a dataset that is not a name, is one line (sample.py and export.py ended in a traceback)."""
    import torch

    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    checkpoint = torch.load(out / 'ckpt.pt', weights_only=True)
    checkpoint['config'] = config
    torch.save(checkpoint, out / 'ckpt.pt')
    for script, args in (
        ('sample.py', ['--max_new_tokens=2', '--num_samples=1']),
        ('eval.py', ['--eval_iters=1']),
        ('export.py', [f'--hf_dir={tmp_path / "hf"}']),
    ):
        result = run_script(script, [f'--out_dir={out}', *args])
        assert_one_line_error(
            result, r"^error: .*ckpt\.pt (is not a checkpoint of train\.py|does not record the dataset)"
        )
    assert not (tmp_path / 'hf').exists()


def test_stale_temporary_files_of_an_interrupted_save_are_removed(trained, tmp_path):
    from infra import checkpoint_file

    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    (out / '.ckpt.pt.tmp-12345').write_bytes(b'half a checkpoint')  # what a killed save leaves: its record too
    (out / '.ckpt.pt.writing').write_text(checkpoint_file.record_text(out / '.ckpt.pt.tmp-12345'))
    result = run_script(
        'train.py', [*TINY, f'--out_dir={out}', '--init_from=resume', '--max_iters=5', '--eval_interval=5']
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(os.listdir(out)) == ['.lock', 'ckpt.pt', 'metrics.jsonl']


def test_nccl_without_cuda_under_torchrun_is_one_line_that_torchrun_names(tmp_path, monkeypatch):
    """--backend=nccl without a CUDA device, under torchrun (RANK set): one line before any process group
    is made; the line also goes to the rank's error file, which torchrun's failure summary shows as the
    root cause. A rank that leaves the printing to another (LOCAL_RANK 1 of a refused config) writes it too."""
    import json

    error_file = tmp_path / 'error.json'
    env = dict(
        RANK='0',
        LOCAL_RANK='0',
        WORLD_SIZE='1',
        MASTER_ADDR='127.0.0.1',
        MASTER_PORT='9',
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / 'run'
    result = run_script(
        'train.py', [*TINY, f'--out_dir={out}', '--backend=nccl', '--device=cpu', '--dist_timeout_s=20']
    )
    assert result.returncode == 1 and result.stderr.splitlines() == [
        "error: backend=nccl needs CUDA GPUs and this run's device is 'cpu'"
        + ('' if __import__('torch').cuda.is_available() else " (torch finds no CUDA GPU here)")
        + ": pass --backend=gloo to train on CPUs"
    ], result.stderr[-2000:]
    assert json.loads(error_file.read_text())['message'] == result.stderr.strip()
    assert not out.exists()
    monkeypatch.setenv('LOCAL_RANK', '1')
    result = run_script('train.py', [*TINY, '--max_iters=-5'])
    assert result.returncode == 1 and result.stderr == ''
    assert json.loads(error_file.read_text())['message'] == "error: max_iters must be >= 0, got -5"


def test_a_model_that_cannot_fit_is_refused_before_it_is_allocated(monkeypatch):
    """Weights over the free memory: refused at once; over an eighth of it: refused when the iteration's
    estimate (bench_memory on meta) exceeds it; small: no estimate is run. (LLaMA-7B's 25 GiB of fp32 weights
    on a 125 GiB host, a fifth, went on unchecked to need about 4x that.)"""
    import memory_estimate
    from model import TransformerConfig

    config = TransformerConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=1000)
    import torch

    from model import Transformer

    with torch.device('meta'):
        n = sum(p.numel() for p in Transformer(config).parameters())
    calls = []
    monkeypatch.setattr(memory_estimate, 'available_bytes', lambda device: 3 * n)  # 4n bytes of weights do not fit
    with pytest.raises(ValueError, match=r'GiB of weights \(4 bytes each\)'):
        memory_estimate.check_fits(config, 'cpu', 4, lambda: calls.append(1) or 0)
    assert not calls
    monkeypatch.setattr(memory_estimate, 'available_bytes', lambda device: 8 * n)  # fit, but half of it
    with pytest.raises(ValueError, match=r'an iteration needs about .* GiB \(meta-device estimate\)'):
        memory_estimate.check_fits(config, 'cpu', 4, lambda: calls.append(1) or 9 * n)
    assert calls == [1]
    memory_estimate.check_fits(config, 'cpu', 4, lambda: calls.append(1) or 7 * n)  # the estimate fits
    monkeypatch.setattr(memory_estimate, 'available_bytes', lambda device: 20 * n)  # a fifth, as LLaMA-7B above
    with pytest.raises(ValueError, match=r'an iteration needs about .* GiB \(meta-device estimate\)'):
        memory_estimate.check_fits(config, 'cpu', 4, lambda: calls.append(1) or 21 * n)
    monkeypatch.setattr(memory_estimate, 'available_bytes', lambda device: 100 * n)
    memory_estimate.check_fits(config, 'cpu', 4, lambda: calls.append(1) or 1000 * n)  # small: no estimate asked
    assert calls == [1, 1, 1]


def test_a_rank_that_does_not_print_the_line_exits_after_the_one_that_does(tmp_path, monkeypatch, capsys):
    """Under torchrun, which stops every worker at the first exit, a rank that leaves the line to another waits
    before it exits (else the printing rank could be stopped before it prints); both ranks' error files hold it."""
    from infra import distributed

    waits = []
    monkeypatch.setattr(distributed.time, 'sleep', waits.append)
    for printed in (True, False):
        monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(tmp_path / f'{printed}.json'))
        assert distributed.report_error('n_layer must be >= 1', printed=printed) == 1
        assert json.loads((tmp_path / f'{printed}.json').read_text())['message'] == 'error: n_layer must be >= 1'
    assert capsys.readouterr().err == "error: n_layer must be >= 1\n"  # printed once
    assert waits == [distributed.SILENT_RANK_WAIT_S]  # by the silent rank alone


def test_an_error_file_that_cannot_be_written_still_ends_in_the_printed_line(tmp_path, monkeypatch, capsys):
    """torchrun's error file in a folder that is gone (a cleaned /tmp): the line is still printed, the exit
    status is still 1, and the failure to write the file is not a second error on top of it."""
    from infra import distributed

    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(tmp_path / 'gone' / 'error.json'))
    assert distributed.report_error('max_iters must be >= 0, got -5') == 1
    assert capsys.readouterr().err == "error: max_iters must be >= 0, got -5\n"
    assert not (tmp_path / 'gone').exists()


@pytest.mark.parametrize('kind', ['device', 'pipe'])
def test_a_train_bin_that_is_a_device_or_a_pipe_is_one_line_saying_so(tmp_path, kind):
    """train.bin a link to /dev/zero, or a named pipe (whose read would block): not "a directory"."""
    data = tmp_path / 'data'
    data.mkdir()
    if kind == 'device':
        (data / 'train.bin').symlink_to('/dev/zero')
    else:
        os.mkfifo(data / 'train.bin')
    (data / 'val.bin').write_bytes(bytes(200))
    out = tmp_path / 'out'
    result = run_script('train.py', [*TINY, f'--out_dir={out}', f'--dataset={data}', '--vocab_size=96'])
    assert_one_line_error(result, r'data/train\.bin is not a regular file \(a device, pipe or socket\)')
    assert not out.exists()


@pytest.mark.parametrize('file_format', ['safetensors', 'bin'])
def test_a_hugging_face_directory_with_a_nan_weight_is_one_line_naming_the_tensor(tmp_path, file_format):
    """--init_from=<a Hugging Face directory with a NaN weight>: the file and the tensor named, before any
    training (it was "train loss is nan at iteration 0; ... lower learning_rate", not the cause)."""
    import torch

    import hf
    from model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=96))
    with torch.no_grad():
        model.blocks[1].mlp.c_fc.weight[3, 5] = float('nan')
        model.blocks[2].attn.c_proj.weight[0, :2] = float('inf')  # the first one found is named
    hf_dir = tmp_path / 'hf'
    hf.save(model, str(hf_dir))
    name = 'model.safetensors'
    if file_format == 'bin':  # the older format: the same tensors pickled (read with weights_only=True)
        from safetensors.torch import load_file

        name = 'pytorch_model.bin'
        torch.save(load_file(hf_dir / 'model.safetensors'), hf_dir / name)
        (hf_dir / 'model.safetensors').unlink()
    out = tmp_path / 'out'
    result = run_script('train.py', [*TINY, f'--init_from={hf_dir}', f'--out_dir={out}', '--max_iters=2'])
    assert_one_line_error(
        result,
        rf"^error: {re.escape(str(hf_dir / name))}: tensor 'transformer\.h\.1\.mlp\.c_fc\.weight' holds 1 "
        r"non-finite value\(s\) \(NaN or inf\), so training and generation would give nan; download the model "
        r"again, or export it from a run that had not diverged$",
    )
    assert 'step 0' not in result.stdout and not out.exists()  # refused before any evaluation or save


@pytest.mark.parametrize('kind', ['file', '/dev/null'])
def test_an_out_dir_that_is_a_file_is_named_so(tmp_path, kind):
    """--out_dir a file or /dev/null: 'is a file, not a directory' (was: its lock file 'notadir.txt/.lock cannot be
    written (File exists)', with advice to remove what is at a path that cannot exist)."""
    out = tmp_path / 'notadir.txt' if kind == 'file' else '/dev/null'
    if kind == 'file':
        out.write_text('kept')
    result = run_script('train.py', [*TINY, f'--out_dir={out}', '--max_iters=1'])
    assert_one_line_error(
        result, rf"^error: out_dir='{out}' cannot hold checkpoints: it is a file, not a directory; choose a directory"
    )
    assert kind != 'file' or out.read_text() == 'kept'


def test_init_from_a_runs_out_dir_says_how_a_run_is_continued(tmp_path):
    """--init_from=<the out_dir of a train.py run> (ckpt.pt, no config.json): the error says a run is continued
    with --init_from=resume --out_dir=..., not only what a Hugging Face directory holds."""
    run = tmp_path / 'run'
    run.mkdir()
    (run / 'ckpt.pt').write_bytes(b'')
    result = run_script('train.py', [*TINY, f'--out_dir={tmp_path / "new"}', f'--init_from={run}'])
    assert_one_line_error(
        result,
        rf"^error: {run} holds no config\.json: it is the out_dir of a train\.py run, not a Hugging Face model "
        rf"directory; continue that run with --init_from=resume --out_dir={run} ",
    )
    assert not (tmp_path / 'new').exists()
