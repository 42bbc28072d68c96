"""Synchronized batch normalization: BatchNorm statistics over the global batch of every rank.

Batch normalization (Ioffe & Szegedy 2015, "Batch Normalization:
Accelerating Deep Network Training by Reducing Internal Covariate Shift")
normalizes each channel by the mean and variance of the batch. In data
parallel training each rank sees only its own part of the batch;
:class:`SyncBatchNorm` computes the statistics over the concatenation of
every rank's batch, as ``torch.nn.SyncBatchNorm`` does (its forward and
backward formulas; torch's own class runs on CUDA only), but over any distopt
communicator (mpi, shm, torch, nccl, single), on CPU tensors as well.

Collectives per layer and training step, on the layer's communicator:

* forward: ONE all-reduce (sum) of ``2 * C + 1`` float64 values: the
  per-channel sums, the per-channel sums of squares and the element count;
* backward (only when the input needs a gradient, as torch): ONE all-reduce
  of ``2 * C`` float64 values: the per-channel sums of the output gradient
  and of the output gradient times ``x - mean``.

Every rank calls them in the same order (same model, same forward), also
with a zero-size local batch (it contributes zero sums and a zero count).
Eval mode (running statistics) communicates nothing; neither does a world
of one rank (plain ``F.batch_norm``). Weight and bias gradients are this
rank's contributions (summed over its own samples), so averaging them over
ranks (``DistOpt``, DDP) gives the single-process gradient of the mean loss.

Not supported inside ``DistOpt.join()`` once a rank has left its loop: a
joined rank does not run forward, so the training ranks' all-reduces are
matched by the joined rank's shadow collectives (a different kind, count
or dtype); the backends then raise
:class:`~distopt.errors.CollectiveMismatchError` on every rank instead of
hanging, and this module adds the explanation on the training ranks.
PyTorch's DDP ``join()`` has the same restriction for SyncBatchNorm.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm.base import Communicator
from ..errors import CollectiveMismatchError
from .adapter import as_array

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "has_sync_batchnorm"]

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


class _CommRef:
    """Holds what ``comm=``/``group=`` named: shared by ``copy.deepcopy``, dropped by pickling."""

    def __init__(self, source: Any, kind: str) -> None:
        self.source, self.kind, self.resolved = source, kind, None
        self.lost = False  # True after unpickling an explicit comm: communicators do not travel

    def __deepcopy__(self, memo: dict) -> "_CommRef":
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


def _shape(x: torch.Tensor) -> tuple[list[int], tuple[int, ...]]:
    """The reduction dims of ``x`` (all but the channel dim 1) and the shape that broadcasts a channel vector."""
    return [0] + list(range(2, x.dim())), (1, x.shape[1]) + (1,) * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """``y = (x - mean) * invstd * weight + bias`` with the global ``mean``/``invstd``; the backward
    all-reduces the two per-channel gradient sums (torch's ``batch_norm_backward_reduce``/``_elemt``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, count: float, comm: Communicator,
                what: str) -> torch.Tensor:
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


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank, for 2-D to 5-D inputs (``torch.nn.SyncBatchNorm``).

    Shapes: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``
    in, the same shape out; ``N`` may differ across ranks and be 0 on some.
    Any floating dtype (statistics are summed and all-reduced in float64;
    the output has the input's dtype), CPU or CUDA (CUDA statistics travel
    through host memory unless the backend is nccl or torch).

    In training mode the mean and the biased variance over all ranks'
    elements normalize the input; ``running_mean``/``running_var`` are
    updated with the global mean and the UNBIASED global variance (global
    count ``n``, factor ``n / (n - 1)``) by ``momentum`` (None: cumulative
    average), identically on every rank. Eval mode uses the running
    statistics (no communication); with ``track_running_stats=False`` eval
    mode normalizes by the local batch, as torch does.

    Args:
        num_features: ``C``.
        eps: as ``torch.nn.BatchNorm2d``'s.
        momentum: as ``torch.nn.BatchNorm2d``'s (None: cumulative average).
        affine: as ``torch.nn.BatchNorm2d``'s.
        track_running_stats: as ``torch.nn.BatchNorm2d``'s.
        device: as ``torch.nn.BatchNorm2d``'s.
        dtype: as ``torch.nn.BatchNorm2d``'s.
        comm: a distopt Communicator, or anything with a ``.comm`` (a
            ``distopt.World``, a ``DistOpt``); None: at the first training
            forward, ``distopt.init()``'s world (the current one, else a new
            one: call ``distopt.init()`` before ``DistOpt(...)`` so both share
            it, or pass ``comm=``; under ``python -m distopt.launch`` a second
            shm communicator of the job cannot open).
        group: a process group (``distopt.comm.groups.Group``; anything with
            ``.comm``) to normalize over; its ``.comm`` is used as ``comm``.
        bias: as torch's keyword ``bias`` (False: no bias parameter).

    Raises:
        ValueError: ``comm`` and ``group`` both given; in forward: the input
            is not 2-D to 5-D or has not ``num_features`` channels (raised on
            every rank: the bad rank still joins the all-reduce, poisoning
            it), the global batch has at most one element per channel, or
            ``group`` has no communicator on this rank (not a member).
        CollectiveMismatchError: ranks disagree on the collective (different
            ``num_features``, a different number or order of layers, a rank
            inside ``DistOpt.join()`` that stopped training), on every rank.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, comm: Any = None, group: Any = None, device: Any = None,
                 dtype: Any = None, *, bias: bool = True) -> None:
        if comm is not None and group is not None:
            raise ValueError("SyncBatchNorm: pass comm= or group=, not both")
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         **extra)
        self._comm_ref = _CommRef(group if group is not None else comm, "group" if group is not None else "comm")

    def set_comm(self, comm: Any) -> None:
        """Use ``comm`` (a Communicator, or anything with ``.comm``) from the next training forward on."""
        self._comm_ref = _CommRef(comm, "comm")

    @property
    def comm(self) -> Communicator:
        """The communicator this layer reduces over (resolved now if it was not yet).

        Raises:
            ValueError, TypeError: as the constructor's ``comm``/``group``.
        """
        return self._comm_ref.get()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"SyncBatchNorm expects a 2-D to 5-D input (N, C[, L | H, W | D, H, W]), got a "
                             f"{input.dim()}-D input of shape {tuple(input.shape)}")

    def _problem(self, x: torch.Tensor) -> str | None:
        """What is wrong with ``x`` for this layer, or None."""
        if not 2 <= x.dim() <= 5:
            return (f"expects a 2-D to 5-D input (N, C[, L | H, W | D, H, W]), got a {x.dim()}-D input of shape "
                    f"{tuple(x.shape)}")
        if x.shape[1] != self.num_features:
            return f"expects {self.num_features} channels (dim 1), got input of shape {tuple(x.shape)}"
        if not x.is_floating_point():
            return f"expects a floating-point input, got {x.dtype}"
        return None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` (see the class docs); collective in training mode (one all-reduce)."""
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked.item())
        if not self.training:  # running statistics, or the local batch without them: no communication
            self._check_input_dim(input)
            use_batch = self.running_mean is None and self.running_var is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch, factor, self.eps)
        comm = self.comm
        if comm.size == 1:
            self._check_input_dim(input)
            stats = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
            return F.batch_norm(input, *stats, self.weight, self.bias, True, factor, self.eps)
        mean, var, count = self._global_stats(input, comm)
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, invstd, count, comm,
                                            self._what())

    def _what(self) -> str:
        return f"SyncBatchNorm({self.num_features})"

    def _global_stats(self, x: torch.Tensor, comm: Communicator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The global per-channel mean and biased variance (float64) and the global count, in ONE all-reduce.

        A rank whose input is unusable still joins the all-reduce with a NaN count, so every rank raises.
        """
        channels = self.num_features
        problem = self._problem(x)
        device = x.device if problem is None else torch.device("cpu")
        packed = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
        if problem is None:
            dims, _ = _shape(x)
            with torch.no_grad():
                x64 = x.detach().to(torch.float64)
                packed[:channels] = x64.sum(dims)
                packed[channels:2 * channels] = (x64 * x64).sum(dims)
                packed[-1] = float(x.numel() // channels) if channels else 0.0
        else:
            packed[-1] = float("nan")
        total = _all_reduce(comm, packed, f"{self._what()} forward")
        count = float(total[-1])
        if problem is not None:
            raise ValueError(f"{self._what()} on rank {comm.rank} {problem}")
        if count != count:  # NaN: another rank's input was unusable
            raise ValueError(f"{self._what()}: another rank's input was unusable (see its error); this rank's "
                             f"input has shape {tuple(x.shape)}")
        if count <= 1:
            raise ValueError(f"{self._what()}: expected more than 1 value per channel over all ranks when "
                             f"training, got {int(count)} (input shape on rank {comm.rank}: {tuple(x.shape)})")
        mean = total[:channels] / count
        var = (total[channels:2 * channels] / count - mean * mean).clamp_(min=0.0)
        return mean, var, count


def convert_sync_batchnorm(module: torch.nn.Module, comm: Any = None, group: Any = None) -> torch.nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` (and ``torch.nn.SyncBatchNorm``) in ``module`` by :class:`SyncBatchNorm`.

    As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the new layers take
    the old ones' parameter and buffer tensors themselves (values, device,
    dtype, ``requires_grad``), ``num_features``, ``eps``, ``momentum``,
    ``affine``, ``track_running_stats``, training mode and ``qconfig``.
    Layers that are already distopt SyncBatchNorm are kept as they are.

    Args:
        module: a model, or one BatchNorm layer.
        comm: as :class:`SyncBatchNorm`'s (one for every layer).
        group: as :class:`SyncBatchNorm`'s (one for every layer).

    Returns:
        ``module`` with its children replaced in place, or the new layer when
        ``module`` itself is a BatchNorm layer.

    Raises:
        ValueError: ``comm`` and ``group`` both given; an uninitialized lazy
            BatchNorm (run one forward before converting).
    """
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"convert_sync_batchnorm: {type(module).__name__} is not initialized yet; run one "
                             "forward pass before converting")
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, comm=comm, group=group,
                            bias=module.bias is not None or not module.affine)
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, comm, group))
    return out


def has_sync_batchnorm(module: Any) -> bool:
    """True if ``module`` (a ``torch.nn.Module``, or anything else: False) contains a :class:`SyncBatchNorm`;
    for ``DistOpt.join()`` to refuse, on every rank alike, a model it cannot shadow."""
    modules = getattr(module, "modules", None)
    return callable(modules) and any(isinstance(m, SyncBatchNorm) for m in modules())
