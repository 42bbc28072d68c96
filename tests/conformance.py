"""Backend-agnostic communicator checks, run over every backend and world size.

Each ``check_*`` takes a live communicator and asserts size-agnostic
expectations (rank r contributes r + 1, so a sum is size*(size+1)/2). Backend
suites (``tests/mpi/mpi_comm.py`` for MPI, the spawned shm suite) call
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
