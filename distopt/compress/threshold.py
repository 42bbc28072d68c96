"""Threshold sparsification: keep every gradient entry whose magnitude reaches a threshold.

Fixed-threshold sparsification as in Strom, "Scalable distributed DNN training using commodity GPU cloud computing"
(Interspeech 2015); the same scan is the candidate pass of :func:`distopt.compress.topk_indices`.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from ._xp import index_dtype, is_cupy

# The NumPy scan works in blocks of _CHUNK elements (|x| and the mask of a block stay in cache), split into up to one
# contiguous range per CPU this process may run on (an MPI rank bound to one core scans in its own thread only), each
# at least _MIN_RANGE long. NumPy releases the GIL inside the ufuncs, so the ranges run in parallel.
_CHUNK = 1 << 17
_MIN_RANGE = 1 << 22


def threshold_indices(x: Any, thr: float) -> Any:
    """Positions of the entries of ``x`` with ``|x[i]| >= thr``, ascending.

    ``thr`` is compared exactly: it is rounded up to the next value of ``x.dtype``, so a float16 array with
    ``thr=1e-8`` does not select its zeros. ``thr=0`` selects every entry except NaNs; NaN entries are never selected.

    Args:
        x: 1-D floating-point array (NumPy or CuPy) of ``n`` elements.
        thr: Magnitude threshold, ``>= 0``, in the units of ``x``.

    Returns:
        Ascending element positions, int32 if ``n < 2**31`` else int64, on the same device as ``x``.

    Raises:
        ValueError: If ``x`` is not 1-D or ``thr`` is negative or NaN.
    """
    if x.ndim != 1:
        raise ValueError(f"threshold_indices needs a 1-D array, got shape {x.shape}")
    if not thr >= 0:
        raise ValueError(f"threshold must be >= 0, got {thr}")
    t = _ceil_to_dtype(thr, x.dtype)
    if is_cupy(x):
        import cupy

        return cupy.flatnonzero(cupy.abs(x) >= t).astype(index_dtype(x.size))
    return scan(x, t)[0].astype(index_dtype(x.size), copy=False)


def scan(x: np.ndarray, t: Any) -> tuple[np.ndarray, np.ndarray]:
    """Ascending int64 positions ``i`` of ``x`` (NumPy, 1-D) with ``|x[i]| >= t``, and those ``|x[i]|``.

    ``t`` is a scalar of ``x.dtype``. One read of ``x`` from memory: ``|x|`` and the mask never exist at full size.
    """
    n = x.size
    ranges = max(1, min(_cpus(), n // _MIN_RANGE))
    bounds = [n * i // ranges for i in range(ranges + 1)]
    found: list[tuple[np.ndarray, np.ndarray]] = [None] * ranges  # type: ignore[list-item]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            found[i] = _scan_range(x, t, bounds[i], bounds[i + 1])
        except BaseException as e:  # re-raised in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, ranges)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    if ranges == 1:
        return found[0]
    return np.concatenate([f[0] for f in found]), np.concatenate([f[1] for f in found])


def _scan_range(x: np.ndarray, t: Any, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`scan` of ``x[lo:hi]``, as positions in ``x``."""
    mag = np.empty(min(hi - lo, _CHUNK), dtype=x.dtype)
    mask = np.empty(mag.size, dtype=bool)
    positions = [np.empty(0, dtype=np.int64)]
    magnitudes = [np.empty(0, dtype=x.dtype)]
    for start in range(lo, hi, _CHUNK):
        size = min(_CHUNK, hi - start)
        np.abs(x[start : start + size], out=mag[:size])
        np.greater_equal(mag[:size], t, out=mask[:size])
        hits = np.flatnonzero(mask[:size])
        if hits.size:
            magnitudes.append(mag[hits])
            hits += start
            positions.append(hits)
    return np.concatenate(positions), np.concatenate(magnitudes)


def _cpus() -> int:
    """Number of CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _ceil_to_dtype(thr: float, dtype: Any) -> Any:
    """The smallest value of ``dtype`` that is ``>= thr`` (``inf`` past the largest finite one)."""
    with np.errstate(over="ignore"):
        t = np.asarray(thr, dtype=dtype)[()]
    if float(t) < thr:
        t = np.nextafter(t, np.asarray(np.inf, dtype=dtype)[()])
    return t
