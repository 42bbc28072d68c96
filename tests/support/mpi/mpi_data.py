"""Data across ranks under mpiexec: uneven inputs, join, accumulation, metrics, stop decisions."""
from __future__ import annotations

import numpy as np
import pytest

import distopt
from distopt import SGD, CollectiveMismatchError, CollectiveTimeoutError, DistOpt
from distopt.comm.mpi import MPICommunicator


class CountingComm(MPICommunicator):
    """An MPI communicator that counts all-reduces (blocking or not) of floating-point buffers (gradient buckets)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.float_reduces = 0

    def all_reduce(self, array, op="sum"):
        if array.dtype.kind == "f":
            self.float_reduces += 1
        return super().all_reduce(array, op)

    def all_reduce_async(self, array, op="sum"):
        if array.dtype.kind == "f":
            self.float_reduces += 1
        return super().all_reduce_async(array, op)


def test_h01_partitioner_gives_equal_steps(world):
    """H01 (a): 21 samples, bs 1: the sampler gives every rank the same number of steps."""
    counts = world.allgather(distopt.DistributedSampler(21, 1, world.rank, world.size).num_batches())
    assert len(set(counts)) == 1


def test_h01_uneven_steps_without_join_error_not_hang(world):
    """H01 (b): rank 1 runs one step more; every rank gets an error (no hang) naming the cause."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    opt = DistOpt(SGD(lr=0.1), timeout=5)
    p = np.zeros(3)
    steps = 11 if world.rank == 1 else 10
    with pytest.raises((CollectiveMismatchError, CollectiveTimeoutError)) as info:
        for _ in range(steps):
            opt.step([p], [np.ones(3)])
        opt.agree(True)  # end-of-epoch collective on the ranks that finished
    text = str(info.value)
    assert "step" in text or "steps" in text, text
    # the job stays usable for nothing else: the communicator is desynchronised; a fresh one works
    fresh = DistOpt(SGD(lr=0.1), timeout=5)
    assert fresh.agree(True)


@pytest.mark.parametrize("strategy", ["plain", "half"])
def test_join_with_3_5_7_batches_keeps_replicas_identical(world, strategy):
    """Join: rank r holds 3/5/7 batches; all finish, parameters identical, average over contributors."""
    opt = DistOpt(SGD(lr=0.01, momentum=0.9), timeout=20)
    rng = np.random.default_rng(world.rank)
    p = [np.zeros(4, np.float32), np.zeros((2, 3), np.float32)]
    opt.sync_params(p)
    n_batches = [3, 5, 7][world.rank % 3]
    with opt.join():
        for _ in range(n_batches):
            grads = [rng.normal(size=4).astype(np.float32), rng.normal(size=(2, 3)).astype(np.float32)]
            if strategy == "plain":
                opt.step(p, grads)
            else:
                opt.step_half(p, grads)
    gathered = world.allgather([a.copy() for a in p])
    for other in gathered:
        for a, b in zip(other, gathered[0]):
            np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(a).all() for a in p)
    assert opt.stats["steps"] == max([3, 5, 7][r % 3] for r in range(world.size))


