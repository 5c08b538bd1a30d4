"""dataloader.py: random reshuffling visits each window once per epoch, disjointly across ranks."""

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dataloader  # noqa: E402
from data.tokenizer import read_meta  # noqa: E402
from dataloader import TokenBatches, check_vocab, dataset_vocab, open_splits  # noqa: E402


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / 'train.bin'
    np.arange(10_000, dtype=np.uint16).tofile(path)  # token value == its position
    return str(path)


def epoch_starts(loader):
    return [s for _ in range(loader.steps_per_epoch) for s in loader.next_starts().tolist()]


def test_each_window_exactly_once_per_epoch_with_fresh_offset_and_order(tokens):
    loader = TokenBatches(tokens, block_size=15, batch_size=4)
    epochs = [epoch_starts(loader) for _ in range(3)]
    for starts in epochs:
        assert len(starts) == len(set(starts)) == loader.steps_per_epoch * 4
        offsets = {s % 16 for s in starts}
        assert len(offsets) == 1  # non-overlapping windows of block_size+1 tokens
    assert epochs[0] != epochs[1]
    assert len({epoch_starts(loader)[0] % 16 for _ in range(10)}) > 1  # a fresh offset per epoch
    x, y = loader.next_batch()
    assert loader.epoch == 13
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:, 0], x[:, 0] + 1)


def test_ranks_take_disjoint_shares_of_the_same_permutation(tokens):
    single = TokenBatches(tokens, block_size=15, batch_size=8)
    ranks = [TokenBatches(tokens, block_size=15, batch_size=4, rank=r, world_size=2) for r in range(2)]
    for _ in range(single.steps_per_epoch):
        both = [r.next_starts().tolist() for r in ranks]
        assert not set(both[0]) & set(both[1])
        assert both[0] + both[1] == single.next_starts().tolist()


def test_position_round_trip_continues_exactly(tokens):
    for sampling in ('rr', 'iid'):
        a = TokenBatches(tokens, block_size=15, batch_size=4, sampling=sampling, seed=3)
        for _ in range(200):  # crosses epoch boundaries
            a.next_starts()
        b = TokenBatches(tokens, block_size=15, batch_size=4, sampling=sampling, seed=3)
        b.load_state_dict(a.state_dict())
        for _ in range(50):
            assert torch.equal(a.next_starts(), b.next_starts())


def test_a_position_of_another_order_is_refused(tokens):
    """A position is a place in one order (sampling, seed): in another it would be a different place, so the
    loader refuses it rather than continue on windows the run did not reach (train.py refuses such a resume
    earlier, by its keys, train_config.FIXED_ON_RESUME)."""
    saved = TokenBatches(tokens, block_size=15, batch_size=4, seed=3).state_dict()
    for other in (dict(seed=4), dict(sampling='iid', seed=3)):
        with pytest.raises(ValueError, match=r"^checkpoint data order is sampling='rr' seed=3; resume with the same"):
            TokenBatches(tokens, block_size=15, batch_size=4, **other).load_state_dict(saved)


def test_iid_samples_with_replacement(tokens):
    loader = TokenBatches(tokens, block_size=15, batch_size=64, sampling='iid')
    starts = [s for _ in range(20) for s in loader.next_starts().tolist()]
    assert len(set(s % 16 for s in starts)) > 1  # arbitrary offsets, overlapping windows
    assert len(set(starts)) < len(starts)


def test_resume_with_another_global_batch_continues_the_same_permutation(tokens):
    """2 ranks x 4 windows for 3 steps, then 1 rank x 8 or x 5: the next windows of the same
    permutation, none repeated, none skipped (a loader of one window a step visits it in order)."""
    in_order = TokenBatches(tokens, block_size=15, batch_size=1)
    order = [s for _ in range(in_order.steps_per_epoch) for s in in_order.next_starts().tolist()]
    two = [TokenBatches(tokens, block_size=15, batch_size=4, rank=r, world_size=2) for r in range(2)]
    seen = [s for _ in range(3) for rank in two for s in rank.next_starts().tolist()]
    assert sorted(seen) == sorted(order[:24])
    for batch_size in (8, 5):
        one = TokenBatches(tokens, block_size=15, batch_size=batch_size)
        one.load_state_dict(two[0].state_dict())  # 24 windows consumed: 3 steps of 8, 4.8 steps of 5
        after = [s for _ in range(10) for s in one.next_starts().tolist()]
        assert after == order[24 : 24 + 10 * batch_size]


def test_missing_file_and_too_little_data(tmp_path, tokens):
    with pytest.raises(FileNotFoundError, match='run `python data/x/prepare.py` first'):
        TokenBatches(str(tmp_path / 'nope.bin'), 16, 4, prepare_hint='python data/x/prepare.py')
    with pytest.raises(ValueError, match='too few for block_size=20000'):
        TokenBatches(tokens, 20_000, 4)


