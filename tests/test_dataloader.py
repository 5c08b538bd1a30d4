"""dataloader.py: random reshuffling visits each window once per epoch, disjointly across ranks."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dataloader import TokenBatches  # noqa: E402


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


def test_iid_samples_with_replacement(tokens):
    loader = TokenBatches(tokens, block_size=15, batch_size=64, sampling='iid')
    starts = [s for _ in range(20) for s in loader.next_starts().tolist()]
    assert len(set(s % 16 for s in starts)) > 1  # arbitrary offsets, overlapping windows
    assert len(set(starts)) < len(starts)


def test_resume_with_other_rank_count_needs_same_global_batch(tokens):
    two = TokenBatches(tokens, block_size=15, batch_size=4, world_size=2)
    for _ in range(3):
        two.next_starts()
    one = TokenBatches(tokens, block_size=15, batch_size=8)
    one.load_state_dict(two.state_dict())  # 24 windows consumed = 3 steps of 8: fine
    assert one.step_in_epoch == 3
    odd = TokenBatches(tokens, block_size=15, batch_size=5)
    with pytest.raises(ValueError, match='resume with the same batch_size'):
        odd.load_state_dict(two.state_dict())


def test_missing_file_and_too_little_data(tmp_path, tokens):
    with pytest.raises(FileNotFoundError, match='run `python data/x/prepare.py` first'):
        TokenBatches(str(tmp_path / 'nope.bin'), 16, 4, prepare_hint='python data/x/prepare.py')
    with pytest.raises(ValueError, match='too few for block_size=20000'):
        TokenBatches(tokens, 20_000, 4)
