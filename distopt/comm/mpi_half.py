"""float16 and bfloat16 reductions on MPI, which has no datatype for them.

The words travel as ``MPI.UINT16_T`` (2 bytes per element). A sum (or average) is done as a reduce-scatter and an
all-gather, the algorithm MPI libraries use for large all-reduces (Rabenseifner; Thakur, Rabenseifner & Gropp 2005),
with the reduction done by distopt between the two: an ``Ialltoallv`` hands rank r every rank's copy of chunk r, rank r
adds them in float32 and rounds once (:func:`distopt.core._fastcast.sum_rows`), and an in-place ``Iallgatherv`` spreads
the reduced chunks. Every rank ends with the same bits; the wire carries the same bytes as a ring all-reduce of 16-bit
words. Max and min use a user-defined MPI operation instead.

MPI requires every rank to start the collectives of one communicator in the same order, and the all-gather of a sum can
only start once its reduce-scatter has completed, at a moment that differs per rank. So the all-gathers run on a
communicator of their own, started strictly in the order the sums were started (:class:`HalfQueue`), and the backend
drives that queue from every one of its waits, so no rank blocked elsewhere holds up a peer's all-gather.
"""
from __future__ import annotations

import functools
from collections import deque
from typing import Any

import numpy as np
from mpi4py import MPI

from ..core._fastcast import cast_into, sum_rows
from .base import _starts, split_counts

__all__ = ["half_dtypes", "half_op", "HalfSum", "HalfQueue"]


@functools.lru_cache(maxsize=1)
def half_dtypes() -> tuple[np.dtype, ...]:
    """The 16-bit float dtypes this process can reduce (bfloat16 needs ml_dtypes); looked up once."""
    try:
        import ml_dtypes
    except ImportError:
        return (np.dtype(np.float16),)
    return (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


_OPS: dict[tuple[np.dtype, str], Any] = {}


def half_op(dtype: np.dtype, op: str) -> Any:
    """The user-defined MPI op for ``"max"``, ``"min"`` or ``"product"`` of a 16-bit float dtype (sums are
    :class:`HalfSum`; each combination in float32, rounded once), created once per process (MPI limits their number)."""
    key = (dtype, op)
    if key not in _OPS:
        ufunc = {"max": np.maximum, "min": np.minimum, "product": np.multiply}[op]

        def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:  # noqa: ARG001
            a = np.frombuffer(inbuf, dtype=dtype)
            b = np.frombuffer(inoutbuf, dtype=dtype)
            wide = cast_into(b, np.empty(b.shape, np.float32))
            ufunc(wide, cast_into(a, np.empty(a.shape, np.float32)), out=wide)
            cast_into(wide, b)

        _OPS[key] = MPI.Op.Create(combine, commute=True)
    return _OPS[key]


class HalfQueue:
    """The sums whose all-gather has not started yet, oldest first, and the communicator of the all-gathers.

    Args:
        gather_comm: an ``mpi4py.MPI.Comm`` used only for the all-gathers.
    """

    def __init__(self, gather_comm: Any) -> None:
        self.gather_comm = gather_comm
        self.waiting: deque[HalfSum] = deque()

    def drive(self) -> None:
        """Start the all-gather of every sum at the head whose reduce-scatter has completed, in order."""
        while self.waiting and self.waiting[0].scattered():
            self.waiting.popleft().gather(self.gather_comm)


class HalfSum:
    """An in-place sum of a 16-bit float array across ``comm``, in flight (see the module docs).

    Duck-types an MPI request: :meth:`Test` drives it (and the sums before it), True once ``array`` holds the sum.

    Args:
        comm: the ``mpi4py.MPI.Comm`` of the reduce-scatter (every rank starts the same sums in the same order).
        array: C-contiguous float16 or bfloat16 NumPy array, any shape.
        queue: the backend's :class:`HalfQueue`; this sum joins its end.
    """

    def __init__(self, comm: Any, array: np.ndarray, queue: HalfQueue) -> None:
        size, rank = comm.Get_size(), comm.Get_rank()
        self._counts = split_counts(array.size, size)
        self._displs = _starts(self._counts)
        mine = self._counts[rank]
        self._comm, self._dtype = comm, array.dtype
        self._words = array.reshape(-1).view(np.uint16)
        self._chunk = self._words[self._displs[rank]:self._displs[rank] + mine]
        self._recv = np.empty((size, mine), dtype=np.uint16)  # every rank's copy of my chunk
        self._queue = queue
        self._scatter = comm.Ialltoallv([self._words, (self._counts, self._displs), MPI.UINT16_T],
                                        [self._recv, ([mine] * size, [mine * r for r in range(size)]),
                                         MPI.UINT16_T])
        self._gathering: Any = None  # the all-gather's request, once started
        self._done = False
        queue.waiting.append(self)

    def scattered(self) -> bool:
        """True once the reduce-scatter has completed (this rank holds every copy of its chunk)."""
        return bool(self._scatter.Test())

    def gather(self, gather_comm: Any) -> None:
        """Sum this rank's chunk, then start the in-place all-gather (called in start order)."""
        sum_rows(self._recv.view(self._dtype), self._chunk.view(self._dtype))
        self._gathering = gather_comm.Iallgatherv(MPI.IN_PLACE, [self._words, (self._counts, self._displs),
                                                                 MPI.UINT16_T])

    def Test(self) -> bool:  # noqa: N802 (an MPI request's name)
        """Progress the queue; True once this sum is complete on this rank."""
        if not self._done:
            self._queue.drive()
            self._done = self._gathering is not None and bool(self._gathering.Test())
        return self._done