# --------------------------------------------------------------------------- datasets: meta.pkl, widths, vocabularies


def dataset(tmp_path, ids, meta, name='ds', dtype=None):
    """A prepared dataset folder: ids in train.bin and val.bin (as meta's dtype unless dtype is given),
    and meta.pkl (None: none)."""
    d = tmp_path / name
    d.mkdir()
    dtype = dtype or (meta or {}).get('dtype', 'uint16')
    for split in ('train', 'val'):
        np.asarray(ids, dtype=dtype).tofile(d / f'{split}.bin')
    if meta is not None:
        with open(d / 'meta.pkl', 'wb') as f:
            pickle.dump(meta, f)
    return str(d)


def test_uint32_dataset_reads_ids_above_65535(tmp_path):
    ids = np.arange(70_000, 70_000 + 4_000)
    d = dataset(tmp_path, ids, {'tokenizer': '/tok', 'vocab_size': 75_000, 'dtype': 'uint32'})
    train, evaluation = open_splits(d, 15, 4, 'rr', 1)
    x, y = train.next_batch()
    assert x.dtype == torch.int64 and int(x.min()) >= 70_000 and torch.equal(y[:, :-1], x[:, 1:])
    assert train.n_tokens == len(ids)  # not twice as many uint16 halves
    assert dataset_vocab(d) == 75_000 and dataset_vocab(d, 80_000) == 80_000
    check_vocab(d, 75_000, train, *evaluation.values())
    with pytest.raises(
        ValueError,
        match=r"vocab_size=50304 is smaller than the vocabulary of .*ds \(75000 ids, "
        r"tokenizer /tok\): set --vocab_size=75000 or more",
    ):
        check_vocab(d, 50_304, train)


def test_datasets_prepared_before_meta_keys_still_read(tmp_path):
    chars = {'vocab_size': 3, 'stoi': {'a': 0, 'b': 1, 'c': 2}, 'itos': {0: 'a', 1: 'b', 2: 'c'}}
    d = dataset(tmp_path, [0, 1, 2] * 100, chars, 'chars')
    assert read_meta(d) == {'tokenizer': 'char', 'dtype': 'uint16', **chars}
    assert dataset_vocab(d) == 3
    bpe = dataset(tmp_path, np.arange(3000), None, 'bpe')  # GPT-2 BPE folders had no meta.pkl
    assert read_meta(bpe) == {'tokenizer': 'gpt2', 'vocab_size': 50257, 'dtype': 'uint16'}
    assert dataset_vocab(bpe) == 0  # the preset's, else GPT-2's padded 50304 (builder.transformer_kwargs)
    check_vocab(bpe, 3000, open_splits(bpe, 15, 4, 'rr', 1)[0])  # no recorded vocabulary: the ids decide
    with pytest.raises(ValueError, match=r"train.bin holds token id 2999, not below vocab_size=2048"):
        check_vocab(bpe, 2048, open_splits(bpe, 15, 4, 'rr', 1)[0])
    bare = dataset(tmp_path, np.arange(30), {'vocab_size': 77}, 'bare')  # a vocabulary only
    assert read_meta(bare) == {'tokenizer': None, 'vocab_size': 77, 'dtype': 'uint16'} and dataset_vocab(bare) == 77
    with pytest.raises(ValueError, match=r'vocab_size=64 is smaller .*bare \(77 ids, tokenizer None\)'):
        check_vocab(bare, 64)


def test_ids_beyond_the_vocabulary_are_refused_at_start_or_when_read(tmp_path, monkeypatch):
    d = dataset(tmp_path, [1, 2, 3, 99] * 50, {'tokenizer': 'char', 'vocab_size': 50, 'stoi': {}, 'itos': {}})
    train, evaluation = open_splits(d, 7, 2, 'rr', 1)
    with pytest.raises(
        ValueError,
        match=r"train.bin holds token id 99, not below vocab_size=64: the file is "
        r"corrupt or of another tokenizer; run `python data/.*/prepare.py` again",
    ):
        check_vocab(d, 64, train, *evaluation.values())
    monkeypatch.setattr(dataloader, 'SCAN_LIMIT', 100)  # too large to scan: checked batch by batch
    check_vocab(d, 64, train)
    with pytest.raises(ValueError, match=r"train.bin holds token id 99, not below the model's vocab_size=64"):
        for _ in range(train.steps_per_epoch):
            train.next_batch()
    check_vocab(d, 100, train)
    train.next_batch()


