"""What every backend shares around its collectives: closing, exit, profiling, wait time.

* :func:`collective` decorates a backend's public calls: a call on a closed communicator raises
  :class:`~distopt.errors.CommunicatorClosedError` at once (before anything is sent or written); the call shows up in
  ``torch.profiler`` traces as ``distopt.<name>`` when torch is already imported and a profiler is recording (torch is
  never imported for it); its wall time is added to the communicator's ``wait_seconds``.
* :func:`close_at_exit` closes, at interpreter exit and before MPI is finalized, the communicators that were never
  closed (in reverse order of creation, the same on every rank); then the functions of :func:`last_at_exit` run.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CommunicatorClosedError

__all__ = ["collective", "timed_call", "profile_range", "close_at_exit", "forget_at_exit", "last_at_exit",
           "CommunicatorState", "Completed"]

F = TypeVar("F", bound=Callable[..., Any])

_NULL = contextlib.nullcontext()


def profile_range(label: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range named ``label`` while a profiler records, else a no-op.

    Never imports torch: without ``torch`` in ``sys.modules`` nobody can be profiling with it.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.autograd._profiler_enabled():
        return _NULL
    return torch.autograd.profiler.record_function(label)


class CommunicatorState:
    """The lifecycle fields of a backend (a mixin).

    Attributes:
        wait_seconds: wall-clock seconds this process has spent inside the communicator's blocking calls (collectives
            and handle waits, data movement included), since it was built.
        closed: True once :meth:`close` has run.
    """

    name = "?"
    rank = 0
    size = 1
    wait_seconds: float = 0.0
    closed: bool = False
    _in_call: bool = False

    def _check_open(self, call: str) -> None:
        if self.closed:
            raise CommunicatorClosedError(
                f"{call} on the closed {self.name} communicator (rank {self.rank} of {self.size}): it was "
                "closed (close() or DistOpt.close()) and cannot be used again; build a new one")

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def timed_call(comm: CommunicatorState, label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` inside a profiler range ``label``, its wall time added to ``comm.wait_seconds``.

    Plain code, no context-manager object: it wraps every collective, and small collectives take microseconds.
    """
    start = time.perf_counter()
    try:
        span = profile_range(label)
        if span is _NULL:
            return fn(*args, **kwargs)
        with span:
            return fn(*args, **kwargs)
    finally:
        comm.wait_seconds += time.perf_counter() - start


def collective(method: F) -> F:
    """Decorate a backend's public call: closed check, profiler range, wait time."""
    label = f"distopt.{method.__name__}"

    @functools.wraps(method)
    def call(self: CommunicatorState, *args: Any, **kwargs: Any) -> Any:
        self._check_open(method.__name__)
        if self._in_call:  # a collective built from others (e.g. staged through the device): time it once
            return method(self, *args, **kwargs)
        self._in_call = True
        try:
            return timed_call(self, label, method, self, *args, **kwargs)
        finally:
            self._in_call = False

    return call  # type: ignore[return-value]


class Completed:
    """The handle of an all-reduce that needs no host wait: ``test()`` is True, ``wait()`` returns the array.

    Used where the result is ready (world size 1) or already ordered on the caller's CUDA stream (NCCL).
    """

    def __init__(self, array: Any) -> None:
        self._array = array

    def test(self) -> bool:
        """Always True."""
        return True

    def wait(self) -> Any:
        """The array."""
        return self._array


_open: list[Any] = []
_last: list[Callable[[], None]] = []
_lock = threading.Lock()


def _close_all() -> None:
    while _open:
        comm = _open.pop()
        try:
            comm.close()
        except Exception as exc:  # noqa: BLE001 (at exit: report, go on with the others)
            sys.stderr.write(f"distopt: closing {comm!r} at exit failed: {exc}\n")
    while _last:
        fn = _last.pop(0)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            sys.stderr.write(f"distopt: cleaning up at exit failed: {exc}\n")


@functools.cache
def _register() -> None:  # once: atexit.register runs a function as often as it was registered
    atexit.register(_close_all)


def last_at_exit(fn: Callable[[], None]) -> None:
    """Have ``fn()`` run once (however often registered) at interpreter exit, after every open communicator was closed
    and before MPI is finalized; in the order given, an error reported and skipped."""
    with _lock:
        _register()
        if fn not in _last:
            _last.append(fn)


def close_at_exit(comm: Any) -> None:
    """Have ``comm.close()`` run at interpreter exit unless it is closed before.

    The handler is registered with :mod:`atexit` after mpi4py is imported, so it runs before mpi4py finalizes MPI.
    """
    with _lock:
        _register()
        _open.append(comm)


def forget_at_exit(comm: Any) -> None:
    """Drop ``comm`` from the exit list (it was closed)."""
    with _lock:
        for i, other in enumerate(_open):
            if other is comm:
                del _open[i]
                return
