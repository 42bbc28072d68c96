"""Tests of distopt.data: training/evaluation partitions and the sampler."""
from __future__ import annotations

import itertools
import logging
from collections import Counter

import numpy as np
import pytest

from distopt.data import (
    DistributedSampler,
    eval_partition_indices,
    partition,
    partition_indices,
)

pytestmark = pytest.mark.unit


def _shards(n, w, **kw):
    return [partition_indices(n, r, w, **kw) for r in range(w)]


def _sampler_epoch(n, b, w, **kw):
    """All batches of every rank for one epoch: list (rank) of lists (batch)."""
    epoch = kw.pop("epoch", 0)
    out = []
    for r in range(w):
        s = DistributedSampler(n, b, r, w, **kw)
        s.set_epoch(epoch)
        out.append(list(s.batches()))
    return out


# --------------------------------------------------------------- partition


@pytest.mark.parametrize("pad", [True, False])
def test_partition_properties(pad):
    for n, w in itertools.product(range(51), range(1, 6)):
        shards = _shards(n, w, pad=pad)
        counts = {len(s) for s in shards}
        assert len(counts) == 1, (n, w, counts)  # equal counts on every rank
        for s in shards:
            assert s.dtype == np.int64
            if len(s):  # contiguous modulo the wrap-around
                assert np.all(np.diff(s) % max(n, 1) == 1 % max(n, 1))
        allids = np.concatenate(shards)
        c = Counter(allids.tolist())
        if pad:
            expected = 0 if n == 0 else max(1, -(-n // w))
            assert counts == {expected}
            assert set(c) == set(range(n))  # covers all
            assert len(allids) - n <= w - 1  # at most W-1 duplicates
            assert all(v <= 2 for v in c.values()) or n < w
        else:
            assert counts == {n // w}
            assert all(v == 1 for v in c.values())  # disjoint
            assert n - len(allids) == n % w  # dropped count


def test_partition_no_pad_logs_dropped(caplog):
    with caplog.at_level(logging.INFO, logger="distopt"):
        partition_indices(10, 0, 4, pad=False)
    assert any("drops 2 of 10" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="distopt"):
        partition_indices(8, 0, 4, pad=False)
    assert not caplog.records


@pytest.mark.parametrize(
    "args, name",
    [
        ((-1, 0, 1), "n"),
        ((5, 0, 0), "world_size"),
        ((5, 4, 4), "rank"),
        ((5, -1, 4), "rank"),
        ((5.0, 0, 1), "n"),
    ],
)
def test_partition_validation(args, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        partition_indices(*args)
    if not isinstance(args[0], float):
        with pytest.raises(ValueError, match=rf"^{name} must"):
            eval_partition_indices(*args)


def test_partition_arrays_and_range():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10) * 10
    xs, ys = partition(x, y, 3, 4)
    np.testing.assert_array_equal(ys, [90, 0, 10])
    np.testing.assert_array_equal(xs, x[[9, 0, 1]])
    assert xs.dtype == np.float32
    xr, yr = partition(range(100, 110), y, 0, 4, pad=False)
    assert isinstance(xr, np.ndarray) and xr.dtype == np.int64
    np.testing.assert_array_equal(xr, [100, 101])
    with pytest.raises(ValueError, match="first dimension"):
        partition(x, y[:9], 0, 2)


def test_partition_torch_tensor():
    torch = pytest.importorskip("torch")
    x = torch.arange(10)
    xs, ys = partition(x, x * 2, 1, 2)
    assert xs.tolist() == [5, 6, 7, 8, 9] and ys.tolist() == [10, 12, 14, 16, 18]


def test_eval_partition_properties():
    for n, w in itertools.product(range(51), range(1, 6)):
        shards = [eval_partition_indices(n, r, w) for r in range(w)]
        counts = [len(s) for s in shards]
        assert max(counts) - min(counts) <= 1
        assert counts == sorted(counts, reverse=True)
        np.testing.assert_array_equal(np.concatenate(shards), np.arange(n))


# -------------------------------------------------------------------- H21

N, W = 10, 4


def test_h21_a_training_partition():
    shards = _shards(N, W, pad=True)
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    c = Counter(np.concatenate(shards).tolist())
    assert set(c) == set(range(N))
    assert sorted(i for i, v in c.items() if v == 2) == [0, 1]  # exactly 2 twice
    assert all(v <= 2 for v in c.values())

    shards = _shards(N, W, pad=False)
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    allids = np.concatenate(shards)
    assert len(set(allids.tolist())) == len(allids) == 8  # disjoint


def test_h21_b_evaluation_partition_exact_metric():
    shards = [eval_partition_indices(N, r, W) for r in range(W)]
    assert [len(s) for s in shards] == [3, 3, 2, 2]
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(N))

    labels = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    preds = np.array([0, 1, 1, 0, 2, 2, 0, 0, 2, 1])  # 6 of 10 right
    single = float(np.mean(preds == labels))
    correct = sum(int(np.sum(preds[s] == labels[s])) for s in shards)
    count = sum(len(s) for s in shards)
    assert count == N
    assert correct / count == single == 0.6
    # The padded training split would count ids 0 and 1 twice: not exact.
    tr = np.concatenate(_shards(N, W))
    assert np.mean(preds[tr] == labels[tr]) != single


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("epoch", range(5))
def test_h21_c_drop_last_never_keeps_duplicate_over_real(shuffle, epoch):
    # drop_last=True: each rank has 3 samples (12 padded), 1 batch of 2; the
    # dropped partial batch holds every padded position, so 8 distinct real
    # ids are used, no duplicates, 2 real ids skipped this epoch.
    ranks = _sampler_epoch(N, 2, W, shuffle=shuffle, drop_last=True, epoch=epoch)
    assert [len(b) for b in ranks] == [1, 1, 1, 1]
    ids = np.concatenate([b for batches in ranks for b in batches]).tolist()
    c = Counter(ids)
    if any(v > 1 for v in c.values()):
        assert set(c) == set(range(N))
    assert len(ids) == 8 and len(c) == 8  # the stated count behaviour

    # drop_last=False: 2 batches per rank (sizes 2, 1), 12 ids, all 10 covered.
    ranks = _sampler_epoch(N, 2, W, shuffle=shuffle, drop_last=False, epoch=epoch)
    assert [[len(b) for b in r] for r in ranks] == [[2, 1]] * W
    c = Counter(np.concatenate([b for r in ranks for b in r]).tolist())
    assert set(c) == set(range(N)) and sum(c.values()) == 12


def test_h21_c_invariant_over_many_sizes():
    for n, w, b in itertools.product(range(1, 30), range(1, 6), range(1, 5)):
        ranks = _sampler_epoch(n, b, w, seed=n, drop_last=True)
        ids = [i for r in ranks for batch in r for i in batch.tolist()]
        c = Counter(ids)
        if any(v > 1 for v in c.values()):
            assert set(c) == set(range(n)), (n, w, b)


def test_h21_d_fewer_samples_than_ranks():
    shards = _shards(3, 4)
    assert [s.tolist() for s in shards] == [[0], [1], [2], [0]]
    for drop_last in (False, True):
        lens = [DistributedSampler(3, 1, r, 4, drop_last=drop_last).num_batches() for r in range(4)]
        assert lens == [1, 1, 1, 1]
    lens = [DistributedSampler(3, 2, r, 4).num_batches() for r in range(4)]
    assert lens == [1, 1, 1, 1]


# -------------------------------------------------------------------- H01


def test_h01_partition_equal_steps():
    steps = [len(partition_indices(21, r, 2)) // 1 for r in range(2)]
    assert steps == [11, 11]
    for drop_last in (False, True):
        lens = [DistributedSampler(21, 1, r, 2, drop_last=drop_last).num_batches() for r in range(2)]
        assert lens == [11, 11]
        assert [sum(1 for _ in DistributedSampler(21, 1, r, 2).batches()) for r in range(2)] == lens


# ---------------------------------------------------------------- sampler


@pytest.mark.parametrize("n, w", [(10, 4), (17, 3), (16, 4), (5, 5), (2, 5), (1, 1)])
def test_sampler_disjoint_and_covering(n, w):
    prev = None
    for epoch in range(4):
        ranks = _sampler_epoch(n, 3, w, seed=7, epoch=epoch)
        ids = np.concatenate([b for r in ranks for b in r])
        assert ids.dtype == np.int64
        c = Counter(ids.tolist())
        assert set(c) == set(range(n))
        assert len(ids) - n == (-n) % w  # only the padding repeats
        assert len(ids) - n <= w - 1
        order = np.concatenate([np.concatenate(r) for r in ranks])
        if prev is not None and n > 3:
            assert not np.array_equal(order, prev)
        prev = order


def test_sampler_epoch_permutation_and_reproducible():
    a = DistributedSampler(100, 8, 1, 3, seed=3)
    b = DistributedSampler(100, 8, 1, 3, seed=3)
    e0 = np.concatenate(list(a.batches()))
    np.testing.assert_array_equal(e0, np.concatenate(list(b.batches())))
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = np.concatenate(list(a.batches()))
    np.testing.assert_array_equal(e1, np.concatenate(list(b.batches())))
    assert not np.array_equal(e0, e1)
    c = DistributedSampler(100, 8, 1, 3, seed=4)
    assert not np.array_equal(e0, np.concatenate(list(c.batches())))
    # iterating twice in the same epoch gives the same order
    np.testing.assert_array_equal(e1, np.concatenate(list(a.batches())))


def test_sampler_no_shuffle_interleaved():
    shards = [DistributedSampler(10, 10, r, 4, shuffle=False).indices() for r in range(4)]
    assert [s.tolist() for s in shards] == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]


def test_sampler_same_len_everywhere():
    for n, w, b, dl in itertools.product(
        [0, 1, 2, 3, 7, 10, 21, 64, 99], range(1, 7), [1, 2, 3, 8, 32], [False, True]
    ):
        samplers = [DistributedSampler(n, b, r, w, drop_last=dl) for r in range(w)]
        lens = {s.num_batches() for s in samplers}
        assert len(lens) == 1, (n, w, b, dl)
        per = samplers[0].num_samples
        assert per == -(-n // w)
        assert samplers[0].num_batches() == (per // b if dl else -(-per // b))
        for s in samplers:
            batches = list(s.batches())
            assert len(batches) == s.num_batches() and len(s) == per
            assert all(len(x) == b for x in batches[:-1])
            if dl:
                assert all(len(x) == b for x in batches)


def test_sampler_state_dict():
    s = DistributedSampler(50, 4, 0, 2, seed=9)
    s.set_epoch(5)
    state = s.state_dict()
    assert state == {"epoch": 5, "seed": 9}
    t = DistributedSampler(50, 4, 0, 2)
    t.load_state_dict(state)
    assert t.epoch == 5 and t.seed == 9
    np.testing.assert_array_equal(list(s), list(t))
    with pytest.raises(ValueError, match="epoch"):
        t.load_state_dict({"seed": 1})


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n=-1), "n"),
        (dict(batch_size=0), "batch_size"),
        (dict(rank=2), "rank"),
        (dict(world_size=0), "world_size"),
        (dict(seed=-1), "seed"),
    ],
)
def test_sampler_validation(kwargs, name):
    args = dict(n=10, batch_size=2, rank=0, world_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        DistributedSampler(**args)
    with pytest.raises(ValueError, match="epoch"):
        DistributedSampler(10, 2, 0, 2).set_epoch(-1)


def test_sampler_follows_pytorch_conventions():
    """Iterating yields sample indices and len() counts samples (torch's DistributedSampler), so
    DataLoader(sampler=...) works; batches() / batch_sampler() give equal batch counts on every rank."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(21))
    counts = set()
    for r in range(4):
        s = DistributedSampler(data, 4, r, 4, seed=1)
        assert len(s) == 6 and [type(i) for i in s] == [int] * 6
        via_sampler = [b[0].tolist() for b in DataLoader(data, batch_size=4, sampler=s)]
        via_batches = [b[0].tolist() for b in DataLoader(data, batch_sampler=s.batch_sampler())]
        assert via_sampler == via_batches == [b.tolist() for b in s.batches()]
        counts.add(len(s.batch_sampler()))
    assert counts == {2}
    with pytest.raises(ValueError, match="batch_size must be given"):
        list(DistributedSampler(10, None, 0, 2).batches())
