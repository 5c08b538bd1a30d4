"""sample.py: text from a checkpoint written by train.py."""

from conftest import run_script, run_train


def test_sample_from_checkpoint_and_missing_checkpoint(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=4', '--eval_interval=4')
    cmd = [f'--out_dir={tmp_path}', '--start=ROMEO:', '--max_new_tokens=40', '--num_samples=2']
    result = run_script('sample.py', cmd)
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split('---------------')
    assert len(samples) == 3 and all(s.strip().startswith('ROMEO:') for s in samples[:2])
    assert len(samples[0].strip()) == len('ROMEO:') + 40
    bad = run_script('sample.py', cmd[:1] + ['--start=ROMEO{}'])
    assert (
        bad.returncode != 0
        and bad.stderr.strip() == "error: --start: characters '{}' are not in the dataset's vocabulary"
    )
    cmd[0] = f'--out_dir={tmp_path / "none"}'
    result = run_script('sample.py', cmd)
    assert result.returncode != 0 and result.stderr.strip().startswith('error: no checkpoint at')


def test_truncated_checkpoint_and_missing_start_file_are_one_line_errors(tmp_path):
    run_train(f'--out_dir={tmp_path}', '--max_iters=2', '--eval_interval=2')
    missing = run_script(
        'sample.py', [f'--out_dir={tmp_path}', '--max_new_tokens=5', f'--start=FILE:{tmp_path / "missing.txt"}']
    )
    assert missing.returncode != 0 and missing.stderr.strip() == (
        f"error: --start=FILE:{tmp_path / 'missing.txt'}: cannot read it (No such file or directory); "
        f"give an existing UTF-8 text file"
    )
    ckpt = tmp_path / 'ckpt.pt'
    ckpt.write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    truncated = run_script('sample.py', [f'--out_dir={tmp_path}'])
    assert truncated.returncode != 0 and len(truncated.stderr.strip().splitlines()) == 1, truncated.stderr
    assert truncated.stderr.startswith(
        f"error: cannot read checkpoint {ckpt} (RuntimeError: PytorchStreamReader "
        f"failed reading zip archive: failed finding central directory); it is "
        f"corrupt, truncated or from another program: restore a backup"
    ), truncated.stderr


def test_ids_the_tokenizer_lacks_decode_as_a_replacement_character():
    """A padded vocabulary (GPT-2's 50257 ids padded to 50304) gives an untrained model ids no tokenizer has:
    sample.py and train.py's closing sample decode them as U+FFFD instead of ending in tiktoken's KeyError."""
    from data.tokenizer import REPLACEMENT, Tokenizer

    gpt2 = Tokenizer('gpt2')
    hello, world = gpt2.encode('Hello'), gpt2.encode(' world')
    assert gpt2.decode(hello + [50300] + world + [50257]) == f'Hello{REPLACEMENT} world{REPLACEMENT}'
    assert gpt2.decode(hello + world) == 'Hello world'
    chars = Tokenizer('char', itos={0: 'a', 1: 'b'})
    assert chars.decode([0, 5, 1, -1]) == f'a{REPLACEMENT}b{REPLACEMENT}'


def test_a_dataset_whose_meta_pkl_is_gone_and_a_nan_checkpoint_are_one_line_errors(tmp_path):
    """A character-level run whose dataset lost its meta.pkl would decode with GPT-2's BPE (an IndexError in
    the embedding, before); a checkpoint with NaN weights would print nothing and exit 0: each is one line."""
    import os
    import shutil

    import torch
    from conftest import assert_one_line_error

    from dataloader import data_dir

    run_train(f'--out_dir={tmp_path / "run"}', '--max_iters=2', '--eval_interval=2')
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    # the run's dataset copied without its meta.pkl (the shared prepared one stays as it is)
    gone = tmp_path / 'data'
    shutil.copytree(data_dir(ckpt['config']['dataset']), gone, ignore=shutil.ignore_patterns('meta.pkl'))
    ckpt['config']['dataset'] = str(gone)
    (tmp_path / 'no_meta').mkdir()
    torch.save(ckpt, tmp_path / 'no_meta' / 'ckpt.pt')
    result = run_script('sample.py', [f'--out_dir={tmp_path / "no_meta"}', '--max_new_tokens=5'])
    vocab = ckpt['model_args']['vocab_size']
    assert_one_line_error(
        result,
        rf"the checkpoint's vocab_size is {vocab} but the tokenizer of its dataset "
        rf"\(GPT-2's BPE, since there is no .*meta\.pkl\) has 50257 ids: .*restore that "
        rf"meta\.pkl, or prepare the dataset again",
    )
    assert not result.stdout
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    name = next(k for k, t in ckpt['model'].items() if t.is_floating_point())
    ckpt['model'][name] = torch.full_like(ckpt['model'][name], float('nan'))
    (tmp_path / 'nan').mkdir()
    torch.save(ckpt, tmp_path / 'nan' / 'ckpt.pt')
    result = run_script('sample.py', [f'--out_dir={tmp_path / "nan"}', '--max_new_tokens=5'])
    assert_one_line_error(
        result,
        rf"{os.path.join(tmp_path, 'nan', 'ckpt.pt')} holds NaN or inf weights \(1 tensor\(s\), e\.g\. {name}\), "
        r"which train\.py never saves: .*restore a backup or use an earlier checkpoint",
    )
    assert not result.stdout
