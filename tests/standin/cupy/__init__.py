"""A CPU stand-in for the part of CuPy that distopt uses (tests and ``distopt.gpucheck --standin`` only).

Not CuPy: NumPy arrays behind CuPy's names and signatures, read from CuPy's
own source, with what a GPU makes observable kept observable:

* device arrays refuse implicit conversion to NumPy and mixing with it;
* memory is addressed by integer pointers on a device, and each host thread
  has a current device (:mod:`cupy.cuda.memory`, :mod:`cupy.cuda.streams`);
* streams defer the work queued on them until something orders it, so a
  missing event wait reads stale memory (:mod:`cupy.cuda.streams`);
* ``ufunc.at`` adds in a random order, as atomics do;
* host synchronisations, events and CUDA initialisations are counted
  (:data:`cupy._state.counters`);
* ``cupy.cuda.nccl`` is NCCL's API over loopback sockets, with its single-use
  unique id, its "Duplicate GPU" check, group calls and asynchronous errors
  (:mod:`cupy.cuda.nccl`).

Put ``tests/standin`` first on ``sys.path`` (``PYTHONPATH``) to use it.
"""
from __future__ import annotations

import numpy as _np

from . import _state
from ._core import ndarray
from ._functions import linalg, namespace as _namespace, random, ufunc
from . import cuda
from . import _standin

__version__ = "14.0.0" if _state.config.version >= 14 else "13.6.0"
STANDIN = True

globals().update(_namespace)

for _name in ("float16 float32 float64 int8 int16 int32 int64 uint8 uint16 uint32 uint64 bool_ complex64 "
              "complex128 intp dtype finfo iinfo result_type can_cast promote_types newaxis inf nan pi e "
              "isscalar ndim shape size").split():
    globals()[_name] = getattr(_np, _name)

del _name, _np
