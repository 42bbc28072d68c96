"""The stand-in's ``cupy.*`` functions and ufuncs: NumPy's, on device arrays only, on the current stream.

Only names CuPy has are offered. ``ufunc.at`` adds in a shuffled order, as
CuPy's atomic scatter-add does (``cupy/_core/_kernel.pyx``: ``ufunc.at``), so
code that needs the same bits on every rank cannot rely on it. ``sort`` and
``argsort`` are stable, as CuPy's (CUB radix sort).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import _core, _state
from .cuda import streams

_RNG = np.random.default_rng()


def _fn(np_func: Callable[..., Any], sync: str | None = None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        streams.run_current()
        out = kwargs.get("out")
        got = np_func(*_core.unwrap(args), **{k: _core.unwrap(v) for k, v in kwargs.items()})
        if sync:
            _core.host_sync(sync)
        return out if out is not None else _core.wrap(got)

    call.__name__ = np_func.__name__
    return call


class ufunc:
    """A CuPy ufunc: call, ``at`` (unordered, see the module docs), ``reduce``, ``accumulate``,
    ``reduceat``, ``outer``."""

    def __init__(self, np_ufunc: np.ufunc) -> None:
        self._u = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _fn(self._u)(*args, **kwargs)

    def at(self, a: Any, indices: Any, b: Any = None) -> None:
        streams.run_current()
        if not isinstance(a, _core.ndarray):
            raise TypeError(f"Unsupported type {type(a)}")
        idx = np.asarray(_core.unwrap(indices)).reshape(-1)
        order = _RNG.permutation(idx.size)  # atomics: any order
        if b is None:
            self._u.at(a._a, idx[order])
            return
        vals = np.broadcast_to(_core.unwrap(b), idx.shape)
        self._u.at(a._a, idx[order], vals[order])

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return _fn(self._u.reduce)(*args, **kwargs)

    def accumulate(self, *args: Any, **kwargs: Any) -> Any:
        return _fn(self._u.accumulate)(*args, **kwargs)

    def reduceat(self, *args: Any, **kwargs: Any) -> Any:
        return _fn(self._u.reduceat)(*args, **kwargs)

    def outer(self, *args: Any, **kwargs: Any) -> Any:
        return _fn(self._u.outer)(*args, **kwargs)


_UFUNCS = ("abs absolute add subtract multiply divide true_divide floor_divide negative positive sqrt square "
           "exp log log2 log1p expm1 sin cos tanh maximum minimum fmax fmin isfinite isnan isinf sign power "
           "remainder mod fmod greater greater_equal less less_equal equal not_equal logical_and logical_or "
           "logical_not logical_xor bitwise_and bitwise_or bitwise_xor invert floor ceil rint trunc reciprocal "
           "copysign signbit clip conj conjugate").split()
_FUNCS = ("where concatenate stack hstack vstack partition argpartition cumsum cumprod sum prod max min amax "
          "amin mean var std dot matmul vdot inner outer einsum reshape ravel searchsorted bincount diff repeat "
          "tile take put broadcast_to array_equal allclose isclose all any squeeze expand_dims transpose swapaxes "
          "nan_to_num atleast_1d atleast_2d count_nonzero argmax argmin split array_split copyto around round "
          "triu tril eye identity trace diag flip roll moveaxis").split()
_CREATE = "empty zeros ones full empty_like zeros_like ones_like full_like arange linspace".split()
_SYNCING = {"flatnonzero": "flatnonzero", "nonzero": "nonzero", "argwhere": "argwhere", "unique": "unique"}

namespace: dict[str, Any] = {}
for _name in _UFUNCS:
    namespace[_name] = ufunc(getattr(np, _name)) if isinstance(getattr(np, _name), np.ufunc) else _fn(
        getattr(np, _name))
for _name in _FUNCS:
    namespace[_name] = _fn(getattr(np, _name))
for _name, _what in _SYNCING.items():
    namespace[_name] = _fn(getattr(np, _name), sync=_what)


def _creator(np_func: Callable[..., Any]) -> Callable[..., Any]:
    def create(*args: Any, **kwargs: Any) -> Any:
        streams._check_device(_core._device())
        return _fn(np_func)(*args, **kwargs)

    create.__name__ = np_func.__name__
    return create


for _name in _CREATE:
    namespace[_name] = _creator(getattr(np, _name))


def sort(a: Any, axis: int = -1, kind: Any = None) -> Any:
    return _fn(np.sort)(a, axis=axis, kind="stable")


def argsort(a: Any, axis: int = -1, kind: Any = None) -> Any:
    return _fn(np.argsort)(a, axis=axis, kind="stable")


def _check_dtype(a: np.ndarray) -> np.ndarray:
    if a.dtype.name == "bfloat16" and _state.config.version < 14:
        raise ValueError("Unsupported dtype bfloat16")  # CuPy 14 added minimal bfloat16 (ml_dtypes)
    return a


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", subok: bool = False,
          ndmin: int = 0) -> Any:
    """A new device array; a host array or list is copied to the device (an upload, no sync)."""
    streams.run_current()
    streams._check_device(_core._device())
    if isinstance(obj, _core.ndarray):
        return _core.wrap(np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin), obj._dev)
    return _core.wrap(_check_dtype(np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin)))


def asarray(a: Any, dtype: Any = None, order: Any = None) -> Any:
    if isinstance(a, _core.ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype=dtype, copy=False if isinstance(a, _core.ndarray) else True, order=order or "K")


def ascontiguousarray(a: Any, dtype: Any = None) -> Any:
    if isinstance(a, _core.ndarray) and a._a.flags.c_contiguous and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    return array(a, dtype=dtype, order="C")


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
    if isinstance(a, _core.ndarray):
        return a.get(out=out, order=order)
    return np.asarray(a, order=order)


def get_array_module(*args: Any) -> Any:
    import cupy

    return cupy if any(isinstance(a, _core.ndarray) for a in args) else np


def from_dlpack(obj: Any) -> Any:
    """Only device memory can be viewed: a CPU tensor is refused (the stand-in has no CUDA tensors)."""
    device = getattr(obj, "__dlpack_device__", lambda: (1, 0))()
    if device[0] != 2:
        raise TypeError(f"CuPy can only import device memory through DLPack, got device type {device[0]}")
    raise NotImplementedError("the stand-in has no CUDA tensors to import")


namespace.update(sort=sort, argsort=argsort, array=array, asarray=asarray, asanyarray=asarray,
                 ascontiguousarray=ascontiguousarray, asnumpy=asnumpy, get_array_module=get_array_module,
                 from_dlpack=from_dlpack)


class _Namespace:
    def __init__(self, module: Any, names: str) -> None:
        for name in names.split():
            setattr(self, name, _fn(getattr(module, name)))


linalg = _Namespace(np.linalg, "norm qr svd inv solve cholesky eigh det")


class _Generator:
    """``cupy.random.default_rng(seed)``'s generator: draws made on the host with NumPy's, then copied."""

    def __init__(self, seed: Any = None) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> Any:
        return array(self._rng.standard_normal(size, dtype=dtype))

    def random(self, size: Any = None, dtype: Any = np.float64) -> Any:
        return array(self._rng.random(size, dtype=dtype))

    def integers(self, low: int, high: Any = None, size: Any = None, dtype: Any = np.int64) -> Any:
        return array(self._rng.integers(low, high, size, dtype=dtype))


class _Random:
    def default_rng(self, seed: Any = None) -> _Generator:
        return _Generator(seed)

    def seed(self, seed: Any = None) -> None:
        global _RNG_DATA
        _RNG_DATA = np.random.default_rng(seed)

    def rand(self, *shape: int, dtype: Any = float) -> Any:
        return array(_RNG_DATA.random(shape).astype(dtype))

    def randn(self, *shape: int, dtype: Any = float) -> Any:
        return array(_RNG_DATA.standard_normal(shape).astype(dtype))

    def standard_normal(self, size: Any = None, dtype: Any = float) -> Any:
        return array(_RNG_DATA.standard_normal(size).astype(dtype))


_RNG_DATA = np.random.default_rng(0)
random = _Random()
