"""Array-module dispatch shared by the compression kernels (see :mod:`distopt.core._array`).

CuPy is imported only when a CuPy array is passed in, so ``import distopt.compress`` works on machines without CuPy.
"""
from __future__ import annotations

import numpy as np

from ..core._array import is_cupy
from ..core._array import xp_of as xp

__all__ = ["is_cupy", "xp", "index_dtype"]


def index_dtype(n: int) -> np.dtype:
    """Index dtype for positions in an array of ``n`` elements: int32 if ``n < 2**31``, else int64."""
    return np.dtype(np.int32 if n < 2**31 else np.int64)
