"""Writes into whole parameters (``summon_full_params``) that every rank keeps alike, or none does.

DeepSpeed's ``GatheredParameters(params, modifier_rank=r)``: with ``modifier_rank`` the block's writes on rank ``r``
become every rank's (a broadcast after the block); without it, the ranks' writes are compared (a digest of the
parameters before and after the block, one small all-gather), and when some ranks wrote and others did not, every rank
raises: at ``zero=3`` such a write is then discarded everywhere, where it would leave each rank's own segment written
and the rest old.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .adapter import as_array

__all__ = ["digest", "check_modifier_rank", "check_writes", "broadcast_from"]


def digest(tensors: Sequence[Any]) -> int:
    """A 64-bit digest of the tensors' bytes, in order (CUDA tensors are read back, one copy each)."""
    import torch

    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        if t.numel():  # the bytes of a copy (any dtype): a NumPy view would pin the storage zero=3 resizes
            h.update(t.detach().reshape(-1).cpu().clone().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little", signed=True)


def check_modifier_rank(modifier_rank: int | None, size: int) -> None:
    """Raises: ValueError: ``modifier_rank`` is neither None nor a rank in ``[0, size)``."""
    if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                                      or not 0 <= modifier_rank < size):
        raise ValueError(f"summon_full_params: modifier_rank must be None or a rank in [0, {size}), got "
                         f"{modifier_rank!r}")


def check_writes(comm: Any, before: int, after: int, discarded: bool) -> None:
    """Raise on every rank when some ranks wrote the parameters and others did not (collective).

    Raises:
        RuntimeError: naming the ranks that wrote and those that did not.
    """
    wrote = comm.all_gather(np.array([int(before != after)], dtype=np.int64)).reshape(-1)
    if 0 < int(wrote.sum()) < comm.size:
        who = [r for r in range(comm.size) if wrote[r]]
        rest = [r for r in range(comm.size) if not wrote[r]]
        fate = ("the write was discarded on every rank" if discarded else
                "the parameters now differ across ranks (opt.broadcast_state(root) makes them equal again)")
        raise RuntimeError(f"summon_full_params(writeback=True): rank(s) {who} wrote the parameters and rank(s) "
                           f"{rest} did not; {fate}. Write on every rank, or pass modifier_rank={who[0]} to "
                           f"keep rank {who[0]}'s values on every rank")


def broadcast_from(comm: Any, tensors: Sequence[Any], root: int) -> None:
    """Give every rank ``root``'s values of ``tensors`` (in place, one broadcast each, through a copy that leaves the
    tensors' storage resizable; collective)."""
    for t in tensors:
        if t.numel():
            buf = t.detach().clone()
            comm.broadcast(as_array(buf), root)
            t.detach().copy_(buf)
