"""The torch backend's view of a caller's array: a flat tensor sharing its memory, how torch.distributed moves and
reduces its dtype, and the way back.

NumPy arrays become CPU tensors that share their memory (``torch.from_numpy``, no copy; bfloat16 from ``ml_dtypes``
through a 16-bit view), CuPy arrays CUDA tensors through DLPack, torch tensors stay as they are; results go back to the
caller's array type. gloo reduces the dtypes of :data:`REDUCIBLE` (bool: MAX for logical OR, MIN for AND: ``"min"``,
``"product"``; ``"avg"`` is a sum the backend then divides) and moves any other dtype as its bytes (:func:`movable`).
"""
from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["FlatTensor", "descriptor_code", "REDUCIBLE", "torch_op", "movable"]

#: The dtypes gloo reduces.
REDUCIBLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                       torch.int32, torch.int64, torch.bool})
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}
_BOOL_OPS = {"sum": dist.ReduceOp.MAX, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.MIN}


try:
    import ml_dtypes
    _NP_BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    _NP_BF16 = None


class FlatTensor:
    """A caller's array as a flat tensor sharing its memory, and the way back to the caller's type."""

    def __init__(self, array: Any) -> None:
        self.array = array
        if isinstance(array, torch.Tensor):
            self.kind, self.flat = "torch", array.reshape(-1)
        elif isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                raise TypeError("array must be C-contiguous; pass np.ascontiguousarray(array)")
            self.kind = "numpy"
            if _NP_BF16 is not None and array.dtype == _NP_BF16:
                self.flat = torch.from_numpy(array.reshape(-1).view(np.uint16)).view(torch.bfloat16)
            else:
                try:
                    self.flat = torch.from_numpy(array.reshape(-1))
                except TypeError as exc:
                    raise TypeError(f"dtype {array.dtype} is not supported by the torch backend") from exc
        elif hasattr(array, "__dlpack__"):
            self.kind, self.flat = "dlpack", torch.from_dlpack(array).reshape(-1)
        else:
            raise TypeError(f"the torch backend takes NumPy or CuPy arrays or torch tensors, "
                            f"got {type(array).__name__}")

    def new(self, *shape: int) -> torch.Tensor:
        """An empty tensor of ``shape`` (elements) with this one's dtype and device."""
        return torch.empty(shape, dtype=self.flat.dtype, device=self.flat.device)

    def back(self, tensor: torch.Tensor) -> Any:
        """``tensor`` as the caller's array type (NumPy: shares memory; CuPy: through DLPack)."""
        if self.kind == "torch":
            return tensor
        if self.kind == "numpy":
            if tensor.dtype == torch.bfloat16:
                return tensor.view(torch.uint16).numpy().view(_NP_BF16)
            return tensor.numpy()
        import cupy  # a DLPack array that is not a tensor: CuPy's, on the GPU

        return cupy.from_dlpack(tensor)


def descriptor_code(t: FlatTensor, extra: int) -> int:
    """Descriptor code of the tensor's dtype and ``extra`` (op or root), the same on every rank."""
    return zlib.crc32(str(t.flat.dtype).encode()) * (1 << 24) + extra


def torch_op(dtype: torch.dtype, op: str) -> Any:
    """The ``ReduceOp`` of ``op`` (of :data:`~distopt.comm.base.REDUCE_OPS`) on ``dtype`` (bool: MAX for OR, MIN for
    AND).

    Raises:
        TypeError: gloo cannot reduce ``dtype``.
    """
    if dtype not in REDUCIBLE:
        raise TypeError(f"dtype {dtype} cannot be reduced by the torch backend (gloo); use one of "
                        + ", ".join(sorted(str(d).replace("torch.", "") for d in REDUCIBLE)))
    return _BOOL_OPS[op] if dtype == torch.bool else _OPS[op]


def movable(flat: torch.Tensor) -> torch.Tensor:
    """A dtype gloo can move: the tensor itself, or its bytes."""
    return flat if flat.dtype in REDUCIBLE else flat.view(torch.uint8)
