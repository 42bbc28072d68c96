"""Error-feedback memory: what a compressing strategy held back, one array per bucket, on this rank.

Error feedback (Seide et al. 2014, "1-bit SGD"; Stich, Cordonnier & Jaggi 2018, "Sparsified SGD with memory";
Karimireddy et al. 2019, "Error feedback fixes SignSGD") keeps what a lossy compression did not send and adds it to the
next step's gradient, so nothing is lost, only delayed. :class:`~distopt.strategies.Sparse` keeps its residuals here,
:class:`~distopt.strategies.DGC` its velocity and accumulation, :class:`~distopt.strategies.PowerSGD` its errors and
warm-start ``Q`` factors. The memory is per rank, so these strategies declare ``per_rank_state``.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

__all__ = ["Residuals"]

log = logging.getLogger("distopt")


class Residuals:
    """One 1-D array per bucket, keyed by ``(layout key, bucket index)`` as the step engine numbers buckets.

    Attributes:
        buffers: the arrays by key (NumPy or CuPy, each the dtype and length in ELEMENTS of its bucket's flat buffer).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], Any] = {}

    def get(self, key: tuple[int, int], like: Any) -> Any:
        """The array of bucket ``key``, created as zeros shaped like ``like`` (1-D) on first use.

        A stored array whose shape or dtype no longer fits ``like`` (the bucket layout changed: a parameter added,
        removed or resized) is dropped with a warning on the ``distopt`` logger and replaced by zeros.

        Args:
            key: ``(layout key, bucket index)``.
            like: the bucket's flat buffer (1-D float array).

        Returns:
            The stored array, to be updated in place.
        """
        r = self.buffers.get(key)
        if r is not None and (r.shape != like.shape or r.dtype != like.dtype):
            log.warning("error-feedback memory of bucket %s dropped: layout changed (%s %s -> %s %s)",
                        key, r.shape, r.dtype, like.shape, like.dtype)
            r = None
        if r is None:
            r = self.buffers[key] = like * 0
        return r

    def state_dict(self) -> dict[str, Any]:
        """Copies of the arrays: ``{"keys": [[layout, bucket], ...], "values": [array, ...]}``, keys sorted."""
        keys = sorted(self.buffers)
        return {"keys": [list(k) for k in keys], "values": [self.buffers[k].copy() for k in keys]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the memory by copies of :meth:`state_dict` output."""
        self.buffers = {(int(k[0]), int(k[1])): v.copy() for k, v in zip(state["keys"], state["values"])}
