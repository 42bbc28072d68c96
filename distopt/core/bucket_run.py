"""One bucket of one step, as an object: what the bucket pipeline and the step's sync work on. The layout
(:class:`~distopt.core.buckets.Bucket`) says which parameters a bucket packs; a :class:`BucketRun` is that bucket during
one step: its flat buffer, its reduction in flight, a sharded step's segment, and where it is (:class:`RunState`)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from .buckets import Bucket

__all__ = ["RunState", "BucketRun"]


class RunState(Enum):
    """Where one bucket of one step is."""

    WAITING = "waiting"  # gradients still missing
    STARTED = "started"  # its reduction is in flight
    HELD = "held"  # the step's sync holds its result; its flat buffer is dropped
    LANDED = "landed"  # finished: its result is where the sync puts it
    GATHERING = "gathering"  # after a sharded update: its parameters' all-gather is in flight (flat, handle)
    GATHERED = "gathered"  # the all-gather completed: the parameters are whole


@dataclass
class BucketRun:
    """One bucket of one step: its layout slot, flat buffer, reduction and state.

    Attributes:
        index: the bucket's position in the layout.
        bucket: its :class:`~distopt.core.buckets.Bucket` (the slots it packs).
        missing: gradients not packed yet.
        flat: its flat buffer (a packing buffer, a bucket view, or a lone gradient itself); None before the first
            gradient and once dropped.
        viewed: ``flat`` is gradient memory (a bucket view, or a lone contiguous gradient).
        handle: the started reduction (a :class:`~distopt.comm.launcher.Handle`), or what the sync keeps in its place;
            while :attr:`RunState.GATHERING`, the parameters' all-gather.
        segment: a sharded step's result: this rank's averaged segment (1-D, ``plan.counts[index][rank]`` ELEMENTS),
            once landed; None otherwise.
        state: a :class:`RunState`.
    """

    index: int
    bucket: Bucket
    missing: int
    flat: Any = None
    viewed: bool = False
    handle: Any = None
    segment: Any = None
    state: RunState = RunState.WAITING

    def describe(self, count: int) -> str:
        """``bucket i of n (size elements of dtype)``, for errors."""
        return f"bucket {self.index + 1} of {count} ({self.bucket.size} elements of {self.bucket.dtype})"

    def drop(self, buffers: list[Any]) -> None:
        """Let go of the flat buffer (its result lives on elsewhere), and of the step's buffer for it."""
        self.flat, self.viewed = None, False
        buffers[self.index] = None
