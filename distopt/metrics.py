"""Cross-rank metric aggregation through buffer collectives."""
from __future__ import annotations

import pickle
from typing import Any, Mapping

import numpy as np

from .comm.base import Communicator
from .comm.consensus import agree, gather_objects

__all__ = ["reduce_metrics", "broadcast_object", "all_gather_object"]


def reduce_metrics(comm: Communicator, metrics: Mapping[str, Any],
                   mean: tuple[str, ...] = ()) -> dict[str, Any]:
    """Sum metrics (scalars or vectors) over all ranks; the caller's values are not changed.

    Every rank must call this with the same keys (in any order): the values travel in one float64 all-reduce of
    ``len(metrics)`` elements, sorted by key. A ratio metric (accuracy) must be computed from summed numerator and
    denominator, never by averaging per-rank ratios.

    Args:
        comm: the communicator.
        metrics: name -> scalar or array (Python number, NumPy/CuPy/torch scalar or tensor of any shape, e.g.
            per-class counts); every rank must give each name the same shape.
        mean: names to divide by the world size after summing.

    Returns:
        name -> float for scalars, a float64 NumPy array (same shape) for arrays: the sum, or the mean for names in
        ``mean``.

    Raises:
        KeyError: on every rank, a name in ``mean`` is not in ``metrics`` on some rank (naming the ranks and the
            names).
        CollectiveMismatchError: on every rank, ranks passed different names, shapes or ``mean``, naming every rank's
            ``{name: shape}`` or ``mean`` (one small all-gather of a digest compares them first:
            :func:`~distopt.comm.consensus.agree`).
    """
    keys = sorted(metrics)
    values = [_host(metrics[k]) for k in keys]
    missing = [name for name in mean if name not in metrics]
    problem = None if not missing else KeyError(f"mean names {missing[0]!r}, which is not among the metrics {keys}")
    agree(comm, {"metric set": {k: tuple(v.shape) for k, v in zip(keys, values)}, "mean": sorted(mean)},
          call="all_reduce_metrics", problem=problem, kinds=(KeyError,),
          hint={"metric set": "every rank must pass the same metric names, each with the same shape"})
    buf = np.concatenate([v.reshape(-1) for v in values]) if values else np.zeros(0)
    comm.all_reduce(buf, op="sum")
    out: dict[str, Any] = {}
    offset = 0
    for k, v in zip(keys, values):
        part = buf[offset:offset + v.size].reshape(v.shape) / (comm.size if k in mean else 1)
        out[k] = float(part) if v.ndim == 0 else part
        offset += v.size
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
    return gather_objects(comm, obj)


def broadcast_object(comm: Communicator, obj: Any, root: int = 0) -> Any:
    """Send a picklable object from ``root`` to every rank; returns it on every rank.

    The pickle travels as a uint8 buffer after its length (one int64), so the data path stays a buffer collective.
    Use it for what must be identical everywhere: a vocabulary built on rank 0 (the AllenNLP pitfall), a config, an
    early-stopping decision.

    Raises:
        CollectiveMismatchError: on every rank, the ranks passed different roots, naming every rank's (one small
            all-gather compares them first: :func:`~distopt.comm.consensus.agree`).
        ValueError: on every rank, ``root`` is not an int in ``[0, size)``.
    """
    agree(comm, {"root": root if isinstance(root, int) and not isinstance(root, bool) else repr(root)},
          call="broadcast_object")
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < comm.size:
        raise ValueError(f"broadcast_object: root must be an int in [0, {comm.size}), got {root!r} (on every rank)")
    payload = pickle.dumps(obj) if comm.rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.broadcast(length, root=root)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if payload else np.empty(int(length[0]), np.uint8)
    comm.broadcast(buf, root=root)
    return obj if comm.rank == root else pickle.loads(buf.tobytes())

