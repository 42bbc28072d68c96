"""NumPy/CuPy dispatch: which array module an array belongs to."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["xp_of", "is_cupy"]


def is_cupy(array: Any) -> bool:
    """True for a CuPy array (checked without importing CuPy)."""
    return type(array).__module__.startswith("cupy")


def xp_of(array: Any) -> ModuleType:
    """The array module of ``array``: ``cupy`` for CuPy arrays, else ``numpy``."""
    if type(array) is not np.ndarray and is_cupy(array):
        import cupy

        return cupy
    return np
