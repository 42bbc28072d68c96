"""Parameters as views of their bucket (``zero=1|2``): the all-gather after the update writes them in place.

torch's ``ZeroRedundancyOptimizer(parameters_as_bucket_view=True)`` and Megatron-LM's distributed optimizer (its
parameter buffer) keep each bucket's parameters in one flat tensor. Here each fused bucket of the layout gets one
flat tensor in the bucket's order, and its parameters' ``.data`` become views of it (values, shapes and strides
unchanged; the ``Parameter`` objects, and so the optimizer's references, stay). The all-gather then runs on the flat
tensor itself: this rank's segment is already there (the update wrote it through the shard tensors), and the other
ranks' segments land in the parameters, with no copy before or after.
"""
from __future__ import annotations

from typing import Any, Sequence

from ...core.buckets import Bucket
from ..adapter import as_array

__all__ = ["FlatParams"]


class FlatParams:
    """One flat tensor per fused bucket of a layout, which that bucket's parameters view.

    A bucket of one parameter, or holding a parameter that is not C-contiguous (its strides are kept) or complex
    (reduced as its real view), has none: the gather packs and unpacks it.
    """

    def __init__(self) -> None:
        self._flats: list[Any] = []
        self._buckets: list[Bucket] = []
        self._tensors: list[Any] = []

    def lay(self, buckets: Sequence[Bucket], tensors: Sequence[Any]) -> None:
        """Move the parameters ``tensors`` (in the layout's order) into flat tensors, one per fused bucket of
        ``buckets``: each flat tensor has ``bucket.size`` ELEMENTS of ``bucket.dtype``; peak memory grows by one
        bucket while it is filled."""
        import torch

        self._buckets, self._tensors, self._flats = list(buckets), list(tensors), []
        for bucket in self._buckets:
            members = [tensors[s.index] for s in bucket.slots]
            if bucket.alone or not all(t.is_contiguous() and not t.is_complex() for t in members):
                self._flats.append(None)
                continue
            flat = torch.empty(bucket.size, dtype=members[0].dtype, device=members[0].device)
            with torch.no_grad():
                for s, t in zip(bucket.slots, members):
                    view = flat[s.offset:s.offset + s.size].view(t.shape)
                    view.copy_(t.detach())
                    t.data = view
            self._flats.append(flat)

    def check(self) -> None:
        """Before an update: every laid parameter still views its bucket.

        Raises:
            RuntimeError: a parameter's ``.data`` was replaced since (``model.to(...)``, ``load_state_dict(...,
                assign=True)``, ``p.data = ...``): this rank's update would no longer reach it.
        """
        for bucket, flat in zip(self._buckets, self._flats):
            if flat is None:
                continue
            base, item = flat.data_ptr(), flat.element_size()
            moved = [s.index for s in bucket.slots if s.size and self._tensors[s.index].data_ptr() !=
                     base + s.offset * item]
            if moved:
                raise RuntimeError(f"DistOpt(zero=1|2): the storage of parameters {moved} (in the layout's order) "
                                   f"was replaced after DistOpt was built (model.to(...), load_state_dict(..., "
                                   f"assign=True) or p.data = ...); the sharded update writes into the storage they "
                                   f"had. Move or load the model in place (copy_), or build DistOpt after moving it")

    def arrays(self) -> list[Any]:
        """Per bucket of the layout, its flat tensor as an array for the gather, or None (none was laid)."""
        return [None if flat is None else as_array(flat) for flat in self._flats]
