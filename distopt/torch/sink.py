"""Where a PyTorch step's reduced gradients go: the gradient sink a follower is built with.

:class:`GradientSink` is the replicated one: every parameter's ``.grad`` holds the cross-rank average, as with PyTorch
DDP. A sharded optimizer's sink (:class:`distopt.torch.zero.step.ShardedTorchStep`) overrides it: ``.grad`` then holds
this rank's segment, the inner optimizer steps its shard tensors, and the parameters are all-gathered after the step.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ..step.outcome import Outcome
from ..step.pipeline import BucketPipeline
from .adapter import as_array, as_tensor_like
from .full_writes import broadcast_from, check_modifier_rank, check_writes, digest

__all__ = ["GradientSink"]


class GradientSink:
    """The replicated sink: the average lands in ``.grad`` (see the module docs).

    Attributes:
        densify: sparse gradients must be reduced densely, in the buckets (False here: they may be averaged as sparse).
        shards_optimizer: the optimizer is sharded (False here): a parameter may not be shared with another DistOpt
            (:func:`~distopt.torch.owners.check_sharing`).
    """

    densify = False
    shards_optimizer = False

    def adopt(self, pipeline: BucketPipeline, tensors: Sequence[Any], grads: Sequence[Any],  # noqa: ARG002
              outcome: Outcome, skipped: bool, shadow: bool, views: Sequence[Any] | None) -> None:
        """After a step's reduction, give each tensor its averaged gradient.

        Args:
            pipeline: the step's pipeline (its sync holds a sharded step's segments).
            tensors: the step's tensors, in the step's order.
            grads: the averaged gradients (arrays; None where this rank had none).
            outcome: the ranks' agreement on the step.
            skipped: the step is skipped: every ``.grad`` becomes None.
            shadow: a joined rank's shadow step (its own ``.grad`` was ignored).
            views: with ``gradient_as_bucket_view``, each tensor's ``.grad`` view into its bucket; None without.
        """
        for i, (t, g, ok) in enumerate(zip(tensors, grads, outcome.present)):
            if skipped or not ok:
                t.grad = None
            elif t.grad is None and views is not None:
                t.grad = views[i]  # its slot (zeros here) holds the average of the other ranks
            elif t.grad is None:
                t.grad = as_tensor_like(g, t)
            elif shadow:
                t.grad.copy_(as_tensor_like(g, t).reshape(t.grad.shape))

    def packed(self, tensor: Any, pipeline: BucketPipeline) -> None:
        """A synchronizing backward packed ``tensor.grad`` into its bucket (at its hook). Here nothing: the average
        lands in ``.grad``. Where the step's sync says a result never lands in the gradients
        (:attr:`~distopt.sharding.sync.StepSync.lands_in_gradients` False: ``zero=2|3``), the gradient is dropped now
        (``.grad`` None; the pipeline keeps that it had one), as FSDP frees each unsharded gradient once reduced: the
        packing copy is queued on the gradient's stream, so its memory is reused only after it."""
        if not pipeline.sync.lands_in_gradients:
            tensor.grad = None

    def reduced_into(self, grads: list[Any]) -> list[Any]:
        """The arrays a step's reduction averages into, from this rank's gradient arrays ``grads`` (None where it has
        none): ``grads`` themselves here; mixed precision's sinks give copies in ``reduce_dtype``."""
        return grads

    def bind(self, follower: Any) -> None:
        """Once the follower exists and the parameters are rank 0's on every rank (nothing to do here)."""

    def arrays(self, tensors: Sequence[Any]) -> list[Any]:
        """The step's parameters as arrays (their shapes and dtypes lay out the buckets)."""
        return [as_array(t) for t in tensors]

    def end_of_backward(self) -> None:
        """At the end of every backward pass, averaging or accumulating (nothing to do here)."""

    def after_step(self, applied: bool) -> None:
        """After the inner optimizer's ``step()`` (``applied``: it was not skipped)."""

    def before_zero_grad(self) -> None:
        """Before ``zero_grad``: the inner optimizer's parameter groups are its own (they always are here)."""

    def wait(self, tensors: Sequence[Any] | None = None) -> None:
        """Complete parameter communication still in flight after a step (none here)."""

    @contextmanager
    def full_parameters(self, writeback: bool, modifier_rank: int | None, comm: Any,
                        params: Sequence[Any]) -> Iterator[None]:
        """Every parameter whole inside the block (here: once gathers in flight have completed); with ``writeback``,
        ``modifier_rank``'s writes become every rank's, or writes on some ranks only raise
        (:mod:`distopt.torch.full_writes`)."""
        check_modifier_rank(modifier_rank, comm.size)
        self.wait()
        before = digest(params) if writeback and modifier_rank is None else 0
        yield
        if writeback and modifier_rank is not None:
            broadcast_from(comm, params, modifier_rank)
        elif writeback:
            check_writes(comm, before, digest(params), discarded=False)

    def clip_grad_norm_(self, params: Sequence[Any], max_norm: float, norm_type: float = 2.0) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` over ``params`` (their ``.grad`` is the average on every rank)."""
        import torch

        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
