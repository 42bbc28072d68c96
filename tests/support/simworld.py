"""An in-process simulated world for fast strategy and engine tests (tests only).

W ranks run as W threads of one process over :class:`SimCommunicator`, an
in-memory implementation of the communicator protocol: every collective
deposits this rank's array, waits for all ranks at a barrier, and combines
the deposits in rank order as the backends do
(:func:`distopt.comm.control.reduce_inline`: every rank computes bitwise the
same result). Mismatched collectives (kind, count, dtype, op) raise
:class:`~distopt.errors.CollectiveMismatchError` on every rank; a rank that
never arrives makes the others raise
:class:`~distopt.errors.CollectiveTimeoutError` naming it.

``run_world(W, fn)`` runs ``fn(rank, comm)`` on every rank and returns the
results in rank order, re-raising the first rank's exception (with the rank
named) if any rank failed, and failing with the names of the ranks that
stalled if the world does not finish in time.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from distopt.comm.base import check_counts, check_reduce_args, check_rows
from distopt.comm.control import reduce_inline
from distopt.comm.lifecycle import Completed
from distopt.errors import CollectiveMismatchError, CollectiveTimeoutError

__all__ = ["SimCommunicator", "run_world", "second_world", "RankFailed"]


class RankFailed(AssertionError):
    """A rank of a simulated world raised or stalled."""


class _Shared:
    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size
        self.where: list[str] = ["not started"] * size


class SimCommunicator:
    """One rank's view of a simulated world (see the module docs).

    Attributes:
        calls: ``(collective, element count)`` per call, in order.
    """

    name = "sim"

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared, self.rank, self.size = shared, rank, shared.size
        self.calls: list[tuple[str, int]] = []
        self.closed = False

    def _sync(self) -> None:
        try:
            self._shared.barrier.wait(self._shared.timeout)
        except threading.BrokenBarrierError:
            late = [r for r, w in enumerate(self._shared.where) if not w.startswith("in ")]
            raise CollectiveTimeoutError(f"rank {self.rank}: collective timed out; ranks elsewhere: "
                                         + ", ".join(f"{r} ({self._shared.where[r]})" for r in late)) from None

    def _exchange(self, kind: str, array: Any, extra: Any = None, check_count: bool = True) -> list[Any]:
        if self.closed:
            raise RuntimeError(f"SimCommunicator rank {self.rank} is closed")
        self.calls.append((kind, int(array.size)))
        shared = self._shared
        shared.where[self.rank] = f"in {kind} #{len(self.calls)}"
        shared.slots[self.rank] = (kind, int(array.size) if check_count else -1, str(array.dtype), extra,
                                   np.array(array, copy=True))
        self._sync()
        everyone = list(shared.slots)
        self._sync()
        shared.where[self.rank] = f"after {kind} #{len(self.calls)}"
        heads = [e[:4] for e in everyone]
        if any(h != heads[0] for h in heads):
            raise CollectiveMismatchError(f"rank {self.rank}: collectives differ across ranks: {heads}")
        return [e[4] for e in everyone]

    def all_reduce(self, array: Any, op: str = "sum", kind: str = "all_reduce") -> Any:
        check_reduce_args(array, op)
        parts = self._exchange(kind, array, op)
        out = np.empty_like(parts[0])
        reduce_inline(parts, op, out)  # the backends' rank-order reduction of small all-reduces
        array[...] = out
        return array

    def all_reduce_async(self, array: Any, op: str = "sum") -> Completed:
        return Completed(self.all_reduce(array, op, kind="all_reduce_async"))

    def broadcast(self, array: Any, root: int = 0) -> Any:
        array[...] = self._exchange("broadcast", array, root)[root]
        return array

    def all_gather(self, array: Any) -> Any:
        return np.stack(self._exchange("all_gather", array))

    def all_gather_v(self, array: Any) -> list[Any]:
        return self._exchange("all_gather_v", array, check_count=False)

    def _counts(self, array: Any, counts: Any) -> list[int]:
        return check_counts(array, counts, self.size)

    def reduce_scatter(self, array: Any, counts: Any = None, op: str = "sum", kind: str = "reduce_scatter") -> Any:
        check_reduce_args(array, op)
        counts = self._counts(array, counts)
        parts = self._exchange(kind, array, (op, tuple(counts)))
        lo = sum(counts[:self.rank])
        mine = [p[lo:lo + counts[self.rank]] for p in parts]
        out = np.empty_like(mine[0])
        reduce_inline(mine, op, out)
        return out

    def reduce_scatter_async(self, array: Any, counts: Any = None, op: str = "sum") -> Completed:
        return Completed(self.reduce_scatter(array, counts, op, kind="reduce_scatter_async"))

    def all_gather_into(self, array: Any, counts: Any = None, kind: str = "all_gather_into") -> Any:
        counts = self._counts(array, counts)
        parts = self._exchange(kind, array, tuple(counts))
        lo = 0
        for r, c in enumerate(counts):
            array[lo:lo + c] = parts[r][lo:lo + c]
            lo += c
        return array

    def all_gather_into_async(self, array: Any, counts: Any = None) -> Completed:
        return Completed(self.all_gather_into(array, counts, kind="all_gather_into_async"))

    def all_to_all(self, array: Any) -> Any:
        check_rows(array, self.size)
        parts = self._exchange("all_to_all", array)
        return np.stack([p[self.rank] for p in parts])

    def barrier(self) -> None:
        self._exchange("barrier", np.zeros(0))

    def close(self) -> None:
        self.closed = True


def second_world(size: int, timeout: float = 10.0) -> Callable[[int], SimCommunicator]:
    """Another simulated communicator over the same ranks (e.g. a host control plane): call it with a rank."""
    shared = _Shared(size, timeout)
    return lambda rank: SimCommunicator(shared, rank)


def run_world(size: int, fn: Callable[[int, SimCommunicator], Any], timeout: float = 20.0) -> list[Any]:
    """Run ``fn(rank, comm)`` on ``size`` threads; return the results in rank order.

    Raises:
        RankFailed: a rank raised (its exception chained, the rank named) or
            the world did not finish within ``timeout`` seconds (the ranks
            still running named).
    """
    shared = _Shared(size, timeout / 2)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, SimCommunicator(shared, rank))
        except BaseException as exc:  # noqa: BLE001 (reported below, with the rank)
            errors[rank] = exc
            shared.barrier.abort()
        finally:
            shared.where[rank] = "done"

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stalled = [r for r, t in enumerate(threads) if t.is_alive()]
    if stalled:
        raise RankFailed(f"simulated world of {size}: rank(s) {stalled} stalled in "
                         + ", ".join(shared.where[r] for r in stalled))
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    failed.sort(key=lambda re: isinstance(re[1], CollectiveTimeoutError))  # the cause before the ranks it stopped
    if failed:
        rank, exc = failed[0]
        raise RankFailed(f"rank {rank} of {size} raised {type(exc).__name__}: {exc}") from exc
    return results
