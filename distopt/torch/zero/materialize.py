"""Stage 3 over a model built on the meta device: each module materialized, initialized and sharded in turn.

A model built under ``with torch.device("meta"):`` (as FSDP2's and torchtitan's scripts build one that does not fit a
rank) holds no memory. ``DistOpt(opt, zero=3, model=m)`` with such a model, the optimizer built over those same meta
parameters:

1. at construction, before any hook or check holds them (:meth:`MetaBuild.find`), swaps each meta parameter in place
   for a CPU ``Parameter`` holding one element expanded to its shape (``torch.utils.swap_tensors``: the same Python
   object, so the model's and the optimizer's references stay valid); meta buffers stay meta until step 2;
2. once the bucket layout is known (:meth:`MetaBuild.materialize`), walks ``m.named_modules()`` in order. A module
   that directly owns meta tensors (``recurse=False``) gets them allocated whole on the CPU and initialized by its
   ``reset_parameters()``, or by ``init(module)`` when DistOpt was given ``init=``, under ``torch.no_grad()``; rank 0's
   values are broadcast, a tensor at a time (no packed copy); this rank's elements of each bucket are copied into its
   segment and the module's parameters freed again. The parameters freed again live in one scratch buffer of the
   largest module's bytes, reused by every module (separate allocations of varying sizes stay resident in the C
   allocator: with glibc, about the whole model). A rank holds its segments and the largest module, never the whole
   model (``tests/sharding/test_meta_init_memory.py`` measures it).

The rules, which make the result bitwise what building the model on the CPU from the same RNG state gives (the
CPU-built model's ``nn.Linear`` initializes in its constructor):

- torch's global CPU generator is consumed in ``named_modules()`` order (a module before its children), each rank from
  its own state as the caller left it (saved and restored around each call under a lock, so ranks running as threads of
  one process draw their own streams), and left where building the model would have left it. That is the CPU
  construction's order when each module initializes its own tensors before building its children (torch's layers;
  containers own none);
- only modules that directly own meta tensors are initialized, each once: a ``reset_parameters()`` must initialize the
  module's own tensors only, in place (torch's layers' do); a module owning none is never called, even with one;
- a tensor tied to several modules (a GPT's embedding and head weight) is materialized once, with the values of the
  first module that owns it; each later owner's initialization runs on a scratch tensor in its place, consuming the RNG
  as that module's construction did before the tie, and is dropped (the CPU result of ``head.weight = emb.weight``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ...core.buckets import Bucket
from ...sharding.plan import ShardPlan
from ...step.agreement import check_same
from ..adapter import as_array
from ..model_sync import broadcast_arrays

__all__ = ["MetaBuild", "refuse_meta"]

#: torch's global generator is one per process: ranks running as threads (the simulated world) take turns with it.
_RNG = threading.Lock()


def _nbytes(t: Any) -> int:
    """BYTES of ``t``'s elements."""
    return t.numel() * t.element_size()


