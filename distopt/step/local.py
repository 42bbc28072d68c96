"""The local optimizer behind DistOpt, behind one interface. Two kinds exist: optimizers on arrays
(:class:`ArrayOptimizer`: :class:`distopt.SGD` or any object with ``update(param, grad)``), where the caller passes
parameters and gradients to every step, and PyTorch optimizers (:class:`distopt.torch.adapter.TorchOptimizer`), which
own their tensors. The step runner only talks to :class:`LocalOptimizer`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Sequence

__all__ = ["LocalOptimizer", "ArrayOptimizer", "checked_pairs"]

_HYPER = ("lr", "momentum", "weight_decay", "dampening", "nesterov", "betas", "eps")


class LocalOptimizer(ABC):
    """What DistOpt needs from a local optimizer."""

    def arrays(self) -> list[Any] | None:
        """The parameter arrays the optimizer owns (shared memory with the model), or None when the caller passes
        parameters to every step."""
        return None

    @abstractmethod
    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:
        """The momentum buffer of each parameter (None where there is none yet).

        Raises:
            ValueError: the optimizer has no momentum buffers at all.
        """

    @abstractmethod
    def momentum_factors(self) -> list[tuple[str, float]]:
        """``(where, value)`` of every momentum setting, e.g. ``("distopt.SGD.momentum", 0.9)``; empty for an
        optimizer without one (DGC refuses a non-zero one)."""

    @abstractmethod
    def hyper_parameters(self) -> list[dict[str, Any]]:
        """Per parameter group, the settings every rank must share (lr, momentum, weight decay, betas, eps, ...; not
        the parameters), compared across ranks in every step header."""

    def remember(self, params: Sequence[Any]) -> None:  # noqa: B027 (optional hook)
        """Record the shared parameter order (array models: from ``sync_params`` or a step)."""

    def detach(self) -> None:  # noqa: B027 (optional hook)
        """Remove the hooks DistOpt placed on the model and optimizer (array optimizers have none)."""

    def state_bytes(self) -> int:
        """BYTES of the optimizer's state (momentum buffers, moments); -1 when it cannot tell."""
        return -1

    def param_bytes(self) -> int:
        """BYTES of parameter memory the optimizer's parameters hold; -1 when it cannot tell."""
        return -1

    @abstractmethod
    def state_dict(self) -> Any:
        """The optimizer's state (None if it has none)."""

    @abstractmethod
    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict` output."""


class ArrayOptimizer(LocalOptimizer):
    """Local optimizer on arrays: anything with ``update(param, grad)`` (arrays updated in place). An array model's loss
    is any object whose ``backward()`` yields ``(param, grad)`` pairs; once the shared order is known (from
    ``sync_params`` or an earlier step) the pairs may arrive in any order."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.known: list[Any] | None = None

    def remember(self, params: Sequence[Any]) -> None:
        self.known = list(params)

    def backward(self, loss: Any) -> tuple[list[Any], list[Any]]:
        """Run ``loss.backward()``; return ``(params, grads)`` in the shared parameter order."""
        pairs = [(p, g) for p, g in loss.backward()]
        params, grads = [p for p, _ in pairs], [g for _, g in pairs]
        known = self.known
        if known is not None and len(params) == len(known):
            index_of = {id(p): i for i, p in enumerate(known)}
            if all(index_of.get(id(p)) is not None for p in params):  # arrival order -> the shared order
                ordered: list[Any] = [None] * len(params)
                for p, g in zip(params, grads):
                    ordered[index_of[id(p)]] = g
                return list(known), ordered
        return params, grads

    def overlapped_backward(self, loss: Any, begin: Callable[[list[Any]], Any]
                            ) -> tuple[list[Any], list[Any], Any] | None:
        """Run backward while handing each final gradient to a bucket pipeline.

        ``begin(params)`` returns the step's :class:`~distopt.step.pipeline.BucketPipeline` (a collective: every rank
        calls it at the same point). Returns ``(params, grads, pipeline)``, or None when the shared order is not known
        yet (nothing has run then).

        Raises:
            ValueError: a parameter outside the shared order arrived.
        """
        if self.known is None:
            return None
        params = self.known
        index_of = {id(p): i for i, p in enumerate(params)}
        pipeline = begin(params)
        grads: list[Any] = [None] * len(params)
        for p, g in loss.backward():
            i = index_of.get(id(p))
            if i is None or params[i] is not p:
                raise ValueError("with overlap=True an array model's parameter list must stay fixed; a new "
                                 "parameter appeared (use DistOpt(..., overlap=False) to change it)")
            grads[i] = g
            pipeline.ready(i, g)
        return params, grads, pipeline

    def apply(self, params: Sequence[Any], grads: Sequence[Any], present: Sequence[bool]) -> None:
        """Update the parameters whose ``present`` flag is True with the (averaged) gradients."""
        for p, g, ok in zip(params, grads, present):
            if ok and g is not None:
                self.opt.update(p, g)

    def momentum_arrays(self, params: Sequence[Any]) -> list[Any]:
        if not callable(getattr(self.opt, "momentum_buffer", None)):
            raise ValueError(f"average_momentum=True needs an optimizer with momentum_buffer(param); "
                             f"{type(self.opt).__name__} has none")
        return [self.opt.momentum_buffer(p) for p in params]

    def hyper_parameters(self) -> list[dict[str, Any]]:
        """One group: the optimizer's ``lr``, ``momentum``, ``weight_decay``, ``dampening``, ``nesterov``, ``betas``
        and ``eps`` attributes, those it has."""
        return [{k: getattr(self.opt, k) for k in _HYPER if hasattr(self.opt, k)}]

    def momentum_factors(self) -> list[tuple[str, float]]:
        if not hasattr(self.opt, "momentum"):
            return []
        kind = "distopt.SGD" if type(self.opt).__module__ == "distopt.optim" else type(self.opt).__name__
        return [(f"{kind}.momentum", float(self.opt.momentum))]

    def state_bytes(self) -> int:
        """The optimizer's ``state_bytes()`` (:class:`distopt.SGD` has one), else -1."""
        count = getattr(self.opt, "state_bytes", None)
        return int(count()) if callable(count) else -1

    def state_dict(self) -> Any:
        return self.opt.state_dict() if hasattr(self.opt, "state_dict") else None

    def load_state_dict(self, state: Any) -> None:
        if state is not None:
            self.opt.load_state_dict(state)


def checked_pairs(params: Sequence[Any], grads: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``(params, grads)`` as lists, checked: one gradient (or None) per parameter, of its shape.

    Raises:
        ValueError: the lengths or a shape differ (the message names the index).
    """
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"got {len(params)} params but {len(grads)} grads")
    for i, (p, g) in enumerate(zip(params, grads)):
        if g is not None and g.shape != p.shape:
            raise ValueError(f"grads[{i}] has shape {g.shape}, params[{i}] has shape {p.shape}")
    return params, grads
