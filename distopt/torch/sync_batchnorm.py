"""Synchronized batch normalization: BatchNorm statistics over the global batch of every rank.

Batch normalization (Ioffe & Szegedy 2015, "Batch Normalization: Accelerating Deep Network Training by Reducing
Internal Covariate Shift") normalizes each channel by the mean and variance of the batch. In data parallel training
each rank sees only its own part of the batch; :class:`SyncBatchNorm` computes the statistics over the concatenation
of every rank's batch, as ``torch.nn.SyncBatchNorm`` does (its forward and backward formulas; torch's own class runs
on CUDA only), but over any distopt communicator (mpi, shm, torch, nccl, single), on CPU tensors as well.

Collectives per layer and training step, on the layer's communicator:

* forward: ONE all-reduce (sum) of ``2 * C + 1`` float64 values: the per-channel sums, the per-channel sums of
  squares and the element count;
* backward (only when the input needs a gradient, as torch): ONE all-reduce of ``2 * C`` float64 values: the
  per-channel sums of the output gradient and of the output gradient times ``x - mean``.

Every rank calls them in the same order (same model, same forward), also with a zero-size local batch (it contributes
zero sums and a zero count). Eval mode (running statistics) communicates nothing; neither does a world of one rank
(plain ``F.batch_norm``). Weight and bias gradients are this rank's contributions (summed over its own samples), so
averaging them over ranks (``DistOpt``, DDP) gives the single-process gradient of the mean loss.

Not supported inside ``DistOpt.join()`` once a rank has left its loop (as with PyTorch's DDP ``join()``): the joined
rank runs no forward, so its shadow collectives differ and every rank raises
:class:`~distopt.errors.CollectiveMismatchError` (with the explanation on the training ranks) instead of hanging.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm.base import Communicator
from .sync_stats import CommRef, sync_train

__all__ = ["SyncBatchNorm", "SyncForward", "convert_sync_batchnorm", "has_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank, for 2-D to 5-D inputs (``torch.nn.SyncBatchNorm``).

    Shapes: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` in, the same shape out; ``N`` may
    differ across ranks and be 0 on some. Any floating dtype (statistics are summed and all-reduced in float64; the
    output has the input's dtype), CPU or CUDA (CUDA statistics travel through host memory unless the backend is nccl
    or torch). In training mode the mean and the biased variance over all ranks' elements normalize the input;
    ``running_mean``/``running_var`` are updated with the global mean and the UNBIASED global variance (global count
    ``n``, factor ``n / (n - 1)``) by ``momentum`` (None: cumulative average), identically on every rank. Eval mode
    uses the running statistics (no communication), or the local batch with ``track_running_stats=False``, as torch.

    Args:
        num_features: ``C``.
        eps: as ``torch.nn.BatchNorm2d``'s.
        momentum: as ``torch.nn.BatchNorm2d``'s (None: cumulative average).
        affine: as ``torch.nn.BatchNorm2d``'s.
        track_running_stats: as ``torch.nn.BatchNorm2d``'s.
        device: as ``torch.nn.BatchNorm2d``'s.
        dtype: as ``torch.nn.BatchNorm2d``'s.
        comm: a distopt Communicator, or anything with a ``.comm`` (a ``distopt.World``, a ``DistOpt``); None: at the
            first training forward, ``distopt.init()``'s world (the current one, else a new one: call
            ``distopt.init()`` before ``DistOpt(...)`` so both share it, or pass ``comm=``).
        group: a process group (``distopt.comm.groups.Group``; anything with ``.comm``) to normalize over, as ``comm``.
        bias: as torch's keyword ``bias`` (False: no bias parameter).

    Raises:
        ValueError: ``comm`` and ``group`` both given; in forward: the input is not 2-D to 5-D or has not
            ``num_features`` channels (raised on every rank: the bad rank still joins the all-reduce, poisoning it),
            the global batch has at most one element per channel, or this rank is not a member of ``group``.
        CollectiveMismatchError: ranks disagree on the collective (different ``num_features``, a different number or
            order of layers, a rank inside ``DistOpt.join()`` that stopped training), on every rank.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, comm: Any = None, group: Any = None, device: Any = None,
                 dtype: Any = None, *, bias: bool = True) -> None:
        if comm is not None and group is not None:
            raise ValueError("SyncBatchNorm: pass comm= or group=, not both")
        extra = {} if bias else {"bias": False}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype, **extra)
        self._comm_ref = CommRef(group if group is not None else comm, "group" if group is not None else "comm")

    def set_comm(self, comm: Any) -> None:
        """Use ``comm`` (a Communicator, or anything with ``.comm``) from the next training forward on."""
        self._comm_ref = CommRef(comm, "comm")

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
        stats = (self.running_mean, self.running_var) if self.track_running_stats else (None, None)
        if comm.size == 1:
            self._check_input_dim(input)
            return F.batch_norm(input, *stats, self.weight, self.bias, True, factor, self.eps)
        return sync_train(self, input, *stats, self.weight, self.bias, factor, self.eps, comm,
                          f"SyncBatchNorm({self.num_features})")


class _RouteBatchNorm(torch.overrides.TorchFunctionMode):
    """During one training forward of a converted BatchNorm subclass (per thread), send its training-mode
    ``F.batch_norm`` calls given the layer's own weight or running statistics through ``sync_stats.sync_train``."""

    def __init__(self, layer: Any, comm: Communicator) -> None:
        super().__init__()
        self.layer, self.comm, self.routed = layer, comm, 0
        self.own = [id(t) for t in (layer.weight, layer.bias, layer.running_mean, layer.running_var) if t is not None]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            call = _batch_norm_args(*args, **kwargs)
            if call["training"] and any(id(call[k]) in self.own for k in ("weight", "bias", "running_mean",
                                                                           "running_var") if call[k] is not None):
                self.routed += 1
                return sync_train(self.layer, call["input"], call["running_mean"], call["running_var"],
                                   call["weight"], call["bias"], call["momentum"], call["eps"], self.comm,
                                   f"{type(self.layer).__name__}({self.layer.num_features})")
        return func(*args, **kwargs)


