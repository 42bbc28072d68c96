"""PyTorch DDP's ``gradient_as_bucket_view``: every ``.grad`` a view into its bucket's flat buffer.

The layout's bucket buffers are tensors of the parameters' dtype and device, allocated once per layout (and
trainable-parameter list), and each ``.grad`` is made a view into its bucket when its final gradient is ready (copied
into the view if it is another tensor, untouched if it is the view already). The pipeline then reduces each bucket in
place and unpacks nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..step.pipeline import BucketPipeline
from ..step.strategy_set import slots
from ..strategies.base import Strategy
from .adapter import TorchOptimizer, as_array

__all__ = ["BucketViews", "check_bucket_view"]


def check_bucket_view(local: Any, strategy: Strategy) -> None:
    """Refuse ``gradient_as_bucket_view=True`` where it cannot work.

    Raises:
        ValueError: ``local`` is not a PyTorch optimizer, or ``strategy`` averages parameters instead of gradients.
    """
    if not isinstance(local, TorchOptimizer):
        raise ValueError("gradient_as_bucket_view=True needs a torch.optim.Optimizer (it makes param.grad a view "
                         f"into the bucket buffers); {type(local.opt).__name__} is an array optimizer: drop "
                         "gradient_as_bucket_view")
    if not slots(strategy).gradients.reduces:
        raise ValueError(f"gradient_as_bucket_view=True needs a strategy that reduces gradient buckets in place "
                         f"(plain, half, sparse, dgc, powersgd), not {strategy.name!r}, which averages parameters "
                         "after the update")


class BucketViews:
    """The ``.grad`` views of one follower, rebuilt when the layout or the trainable tensors change."""

    def __init__(self) -> None:
        self.views: list[Any] = []  # per trainable tensor, its .grad view into the bucket buffers
        self._owner: tuple[Any, tuple[int, ...]] | None = None  # (layout buffers, tensor ids) they view

    def bind(self, pipeline: BucketPipeline, tensors: Sequence[Any]) -> None:
        """Allocate ``pipeline``'s bucket buffers as tensors and the views into them, once per layout and tensor list
        (a new layout or list: new buffers, new views)."""
        import torch

        owner = (pipeline.buffers, tuple(id(t) for t in tensors))
        if self._owner is not None and self._owner[0] is owner[0] and self._owner[1] == owner[1]:
            return
        # never reuse memory a parameter no longer trained may still hold as .grad
        pipeline.buffers[:] = [None] * len(pipeline.buffers)
        views: list[Any] = [None] * len(tensors)
        for b, bucket in enumerate(pipeline.buckets):
            ref = tensors[bucket.slots[0].index]
            flat = torch.zeros(bucket.size, dtype=ref.dtype, device=ref.device)  # bucket.size ELEMENTS
            pipeline.buffers[b] = as_array(flat)
            for s in bucket.slots:
                views[s.index] = flat[s.offset:s.offset + s.size].view(s.shape)
        self.views, self._owner = views, owner

    def adopt(self, tensor: Any, index: int) -> None:
        """Make ``tensor``'s ``.grad`` its view ``index``: copy a gradient held elsewhere into the view, then point
        ``.grad`` at it (the old tensor is freed); the view itself is left as it is."""
        view = self.views[index]
        grad = tensor.grad
        if grad is not None and (grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride()):
            view.copy_(grad)
            tensor.grad = view
