"""Starting collectives asynchronously: the :class:`Handle` protocol and the step's :class:`Launcher`.

A backend's own non-blocking calls (MPI's ``Iallreduce``, NCCL on its stream, torch's ``async_op``) give handles; a
backend without them (shared memory) runs each call on one worker thread, in order.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence

from .base import Communicator
from .lifecycle import Completed

__all__ = ["Handle", "ThreadHandle", "Launcher"]


class Handle(Protocol):
    """A collective in progress: a gather, or a bucket's reduction (what
    :meth:`~distopt.strategies.base.GradientStrategy.start` returns and ``finish`` takes).

    The pipeline calls :meth:`test` while backward runs (MPI progresses a non-blocking collective only inside MPI calls)
    and may :meth:`wait` early to bound the reductions in flight; :meth:`wait` may be called more than once. The handles
    of :meth:`~distopt.strategies.base.BucketContext.launch` are Handles.
    """

    def test(self) -> bool:
        """True once the reduction has completed (never blocks)."""

    def wait(self) -> Any:
        """Block until the reduction has completed; returns its result (the reduced array)."""


class ThreadHandle:
    """A blocking collective run on the launcher's worker thread: a :class:`Handle`."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def test(self) -> bool:
        """True once the call has returned."""
        return self._future.done()

    def wait(self) -> Any:
        """Its result (re-raising its exception)."""
        return self._future.result()


class Launcher:
    """Starts all-reduces asynchronously: the backend's ``all_reduce_async`` or one worker thread.

    Args:
        comm: the communicator.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._native = getattr(comm, "all_reduce_async", None)
        self._executor: ThreadPoolExecutor | None = None
        self._last: Future | None = None  # the worker thread's last call

    @property
    def threaded(self) -> bool:
        """True when reductions run on a worker thread (the caller must drain before its next collective)."""
        return self._native is None

    def __call__(self, array: Any, op: str) -> Any:
        if self._native is not None:
            return self._native(array, op)
        return self._submit(self.comm.all_reduce, array, op)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> ThreadHandle:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distopt-allreduce")
        self._last = self._executor.submit(fn, *args)
        return ThreadHandle(self._last)

    def scatter(self, counts: Sequence[int]) -> Callable[[Any, str], Any]:
        """``scatter(array, op)``: starts a reduce-scatter of ``array`` over ``counts`` (the backend's
        ``reduce_scatter_async``, or the worker thread); its handle's ``wait()`` returns this rank's segment."""
        native = getattr(self.comm, "reduce_scatter_async", None)
        if native is not None:
            return lambda array, op: native(array, counts, op)
        return lambda array, op: self._submit(self.comm.reduce_scatter, array, counts, op)

    def gather(self, array: Any, counts: Sequence[int]) -> Any:
        """Start an in-place all-gather of ``array`` over ``counts`` (the backend's ``all_gather_into_async``); its
        handle's ``wait()`` completes it. Without one it is complete on return, run by :meth:`call`: left on the worker
        thread, it could pair with a collective the caller makes meanwhile."""
        native = getattr(self.comm, "all_gather_into_async", None)
        if native is not None:
            return native(array, counts)
        return Completed(self.call(self.comm.all_gather_into, array, counts))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a collective of ``comm``, in order with the reductions started before it: on the worker thread
        while it still runs one (two threads must not interleave one communicator's calls), else on the caller's."""
        if self._last is None or self._last.done():  # the worker holds nothing: no interleaving
            return fn(*args)
        return self._submit(fn, *args).wait()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None


