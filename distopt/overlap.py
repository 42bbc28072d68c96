"""Bucketed gradient reduction that can start while backward is still running.

The buckets of the plain and half strategies are laid out in REVERSE
parameter order (the order backward produces gradients), with a small first
bucket (1 MiB of float32 by default, as PyTorch DDP) so the last layers'
reduction starts early. :class:`BucketPipeline` receives gradients one by
one (:meth:`BucketPipeline.ready`, from PyTorch's post-accumulate-grad hooks
or from a generator of ``(param, grad)`` pairs) and starts a bucket's
all-reduce as soon as the bucket is complete AND every earlier bucket has
been started, so all ranks start the same reductions in the same order
whatever order their gradients arrive in (no deadlock). After backward,
:meth:`BucketPipeline.launch_rest` starts the remaining buckets (missing
gradients as zeros) and :meth:`BucketPipeline.finish` waits, scales by the
number of contributing ranks and unpacks. The post-backward path uses the
same pipeline with every bucket started after backward, so both paths issue
identical collectives and give bitwise identical results.

Asynchrony per backend: MPI ``Iallreduce`` (progressed by ``test()`` from
the hooks), NCCL enqueued on its stream, shared memory on one worker thread
(NumPy releases the GIL while it reduces).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np

from ._array import xp_of
from .buckets import Bucket, unpack

__all__ = ["BucketPipeline", "Codec", "DenseCodec", "HalfCodec", "float_buckets"]


#: Reductions started after backward that may be in flight at once.
IN_FLIGHT = 2


def _handle(started: Any) -> Any:
    """The handle inside what a codec's ``start`` returned."""
    return started[1] if isinstance(started, tuple) else started


