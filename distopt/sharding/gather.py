"""The all-gather of a sharded step's parameters, bucket by bucket (ZeRO's parameter gather)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..comm.base import Communicator
from ..core.buckets import Bucket, pack, unpack
from ..core._array import xp_of
from .plan import ShardPlan

__all__ = ["ParamGather"]


class ParamGather:
    """The all-gather of a layout's parameters after a sharded update, bucket by bucket.

    Each bucket's flat buffer is the lone parameter itself (C-contiguous),
    or a packed copy that is unpacked when the bucket's gather has
    completed. Buckets are started last to first (the layout walks
    parameters in reverse, so the last bucket holds the first layers: the
    ones the next forward needs first).

    Args:
        comm: the communicator (``all_gather_into``; ``all_gather_into_async``
            where the backend has it).
        buckets: the layout's float buckets.
        plan: the layout's :class:`ShardPlan`.
        params: the parameters (arrays), in the step's order.
        buffers: packing buffers, per bucket (None: none yet; reused; with ``keep``, new
            ones are added).
        context: wraps collective errors with the step and the bucket.
        asynchronous: start every gather now and complete each at
            :meth:`wait` (``overlap_param_gather``); False completes them
            all in :meth:`start`.
        keep: add the buffers made here to ``buffers`` for later steps (stage
            1: they are the layout's gradient buffers too). False (stage 2,
            whose gradient buffers live for one reduction): not
            ``asynchronous``, the buckets without a buffer are packed one
            after another into ONE scratch buffer per dtype, of the largest
            such bucket's size, so the gather holds one bucket's bytes at a
            time instead of every bucket's.

    Attributes:
        gathered_bytes: BYTES of the buckets gathered (the buckets' sizes).
    """

    def __init__(self, comm: Communicator, buckets: Sequence[Bucket], plan: ShardPlan, params: Sequence[Any],
                 buffers: list[Any], context: Callable[[str], Any], asynchronous: bool, keep: bool = True
                 ) -> None:
        self.comm, self.buckets, self.plan, self.params = comm, buckets, plan, list(params)
        self.buffers, self.context, self.asynchronous, self.keep = buffers, context, asynchronous, keep
        self._scratch: dict[Any, Any] = {}
        self._pending: dict[int, tuple[Any, Any, bool]] = {}
        self.gathered_bytes = 0

    def _where(self, b: int) -> str:
        return f"parameter all-gather, bucket {b + 1} of {len(self.buckets)}"

    def start(self) -> None:
        """Start (or, not asynchronous, complete) the gather of every bucket, last bucket first."""
        native = getattr(self.comm, "all_gather_into_async", None) if self.asynchronous else None
        for b in reversed(range(len(self.buckets))):
            bucket = self.buckets[b]
            buffer = self.buffers[b]
            if buffer is None and not (self.keep or self.asynchronous):
                buffer = self._scratch_for(bucket)
            flat, viewed = pack(bucket, self.params, buffer)
            if not viewed and self.keep:
                self.buffers[b] = flat
            self.gathered_bytes += int(flat.nbytes)
            with self.context(self._where(b)):
                if native is None:
                    self.comm.all_gather_into(flat, self.plan.counts[b])
                    handle = None
                else:
                    handle = native(flat, self.plan.counts[b])
            self._pending[b] = (handle, flat, viewed)
            if native is None:
                self.wait(b)

    def _scratch_for(self, bucket: Bucket) -> Any:
        """A view of ``bucket.size`` elements of the scratch buffer of ``bucket.dtype`` (made at first use,
        as large as the largest bucket of that dtype), or None for a lone contiguous parameter (a view)."""
        first = self.params[bucket.slots[0].index]
        if bucket.alone and first.flags.c_contiguous:  # pack() gathers into the parameter itself
            return None
        key = str(bucket.dtype)
        if key not in self._scratch:
            size = max(b.size for b in self.buckets if str(b.dtype) == key)
            self._scratch[key] = xp_of(first).empty(size, dtype=bucket.dtype)
        return self._scratch[key][:bucket.size]

    def buckets_of(self, indices: set[int]) -> list[int]:
        """The pending buckets holding any of the parameters ``indices``."""
        return [b for b in self._pending if any(s.index in indices for s in self.buckets[b].slots)]

    def wait(self, b: int) -> None:
        """Complete bucket ``b``'s gather (a no-op when it has completed)."""
        entry = self._pending.pop(b, None)
        if entry is None:
            return
        handle, flat, viewed = entry
        if handle is not None:
            with self.context(self._where(b)):
                handle.wait()
        if not viewed:
            unpack(self.buckets[b], flat, self.params)

    def wait_all(self) -> None:
        """Complete every pending gather."""
        for b in list(self._pending):
            self.wait(b)

    @property
    def pending(self) -> bool:
        """True while some bucket's gather has not completed."""
        return bool(self._pending)
