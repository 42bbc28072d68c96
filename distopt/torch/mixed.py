"""Mixed precision below ``zero=3`` (``DistOpt(opt, zero=0|1|2, model=m, param_dtype=, reduce_dtype=)``).

The policy is :mod:`distopt.torch.zero.precision`'s (FSDP2's ``MixedPrecisionPolicy``); this module holds what every
stage shares and the replicated stage's gradient sink, :class:`MixedSink`:

* :class:`LowCopies`: the model's floating-point parameters keep their identity, but at rest their data is a
  ``param_dtype`` copy of the masters (forward and backward run in it); inside a *span* (``model.state_dict()``,
  ``model.load_state_dict()``, ``summon_full_params()``, the optimizer's state dicts at ``zero=1|2``) their data is
  the masters' dtype, and what a span wrote is cast into the copies when it ends (:class:`MixedSpans`);
* :func:`stand_ins`: the arrays that lay out the buckets have the gradients' reduction dtype (``reduce_dtype``), so
  each gradient is cast as it is packed into its bucket; :meth:`MixedSink.reduced_into` gives the reduction copies
  of the gradients in that dtype to average into (a ``param_dtype`` gradient cannot hold the float32 average);
* ``zero=0`` (:class:`MixedSink`): the masters are whole, one float32 tensor per parameter, and they are what the
  inner optimizer's parameter groups hold (its state, ``state_dict()``, LR schedulers, ``GradScaler`` and
  ``opt.clip_grad_norm_`` see them); each master's ``.grad`` receives the average cast to the masters' dtype, and
  after the update every copy is the cast of its master. The parameters' own ``.grad`` keeps this rank's
  ``param_dtype`` gradient until ``zero_grad()``. At ``zero=1|2`` the masters are this rank's pieces
  (:mod:`distopt.torch.zero.mixed_step`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from ..core._array import xp_of
from .adapter import TorchOptimizer, as_array, as_tensor
from .sink import GradientSink

__all__ = ["LowCopies", "MixedSpans", "MixedSink", "stand_in", "stand_ins", "reduce_copies", "cast_segments", "hook_model"]


def stand_in(tensor: Any, dtype: Any, shape: Sequence[int]) -> Any:
    """A read-only array of ``shape`` holding one element of torch ``dtype`` on ``tensor``'s device (the engine lays
    the buckets out by shapes and dtypes)."""
    import torch

    one = as_array(torch.zeros((), dtype=dtype, device=tensor.device))
    return xp_of(one).broadcast_to(one, tuple(shape))


def stand_ins(precision: Any, tensors: Sequence[Any]) -> list[Any]:
    """:func:`stand_in` of each of ``tensors`` in its gradients' reduction dtype under ``precision``."""
    return [stand_in(t, precision.reduce(t.dtype), t.shape) for t in tensors]


def reduce_copies(precision: Any, tensor: Any, grads: list[Any]) -> list[Any]:
    """Copies of ``grads`` (arrays, None where absent) in the dtype ``tensor``'s gradient is reduced in under
    ``precision``: the reduction averages into them."""
    import torch

    dtype = as_array(torch.empty(0, dtype=precision.reduce(tensor.dtype), device=tensor.device)).dtype
    return [None if g is None else g.astype(dtype) for g in grads]


def cast_segments(step: Any, dtype: Any) -> None:
    """Each reduced segment of a sharded step (``reduce_dtype``) cast to ``dtype``, the masters' (as FSDP2 casts the
    reduce-scatter's output to the parameters' dtype); a no-op where they agree."""
    for run in step.runs:
        if run.segment is not None and run.segment.dtype != dtype:
            run.segment = run.segment.astype(dtype)


def one_dtype(tensors: Sequence[Any]) -> Any:
    """The dtype of the floating-point ``tensors`` (None without any).

    Raises:
        ValueError: they have several (the masters are one dtype, as FSDP2 requires).
    """
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError("param_dtype=/reduce_dtype= need every trained parameter in one dtype (the masters'), "
                         f"as FSDP2 does; these have {sorted(str(d) for d in dtypes)}")
    return next(iter(dtypes), None)


