"""``cupy.ndarray`` of the stand-in: device memory (host memory under the hood) that refuses to be NumPy.

As CuPy's, an array never converts to NumPy implicitly (``np.asarray(a)`` raises
``TypeError``; ``a.get()`` and ``cupy.asnumpy(a)`` copy), and an operation
that mixes it with a NumPy array raises ``TypeError``. Every operation runs on
the current stream after its earlier work (see :mod:`cupy.cuda.streams`).
Host synchronisations are counted (:data:`cupy._state.counters`): ``get``,
``float``/``int``/``bool``/``item``/``tolist``, and results whose size depends
on the data (boolean-mask indexing, ``flatnonzero``, ``nonzero``, ``unique``).
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import _state
from .cuda import memory, streams

__all__ = ["ndarray", "wrap", "unwrap", "host_sync"]


def host_sync(what: str) -> None:
    _state.counters.host_syncs += 1
    if len(_state.counters.sync_sites) < 1000:
        _state.counters.sync_sites.append(what)


def _device() -> int:
    return int(getattr(_state.local, "device", 0))


def wrap(value: Any, device: int | None = None) -> Any:
    """NumPy results as device arrays (scalars as 0-d arrays, as CuPy's reductions return)."""
    if isinstance(value, np.ndarray):
        return ndarray._from(value, _device() if device is None else device)
    if isinstance(value, np.generic):
        return ndarray._from(np.asarray(value), _device() if device is None else device)
    if isinstance(value, tuple):
        return tuple(wrap(v, device) for v in value)
    if isinstance(value, list):
        return [wrap(v, device) for v in value]
    return value


def unwrap(value: Any, host_ok: bool = False) -> Any:
    """Device arrays to their NumPy memory; a NumPy array is refused unless ``host_ok``."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, np.ndarray) and not host_ok:
        raise TypeError(f"Unsupported type {type(value)}")
    if isinstance(value, (list, tuple)):
        return type(value)(unwrap(v, host_ok) for v in value)
    return value


def _is_mask(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (ndarray, np.ndarray)) and k.dtype == np.bool_ for k in keys)


class ndarray:
    """``cupy.ndarray(shape, dtype=float, memptr=None, strides=None, order='C')``."""

    __slots__ = ("_a", "_dev", "__weakref__")

    def __init__(self, shape: Any, dtype: Any = float, memptr: Any = None, strides: Any = None,
                 order: str = "C") -> None:
        if memptr is None:
            streams._check_device(_device())
            self._a = np.empty(shape, dtype, order=order)
            self._dev = _device()
        else:
            buffer = memptr.mem._host if hasattr(memptr.mem, "_host") else memory.resolve(
                memptr.mem.ptr, memptr.mem.size)
            self._a = np.ndarray(shape, dtype, buffer=buffer, offset=memptr.offset, strides=strides, order=order)
            self._dev = memptr.device_id
        memory.register(self._a, self._dev)

    @classmethod
    def _from(cls, a: np.ndarray, device: int) -> "ndarray":
        out = cls.__new__(cls)
        out._a, out._dev = a, device
        memory.register(a, device)
        return out

    # -- attributes ---------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: wrap(self._a.T, self._dev))
    real = property(lambda self: wrap(self._a.real, self._dev))
    imag = property(lambda self: wrap(self._a.imag, self._dev))

    @property
    def device(self) -> Any:
        return streams.Device(self._dev)

    @property
    def data(self) -> memory.MemoryPointer:
        alloc = memory.register(self._a, self._dev)
        return memory.MemoryPointer(alloc, self._a.__array_interface__["data"][0] - alloc.ptr)

    # -- host transfers (synchronising) ------------------------------------------------------------
    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        streams.run_current()
        host_sync("get")
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order, copy=True)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        streams.run_current()
        self._a[...] = arr

    def item(self) -> Any:
        streams.run_current()
        host_sync("item")
        return self._a.item()

    def tolist(self) -> Any:
        streams.run_current()
        host_sync("tolist")
        return self._a.tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        import cupy

        mine = getattr(cupy, ufunc.__name__, None)
        if mine is None:
            return NotImplemented
        return getattr(mine, method)(*inputs, **kwargs) if method != "__call__" else mine(*inputs, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        import cupy

        mine = getattr(cupy, func.__name__, None)
        return NotImplemented if mine is None else mine(*args, **kwargs)

    # -- indexing ----------------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        streams.run_current()
        if _is_mask(key):
            host_sync("boolean mask")
        got = self._a[unwrap(key, host_ok=True)]
        return wrap(got if isinstance(got, np.ndarray) else np.asarray(got), self._dev)

    def __setitem__(self, key: Any, value: Any) -> None:
        streams.run_current()
        if _is_mask(key):
            host_sync("boolean mask")
        self._a[unwrap(key, host_ok=True)] = unwrap(value, host_ok=True)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"array({np.array2string(self._a, separator=', ')}, dtype={self._a.dtype}) (stand-in device {self._dev})"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np.ndarray, name, None)
        if attr is None or name.startswith("_"):
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")

        def method(*args: Any, **kwargs: Any) -> Any:
            streams.run_current()
            out = getattr(self._a, name)(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
            if name in ("fill", "sort", "partition", "resize"):
                return None
            return wrap(out, self._dev)

        return method

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None,
               copy: bool = True) -> "ndarray":
        streams.run_current()
        return wrap(self._a.astype(dtype, order=order, copy=copy), self._dev)

    def copy(self, order: str = "C") -> "ndarray":
        streams.run_current()
        return wrap(self._a.copy(order=order), self._dev)


def _binary(name: str, inplace: bool = False) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        streams.run_current()
        if isinstance(other, np.ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        got = getattr(self._a, name)(unwrap(other))
        if got is NotImplemented:
            return NotImplemented
        return self if inplace else wrap(got, self._dev)

    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
              "lshift", "rshift"):
    for _form, _inplace in ((f"__{_name}__", False), (f"__r{_name}__", False), (f"__i{_name}__", True)):
        if hasattr(np.ndarray, _form):
            setattr(ndarray, _form, _binary(_form, _inplace))
for _form in ("__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"):
    setattr(ndarray, _form, _binary(_form))


def _host_read(kind: type) -> Any:
    """``float(a)``, ``int(a)``, ``bool(a)``, ``complex(a)``: a copy to the host, after the stream's work."""
    def read(self: ndarray) -> Any:
        streams.run_current()
        host_sync(kind.__name__)
        return kind(self._a)

    return read


for _kind in (float, int, bool, complex):
    setattr(ndarray, f"__{_kind.__name__}__", _host_read(_kind))


def _unary(name: str) -> Any:
    def op(self: ndarray) -> Any:
        streams.run_current()
        return wrap(getattr(operator, name)(self._a), self._dev)

    return op


for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", _unary(_name))
ndarray.__hash__ = None  # type: ignore[assignment]
