"""Gradient sparsification with error feedback (SINGA's ``backward_and_sparse_update``).

Per bucket: add the residual (error feedback, see :mod:`distopt.strategies.memory`), select entries (top-K by
magnitude, Aji & Heafield 2017, "Sparse communication for distributed gradient descent", or |g| >= threshold, Strom
2015, "Scalable distributed DNN training using commodity GPU cloud computing"), keep what was not sent as the new
residual (compensated gradient minus what THIS rank sent, never minus the average, as PowerSGD's error feedback does),
all-gather (index, value) pairs from every rank, densify by ADDING duplicates, divide by world size. Every rank thus
applies the identical update.

When the sparse exchange would move at least as many bytes as a dense all-reduce (density x world size >= about 1), the
selected entries are all-reduced as a dense vector instead (zeros elsewhere): same result and residual, only the
transport changes (``stats["sparse_dense_fallbacks"]``; ``stats["sparse_entries"]`` counts the entries this rank
selected).
"""
from __future__ import annotations

import warnings
from typing import Any, ClassVar, Mapping

import numpy as np

from ..comm.base import Communicator
from ..core._array import xp_of
from ..core.counters import Counters
from ..compress import densify, k_for, threshold_indices, topk_indices
from ..compress._xp import index_dtype
from .base import BucketContext, Done, GradientStrategy, Handle
from .memory import Residuals
from .registry import Example, register

__all__ = ["Sparse", "SELECTIONS", "average_sparse"]

SELECTIONS: tuple[str, ...] = ("topk", "threshold")
"""The selection modes of :class:`Sparse`."""

ENTRIES, FALLBACKS = "sparse_entries", "sparse_dense_fallbacks"


def average_sparse(comm: Communicator, flat: Any, *, density: float, select: str,
                   residual: Any | None, counters: Counters) -> int:
    """Average ``flat`` across ranks in place through a sparse exchange.

    Args:
        comm: the communicator.
        flat: 1-D float gradient bucket, overwritten with the average of every rank's sparse contribution.
        density: with ``select="topk"``, the fraction of elements kept, in (0, 1] (k = max(1, ceil(density * n)));
            with ``"threshold"``, the absolute threshold (entries with |g| >= density are sent).
        select: ``"topk"`` (exactly k entries per rank, even with ties) or ``"threshold"`` (counts differ per rank, may
            be 0).
        residual: this bucket's error-feedback residual (same shape as ``flat``), updated in place; None disables
            error feedback.
        counters: the step counters: ``sparse_entries`` (entries this rank selected) and ``sparse_dense_fallbacks``
            are added to.

    Returns:
        BYTES this rank handed to the collectives (indices + values, or the dense bucket on fallback, plus an 8-byte
        count for threshold mode).
    """
    n = flat.size
    top_k = select == "topk"
    # the accumulated gradient lives in the residual itself (no copy back): after the selection, its
    # sent entries are zeroed and what is left is the next step's residual (error feedback)
    acc = flat if residual is None else residual
    if residual is not None:
        residual += flat
    pair_bytes = index_dtype(n).itemsize + flat.dtype.itemsize
    if top_k:
        idx = topk_indices(acc, k_for(n, density))
        total, sent_bytes = idx.size * comm.size, 0
    else:
        idx = threshold_indices(acc, density)
        total, sent_bytes = int(comm.all_gather(np.array([idx.size], dtype=np.int64)).sum()), 8
    counters.add(ENTRIES, int(idx.size))
    values = acc[idx]
    if residual is not None:
        residual[idx] = 0
    dense = total * pair_bytes >= n * flat.dtype.itemsize
    counters.add(FALLBACKS, int(dense))
    if dense:
        xp_of(flat).multiply(acc, 0, out=flat)  # zeros (NaN where the gradient is not finite, as a product keeps it)
        flat[idx] = values
        comm.all_reduce(flat, op="avg")
        return sent_bytes + int(flat.nbytes)
    gather = comm.all_gather if top_k else comm.all_gather_v  # top-k: one row per rank, added in rank order
    all_idx, all_val = gather(idx), gather(values)
    densify(all_idx, all_val, n, flat.dtype, out=flat)
    touched = xp_of(flat).concatenate(all_idx) if isinstance(all_idx, list) else all_idx.reshape(-1)
    flat[touched] /= comm.size  # only the gathered positions are nonzero: divide k*W values, not n
    return sent_bytes + int(idx.nbytes + values.nbytes)


def _renamed(new: str, value: Any, old: str, legacy: Any) -> Any:
    """``value``, or the value given under the deprecated name ``old`` (with a DeprecationWarning)."""
    if legacy is None:
        return value
    if value is not None:
        raise TypeError(f"Sparse() got both {new}= and its deprecated name {old}=")
    warnings.warn(f"Sparse({old}=...) is deprecated and will be removed in the next release: use {new}=",
                  DeprecationWarning, stacklevel=3)
    return legacy