class LowCopies:
    """The model's floating-point parameters as ``param_dtype`` copies of their masters (see the module docs).

    Args:
        params: the optimizer's parameters (still holding the masters' values).
        precision: the :class:`~distopt.torch.zero.precision.MixedPrecision` policy.

    Attributes:
        tensors: the parameters that get a copy (none when ``param_dtype`` is the masters' dtype or None).
        low: after :meth:`cast`, each one's ``param_dtype`` data (what it holds at rest).
        master_dtype: the masters' torch dtype (None without floating-point parameters).

    Raises:
        ValueError: as :func:`one_dtype`.
    """

    def __init__(self, params: Sequence[Any], precision: Any) -> None:
        self.master_dtype = one_dtype(params)
        self.dtype = None if self.master_dtype is None else precision.compute(self.master_dtype)
        self.tensors = [p for p in params if p.is_floating_point()] if self.dtype != self.master_dtype else []
        self.low: list[Any] = []

    def cast(self) -> None:
        """Give each parameter its ``param_dtype`` copy as its data (once the masters were taken from it)."""
        for t in self.tensors:
            t.data = t.detach().to(self.dtype)
            self.low.append(t.data)

    def show(self, fulls: Sequence[Any]) -> None:
        """Make ``fulls[i]`` (masters' dtype, each parameter's shape) the data of parameter ``i``."""
        for t, full in zip(self.tensors, fulls):
            t.data = full

    def hide(self, fulls: Sequence[Any] | None) -> None:
        """Give the parameters their copies back, first cast from ``fulls`` when given (written in a span)."""
        import torch

        with torch.no_grad():
            for t, low, full in zip(self.tensors, self.low, fulls or [None] * len(self.low)):
                if full is not None:
                    low.copy_(full)
                t.data = low


def hook_model(model: Any, precision: Any, spans: MixedSpans, handles: list[Any]) -> None:
    """``model``'s floating-point inputs cast to ``param_dtype`` (FSDP2's ``cast_forward_inputs``), and every module's
    ``state_dict()``/``load_state_dict()`` in a span of the masters (as ``zero=3``'s); the handles go to ``handles``."""
    if precision.param_dtype is not None:
        handles.append(model.register_forward_pre_hook(precision.cast_inputs, with_kwargs=True))
    for module in model.modules():
        handles.append(module.register_state_dict_pre_hook(lambda *args: spans.enter(True)))
        handles.append(module.register_state_dict_post_hook(lambda *args: spans.leave(False)))
        handles.append(module.register_load_state_dict_pre_hook(lambda *args: spans.enter(True)))
        handles.append(module.register_load_state_dict_post_hook(lambda *args: spans.leave(True)))


class MixedSpans(ABC):
    """Spans in which the model's parameters hold the masters (:class:`LowCopies`); they nest, the outermost decides.
    A sink mixing it in provides :meth:`fulls` and :meth:`written`."""

    copies: LowCopies
    _depth = 0
    _fulls: list[Any] | None = None

    @abstractmethod
    def fulls(self, values: bool) -> list[Any]:
        """The masters whole, one per parameter of :attr:`LowCopies.tensors` (``values``: False when only their
        dtype matters: no gather)."""

    def written(self, fulls: Sequence[Any]) -> None:
        """A span that may have written ``fulls`` ended (nothing to do where they are the masters themselves)."""

    def enter(self, values: bool) -> None:
        """Enter a span (``values``: the parameters hold the masters' values; collective at ``zero=1|2``)."""
        self._depth += 1
        if self._depth == 1 and self.copies.tensors:
            self._fulls = self.fulls(values)
            self.copies.show(self._fulls)

    def leave(self, write: bool) -> None:
        """Leave a span; ``write``: what it wrote is kept (in the masters and, cast, in the copies)."""
        self._depth = max(0, self._depth - 1)
        if self._depth or self._fulls is None:
            return
        fulls, self._fulls = self._fulls, None
        if write:
            self.written(fulls)
        self.copies.hide(fulls if write else None)

    @contextmanager
    def full_parameters(self, writeback: bool, modifier_rank: int | None, comm: Any,
                        params: Sequence[Any]) -> Iterator[None]:
        """``summon_full_params()``: the masters whole inside (their dtype, as FSDP's), what the block wrote kept
        with ``writeback`` (:meth:`GradientSink.full_parameters`)."""
        self.enter(True)
        try:
            with super().full_parameters(writeback, modifier_rank, comm, params):  # type: ignore[misc]
                yield
        finally:
            self.leave(writeback)


