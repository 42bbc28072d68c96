"""The arithmetic and collectives of synchronized batch normalization (:mod:`distopt.torch.sync_batchnorm`, which
says what travels per layer and step): the global statistics in one all-reduce, the forward and backward formulas, the
layer's communicator.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..comm.base import Communicator
from ..errors import CollectiveMismatchError
from .adapter import as_array

__all__ = ["CommRef", "sync_train", "global_stats", "input_problem"]

_DEVICE_COMMS = ("nccl", "torch")  # backends that reduce CUDA memory in place; the others get host copies
_JOIN_HINT = ("every rank must run the same SyncBatchNorm layers (same num_features) in the same order in "
              "training mode; inside DistOpt.join() a rank that has left its loop runs no forward, so "
              "SyncBatchNorm cannot train there (use even batch counts, e.g. DistributedSampler(drop_last="
              "True), or nn.BatchNorm inside join())")


def _communicator(source: Any, what: str) -> Communicator:
    """The communicator of ``source``: a Communicator, or anything with ``.comm`` (World, DistOpt, Group).

    Raises:
        ValueError: ``source.comm`` is None (this rank is not a member of the process group).
        TypeError: ``source`` is neither.
    """
    comm = getattr(source, "comm", source)
    if comm is None:
        raise ValueError(f"{what}: {source!r} has no communicator on this rank (.comm is None: this rank is not "
                         "a member of the process group); build SyncBatchNorm with a group this rank belongs to")
    if not (hasattr(comm, "all_reduce") and hasattr(comm, "size") and hasattr(comm, "rank")):
        raise TypeError(f"{what}: comm/group must be a distopt Communicator or have a .comm attribute "
                        f"(distopt.World, DistOpt, Group); got {type(source).__name__}")
    return comm


class CommRef:
    """Holds what ``comm=``/``group=`` named: shared by ``copy.deepcopy``, dropped by pickling."""

    def __init__(self, source: Any, kind: str) -> None:
        self.source, self.kind, self.resolved = source, kind, None
        self.lost = False  # True after unpickling an explicit comm: communicators do not travel

    def __deepcopy__(self, memo: dict) -> "CommRef":
        return self

    def __getstate__(self) -> dict:
        return {"source": None, "kind": self.kind, "resolved": None, "lost": self.source is not None}

    def get(self) -> Communicator:
        if self.resolved is None or getattr(self.resolved, "closed", False):
            if self.lost:
                raise RuntimeError("this SyncBatchNorm was unpickled and its communicator did not travel with "
                                   "it: call set_comm(comm) before training")
            if self.source is None:
                from ..launch import world

                found = world.current()
                self.resolved = (found if found is not None else world.init()).comm
            else:
                self.resolved = _communicator(self.source, f"SyncBatchNorm({self.kind}=...)")
        return self.resolved


def _all_reduce(comm: Communicator, packed: torch.Tensor, what: str) -> torch.Tensor:
    """Sum ``packed`` (a float64 tensor) over ranks, in place where the backend allows; returns the sums.

    Raises:
        CollectiveMismatchError: ranks disagree (the backend's, with :data:`_JOIN_HINT` added).
    """
    buf = packed if packed.device.type == "cpu" or comm.name in _DEVICE_COMMS else packed.cpu()
    try:
        comm.all_reduce(as_array(buf), op="sum")
    except CollectiveMismatchError as exc:
        raise CollectiveMismatchError(f"{exc}\n{what}: {_JOIN_HINT}") from exc
    return buf.to(packed.device)


def _count_on_host(x: torch.Tensor, comm: Communicator) -> bool:
    """Whether the count travels apart from the sums, on the host: the sums stay on a GPU (the NCCL backend, or the
    torch backend with a CUDA input, which torch sends over NCCL)."""
    return comm.name == "nccl" or (comm.name == "torch" and x.is_cuda)


def _shape(x: torch.Tensor) -> tuple[list[int], tuple[int, ...]]:
    """The reduction dims of ``x`` (all but the channel dim 1) and the shape that broadcasts a channel vector."""
    return [0] + list(range(2, x.dim())), (1, x.shape[1]) + (1,) * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """``y = (x - mean) * invstd * weight + bias`` with the global ``mean``/``invstd``; the backward all-reduces the
    two per-channel gradient sums (torch's ``batch_norm_backward_reduce``/``_elemt``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, count: float, comm: Communicator, what: str) -> torch.Tensor:
        dims, shape = _shape(x)
        y = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        if weight is not None:
            y = y * weight.to(x.dtype).view(shape)
        if bias is not None:
            y = y + bias.to(x.dtype).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.comm, ctx.what, ctx.has_bias = count, comm, what, bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _shape(x)
        dy64 = dy.to(torch.float64)
        xmu = x.to(torch.float64) - mean.view(shape)
        sums = torch.cat([dy64.sum(dims), (dy64 * xmu).sum(dims)])  # this rank's: bias and weight grads
        channels = x.shape[1]
        grad_weight = (sums[channels:] * invstd).to(weight.dtype) if weight is not None else None
        grad_bias = sums[:channels].to(weight.dtype) if ctx.has_bias else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            total = _all_reduce(ctx.comm, sums.clone(), f"{ctx.what} backward") / ctx.count
            mean_dy, mean_dy_xmu = total[:channels].view(shape), total[channels:].view(shape)
            scale = invstd if weight is None else invstd * weight.to(torch.float64)
            grad_x = ((dy64 - mean_dy - xmu * (invstd * invstd).view(shape) * mean_dy_xmu)
                      * scale.view(shape)).to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def sync_train(layer: Any, x: torch.Tensor, running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                weight: torch.Tensor | None, bias: torch.Tensor | None, factor: float, eps: float,
                comm: Communicator, what: str) -> torch.Tensor:
    """``F.batch_norm(x, running_mean, running_var, weight, bias, True, factor, eps)`` over the global batch of every
    rank (collective: one all-reduce in forward, one in backward); the running statistics (when given) take the global
    mean and unbiased variance by ``factor``."""
    mean, var, count = global_stats(layer.num_features, x, comm, what)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = var * (count / (count - 1))
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
            running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
    return _SyncBatchNormFunction.apply(x, weight, bias, mean, torch.rsqrt(var + eps), count, comm, what)


def global_stats(channels: int, x: torch.Tensor, comm: Communicator,
                 what: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The global per-channel mean and biased variance (float64) and the global count of ``x`` (``channels`` channels
    in dim 1), in ONE all-reduce.

    A rank whose input is unusable still joins the all-reduce with a NaN count, so every rank raises. Where the sums
    stay on a GPU (NCCL, or torch's NCCL for CUDA inputs) the count travels first in a small host all-reduce of its
    own, so that no layer waits for the device to read it back, and every rank raises before the sums move.
    """
    problem = input_problem(channels, x)
    local = float("nan") if problem is not None else float(x.numel() // channels) if channels else 0.0
    on_host = _count_on_host(x, comm)
    device = x.device if problem is None else torch.device("cpu")
    packed = torch.zeros(2 * channels + (0 if on_host else 1), dtype=torch.float64, device=device)
    if on_host:  # the count travels on the host: no device-to-host copy per layer
        counts = np.array([local])
        comm.all_reduce(counts, op="sum")
        count = float(counts[0])
    else:
        packed[-1] = local
    if problem is None:
        dims, _ = _shape(x)
        with torch.no_grad():
            x64 = x.detach().to(torch.float64)
            packed[:channels] = x64.sum(dims)
            packed[channels:2 * channels] = (x64 * x64).sum(dims)
    if not on_host:
        total = _all_reduce(comm, packed, f"{what} forward")
        count = float(total[-1])
    if problem is not None:
        raise ValueError(f"{what} on rank {comm.rank} {problem}")
    if count != count:  # NaN: another rank's input was unusable
        raise ValueError(f"{what}: another rank's input was unusable (see its error); this rank's "
                         f"input has shape {tuple(x.shape)}")
    if count <= 1:
        raise ValueError(f"{what}: expected more than 1 value per channel over all ranks when "
                         f"training, got {int(count)} (input shape on rank {comm.rank}: {tuple(x.shape)})")
    if on_host:  # every rank's input is usable (else all raised above, before the data moved)
        total = _all_reduce(comm, packed, f"{what} forward")
    mean = total[:channels] / count
    var = (total[channels:2 * channels] / count - mean * mean).clamp_(min=0.0)
    return mean, var, count


def input_problem(channels: int, x: torch.Tensor) -> str | None:
    """What is wrong with ``x`` for a layer of ``channels`` channels, or None."""
    if not 2 <= x.dim() <= 5:
        return (f"expects a 2-D to 5-D input (N, C[, L | H, W | D, H, W]), got a {x.dim()}-D input of shape "
                f"{tuple(x.shape)}")
    if x.shape[1] != channels:
        return f"expects {channels} channels (dim 1), got input of shape {tuple(x.shape)}"
    if not x.is_floating_point():
        return f"expects a floating-point input, got {x.dtype}"
    return None
