"""Checkpoint state of one DistOpt: the local optimizer's, the strategies' and the counters'."""
from __future__ import annotations

import warnings
from typing import Any, Mapping, Protocol, Sequence

from ..core.counters import Counters
from ..portable import from_portable, to_portable
from ..sharding.shard_state import ShardStream
from .local import LocalOptimizer
from .strategy_set import StrategySet

__all__ = ["StepState", "ShardedStateLike", "STATE_FORMAT"]

class ShardedStateLike(Protocol):
    """A sharded optimizer's checkpoint state (:class:`distopt.torch.zero.state.ShardedState`)."""

    def state_dict(self, sharded: bool, params: bool = False) -> dict[str, Any]: ...

    def load_state_dict(self, state: Any) -> None: ...

    def load_stream(self, stream: ShardStream, split: Any) -> Any: ...

    def consolidate(self, to: int) -> None: ...


#: Version of :meth:`StepState.state_dict`'s layout (2: strategies own their state).
STATE_FORMAT = 2


def _split_extras(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """A torch-layout state without distopt's own parts, and those parts (None: a plain torch optimizer's
    state): ``param_groups[0]["distopt"]`` (the replicated part) merged with the top-level ``"distopt"``
    (``rank_local``; all of it in files of earlier versions)."""
    groups = list(state["param_groups"])
    inner = groups[0].get("distopt") if groups else None
    if inner is not None:
        groups[0] = {k: v for k, v in groups[0].items() if k != "distopt"}
    clean = {**{k: v for k, v in state.items() if k != "distopt"}, "param_groups": groups}
    top = state.get("distopt")
    if inner is None and top is None:
        return clean, None
    extras = {**(inner or {}), **(top or {})}
    for section in ("strategies", "rank_local"):  # DCP keeps only the replicated part, and drops empty dicts
        extras.setdefault(section, {})
    return clean, extras


class StepState:
    """Saves and restores what a DistOpt needs to continue.

    With a PyTorch optimizer the state is in ``torch.optim.Optimizer``'s
    layout: the inner optimizer's ``state`` and ``param_groups``; distopt's
    own state identical on every rank (format, counters, strategies,
    sampler) is ``param_groups[0]["distopt"]`` (so ``torch.distributed.checkpoint``,
    which keeps only ``state`` and ``param_groups``, carries it), the
    per-rank residuals are under one added key, ``"distopt"``
    (``{"rank_local": ...}``). A plain torch optimizer loads it as its own,
    and :meth:`load_state_dict` takes a plain torch optimizer's state dict
    too (a single-process or DDP run).
    With an array optimizer: ``{"format", "local", "stats", "strategies",
    "rank_local"[, "sampler"]}``.

    Args:
        local: the local optimizer.
        counters: ``DistOpt.stats``.
        strategies: the held and per-call strategies.
        sharding: a sharded torch optimizer's state, which stands in for the
            local optimizer's own (consolidated or per rank); None otherwise.
    """

    def __init__(self, local: LocalOptimizer, counters: Counters, strategies: StrategySet,
                 sharding: ShardedStateLike | None = None) -> None:
        self.local, self.counters, self.strategies, self.sharding = local, counters, strategies, sharding

    def _torch_layout(self) -> bool:
        return hasattr(self.local, "optimizer")

    def state_dict(self, sampler: Any = None, sharded: bool = False, params: bool = False) -> dict[str, Any]:
        """The local optimizer's, the strategies', the counters' and ``sampler``'s state.

        Strategies whose state is per rank (error-feedback residuals) are
        under ``"rank_local"``; the rest is identical on every rank. It holds
        only tensors, numbers, strings and plain containers (arrays as
        tensors, see :mod:`distopt.portable`) when PyTorch is installed, so
        ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it.
        A sharded optimizer's state is consolidated (collective), or this
        rank's shard with ``sharded`` (see :class:`~distopt.torch.zero.state.ShardedState`).

        With ``params`` (and ``sharded``), the shard holds this rank's elements of the parameters too.

        Raises:
            ValueError: ``sharded=True`` without a sharded torch optimizer; ``params=True`` without ``sharded``.
        """
        if sharded and self.sharding is None:
            raise ValueError("sharded=True needs DistOpt(torch_optimizer, zero=1|2|3)")
        if params and not sharded:
            raise ValueError("params=True adds this rank's parameter elements to its shard: it needs sharded=True")
        extras: dict[str, Any] = {"format": STATE_FORMAT, "stats": self.counters.state_dict(),
                                  **self.strategies.state_dict()}
        if sampler is not None:
            extras["sampler"] = sampler.state_dict()
        if self._torch_layout():
            local = self.local.state_dict() if self.sharding is None else self.sharding.state_dict(sharded, params)
            groups = [dict(g) for g in local["param_groups"]]
            rank_local = extras.pop("rank_local")
            groups[0]["distopt"] = extras  # identical on every rank: torch.distributed.checkpoint keeps it
            return to_portable({**local, "param_groups": groups, "distopt": {"rank_local": rank_local}})
        return to_portable({**extras, "local": self.local.state_dict()})

    def consolidate_state_dict(self, to: int) -> None:
        """A sharded optimizer: consolidate now (collective) and keep the state on rank ``to`` for a
        :meth:`state_dict` there alone until the next step; nothing to do otherwise (the state is local)."""
        if self.sharding is not None:
            self.sharding.consolidate(to)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]] | ShardStream,
                        sampler: Any = None) -> None:
        """Restore :meth:`state_dict` output, or (PyTorch) a plain torch optimizer's state dict; a torch
        optimizer also takes the list, or a :class:`~distopt.sharding.shard_state.ShardStream`, of every rank's
        ``state_dict(sharded=True)`` (any world size), which a sharded one re-shards one shard at a time.

        Raises:
            ValueError: ``state`` is neither, or was written by an older
                distopt for an array optimizer (its format is named).
        """
        if isinstance(state, Mapping) and "distopt_shard" in state and self.sharding is None:
            state = [state]  # one rank's shard: a whole checkpoint only if it was saved at world size 1
        if isinstance(state, (list, tuple)) and self._torch_layout():
            state = ShardStream.of(state)
        if isinstance(state, ShardStream) and self._torch_layout():  # every rank's shard
            if self.sharding is not None:
                extras = self.sharding.load_stream(state, lambda s: _split_extras(from_portable(s)))
            else:  # a replicated torch optimizer merges them
                split = [_split_extras(from_portable(s)) for s in state.shards]
                self.local.load_state_dict([clean for clean, _ in split])
                extras = split[0][1]
        else:
            extras = self._load_local(from_portable(state))
        if extras is None:
            return
        self.counters.load_state_dict(extras["stats"])
        self.strategies.load_state_dict(extras)
        if sampler is not None and "sampler" in extras:
            sampler.load_state_dict(extras["sampler"])

    def _load_local(self, state: Mapping[str, Any]) -> Any:
        """Load the local optimizer's part of ``state``; return distopt's own part (None: a plain torch state)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"state is a {type(state).__name__}; a list of every rank's state_dict(sharded=True) "
                             "loads only into a DistOpt over a PyTorch optimizer, and this one's is "
                             f"{type(self.local).__name__}: load its state_dict()")
        if self._torch_layout() and "param_groups" in state:
            local, extras = _split_extras(state)
            if self.sharding is not None:
                self.sharding.load_state_dict(local)
            else:
                self.local.load_state_dict(local)
            return extras
        if self._torch_layout() and state.get("format") == 2:
            warnings.warn("this optimizer state was written by an older distopt (format 2, the torch optimizer's "
                          "state under 'local'); it is loaded, but save it again to write torch's layout",
                          UserWarning, stacklevel=4)
            self.local.load_state_dict(state["local"])
            return state
        if not self._torch_layout() and state.get("format") == STATE_FORMAT:
            self.local.load_state_dict(state["local"])
            return state
        raise ValueError(f"state has format {state.get('format', 1)!r} and keys {sorted(state)}; this distopt "
                         f"reads its own state_dict() (format {STATE_FORMAT}) or, with a PyTorch optimizer, "
                         "a torch optimizer's state dict ('state', 'param_groups')")