class _ThreadHandle:
    """A blocking all-reduce run on a worker thread."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def test(self) -> bool:
        return self._future.done()

    def wait(self) -> Any:
        return self._future.result()


class Codec(ABC):
    """How one bucket travels: ``start`` returns a handle, ``finish`` writes the average back."""

    @abstractmethod
    def start(self, comm: Any, flat: Any, launch: Callable[[Any, str], Any]) -> Any:
        """Start reducing ``flat`` (via ``launch(array, op)``); return what ``finish`` needs."""

    @abstractmethod
    def finish(self, flat: Any, started: Any, divisor: int) -> None:
        """Wait for ``started`` and write the average over ``divisor`` ranks into ``flat``."""

    def wire_bytes(self, flat: Any) -> int:
        return int(flat.nbytes)


class DenseCodec(Codec):
    """The bucket travels in its own dtype; sum, then divide by the contributing ranks."""

    def start(self, comm: Any, flat: Any, launch: Callable[[Any, str], Any]) -> Any:
        return launch(flat, "sum")

    def finish(self, flat: Any, started: Any, divisor: int) -> None:
        started.wait()
        if divisor != 1:
            flat /= divisor


class HalfCodec(Codec):
    """The bucket travels as float16/bfloat16 (SINGA's ``backward_and_update_half``).

    Steps: optional element clipping to ``[-clip, clip]`` (as the seed's
    ``clipping``), scale by ``1/predivide``, cast to ``wire``, sum-all-reduce
    in the wire dtype, cast back to the bucket's dtype, scale by
    ``predivide/divisor`` (the contributing ranks). With the default
    ``predivide = world_size`` the sum cannot exceed the largest rank's
    value, so 4 ranks each sending 40000 average to 40000, not inf (Horovod
    #1699, PyTorch #57410; shared case H06); ``predivide=1`` keeps small
    gradients from flushing to zero (H07) at the risk of overflow (fairscale
    PR 565 splits the factor).

    What travels: 2 bytes per element. On the MPI backend float16/bfloat16
    move as 16-bit words reduced by a user-defined op that adds in float32
    and rounds once per combination; NCCL reduces float16 natively.
    """

    def __init__(self, world_size: int, wire: str, predivide: float | None, clip: float | None) -> None:
        from .compress import half_scales

        self.wire, self.clip = wire, clip
        self.predivide = float(world_size if predivide is None else predivide)
        half_scales(world_size, self.predivide)  # validates predivide

    def start(self, comm: Any, flat: Any, launch: Callable[[Any, str], Any]) -> Any:
        from .compress import to_wire

        src = flat if self.clip is None else flat.clip(-self.clip, self.clip)
        w = to_wire(src, self.wire, 1.0 / self.predivide)
        return w, launch(w, "sum")

    def finish(self, flat: Any, started: Any, divisor: int) -> None:
        from .compress import from_wire

        w, handle = started
        handle.wait()
        flat[...] = from_wire(w, flat.dtype, self.predivide / divisor)

    def wire_bytes(self, flat: Any) -> int:
        return 2 * int(flat.size)


class BucketPipeline:
    """One step's bucket reductions, started in bucket order as gradients become ready.

    Args:
        comm: the communicator (``all_reduce_async`` if it has one, else a
            worker thread runs its blocking ``all_reduce``).
        buckets: the layout (identical on every rank).
        codec: how a bucket travels.
        buffers: reusable flat buffers, keyed by bucket index (filled here).
        params: the parameters (for dtype/device of new buffers).
        executor: the worker thread for backends without async all-reduce.
    """

    def __init__(self, comm: Any, buckets: Sequence[Bucket], codec: Codec, buffers: dict[Any, Any],
                 params: Sequence[Any], executor: ThreadPoolExecutor | None) -> None:
        self.comm, self.buckets, self.codec, self.params = comm, buckets, codec, params
        self.buffers = buffers
        self.executor = executor
        self.where = {s.index: (b, s) for b, bucket in enumerate(buckets) for s in bucket.slots}
        self.missing = [len(bucket.slots) for bucket in buckets]
        self.marked: set[int] = set()
        self.views: dict[int, bool] = {}
        self.flats: dict[int, Any] = {}
        self.started: dict[int, Any] = {}
        self.next = 0

    def _launch(self, flat: Any, op: str) -> Any:
        if hasattr(self.comm, "all_reduce_async"):
            return self.comm.all_reduce_async(flat, op)
        return _ThreadHandle(self.executor.submit(self.comm.all_reduce, flat, op))

    def _flat(self, b: int, grad_of: Callable[[int], Any]) -> Any:
        bucket = self.buckets[b]
        if b not in self.flats:
            if bucket.alone:
                g = grad_of(bucket.slots[0].index)
                if g is not None and g.flags.c_contiguous:
                    self.flats[b], self.views[b] = g.reshape(-1), True
                    return self.flats[b]
            buf = self.buffers.get(b)
            if buf is None:
                ref = self.params[bucket.slots[0].index]
                buf = self.buffers[b] = xp_of(ref).empty(bucket.size, dtype=bucket.dtype)
            self.flats[b], self.views[b] = buf, False
        return self.flats[b]

    def _put(self, index: int, grad: Any) -> None:
        b, s = self.where[index]
        flat = self._flat(b, lambda i: grad if i == index else None)
        if not self.views[b]:
            flat[s.offset:s.offset + s.size] = 0 if grad is None else grad.reshape(-1)
        self.marked.add(index)
        self.missing[b] -= 1

    def ready(self, index: int, grad: Any) -> None:
        """Gradient of parameter ``index`` is final: pack it, start complete buckets in order."""
        if index in self.marked or index not in self.where:
            return
        self._put(index, grad)
        while self.next < len(self.buckets) and self.missing[self.next] == 0:
            self._start(self.next)
        for started in self.started.values():  # MPI progress while backward runs
            _handle(started).test()

    def _start(self, b: int) -> None:
        self.started[b] = self.codec.start(self.comm, self.flats[b], self._launch)
        self.next = b + 1

    def launch_rest(self, grads: Sequence[Any]) -> None:
        """Start every bucket not started yet, in order; missing gradients pack as zeros.

        At most :data:`IN_FLIGHT` reductions run at once from here on: MPI
        moves many concurrent large all-reduces slower than a short queue.
        """
        for index in self.where:
            if index not in self.marked:
                self._put(index, grads[index])
        while self.next < len(self.buckets):
            if self.next >= IN_FLIGHT:
                _handle(self.started[self.next - IN_FLIGHT]).wait()
            self._start(self.next)

    def finish(self, grads: list[Any], divisor: int) -> int:
        """Wait for every bucket, average over ``divisor`` ranks, unpack into ``grads``.

        A None entry of ``grads`` receives a new array. Returns the bytes
        handed to the collectives.
        """
        sent = 0
        for b, bucket in enumerate(self.buckets):
            flat = self.flats[b]
            fold = isinstance(self.codec, DenseCodec) and not self.views[b]  # divide while unpacking
            self.codec.finish(flat, self.started[b], 1 if fold else divisor)
            sent += self.codec.wire_bytes(flat)
            if not self.views[b]:
                unpack(bucket, flat, grads, divisor if fold else 1)
        return sent

    def drain(self) -> None:
        """On a thread-backed communicator, let every started reduction end before the caller's next
        collective (one thread at a time may use the communicator). A no-op for MPI and NCCL."""
        if self.executor is not None:
            self.abandon()

    def abandon(self) -> None:
        """Complete in-flight reductions without using them (after a skipped step)."""
        for b in range(self.next):
            _handle(self.started[b]).wait()


def float_buckets(buckets: Sequence[Bucket]) -> list[Bucket]:
    """The buckets holding floating-point parameters (the others are never reduced)."""
    return [b for b in buckets if np.dtype(b.dtype).kind == "f" or str(b.dtype) == "bfloat16"]
