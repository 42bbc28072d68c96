"""Gradient sparsification with error feedback (SINGA's ``backward_and_sparse_update``).

Per bucket: add the residual (error feedback, Seide et al. 2014; Stich et
al. 2018; Karimireddy et al. 2019), select entries (top-K by magnitude, Aji
& Heafield 2017, or |g| >= threshold, Strom 2015), keep what was not sent
as the new residual (compensated gradient minus what THIS rank sent, never
minus the average: PowerSGD #3, shared case H17), all-gather (index, value)
pairs from every rank, densify by ADDING duplicates, divide by world size.
Every rank thus applies the identical update.

When the sparse exchange would move at least as many bytes as a dense
all-reduce (density x world size >= about 1), the selected entries are
all-reduced as a dense vector instead (zeros elsewhere): the result and the
residual are the same as the sparse path's, only the transport changes.
Counted in ``stats["sparse_dense_fallbacks"]``.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..comm.base import Communicator
from ..compress import densify, k_for, threshold_indices, topk_indices

__all__ = ["Residuals", "average_sparse"]

log = logging.getLogger("distopt")


class Residuals:
    """Error-feedback memory: one residual array per bucket, local to this rank."""

    def __init__(self) -> None:
        self.buffers: dict[Any, Any] = {}

    def get(self, bucket: Any, like: Any) -> Any:
        """The residual of ``bucket`` (any hashable key), created as zeros shaped like ``like``.

        A stored residual whose shape or dtype no longer fits (the bucket
        layout changed) is dropped with a warning, never silently.
        """
        r = self.buffers.get(bucket)
        if r is not None and (r.shape != like.shape or r.dtype != like.dtype):
            log.warning("error-feedback residual of bucket %s dropped: layout changed (%s %s -> %s %s)",
                        bucket, r.shape, r.dtype, like.shape, like.dtype)
            r = None
        if r is None:
            r = self.buffers[bucket] = like * 0
        return r

    def clear(self) -> None:
        self.buffers = {}

    def state_dict(self) -> dict[Any, Any]:
        """Copies of the residuals, keyed as DistOpt keys its buckets."""
        return {k: v.copy() for k, v in self.buffers.items()}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self.buffers = {k: v.copy() for k, v in state.items()}


def average_sparse(comm: Communicator, flat: Any, *, spars: float, topK: bool,
                   residual: Any | None, stats: dict[str, int]) -> int:
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
        stats: counters to update: ``sparse_entries`` (entries this rank
            selected) and ``sparse_dense_fallbacks``.

    Returns:
        Bytes this rank handed to the collectives (indices + values, or the
        dense bucket on fallback, plus an 8-byte count for threshold mode).
    """
    n = flat.size
    if residual is not None:
        flat += residual
    pair_bytes = np.dtype(np.int64 if n >= 2**31 else np.int32).itemsize + flat.dtype.itemsize
    sent_bytes = 0
    if topK:
        idx = topk_indices(flat, k_for(n, spars))
        total = idx.size * comm.size
    else:
        idx = threshold_indices(flat, spars)
        counts = comm.all_gather(np.array([idx.size], dtype=np.int64)).reshape(-1)
        sent_bytes += 8
        total = int(counts.sum())
    stats["sparse_entries"] = stats.get("sparse_entries", 0) + int(idx.size)
    if total * pair_bytes >= n * flat.dtype.itemsize:
        # same selection and residual as the sparse path; only the transport is dense
        stats["sparse_dense_fallbacks"] = stats.get("sparse_dense_fallbacks", 0) + 1
        sent = flat * 0
        sent[idx] = flat[idx]
        if residual is not None:
            residual[...] = flat - sent
        flat[...] = sent
        comm.all_reduce(flat, op="avg")
        return sent_bytes + int(flat.nbytes)
    values = flat[idx]
    if residual is not None:
        residual[...] = flat
        residual[idx] = 0
    if topK:
        all_idx = comm.all_gather(idx).reshape(-1)
        all_val = comm.all_gather(values).reshape(-1)
    else:
        all_idx = comm.all_gather_v(idx)
        all_val = comm.all_gather_v(values)
    flat[...] = densify(all_idx, all_val, n, flat.dtype)
    flat /= comm.size
    return sent_bytes + int(idx.nbytes + values.nbytes)
