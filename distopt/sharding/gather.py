"""The all-gather of a sharded step's parameters, bucket by bucket (ZeRO's parameter gather)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..comm.base import Communicator
from ..core.bucket_run import BucketRun, RunState
from ..core.buckets import pack
from ..core._array import xp_of
from ..core.spares import Spares
from .plan import ShardPlan

__all__ = ["ParamGather"]


class ParamGather:
    """The all-gather of a layout's parameters after a sharded update, bucket by bucket: each
    :class:`~distopt.core.bucket_run.BucketRun` holds its gather in flight (``flat``, ``handle``, state
    ``GATHERING``) until :meth:`wait` completes it (``GATHERED``).

    Each bucket's flat buffer is the lone parameter itself (C-contiguous), or a packed copy that is unpacked when the
    bucket's gather has completed. Buckets are started last to first (the layout walks parameters in reverse, so the
    last bucket holds the first layers: the ones the next forward needs first).

    Args:
        comm: the communicator (``all_gather_into``; ``all_gather_into_async`` where the backend has it).
        runs: the step's buckets.
        plan: the layout's :class:`ShardPlan`.
        params: the parameters (arrays), in the step's order.
        buffers: packing buffers, per bucket (None: none yet; reused; with ``keep``, new ones are added).
        context: wraps collective errors with the step and the bucket.
        asynchronous: start every gather now and complete each at :meth:`wait` (``overlap_param_gather``); False
            completes them all in :meth:`start`.
        keep: add the buffers made here to ``buffers`` for later steps (stage 1: they are the layout's gradient
            buffers too). False (stage 2) and not ``asynchronous``: buckets without a buffer are packed one after
            another into ONE scratch buffer per dtype, so the gather holds one bucket's bytes at a time.
        spares: where the scratch buffers come from and go back to once the gather completed (None: new ones).
        flats: per bucket, a flat array of ``bucket.size`` elements that the bucket's parameters are views of (in the
            bucket's layout), or None: the gather runs on it in place, nothing packed or unpacked (None: none has).

    Attributes:
        gathered_bytes: BYTES of the buckets gathered (the buckets' sizes).
    """

    def __init__(self, comm: Communicator, runs: Sequence[BucketRun], plan: ShardPlan, params: Sequence[Any],
                 buffers: list[Any], context: Callable[[str], Any], asynchronous: bool, keep: bool = True,
                 spares: Spares | None = None, flats: Sequence[Any] | None = None) -> None:
        self.comm, self.runs, self.plan, self.params = comm, list(runs), plan, list(params)
        self.spares, self.flats = spares, list(flats) if flats else [None] * len(self.runs)
        self.buffers, self.context, self.asynchronous, self.keep = buffers, context, asynchronous, keep
        self._scratch: dict[Any, Any] = {}
        self.gathered_bytes = 0

    def _where(self, run: BucketRun) -> str:
        return f"parameter all-gather, bucket {run.index + 1} of {len(self.runs)}"

    def start(self) -> None:
        """Start (or, not asynchronous, complete) the gather of every bucket, last bucket first."""
        native = getattr(self.comm, "all_gather_into_async", None) if self.asynchronous else None
        for run in reversed(self.runs):
            keep = self.keep and self._dtype(run) == run.bucket.dtype
            if self.flats[run.index] is not None:
                flat, viewed = self.flats[run.index], True
            else:
                buffer = self.buffers[run.index] if keep else None
                if buffer is None and not (keep or self.asynchronous):
                    buffer = self._scratch_for(run)
                flat, viewed = self._pack_own(run, buffer)
            if not viewed and keep:
                self.buffers[run.index] = flat
            self.gathered_bytes += int(flat.nbytes)
            with self.context(self._where(run)):
                if native is None:
                    self.comm.all_gather_into(flat, self.plan.counts[run.index])
                    handle = None
                else:
                    handle = native(flat, self.plan.counts[run.index])
            run.flat, run.viewed, run.handle, run.state = flat, viewed, handle, RunState.GATHERING
            if native is None:
                self.wait(run)
        if self.spares is not None and not self.pending:
            for scratch in self._scratch.values():
                self.spares.give(scratch)
            self._scratch.clear()

    def _dtype(self, run: BucketRun) -> Any:
        """The dtype the bucket's gather moves: its parameters' (mixed precision: ``param_dtype``, which the bucket's
        reduction, in ``reduce_dtype``, does not share; then the layout's buffers are not used)."""
        return self.params[run.bucket.slots[0].index].dtype

    def _own_range(self, run: BucketRun) -> tuple[int, int]:
        lo = self.plan.lows[run.index]
        return lo, lo + self.plan.counts[run.index][self.comm.rank]

    def _pack_own(self, run: BucketRun, buffer: Any) -> tuple[Any, bool]:
        """The bucket's flat buffer (:func:`~distopt.core.buckets.pack`), with only this rank's segment copied in:
        the gather overwrites the rest."""
        bucket = run.bucket
        if bucket.alone:
            return pack(bucket, self.params, buffer)
        if buffer is None:
            buffer = xp_of(self.params[bucket.slots[0].index]).empty(bucket.size, dtype=self._dtype(run))
        lo, _ = self._own_range(run)
        for p in self.plan.pieces:
            if p.bucket == run.index:
                buffer[lo + p.offset:lo + p.offset + p.size] = self.params[p.index].reshape(-1)[p.start:p.stop]
        return buffer, False

    def _unpack_others(self, run: BucketRun) -> None:
        """Write the other ranks' segments of the gathered flat buffer into the parameters (this rank's own
        elements are already there: the update wrote them)."""
        lo, hi = self._own_range(run)
        for s in run.bucket.slots:
            target = self.params[s.index]
            if not target.flags.c_contiguous:
                target[...] = run.flat[s.offset:s.offset + s.size].reshape(s.shape)
                continue
            flat_target = target.reshape(-1)
            for a, b in ((s.offset, min(lo, s.offset + s.size)), (max(hi, s.offset), s.offset + s.size)):
                if a < b:
                    flat_target[a - s.offset:b - s.offset] = run.flat[a:b]

    def _scratch_for(self, run: BucketRun) -> Any:
        """A view of ``bucket.size`` elements of the scratch buffer of the gather's dtype (made at first use, as large
        as the largest bucket of that dtype), or None for a lone contiguous parameter (a view)."""
        bucket, dtype = run.bucket, self._dtype(run)
        first = self.params[bucket.slots[0].index]
        if bucket.alone and first.flags.c_contiguous:  # pack() gathers into the parameter itself
            return None
        key = str(dtype)
        if key not in self._scratch:
            size = max(r.bucket.size for r in self.runs if str(self._dtype(r)) == key)
            xp = xp_of(first)
            new = lambda n: xp.empty(n, dtype=dtype)  # noqa: E731
            self._scratch[key] = new(size) if self.spares is None else self.spares.take(size, dtype, new)
        return self._scratch[key][:bucket.size]

    def buckets_of(self, indices: set[int]) -> list[BucketRun]:
        """The buckets still gathering any of the parameters ``indices``."""
        return [r for r in self.runs
                if r.state is RunState.GATHERING and any(s.index in indices for s in r.bucket.slots)]

    def wait(self, run: BucketRun) -> None:
        """Complete ``run``'s gather (a no-op when it has completed)."""
        if run.state is not RunState.GATHERING:
            return
        if run.handle is not None:
            with self.context(self._where(run)):
                run.handle.wait()
        if not run.viewed:
            self._unpack_others(run)
        run.flat, run.viewed, run.handle, run.state = None, False, None, RunState.GATHERED

    def wait_all(self) -> None:
        """Complete every pending gather."""
        for run in self.runs:
            self.wait(run)

    @property
    def pending(self) -> bool:
        """True while some bucket's gather has not completed."""
        return any(r.state is RunState.GATHERING for r in self.runs)
