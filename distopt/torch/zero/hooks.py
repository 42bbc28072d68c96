"""Stage 3's model hooks: which buckets a module needs, and when they are gathered and freed.

Over :class:`~distopt.torch.zero.params.ParamShards` (the segments, gathers and frees), as PyTorch FSDP's pre- and
post-forward and pre- and post-backward hooks (Zhao et al., VLDB 2023); the user's view is in ``docs/sharding.md``:

* **units**: a module's unit is the buckets of the parameters it reads while it is the innermost running module
  (``nn.MultiheadAttention`` reads its ``out_proj`` without calling it; a root may read an embedding's weight for its
  head). The first forward learns them without holding the model whole: a freed parameter's use gathers its bucket
  and records it, and as each module starts and returns, the buckets no running module has read are freed and the
  whole ones watched (their parameters take the freed class while staying whole), so that every module's reads are
  seen. A module that did not run then needs its whole subtree when it does;
* **forward**: a module's pre-hook frees the gathered buckets that no running module needs, gathers its unit, starts
  the next unit's prefetch and announces the one the module after it starts. When the outermost module returns,
  everything is freed (as FSDP2 does);
* **backward**: a hook on each module's outputs (``register_multi_grad_hook``) gathers the module's unit and
  prefetches the one before it; a bucket is freed once each of its parameters has its gradient. A re-computation
  during backward (activation checkpointing) gathers without freeing;
* ``state_dict()`` gathers everything and returns copies; ``load_state_dict()`` writes what it loads into the segments.
  With mixed precision (:mod:`~distopt.torch.zero.precision`) these and ``summon_full_params`` gather the segments'
  own dtype, forward and backward ``param_dtype``.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

from ..full_writes import broadcast_from, check_modifier_rank, check_writes, digest
from .params import ParamShards

__all__ = ["ModuleHooks"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class ModuleHooks:
    """The hooks that gather and free a stage-3 model's parameters (see the module docs).

    Args:
        store: the :class:`~distopt.torch.zero.params.ParamShards` of the model's layout.
        reshard_after_forward: False: a forward with gradients on frees nothing (FSDP's option of that name).
    """

    def __init__(self, store: ParamShards, reshard_after_forward: bool = True) -> None:
        self.store, self.reshard = store, reshard_after_forward
        self._positions: dict[int, int] = {}
        self._done: list[set[int]] = [set() for _ in store.buckets]  # per bucket: parameters with their gradient
        self._units: dict[int, tuple[int, ...]] | None = None  # id(module) -> its unit's buckets; None: not learnt
        self._fired: list[Any] = []  # the first forward's modules, in the order they started
        self._read: dict[int, set[int]] = {}  # the first forward: id(module) -> the buckets it read
        self._seen: set[int] = set()  # the first forward: the parameters read so far
        self._next: dict[int, tuple[int, ...]] = {}  # id(module) -> the forward's prefetch at its start
        self._prev: dict[int, tuple[int, ...]] = {}  # the same in backward (the forward's order reversed)
        self._next2: dict[int, tuple[int, ...]] = {}  # the next module's prefetch (announced here, started there)
        self._prev2: dict[int, tuple[int, ...]] = {}
        self._stack: list[Any] = []
        self._depth = 0  # nesting of state_dict / load_state_dict calls

    def _position(self, module: Any) -> int:
        return self._positions.get(id(module), -1)

    @contextmanager
    def full(self, writeback: bool, modifier_rank: int | None = None) -> Iterator[None]:
        """Every parameter whole inside the block (collective on entry and exit); with ``writeback``, what the block
        wrote is kept as :mod:`distopt.torch.full_writes` says.

        Raises:
            RuntimeError: called inside a forward pass; some ranks wrote and others did not (without
                ``modifier_rank``: the writes are discarded on every rank).
            ValueError: ``modifier_rank`` outside the world.
        """
        if self._stack:
            raise RuntimeError("summon_full_params() inside a forward pass of the model: call it between steps")
        check_modifier_rank(modifier_rank, self.store.comm.size)
        self.store.use_masters(True)  # mixed precision: the segments' dtype, not param_dtype
        self.store.gather_all()
        flats = self.store.gathered_flats()
        before = digest(flats) if writeback and modifier_rank is None else 0
        try:
            yield
            if writeback and modifier_rank is not None:
                broadcast_from(self.store.comm, flats, modifier_rank)
            elif writeback:
                check_writes(self.store.comm, before, digest(flats), discarded=True)
            if writeback:
                self.store.write_back()
        finally:
            self.store.free_all()
            self.store.use_masters(False)

    def hook(self, model: Any) -> list[Any]:
        """Forward pre- and post-hooks on every module of ``model`` holding a parameter of the layout,
        post-accumulate-grad hooks on the layout's parameters, and state-dict hooks (``state_dict`` returns whole
        tensors, ``load_state_dict`` writes the segments). Returns the hook handles."""
        self.store.names = [name for name, _ in model.named_modules()]
        for name, p in model.named_parameters():
            p._zero3_name = name  # named in the error a freed parameter's use raises
        self._positions = {id(m): i for i, m in enumerate(model.modules())}
        handles = []
        for module in model.modules():
            if any(id(p) in self.store.bucket_of for p in module.parameters()):
                handles.append(module.register_forward_pre_hook(self._pre_forward))
                handles.append(module.register_forward_hook(self._post_forward, always_call=True))
            handles.append(module.register_state_dict_pre_hook(self._before_state_dict))
            handles.append(module.register_state_dict_post_hook(  # torch marks the hook: a function, not a method
                lambda *args: self._after_state_dict(*args)))
            handles.append(module.register_load_state_dict_pre_hook(self._before_load))
            handles.append(module.register_load_state_dict_post_hook(self._after_load))
        return handles + [t.register_post_accumulate_grad_hook(self._grad_done) for t in self.store.tensors]

    def _unit(self, module: Any) -> tuple[int, ...]:
        """The buckets ``module`` needs whole while it runs."""
        units = self._units
        if units is not None and id(module) in units:
            return units[id(module)]
        bucket_of = self.store.bucket_of
        unit = tuple(sorted({bucket_of[id(p)] for p in module.parameters() if id(p) in bucket_of}))
        if units is not None:
            units[id(module)] = unit  # a module that did not run in the first forward: its whole subtree
        return unit

    def _use(self, tensors: Sequence[Any]) -> None:
        """The first forward: the innermost running module reads ``tensors`` (freed or watched parameters): their
        buckets join its unit, and are gathered."""
        owner = self._stack[-1]
        buckets = list(dict.fromkeys(self.store.bucket_of[id(t)] for t in tensors))
        self._seen.update(id(t) for t in tensors)
        self._read.setdefault(id(owner), set()).update(buckets)
        self.store.gather(0, self._position(owner), buckets)
        self.store.unwatch(tensors)

    def _boundary(self) -> None:
        """The first forward, as a module starts or returns: free the buckets that no running module has read and
        whose every parameter has been read (a later module is likely to read the rest of a bucket), unless a forward
        with gradients keeps everything (``reshard_after_forward=False``); watch the rest, so that each module's reads
        are seen even of a bucket gathered for another."""
        if self.reshard or not torch.is_grad_enabled():
            store = self.store
            keep = {b for m in self._stack for b in self._read.get(id(m), ())}
            keep.update(b for b, bucket in enumerate(store.buckets)
                        if any(id(store.tensors[s.index]) not in self._seen for s in bucket.slots))
            store.free_all(keep=keep)
        self.store.watch(self._use)

    def _learn(self) -> None:
        """Units and the prefetch order from the first forward's modules and reads (see the module docs)."""
        self._units = {id(m): tuple(sorted(self._read.get(id(m), ()))) for m in self._fired}
        fired = [m for m in self._fired if self._units[id(m)]]
        order = [self._units[id(m)] for m in fired]
        for i, m in enumerate(fired):
            self._next[id(m)] = self._ahead(order[i], order[i + 1:])
            self._prev[id(m)] = self._ahead(order[i], order[:i][::-1])
        for a, b in zip(fired, fired[1:]):  # what the module after this one (in each pass's order) prefetches
            self._next2[id(a)], self._prev2[id(b)] = self._next[id(b)], self._prev[id(a)]

    @staticmethod
    def _ahead(unit: tuple[int, ...], later: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """The prefetch of a module whose unit is ``unit``: the first of the ``later`` units (in the pass's order)
        that needs a bucket ``unit`` does not, less the buckets of ``unit``."""
        for other in later:
            new = tuple(b for b in other if b not in unit)
            if new:
                return new
        return ()

    def _pre_forward(self, module: Any, args: Any) -> None:  # noqa: ARG002
        if _in_backward():  # a re-computation (activation checkpointing): gather, free nothing
            self.store.gather(1, self._position(module), self._unit(module))
            return
        if self._units is None:  # the first forward: which modules run, and what each reads
            if all(m is not module for m in self._fired):
                self._fired.append(module)
            self._stack.append(module)
            self._boundary()
            return
        if not self._stack:
            self._done = [set() for _ in self.store.buckets]
        need, ahead = self._unit(module), self._next.get(id(module), ())
        self._stack.append(module)
        if not need:  # a container: its children gather what they use
            return
        if self.reshard or not torch.is_grad_enabled():
            self.store.free_all(keep={*need, *ahead, *(b for m in self._stack for b in self._unit(m))})
        self.store.gather(0, self._position(module), need, ahead, self._next2.get(id(module), ()))

    def _post_forward(self, module: Any, args: Any, output: Any) -> None:  # noqa: ARG002
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
        if self._units is not None and self._stack:
            return
        if self._units is None:
            if self._stack:
                self._boundary()
                return
            self.store.watch(None)
            if sys.exc_info()[1] is not None:  # the forward raised (the hook runs in torch's handler): learn anew
                self._fired, self._read, self._seen = [], {}, set()
                self.store.free_all()
                return
            self._learn()
        if grad and not self.reshard:
            return
        self.store.free_all()  # backward's first hook gathers what it needs (FSDP2 frees the root's too)

    def _pre_backward(self, module: Any) -> None:
        self.store.gather(1, self._position(module), self._unit(module), self._prev.get(id(module), ()),
                          self._prev2.get(id(module), ()))

    def _grad_done(self, tensor: Any) -> None:
        b = self.store.bucket_of[id(tensor)]
        done = self._done[b]
        done.add(id(tensor))
        if len(done) == len(self.store.buckets[b].slots) and not self._stack:
            self.store.free(b)

    def end_of_backward(self) -> None:
        """Free everything a backward gathered."""
        self._done = [set() for _ in self.store.buckets]
        if not self._stack:
            self.store.free_all()

    def _before_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:  # noqa: ARG002
        if self._depth == 0:
            self.store.use_masters(True)
            self.store.gather_all()
        self._depth += 1

    def _after_state_dict(self, module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:  # noqa: ARG002
        self._depth -= 1
        if self._depth:
            return
        storages = self.store.storages()
        for key, value in state_dict.items():
            if hasattr(value, "untyped_storage") and value.untyped_storage().data_ptr() in storages:
                state_dict[key] = value.detach().clone()
        self.store.free_all()
        self.store.use_masters(False)

    def _before_load(self, module: Any, *args: Any) -> None:  # noqa: ARG002
        self._before_state_dict(module, "", False)

    def _after_load(self, module: Any, incompatible_keys: Any) -> None:  # noqa: ARG002
        self._depth -= 1
        if self._depth == 0:
            self.store.write_back()
            self.store.free_all()
            self.store.use_masters(False)
