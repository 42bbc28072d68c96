"""Cross-rank metric aggregation through buffer collectives."""
from __future__ import annotations

import json
import pickle
import zlib
from typing import Any, Mapping

import numpy as np

from .comm.base import Communicator
from .errors import CollectiveMismatchError

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
        KeyError: on every rank, a name in ``mean`` is not in ``metrics`` on some rank.
        CollectiveMismatchError: on every rank, ranks passed different names, shapes or ``mean``
            (one small all-gather of a digest compares them first).
    """
    keys = sorted(metrics)
    values = [_host(metrics[k]) for k in keys]
    sizes = [v.size for v in values]
    missing = [name for name in mean if name not in metrics]
    mine = [keys, [list(v.shape) for v in values], sorted(mean), missing]
    everyone = _agree_on(comm, mine, bool(missing))
    if everyone is not None:
        for r, (names, _, _, lost) in enumerate(everyone):
            if lost:
                raise KeyError(f"all_reduce_metrics on rank {r}: mean names {lost[0]!r}, which is not among the "
                               f"metrics {names}")
        listing = "; ".join(f"rank {r}: {dict(zip(n, map(tuple, sh)))} mean={m}" for r, (n, sh, m, _) in
                            enumerate(everyone))
        raise CollectiveMismatchError(f"all_reduce_metrics: the ranks passed different metric names, shapes or "
                                      f"mean ({listing})")
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

    Raises:
        CollectiveMismatchError: on every rank, the ranks passed different roots (one small all-gather
            compares them first).
        ValueError: on every rank, ``root`` is not an int in ``[0, size)``.
    """
    everyone = _agree_on(comm, [root if isinstance(root, int) and not isinstance(root, bool) else repr(root)])
    if everyone is not None:
        roots = [e[0] for e in everyone]
        raise CollectiveMismatchError(f"broadcast_object: the ranks passed different roots ({roots})")
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < comm.size:
        raise ValueError(f"broadcast_object: root must be an int in [0, {comm.size}), got {root!r} (on every rank)")
    payload = pickle.dumps(obj) if comm.rank == root else b""
    length = np.array([len(payload)], dtype=np.int64)
    comm.broadcast(length, root=root)
    buf = np.frombuffer(payload, dtype=np.uint8).copy() if payload else np.empty(int(length[0]), np.uint8)
    comm.broadcast(buf, root=root)
    return obj if comm.rank == root else pickle.loads(buf.tobytes())


def _agree_on(comm: Communicator, description: list[Any], problem: bool = False) -> list[Any] | None:
    """None when every rank passed the same JSON-able ``description`` and no rank has a ``problem`` (one
    all-gather of a CRC-32 and the flag), else every rank's description (one more all-gather), on every rank."""
    mine = np.array([zlib.crc32(json.dumps(description, sort_keys=True).encode()), int(problem)], dtype=np.int64)
    rows = comm.all_gather(mine)
    if (rows[:, 0] == rows[0, 0]).all() and not rows[:, 1].any():
        return None
    return all_gather_object(comm, description)
