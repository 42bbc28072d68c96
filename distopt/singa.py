"""SINGA's per-call strategy arguments, turned into strategy objects.

``backward_and_update_half``, ``backward_and_partial_update`` and
``backward_and_sparse_update`` (and their ``step_*`` twins for array
models) keep SINGA's names and arguments, camelCase included
(``clip_Value``, ``spars``, ``topK``, ``corr``). Each call builds the
matching strategy here; the runner's strategy set
(:meth:`~distopt.step.strategy_set.StrategySet.per_call`) reuses the
previous one of its kind from call to call, so that residuals and cursors
persist, and a call with other settings keeps the state of the previous one.
"""
from __future__ import annotations

from .strategies import Half, Partial, Sparse

__all__ = ["half", "sparse", "partial"]


def half(clipping: bool, clip_Value: float, wire: str, predivide: float | None) -> Half:
    """SINGA's ``*_half`` arguments: clip elements to ``[-clip_Value, clip_Value]`` if ``clipping``."""
    return Half(wire=wire, predivide=predivide, clip=clip_Value if clipping else None)


def sparse(spars: float, topK: bool, corr: bool) -> Sparse:
    """SINGA's ``*_sparse_*`` arguments: density ``spars``, top-K if ``topK`` (else ``|g| >= spars``),
    error feedback if ``corr``."""
    return Sparse(density=spars, select="topk" if topK else "threshold", error_feedback=corr)


def partial(average_momentum: bool) -> Partial:
    """SINGA's ``*_partial_*`` arguments: chunks cut by the step's threshold."""
    return Partial(None, average_momentum)
