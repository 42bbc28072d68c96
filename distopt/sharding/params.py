"""Stage 3 (``zero=3``): each rank keeps only its segment of every bucket's parameters.

ZeRO stage 3 (Rajbhandari, Rasley, Ruwase & He, SC 2020) and PyTorch FSDP
(Zhao et al., VLDB 2023), on distopt's bucket layout and shard plan
(:mod:`distopt.sharding.plan`; the same plan as stages 1 and 2):

* **at rest** every parameter of the layout is a 0-element tensor of its
  dtype and device (as FSDP's ``use_orig_params``) and this rank keeps its
  segment of each bucket (``segments[b]``: ``plan.counts[b][rank]``
  ELEMENTS), which the local optimizer updates through 1-D views;
* **gathering** bucket ``b`` re-allocates the storage of its flat buffer
  (``bucket.size`` elements), copies this rank's segment in, all-gathers
  the other ranks' segments and makes each parameter a view into the
  buffer; **freeing** it resizes that storage to 0 bytes and makes the
  parameters 0-element tensors again. Autograd's saved views of a
  parameter share the buffer's storage, so the values that backward reads
  are those of the re-gather before it;
* **units**: the first forward pass gathers everything and records which
  modules' forward ran. A module's unit is the buckets of the parameters of
  its subtree that are not in a descendant that ran (``nn.MultiheadAttention``
  reads its ``out_proj`` without calling it); a shared parameter (a tied
  head) is in the unit of every module that owns it;
* **forward**: a module's pre-hook frees the gathered buckets that no
  running module needs, gathers its unit and starts the next unit's gather
  (prefetch). When the outermost module returns, everything is freed but,
  with gradients on, the last unit's buckets, which backward needs first;
* **backward**: a hook on each module's outputs (``register_multi_grad_hook``)
  gathers the module's unit before its backward runs and prefetches the
  unit that ran before it. A bucket is freed once each of its parameters
  has its gradient (post-accumulate-grad hooks), as FSDP frees after a
  unit's backward; everything at the end of backward. A re-computation
  during backward (activation checkpointing) gathers without freeing.

A tensor that merely views a parameter but takes no gradient through it
(``x @ w.detach()``), read in backward after every parameter of its bucket
has its gradient, would read freed memory; FSDP has the same rule.
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..core._array import xp_of
from ..core.buckets import Bucket
from ..torch.adapter import as_array
from .plan import ShardPlan

__all__ = ["ParamShards", "raw_array"]

_FREE, _PENDING, _FULL = 0, 1, 2


def raw_array(tensor: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array over a contiguous tensor's memory that leaves its storage
    resizable (``Tensor.numpy()`` pins it); valid until the storage is resized."""
    dtype = as_array(tensor.new_empty(0)).dtype
    if tensor.is_cuda:
        import cupy

        memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.nbytes, tensor)
        return cupy.ndarray((tensor.numel(),), dtype, cupy.cuda.MemoryPointer(memory, 0))
    if tensor.numel() == 0:
        return np.zeros(0, dtype)
    return np.frombuffer((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()), dtype=dtype)


def _in_backward() -> bool:
    import torch

    return torch._C._current_graph_task_id() != -1