def _batch_norm_args(input: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
                     training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> dict[str, Any]:
    return {"input": input, "running_mean": running_mean, "running_var": running_var, "weight": weight,
            "bias": bias, "training": training, "momentum": momentum, "eps": eps}


class SyncForward:
    """What :func:`convert_sync_batchnorm` adds to a BatchNorm subclass with a ``forward`` of its own (timm's
    ``BatchNormAct2d``: norm, then drop and activation): the class made is a subclass of the user's class, named
    ``Sync<Name>``, whose training forward runs the user's ``forward`` with its ``F.batch_norm`` call reduced over
    every rank (as :class:`SyncBatchNorm`'s; the rest of the forward, the activation included, runs unchanged). Eval
    mode and a world of one rank run the user's ``forward`` as it is.

    Raises (in a training forward, on every rank alike):
        TypeError: the user's ``forward`` did not call ``torch.nn.functional.batch_norm`` with the layer's own
            weight, bias or running statistics (so distopt cannot synchronize it), naming the class.
    """

    _comm_ref: CommRef
    _unsynced: type
    set_comm = SyncBatchNorm.set_comm
    comm = SyncBatchNorm.comm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The user's ``forward``, its batch statistics over every rank in training mode (collective)."""
        run = super().forward  # type: ignore[misc]
        if not self.training or self.comm.size == 1:  # type: ignore[attr-defined]
            return run(*args, **kwargs)
        route = _RouteBatchNorm(self, self.comm)
        with route:
            out = run(*args, **kwargs)
        if not route.routed:
            raise TypeError(f"convert_sync_batchnorm: {self._unsynced.__module__}.{self._unsynced.__qualname__}."
                            "forward does not call torch.nn.functional.batch_norm with the layer's own weight or "
                            "running statistics, so its batch statistics cannot be synchronized; give it a "
                            "forward that does (or calls super().forward), or keep it out of the conversion")
        return out

    def __reduce_ex__(self, protocol: int) -> Any:
        """Pickled as the user's class made synchronized again on load (the class made here has no import path); its
        communicator does not travel (``set_comm`` after loading, as :class:`SyncBatchNorm`)."""
        return (_new_synced, (self._unsynced,), self.__getstate__())  # type: ignore[attr-defined]


_SYNCED: dict[type, type] = {}


def _synced_class(cls: type) -> type:
    """The ``Sync<Name>`` subclass of ``cls`` (:class:`SyncForward` first in its MRO), made once per class."""
    made = _SYNCED.get(cls)
    if made is None:
        made = _SYNCED[cls] = type(f"Sync{cls.__name__}", (SyncForward, cls),
                                   {"__module__": cls.__module__, "_unsynced": cls,
                                    "__doc__": f"{cls.__name__}, synchronized by distopt.convert_sync_batchnorm "
                                               "(see distopt.torch.sync_batchnorm.SyncForward)."})
    return made


def _new_synced(cls: type) -> Any:
    return _synced_class(cls).__new__(_synced_class(cls))


def convert_sync_batchnorm(module: torch.nn.Module, comm: Any = None, group: Any = None) -> torch.nn.Module:
    """Replace every ``nn.BatchNorm1d/2d/3d`` (and ``torch.nn.SyncBatchNorm``) in ``module`` by :class:`SyncBatchNorm`.

    As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the new layers take the old ones' parameter and buffer
    tensors themselves (values, device, dtype, ``requires_grad``), ``num_features``, ``eps``, ``momentum``,
    ``affine``, ``track_running_stats``, training mode and ``qconfig``. distopt's own SyncBatchNorm layers are kept.

    A BatchNorm subclass whose ``forward`` is its own (timm's ``BatchNormAct2d``) keeps it: the layer stays the same
    object, its class becomes ``Sync<Name>`` (:class:`SyncForward`, as timm's ``SyncBatchNormAct``). Subclasses
    without a ``forward`` of their own become :class:`SyncBatchNorm`, as torch's do.

    Args:
        module: a model, or one BatchNorm layer.
        comm: as :class:`SyncBatchNorm`'s (one for every layer).
        group: as :class:`SyncBatchNorm`'s (one for every layer).

    Returns:
        ``module`` with its children replaced in place, or the new layer when ``module`` itself is a BatchNorm layer.

    Raises:
        ValueError: ``comm`` and ``group`` both given; an uninitialized lazy BatchNorm (run one forward first).
    """
    if comm is not None and group is not None:
        raise ValueError("convert_sync_batchnorm: pass comm= or group=, not both")
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, SyncForward)):
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ValueError(f"convert_sync_batchnorm: {type(module).__name__} is not initialized yet; run one "
                             "forward pass before converting")
        if type(module).forward in (_BatchNorm.forward, torch.nn.SyncBatchNorm.forward):  # SyncBatchNorm's own
            out = _replacement(module, comm, group)
        else:  # a forward of its own (norm + activation): kept, its batch norm synchronized
            module.__class__ = _synced_class(type(module))
            module._comm_ref = CommRef(group if group is not None else comm, "group" if group is not None else "comm")
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, comm, group))
    return out


def _replacement(module: Any, comm: Any, group: Any) -> SyncBatchNorm:
    """A :class:`SyncBatchNorm` holding ``module``'s tensors and settings (see :func:`convert_sync_batchnorm`)."""
    out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                        module.track_running_stats, comm=comm, group=group,
                        bias=module.bias is not None or not module.affine)
    if module.affine:
        out.weight, out.bias = module.weight, module.bias
    out.running_mean, out.running_var = module.running_mean, module.running_var
    out.num_batches_tracked, out.training = module.num_batches_tracked, module.training
    if hasattr(module, "qconfig"):
        out.qconfig = module.qconfig
    return out


def has_sync_batchnorm(module: Any) -> bool:
    """True if ``module`` (a ``torch.nn.Module``, or anything else: False) contains a :class:`SyncBatchNorm`; for
    ``DistOpt.join()`` to refuse, on every rank alike, a model it cannot shadow."""
    modules = getattr(module, "modules", None)
    return callable(modules) and any(isinstance(m, (SyncBatchNorm, SyncForward)) for m in modules())
