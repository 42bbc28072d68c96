"""Devices, streams and events of the stand-in, with streams that DEFER their work.

The model: array operations run at once, on the current stream, after
everything queued on that stream before them (``run_current``); work queued
explicitly on a stream (NCCL collectives, :func:`cupy._standin.launch`)
runs only when something orders it:

* ``stream.synchronize()``, ``event.synchronize()`` and ``Device.synchronize()``
  run it, blocking;
* ``event.done`` and ``stream.done`` run what can run without waiting on a peer;
* ``a.wait_event(e)`` queues on ``a`` a wait for ``e``'s stream up to the point
  ``e`` was recorded, so work on ``a`` after the wait sees that work done.

A queued NCCL call, though, starts as early as a GPU could start it: at
once when nothing is queued before it on its stream, reading its send
buffer then. So a missing ``wait_event`` gives a stale buffer either way (a
wrong number in a test), never a right answer by luck. The legacy null stream (ptr 0) and streams
made with ``non_blocking=False`` order against each other, as CUDA's legacy
default stream does; ``non_blocking=True`` streams order against nothing.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Callable

from .. import _state
from . import runtime

__all__ = ["Device", "Stream", "ExternalStream", "Event", "get_current_stream", "synchronize_device"]

_POINTERS = itertools.count(0x7F00_0000_1000, 0x100)
_QUEUES: dict[int, "_Queue"] = {}
_LOCK = threading.RLock()


class _Queue:
    """The work of one CUDA stream, in order. ``posted`` counts what was ever queued, ``done`` what ran."""

    def __init__(self, ptr: int, device: int, blocking: bool) -> None:
        self.ptr, self.device, self.blocking = ptr, device, blocking
        self.items: collections.deque = collections.deque()
        self.posted = 0
        self.done = 0
        self.busy_until = 0.0  # when the kernels queued so far finish
        self.lock = threading.RLock()

    def put(self, item: Any) -> None:
        """Queue ``item``; work that needs nothing unfinished before it starts at once (an NCCL call
        reads its send buffer now, as a GPU may run it now), and kernels still busy stay queued."""
        with self.lock:
            self.items.append(item)
            self.posted += 1
            self.busy_until = max(self.busy_until, getattr(item, "busy_until", 0.0))
            if getattr(item, "eager", False):
                self.run(block=False)

    def run(self, upto: int | None = None, block: bool = True) -> bool:
        """Run queued work up to position ``upto`` (all by default); False if it had to wait and may not."""
        with self.lock:
            upto = self.posted if upto is None else upto
            while self.done < upto:
                head = self.items[0]
                if not head.advance(block):
                    return False
                self.items.popleft()
                self.done += 1
            return True


class _Kernel:
    """A kernel: ``fn`` runs when the stream reaches it. With ``busy_until`` (a ``time.monotonic()``) the
    stream is not done before then: an event recorded after it is unfinished for a poll until that time,
    a synchronisation sleeps until it; array operations queued after it do not wait on the host (they
    are launched, as on a GPU)."""

    def __init__(self, fn: Callable[[], None] | None, busy_until: float = 0.0) -> None:
        self.fn, self.busy_until = fn, busy_until

    def advance(self, block: bool) -> bool:  # noqa: ARG002
        if self.fn is not None:
            self.fn()
            self.fn = None
        return True


class _Wait:
    """``cudaStreamWaitEvent``: the queue holding this item runs nothing after it before ``queue`` reached
    ``upto`` and its kernels up to there finished (``until``)."""

    def __init__(self, queue: _Queue, upto: int, until: float) -> None:
        self.queue, self.upto, self.until = queue, upto, until

    def advance(self, block: bool) -> bool:
        return self.queue.run(self.upto, block) and _finished(self.until, block)


def _finished(until: float, block: bool) -> bool:
    left = until - time.monotonic()
    if left <= 0:
        return True
    if block:
        time.sleep(left)
    return block


def _current_device() -> int:
    return int(getattr(_state.local, "device", 0))


def _check_device(device: int) -> None:
    if not 0 <= device < runtime._init():
        raise runtime.CUDARuntimeError(101)


class Device:
    """``cupy.cuda.Device``: ``Device(i).use()`` makes device ``i`` current for this host thread."""

    def __init__(self, device: Any = None) -> None:
        self.id = _current_device() if device is None else int(device)

    def use(self) -> None:
        _check_device(self.id)
        _state.local.device = self.id

    def __enter__(self) -> "Device":
        stack = getattr(_state.local, "device_stack", None)
        if stack is None:
            stack = _state.local.device_stack = []
        stack.append(_current_device())
        self.use()
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.local.device = _state.local.device_stack.pop()

    def synchronize(self) -> None:
        synchronize_device(self.id)

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


class Stream:
    """``cupy.cuda.Stream(null=False, non_blocking=False, ptds=False)``; ``with s:`` or ``s.use()`` makes
    it this thread's current stream."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False) -> None:
        if ptds:
            raise NotImplementedError("the stand-in has no per-thread default stream")
        device = _current_device()
        if null:
            self._q = _queue(0, device, True)
        else:
            _check_device(device)
            self._q = _queue(next(_POINTERS), device, not non_blocking)

    @property
    def ptr(self) -> int:
        return self._q.ptr

    @property
    def device_id(self) -> int:
        return self._q.device

    def record(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: "Event") -> None:
        if event._queue is not None and event._queue is not self._q:
            self._q.put(_Wait(event._queue, event._upto, event._until))

    def synchronize(self) -> None:
        _state.counters.host_syncs += 1
        _run_ordered(self._q, block=True)
        _finished(self._q.busy_until, True)

    @property
    def done(self) -> bool:
        return _run_ordered(self._q, block=False) and _finished(self._q.busy_until, False)

    def use(self) -> "Stream":
        _state.local.stream = self
        return self

    def __enter__(self) -> "Stream":
        stack = getattr(_state.local, "stream_stack", None)
        if stack is None:
            stack = _state.local.stream_stack = []
        stack.append(getattr(_state.local, "stream", None))
        _state.local.stream = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _state.local.stream = _state.local.stream_stack.pop()

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Stream) and other._q is self._q

    def __hash__(self) -> int:
        return hash(self._q.ptr)

    def __repr__(self) -> str:
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