class ParamShards:
    """A stage-3 model's parameter segments, their gathers and frees, and the model hooks driving them.

    Args:
        comm: the communicator (``all_gather_into``; ``all_gather_into_async`` where it has one).
        counters: the step counters (``gather_bytes``, ``gathered_bytes_peak``).

    Attributes:
        tensors: the layout's parameters, in the step's order.
        shapes: ``id(parameter)`` -> its full shape.
        segments: per bucket, this rank's segment (a 1-D tensor).
        plan: the layout's :class:`~distopt.sharding.plan.ShardPlan`.
    """

    def __init__(self, comm: Any, counters: Any) -> None:
        self.comm, self.counters = comm, counters
        self.tensors: list[Any] = []
        self.buckets: list[Bucket] = []
        self.plan: ShardPlan | None = None
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.segments: list[Any] = []
        self._flats: list[Any] = []
        self._state: list[int] = []
        self._pending: dict[int, Any] = {}
        self._bucket_of: dict[int, int] = {}  # id(parameter) -> its bucket
        self._done: list[set[int]] = []  # per bucket: the parameters with their gradient in this backward
        self._context: Callable[[str], Any] | None = None
        self._gathered = 0
        self._peak = 0  # the most BYTES gathered at one time since the last step
        self._model: Any = None
        self._units: dict[int, tuple[int, ...]] | None = None  # id(module) -> its unit's buckets; None: not learnt
        self._fired: list[Any] = []
        self._next: dict[int, tuple[int, ...]] = {}
        self._prev: dict[int, tuple[int, ...]] = {}
        self._stack: list[Any] = []
        self._last: Any = None
        self._depth = 0  # nesting of state_dict / load_state_dict calls

    # ------------------------------------------------------------ segments
    def shard(self, tensors: Sequence[Any], buckets: Sequence[Bucket], plan: ShardPlan,
              context: Callable[[str], Any]) -> None:
        """Keep this rank's segment of every bucket of ``tensors`` (identical on every rank) and free them."""
        import torch

        self.tensors, self.buckets, self.plan, self._context = list(tensors), list(buckets), plan, context
        self.shapes = {id(t): tuple(t.shape) for t in self.tensors}
        rank = self.comm.rank
        for b, bucket in enumerate(self.buckets):
            first = self.tensors[bucket.slots[0].index]
            flat = torch.empty(bucket.size, dtype=first.dtype, device=first.device)
            with torch.no_grad():
                for s in bucket.slots:
                    flat[s.offset:s.offset + s.size].copy_(self.tensors[s.index].detach().reshape(-1))
                    self._bucket_of[id(self.tensors[s.index])] = b
            lo = plan.lows[b]
            self.segments.append(flat[lo:lo + plan.counts[b][rank]].clone())
            self._flats.append(flat)
            self._state.append(_FULL)
            self._gathered += flat.nbytes
            self._views(b)
        self._done = [set() for _ in self.buckets]
        self.free_all()

    def step_done(self) -> None:
        """At the end of a step: free everything and report the step's peak of gathered bytes."""
        self.free_all()
        self.counters.gathered_bytes_peak, self._peak = self._peak, self._gathered

    def held_bytes(self) -> int:
        """BYTES of this rank's segments."""
        return sum(int(s.nbytes) for s in self.segments)

    def _where(self, b: int) -> str:
        return f"zero=3 parameter all-gather, bucket {b + 1} of {len(self.buckets)}"

    def _start(self, b: int) -> None:
        """Start gathering bucket ``b`` (a no-op unless it is free)."""
        if self._state[b] != _FREE:
            return
        flat = self._flats[b]
        flat.untyped_storage().resize_(flat.nbytes)
        array = raw_array(flat)
        lo, counts = self.plan.lows[b], self.plan.counts[b]  # type: ignore[union-attr]
        array[lo:lo + counts[self.comm.rank]] = as_array(self.segments[b])
        native = getattr(self.comm, "all_gather_into_async", None)
        with self._context(self._where(b)):  # type: ignore[misc]
            if native is None:
                self.comm.all_gather_into(array, counts)
                handle = None
            else:
                handle = native(array, counts)
        self._pending[b] = handle
        self._state[b] = _PENDING
        self._gathered += flat.nbytes
        self.counters.gather_bytes += int(flat.nbytes)
        self._peak = max(self._peak, self._gathered)

    def _finish(self, b: int) -> None:
        """Complete bucket ``b``'s gather (starting it if free): its parameters are full views."""
        self._start(b)
        if self._state[b] != _PENDING:
            return
        handle = self._pending.pop(b)
        if handle is not None:
            with self._context(self._where(b)):  # type: ignore[misc]
                handle.wait()
        self._views(b)
        self._state[b] = _FULL

    def _views(self, b: int) -> None:
        flat = self._flats[b]
        for s in self.buckets[b].slots:
            self.tensors[s.index].data = flat[s.offset:s.offset + s.size].view(s.shape)

    def _free(self, b: int) -> None:
        """Free bucket ``b`` (completing a gather in flight first)."""
        import torch

        if self._state[b] == _PENDING:
            self._finish(b)
        if self._state[b] != _FULL:
            return
        for s in self.buckets[b].slots:
            t = self.tensors[s.index]
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        flat = self._flats[b]
        flat.untyped_storage().resize_(0)
        self._gathered -= flat.nbytes
        self._state[b] = _FREE

    def gather_all(self) -> None:
        """Gather every bucket (collective)."""
        for b in range(len(self.buckets)):
            self._start(b)
        for b in range(len(self.buckets)):
            self._finish(b)

    def free_all(self, keep: Sequence[int] = ()) -> None:
        """Free every bucket but ``keep``."""
        for b in range(len(self.buckets)):
            if b not in keep:
                self._free(b)

    def write_back(self) -> None:
        """Copy every gathered bucket's segment of this rank back into :attr:`segments` (the model's
        parameters were written: ``load_state_dict``, ``summon_full_params``)."""
        rank = self.comm.rank
        for b, flat in enumerate(self._flats):
            if self._state[b] == _FULL:
                lo = self.plan.lows[b]  # type: ignore[union-attr]
                self.segments[b].copy_(flat.detach()[lo:lo + self.plan.counts[b][rank]])  # type: ignore[union-attr]

    @contextmanager
    def full(self, writeback: bool) -> Iterator[None]:
        """Every parameter whole inside the block (collective on entry); with ``writeback``, what the block
        wrote into them is kept.

        Raises:
            RuntimeError: called inside a forward pass.
        """
        if self._stack:
            raise RuntimeError("summon_full_params() inside a forward pass of the model: call it between steps")
        self.gather_all()
        try:
            yield
        finally:
            if writeback:
                import torch

                with torch.no_grad():
                    self.write_back()
            self.free_all()

    # --------------------------------------------------------------- hooks
    def hook(self, model: Any) -> list[Any]:
        """Forward pre- and post-hooks on every module of ``model`` holding a parameter of the layout,
        post-accumulate-grad hooks on the layout's parameters, and state-dict hooks (``state_dict``
        returns whole tensors, ``load_state_dict`` writes the segments). Returns the hook handles."""
        self._model = model
        handles = []
        for module in model.modules():
            if any(id(p) in self._bucket_of for p in module.parameters()):
                handles.append(module.register_forward_pre_hook(self._pre_forward))
                handles.append(module.register_forward_hook(self._post_forward, always_call=True))
            handles.append(module.register_state_dict_pre_hook(self._before_state_dict))
            handles.append(module.register_state_dict_post_hook(  # torch marks the hook: a function, not a method
                lambda *args: self._after_state_dict(*args)))
            handles.append(module.register_load_state_dict_pre_hook(self._before_load))
            handles.append(module.register_load_state_dict_post_hook(self._after_load))
        for t in self.tensors:
            handles.append(t.register_post_accumulate_grad_hook(self._grad_done))
        return handles

    def _unit(self, module: Any) -> tuple[int, ...]:
        """The buckets ``module`` needs whole while it runs."""
        units = self._units
        if units is not None and id(module) in units:
            return units[id(module)]
        unit = tuple(sorted({self._bucket_of[id(p)] for p in module.parameters() if id(p) in self._bucket_of}))
        if units is not None:
            units[id(module)] = unit  # a module that did not run in the first forward: its whole subtree
        return unit

    def _learn(self) -> None:
        """Units and the prefetch order from the first forward's modules (see the module docs)."""
        fired = {id(m) for m in self._fired}
        units: dict[int, set[int]] = {}

        def walk(module: Any, owner: Any) -> None:
            owner = module if id(module) in fired else owner
            for p in module.parameters(recurse=False):
                if id(p) in self._bucket_of:
                    units.setdefault(id(owner), set()).add(self._bucket_of[id(p)])
            for child in module.children():
                walk(child, owner)

        walk(self._model, self._model)
        self._units = {k: tuple(sorted(v)) for k, v in units.items()}
        order = [self._units[id(m)] for m in self._fired if self._units.get(id(m))]
        for i, m in enumerate(m for m in self._fired if self._units.get(id(m))):
            self._next[id(m)] = self._ahead(order[i], order[i + 1:])
            self._prev[id(m)] = self._ahead(order[i], order[:i][::-1])
        for m in self._fired:
            self._units.setdefault(id(m), ())

    @staticmethod
    def _ahead(unit: tuple[int, ...], later: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """The prefetch of a module whose unit is ``unit``: the first of the ``later`` units (in the pass's
        order) that needs a bucket ``unit`` does not, less the buckets of ``unit``."""
        for other in later:
            new = tuple(b for b in other if b not in unit)
            if new:
                return new
        return ()

    def _pre_forward(self, module: Any, args: Any) -> None:  # noqa: ARG002
        if _in_backward():  # a re-computation (activation checkpointing): gather, free nothing
            for b in self._unit(module):
                self._finish(b)
            return
        if self._units is None:  # the first forward: everything whole, and which modules run
            if not self._stack:
                self.gather_all()
            if all(m is not module for m in self._fired):
                self._fired.append(module)
            self._stack.append(module)
            return
        if not self._stack:
            self._done = [set() for _ in self.buckets]
        need, ahead = self._unit(module), self._next.get(id(module), ())
        self._stack.append(module)
        if not need:  # a container: its children gather what they use
            return
        keep = {*need, *ahead, *(b for m in self._stack for b in self._unit(m))}
        for b in range(len(self.buckets)):
            if self._state[b] != _FREE and b not in keep:
                self._free(b)
        self._last = module
        for b in (*need, *ahead):
            self._start(b)
        for b in need:
            self._finish(b)

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:  # noqa: ARG002
        import torch

        if _in_backward():
            return
        if module in self._stack:
            del self._stack[len(self._stack) - 1 - self._stack[::-1].index(module)]
        grad = torch.is_grad_enabled()
        if grad and (self._units is None or self._unit(module)):
            outputs = [t for t in torch.utils._pytree.tree_leaves(output)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads, module=module: self._pre_backward(module), mode="any")
        if self._stack:
            return
        if self._units is None:
            self._learn()
            if grad:  # the first backward: everything stays whole until its gradients arrive
                return
        self.free_all(keep=self._unit(self._last) if grad and self._last is not None else ())

    def _pre_backward(self, module: Any) -> None:
        need = self._unit(module)
        for b in (*need, *self._prev.get(id(module), ())):
            self._start(b)
        for b in need:
            self._finish(b)

    def _grad_done(self, tensor: Any) -> None:
        b = self._bucket_of[id(tensor)]
        done = self._done[b]
        done.add(id(tensor))
        if len(done) == len(self.buckets[b].slots) and not self._stack:
            self._free(b)

    def end_of_backward(self) -> None:
        """Free everything a backward gathered."""
        self._done = [set() for _ in self.buckets]
        if not self._stack:
            self.free_all()

    def _before_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:  # noqa: ARG002
        if self._depth == 0:
            self.gather_all()
        self._depth += 1

    def _after_state_dict(self, module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:  # noqa: ARG002
        self._depth -= 1
        if self._depth:
            return
        storages = {f.untyped_storage().data_ptr() for f in self._flats}
        for key, value in state_dict.items():
            if hasattr(value, "untyped_storage") and value.untyped_storage().data_ptr() in storages:
                state_dict[key] = value.detach().clone()
        self.free_all()

    def _before_load(self, module: Any, *args: Any) -> None:  # noqa: ARG002
        self._before_state_dict(module, "", False)

    def _after_load(self, module: Any, incompatible_keys: Any) -> None:  # noqa: ARG002
        self._depth -= 1
        if self._depth == 0:
            import torch

            with torch.no_grad():
                self.write_back()
            self.free_all()

    def stand_in(self, tensor: Any) -> Any:
        """A read-only array of ``tensor``'s full shape and dtype holding one element (the engine lays
        the buckets out by shapes and dtypes)."""
        import torch

        one = as_array(torch.zeros((), dtype=tensor.dtype, device=tensor.device))
        return xp_of(one).broadcast_to(one, self.shapes.get(id(tensor), tuple(tensor.shape)))
