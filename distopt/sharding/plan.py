"""The shard plan: which segment of every bucket each rank owns, and the stage and its checks.

ZeRO (Rajbhandari, Rasley, Ruwase & He, SC 2020, "ZeRO: memory optimizations toward training trillion parameter
models") and Megatron-LM's distributed optimizer. Per bucket of the step's layout (identical on every rank), rank ``r``
owns the contiguous segment ``[lo_r, hi_r)`` of the bucket's flat buffer, split by
:func:`~distopt.comm.base.split_counts` (the first ``size % W`` ranks own one element more), so a tensor may span
ranks and a rank's shard is one slice per bucket. A step reduces each bucket (stage 2: reduce-scatters it, a rank
receiving only its segment's average), the local optimizer updates only the pieces of parameters in this rank's
segments (1-D views, so its state has 1/W of the elements), and every bucket's parameters are all-gathered in place
(:class:`~distopt.sharding.gather.ParamGather`); the stages' differences are in :mod:`distopt.sharding.sync`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..comm.base import split_counts
from ..core.buckets import Bucket
from ..strategies.base import Strategy

__all__ = ["Piece", "ShardPlan", "plan_shards", "piece_views", "shard_grad_views", "ZERO_STAGES", "check_stage",
           "check_sharding", "check_strategy"]

#: The sharding stages: 0 (none: every rank updates everything), 1 (optimizer state), 2 (and gradients),
#: 3 (and parameters: :mod:`distopt.torch.zero.params`).
ZERO_STAGES = (0, 1, 2, 3)


def check_stage(zero: Any) -> int:
    """``zero`` as a stage, validated.

    Raises:
        ValueError: ``zero`` is not one of :data:`ZERO_STAGES`.
    """
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES} (0: no sharding, 1: optimizer state, "
                         f"2: optimizer state and gradients, 3: and parameters), got {zero!r}")
    return int(zero)


def check_sharding(zero: Any, strategy: Strategy, array_opt: Any, overlap_param_gather: bool) -> int:
    """``zero`` as a stage (:func:`check_stage`), checked against the strategy and an array optimizer.

    Args:
        zero: the requested stage.
        strategy: the held strategy.
        array_opt: the array optimizer (None for a PyTorch one, checked by
            :func:`distopt.torch.zero.placeholder.check_elementwise`).
        overlap_param_gather: the option of the same name.

    Raises:
        ValueError: ``zero`` is not a stage; the strategy does not support sharding; ``array_opt`` is not
            :class:`distopt.SGD` and does not declare ``elementwise = True`` (its update sees 1-D pieces of arrays);
            ``overlap_param_gather`` or ``zero=3`` with an array optimizer (they need a PyTorch model's forward hooks).
    """
    zero = check_stage(zero)
    check_strategy(zero, strategy)
    if zero == 3 and array_opt is not None:
        raise ValueError("zero=3 frees each parameter between the forward passes that use it, which needs a "
                         "torch.optim.Optimizer and model= (forward hooks gather the parameters); an array model "
                         "can use zero=1 or zero=2")
    if zero and array_opt is not None:
        kind = type(array_opt)
        if not (f"{kind.__module__}.{kind.__name__}" == "distopt.optim.SGD"
                or getattr(kind, "elementwise", False) is True):
            raise ValueError(f"zero={zero} hands the optimizer 1-D pieces of each array, so its update(param, "
                             f"grad) must be elementwise; {kind.__name__} is not known to be: use distopt.SGD, or "
                             "set `elementwise = True` on your optimizer class to declare it")
        if overlap_param_gather:
            raise ValueError("overlap_param_gather=True needs a torch.optim.Optimizer and model= (forward pre-hooks)")
    return zero


def check_strategy(zero: int, strategy: Strategy) -> None:
    """Refuse a strategy whose one collective per bucket cannot become a reduce-scatter under ``zero``.

    Raises:
        ValueError: ``zero`` is 1, 2 or 3 and ``strategy.supports_sharding`` is False.
    """
    if zero and not strategy.supports_sharding:
        raise ValueError(f"zero={zero} needs a strategy that supports sharding (its bucket collective becomes a "
                         f"reduce-scatter): Dense or Half, not {strategy.name!r}; or use zero=0")


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in this rank's segment of a bucket.

    Attributes:
        index: the parameter's position in the step's parameter list.
        start: first ELEMENT of the piece in the flattened parameter.
        stop: one past its last element (``stop > start``).
        bucket: the bucket's index in the layout.
        offset: first element of the piece in this rank's segment of the bucket.
    """

    index: int
    start: int
    stop: int
    bucket: int
    offset: int

    @property
    def size(self) -> int:
        """Elements in the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """How one bucket layout is split across the ranks, seen from one rank.

    Attributes:
        counts: per bucket, the ELEMENTS each rank owns (``len == W``).
        lows: per bucket, the first element this rank owns.
        pieces: this rank's pieces, bucket by bucket, in slot order.
    """

    counts: tuple[tuple[int, ...], ...]
    lows: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plan_shards(buckets: Sequence[Bucket], rank: int, size: int) -> ShardPlan:
    """Split every bucket over ``size`` ranks and list the pieces ``rank`` owns.

    Args:
        buckets: the layout's float buckets (identical on every rank).
        rank: this rank, ``0 <= rank < size``.
        size: the world size.
    """
    counts, lows, pieces = [], [], []
    for b, bucket in enumerate(buckets):
        c = tuple(split_counts(bucket.size, size))
        lo, hi = sum(c[:rank]), sum(c[:rank + 1])
        counts.append(c)
        lows.append(lo)
        for s in bucket.slots:
            start, stop = max(lo, s.offset), min(hi, s.offset + s.size)
            if stop > start:
                pieces.append(Piece(s.index, start - s.offset, stop - s.offset, b, start - lo))
    return ShardPlan(tuple(counts), tuple(lows), tuple(pieces))


def piece_views(plan: ShardPlan, arrays: Sequence[Any]) -> list[Any]:
    """One 1-D view per piece into ``arrays`` (C-contiguous; writing a view writes the array); None for a piece of a
    None entry."""
    return [None if arrays[p.index] is None else arrays[p.index].reshape(-1)[p.start:p.stop] for p in plan.pieces]


def shard_grad_views(plan: ShardPlan, segments: Sequence[Any]) -> list[Any]:
    """One 1-D view per piece into the reduced segments (``segments[b]``: this rank's part of bucket b)."""
    return [segments[p.bucket][p.offset:p.offset + p.size] for p in plan.pieces]
