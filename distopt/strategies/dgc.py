"""Deep Gradient Compression (Lin, Han, Mao, Wang & Dally, ICLR 2018).

Top-K sparsification with the four techniques that keep its accuracy at 99.9 % sparsity. Per bucket and step, on
each rank, with its gradient ``g`` (flat, the bucket's dtype), its velocity ``u`` and its accumulation ``v``:

1. **local gradient clipping** (section 3.2): ``g *= min(1, c / ||g||)`` with ``c = clip_norm / sqrt(W)``, so that
   the sum of ``W`` clipped gradients keeps the norm a global clip of ``clip_norm`` would allow;
2. **momentum correction** (section 3.1): ``u = m * u + g``, ``v = v + u``: the residual accumulates the velocity,
   so that the sparse update equals momentum SGD's once an entry is sent;
3. selection, per tensor of the bucket (the paper's per-layer threshold), of the ``max(1, ceil(d * size))`` largest
   ``|v|`` at density ``d = 1 - sparsity`` (:func:`distopt.compress.topk_indices`), sent as (index, value) pairs;
   ``v`` keeps what was not sent;
4. **momentum factor masking** (section 3.2): ``u[sent] = 0``, so stale momentum does not push a just-sent entry again;
5. **warm-up** of the sparsity (section 3.3): stage ``i`` (``warmup_steps`` steps each) sends at
   ``warmup_sparsity[i]``, then at ``sparsity``. The step count is in the strategy's state, so a resumed run continues.

Every rank gathers every rank's pairs and adds them in rank order (:func:`distopt.compress.densify`), so every rank
applies bitwise the same update. When the pairs would move at least as many bytes as a dense all-reduce of the bucket
(``W * k * (index + value bytes) >= n * itemsize``), the same selection travels as one dense all-reduce instead
(``stats["sparse_dense_fallbacks"]``; ``stats["sparse_entries"]`` counts the pairs this rank selected).

The momentum lives in the strategy, so the local optimizer must have none (see docs/strategies.md).
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, ClassVar, Mapping, Sequence

import numpy as np

from ..core._array import xp_of
from ..compress import densify, k_for, topk_indices
from ..compress._xp import index_dtype, is_cupy
from .base import BucketContext, Done, GradientStrategy, Handle, LocalInfo
from .memory import Residuals
from .registry import Example, register
from .sparse import ENTRIES, FALLBACKS

__all__ = ["DGC", "WARMUP_SPARSITY"]

_BLOCK = 1 << 15
"""Elements per block of the momentum correction on NumPy (128 KiB of float32: three blocks fit in L2)."""

WARMUP_SPARSITY: tuple[float, ...] = (0.75, 0.9375, 0.984375, 0.996)
"""The paper's warm-up stages: the density (1 - sparsity) shrinks 4x per stage, from 25 % to 0.4 %."""


class DGC(GradientStrategy):
    """Deep Gradient Compression: top-K of the momentum-corrected accumulation, with warm-up.

    Args:
        sparsity: fraction of each tensor's elements NOT sent once warm-up is over, in [0, 1); 0.999 sends
            ``k = max(1, ceil(0.001 * n))`` of a tensor's ``n`` elements.
        momentum: the momentum factor ``m`` of the velocity the strategy keeps, in [0, 1); the local optimizer's own
            momentum must be 0.
        clip_norm: the global L2-norm bound a single process would clip the summed gradient to (as
            ``torch.nn.utils.clip_grad_norm_``); each rank clips its own gradient to ``clip_norm / sqrt(W)`` before
            accumulating, per bucket. None: no clipping.
        warmup_steps: steps per warm-up stage, >= 0; 0 skips the warm-up.
        warmup_sparsity: the sparsity of each warm-up stage, each in [0, 1).

    Attributes:
        steps: steps completed with this strategy (drives the warm-up; counted by :meth:`end_of_step`).
        velocity: this rank's ``u`` per bucket (:class:`~distopt.strategies.memory.Residuals`).
        accumulated: this rank's ``v`` per bucket, what was not sent yet (the error-feedback memory).

    Raises:
        ValueError: an argument outside the ranges above (at construction); the local optimizer has its own momentum
            (at the first step).

    Supports neither overlap nor ``join``.
    """

    name: ClassVar[str] = "dgc"
    per_rank_state: ClassVar[bool] = True
    counter_names: ClassVar[tuple[str, ...]] = (ENTRIES, FALLBACKS)

    def __init__(self, sparsity: float = 0.999, momentum: float = 0.9, clip_norm: float | None = None,
                 warmup_steps: int = 0, warmup_sparsity: Sequence[float] = WARMUP_SPARSITY) -> None:
        for what, value in [("sparsity", sparsity), *((f"warmup_sparsity[{i}]", s)
                                                       for i, s in enumerate(warmup_sparsity))]:
            if not 0 <= value < 1:
                raise ValueError(f"{what} must be in [0, 1) (the fraction of elements not sent), got {value!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 (an L2 norm) or None for no clipping, got {clip_norm!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0 (steps per warm-up stage), got {warmup_steps!r}")
        self.sparsity, self.momentum = float(sparsity), float(momentum)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_steps = int(warmup_steps)
        self.warmup_sparsity = tuple(float(s) for s in warmup_sparsity)
        self.steps = 0
        self.velocity, self.accumulated = Residuals(), Residuals()

    def settings(self) -> dict[str, Any]:
        return {"sparsity": self.sparsity, "momentum": self.momentum, "clip_norm": self.clip_norm,
                "warmup_steps": self.warmup_steps, "warmup_sparsity": self.warmup_sparsity}

    def bind(self, world_size: int, local: LocalInfo) -> None:  # noqa: ARG002
        """Refuse a local optimizer with momentum: DGC's velocity replaces it (momentum correction).

        Raises:
            ValueError: naming the optimizer setting and the fix.
        """
        for where, value in local.momentum_factors():
            if value != 0:
                raise ValueError(
                    f"DGC keeps the momentum itself (momentum correction), so the local optimizer's must be "
                    f"off: {where} is {value}, expected 0. Build the optimizer with momentum=0 and pass the "
                    f"momentum to the strategy: DGC(momentum={value}, ...)")

    def density(self, step: int) -> float:
        """Fraction of each tensor's elements sent at ``step`` (0-based), from the warm-up schedule.

        Computed on the decimal forms of the sparsities, so 0.999 gives exactly 0.001, not ``0.0010000000000000009``.
        """
        stage = step // self.warmup_steps if self.warmup_steps else len(self.warmup_sparsity)
        sparsity = self.warmup_sparsity[stage] if stage < len(self.warmup_sparsity) else self.sparsity
        return float(1 - Fraction(repr(sparsity)))

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:  # noqa: ARG002
        key = (ctx.key, ctx.index)
        if self.clip_norm is not None:
            _clip(flat, self.clip_norm / math.sqrt(ctx.comm.size))
        u = self.velocity.get(key, flat)
        v = self.accumulated.get(key, flat)
        _correct(u, v, flat, u.dtype.type(self.momentum))      # u = m u + g, v += u
        idx = _select(ctx, v, self.density(self.steps))
        values = v[idx]
        v[idx] = 0
        u[idx] = 0                                             # momentum factor masking
        ctx.counters.add(ENTRIES, int(idx.size))
        return Done(_exchange(ctx, flat, idx, values, flat.dtype.type(divisor)))

    def end_of_step(self) -> None:
        """Count the step: the next one reads its density from the warm-up schedule at ``steps + 1``."""
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "velocity": self.velocity.state_dict(),
                "accumulated": self.accumulated.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.velocity.load_state_dict(state["velocity"])
        self.accumulated.load_state_dict(state["accumulated"])


