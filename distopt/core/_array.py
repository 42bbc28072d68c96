"""NumPy/CuPy dispatch: which array module an array belongs to; the finiteness test over many arrays."""
from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["xp_of", "is_cupy", "cupy_major", "any_not_finite", "all_zero"]


def is_cupy(array: Any) -> bool:
    """True for a CuPy array (checked without importing CuPy)."""
    return type(array).__module__.startswith("cupy")


def xp_of(array: Any) -> ModuleType:
    """The array module of ``array``: ``cupy`` for CuPy arrays, else ``numpy``."""
    if type(array) is not np.ndarray and is_cupy(array):
        import cupy

        return cupy
    return np


def cupy_major(cupy: ModuleType) -> int:
    """CuPy's major version (14 and later hold ml_dtypes' bfloat16 arrays)."""
    return int(cupy.__version__.split(".")[0])


def any_not_finite(arrays: Iterable[Any]) -> bool:
    """Whether some element of some array (NumPy or CuPy, floating point) is a NaN or an inf. A NumPy array costs one
    sum (in float32 at least) while it is finite, and the elementwise test only when the sum is not (a NaN, an inf, or a
    finite overflow); the first bad one ends the test. CuPy arrays are tested on the device, one flag each, and the
    flags are read with ONE host synchronisation for all of them."""
    device = []
    for array in arrays:
        if not array.size:
            continue
        if is_cupy(array):
            device.append(array)
        elif not _host_finite(array):
            return True
    if not device:
        return False
    mod = xp_of(device[0])
    return not bool(mod.stack([mod.isfinite(a).all() for a in device]).all())


def _host_finite(array: np.ndarray) -> bool:
    with np.errstate(over="ignore", invalid="ignore"):  # an inf or NaN sum is the answer, not a warning
        total = array.sum(dtype=np.float32 if array.dtype.itemsize < 4 else array.dtype)
    if np.isfinite(float(total)):
        return True
    return bool(np.isfinite(array).all())


def all_zero(array: Any) -> bool:
    """True when every element of a host array is zero (or it has none), read in growing slices from its start."""
    flat = array.reshape(-1)
    if flat.size and flat[0] != 0:
        return False
    start, step = 0, 64
    while start < flat.size:
        if flat[start:start + step].any():
            return False
        start, step = start + step, step * 8
    return True
