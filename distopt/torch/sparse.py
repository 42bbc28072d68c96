"""Sparse PyTorch gradients (``nn.Embedding(sparse=True)``): averaged as sparse, outside the buckets.

Source: Horovod's sparse all-reduce through all-gathers (``horovod/torch/mpi_ops.py``, ``sparse_allreduce_async``):
every rank's indices and values are gathered, concatenated in rank order and made one sparse tensor. Here:

* **Which tensors are sparse** is agreed once, at the end of the first synchronizing backward that meets a trainable
  tensor not classified yet: one small all-gather of one code per tensor (0 no gradient, 1 dense, ``1 + k`` sparse
  with ``sparse_dim`` k; sparse on one rank and dense on another raises
  :class:`~distopt.errors.CollectiveMismatchError` on every rank; no gradient anywhere: dense). Until then it stays in
  the dense bucket layout with no gradient packed; from the next step on, sparse tensors are left out of it.
* **Averaging** (every synchronizing step, after the dense buckets, on every rank in the parameters' order): two
  ``all_gather_v`` for all sparse tensors together, one of int64 (per tensor a tag, whether this rank has a gradient,
  its nnz; then the indices, ``(sparse_dim, nnz)`` row-major) and one of the values' raw bytes (``(nnz,
  *dense_dims)`` of any dtype). Per tensor the ranks' parts are concatenated in rank order, coalesced, and divided by
  the world size (by the contributing ranks with ``divide_by_initial_world_size=False`` while some have joined). A
  joined rank contributes no gradient (0 nnz) and receives the average. ``.grad`` is then the coalesced sparse average
  (``torch.optim.SparseAdam``, sparse ``SGD``, ``Adagrad``); None where no rank had a gradient.
* **Arithmetic**: ``coalesce`` sums the entries of one index in the order they appear in the concatenation (rank
  order, then each rank's own order), the order one process meets them over the concatenated batch. With per-rank
  mean losses the one-process entries are the per-rank ones divided by W: for W a power of two that scaling is exact
  and the average is bitwise one process's; otherwise it agrees to rounding (Horovod divides each entry before the
  sum; here the sum is divided once).
* **Densified** instead (``sparse_as_dense=True``, and always with ``gradient_as_bucket_view`` or ``zero=1|2|3``): a
  sparse gradient becomes dense at its hook and is averaged in its bucket; an optimizer that only takes sparse
  gradients (:func:`needs_sparse`: ``SparseAdam``) gets it back sparse, the rows (``sparse_dim`` 1) that are non-zero
  in the average (an exactly zero average of a touched row is left out); any other gets the dense average.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..core._array import xp_of
from ..errors import CollectiveMismatchError
from ..comm.consensus import digest
from ..step.engine import Engine
from ..step.outcome import Outcome
from .adapter import as_array, as_tensor

__all__ = ["SparseGrads", "needs_sparse", "DENSE"]

DENSE = 1
"""Code of a tensor averaged in the dense buckets; ``DENSE + k`` is sparse with ``sparse_dim`` k; 0 no gradient."""

_HEAD = 3  # int64 per sparse tensor ahead of the indices: tag, has a gradient, nnz


def needs_sparse(optimizer: Any) -> bool:
    """Whether ``optimizer`` refuses dense gradients (``torch.optim.SparseAdam``)."""
    import torch

    return isinstance(optimizer, torch.optim.SparseAdam)


def _code(grad: Any) -> int:
    return 0 if grad is None else DENSE + grad.sparse_dim() if grad.is_sparse else DENSE


def _where(i: int, t: Any) -> str:
    return f"parameter #{i} of shape {tuple(t.shape)} ({str(t.dtype).replace('torch.', '')})"


class SparseGrads:
    """The sparse gradients of one follower: which trainable tensors are sparse, and their averaging.

    Args:
        engine: the step engine (communicator, counters, division rule).
        optimizer: the inner ``torch.optim.Optimizer`` (:func:`needs_sparse`).
        densify: average sparse gradients densely (``sparse_as_dense``, ``gradient_as_bucket_view``, a sharded sink).

    Attributes:
        kinds: ``id(tensor) -> code`` of every classified tensor (see :data:`DENSE`).
        owned: the step's trainable tensors this follower averages, in parameter order.
        averaged: ``id(tensor) -> (tensor, sparse average or None)`` of this step.
    """

    def __init__(self, engine: Engine, optimizer: Any, densify: bool) -> None:
        self.engine, self.densify = engine, bool(densify)
        self.sparse_out = needs_sparse(optimizer)
        self.kinds: dict[int, int] = {}
        self.owned: list[Any] = []
        self.averaged: dict[int, tuple[Any, Any]] = {}

    def is_sparse(self, t: Any) -> bool:
        """Whether ``t`` is averaged as sparse (classified so, and not densified)."""
        return not self.densify and self.kinds.get(id(t), DENSE) > DENSE

    def layout(self, owned: Sequence[Any]) -> list[Any]:
        """Remember the step's trainable tensors; return those of the dense bucket layout (all but the sparse ones;
        unclassified tensors included)."""
        self.owned = list(owned)
        return [t for t in self.owned if not self.is_sparse(t)]

    def on_grad(self, param: Any) -> bool:
        """A final gradient at its hook: True when it goes to the dense pipeline (a sparse one densified there when it
        is averaged densely), False when it is averaged here."""
        if self.is_sparse(param):
            return False
        grad = param.grad
        if grad is None or not grad.is_sparse:
            return True
        if self.densify or id(param) in self.kinds:  # classified dense: a late sparse gradient is densified
            param.grad = grad.to_dense()
            return True
        return False  # not classified yet: kept sparse, classified at the end of the backward

    def array(self, t: Any, contiguous: bool = False) -> Any:
        """The array of ``t.grad`` for the dense buckets; None when it has none or it is averaged here.

        Raises:
            TypeError: from :func:`~distopt.torch.adapter.as_array` (a non-contiguous gradient).
        """
        grad = t.grad
        if grad is None or (grad.is_sparse and not self.on_grad(t)) or self.is_sparse(t):
            return None
        return as_array(t.grad.contiguous() if contiguous else t.grad)

    # ------------------------------------------------------------- collective
    def reduce(self, outcome: Outcome, shadow: bool) -> bool:
        """Classify new tensors and average the sparse gradients (collective); returns whether ``check_finite`` found a
        non-finite average (every rank then skips the step).

        Args:
            outcome: the dense buckets' agreement (nothing runs when it does not apply).
            shadow: a joined rank's shadow step: it contributes no gradient.

        Raises:
            CollectiveMismatchError: on every rank, a tensor sparse on one rank and dense on another, or with another
                sparse layout.
        """
        self.averaged = {}
        if not outcome.applies or self.densify:
            return False
        with self.engine.context("sparse gradients"):
            if any(id(t) not in self.kinds for t in self.owned):
                self._classify(shadow)
            sparse = [(i, t) for i, t in enumerate(self.owned) if self.is_sparse(t)]
            if not sparse:
                return False
            bad = self._average(sparse, self.engine.agreement.divisor(outcome), shadow)
        if bad and self.engine.check_finite:
            self.engine.counters.skipped_steps += 1
        return bad and self.engine.check_finite

    def _classify(self, shadow: bool) -> None:
        codes = np.array([0 if shadow else _code(t.grad) for t in self.owned], dtype=np.int64)
        everyone = self.engine.comm.all_gather(codes)  # (W, len(owned)) int64
        self.engine.counters.control_collectives += 1
        for i, t in enumerate(self.owned):
            column = everyone[:, i]
            kinds = sorted(set(column[column > 0].tolist()))
            if len(kinds) > 1:
                ranks = {k: np.flatnonzero(column == k).tolist() for k in kinds}
                said = "; ".join(f"{'a dense gradient' if k == DENSE else f'a sparse one (sparse_dim {k - DENSE})'}"
                                 f" on rank(s) {r}" for k, r in ranks.items())
                raise CollectiveMismatchError(
                    f"{_where(i, t)} has {said}: every rank must build the same model (nn.Embedding(sparse=...) "
                    "alike), or pass DistOpt(..., sparse_as_dense=True) to average sparse gradients densely")
            self.kinds[id(t)] = kinds[0] if kinds else DENSE

    def _tag(self, i: int, t: Any) -> int:
        return digest([i, list(t.shape), str(t.dtype), self.kinds[id(t)]])

    def _average(self, sparse: list[tuple[int, Any]], divisor: int, shadow: bool) -> bool:
        """Gather, coalesce and divide every sparse tensor's gradient; returns whether one is not finite."""
        import torch

        heads, indices, values = [], [], []
        for i, t in sparse:
            grad = None if shadow else t.grad
            if grad is not None and not grad.is_sparse:  # classified sparse, dense here: its non-zero part
                grad = grad.to_sparse(self.kinds[id(t)] - DENSE)
            has = grad is not None
            nnz = grad._nnz() if has else 0
            heads += [self._tag(i, t), int(has), nnz]
            if nnz:
                indices.append(grad._indices().reshape(-1).to("cpu", torch.int64))
                values.append(grad._values().contiguous().reshape(-1).view(torch.uint8))
        mine_idx = as_array(torch.cat([torch.tensor(heads, dtype=torch.int64), *indices]))
        device = sparse[0][1].device
        mine_val = as_array(torch.cat(values) if values else torch.zeros(0, dtype=torch.uint8, device=device))
        comm = self.engine.comm
        all_idx = comm.all_gather_v(mine_idx)  # per rank: int64 [heads, indices]
        all_val = comm.all_gather_v(mine_val)  # per rank: uint8, the values' bytes
        counters = self.engine.counters
        counters.wire_bytes += int(mine_idx.nbytes + mine_val.nbytes)
        counters.dense_bytes += sum(t.numel() * t.element_size() for _, t in sparse)
        n = len(sparse)
        tables = [np.asarray(a[:_HEAD * n]).reshape(n, _HEAD) for a in all_idx]
        for r, table in enumerate(tables):
            for j, (i, t) in enumerate(sparse):
                if table[j, 0] != tables[0][j, 0]:
                    raise CollectiveMismatchError(
                        f"{_where(i, t)} is averaged as sparse gradient {j} of {n} here, but rank {r} holds "
                        "another tensor (shape, dtype or sparse_dim) there: every rank must build the same model")
        cursors = [[_HEAD * n, 0] for _ in all_idx]  # per rank: next index element, next value byte
        xp = xp_of(all_val[0])
        bad = False
        for j, (i, t) in enumerate(sparse):
            k = self.kinds[id(t)] - DENSE
            row = int(np.prod(t.shape[k:], dtype=np.int64)) * t.element_size()  # BYTES per value row
            parts_idx, parts_val, present = [], [], False
            for r, table in enumerate(tables):
                nnz = int(table[j, 2])
                present |= bool(table[j, 1])
                at_i, at_v = cursors[r]
                parts_idx.append(np.asarray(all_idx[r][at_i:at_i + k * nnz]).reshape(k, nnz))
                parts_val.append(all_val[r][at_v:at_v + row * nnz])
                cursors[r] = [at_i + k * nnz, at_v + row * nnz]
            if not present:
                self.averaged[id(t)] = (t, None)
                continue
            idx = torch.from_numpy(np.concatenate(parts_idx, axis=1)).to(t.device)  # (k, total nnz) int64
            vals = as_tensor(xp.concatenate(parts_val)).to(t.device).view(t.dtype).reshape(-1, *t.shape[k:])
            mean = torch.sparse_coo_tensor(idx, vals, t.shape, check_invariants=True).coalesce() / divisor
            self.averaged[id(t)] = (t, mean)
            bad = bad or (self.engine.check_finite and not bool(torch.isfinite(mean._values()).all()))
        return bad

    def give_back(self, tensors: Sequence[Any], skipped: bool) -> None:
        """Set ``.grad`` to this step's sparse averages; hand an optimizer that needs sparse gradients
        (:func:`needs_sparse`) the dense averages of ``tensors`` as sparse rows."""
        for t, mean in self.averaged.values():
            t.grad = mean
        self.averaged = {}
        for t in self.owned if skipped else ():
            t.grad = None  # a skipped step: no gradient, sparse ones included
        for t in tensors if self.sparse_out and not skipped else ():
            if t.grad is not None and not t.grad.is_sparse and t.dim():
                t.grad = t.grad.to_sparse(1)