@pytest.mark.parametrize(
    'meta,message',
    [
        (b'not a pickle', r"meta.pkl cannot be read \(UnpicklingError: .*\); prepare the dataset again"),
        (pickle.dumps([1, 2]), "meta.pkl holds a list, not a dict; prepare the dataset again"),
        (pickle.dumps({'stoi': {}, 'itos': {}}), "meta.pkl: vocab_size=None is not a positive integer"),
        (pickle.dumps({'tokenizer': 'gpt2', 'vocab_size': 70_000}), "vocab_size=70000 does not fit dtype=uint16"),
        (pickle.dumps({'tokenizer': 'gpt2', 'vocab_size': 9, 'dtype': 'int8'}), "dtype='int8' is not one of uint16"),
        (pickle.dumps({'tokenizer': 'char', 'vocab_size': 9}), "tokenizer='char' without its stoi and itos"),
    ],
)
def test_meta_that_does_not_load_is_one_line(tmp_path, meta, message):
    d = dataset(tmp_path, np.arange(100), None)
    (tmp_path / 'ds' / 'meta.pkl').write_bytes(meta)
    with pytest.raises(ValueError, match=message) as e:
        open_splits(d, 7, 2, 'rr', 1)
    assert '\n' not in str(e.value)


class RunsCode:
    """Unpickles as a call of os.system: what a crafted meta.pkl carries."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_meta_pkl_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / 'code_ran'
    dataset(tmp_path, np.arange(3000), {'vocab_size': 3000, 'hook': RunsCode(f'touch {marker}')})
    with pytest.raises(
        ValueError,
        match=r"meta.pkl cannot be read \(UnpicklingError: it names posix.system, and a "
        r"meta.pkl holds only plain data\); prepare the dataset again",
    ):
        read_meta(str(tmp_path / 'ds'))
    assert not marker.exists()


def test_bin_files_of_the_wrong_size(tmp_path):
    d = dataset(tmp_path, np.arange(1000), {'tokenizer': '/t', 'vocab_size': 70_000, 'dtype': 'uint32'})
    with open(os.path.join(d, 'val.bin'), 'ab') as f:
        f.write(b'\0\0')  # a uint16 id appended to a uint32 file
    with pytest.raises(
        ValueError,
        match=r"val.bin has 4002 bytes, not a whole number of uint32 ids \(4 bytes each\)"
        r": it is empty, cut short or of another dataset; run `python data/",
    ):
        open_splits(d, 7, 2, 'rr', 1)
    open(os.path.join(d, 'val.bin'), 'wb').close()
    with pytest.raises(ValueError, match="val.bin has 0 bytes"):
        open_splits(d, 7, 2, 'rr', 1)


def test_ids_of_another_width_than_meta_pkl_says_are_refused(tmp_path):
    """uint32 files under a meta.pkl that says uint16 (a hand-made or older meta.pkl) would train on
    every id followed by a 0: refused, by the counts meta.pkl records, or without them by the zeros."""
    ids = np.arange(100, 3100)
    d = dataset(tmp_path, ids, {'tokenizer': 'gpt2', 'vocab_size': 50257}, dtype='uint32')
    with pytest.raises(
        ValueError,
        match=r"train.bin looks like uint32 ids \(every second uint16 is 0\) but "
        r"meta.pkl says dtype=uint16 \(or there is no meta.pkl\); run `python "
        r"data/.*/prepare.py` again, or fix meta.pkl's dtype",
    ):
        open_splits(d, 15, 4, 'rr', 1)
    counted = dataset(
        tmp_path,
        ids,
        {'tokenizer': 'gpt2', 'vocab_size': 50257, 'n_ids': {'train': 6000, 'val': 6000}},
        'counted',
        dtype='uint32',
    )
    with pytest.raises(ValueError, match=r"train.bin looks like uint32"):  # counts that fit the size: the zeros tell
        open_splits(counted, 15, 4, 'rr', 1)
    counted = dataset(
        tmp_path,
        ids,
        {'tokenizer': 'gpt2', 'vocab_size': 50257, 'n_ids': {'train': 3000, 'val': 3000}},
        'counted2',
        dtype='uint32',
    )
    with pytest.raises(
        ValueError,
        match=r"train.bin holds the 3000 ids meta.pkl records as uint32 \(12000 bytes\), "
        r"but meta.pkl says dtype=uint16; run `python data/.*/prepare.py` again, or "
        r"fix meta.pkl's dtype",
    ):
        open_splits(counted, 15, 4, 'rr', 1)
    narrow = dataset(
        tmp_path,
        ids,
        {'tokenizer': '/t', 'vocab_size': 75_000, 'dtype': 'uint32', 'n_ids': {'train': 3000, 'val': 3000}},
        'narrow',
        dtype='uint16',
    )
    with pytest.raises(
        ValueError,
        match=r"train.bin holds the 3000 ids meta.pkl records as uint16 \(6000 bytes\), "
        r"but meta.pkl says dtype=uint32",
    ):
        open_splits(narrow, 15, 4, 'rr', 1)
    right = dataset(
        tmp_path, ids, {'tokenizer': 'gpt2', 'vocab_size': 50257, 'n_ids': {'train': 3000, 'val': 3000}}, 'right'
    )
    assert open_splits(right, 15, 4, 'rr', 1)[0].n_tokens == 3000
    with pytest.raises(ValueError, match=r"meta.pkl: n_ids=\{'train': -1\} is not a dict of id counts"):
        read_meta(dataset(tmp_path, ids, {'vocab_size': 50257, 'n_ids': {'train': -1}}, 'bad'))


def test_prepare_records_the_id_counts_that_the_loader_checks(tmp_path):
    from data.common import write_splits
    from data.tokenizer import Tokenizer

    meta = Tokenizer('char', {0: 'a', 1: 'b'}).record()
    write_splits([0, 1] * 50, [1, 0] * 20, tmp_path / 'ds', meta)
    assert read_meta(str(tmp_path / 'ds'))['n_ids'] == {'train': 100, 'val': 40}
    ids = np.fromfile(tmp_path / 'ds' / 'val.bin', dtype=np.uint16)
    ids.astype(np.uint32).tofile(tmp_path / 'ds' / 'val.bin')  # the same 40 ids, written 4 bytes wide
    with pytest.raises(ValueError, match=r"val.bin holds the 40 ids meta.pkl records as uint32 \(160 bytes\)"):
        open_splits(str(tmp_path / 'ds'), 7, 2, 'rr', 1)


def test_sample_decodes_with_the_recorded_tokenizer(tmp_path):
    """sample.py's load_codec: a Hugging Face tokenizer directory; a gone tokenizer or a bad meta.pkl is one line."""
    tokenizers = pytest.importorskip('tokenizers')
    from sample import load_codec

    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({'[UNK]': 0, 'hello': 1, 'world': 70_000, '</s>': 70_001}, unk_token='[UNK]')
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    (tmp_path / 'tok').mkdir()
    tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    d = dataset(
        tmp_path, [1, 70_000] * 100, {'tokenizer': str(tmp_path / 'tok'), 'vocab_size': 70_002, 'dtype': 'uint32'}
    )
    encode, decode = load_codec(d)
    assert encode('hello world') == [1, 70_000] and decode([70_000, 1]) == 'world hello'
    os.rename(tmp_path / 'tok', tmp_path / 'moved')
    with pytest.raises(
        SystemExit,
        match=f"error: the dataset's tokenizer {tmp_path / 'tok'} \\(recorded in its "
        f"meta.pkl\\) has no tokenizer.json any more",
    ):
        load_codec(d)
    (tmp_path / 'ds' / 'meta.pkl').write_bytes(b'\x80')
    with pytest.raises(SystemExit, match='error: .*meta.pkl cannot be read'):
        load_codec(d)


