"""Sharded optimizer state in torch's layout, merged from every rank's pieces (no communication).

A piece is ``(parameter number, start, stop, state)``: this rank's elements
``start:stop`` of the flattened parameter numbered over the optimizer's
groups, with the optimizer's state entry for them
(:meth:`distopt.torch.zero.step.ShardedTorchStep.pieces`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["ShardStream", "check_shards", "consolidate", "merge_shards"]


@dataclass
class ShardStream:
    """Every rank's ``state_dict(sharded=True)`` of one checkpoint, read one shard at a time: what
    ``DistOpt.load_state_dict`` takes to re-shard a checkpoint without any rank holding the whole state
    (each shard is dropped once this rank took its elements).

    Attributes:
        headers: each shard's ``{"world_size", "rank"}``, in the order ``shards`` yields them; checked
            (:func:`check_shards`) before any shard is read.
        shards: the shards, in ``headers``' order (it may run a collective per shard, e.g. a broadcast from
            the rank that holds it: every rank then iterates it in step).
    """

    headers: list[dict[str, Any]]
    shards: Iterable[Mapping[str, Any]]

    @classmethod
    def of(cls, shards: Sequence[Mapping[str, Any]]) -> "ShardStream":
        """The stream of a list of every rank's sharded state (any order).

        Raises:
            ValueError: an entry is not a sharded state (no ``"distopt_shard"``).
        """
        bad = [i for i, s in enumerate(shards) if not isinstance(s, Mapping) or "distopt_shard" not in s]
        if bad:
            raise ValueError(f"entries {bad} of the list are not state_dict(sharded=True) outputs (no "
                             "'distopt_shard'): load a list of every rank's sharded state")
        return cls([dict(s["distopt_shard"], pieces=None) for s in shards], shards)


def check_shards(shards: Sequence[Any]) -> None:
    """Refuse a list of sharded states that is not one checkpoint's every rank, each once.

    Args:
        shards: the ``"distopt_shard"`` entries (``world_size``, ``rank``, ``steps``, ``pieces``).

    Raises:
        ValueError: the entries disagree on the world size or the step they
            were saved at (a stale shard), a rank's shard is missing, or one
            appears twice; the message names the ranks and values.
    """
    sizes = sorted({s["world_size"] for s in shards})
    if len(sizes) != 1:
        raise ValueError("the sharded states were saved at different world sizes "
                         f"({[s['world_size'] for s in shards]}, in list order): load one checkpoint's shards")
    ranks = [s["rank"] for s in shards]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    missing = sorted(set(range(sizes[0])) - set(ranks))
    if twice or missing:
        raise ValueError(f"a checkpoint saved at world size {sizes[0]} needs each rank's sharded state once, in "
                         f"any order; got ranks {ranks}" + (f": rank(s) {twice} twice" if twice else "")
                         + (f": rank(s) {missing} missing" if missing else ""))
    steps = {s["rank"]: s.get("steps") for s in shards}
    if len(set(steps.values()) - {None}) > 1:
        raise ValueError(f"the sharded states were saved at different steps (rank: steps {steps}): a stale "
                         "shard; load every rank's shard of the same checkpoint")


def merge_shards(states: Sequence[Any], shapes: Sequence[Any]) -> dict[str, Any]:
    """A torch optimizer's state dict (``state``, ``param_groups``) from every rank's
    ``state_dict(sharded=True)`` of one checkpoint (any world size): what a replicated optimizer loads.

    Args:
        states: every rank's sharded state, any order, without distopt's own ``"distopt"`` key.
        shapes: each parameter's shape, numbered as the optimizer's groups list them.

    Raises:
        ValueError: not one checkpoint's every rank once (:func:`check_shards`).
    """
    check_shards([s["distopt_shard"] for s in states])
    full = consolidate([s["distopt_shard"]["pieces"] for s in states], shapes)
    return {"state": full, "param_groups": states[0]["param_groups"]}


def consolidate(entries: Sequence[Sequence[tuple[int, int, int, Any]]], shapes: Sequence[Any]) -> dict[int, dict]:
    """Per-parameter state in torch's layout from every rank's :meth:`ShardedTorchStep.pieces`.

    Tensors of a piece's size are placed at its elements of a tensor of the
    parameter's shape; other values (``step``) are taken from the first piece.
    """
    import torch

    full: dict[int, dict[str, Any]] = {}
    for rank_pieces in entries:
        for number, start, stop, state in rank_pieces:
            if not state:  # no update yet
                continue
            entry = full.setdefault(number, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == stop - start:
                    if k not in entry:
                        entry[k] = torch.zeros(int(np.prod(shapes[number])), dtype=v.dtype)
                    entry[k][start:stop] = v
                elif k not in entry:
                    entry[k] = v
    for number, entry in full.items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == int(np.prod(shapes[number])):
                entry[k] = v.reshape(shapes[number])
    return full
