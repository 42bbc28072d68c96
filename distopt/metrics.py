"""Cross-rank metric aggregation through buffer collectives."""
from __future__ import annotations

import pickle
from typing import Any, Mapping

import numpy as np

from .comm.base import Communicator

__all__ = ["reduce_metrics", "broadcast_object", "all_gather_object"]


def reduce_metrics(comm: Communicator, metrics: Mapping[str, Any],
                   mean: tuple[str, ...] = ()) -> dict[str, Any]:
    """Sum metrics (scalars or vectors) over all ranks; the caller's values are not changed.

    Every rank must call this with the same keys (in any order): the values
    travel in one float64 all-reduce of ``len(metrics)`` elements, sorted by
    key. A ratio metric (accuracy) must be computed from summed numerator and
    denominator, never by averaging per-rank ratios.

    Args:
        comm: the communicator.
        metrics: name -> scalar or array (Python number, NumPy/CuPy/torch
            scalar or tensor of any shape, e.g. per-class counts); every rank
            must give each name the same shape.
        mean: names to divide by the world size after summing.

    Returns:
        name -> float for scalars, a float64 NumPy array (same shape) for
        arrays: the sum, or the mean for names in ``mean``.

    Raises:
        KeyError: a name in ``mean`` is not in ``metrics``.
        CollectiveMismatchError: ranks passed different numbers of metrics.
    """
    for name in mean:
        if name not in metrics:
            raise KeyError(f"mean names {name!r}, which is not among the metrics {sorted(metrics)}")
    keys = sorted(metrics)
    values = [_host(metrics[k]) for k in keys]
    sizes = [v.size for v in values]
    buf = np.concatenate([v.reshape(-1) for v in values]) if values else np.zeros(0)
    comm.all_reduce(buf, op="sum")
    out: dict[str, Any] = {}
    offset = 0
    for k, v, n in zip(keys, values, sizes):
        part = buf[offset:offset + n].reshape(v.shape) / (comm.size if k in mean else 1)
        out[k] = float(part) if v.ndim == 0 else part
        offset += n
    return out


def _host(value: Any) -> np.ndarray:
    """A float64 NumPy copy of a number, NumPy/CuPy array or torch tensor."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    elif hasattr(value, "get") and type(value).__module__.startswith("cupy"):
        value = value.get()
    return np.asarray(value, dtype=np.float64)


def all_gather_object(comm: Communicator, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order, on every rank (one variable-length all-gather)."""
    payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8).copy()
    return [pickle.loads(part.tobytes()) for part in comm.all_gather_v(payload)]


def broadcast_object(comm: Communicator, obj: Any, root: int = 0) -> Any:
    """Send a picklable object from ``root`` to every rank; returns it on every rank.

    The pickle travels as a uint8 buffer after its length (one int64), so the
    data path stays a buffer collective. Use it for what must be identical
    everywhere: a vocabulary built on rank 0 (the AllenNLP pitfall), a
    config, an early-stopping decision.
    """
    payload = pickle.dumps(obj) if comm.rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.broadcast(length, root=root)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if payload else np.empty(int(length[0]), np.uint8)
    comm.broadcast(buf, root=root)
    return obj if comm.rank == root else pickle.loads(buf.tobytes())