def _select(ctx: BucketContext, v: Any, density: float) -> Any:
    """Ascending positions in the bucket of each tensor's ``max(1, ceil(density * size))`` largest ``|v|``.

    Per tensor, as the paper's per-layer thresholds: a layer of small gradients is not starved by one of large gradients
    sharing its bucket, and the selection does not depend on how tensors are bucketed.
    """
    parts = []
    for slot in ctx.bucket.slots:
        if slot.size:
            chosen = topk_indices(v[slot.offset:slot.offset + slot.size], k_for(slot.size, density))
            parts.append(chosen.astype(index_dtype(v.size)) + slot.offset)
    return parts[0] if len(parts) == 1 else xp_of(v).concatenate(parts)


def _clip(flat: Any, bound: float) -> None:
    """Scale ``flat`` in place to the L2 norm ``bound`` if its norm is above it (a NaN norm: unchanged).

    The norm is taken in float64 (a float16 or float32 sum of squares can overflow). On CuPy the comparison and the
    scale stay on the device (no host synchronisation); the scale is the same float64 quotient, rounded to ``flat``'s
    dtype, so both give the same bits (a factor of exactly 1 where NumPy skips the product).
    """
    mod = xp_of(flat)
    norm = mod.linalg.norm(flat.astype(np.float64))
    if mod is np:
        if norm > bound:
            flat *= flat.dtype.type(bound / norm)
        return
    flat *= mod.where(norm > bound, bound / norm, 1.0).astype(flat.dtype)


def _correct(u: Any, v: Any, g: Any, momentum: Any) -> None:
    """Momentum correction in place: ``u = momentum * u + g``, then ``v += u`` (1-D arrays of one length).

    NumPy: in blocks of ``_BLOCK`` elements, so that each block of ``u`` is still in cache for the second and third
    operation (one pass over memory instead of three, bitwise the same result). CuPy: on whole arrays.
    """
    block = u.size if is_cupy(u) else _BLOCK
    for lo in range(0, u.size, block):
        ub = u[lo:lo + block]
        ub *= momentum
        ub += g[lo:lo + block]
        v[lo:lo + block] += ub


def _exchange(ctx: BucketContext, flat: Any, idx: Any, values: Any, divisor: Any) -> int:
    """Write into ``flat`` the SUM over ranks of every rank's ``values`` at its ``idx``, divided by ``divisor`` (a
    scalar of ``flat.dtype``), as the module docs describe (sparse, or dense fallback); returns bytes sent."""
    n, comm = flat.size, ctx.comm
    pair_bytes = index_dtype(n).itemsize + flat.dtype.itemsize
    dense = comm.size * idx.size * pair_bytes >= flat.nbytes
    ctx.counters.add(FALLBACKS, int(dense))
    if dense:
        flat[...] = 0
        flat[idx] = values
        comm.all_reduce(flat, op="sum")
        flat /= divisor
        return int(flat.nbytes)
    all_idx = comm.all_gather(idx)  # one row per rank: densify adds them in rank order (on CuPy without atomics)
    densify(all_idx, comm.all_gather(values), n, flat.dtype, out=flat)
    flat[all_idx.reshape(-1)] /= divisor  # a repeated position is divided once (fancy-index assignment)
    return int(idx.nbytes + values.nbytes)


register(Example("dgc", DGC, {"sparsity": 0.75, "momentum": 0.9, "warmup_steps": 1, "warmup_sparsity": (0.5,)},
                 mismatch={"sparsity": 0.5, "momentum": 0.9}, local_momentum=0.0))
