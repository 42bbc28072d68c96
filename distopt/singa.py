"""SINGA's per-call strategy arguments, turned into strategy objects.

``backward_and_update_half``, ``backward_and_partial_update`` and ``backward_and_sparse_update`` (and their ``step_*``
twins for array models) keep SINGA's names and arguments, camelCase included (``clip_Value``, ``spars``, ``topK``,
``corr``). Each call builds the matching strategy here; the runner's strategy set
(:meth:`~distopt.step.strategy_set.StrategySet.per_call`) reuses the previous one of its kind from call to call, so that
residuals and cursors persist, and a call with other settings keeps the state of the previous one. :class:`SingaMethods`
gives :class:`~distopt.DistOpt` these methods."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .strategies import Half, Partial, Sparse, Strategy

__all__ = ["half", "sparse", "partial", "SingaMethods"]


def half(clipping: bool, clip_Value: float, wire: str, predivide: float | None) -> Half:
    """SINGA's ``*_half`` arguments: clip elements to ``[-clip_Value, clip_Value]`` if ``clipping``."""
    return Half(wire=wire, predivide=predivide, clip=clip_Value if clipping else None)


def sparse(spars: float, topK: bool, corr: bool) -> Sparse:
    """SINGA's ``*_sparse_*`` arguments: density ``spars``, top-K if ``topK`` (else ``|g| >= spars``), error feedback
    if ``corr``."""
    return Sparse(density=spars, select="topk" if topK else "threshold", error_feedback=corr)


def partial(average_momentum: bool) -> Partial:
    """SINGA's ``*_partial_*`` arguments: chunks cut by the step's threshold."""
    return Partial(None, average_momentum)


class SingaMethods:
    """SINGA's per-call methods of :class:`~distopt.DistOpt` (its step runner ``_runner`` and ``_backward``)."""

    _runner: Any
    _backward: Callable[[Strategy, Any, int | None], None]

    def step_half(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                  clipping: bool = False, clip_Value: float = 100.0, *, wire: str = "float16",
                  predivide: float | None = None) -> None:
        """Like :meth:`step`, with gradients as 16-bit floats (:class:`~distopt.strategies.Half`): ``wire``
        ``"float16"`` or ``"bfloat16"``; ``clipping`` clips elements to ``[-clip_Value, clip_Value]``."""
        self._runner.run(self._runner.strategies.per_call(half(clipping, clip_Value, wire, predivide)), params,
                         grads, threshold)

    def step_sparse(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                    spars: float = 0.05, topK: bool = False, corr: bool = True) -> None:
        """Like :meth:`step`, each bucket sparsified (:class:`~distopt.strategies.Sparse`; ValueError on every
        rank for ``spars`` out of range)."""
        self._runner.run(self._runner.strategies.per_call(sparse(spars, topK, corr)), params, grads, threshold)

    def step_partial(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                     average_momentum: bool = False) -> None:
        """Local update, then average one chunk of ``threshold`` elements (:class:`~distopt.strategies.Partial`)."""
        self._runner.run(self._runner.strategies.per_call(partial(average_momentum)), params, grads, threshold)

    def backward_and_update_half(self, loss: Any, threshold: int | None = None, clipping: bool = False,
                                 clip_Value: float = 100.0, *, wire: str = "float16",
                                 predivide: float | None = None) -> None:
        """Backward pass, then :meth:`step_half` (overlapped as ``backward_and_update``)."""
        self._backward(self._runner.strategies.per_call(half(clipping, clip_Value, wire, predivide)), loss, threshold)

    def backward_and_partial_update(self, loss: Any, threshold: int | None = None,
                                    average_momentum: bool = False) -> None:
        """Backward pass, then :meth:`step_partial`."""
        self._backward(self._runner.strategies.per_call(partial(average_momentum)), loss, threshold)

    def backward_and_sparse_update(self, loss: Any, threshold: int | None = None, spars: float = 0.05,
                                   topK: bool = False, corr: bool = True) -> None:
        """Backward pass, then :meth:`step_sparse`."""
        self._backward(self._runner.strategies.per_call(sparse(spars, topK, corr)), loss, threshold)