class Sparse(GradientStrategy):
    """Top-K or threshold sparsification with error feedback.

    Args:
        density: (default 0.05) with ``select="topk"`` the fraction of each bucket's elements sent, in (0, 1]; with
            ``select="threshold"`` (the default) NOT a fraction but the absolute magnitude threshold (>= 0): entries
            with ``|g| >= density`` are sent, however many they are (SINGA's ``spars`` with ``topK=False``).
        select: ``"topk"`` (exactly ``k = max(1, ceil(density * n))`` entries per rank and bucket of ``n`` elements)
            or ``"threshold"`` (the default).
        error_feedback: (default True) keep what was not sent as a per-bucket residual added to the next step's
            gradient.
        threshold: the clearer spelling of ``select="threshold"`` with ``density=threshold``:
            ``Sparse(threshold=1e-3)`` sends the entries with ``|g| >= 1e-3``.
        spars: deprecated name of ``density`` (SINGA's; warns).
        topK: deprecated, warns: True is ``select="topk"``, False ``select="threshold"``. A bool passed positionally as
            ``select`` (the old ``Sparse(spars, topK, corr)``) is read the same way.
        corr: deprecated name of ``error_feedback`` (warns).

    Attributes:
        residuals: this rank's error-feedback memory (:class:`~distopt.strategies.memory.Residuals`).

    Raises:
        ValueError: ``select`` not in :data:`SELECTIONS`, or ``density`` out of range for it.
        TypeError: both a name and its deprecated alias given, or ``threshold`` with ``density``/``spars`` or
            ``select="topk"``.

    The exchange runs after the ranks agreed on the step (so a skipped step leaves the residuals untouched). Does not
    support overlap or ``join``.
    """

    name: ClassVar[str] = "sparse"
    per_rank_state: ClassVar[bool] = True
    counter_names: ClassVar[tuple[str, ...]] = (ENTRIES, FALLBACKS)

    def __init__(self, density: float | None = None, select: str | bool | None = None,
                 error_feedback: bool | None = None, *, threshold: float | None = None,
                 spars: float | None = None, topK: bool | None = None, corr: bool | None = None) -> None:
        if threshold is not None:  # the clearer spelling of select="threshold", density=t
            if density is not None or spars is not None or select not in (None, "threshold"):
                raise TypeError("Sparse(threshold=t) is select='threshold' with the magnitude threshold t: "
                                f"pass it without density=/spars= and select= (got density={density!r}, "
                                f"select={select!r})")
            density, select = threshold, "threshold"
        density = _renamed("density", density, "spars", spars)
        error_feedback = _renamed("error_feedback", error_feedback, "corr", corr)
        select = _renamed("select", select, "topK", topK)
        if isinstance(select, bool):  # topK=..., or the old positional Sparse(spars, topK, corr)
            if topK is None:
                warnings.warn("Sparse(spars, topK, corr) with a bool second argument is deprecated and will be "
                              'removed in the next release: use select="topk" or select="threshold"',
                              DeprecationWarning, stacklevel=2)
            select = "topk" if select else "threshold"
        select = "threshold" if select is None else select
        density = 0.05 if density is None else float(density)
        if select not in SELECTIONS:
            raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}")
        if select == "topk" and not 0 < density <= 1:
            raise ValueError(f"density (SINGA's spars) must be in (0, 1] with select='topk' (topK=True): "
                             f"the fraction of elements kept, got {density}")
        if select == "threshold" and not density >= 0:
            raise ValueError(f"density (SINGA's spars) must be >= 0 with select='threshold' (topK=False): "
                             f"a magnitude threshold, got {density}")
        self.density, self.select = density, select
        self.error_feedback = True if error_feedback is None else bool(error_feedback)
        self.residuals = Residuals()

    def settings(self) -> dict[str, Any]:
        return {"density": self.density, "select": self.select, "error_feedback": self.error_feedback}

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:  # noqa: ARG002
        residual = self.residuals.get((ctx.key, ctx.index), flat) if self.error_feedback else None
        return Done(average_sparse(ctx.comm, flat, density=self.density, select=self.select,
                                   residual=residual, counters=ctx.counters))

    def state_dict(self) -> dict[str, Any]:
        return {"residuals": self.residuals.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.residuals.load_state_dict(state["residuals"])


register(Example("sparse-topk", Sparse, {"density": 0.3, "select": "topk"},
                 mismatch={"density": 0.2, "select": "topk"}),
         Example("sparse-threshold", Sparse, {"density": 0.5}, mismatch={"density": 0.5, "error_feedback": False}))
