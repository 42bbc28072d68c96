"""Fast casts of NumPy arrays to and from 16-bit floats, through PyTorch's kernels when installed. NumPy converts
float32 to float16 with scalar code, about 40x slower than PyTorch's vectorised kernels on a CPU; both round to nearest
even, so the results are bitwise the same (the tests compare them). Used by the half-precision wire format and by the
MPI backend's float16/bfloat16 sum. PyTorch is imported only for arrays of at least 65,536 elements or when it is
already imported."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any

import numpy as np

__all__ = ["HAVE_TORCH", "usable", "torch_view", "cast_into", "sum_rows"]

#: Whether PyTorch is installed.
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def usable(*arrays: Any) -> bool:
    """True when casts between these NumPy arrays can run through PyTorch (float16/bfloat16/float32)."""
    return HAVE_TORCH and all(
        isinstance(a, np.ndarray) and a.flags.c_contiguous
        and (a.dtype in (np.float16, np.float32) or str(a.dtype) == "bfloat16") for a in arrays) \
        and ("torch" in sys.modules or arrays[0].size >= 65536)


def torch_view(a: np.ndarray) -> Any:
    """A torch tensor sharing memory with ``a`` (bfloat16 through an int16 view)."""
    import torch

    if a.dtype in (np.float16, np.float32):
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def cast_into(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``dst[...] = src`` with the conversion rounding to nearest even; returns ``dst``."""
    if usable(src, dst):
        torch_view(dst).copy_(torch_view(src))
    else:
        dst[...] = src
    return dst


def sum_rows(rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = rows.sum(axis=0)`` for 16-bit float rows: added in float32, rounded once; returns ``out``.

    Rows are added in order in float32 (IEEE signed zeros kept), then rounded; two rows by one PyTorch kernel (each
    pair widened, added, rounded), more through a float32 accumulator; NumPy does the same where PyTorch is missing.

    Args:
        rows: shape ``(n_rows, m)``, float16 or bfloat16, C-contiguous.
        out: shape ``(m,)``, the same dtype (may not overlap ``rows``).
    """
    if rows.shape[0] == 0:
        out[...] = 0
        return out
    if usable(rows, out):
        import torch

        if rows.shape[0] == 2:
            torch.add(torch_view(rows[0]), torch_view(rows[1]), out=torch_view(out))
            return out
        acc = torch_view(rows[0]).to(torch.float32)
        for row in rows[1:]:  # in order, widened on the fly
            acc.add_(torch_view(row))
        torch_view(out).copy_(acc)
        return out
    acc = rows[0].astype(np.float32)
    for row in rows[1:]:
        acc += row.astype(np.float32)
    out[...] = acc.astype(out.dtype)
    return out
