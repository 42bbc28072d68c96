"""Backend-agnostic communicator checks, run over every backend and world size.

Each ``check_*`` takes a live communicator and asserts size-agnostic
expectations (rank r contributes r + 1, so a sum is size*(size+1)/2). Backend
suites (``tests/support/mpi/mpi_comm.py`` for MPI, the spawned shm suite) call
:func:`run_all` on every rank in the same order.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt.errors import CollectiveMismatchError

FLOAT_DTYPES = (np.float32, np.float64)
INT_DTYPES = (np.int32, np.int64)


def _tri(size: int) -> int:
    return size * (size + 1) // 2


def check_all_reduce_sum(comm) -> None:
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        for shape in [(), (1,), (7,), (3, 5), (1000,), (1, 0, 2)]:
            a = np.full(shape, comm.rank + 1, dtype=dtype)
            out = comm.all_reduce(a)
            assert out is a, "all_reduce must work in place and return its argument"
            assert a.shape == shape and a.dtype == dtype
            np.testing.assert_array_equal(a, np.full(shape, _tri(comm.size), dtype=dtype))


def check_all_reduce_large(comm) -> None:
    a = np.arange(3_000_001, dtype=np.float64) * (comm.rank + 1)
    comm.all_reduce(a)
    np.testing.assert_array_equal(a, np.arange(3_000_001, dtype=np.float64) * _tri(comm.size))


def check_all_reduce_ops(comm) -> None:
    a = np.array([comm.rank, -comm.rank, 2.0], dtype=np.float64)
    comm.all_reduce(a, op="avg")
    np.testing.assert_allclose(a, [(comm.size - 1) / 2, -(comm.size - 1) / 2, 2.0], rtol=0, atol=1e-12)
    m = np.array([comm.rank, -comm.rank], dtype=np.int64)
    comm.all_reduce(m, op="max")
    np.testing.assert_array_equal(m, [comm.size - 1, 0])
    m = np.array([comm.rank, -comm.rank], dtype=np.float32)
    comm.all_reduce(m, op="min")
    np.testing.assert_array_equal(m, [0, -(comm.size - 1)])


def check_integer_avg_raises(comm) -> None:
    """H09 (a): integer averaging is a clear TypeError, never silent zeros."""
    a = np.array([4, 6, 7], dtype=np.int32) + 2 * comm.rank
    with pytest.raises(TypeError, match="avg"):
        comm.all_reduce(a, op="avg")
    comm.all_reduce(a, op="sum")
    expect = np.array([4, 6, 7]) * comm.size + 2 * _tri(comm.size - 1)
    np.testing.assert_array_equal(a, expect)


def check_bool_reduce(comm) -> None:
    """H09 (b): bool sum/max is logical OR, min is logical AND."""
    a = np.array([True, comm.rank == 1, False])
    b = a.copy()
    comm.all_reduce(a, op="sum")
    comm.all_reduce(b, op="min")
    np.testing.assert_array_equal(a, [True, comm.size > 1, False])
    np.testing.assert_array_equal(b, [True, False, False])  # rank 0 holds False


def check_broadcast(comm) -> None:
    for root in range(comm.size):
        a = np.full((4, 3), comm.rank, dtype=np.float32)
        out = comm.broadcast(a, root=root)
        assert out is a
        np.testing.assert_array_equal(a, np.full((4, 3), root, dtype=np.float32))
    e = np.zeros((0, 2))
    comm.broadcast(e, root=0)
    assert e.shape == (0, 2)


def check_all_gather(comm) -> None:
    a = np.array([comm.rank, comm.rank * 10], dtype=np.int64)
    g = comm.all_gather(a)
    assert g.shape == (comm.size, 2)
    np.testing.assert_array_equal(g, [[r, r * 10] for r in range(comm.size)])


def check_all_gather_v(comm) -> None:
    for lengths in [lambda r: r, lambda r: 0, lambda r: 3 if r == 0 else 0]:
        a = np.arange(lengths(comm.rank), dtype=np.float32) + 100 * comm.rank
        got = comm.all_gather_v(a)
        assert len(got) == comm.size
        for r, part in enumerate(got):
            np.testing.assert_array_equal(part, np.arange(lengths(r), dtype=np.float32) + 100 * r)
            assert part.dtype == np.float32


def check_half_sums(comm) -> None:
    """16-bit float sums and averages of sizes that do not split evenly across ranks (exact values)."""
    dtypes = [np.float16]
    try:
        import ml_dtypes
        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    for dtype in dtypes:
        for n in (3, 1001, 70001):
            pattern = (np.arange(n) % 8).astype(np.float32)
            a = (pattern * (comm.rank + 1)).astype(dtype)
            try:
                comm.all_reduce(a, op="sum")
            except TypeError as exc:  # a backend without bfloat16 must say so clearly
                assert dtype is not np.float16 and "bfloat16" in str(exc), exc
                break
            np.testing.assert_array_equal(a.astype(np.float32), pattern * _tri(comm.size))
            b = (pattern * 2 * comm.size).astype(dtype)
            comm.all_reduce(b, op="avg")
            np.testing.assert_array_equal(b.astype(np.float32), pattern * 2 * comm.size)
            assert a.dtype == dtype and b.dtype == dtype


def check_results_survive_the_next_call(comm) -> None:
    """Small calls may travel inline in a reused control block: their results must be copies."""
    gathered = comm.all_gather(np.array([comm.rank, 7], dtype=np.int64))
    pieces = comm.all_gather_v(np.arange(comm.rank + 1, dtype=np.int32))
    reduced = comm.all_reduce(np.array([1.5], dtype=np.float64))
    comm.all_gather_v(np.full(3, -1, dtype=np.int32))
    comm.all_gather(np.array([-5, -5], dtype=np.int64))
    comm.all_reduce(np.array([-9.0], dtype=np.float64))
    np.testing.assert_array_equal(gathered, [[r, 7] for r in range(comm.size)])
    for r, part in enumerate(pieces):
        np.testing.assert_array_equal(part, np.arange(r + 1, dtype=np.int32))
    assert reduced.tolist() == [1.5 * comm.size]


def check_barrier(comm) -> None:
    for _ in range(3):
        comm.barrier()


def check_mismatch_h03(comm) -> None:
    """H03 (a)/(b): different lengths or dtypes raise on every rank, never a partial sum."""
    if comm.size < 2:
        return
    a = np.ones(6 if comm.rank == 0 else 4, dtype=np.float32)
    with pytest.raises(CollectiveMismatchError, match="element count"):
        comm.all_reduce(a)
    b = np.ones(4, dtype=np.float32 if comm.rank == 0 else np.float16)
    with pytest.raises(CollectiveMismatchError, match="dtype"):
        comm.all_reduce(b)
    # the communicator is still usable afterwards
    c = np.ones(2)
    comm.all_reduce(c)
    np.testing.assert_array_equal(c, [comm.size] * 2)


CHECKS = [
    check_all_reduce_sum,
    check_all_reduce_large,
    check_all_reduce_ops,
    check_integer_avg_raises,
    check_bool_reduce,
    check_broadcast,
    check_all_gather,
    check_all_gather_v,
    check_results_survive_the_next_call,
    check_half_sums,
    check_barrier,
    check_mismatch_h03,
]


def run_all(comm) -> None:
    """Run every check in a fixed order (every rank must call this)."""
    for check in CHECKS:
        check(comm)


# ------------------------------------------------------------------ sharded collectives
def _offsets(counts) -> list[int]:
    return [sum(counts[:r]) for r in range(len(counts))]


def _count_patterns(size: int) -> list[tuple[int, list[int] | None]]:
    """(element count, counts) pairs: balanced and uneven defaults, explicit uneven, a rank with 0
    elements, all ranks with 0."""
    return [
        (12 * size, None),
        (12 * size + 5, None),
        (sum(r + 1 for r in range(size)), [r + 1 for r in range(size)]),
        (7 * (size - 1), [7] * (size - 1) + [0]),
        (0, [0] * size),
    ]


def _data(rank: int, n: int, dtype) -> np.ndarray:
    """Rank ``rank``'s input: positive values (no cancellation, so a relative tolerance holds)."""
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.random(n) + 1).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _assert_segment(comm, got, full, counts, dtype) -> None:
    """``got`` is this rank's segment of ``full`` (an all-reduce of the same data): bitwise at W <= 2 and
    for integers, to rtol 1e-6 (float32) / 1e-12 (float64) beyond."""
    lo = _offsets(counts)[comm.rank]
    want = full[lo:lo + counts[comm.rank]]
    assert got.shape == (counts[comm.rank],) and got.dtype == np.dtype(dtype), (got.shape, got.dtype)
    if comm.size <= 2 or np.dtype(dtype).kind != "f":
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6 if np.dtype(dtype).itemsize <= 4 else 1e-12)


