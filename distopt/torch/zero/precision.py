"""Mixed precision (``DistOpt(opt, zero=0|1|2|3, model=m, param_dtype=..., reduce_dtype=...)``): the policy, and its
meaning at ``zero=3``.

The meaning of PyTorch FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``fully_shard``'s
``_fsdp_param.py`` and ``_fsdp_collectives.py``) at every stage: float32 masters (whole at ``zero=0``, this rank's
pieces at ``zero=1|2``, its segments at ``zero=3``) that the optimizer steps, forward and backward in ``param_dtype``,
gradients reduced in ``reduce_dtype``. Below ``zero=3`` the model's parameters hold ``param_dtype`` copies of the
masters between steps, which a step refreshes (at ``zero=1|2`` the parameters' all-gather moves ``param_dtype``):
:mod:`distopt.torch.mixed` and :mod:`distopt.torch.zero.mixed_step`. At ``zero=3``, on
:class:`~distopt.torch.zero.params.ParamShards`:

* the parameters this rank keeps (its segments, the *masters*) stay in their own dtype, float32 typically; the
  optimizer steps them, and its state is in that dtype;
* a module's forward and backward see ``param_dtype`` copies: each bucket's segments are cast to ``param_dtype`` and
  the all-gather moves ``param_dtype`` (half the bytes of float32 for bfloat16 or float16). At rest the parameters
  hold one element of ``param_dtype`` (a parameter's dtype changing between two uses in one forward would give it
  two gradient accumulators in autograd);
* the model's floating-point inputs are cast to ``param_dtype`` before its forward (FSDP2's
  ``cast_forward_inputs=True``, applied to the model given as ``model=``);
* each gradient (``param_dtype``, from backward) is cast to ``reduce_dtype`` as it is packed into its bucket, reduced
  (reduce-scattered) and averaged in ``reduce_dtype``, then cast to the masters' dtype for the optimizer.
  ``reduce_dtype=None`` reduces in ``param_dtype``, as FSDP2; ``reduce_dtype`` alone (no ``param_dtype``) computes in
  the parameters' dtype and reduces in ``reduce_dtype``;
* ``summon_full_params()``, ``model.state_dict()`` and ``model.load_state_dict()`` gather and write the masters (as
  FSDP's full-precision state dicts); inside them, and while the optimizer's state is saved or loaded, the
  parameters have the masters' dtype.

FSDP2's rules on dtypes hold: ``param_dtype`` equal to the parameters' dtype casts nothing, and only floating-point
parameters and inputs are cast. Inside ``no_sync()`` gradients accumulate in ``param_dtype`` (FSDP2 accumulates them
in ``reduce_dtype``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MixedPrecision", "mixed_precision"]


def _floating(name: str, dtype: Any) -> Any:
    import torch  # imported here: ``import distopt`` does not import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point torch.dtype (torch.bfloat16, torch.float16, "
                         f"torch.float32), got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class MixedPrecision:
    """A resolved mixed-precision policy (see the module docs).

    Attributes:
        param_dtype: the dtype of the parameters in forward and backward and of the all-gather; None: the
            parameters' own.
        reduce_dtype: the dtype gradients are reduced in; None: ``param_dtype`` (or the parameters' own).
    """

    param_dtype: Any = None
    reduce_dtype: Any = None

    def compute(self, dtype: Any) -> Any:
        """The dtype a parameter of ``dtype`` has in forward and backward (gathered)."""
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    def reduce(self, dtype: Any) -> Any:
        """The dtype the gradient of a parameter of ``dtype`` is reduced in (its bucket's dtype)."""
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype if self.reduce_dtype is not None else self.compute(dtype)

    def cast_inputs(self, module: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:  # noqa: ARG002
        """A forward pre-hook (``with_kwargs=True``): the floating-point tensors among the inputs cast to
        ``param_dtype`` (FSDP2's ``cast_forward_inputs``)."""
        import torch

        dtype = self.param_dtype

        def cast(x: Any) -> Any:
            return x.to(dtype) if dtype is not None and x.is_floating_point() and x.dtype != dtype else x

        return torch.utils._pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))


def mixed_precision(param_dtype: Any, reduce_dtype: Any, zero: int,  # noqa: ARG001 (every stage takes it)
                    torch_optimizer: bool) -> MixedPrecision | None:
    """The policy of ``DistOpt(param_dtype=, reduce_dtype=)``; None when both are None.

    Args:
        param_dtype: the dtype of forward, backward and the all-gather (a floating-point ``torch.dtype``) or None.
        reduce_dtype: the dtype of the gradients' reduction (a floating-point ``torch.dtype``) or None.
        zero: the sharding stage (every stage takes a policy; ``model=`` is checked by
            :func:`~distopt.torch.zero.state.torch_sharding`).
        torch_optimizer: DistOpt wraps a ``torch.optim.Optimizer``.

    Raises:
        TypeError: an array optimizer (its arrays are the caller's: distopt cannot keep two copies of them).
        ValueError: a dtype that is not a floating-point ``torch.dtype``.
    """
    if param_dtype is None and reduce_dtype is None:
        return None
    if not torch_optimizer:
        raise TypeError("param_dtype= and reduce_dtype= (mixed precision) need a torch.optim.Optimizer inside DistOpt "
                        "and model=; an array optimizer's parameters are the caller's arrays: keep them in the dtype "
                        "to train in")
    return MixedPrecision(None if param_dtype is None else _floating("param_dtype", param_dtype),
                          None if reduce_dtype is None else _floating("reduce_dtype", reduce_dtype))

