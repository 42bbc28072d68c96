"""Clipping sharded gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_`` computes it.

At ``zero=2`` each rank holds only its pieces of each parameter's gradient; summing every rank's squares would give
the norm in another rounding order. This reproduces torch's own formula instead: one norm per parameter
(``torch._foreach_norm``), then the norm of those norms in the parameters' order grouped by dtype, then ``grad *=
clamp(max_norm / (total + 1e-6), max=1)``; bitwise ``clip_grad_norm_`` over the unsharded gradients where the
per-tensor norm kernel is the same for a view as for the whole tensor (CPU; CUDA's multi-tensor kernel may round a
misaligned view differently). A parameter wholly inside one rank's segment has its norm computed by that rank; one
split between ranks ("straddling") has its pieces all-gathered and every rank computes its norm (the collectives:
``docs/sharding.md``, "Numerics").
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ...sharding.plan import ShardPlan

__all__ = ["ShardedClip"]


class ShardedClip:
    """``clip_grad_norm_`` over sharded gradients (see the module docs).

    Args:
        comm: the communicator of the shard plan.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self._plan_key: tuple[int, ...] | None = None
        self._straddling: list[np.ndarray] = []  # per rank: (k, 3) int64 rows (tensor, start, stop)

    def _positions(self, plan: ShardPlan, tensors: Sequence[Any], numels: Sequence[int]) -> list[np.ndarray]:
        """Every rank's straddling pieces as ``(tensor index, start, stop)`` rows (collective once per plan)."""
        key = (id(plan), *(id(t) for t in tensors))
        if key != self._plan_key:
            mine = np.array([(p.index, p.start, p.stop) for p in plan.pieces if p.size < numels[p.index]],
                            dtype=np.int64).reshape(-1)
            self._straddling = [rows.reshape(-1, 3) for rows in self.comm.all_gather_v(mine)]
            self._plan_key = key
        return self._straddling

    def __call__(self, plan: ShardPlan, tensors: Sequence[Any], numels: Sequence[int], grads: Sequence[Any | None],
                 params: Sequence[Any], max_norm: float, norm_type: float = 2.0) -> Any:
        """Clip ``grads`` in place by the global ``norm_type`` norm; returns it (a 0-dim tensor, the gradients' dtype).
        Collective: every rank calls it at the same step.

        Args:
            plan: this rank's shard plan.
            tensors: the plan's parameters, in the step's order.
            numels: ELEMENTS of each of ``tensors`` (stage 3 frees them between uses).
            grads: per piece of ``plan`` (same order), its gradient (a 1-D tensor) or None where the parameter has
                none this step (None on every rank alike).
            params: the parameters in the order torch's ``clip_grad_norm_`` would see them (the inner optimizer's
                groups); those outside ``tensors`` have no gradient.
            max_norm: the largest norm kept.
            norm_type: the ``p`` of the norm (``inf``: the largest magnitude).
        """
        import torch

        p = float(norm_type)
        straddling = self._positions(plan, tensors, numels)
        split = {int(i) for rows in straddling for i in rows[:, 0]}
        # one row per tensor: (its norm, how many pieces of it have a gradient); a whole piece's norm is written by its
        # rank only, so the float64 sum is exact
        table = np.zeros((len(tensors), 2), dtype=np.float64)
        whole = [(q.index, g) for q, g in zip(plan.pieces, grads) if g is not None and q.index not in split]
        if whole:  # one device-to-host copy for all the norms (CUDA: one synchronisation, not one per tensor)
            norms = torch._foreach_norm([g for _, g in whole], p)
            table[[index for index, _ in whole], 0] = torch.stack([n.double() for n in norms]).cpu().numpy()
        for q, g in zip(plan.pieces, grads):
            table[q.index, 1] += g is not None
        self.comm.all_reduce(table, op="sum")
        present = table[:, 1] > 0
        # the straddling pieces' values, float64 on the wire (exact for every float dtype), in one copy
        values = [g.detach().reshape(-1).double() for q, g in zip(plan.pieces, grads)
                  if g is not None and q.index in split]
        sent = torch.cat(values).cpu().numpy() if values else np.zeros(0, np.float64)
        full: dict[int, Any] = {}
        for rows, data in zip(straddling, self.comm.all_gather_v(np.ascontiguousarray(sent))):
            at = 0
            for index, start, stop in (tuple(int(v) for v in row) for row in rows):
                if not present[index]:
                    continue
                t = tensors[index]
                if index not in full:
                    full[index] = torch.empty(numels[index], dtype=t.dtype, device=t.device)
                full[index][start:stop] = torch.from_numpy(data[at:at + stop - start]).to(t.device, t.dtype)
                at += stop - start
        kept = [i for i in range(len(tensors)) if present[i] and i not in split]
        column = torch.from_numpy(table[kept, 0]).to(tensors[kept[0]].device) if kept else None  # one copy
        norms = {i: column[j].to(tensors[i].dtype) for j, i in enumerate(kept)}
        if full:
            norms.update(zip(full, torch._foreach_norm(list(full.values()), p)))
        order = {id(t): i for i, t in enumerate(tensors)}
        ordered = [order[id(q)] for q in params if id(q) in order and order[id(q)] in norms]
        if not ordered:
            return torch.tensor(0.0)
        groups: dict[Any, list[int]] = {}  # torch groups the gradients by dtype, in order of first appearance
        for index in ordered:
            groups.setdefault(tensors[index].dtype, []).append(index)
        total = torch.linalg.vector_norm(torch.stack([norms[i] for g in groups.values() for i in g]), p)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        mine = [g for g in grads if g is not None]
        if mine:
            torch._foreach_mul_(mine, coef)
        return total

