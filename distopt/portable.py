"""Arrays as tensors, so that checkpoints load with ``torch.load(weights_only=True)``.

PyTorch's safe loader accepts tensors, numbers, strings and plain containers, not NumPy or CuPy arrays or scalars.
:func:`to_portable` replaces every NumPy/CuPy array in a nested state by ``{"__array__": tensor}`` (a CPU tensor for
NumPy, a CUDA tensor for CuPy; bfloat16 NumPy arrays travel as int16 with ``"dtype": "bfloat16"``) and every NumPy
scalar (``np.float64(0.91)``, ``np.int64(3)``) by ``{"__scalar__": python_number, "dtype": name}``;
:func:`from_portable` turns them back into NumPy arrays (a tensor on the CPU) or CuPy arrays (on a GPU), so a
``map_location`` chosen at load time decides the device, and into NumPy scalars of the same dtype. Tensors of the state
(a PyTorch optimizer's) are left as they are. Without PyTorch installed the arrays stay as they are. Anything else the
safe loaders would refuse (an object of another class, a named tuple, a NumPy ``datetime64``) is refused by
:func:`to_portable`, naming where it is."""
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
_SCALAR = "__scalar__"
#: Leaves that ``torch.load(weights_only=True)`` and the NumPy-only unpickler both read back.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)


def to_portable(obj: Any, where: str = "state") -> Any:
    """A copy of ``obj`` with every array and NumPy scalar in a form the safe loaders read back.

    Dicts (of any dict class) become plain dicts; lists, tuples and sets of plain values keep their type. The arrays'
    data is copied, so later updates do not change the result.

    Args:
        obj: nested dicts, lists and tuples of tensors, arrays, NumPy scalars, numbers, strings, bytes and None.
        where: how to name ``obj`` in an error (a key path is appended).

    Raises:
        TypeError: a value or dict key of another type, naming its key path and its type (nothing is written, so
            nothing is left that cannot be read back).
    """
    if isinstance(obj, dict):
        for k in obj:
            if type(k) not in _PLAIN:
                raise TypeError(f"{where} has a key {k!r} of type {_name(k)}; a checkpoint's keys must be "
                                "str, int, float, bool, bytes or None")
        return {k: to_portable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(to_portable(v, f"{where}[{i}]") for i, v in enumerate(obj))
    if type(obj) in _PLAIN or _is_torch_value(obj) or (type(obj) is set and all(type(v) in _PLAIN for v in obj)):
        return obj
    if isinstance(obj, np.generic):
        value = obj.item()
        if type(value) in _PLAIN and obj.dtype.kind not in "mM":  # datetime64 as an int loses its unit
            return {_SCALAR: value, "dtype": str(obj.dtype)}
    elif isinstance(obj, np.ndarray) or is_cupy(obj):
        try:
            return _tensor(obj)
        except TypeError as exc:
            raise TypeError(f"{where} is an array of dtype {obj.dtype}, which cannot be stored as a tensor "
                            f"({exc}); convert it to a numeric or bool dtype, or to a list") from exc
    raise TypeError(f"{where} is of type {_name(obj)}, which torch.load(weights_only=True) cannot read back; store "
                    "tensors, arrays, numbers, strings or dicts, lists and tuples of them")


def _name(obj: Any) -> str:
    cls = type(obj)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _is_torch_value(obj: Any) -> bool:
    if "torch" not in sys.modules:
        return False
    import torch

    return isinstance(obj, (torch.Tensor, torch.dtype, torch.Size, torch.device))


def _tensor(array: Any) -> Any:
    """``{"__array__": ...}`` holding a copy of a NumPy/CuPy array (the array itself without PyTorch)."""
    if not HAVE_TORCH:
        return {_KEY: array.copy()}
    import torch

    if is_cupy(array):
        return {_KEY: torch.from_dlpack(array.copy())}
    if str(array.dtype) == "bfloat16":
        return {_KEY: torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy()), "dtype": "bfloat16"}
    return {_KEY: torch.from_numpy(np.array(array, copy=True))}


def from_portable(obj: Any) -> Any:
    """Undo :func:`to_portable`: NumPy arrays for CPU tensors, CuPy arrays for CUDA ones, NumPy scalars."""
    if isinstance(obj, dict):
        if _KEY in obj:
            return _array(obj[_KEY], obj.get("dtype"))
        if _SCALAR in obj:
            return _dtype(obj["dtype"]).type(obj[_SCALAR])
        return {k: from_portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_portable(v) for v in obj)
    return obj


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _array(tensor: Any, dtype: str | None) -> Any:
    if isinstance(tensor, np.ndarray) or "torch" not in sys.modules:  # written without PyTorch
        return np.array(tensor, copy=True)
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor.detach().clone())
    out = tensor.detach().cpu().numpy().copy()
    if dtype == "bfloat16":
        out = out.view(_dtype(dtype))
    return out
