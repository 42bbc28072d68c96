"""Partial synchronization: average one chunk of the parameters per step.

SINGA's ``backward_and_partial_update``: every rank updates locally with its
own gradient, then one chunk of the parameters (in the fixed parameter
order, cut by the threshold rule) is averaged across ranks, the chunk moving
round-robin so that after K calls (K chunks) every parameter has been
averaged once. Related to local SGD / periodic model averaging
(Zinkevich et al. 2010; Lin et al. 2020, "Don't use large mini-batches").
"""
from __future__ import annotations

from typing import Any

__all__ = ["ChunkCursor"]


class ChunkCursor:
    """Which chunk the next partial update averages; identical on every rank.

    The cursor advances once per call, whatever the number of parameter
    groups; it is part of DistOpt's ``state_dict``.
    """

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

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