class ExternalStream(Stream):
    """``cupy.cuda.ExternalStream(ptr, device_id=-1)``: a stream made elsewhere (torch's), by its pointer;
    the same pointer is the same queue."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        device = _current_device() if device_id < 0 else device_id
        self._q = _queue(int(ptr), device, int(ptr) == 0)


def _queue(ptr: int, device: int, blocking: bool) -> _Queue:
    with _LOCK:
        found = _QUEUES.get(ptr) if ptr else _QUEUES.get(-1 - device)
        if found is None:
            found = _Queue(ptr, device, blocking)
            _QUEUES[ptr if ptr else -1 - device] = found
        return found


def _run_ordered(queue: _Queue, block: bool) -> bool:
    """Run ``queue``'s work, after the legacy-stream work it is ordered after."""
    if queue.blocking:
        for other in list(_QUEUES.values()):
            if other is not queue and other.blocking and other.device == queue.device and (other.ptr == 0
                                                                                           or queue.ptr == 0):
                if not other.run(block=block):
                    return False
    return queue.run(block=block)


class _NullStream(Stream):
    """``Stream.null``: the legacy default stream of the current device (pointer 0)."""

    def __init__(self) -> None:  # noqa: D107 (no queue of its own)
        pass

    @property
    def _q(self) -> _Queue:  # type: ignore[override]
        return _queue(0, _current_device(), True)


Stream.null = _NullStream()


def get_current_stream(device_id: int = -1) -> Stream:
    """This thread's current stream (the device's null stream unless one was made current)."""
    current = getattr(_state.local, "stream", None)
    if current is not None:
        return current
    if device_id < 0 or device_id == _current_device():
        return Stream.null
    stream = Stream.__new__(Stream)
    stream._q = _queue(0, device_id, True)
    return stream


def run_current() -> None:
    """What an array operation does first: the current stream's earlier work runs."""
    _run_ordered(get_current_stream()._q, block=True)


def synchronize_device(device: int) -> None:
    _state.counters.host_syncs += 1
    for queue in list(_QUEUES.values()):
        if queue.device == device:
            queue.run(block=True)
            _finished(queue.busy_until, True)


class Event:
    """``cupy.cuda.Event(block=False, disable_timing=False, interprocess=False)``."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        _state.counters.events += 1
        if not disable_timing:
            _state.counters.timing_events += 1
        self._queue: _Queue | None = None
        self._upto = 0
        self._until = 0.0

    def record(self, stream: Stream | None = None) -> None:
        stream = get_current_stream() if stream is None else stream
        self._queue, self._upto, self._until = stream._q, stream._q.posted, stream._q.busy_until

    @property
    def done(self) -> bool:
        return self._queue is None or (self._queue.run(self._upto, block=False) and _finished(self._until, False))

    def synchronize(self) -> None:
        _state.counters.host_syncs += 1
        if self._queue is not None:
            self._queue.run(self._upto, block=True)
            _finished(self._until, True)