def _aligned(t: Any) -> int:
    """``t``'s BYTES rounded up to 64 (each tensor in the scratch buffer starts 64-byte aligned)."""
    return -(-_nbytes(t) // 64) * 64


def _meta_named(model: Any) -> list[tuple[str, Any]]:
    """The model's meta parameters and buffers with their names (tied ones once)."""
    return [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]


def refuse_meta(model: Any, local: Any, zero: int, init: Any) -> None:
    """Refuse a meta-built model or an ``init=`` below ``zero=3``.

    Raises:
        ValueError: a parameter or buffer of ``model``, or an optimizer parameter, is on the meta device, or ``init`` is
            given (each naming ``zero``).
    """
    meta = _meta_named(model) if model is not None else []
    meta += [(f"optimizer parameter #{i}", p) for i, p in enumerate(local.params()) if p.is_meta]
    if meta:
        raise ValueError(f"{meta[0][0]!r} is on the meta device: DistOpt materializes a model built under "
                         f"torch.device('meta') at zero=3 only (module by module, each rank keeping its segments); "
                         f"with zero={zero} build the model on the CPU, or use zero=3 with model=")
    if init is not None:
        raise ValueError(f"init= initializes the modules of a model built on the meta device, at zero=3 with model=; "
                         f"this is zero={zero}: drop init=")


class MetaBuild:
    """A meta-built model taken at construction, materialized into stage 3's segments at bind (see the module docs).

    Args:
        model: the ``torch.nn.Module``.
        local: the torch local optimizer (its :attr:`~distopt.torch.adapter.TorchOptimizer.deferred` lists the tensors
            materialized here, which :class:`~distopt.torch.model_sync.ModelSync` leaves alone).
        init: ``init(module)``, called instead of ``module.reset_parameters()`` on every module that directly owns
            meta tensors (allocated, uninitialized, on the CPU; under ``torch.no_grad()``); None: their
            ``reset_parameters()``.
    """

    def __init__(self, model: Any, local: Any, init: Callable[[Any], Any] | None) -> None:
        self.model, self.local, self.init = model, local, init
        self.state = torch.get_rng_state()  # this rank's, before any rank's materialization set the global one

    @classmethod
    def find(cls, model: Any, local: Any, init: Callable[[Any], Any] | None) -> MetaBuild | None:
        """Take ``model``'s meta tensors (swapping its meta parameters for CPU placeholders in place); None when it
        has none.

        Raises:
            ValueError: an optimizer parameter on the meta device outside ``model``; ``init`` given for a model
                without meta tensors.
            RuntimeError: a meta parameter that cannot be swapped in place (something holds a weak reference to it).
        """
        meta = _meta_named(model)
        in_model = {id(t) for _, t in meta}
        outside = [i for i, p in enumerate(local.params()) if p.is_meta and id(p) not in in_model]
        if outside:
            raise ValueError(f"optimizer parameters #{outside} are on the meta device but not in model=: zero=3 "
                             "materializes the model's modules only; give the optimizer the model's parameters")
        if not meta:
            if init is not None:
                raise ValueError("init= initializes the modules of a model built on the meta device; model= has no "
                                 "meta parameter or buffer: drop init=")
            return None
        for name, t in meta:
            if isinstance(t, torch.nn.Parameter):
                stand = torch.nn.Parameter(torch.zeros((), dtype=t.dtype).expand(t.shape), t.requires_grad)
                try:
                    torch.utils.swap_tensors(t, stand)
                except RuntimeError as exc:
                    raise RuntimeError(f"zero=3 cannot take the meta parameter {name!r} in place ({exc}): build "
                                       "DistOpt before anything else holds the model's parameters") from exc
        local.deferred = in_model
        return cls(model, local, init)

    def _check(self, comm: Any) -> None:
        """The meta tensors' names, shapes and dtypes, the same on every rank (collective)."""
        named = [(n, t) for n, t in (*self.model.named_parameters(), *self.model.named_buffers())
                 if id(t) in self.local.deferred]
        check_same(comm, [t for _, t in named], {"meta-built tensors": len(named)}, [n for n, _ in named])

    def _run(self, name: str, module: Any) -> None:
        """Initialize ``module`` from this rank's RNG state, advancing it."""
        what = "init(module)" if self.init is not None else "reset_parameters()"
        with _RNG:
            torch.set_rng_state(self.state)
            try:
                with torch.no_grad():
                    if self.init is not None:
                        self.init(module)
                    else:
                        module.reset_parameters()
            except Exception as exc:
                raise RuntimeError(f"zero=3 initializing module {name or 'the model'!r} ({type(module).__name__}) "
                                   f"built on the meta device: {what} raised {type(exc).__name__}: {exc}; it must "
                                   "initialize the module's own parameters and buffers only, in place") from exc
            finally:
                self.state = torch.get_rng_state()

    def materialize(self, tensors: Sequence[Any], buckets: Sequence[Bucket], plan: ShardPlan,
                    comm: Any) -> list[Any]:
        """Materialize the model module by module (collective: a check, then one broadcast per module).

        Args:
            tensors: the layout's parameters, in the step's order.
            buckets: the layout's float buckets.
            plan: the layout's shard plan (this rank's segments).
            comm: the communicator.

        Returns:
            This rank's segment of each bucket (a 1-D CPU tensor of ``plan.counts[b][rank]`` ELEMENTS); the layout's
            parameters are left holding one element, every other tensor of the model whole.

        Raises:
            ValueError: a module that directly owns meta tensors has no ``reset_parameters()`` and no ``init=`` was
                given (naming the module by its qualified name).
            RuntimeError: an initialization raised or replaced a parameter (the optimizer holds the original), or a meta
                tensor is left afterwards (naming it).
            CollectiveMismatchError: the ranks' meta tensors differ (names, shapes, dtypes).
        """
        self._check(comm)
        rank = comm.rank
        segments = [torch.empty(plan.counts[b][rank], dtype=tensors[k.slots[0].index].dtype)
                    for b, k in enumerate(buckets)]
        place = {id(tensors[s.index]): (b, s) for b, k in enumerate(buckets) for s in k.slots}
        scratch = torch.empty(self._scratch_bytes(place), dtype=torch.uint8)
        done: dict[int, Any] = {}  # id of a meta tensor taken -> what replaced it
        for name, module in self.model.named_modules():
            own = [(table, key, t) for table in (module._parameters, module._buffers) for key, t in table.items()
                   if t is not None and id(t) in self.local.deferred]
            fresh = [(table, key, t) for table, key, t in own if id(t) not in done]
            if not own:
                continue
            if self.init is None and not callable(getattr(module, "reset_parameters", None)):
                if fresh:
                    raise ValueError(f"zero=3: module {name or 'the model'!r} ({type(module).__name__}) owns meta "
                                     f"tensors {[key for _, key, _ in fresh]} but has no reset_parameters() to "
                                     "initialize them: give it one, or pass DistOpt(..., init=fn), fn(module) "
                                     "initializing a module's own tensors in place")
                for table, key, t in own:
                    table[key] = done[id(t)]
                continue
            at = 0
            for table, key, t in own:
                if id(t) in done or id(t) in place:  # freed after this module: in the scratch buffer
                    whole = scratch[at:at + _nbytes(t)].view(t.dtype).view(t.shape)
                    at += _aligned(t)
                else:  # kept whole (a buffer, a parameter outside the layout)
                    whole = torch.empty(t.shape, dtype=t.dtype)
                if id(t) in done:  # tied to an earlier module: initialized on a scratch tensor, then dropped
                    table[key] = torch.nn.Parameter(whole, t.requires_grad) if table is module._parameters else whole
                elif table is module._parameters:
                    t.data = whole
                else:
                    table[key] = whole
            self._run(name, module)
            for table, key, t in own:
                if id(t) in done:
                    table[key] = done[id(t)]
                elif table is module._parameters and table[key] is not t:
                    raise RuntimeError(f"zero=3: initializing module {name or 'the model'!r} replaced its parameter "
                                       f"{key!r} by a new tensor; the optimizer holds the original: initialize it "
                                       "in place (nn.init.*_, copy_)")
            made = [(key, table[key]) for table, key, _ in fresh]
            left = [key for key, x in made if x.is_meta]
            if left:
                raise RuntimeError(f"zero=3: module {name or 'the model'!r} left {left} on the meta device after "
                                   "its initialization: allocate them on the CPU (or leave them to DistOpt)")
            for _, x in made:  # rank 0's values, as for a CPU-built model; one tensor at a time: no packed copy
                broadcast_arrays(comm, [as_array(x)])
            for (table, key, t), (_, x) in zip(fresh, made):
                done[id(t)] = x
                if id(t) in place:
                    self._keep(x, *place[id(t)], plan, rank, segments)
        self.local.deferred = set()
        with _RNG:
            torch.set_rng_state(self.state)
        left = [n for n, t in (*self.model.named_parameters(), *self.model.named_buffers()) if t.is_meta]
        if left:
            raise RuntimeError(f"zero=3: {left} are still on the meta device after materializing the model (not "
                               "owned by any module of model=?)")
        return segments

    def _scratch_bytes(self, place: dict[int, Any]) -> int:
        """BYTES of the scratch buffer that holds, in turn, each module's tensors freed after its initialization (its
        layout parameters and its tied tensors' stand-ins): the largest module's. One buffer reused, not one allocation
        per module: the C allocator keeps freed blocks of varying sizes resident (about the whole model's bytes, with
        glibc's adaptive mmap threshold), the scratch buffer is resident once."""
        most, seen = 0, set()
        for module in self.model.modules():
            own = [t for table in (module._parameters, module._buffers) for t in table.values()
                   if t is not None and id(t) in self.local.deferred]
            most = max(most, sum(_aligned(t) for t in own if id(t) in seen or id(t) in place))
            seen.update(id(t) for t in own)
        return most

    @staticmethod
    def _keep(param: Any, b: int, slot: Any, plan: ShardPlan, rank: int, segments: list[Any]) -> None:
        """Copy this rank's elements of ``param`` (slot ``slot`` of bucket ``b``) into its segment; free ``param``."""
        lo = plan.lows[b]
        start, stop = max(lo, slot.offset), min(lo + plan.counts[b][rank], slot.offset + slot.size)
        if stop > start:
            segments[b][start - lo:stop - lo].copy_(param.detach().reshape(-1)[start - slot.offset:stop - slot.offset])
        param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)
