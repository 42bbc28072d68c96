"""SINGA's per-call step methods, as thin shims over strategy objects.

``backward_and_update_half``, ``backward_and_partial_update`` and
``backward_and_sparse_update`` (and their ``step_*`` twins for array
models) keep SINGA's names and arguments, camelCase included. Each call
picks the matching strategy (:class:`~distopt.strategies.Half`,
:class:`~distopt.strategies.Partial`, :class:`~distopt.strategies.Sparse`),
reused from call to call so that residuals and cursors persist; a call
with other settings keeps the state of the previous one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .strategies import Half, Partial, Sparse, Strategy
from .strategy_set import StrategySet

__all__ = ["SingaMethods"]


class SingaMethods:
    """Mixin of :class:`~distopt.DistOpt`: SINGA's strategy-per-call methods."""

    _strategies: StrategySet
    if TYPE_CHECKING:  # provided by DistOpt
        def _run(self, strategy: Strategy, params: Sequence[Any], grads: Sequence[Any], threshold: int | None) -> None: ...

        def _backward_run(self, strategy: Strategy, loss: Any, threshold: int | None) -> None: ...

    def _shim(self, strategy: Strategy) -> Strategy:
        return self._strategies.per_call(strategy)

    @staticmethod
    def _half(clipping: bool, clip_Value: float, wire: str, predivide: float | None) -> Half:
        return Half(wire=wire, predivide=predivide, clip=clip_Value if clipping else None)

    def step_half(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                  clipping: bool = False, clip_Value: float = 100.0, *, wire: str = "float16",
                  predivide: float | None = None) -> None:
        """Like ``step``, but gradients travel as 16-bit floats (:class:`~distopt.strategies.Half`).

        Args:
            clipping: clip gradient elements to ``[-clip_Value, clip_Value]``
                before the cast (as the seed's DistOpt).
            wire: ``"float16"`` or ``"bfloat16"`` (NumPy: needs ml_dtypes).
            predivide: see :class:`~distopt.strategies.Half` (default: world size).
        """
        self._run(self._shim(self._half(clipping, clip_Value, wire, predivide)), params, grads, threshold)

    def step_sparse(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                    spars: float = 0.05, topK: bool = False, corr: bool = True) -> None:
        """Like ``step``, but each bucket is sparsified before the exchange (:class:`~distopt.strategies.Sparse`).

        Raises:
            ValueError: ``spars`` out of range, raised on every rank before
                any communication.
        """
        self._run(self._shim(Sparse(spars, topK, corr)), params, grads, threshold)

    def step_partial(self, params: Sequence[Any], grads: Sequence[Any], threshold: int | None = None,
                     average_momentum: bool = False) -> None:
        """Local update, then average one chunk of ``threshold`` elements (:class:`~distopt.strategies.Partial`)."""
        self._run(self._shim(Partial(None, average_momentum)), params, grads, threshold)

    def backward_and_update_half(self, loss: Any, threshold: int | None = None, clipping: bool = False,
                                 clip_Value: float = 100.0, *, wire: str = "float16",
                                 predivide: float | None = None) -> None:
        """Backward pass, then :meth:`step_half` (overlapped as ``backward_and_update``)."""
        self._backward_run(self._shim(self._half(clipping, clip_Value, wire, predivide)), loss, threshold)

    def backward_and_partial_update(self, loss: Any, threshold: int | None = None,
                                    average_momentum: bool = False) -> None:
        """Backward pass, then :meth:`step_partial`."""
        self._backward_run(self._shim(Partial(None, average_momentum)), loss, threshold)

    def backward_and_sparse_update(self, loss: Any, threshold: int | None = None, spars: float = 0.05,
                                   topK: bool = False, corr: bool = True) -> None:
        """Backward pass, then :meth:`step_sparse`."""
        self._backward_run(self._shim(Sparse(spars, topK, corr)), loss, threshold)
