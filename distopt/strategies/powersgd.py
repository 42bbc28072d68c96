"""PowerSGD: rank-r low-rank gradient compression (Vogels, Karimireddy & Jaggi, NeurIPS 2019,
"PowerSGD: practical low-rank gradient compression for distributed optimization").

As PyTorch's ``powerSGD_hook`` (``torch.distributed.algorithms.ddp_comm_hooks``), per bucket and step, on each rank:

1. **error feedback**: add this rank's residual ``e`` to the gradient: ``M = g + e`` (flat, the bucket's dtype);
2. view every tensor of the bucket that is worth compressing as a matrix ``M_i`` of shape ``(out, rest)`` =
   ``(shape[0], prod(shape[1:]))``; 1-D tensors and those with ``out * rest < min_compression_rate * (out + rest) * r``
   are reduced densely;
3. ``P_i = M_i Q_i`` with ``Q_i`` of shape ``(rest, r)`` **warm-started** from the previous step's (random, identical
   on every rank, at the first step), orthonormalized first; ONE all-reduce sums every ``P_i`` and the dense tensors;
4. orthonormalize ``P_i`` (Gram-Schmidt, see :func:`orthonormalize`), then ``Q_i = M_i^T P_i``; ONE all-reduce sums
   every ``Q_i``, divided by the contributing ranks;
5. the update is ``P_i Q_i^T``; the residual becomes ``M - P_i Q_i^T`` for compressed tensors (minus the AVERAGE
   approximation, as PyTorch's hook and the paper's Algorithm 2) and 0 for densely reduced ones (their average is
   exact; PyTorch stores ``own - average`` there, which averages to zero over the ranks and only grows).

``start_step`` steps of plain dense averaging come first (PyTorch's ``start_powerSGD_iter``). Every rank
orthonormalizes the same summed ``P`` and applies the same ``P Q^T``, so replicas stay bitwise identical. Only the
first ``Q`` is drawn with NumPy (a fixed seed) and copied to the device; everything else runs in the input's array
module (NumPy or CuPy).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from ..core._array import xp_of
from ..core.buckets import Bucket, Slot
from .base import BucketContext, Done, GradientStrategy, Handle
from .lowrank import Stack, orthonormalize, project
from .memory import Residuals
from .registry import Example, register

__all__ = ["PowerSGD", "orthonormalize", "Factorization", "plan_bucket"]


@dataclass(frozen=True)
class Factorization:
    """One tensor of a bucket compressed as ``(rows, cols)`` factors of rank ``rank``.

    Attributes:
        offset: first element of the tensor in the bucket's flat buffer.
        rows: ``shape[0]``.
        cols: ``prod(shape[1:])``.
        rank: ``min(r, rows, cols)``.
    """

    offset: int
    rows: int
    cols: int
    rank: int

    @property
    def size(self) -> int:
        """Elements of the tensor (``rows * cols``)."""
        return self.rows * self.cols


def plan_bucket(bucket: Bucket, matrix_rank: int,
                min_compression_rate: float) -> tuple[list[Factorization], list[Slot]]:
    """Split a bucket's tensors into those compressed at ``matrix_rank`` and those reduced densely.

    Args:
        bucket: the bucket layout (slots with offset, size in elements, shape).
        matrix_rank: the approximation rank ``r``, >= 1.
        min_compression_rate: compress a tensor only when
            ``rows * cols >= min_compression_rate * (rows + cols) * min(r, rows, cols)``.

    Returns:
        ``(factorizations, dense_slots)``, each in bucket order; tensors with fewer than 2 dimensions or no elements
        are dense.
    """
    factorizations: list[Factorization] = []
    dense: list[Slot] = []
    for slot in bucket.slots:
        if len(slot.shape) >= 2 and slot.size > 0:
            rows = int(slot.shape[0])
            cols = slot.size // rows
            r = min(matrix_rank, rows, cols)
            if rows * cols >= min_compression_rate * (rows + cols) * r:
                factorizations.append(Factorization(slot.offset, rows, cols, r))
                continue
        dense.append(slot)
    return factorizations, dense


class PowerSGD(GradientStrategy):
    """Rank-``r`` PowerSGD with error feedback and warm-started ``Q``, as PyTorch's ``powerSGD_hook``.

    Args:
        matrix_rank: the approximation rank ``r`` (PyTorch's ``matrix_approximation_rank``), >= 1.
        start_step: steps of plain dense averaging before compression starts (PyTorch's ``start_powerSGD_iter``), >= 0.
        min_compression_rate: compress a tensor only when its factors are at least this many times smaller than it
            (PyTorch's default 2), >= 0.
        warm_start: reuse each tensor's ``Q`` from the previous step (default), else draw a new random ``Q`` every step.
        seed: seed of the random ``Q`` (identical on every rank).
        rank: deprecated name of ``matrix_rank`` (it collides with the process rank); warns.

    Attributes:
        steps: steps completed with this strategy (dense and compressed; counted by :meth:`end_of_step`).
        errors: this rank's error-feedback residual per bucket (:class:`~distopt.strategies.memory.Residuals`).
        qs: the (averaged) ``Q`` factors per bucket, one flat array of ``sum(cols * rank)`` elements each, kept for the
            warm start (a :class:`~distopt.strategies.memory.Residuals` memory).

    Raises:
        ValueError: an argument outside the ranges above.
        TypeError: both ``matrix_rank`` and ``rank`` given.

    Supports neither overlap nor ``join``.
    """

    name: ClassVar[str] = "powersgd"
    per_rank_state: ClassVar[bool] = True

    def __init__(self, matrix_rank: int | None = None, start_step: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, seed: int = 0, *, rank: int | None = None) -> None:
        if rank is not None:
            if matrix_rank is not None:
                raise TypeError("PowerSGD() got both matrix_rank= and its deprecated name rank=")
            warnings.warn("PowerSGD(rank=...) is deprecated and will be removed in the next release: use "
                          "matrix_rank= (rank= collides with the process rank)", DeprecationWarning, stacklevel=2)
            matrix_rank = rank
        matrix_rank = 2 if matrix_rank is None else matrix_rank
        if int(matrix_rank) != matrix_rank or matrix_rank < 1:
            raise ValueError(f"matrix_rank must be an integer >= 1 (the approximation rank r), got {matrix_rank!r}")
        if int(start_step) != start_step or start_step < 0:
            raise ValueError(f"start_step must be an integer >= 0 (dense steps before compression), got {start_step!r}")
        if not (min_compression_rate >= 0 and math.isfinite(min_compression_rate)):
            raise ValueError(f"min_compression_rate must be a finite number >= 0, got {min_compression_rate!r}")
        self.matrix_rank, self.start_step = int(matrix_rank), int(start_step)
        self.min_compression_rate, self.warm_start, self.seed = float(min_compression_rate), bool(warm_start), int(seed)
        self.steps = 0
        self.errors, self.qs = Residuals(), Residuals()
        self._plans: dict[tuple[int, int], tuple[list[Factorization], list[Slot], Stack, Stack]] = {}

    def settings(self) -> dict[str, Any]:
        return {"matrix_rank": self.matrix_rank, "start_step": self.start_step,
                "min_compression_rate": self.min_compression_rate, "warm_start": self.warm_start, "seed": self.seed}

    def finish(self, ctx: BucketContext, flat: Any, started: Handle, divisor: int) -> Done:  # noqa: ARG002
        if self.steps >= self.start_step:
            return Done(self._compressed(ctx, flat, divisor))
        ctx.comm.all_reduce(flat, op="sum")                      # dense warm-up
        flat /= flat.dtype.type(divisor)
        return Done(int(flat.nbytes))

    def end_of_step(self) -> None:
        """Count the step (the dense warm-up of ``start_step`` steps, the per-step draws without warm start)."""
        self.steps += 1

    def _compressed(self, ctx: BucketContext, flat: Any, divisor: int) -> int:
        """Steps 1-5 of the module docs for one bucket; ``flat`` ends holding the average approximation. Returns the
        bytes sent.

        The error memory holds ``M`` from step 1 to the residual (no copy), every product writes into its factor or
        into ``flat`` (no matrix-sized temporaries), and the Gram-Schmidt runs once per bucket on all its ``P`` (or
        ``Q``) factors (:class:`~distopt.strategies.lowrank.Stack`).
        """
        key = (ctx.key, ctx.index)
        xp, div = xp_of(flat), flat.dtype.type(divisor)
        factors, dense, p_stack, q_stack = self._plan(key, ctx.bucket, xp)
        error = self.errors.get(key, flat)
        error += flat                                            # error feedback: M = g + e, held in the memory
        n_dense = sum(s.size for s in dense)
        first = xp.empty(n_dense + p_stack.size, dtype=flat.dtype)
        at = 0
        for s in dense:
            first[at:at + s.size] = error[s.offset:s.offset + s.size]
            at += s.size
        q = q_stack.orthonormalize(self._q(key, factors, flat))
        ms = [error[f.offset:f.offset + f.size].reshape(f.rows, f.cols) for f in factors]
        ps, qs = p_stack.views(first[n_dense:]), q_stack.views(q)
        for m, pi, qi in zip(ms, ps, qs):
            project(m, qi, pi)                                   # P = M Q
        ctx.comm.all_reduce(first, op="sum")                     # dense tensors and every P: one collective
        sent = int(first.nbytes)
        p_stack.orthonormalize(first[n_dense:])
        for m, pi, qi in zip(ms, ps, qs):
            project(m.T, pi, qi)                                 # Q = M^T P
        if factors:
            ctx.comm.all_reduce(q, op="sum")                     # every Q: one collective
            sent += int(q.nbytes)
            q /= div                                             # kept averaged: next step's warm start
        for f, pi, qi in zip(factors, ps, qs):                   # the average rank-r approximation
            xp.matmul(pi, qi.T, out=flat[f.offset:f.offset + f.size].reshape(f.rows, f.cols))
        error -= flat                                            # compensated - average approximation
        at = 0
        for s in dense:
            xp.divide(first[at:at + s.size], div, out=flat[s.offset:s.offset + s.size])
            error[s.offset:s.offset + s.size] = 0                # exact: nothing held back
            at += s.size
        return sent

    def _plan(self, key: tuple[int, int], bucket: Bucket, xp: Any) -> tuple[list[Factorization], list[Slot],
                                                                             Stack, Stack]:
        """The bucket's :func:`plan_bucket` and the :class:`Stack` of its ``P`` and of its ``Q`` factors (built once per
        bucket and array module)."""
        plan = self._plans.get(key)
        if plan is None or plan[2].xp is not xp:
            factors, dense = plan_bucket(bucket, self.matrix_rank, self.min_compression_rate)
            plan = self._plans[key] = (factors, dense, Stack([(f.rows, f.rank) for f in factors], xp),
                                       Stack([(f.cols, f.rank) for f in factors], xp))
        return plan

    def _q(self, key: tuple[int, int], factors: list[Factorization], like: Any) -> Any:
        """The bucket's flat ``Q`` memory (``sum(cols * rank)`` elements of ``like.dtype``): the previous step's with
        ``warm_start``, else (or at first) standard normal from ``seed``."""
        size = sum(f.cols * f.rank for f in factors)
        q = self.qs.buffers.get(key)
        if q is None or q.size != size or q.dtype != like.dtype or not self.warm_start:
            draw = np.random.default_rng([self.seed, key[1], 0 if self.warm_start else self.steps])
            q = self.qs.buffers[key] = xp_of(like).asarray(draw.standard_normal(size).astype(like.dtype))
        return q

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "errors": self.errors.state_dict(), "qs": self.qs.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.errors.load_state_dict(state["errors"])
        self.qs.load_state_dict(state["qs"])


register(Example("powersgd", PowerSGD, {"matrix_rank": 1, "start_step": 1, "min_compression_rate": 0.0},
                 mismatch={"matrix_rank": 2, "start_step": 1, "min_compression_rate": 0.0}))