def _counts_of(comm, n: int, counts):
    return counts if counts is not None else [n // comm.size + (r < n % comm.size) for r in range(comm.size)]


def check_reduce_scatter_matches_all_reduce(comm) -> None:
    for dtype in (np.float32, np.float64, np.int64):
        for n, counts in _count_patterns(comm.size):
            a = _data(comm.rank, n, dtype)
            got = comm.reduce_scatter(a.copy(), counts)
            full = comm.all_reduce(a.copy())
            _assert_segment(comm, got, full, _counts_of(comm, n, counts), dtype)


def check_reduce_scatter_ops(comm) -> None:
    n, counts = 5 * comm.size + 2, None
    for dtype, ops in ((np.float32, ("avg", "max", "min")), (np.float64, ("avg",)), (np.int64, ("max", "min"))):
        for op in ops:
            a = _data(comm.rank, n, dtype)
            got = comm.reduce_scatter(a.copy(), counts, op=op)
            _assert_segment(comm, got, comm.all_reduce(a.copy(), op=op), _counts_of(comm, n, counts), dtype)
    with pytest.raises(TypeError, match="avg"):
        comm.reduce_scatter(np.ones(comm.size, np.int64), op="avg")
    with pytest.raises(ValueError, match="op must be one of"):
        comm.reduce_scatter(np.ones(comm.size), op="prod")


def check_reduce_scatter_large(comm) -> None:
    n = 1_200_003
    a = _data(comm.rank, n, np.float32)
    got = comm.reduce_scatter(a.copy())
    _assert_segment(comm, got, comm.all_reduce(a.copy()), _counts_of(comm, n, None), np.float32)


def _half_dtypes() -> list:
    dtypes = [np.float16]
    try:
        import ml_dtypes
        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    return dtypes


def check_reduce_scatter_half(comm) -> None:
    """16-bit float sums and averages (exact values), balanced and uneven counts."""
    for dtype in _half_dtypes():
        for n, counts in ((3, None), (70001, None), (1001, [0] * (comm.size - 1) + [1001])):
            counts_ = _counts_of(comm, n, counts)
            lo, c = _offsets(counts_)[comm.rank], counts_[comm.rank]
            pattern = (np.arange(n) % 8).astype(np.float32)
            try:
                got = comm.reduce_scatter((pattern * (comm.rank + 1)).astype(dtype), counts)
            except TypeError as exc:  # a backend without bfloat16 must say so clearly
                assert dtype is not np.float16 and "bfloat16" in str(exc), exc
                break
            assert got.dtype == dtype and got.shape == (c,)
            np.testing.assert_array_equal(got.astype(np.float32), pattern[lo:lo + c] * _tri(comm.size))
            got = comm.reduce_scatter((pattern * 2 * comm.size).astype(dtype), counts, op="avg")
            np.testing.assert_array_equal(got.astype(np.float32), pattern[lo:lo + c] * 2 * comm.size)


def check_all_gather_into(comm) -> None:
    for dtype in (np.float32, np.int64, np.bool_, np.float16):
        for n, counts in _count_patterns(comm.size) + [(1_200_007, None)] * (dtype == np.float32):
            counts_ = _counts_of(comm, n, counts)
            starts = _offsets(counts_)
            want = np.concatenate([(np.arange(c) + 1000 * r) % 251 for r, c in enumerate(counts_)] or [[]])
            want = want.astype(dtype)
            a = np.zeros(n, dtype) if dtype == np.bool_ else np.full(n, -1, dtype)
            lo, c = starts[comm.rank], counts_[comm.rank]
            a[lo:lo + c] = want[lo:lo + c]
            out = comm.all_gather_into(a, counts)
            assert out is a, "all_gather_into works in place and returns its argument"
            np.testing.assert_array_equal(a, want)


def check_all_to_all(comm) -> None:
    size = comm.size
    for dtype in (np.int64, np.float32):
        for rest in ((), (3,), (2, 2), (0,)):
            k = int(np.prod(rest, dtype=np.int64))
            a = (comm.rank * 1000 + np.arange(size * k).reshape(size, *rest)).astype(dtype)
            out = comm.all_to_all(a)
            assert out is not a and out.shape == a.shape and out.dtype == a.dtype
            want = np.stack([r * 1000 + comm.rank * k + np.arange(k).reshape(rest) for r in range(size)])
            np.testing.assert_array_equal(out, want.astype(dtype))


def check_shard_bad_args(comm) -> None:
    """Bad counts and shapes raise on every rank before anything moves (the next call still works)."""
    size, n = comm.size, 4 * comm.size
    a = np.ones(n, np.float32)
    negative = [-1, n + 1] + [0] * (size - 2) if size > 1 else [-1]
    for counts in ([n] * (size + 1), negative, [n + 1] + [0] * (size - 1), [1.5] * size):
        with pytest.raises(ValueError, match="counts"):
            comm.reduce_scatter(a, counts)
        with pytest.raises(ValueError, match="counts"):
            comm.all_gather_into(a, counts)
    for bad, error in ((np.ones((size, 4), np.float32), ValueError), (np.ones(2 * n, np.float32)[::2], TypeError)):
        with pytest.raises(error, match="array"):
            comm.reduce_scatter(bad)
        with pytest.raises(error, match="array"):
            comm.all_gather_into(bad)
    with pytest.raises(ValueError, match="array"):
        comm.all_to_all(np.ones((size + 1, 2)))
    with pytest.raises(TypeError, match="array"):
        comm.all_to_all(np.ones((size, 4))[:, ::2])
    got = comm.reduce_scatter(a, [n] + [0] * (size - 1))
    np.testing.assert_array_equal(got, np.full(n if comm.rank == 0 else 0, size, np.float32))


def check_shard_mismatch(comm) -> None:
    """Ranks with different counts, element counts, ops or dtypes raise on every rank; usable afterwards."""
    if comm.size < 2:
        return
    n = 2 * comm.size
    swapped = [n] + [0] * (comm.size - 1) if comm.rank == 0 else [0] * (comm.size - 1) + [n]
    with pytest.raises(CollectiveMismatchError, match="counts"):
        comm.reduce_scatter(np.ones(n, np.float32), swapped)
    with pytest.raises(CollectiveMismatchError, match="counts"):
        comm.all_gather_into(np.ones(n, np.float32), swapped)
    with pytest.raises(CollectiveMismatchError, match="element count"):
        comm.reduce_scatter(np.ones(n + (comm.rank == 0) * comm.size, np.float32))
    with pytest.raises(CollectiveMismatchError, match="op"):
        comm.reduce_scatter(np.ones(n, np.float32), op="max" if comm.rank == 0 else "sum")
    with pytest.raises(CollectiveMismatchError, match="dtype"):
        comm.reduce_scatter(np.ones(n, np.float32 if comm.rank == 0 else np.float64))
    with pytest.raises(CollectiveMismatchError, match="dtype"):
        comm.all_to_all(np.ones((comm.size, 2), np.float32 if comm.rank == 0 else np.int32))
    got = comm.reduce_scatter(np.ones(n, np.float32))
    np.testing.assert_array_equal(got, np.full(2, comm.size, np.float32))


def check_shard_async(comm) -> None:
    """Several reduce-scatters and all-gathers in flight, a blocking call in between, completed in start
    order: the blocking forms' results; ``wait()`` twice returns the same; bad arguments raise at once."""
    if not hasattr(comm, "reduce_scatter_async"):
        return
    size, rank = comm.size, comm.rank
    uneven = [r + 1 for r in range(size)]
    starts = _offsets(uneven)
    inputs = [(_data(rank, 300_001, np.float32), None, "sum"), (_data(rank, 11, np.float64), None, "avg"),
              (((np.arange(1001) % 8) * (rank + 1)).astype(np.float16), [0] * (size - 1) + [1001], "sum"),
              (_data(rank, sum(uneven), np.int64), uneven, "max")]
    handles = []
    gathered = np.full(sum(uneven), -1, np.int64)
    gathered[starts[rank]:starts[rank] + uneven[rank]] = rank
    for i, (a, counts, op) in enumerate(inputs):
        handles.append(comm.reduce_scatter_async(a.copy(), counts, op=op))
        if i == 1:
            gather = comm.all_gather_into_async(gathered, uneven)
    for h in handles:
        h.test()
    comm.all_reduce(np.ones(3, np.float32))  # a blocking collective while they are in flight
    results = [h.wait() for h in handles]
    assert gather.wait() is gathered and gather.wait() is gathered and gather.test()
    np.testing.assert_array_equal(gathered, np.repeat(np.arange(size), uneven))
    for h, got, (a, counts, op) in zip(handles, results, inputs):
        assert h.wait() is got and h.test()
        full = comm.all_reduce(a.copy(), op=op)
        counts_ = _counts_of(comm, a.size, counts)
        if a.dtype == np.float16:
            lo = _offsets(counts_)[rank]
            np.testing.assert_array_equal(got, full[lo:lo + counts_[rank]])
        else:
            _assert_segment(comm, got, full, counts_, a.dtype)
    with pytest.raises(ValueError, match="counts"):
        comm.reduce_scatter_async(np.ones(4), [4] * (size + 1))
    with pytest.raises(ValueError, match="counts"):
        comm.all_gather_into_async(np.ones(4), [5] + [0] * (size - 1))


SHARD_CHECKS = [
    check_reduce_scatter_matches_all_reduce,
    check_reduce_scatter_ops,
    check_reduce_scatter_large,
    check_reduce_scatter_half,
    check_all_gather_into,
    check_all_to_all,
    check_shard_bad_args,
    check_shard_mismatch,
    check_shard_async,
]


def run_shards(comm) -> None:
    """Run every sharded-collective check in a fixed order (every rank must call this)."""
    for check in SHARD_CHECKS:
        check(comm)


def shard_case(rank: int, comm) -> int:  # noqa: ARG001 (tests.support.backends.run_case's signature)
    """:func:`run_shards` as a :func:`tests.support.backends.run_case` case; returns the number of checks run."""
    run_shards(comm)
    return len(SHARD_CHECKS)
