"""Gradient sparsification with error feedback (SINGA's ``backward_and_sparse_update``).

Per bucket: add the residual (error feedback, Seide et al. 2014; Stich et
al. 2018; Karimireddy et al. 2019), select entries (top-K by magnitude, Aji
& Heafield 2017, or |g| >= threshold, Strom 2015), keep what was not sent
as the new residual (compensated gradient minus what THIS rank sent, never
minus the average, as PowerSGD's error feedback does), all-gather (index,
value) pairs from every rank, densify by ADDING duplicates, divide by world
size. Every rank thus applies the identical update.

When the sparse exchange would move at least as many bytes as a dense
all-reduce (density x world size >= about 1), the selected entries are
all-reduced as a dense vector instead (zeros elsewhere): the result and the
residual are the same as the sparse path's, only the transport changes.
Counted in ``stats["sparse_dense_fallbacks"]``.
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar, Mapping

import numpy as np

from ..comm.base import Communicator
from .._array import xp_of
from ..compress import densify, k_for, threshold_indices, topk_indices
from .base import BucketContext, Done, Strategy

__all__ = ["Sparse", "Residuals", "average_sparse"]

log = logging.getLogger("distopt")


class Residuals:
    """Error-feedback memory: one residual array per bucket, local to this rank.

    Keys are ``(layout key, bucket index)`` as the engine numbers buckets.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], Any] = {}

    def get(self, key: tuple[int, int], like: Any) -> Any:
        """The residual of bucket ``key``, created as zeros shaped like ``like`` (1-D).

        A stored residual whose shape or dtype no longer fits (the bucket
        layout changed) is dropped with a warning, never silently.
        """
        r = self.buffers.get(key)
        if r is not None and (r.shape != like.shape or r.dtype != like.dtype):
            log.warning("error-feedback residual of bucket %s dropped: layout changed (%s %s -> %s %s)",
                        key, r.shape, r.dtype, like.shape, like.dtype)
            r = None
        if r is None:
            r = self.buffers[key] = like * 0
        return r

    def state_dict(self) -> dict[str, Any]:
        """Copies of the residuals: ``{"keys": [[layout, bucket], ...], "values": [array, ...]}``."""
        keys = sorted(self.buffers)
        return {"keys": [list(k) for k in keys], "values": [self.buffers[k].copy() for k in keys]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.buffers = {(int(k[0]), int(k[1])): v.copy() for k, v in zip(state["keys"], state["values"])}


def average_sparse(comm: Communicator, flat: Any, *, spars: float, topK: bool,
                   residual: Any | None, counters: Any) -> int:
    """Average ``flat`` across ranks in place through a sparse exchange.

    Args:
        comm: the communicator.
        flat: 1-D float gradient bucket, overwritten with the average of
            every rank's sparse contribution.
        spars: with ``topK``, the fraction of elements kept, in (0, 1]
            (k = max(1, ceil(spars * n))); else the absolute threshold
            (entries with |g| >= spars are sent).
        topK: choose top-K (exactly k entries per rank, even with ties) or
            threshold selection (counts differ per rank, may be 0).
        residual: this bucket's error-feedback residual (same shape as
            ``flat``), updated in place; None disables error feedback.
        counters: the step counters: ``sparse_entries`` (entries this rank
            selected) and ``sparse_dense_fallbacks`` are incremented.

    Returns:
        Bytes this rank handed to the collectives (indices + values, or the
        dense bucket on fallback, plus an 8-byte count for threshold mode).
    """
    n = flat.size
    # the accumulated gradient lives in the residual itself (no copy back): after the selection, its
    # sent entries are zeroed and what is left is the next step's residual (error feedback)
    acc = flat if residual is None else residual
    if residual is not None:
        residual += flat
    pair_bytes = np.dtype(np.int64 if n >= 2**31 else np.int32).itemsize + flat.dtype.itemsize
    sent_bytes = 0
    if topK:
        idx = topk_indices(acc, k_for(n, spars))
        total = idx.size * comm.size
    else:
        idx = threshold_indices(acc, spars)
        counts = comm.all_gather(np.array([idx.size], dtype=np.int64)).reshape(-1)
        sent_bytes += 8
        total = int(counts.sum())
    counters.sparse_entries += int(idx.size)
    values = acc[idx]
    if residual is not None:
        residual[idx] = 0
    if total * pair_bytes >= n * flat.dtype.itemsize:
        # same selection and residual as the sparse path; only the transport is dense
        counters.sparse_dense_fallbacks += 1
        xp_of(flat).multiply(acc, 0, out=flat)  # zeros (NaN where the gradient is not finite, as a product keeps it)
        flat[idx] = values
        comm.all_reduce(flat, op="avg")
        return sent_bytes + int(flat.nbytes)
    if topK:
        all_idx = comm.all_gather(idx).reshape(-1)
        all_val = comm.all_gather(values).reshape(-1)
    else:
        all_idx = comm.all_gather_v(idx)
        all_val = comm.all_gather_v(values)
    densify(all_idx, all_val, n, flat.dtype, out=flat)
    touched = xp_of(flat).concatenate(all_idx) if isinstance(all_idx, list) else all_idx
    flat[touched] /= comm.size  # only the gathered positions are nonzero: divide k*W values, not n
    return sent_bytes + int(idx.nbytes + values.nbytes)


class Sparse(Strategy):
    """Top-K or threshold sparsification with error feedback.

    Args:
        spars: with ``topK=True`` the fraction of each bucket's elements
            sent, in (0, 1]; else the magnitude threshold (>= 0).
        topK: top-K selection (exactly k per rank) or threshold selection.
        corr: error feedback: keep what was not sent as a per-bucket
            residual added to the next step's gradient.

    Attributes:
        residuals: this rank's error-feedback memory (:class:`Residuals`).

    Raises:
        ValueError: ``spars`` out of range for the selection mode.

    The exchange runs after the ranks agreed on the step (so a skipped step
    leaves the residuals untouched). Does not support overlap or ``join``.
    """

    name: ClassVar[str] = "sparse"
    per_rank_state: ClassVar[bool] = True

    def __init__(self, spars: float = 0.05, topK: bool = False, corr: bool = True) -> None:
        if topK and not 0 < spars <= 1:
            raise ValueError(f"spars must be in (0, 1] with topK=True (the fraction of elements kept), got {spars}")
        if not topK and not spars >= 0:
            raise ValueError(f"spars must be >= 0 with topK=False (a magnitude threshold), got {spars}")
        self.spars, self.top_k, self.corr = float(spars), bool(topK), bool(corr)
        self.residuals = Residuals()

    def settings(self) -> dict[str, Any]:
        return {"spars": self.spars, "top_k": self.top_k, "corr": self.corr}

    def finish(self, ctx: BucketContext, flat: Any, started: Any, divisor: int) -> Done:  # noqa: ARG002
        residual = self.residuals.get((ctx.key, ctx.index), flat) if self.corr else None
        return Done(average_sparse(ctx.comm, flat, spars=self.spars, topK=self.top_k,
                                   residual=residual, counters=ctx.counters))

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals.load_state_dict(state["residuals"])