@pytest.mark.parametrize("initial", [True, False], ids=["ddp_divisor", "active_divisor"])
def test_join_average_divides_by_world_size_or_contributing_ranks(world, initial):
    """While a rank has joined, the sum is divided by the world size (DDP's default, the joined rank
    contributing zeros) or, with ``divide_by_initial_world_size=False``, by the ranks still training."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    opt = DistOpt(SGD(lr=1.0), divide_by_initial_world_size=initial)
    p = np.zeros(1)
    steps = 1 if world.rank == 0 else 2
    with opt.join() as joined:
        for s in range(steps):
            opt.step([p], [np.array([float(world.rank + 1)])])
    # step 1: mean over all ranks of (r+1); step 2: the sum over ranks 1..W-1 of (r+1), divided
    first = (world.size + 1) / 2
    rest = [r + 1 for r in range(1, world.size)]
    second = sum(rest) / (world.size if initial else len(rest))
    np.testing.assert_allclose(p, [-(first + second)])
    assert joined.last_joined == world.size - 1


def test_join_rejects_sparse(world):
    opt = DistOpt(SGD(lr=1.0))
    p = np.zeros(4)
    with pytest.raises(ValueError, match="join"):
        with opt.join():
            opt.step_sparse([p], [np.ones(4)], spars=0.5, topK=True)


def test_h27_accumulation_averages_and_resets_each_epoch(world):
    """H27: k=2; micro-batches r0: 1,3 (then 0) and r1: 5,7 (then 2); one all-reduce per 2; flush at epoch end."""
    if world.size != 2:
        pytest.skip("shared case stated for W=2")
    comm = CountingComm()
    opt = DistOpt(SGD(lr=1.0), comm=comm, backward_passes_per_step=2)
    p = np.zeros(1)
    micro = {0: [1.0, 3.0, 0.0], 1: [5.0, 7.0, 2.0]}[world.rank]
    for epoch in range(2):
        reduces_before = comm.float_reduces
        for i, g in enumerate(micro):
            opt.step([p], [np.array([g])])
            if epoch == 0 and i == 1:
                np.testing.assert_allclose(p, [-4.0])  # mean of 1,3,5,7 (never -8 or -16)
        assert comm.float_reduces - reduces_before == 1  # one gradient all-reduce per 2 micro-batches
        opt.flush()  # leftover third micro-batch: its own averaged update (mean of 0 and 2)
        assert comm.float_reduces - reduces_before == 2
        np.testing.assert_allclose(p, [-5.0 * (epoch + 1)])


def test_accumulation_equals_one_large_batch(world):
    """k micro-batches accumulated == one step on their concatenation (mean loss), float64."""
    from tests.support import models

    k, mb = 3, 2
    acc_opt = DistOpt(SGD(lr=0.1, momentum=0.9), backward_passes_per_step=k)
    big_opt = DistOpt(SGD(lr=0.1, momentum=0.9))
    pa, pb = models.mlp_params(0), models.mlp_params(0)
    for step in range(3):
        x, y = models.batch(step, k * mb * world.size)
        mine = slice(world.rank * k * mb, (world.rank + 1) * k * mb)
        xs, ys = x[mine], y[mine]
        for j in range(k):
            acc_opt.step(pa, models.mlp_grads(pa, xs[j * mb:(j + 1) * mb], ys[j * mb:(j + 1) * mb]))
        big_opt.step(pb, models.mlp_grads(pb, xs, ys))
    for a, b in zip(pa, pb):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_h25_mean_reduce_keeps_inputs(world):
    """H25 (a)/(b): mean of losses 1, 3 is 2 and inputs unchanged; accuracy from summed counters, twice."""
    opt = DistOpt(SGD(lr=1.0))
    loss = np.array(1.0 + 2 * (world.rank % 2))
    got = opt.all_reduce_metrics({"loss": loss}, mean=("loss",))["loss"]
    assert loss == 1.0 + 2 * (world.rank % 2)
    expected = np.mean([1.0 + 2 * (r % 2) for r in range(world.size)])
    assert got == pytest.approx(expected)
    if world.size == 2:
        assert got == 2.0
    counters = {"correct": 3 if world.rank == 0 else 1, "total": 4 if world.rank == 0 else 1}
    for _ in range(2):  # no growth on a second call
        summed = opt.all_reduce_metrics(counters)
        acc = summed["correct"] / summed["total"]
        expect = (3 + (world.size - 1)) / (4 + (world.size - 1))
        assert acc == pytest.approx(expect)
        if world.size == 2:
            assert acc == pytest.approx(0.8)  # 4/5, never (0.75 + 1) / 2


def test_h31_rank0_only_metric_reduction_errors(world):
    """H31 (a): rank 0 reduces a metric while the others go on training: an error, not a hang."""
    if world.size < 2:
        pytest.skip("needs two ranks")
    opt = DistOpt(SGD(lr=1.0), timeout=5)
    p = np.zeros(2)
    opt.step([p], [np.ones(2)])
    with pytest.raises((CollectiveMismatchError, CollectiveTimeoutError)):
        if world.rank == 0:
            opt.all_reduce_metrics({"correct": 1, "count": 2})
        opt.step([p], [np.ones(2)])


def test_h31_collective_stop_decision(world):
    """H31 (b): per-rank losses 1.0 and 2.0, stop if loss < 1.5: the decision is the same on every rank."""
    opt = DistOpt(SGD(lr=1.0))
    loss = 1.0 if world.rank % 2 == 0 else 2.0
    mean = opt.all_reduce_metrics({"loss": loss}, mean=("loss",))["loss"]
    decisions = world.allgather((mean < 1.5, opt.agree(loss < 1.5, "root"), opt.agree(loss < 1.5, "any"),
                                 opt.agree(loss < 1.5, "all")))
    assert len(set(decisions)) == 1
    if world.size == 2:
        assert decisions[0] == (False, True, True, False)


def test_broadcast_object_vocabulary(world):
    """The AllenNLP pitfall's fix: the vocabulary built on rank 0 reaches every rank."""
    opt = DistOpt(SGD(lr=1.0))
    local_vocab = sorted({f"tok{world.rank}", "the", "a"})  # differs per rank
    vocab = opt.broadcast_object(local_vocab)
    assert vocab == sorted({"tok0", "the", "a"})


def test_sampler_shards_disjoint_and_covering_across_real_ranks(world):
    for epoch in range(3):
        s = distopt.DistributedSampler(103, 8, world.rank, world.size, seed=7)
        s.set_epoch(epoch)
        mine = np.array(list(s))  # iterating yields this rank's sample indices
        assert len(mine) == len(s) and np.array_equal(mine, np.concatenate(list(s.batches())))
        everyone = world.allgather(mine)
        union = np.concatenate(everyone)
        assert set(union.tolist()) == set(range(103))
        assert len(union) - 103 < world.size  # padding only
