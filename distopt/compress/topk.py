"""Top-k sparsification: keep the ``k`` gradient entries of largest magnitude.

Top-k selection as in Aji & Heafield, "Sparse Communication for Distributed Gradient Descent" (EMNLP 2017); large
arrays find candidates with a threshold estimated from a random sample, as in Deep Gradient Compression (Lin et al.,
ICLR 2018), then select exactly ``k`` of them.
"""
from __future__ import annotations

import functools
import math
import operator
from fractions import Fraction
from typing import Any

import numpy as np

from ._xp import index_dtype, is_cupy, xp
from .threshold import scan

# |x| of _SAMPLE_SIZE positions drawn with a fixed seed estimate the k-th largest magnitude; arrays of at most
# 2 * _SAMPLE_SIZE elements are selected exactly. 10,000 takes about half the time of 100,000 over ResNet-50's 161
# tensors at 1 % and 0.1 %, with the same selections.
_SAMPLE_SIZE = 10_000
_SEED = 0x5EED


def k_for(n: int, ratio: float) -> int:
    """Number of entries to keep out of ``n`` for a sparsification ratio.

    ``max(1, ceil(ratio * n))`` clamped to ``n``, and 0 for ``n = 0``. The product is taken on the shortest decimal
    form of ``ratio``, so ``k_for(100, 0.07)`` is 7 although ``0.07 * 100`` is ``7.000000000000001``.

    Args:
        n: Number of elements, ``>= 0``.
        ratio: Fraction of the elements to keep (``spars``), in ``(0, 1]``.

    Returns:
        ``k`` with ``0 <= k <= n`` (``k >= 1`` when ``n >= 1``).

    Raises:
        ValueError: If ``ratio`` is outside ``(0, 1]`` or ``n < 0``.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"sparsification ratio spars must be in (0, 1], got {ratio!r}")
    if n < 0:
        raise ValueError(f"element count must be >= 0, got {n}")
    return _k_for(int(n), float(ratio))


@functools.lru_cache(maxsize=4096)
def _k_for(n: int, ratio: float) -> int:
    """:func:`k_for` of checked arguments, cached: the exact product costs ~50 us, and a step asks for the same few
    ``(n, ratio)`` pairs every time."""
    if n == 0:
        return 0
    return min(n, max(1, math.ceil(Fraction(repr(ratio)) * n)))


def topk_indices(x: Any, k: int) -> Any:
    """Positions of the ``k`` entries of ``x`` with the largest magnitude ``|x|``.

    Always exactly ``k`` positions, returned in ascending order. Among equal magnitudes the lowest positions win, so
    ``|x| = [1, 1, 1, 1, 0.5]`` with ``k = 2`` gives ``[0, 1]``. NaN ranks below every number (it is chosen only when
    fewer than ``k`` entries are not NaN); ``inf`` ranks above.

    Arrays of ``n > 2 * _SAMPLE_SIZE`` elements with ``k`` below about ``n / 2``: the ``r``-th largest ``|x|`` among
    ``_SAMPLE_SIZE`` positions drawn with a fixed seed, with ``r`` five standard deviations above the expected
    ``k * _SAMPLE_SIZE / n``, is a threshold that at least ``k`` entries pass with high probability; one blocked pass
    over ``x`` collects those candidates, and an exact selection among them gives the result. When fewer than ``k``
    pass (or the sample's threshold is 0), the exact selection runs on all of ``x``, so the result never depends on the
    sample. O(n) either way. CuPy takes the same route on the device with one host synchronisation (the candidates'
    count); its exact selection is a stable sort by descending magnitude.

    Args:
        x: 1-D floating-point array (NumPy or CuPy) of ``n`` elements.
        k: Number of entries to select, ``0 <= k <= n`` (see :func:`k_for`).

    Returns:
        ``k`` ascending element positions, int32 if ``n < 2**31`` else int64, on the same device as ``x``.

    Raises:
        ValueError: If ``x`` is not 1-D or ``k`` is outside ``[0, n]``.
        TypeError: If ``k`` is not an integer.
    """
    if x.ndim != 1:
        raise ValueError(f"topk_indices needs a 1-D array, got shape {x.shape}")
    n = x.size
    k = operator.index(k)
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, {n}], got {k}")
    itype = index_dtype(n)
    if k == 0:
        return xp(x).empty(0, dtype=itype)
    mean = k * _SAMPLE_SIZE / n
    r = math.ceil(mean + 5 * math.sqrt(mean) + 4)
    if n <= 2 * _SAMPLE_SIZE or r > _SAMPLE_SIZE // 2:
        return _select(_magnitude(x), k).astype(itype, copy=False)
    if is_cupy(x):
        # the threshold stays on the device: the candidates' count is the one host synchronisation (a
        # threshold of 0 or less lets every number through, still a superset of the top k)
        sample = _magnitude(x[_device_sample_positions(n, _SAMPLE_SIZE, x.device.id)])
        t = xp(x).partition(sample, _SAMPLE_SIZE - r)[_SAMPLE_SIZE - r]
        candidates = xp(x).flatnonzero(xp(x).abs(x) >= t)  # NaN fails the comparison, as it ranks last
        if candidates.size >= k:
            return candidates[_select(xp(x).abs(x[candidates]), k)].astype(itype)
        return _select(_magnitude(x), k).astype(itype, copy=False)
    sample = _magnitude(x[_sample_positions(n, _SAMPLE_SIZE)])
    t = float(np.partition(sample, _SAMPLE_SIZE - r)[_SAMPLE_SIZE - r])
    if t > 0:
        candidates, magnitudes = scan(x, x.dtype.type(t))
        if candidates.size >= k:
            return candidates[_select(magnitudes, k)].astype(itype)
    return _select(_magnitude(x), k).astype(itype, copy=False)


@functools.lru_cache(maxsize=32)
def _sample_positions(n: int, size: int) -> np.ndarray:
    """The ``size`` positions in ``[0, n)`` drawn with the fixed seed, sorted (read-only, cached).

    Sorted, the gather reads ``x`` front to back (a partition does not care about order). Drawing them costs about as
    much as the gather, so once per tensor size; 32 sizes of 40 KiB (int32) each at most are kept.
    """
    positions = np.sort(np.random.default_rng(_SEED).integers(0, n, size)).astype(index_dtype(n))
    positions.setflags(write=False)
    return positions


@functools.lru_cache(maxsize=32)
def _device_sample_positions(n: int, size: int, device: int) -> Any:
    """:func:`_sample_positions` copied to ``device`` once (CuPy), instead of once per call."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(_sample_positions(n, size))


def _magnitude(x: Any) -> Any:
    """``|x|`` with NaN replaced by -1, so that NaN ranks below every number."""
    mod = xp(x)
    a = mod.abs(x)
    mod.copyto(a, -1, where=a != a)
    return a


def _select(a: Any, k: int) -> Any:
    """Ascending positions of the ``k >= 1`` largest entries of ``a`` (no NaN), lowest first among ties.

    The k-th largest value ``v`` comes from a partition; every entry above ``v`` is kept, and of the entries equal to
    ``v`` the first ones, up to ``k`` in all.
    """
    mod = xp(a)
    if mod is not np:  # no host synchronisation: the first k of a stable sort by descending value
        return mod.sort(mod.argsort(-a, kind="stable")[:k])
    v = mod.partition(a, a.size - k)[a.size - k]
    keep = a > v
    need = k - int(mod.count_nonzero(keep))
    keep[mod.flatnonzero(a == v)[:need]] = True
    return mod.flatnonzero(keep)
