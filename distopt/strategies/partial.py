"""Partial synchronization: average one chunk of the parameters per step.

SINGA's ``backward_and_partial_update``: every rank updates locally with its own gradient, then one chunk of the
parameters is averaged across ranks, the chunk moving round-robin so that after K calls (K chunks) every parameter has
been averaged once. Related to local SGD / periodic model averaging (Zinkevich et al. 2010; Lin et al. 2020, "Don't use
large mini-batches").
"""
from __future__ import annotations

from typing import Any, ClassVar, Mapping

from ..core.buckets import plan_buckets
from .base import LocalInfo, ParameterAverager, UpdateContext
from .registry import Example, register

__all__ = ["Partial", "ChunkCursor"]


class ChunkCursor:
    """Which chunk the next partial update averages; identical on every rank, advanced once per step."""

    def __init__(self) -> None:
        self.position = 0

    def take(self, num_chunks: int) -> int:
        """Return the chunk to average now (``0 <= i < num_chunks``) and advance.

        Raises:
            ValueError: ``num_chunks < 1``.
        """
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        chunk = self.position % num_chunks
        self.position = (chunk + 1) % num_chunks
        return chunk

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


class Partial(ParameterAverager):
    """Local update with this rank's own gradients, then average one chunk of parameters.

    Parameters are cut into chunks by the threshold rule (a parameter of more than ``chunk_size`` elements is its own
    chunk, smaller ones are fused up to ``chunk_size`` elements) in the shared order; each step averages the chunk
    under :attr:`cursor` and advances it.

    Args:
        chunk_size: chunk capacity in ELEMENTS; None uses the step's ``threshold`` (SINGA's rule).
        average_momentum: also average the chunk's momentum buffers. Default False, as in SINGA: it doubles the bytes
            per step.

    Attributes:
        cursor: the :class:`ChunkCursor` (same on every rank).

    Raises:
        ValueError: ``chunk_size < 1``; at a step, ``average_momentum=True`` with an optimizer that exposes no momentum
            buffers, or a chunk parameter without a momentum buffer yet.
    """

    name: ClassVar[str] = "partial"
    identical_replicas: ClassVar[bool] = False

    def __init__(self, chunk_size: int | None = None, average_momentum: bool = False) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 element (or None for the step's threshold), got {chunk_size}")
        self.chunk_size = None if chunk_size is None else int(chunk_size)
        self.average_momentum = bool(average_momentum)
        self.cursor = ChunkCursor()

    def settings(self) -> dict[str, Any]:
        return {"chunk_size": self.chunk_size, "average_momentum": self.average_momentum}

    def bind(self, world_size: int, local: LocalInfo) -> None:  # noqa: ARG002
        if self.average_momentum:
            local.momentum_arrays([])  # raises before any update if the optimizer has no momentum buffers

    def after_update(self, ctx: UpdateContext) -> None:
        size = ctx.threshold if self.chunk_size is None else self.chunk_size
        params = list(ctx.params)
        chunks = plan_buckets([(p.shape, p.dtype) for p in params], size, max(size, 1))
        if not chunks:
            return
        chunk = chunks[self.cursor.take(len(chunks))]
        groups = [params]
        if self.average_momentum:
            momenta = ctx.momenta(params)
            if any(momenta[s.index] is None for s in chunk.slots):
                raise ValueError("average_momentum=True but a parameter of this chunk has no momentum buffer yet")
            groups.append(momenta)
        for arrays in groups:
            ctx.counters.wire_bytes += ctx.average(chunk, arrays, f"partial chunk of {chunk.size} elements")

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.cursor.load_state_dict(state["cursor"])


register(Example("partial", Partial, {"chunk_size": 4}, mismatch={"chunk_size": 5}))
