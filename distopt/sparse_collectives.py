"""The raw sparse all-reduce of one torch sparse COO tensor (Horovod's ``sparse_allreduce_async``): what
``DistOpt.sparse_all_reduce`` runs.

Source: ``horovod/torch/mpi_ops.py``, ``sparse_allreduce_async``: every rank's indices and values are all-gathered and
concatenated in rank order into one sparse tensor of the input's size, NOT coalesced (an index held by several ranks
appears once per rank; ``coalesce()`` sums them), the values divided by the number of ranks for ``"avg"`` (each entry,
before any sum, as Horovod). The wire is that of the sparse gradients of :mod:`distopt.torch.sparse`: one
``all_gather_v`` of int64 (this rank's nnz, then its indices, ``(sparse_dim, nnz)`` row-major) and one of the values'
raw bytes (``(nnz, *dense_dims)`` of any dtype). First the ranks agree (:func:`~distopt.comm.consensus.agree`, one
small all-gather) on the call, the size, ``sparse_dim``, dtype and op, so a bad argument on one rank or a tensor that
differs raises the same exception on every rank, and no data moves.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .comm.base import Communicator
from .comm.consensus import agree
from .core._array import xp_of

__all__ = ["sparse_all_reduce", "SPARSE_OPS"]

SPARSE_OPS = ("sum", "avg")
"""The ``op`` values :func:`sparse_all_reduce` takes."""


def sparse_all_reduce(comm: Communicator, tensor: Any, op: str = "sum") -> Any:
    """Every rank's entries of the sparse COO ``tensor`` in one sparse tensor (see the module docs).

    Args:
        comm: the communicator (a group's, for a process group).
        tensor: a ``torch.sparse_coo`` tensor (coalesced or not; hybrid ``sparse_dim < ndim`` allowed), on the host or
            a GPU; the same size, ``sparse_dim`` and dtype on every rank; its number of entries (nnz) may differ.
        op: ``"sum"`` (the concatenation) or ``"avg"`` (its values divided by the number of ranks; floating-point or
            complex dtypes only).

    Returns:
        A new uncoalesced sparse COO tensor of ``tensor``'s size, dtype and device: rank 0's entries, then rank 1's,
        ... (``total nnz`` = the sum of the ranks' nnz); ``.coalesce()`` sums the entries of one index.

    Raises:
        TypeError: on every rank, naming the rank: ``tensor`` is not a sparse COO torch tensor (a dense one: use
            ``all_reduce``), ``op="avg"`` on an integer or bool dtype.
        ValueError: on every rank, an ``op`` other than ``"sum"`` and ``"avg"``.
        CollectiveMismatchError: on every rank, the size, ``sparse_dim``, dtype or op differs across ranks.
    """
    problem = None
    try:
        _check(tensor, op)
    except (TypeError, ValueError) as exc:
        problem = exc
    good = problem is None
    fields = {"collective": "sparse_all_reduce", "op": op,
              "size": list(tensor.shape) if good else None, "sparse_dim": tensor.sparse_dim() if good else None,
              "dtype": str(tensor.dtype) if good else None}
    agree(comm, fields, call="sparse_all_reduce", problem=problem, kinds=(ValueError, TypeError),
          hint={"collective": "the ranks must call the same collectives in the same order"})
    return _gathered(comm, tensor.detach(), op)


def _check(tensor: Any, op: str) -> None:
    """This rank's own validation (TypeError / ValueError)."""
    if op not in SPARSE_OPS:
        raise ValueError(f"op must be one of {SPARSE_OPS}, got {op!r}")
    if not type(tensor).__module__.startswith("torch") or not hasattr(tensor, "layout"):
        raise TypeError(f"tensor must be a torch sparse COO tensor, got {type(tensor).__name__}")
    import torch

    if tensor.layout != torch.sparse_coo:
        hint = " (a dense tensor: use all_reduce)" if tensor.layout == torch.strided else ""
        raise TypeError(f"tensor must be a torch sparse COO tensor, got layout {tensor.layout}{hint}")
    if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='avg' divides floating-point values, got dtype {tensor.dtype}: use op='sum' and divide")


def _gathered(comm: Communicator, tensor: Any, op: str) -> Any:
    """The all-gathers and the concatenation, once the ranks agreed."""
    import torch

    from .torch.adapter import as_array, as_tensor

    k, nnz = tensor.sparse_dim(), tensor._nnz()
    dense = tuple(tensor.shape[k:])
    indices = tensor._indices().reshape(-1).to("cpu", torch.int64)  # (k, nnz) row-major
    values = tensor._values().contiguous().reshape(-1)
    values = values.view(torch.uint8) if values.numel() else torch.zeros(0, dtype=torch.uint8, device=values.device)
    all_idx = comm.all_gather_v(as_array(torch.cat([torch.tensor([nnz], dtype=torch.int64), indices])))
    all_val = comm.all_gather_v(as_array(values))
    counts = [int(part[0]) for part in all_idx]
    idx = np.concatenate([np.asarray(part[1:]).reshape(k, n) for part, n in zip(all_idx, counts)], axis=1)
    total = sum(counts)
    if total:
        raw = xp_of(all_val[0]).concatenate(all_val)  # every rank's values' bytes, rank order
        vals = as_tensor(raw).to(tensor.device).view(tensor.dtype).reshape(total, *dense)
    else:  # no entry on any rank (Horovod: an empty tensor of the size)
        vals = torch.zeros((0, *dense), dtype=tensor.dtype, device=tensor.device)
    if op == "avg":
        vals = vals / comm.size
    return torch.sparse_coo_tensor(torch.from_numpy(idx).to(tensor.device), vals, tuple(tensor.shape),
                                   dtype=tensor.dtype, device=tensor.device, check_invariants=True)