def test_train_and_sample_on_a_uint32_dataset(tmp_path):
    """train.py on a dataset of a 70,002-id Hugging Face tokenizer (the model takes meta.pkl's
    vocabulary), sample.py decodes with it; a model vocabulary too small is one line at start."""
    tokenizers = pytest.importorskip('tokenizers')
    from conftest import ROOT, assert_one_line_error, run_train

    words = {'[UNK]': 0, **{f'w{i}': i for i in range(1, 70_000)}, '</s>': 70_000, 'top': 70_001}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token='[UNK]'))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    (tmp_path / 'tok').mkdir()
    tok.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    ids = np.random.default_rng(0).choice([5, 65_536, 69_999, 70_001], size=5_000)
    d = dataset(tmp_path, ids, {'tokenizer': str(tmp_path / 'tok'), 'vocab_size': 70_002, 'dtype': 'uint32'})
    out = tmp_path / 'out'
    result = run_train(
        f'--dataset={d}', f'--out_dir={out}', '--max_iters=2', '--eval_interval=2', '--n_embd=8', '--n_head=1'
    )
    assert f'found vocab_size = 70002 (inside {d}/meta.pkl)' in result.stdout
    sample = subprocess.run(
        [sys.executable, 'sample.py', f'--out_dir={out}', '--start=w5 top', '--max_new_tokens=6', '--device=cpu'],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sample.returncode == 0, sample.stderr
    words_out = sample.stdout.split('---------------')[0].split()
    assert words_out[:2] == ['w5', 'top'] and len(words_out) == 8 and set(words_out) <= set(words)
    assert_one_line_error(
        run_train(f'--dataset={d}', f'--out_dir={tmp_path / "small"}', '--vocab_size=50304', expect_ok=False),
        r'vocab_size=50304 is smaller than the vocabulary of .* \(70002 '
        r'ids, tokenizer .*tok\): set --vocab_size=70002 or more',
    )
