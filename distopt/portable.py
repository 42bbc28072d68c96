"""Arrays as tensors, so that checkpoints load with ``torch.load(weights_only=True)``.

PyTorch's safe loader accepts tensors, numbers, strings and plain
containers, not NumPy or CuPy arrays. :func:`to_portable` replaces every
NumPy/CuPy array in a nested state by ``{"__array__": tensor}`` (a CPU
tensor for NumPy, a CUDA tensor for CuPy; bfloat16 NumPy arrays travel as
int16 with ``"dtype": "bfloat16"``); :func:`from_portable` turns them back
into NumPy arrays (a tensor on the CPU) or CuPy arrays (on a GPU), so a
``map_location`` chosen at load time decides the device. Tensors of the
state (a PyTorch optimizer's) are left as they are. Without PyTorch
installed the arrays stay as they are.
"""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

import numpy as np

from .core._array import is_cupy

__all__ = ["to_portable", "from_portable", "HAVE_TORCH"]

#: Whether PyTorch is installed (arrays are then stored as tensors).
HAVE_TORCH = importlib.util.find_spec("torch") is not None
_KEY = "__array__"


def to_portable(obj: Any) -> Any:
    """A copy of ``obj`` with every array as ``{"__array__": tensor}`` (nested dicts, lists, tuples).

    The arrays' data is copied, so later updates do not change the result.
    """
    if isinstance(obj, dict):
        return {k: to_portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_portable(v) for v in obj)
    if isinstance(obj, np.ndarray) or is_cupy(obj):
        if not HAVE_TORCH:
            return obj.copy()
        import torch

        if is_cupy(obj):
            return {_KEY: torch.from_dlpack(obj.copy())}
        if str(obj.dtype) == "bfloat16":
            return {_KEY: torch.from_numpy(np.ascontiguousarray(obj).view(np.int16).copy()), "dtype": "bfloat16"}
        return {_KEY: torch.from_numpy(np.array(obj, copy=True))}
    return obj


def from_portable(obj: Any) -> Any:
    """Undo :func:`to_portable`: NumPy arrays for CPU tensors, CuPy arrays for CUDA ones."""
    if isinstance(obj, dict):
        if _KEY in obj:
            return _array(obj[_KEY], obj.get("dtype"))
        return {k: from_portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_portable(v) for v in obj)
    return obj


def _array(tensor: Any, dtype: str | None) -> Any:
    if isinstance(tensor, np.ndarray) or "torch" not in sys.modules:  # written without PyTorch
        return np.array(tensor, copy=True)
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor.detach().clone())
    out = tensor.detach().cpu().numpy().copy()
    if dtype == "bfloat16":
        import ml_dtypes

        out = out.view(ml_dtypes.bfloat16)
    return out
