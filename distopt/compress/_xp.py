"""Array-module dispatch shared by the compression kernels.

CuPy is imported only when a CuPy array is passed in, so
``import distopt.compress`` works on machines without CuPy.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (checked by its type's module, without importing CuPy)."""
    return type(x).__module__.startswith("cupy")


def xp(x: Any) -> ModuleType:
    """The array module of ``x``: ``cupy`` for CuPy arrays, else ``numpy``."""
    if is_cupy(x):
        import cupy

        return cupy
    return np


def index_dtype(n: int) -> np.dtype:
    """Index dtype for positions in an array of ``n`` elements: int32 if ``n < 2**31``, else int64."""
    return np.dtype(np.int32 if n < 2**31 else np.int64)
