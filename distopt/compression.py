"""Tensor compressors in Horovod's form (``hvd.Compression.none`` and ``hvd.Compression.fp16``), and the strategy each
stands for in ``DistOpt(..., compression=...)``.

Source: ``horovod/torch/compression.py``. A compressor's ``compress(tensor)`` returns ``(compressed, ctx)`` and
``decompress(compressed, ctx)`` the tensor again: :class:`Compression.fp16` casts floating-point tensors (torch tensors,
NumPy or CuPy arrays) to float16 and back to their own dtype; other dtypes pass through unchanged, as Horovod's.

In ``DistOpt`` gradients are compressed by the strategy (:mod:`distopt.strategies`), which does the whole bucket:
``compression=Compression.fp16`` is ``strategy=Half()`` (float16 on the wire, ``docs/strategies.md``: it divides by
the world size BEFORE the cast, against overflow, where Horovod divides after the float16 sum; ``Half(predivide=1.0)``
divides after), ``Compression.none`` (or None) keeps ``strategy`` (default ``Dense()``). A compressor of one's own has
no such mapping: write a strategy (:class:`~distopt.strategies.base.GradientStrategy`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from .strategies import Dense, Half, Strategy
from .strategies.registry import strategy_error

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression", "strategy_for"]


class Compressor(ABC):
    """Interface of a tensor compressor (Horovod's): static ``compress`` and ``decompress``."""

    @staticmethod
    @abstractmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """``(compressed tensor, context needed to decompress it)``."""

    @staticmethod
    @abstractmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The tensor ``compress`` was given, from its output ``(tensor, ctx)``."""


class NoneCompressor(Compressor):
    """No compression (Horovod's default): ``compress`` returns ``(tensor, None)``, ``decompress`` the tensor itself."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:  # noqa: ARG004
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors as float16 (2 bytes per element); other dtypes unchanged.

    ``compress``: a torch tensor, NumPy or CuPy array of a floating-point dtype is cast to float16 (a new tensor, round
    to nearest; beyond 65504 in magnitude: inf); ``ctx`` is the original dtype. ``decompress`` casts back to ``ctx``
    (a float16 input comes back as the same object). Integer, bool and complex tensors pass through both unchanged.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        dtype = tensor.dtype
        return (_cast(tensor, "float16") if _floating(dtype) else tensor), dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return _cast(tensor, ctx) if _floating(ctx) else tensor


class Compression:
    """Horovod's ``Compression``: ``Compression.none`` and ``Compression.fp16`` (the compressor classes; their static
    methods are called on the class), also accepted as ``DistOpt(..., compression=...)`` (module docs)."""

    none = NoneCompressor
    fp16 = FP16Compressor


def strategy_for(strategy: Strategy | None, compression: Any = None) -> Strategy:
    """The strategy of ``DistOpt(..., strategy=strategy, compression=compression)``: ``strategy`` (default
    ``Dense()``) with no compression or ``Compression.none``; ``Half()`` for ``Compression.fp16``.

    Raises:
        TypeError: ``strategy`` is not a :class:`~distopt.strategies.Strategy`, or ``compression`` is not one of
            :class:`Compression`'s compressors (class or instance).
        ValueError: ``Compression.fp16`` together with a ``strategy``.
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        raise strategy_error(strategy)
    kind = compression if isinstance(compression, type) else type(compression)
    if compression is None or kind is NoneCompressor:
        return Dense() if strategy is None else strategy
    if kind is not FP16Compressor:
        raise TypeError(f"compression must be distopt.Compression.none or distopt.Compression.fp16, got "
                        f"{getattr(kind, '__name__', kind)}: a compressor of one's own maps to no strategy (write a "
                        "GradientStrategy, docs/strategies.md)")
    if strategy is not None:
        raise ValueError(f"compression=Compression.fp16 is strategy=Half(); got strategy={type(strategy).__name__}() "
                         "too: pass one of them (Half(predivide=..., clip=...) for Half's own settings)")
    return Half(wire="float16")


def _floating(dtype: Any) -> bool:
    """A floating-point dtype (torch or NumPy; complex is not)."""
    is_float = getattr(dtype, "is_floating_point", None)
    if isinstance(is_float, bool):
        return is_float
    try:
        return np.dtype(dtype).kind == "f"
    except TypeError:
        return False


def _cast(tensor: Any, dtype: Any) -> Any:
    """``tensor`` as ``dtype`` (``"float16"`` or a dtype of its own library); a new tensor unless it has it."""
    if type(tensor).__module__.startswith("torch"):
        import torch

        return tensor.to(torch.float16 if dtype == "float16" else dtype)
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch's cast (documented)
        return tensor.astype(dtype, copy=False)
