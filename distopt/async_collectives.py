"""Asynchronous public collectives: ``DistOpt.all_reduce(t, async_op=True)`` and its siblings.

The step engine issues its own collectives on DistOpt's communicator from the main thread while a metric all-reduce may
be in flight, and every backend needs one order of collectives per communicator on every rank. So at the first
``async_op=True`` call on a communicator (DistOpt's, or a process group's) every rank of it creates a dedicated
communicator over the same ranks with :func:`distopt.comm.groups.split` (a collective on the parent issued from the
caller's thread, so ordered with its other collectives, as the blocking form is), and one FIFO worker thread (one for
all communicators) runs the same checked code as the blocking form (:mod:`distopt.array_collectives`) on it. Calls
complete in the order they were started; many may be in flight. An error (a bad argument on one rank, a mismatch, a
timeout) is raised by :meth:`CollectiveHandle.wait` on every rank.

In-place calls (all_reduce, broadcast) write into the caller's array when they run on the worker: do not read or
write it before ``wait()``. Backends that cannot split (NCCL; a torch.distributed group of a group) raise at the first
asynchronous call, on every rank alike.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from .comm.base import Communicator
from .comm.groups import Group, split
from .errors import CommunicatorClosedError

__all__ = ["CollectiveHandle", "AsyncCollectives"]


class CollectiveHandle:
    """A collective started with ``async_op=True`` (Horovod's handle, torch's ``Work``).

    Attributes:
        call: the collective's name (``"all_reduce"``, ...).
    """

    def __init__(self, future: Future, call: str) -> None:
        self._future, self.call = future, call

    def wait(self) -> Any:
        """Block until the collective has run; return what the blocking form returns (callable more than once).
        Raises what the blocking form raises, on every rank (bounded by the communicator's timeout)."""
        return self._future.result()

    def is_completed(self) -> bool:
        """True once the collective has run (successfully or not); never blocks."""
        return self._future.done()

    def __repr__(self) -> str:
        return f"CollectiveHandle({self.call}, completed={self.is_completed()})"


class AsyncCollectives:
    """The worker thread and the dedicated communicators of one DistOpt's asynchronous collectives."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._dedicated: dict[int, tuple[Communicator, Group]] = {}
        self._closed = False

    def submit(self, comm: Communicator, call: str, fn: Callable[..., Any], *args: Any) -> CollectiveHandle:
        """Start ``fn(dedicated communicator of comm, *args)`` on the worker; its handle.

        Raises:
            CommunicatorClosedError: after :meth:`close`.
            TypeError: ``comm`` has no ``split`` (a communicator of your own), on every rank.
            ValueError: the backend cannot split (NCCL), on every rank.
        """
        if self._closed:
            raise CommunicatorClosedError(f"{call}(async_op=True): this DistOpt is closed")
        dedicated = self._dedicated_of(comm, call)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distopt-async-collectives")
        return CollectiveHandle(self._executor.submit(fn, dedicated, *args), call)

    def _dedicated_of(self, comm: Communicator, call: str) -> Communicator:
        held = self._dedicated.get(id(comm))
        if held is not None and held[0] is comm:
            return held[1].require(call)
        if not callable(getattr(comm, "split", None)):
            raise TypeError(f"{call}(async_op=True) runs on a communicator of its own, made by "
                            f"Communicator.split(ranks); the {getattr(comm, 'name', type(comm).__name__)!r} "
                            "communicator has no split(): use the blocking form")
        group = split(comm, range(comm.size), name=f"async collectives of {getattr(comm, 'name', '?')}")
        self._dedicated[id(comm)] = (comm, group)
        return group.require(call)

    def close(self) -> None:
        """Wait for the collectives in flight (each bounded by its timeout), stop the worker and close the dedicated
        communicators; idempotent. Later submissions raise CommunicatorClosedError."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for _, group in self._dedicated.values():
            group.close()
        self._dedicated.clear()