class MixedSink(MixedSpans, GradientSink):
    """``zero=0``'s gradient sink with mixed precision (see the module docs).

    Args:
        local: the torch local optimizer.
        model: the ``torch.nn.Module`` given as ``model=``.
        precision: the :class:`~distopt.torch.zero.precision.MixedPrecision` policy.
    """

    densify = True  # a sparse gradient is cast and reduced in its bucket too

    def __init__(self, local: TorchOptimizer, model: Any, precision: Any) -> None:
        self.local, self.model, self.precision = local, model, precision
        self.copies = LowCopies(local.params(), precision)
        self.masters: dict[int, Any] = {}
        self._engine: Any = None
        self._known: list[int] = []

    def master(self, tensor: Any) -> Any:
        """The master of a parameter (itself where it has no ``param_dtype`` copy)."""
        return self.masters.get(id(tensor), tensor)

    def bind(self, follower: Any) -> None:
        """Take the masters from the parameters (rank 0's by now), put them in the inner optimizer's groups, give the
        parameters their copies, and hook the model."""
        optimizer = self.local.optimizer
        self.masters = {id(t): t.detach().clone() for t in self.copies.tensors}
        for t in self.copies.tensors:
            if t in optimizer.state:  # a state loaded before the wrap
                optimizer.state[self.master(t)] = optimizer.state.pop(t)
        self.local.real_groups = [list(group["params"]) for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [self.master(p) for p in group["params"]]
        self.copies.cast()
        self._engine = follower.runner.engine
        follower.planned()  # the engine knows its stand-ins (arrays)
        self.local.held_param_bytes = lambda: sum(int(m.nbytes) for m in self.masters.values())
        hook_model(self.model, self.precision, self, self.local.handles)

    def arrays(self, tensors: Sequence[Any]) -> list[Any]:
        """Stand-ins of the parameters' shapes in their reduction dtype (:func:`stand_in`); a new list of tensors
        (``requires_grad`` changed) is known to the engine at once: its values are rank 0's already, and a stand-in
        takes no broadcast."""
        arrays = stand_ins(self.precision, tensors)
        if self._engine is not None and [id(t) for t in tensors] != self._known:
            self._known = [id(t) for t in tensors]
            self._engine.known(arrays)
        return arrays

    def reduced_into(self, grads: list[Any]) -> list[Any]:
        """Copies of the gradients in ``reduce_dtype``: the reduction averages into them."""
        first = next((p for p in self.local.params() if p.is_floating_point()), None)
        if first is None or (not self.masters and self.precision.reduce_dtype is None):
            return grads
        return reduce_copies(self.precision, first, grads)

    def adopt(self, pipeline: Any, tensors: Sequence[Any], grads: Sequence[Any], outcome: Any, skipped: bool,
              shadow: bool, views: Sequence[Any] | None) -> None:  # noqa: ARG002
        """Each master's ``.grad``: its parameter's average, cast to the masters' dtype (None where skipped)."""
        for t, g, ok in zip(tensors, grads, outcome.present):
            m = self.master(t)
            m.grad = None if skipped or not ok or g is None else as_tensor(g).view(m.shape).to(m.dtype)

    def after_step(self, applied: bool) -> None:
        """Cast the updated masters into the parameters' copies."""
        if applied:
            self.copies.hide([self.masters[id(t)] for t in self.copies.tensors])

    def before_zero_grad(self) -> None:
        """Drop the parameters' own ``param_dtype`` gradients (the inner ``zero_grad`` clears the masters')."""
        for t in self.copies.tensors:
            t.grad = None

    def fulls(self, values: bool) -> list[Any]:  # noqa: ARG002
        """The masters themselves."""
        return [self.masters[id(t)] for t in self.copies.tensors]

    def leave(self, write: bool) -> None:  # noqa: ARG002
        """Leave a span: the copies are cast from the masters again, whatever ``write`` says (a span writes the
        masters themselves, as ``zero=0`` without mixed precision keeps what ``summon_full_params`` wrote)."""
        super().leave(True)

    def clip_grad_norm_(self, params: Sequence[Any], max_norm: float, norm_type: float = 2.0) -> Any:
        """``torch.nn.utils.clip_grad_norm_`` over the masters of ``params`` (their float32 averaged gradients)."""
        import torch

        return torch.nn.utils.clip_grad_norm_([self.master(p) for p in params], max_norm, norm_type)

