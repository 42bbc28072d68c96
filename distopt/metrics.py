"""Cross-rank metric aggregation through buffer collectives."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .comm.base import Communicator

__all__ = ["reduce_metrics"]


def reduce_metrics(comm: Communicator, metrics: Mapping[str, Any],
                   mean: tuple[str, ...] = ()) -> dict[str, float]:
    """Sum scalar metrics over all ranks; the caller's values are not changed.

    Every rank must call this with the same keys (in any order): the values
    travel in one float64 all-reduce of ``len(metrics)`` elements, sorted by
    key. A ratio metric (accuracy) must be computed from summed numerator and
    denominator, never by averaging per-rank ratios (shared case H25).

    Args:
        comm: the communicator.
        metrics: name -> scalar (Python number, NumPy/CuPy/torch scalar).
        mean: names to divide by the world size after summing.

    Returns:
        name -> float, the sum (or the mean for names in ``mean``).

    Raises:
        KeyError: a name in ``mean`` is not in ``metrics``.
        CollectiveMismatchError: ranks passed different numbers of metrics.
    """
    for name in mean:
        if name not in metrics:
            raise KeyError(f"mean names {name!r}, which is not among the metrics {sorted(metrics)}")
    keys = sorted(metrics)
    buf = np.array([float(metrics[k]) for k in keys], dtype=np.float64)
    comm.all_reduce(buf, op="sum")
    return {k: float(v) / (comm.size if k in mean else 1) for k, v in zip(keys, buf)}
