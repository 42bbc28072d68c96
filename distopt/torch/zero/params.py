"""Stage 3 (``zero=3``): each rank keeps only its segment of every bucket's parameters.

ZeRO stage 3 (Rajbhandari, Rasley, Ruwase & He, SC 2020) and PyTorch FSDP (Zhao et al., VLDB 2023), on the shard plan
of stages 1 and 2 (:mod:`distopt.sharding.plan`). At rest every parameter of the layout holds one element expanded to
its shape (as FSDP's ``use_orig_params``), of a subclass whose use in any computation raises an error naming it; this
rank keeps its segment of each bucket, which the local optimizer updates through 1-D views. Gathering bucket ``b``
re-allocates the storage of its flat buffer, copies this rank's segment in, all-gathers the others and makes each
parameter a view into it; freeing resizes that storage to 0 bytes. Autograd's saved views of a parameter share the
buffer's storage, so the values that backward reads are those of the re-gather before it. When a bucket is gathered
and freed is :mod:`~distopt.torch.zero.hooks`'s.
"""
from __future__ import annotations

import ctypes
from enum import Enum
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...core.buckets import Bucket
from ...sharding import frame
from ...sharding.plan import ShardPlan
from ..adapter import as_array
from ..mixed import stand_in
from .freed import freed_class
from .precision import MixedPrecision

__all__ = ["ParamShards", "Gathered", "raw_array"]


class Gathered(Enum):
    """Where a bucket's parameters are: freed (this rank's segment only), being gathered, whole."""

    FREE = "free"
    PENDING = "pending"
    FULL = "full"


def raw_array(tensor: Any, dtype: Any) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array of ``dtype`` (the tensor's, as :func:`~distopt.torch.adapter.as_array`
    gives it) over a contiguous tensor's memory that leaves its storage resizable (``Tensor.numpy()`` pins it); valid
    until the storage is resized."""
    if tensor.is_cuda:
        import cupy

        memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.nbytes, tensor)
        return cupy.ndarray((tensor.numel(),), dtype, cupy.cuda.MemoryPointer(memory, 0))
    if tensor.numel() == 0:
        return np.zeros(0, dtype)
    return np.frombuffer((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()), dtype=dtype)


def _slot_views(flat: Any, bucket: Bucket) -> list[Any]:
    """Each parameter of ``bucket`` as a view into its flat buffer ``flat``, in slot order."""
    return [flat[s.offset:s.offset + s.size].view(s.shape) for s in bucket.slots]


class ParamShards:
    """A stage-3 model's parameter segments, their gathers and frees (driven by
    :class:`~distopt.torch.zero.hooks.ModuleHooks`).

    Args:
        comm: the communicator (its rank; the gathers go through the engine's launcher, :meth:`shard`).
        counters: the step counters (``gather_bytes``, ``gathered_bytes_peak``).
        precision: the mixed-precision policy (:mod:`~distopt.torch.zero.precision`): the segments keep the
            parameters' dtype, forward and backward gather ``param_dtype``; None: the parameters' dtype throughout.

    Attributes:
        tensors: the layout's parameters, in the step's order.
        shapes: ``id(parameter)`` -> its full shape.
        segments: per bucket, this rank's segment (a 1-D tensor).
        plan: the layout's :class:`~distopt.sharding.plan.ShardPlan`.
        bucket_of: ``id(parameter)`` -> its bucket.
        names: the model's module names by position (``model.named_modules()`` order), for errors.
        masters: the buckets gather in the segments' dtype now, not ``param_dtype`` (:meth:`use_masters`).
    """

    def __init__(self, comm: Any, counters: Any, precision: MixedPrecision | None = None) -> None:
        self.comm, self.counters, self.precision = comm, counters, precision
        self.tensors: list[Any] = []
        self.buckets: list[Bucket] = []
        self.plan: ShardPlan | None = None
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.segments: list[Any] = []
        self._flats: list[Any] = []
        self._state: list[Gathered] = []
        self._pending: dict[int, Any] = {}
        self.bucket_of: dict[int, int] = {}
        self.names: list[str] = []
        self._context: Callable[[str], Any] | None = None
        self._launch: Any = None
        self._full: list[list[Any]] = []  # per bucket: its parameters' views into the flat buffer
        self._empty: list[Any] = []  # per parameter: its data at rest (one element, expanded to its shape)
        self._kinds: list[type] = []  # per parameter: its own class (a freed one takes a subclass)
        self._index: dict[int, int] = {}  # id(parameter) -> its position in tensors
        self._segment_arrays: list[Any] = []  # per bucket: the segment as an array
        self._gathered = self._peak = 0  # BYTES gathered now, and the most at one time since the last step
        self._announced: tuple[Any, int, list[int]] | None = None  # (check in flight, phase, buckets)
        self._modes: dict[bool, tuple[list[Any], ...]] = {}  # masters? -> (flats, views, at rest), mixed precision
        self.masters, self._spans = False, 0  # the flats gathered now are the masters' dtype; use_masters' nesting
        self._np: dict[Any, Any] = {}  # torch dtype -> the NumPy/CuPy dtype of a flat buffer's array

    # ------------------------------------------------------------ segments
    def shard(self, tensors: Sequence[Any], buckets: Sequence[Bucket], plan: ShardPlan,
              context: Callable[[str], Any], launch: Any, segments: Sequence[Any] | None = None) -> None:
        """Keep this rank's segment of every bucket of ``tensors`` (identical on every rank) and free them, one
        bucket at a time.

        Args:
            tensors: the layout's parameters, in the step's order.
            buckets: the layout's float buckets.
            plan: the layout's shard plan.
            context: wraps collective errors with the step and the bucket.
            launch: the engine's :class:`~distopt.comm.launcher.Launcher`: the gathers and checks go in order with the
                step's reductions (on its worker thread where the backend has no asynchronous collectives).
            segments: this rank's segments, already made (a meta-built model's,
                :mod:`~distopt.torch.zero.materialize`); None: copied from ``tensors``.
        """
        self.tensors, self.buckets, self.plan = list(tensors), list(buckets), plan
        self._context, self._launch = context, launch
        self.shapes = {id(t): tuple(t.shape) for t in self.tensors}
        if self.precision is not None and len({t.dtype for t in self.tensors}) > 1:
            raise ValueError("param_dtype=/reduce_dtype= need every trained parameter in one dtype (the masters'), "
                             f"as FSDP2 does; these have {sorted({str(t.dtype) for t in self.tensors})}")
        self._empty = [torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape) for t in self.tensors]
        self._np = {d: as_array(torch.empty(0, dtype=d)).dtype for d in {t.dtype for t in self.tensors}}
        master = self.tensors[0].dtype if self.tensors else None
        self._kinds = [type(t) for t in self.tensors]
        self._index = {id(t): i for i, t in enumerate(self.tensors)}
        rank = self.comm.rank
        for b, bucket in enumerate(self.buckets):
            first = self.tensors[bucket.slots[0].index]
            flat = torch.empty(bucket.size, dtype=first.dtype, device=first.device)
            with torch.no_grad():
                for s in bucket.slots:
                    if segments is None:
                        flat[s.offset:s.offset + s.size].copy_(self.tensors[s.index].detach().reshape(-1))
                    self.bucket_of[id(self.tensors[s.index])] = b
            lo = plan.lows[b]
            self.segments.append(flat[lo:lo + plan.counts[b][rank]].clone() if segments is None else segments[b])
            self._flats.append(flat)
            self._state.append(Gathered.FULL)
            self._gathered += flat.nbytes
            self._full.append(_slot_views(flat, bucket))
            self._views(b)
            self.free(b)
        self._segment_arrays = [as_array(seg) for seg in self.segments]
        self._mixed(master)

    def _mixed(self, master: Any) -> None:
        """With a ``param_dtype`` other than the segments' dtype ``master``: a second flat buffer per bucket, in
        ``param_dtype`` (freed), and its views, for forward and backward; the first serves :meth:`use_masters`."""
        dtype = None if self.precision is None or master is None else self.precision.compute(master)
        if dtype is None or dtype == master:
            return
        flats, views = [], []
        for bucket, full in zip(self.buckets, self._flats):
            flat = torch.empty(bucket.size, dtype=dtype, device=full.device)
            views.append(_slot_views(flat, bucket))
            flat.untyped_storage().resize_(0)
            flats.append(flat)
        # at rest a parameter has the gathered dtype: autograd keeps one gradient accumulator per parameter only while
        # its dtype does not change (a tied weight freed between two uses would get two)
        empty = [torch.zeros((), dtype=dtype, device=t.device).expand(t.shape) for t in self.tensors]
        self._modes = {True: (self._flats, self._full, self._empty), False: (flats, views, empty)}
        self._np[dtype] = as_array(torch.empty(0, dtype=dtype)).dtype
        self.masters = True
        self._switch(False)

    def use_masters(self, masters: bool) -> None:
        """Enter (True) or leave (False) a span (they nest) in which the buckets gather the segments' dtype (state
        dicts, ``summon_full_params``: writes go to the segments), not ``param_dtype``; a change frees every bucket, and
        the parameters at rest take the dtype too; nothing changes without a ``param_dtype`` unlike the segments'."""
        self._spans = max(0, self._spans + (1 if masters else -1))
        self._switch(self._spans > 0)

    def _switch(self, masters: bool) -> None:
        if not self._modes or masters == self.masters:
            return
        self.free_all()
        self._flats, self._full, self._empty = self._modes[masters]
        self.masters = masters
        for t, empty in zip(self.tensors, self._empty):
            t.data = empty

    def step_done(self) -> None:
        """At the end of a step: verify a gather still announced (without starting it), free everything and report
        the step's peak of gathered bytes."""
        self._verify_announced()
        self.free_all()
        self.counters.gathered_bytes_peak, self._peak = self._peak, self._gathered

    def held_bytes(self) -> int:
        """BYTES of this rank's segments."""
        return sum(int(s.nbytes) for s in self.segments)

    def _where(self, b: int) -> str:
        return f"zero=3 parameter all-gather, bucket {b + 1} of {len(self.buckets)}"

    def _start(self, b: int) -> None:
        """Start gathering bucket ``b`` (a no-op unless it is free)."""
        if self._state[b] is not Gathered.FREE:
            return
        flat = self._flats[b]
        flat.untyped_storage().resize_(flat.nbytes)
        array = raw_array(flat, self._np[flat.dtype])
        lo, counts = self.plan.lows[b], self.plan.counts[b]  # type: ignore[union-attr]
        array[lo:lo + counts[self.comm.rank]] = self._segment_arrays[b]  # cast to param_dtype (mixed precision)
        with self._context(self._where(b)):  # type: ignore[misc]
            self._pending[b] = self._launch.gather(array, counts)
        self._state[b] = Gathered.PENDING
        self._gathered += flat.nbytes
        self.counters.gather_bytes += int(flat.nbytes)
        self.counters.gathered_bytes = self._gathered
        self._peak = max(self._peak, self._gathered)

    def _finish(self, b: int) -> None:
        """Complete bucket ``b``'s gather (starting it if free): its parameters are full views."""
        self._start(b)
        if self._state[b] is not Gathered.PENDING:
            return
        with self._context(self._where(b)):  # type: ignore[misc]
            self._pending.pop(b).wait()
        self._views(b)
        self._state[b] = Gathered.FULL

    def _views(self, b: int) -> None:
        """Make bucket ``b``'s parameters views into its flat buffer (made once: a view reads the buffer's
        storage through every resize)."""
        for s, view in zip(self.buckets[b].slots, self._full[b]):
            t = self.tensors[s.index]
            t.data = view
            if self._kinds:  # made whole again: its own class back
                t.__class__ = self._kinds[s.index]

    def free(self, b: int) -> None:
        """Free bucket ``b`` (completing a gather in flight first)."""
        if self._state[b] is Gathered.PENDING:
            self._finish(b)
        if self._state[b] is not Gathered.FULL:
            return
        for s in self.buckets[b].slots:
            t = self.tensors[s.index]
            t.data = self._empty[s.index]
            t.__class__ = freed_class(self._kinds[s.index])
        flat = self._flats[b]
        if not flat.untyped_storage().resizable():
            # a NumPy array (``p.numpy()`` inside ``summon_full_params``) shares it and keeps that memory: the bucket
            # gets a new, empty flat buffer and views into it
            self._flats[b] = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)
            self._full[b] = _slot_views(self._flats[b], self.buckets[b])
        self._flats[b].untyped_storage().resize_(0)
        self._gathered -= flat.nbytes
        self.counters.gathered_bytes = self._gathered
        self._state[b] = Gathered.FREE

    def watch(self, on_use: Callable[[list[Any]], None] | None) -> None:
        """Learning which module reads which parameter: with ``on_use``, every parameter of a whole bucket takes its
        freed class too, so that its next use, like a freed one's, calls ``on_use(parameters)`` (which makes them
        whole: :meth:`gather`, :meth:`unwatch`); None: the whole ones get their own classes back and a freed one's use
        raises again."""
        for t in self.tensors:
            if on_use is None and hasattr(t, "_zero3_on_use"):
                del t._zero3_on_use
            elif on_use is not None:
                t._zero3_on_use = on_use
        for b, bucket in enumerate(self.buckets):
            if self._state[b] is Gathered.FULL:
                for s in bucket.slots:
                    kind = self._kinds[s.index]
                    self.tensors[s.index].__class__ = kind if on_use is None else freed_class(kind)

    def unwatch(self, tensors: Sequence[Any]) -> None:
        """Give whole ``tensors`` (watched ones, :meth:`watch`) their own classes back."""
        for t in tensors:
            if self._state[self.bucket_of[id(t)]] is Gathered.FULL:
                t.__class__ = self._kinds[self._index[id(t)]]

    def _words(self, kind: int, phase: int, where: int, buckets: Sequence[int]) -> Any:
        """Start a gather check: this rank's frame (a start or an announcement, the pass, the module, a digest of the
        buckets) gathered from every rank, the same collective as the step header's (:mod:`~distopt.sharding.frame`)."""
        payload = (phase, where, len(buckets), min(buckets), sum((b + 1) * (b + 7) for b in buckets))
        with self._context(f"zero=3 gather check, {frame.PHASES[phase]}"):  # type: ignore[misc]
            return frame.exchange(self._launch, self.comm.size, self.comm.rank, kind, payload)

    def _verify(self, handle: Any, phase: int) -> None:
        """Wait for a gather check and compare every rank's frame.

        Raises:
            CollectiveMismatchError: on every rank, naming each rank's module, pass and buckets, or the step header a
                rank reached instead.
        """
        with self._context(f"zero=3 gather check, {frame.PHASES[phase]}"):  # type: ignore[misc]
            everyone = frame.rows(handle.wait(), self.comm.size)
        if not (everyone == everyone[0]).all():
            raise frame.mismatch(everyone, self.module_names)

    def module_names(self) -> dict[int, str]:
        """Module position -> name, as the gather checks number the modules."""
        return dict(enumerate(n or "the model" for n in self.names))

    def _verify_announced(self) -> Sequence[int]:
        """Verify the gathers the last :meth:`gather` announced; returns their buckets (every rank announced the same
        free buckets, and nothing gathers between an announcement and their start)."""
        if self._announced is None:
            return ()
        handle, phase, buckets = self._announced
        self._announced = None
        self._verify(handle, phase)
        return buckets

    def gather(self, phase: int, where: int, need: Sequence[int], ahead: Sequence[int] = (),
               later: Sequence[int] = ()) -> None:
        """Start the gathers announced by the last call, start those of ``need`` and ``ahead`` that are still free
        (checked across ranks first, so that a module run on some ranks only raises instead of pairing collectives of
        different sizes), announce those of ``later`` (checked at the next call), then complete ``need`` (collective).

        Args:
            phase: 0 forward, 1 backward, 2 everything (``summon_full_params``, ``state_dict``).
            where: the module's position in :attr:`names` (-1: none).
            need: buckets needed whole now.
            ahead: buckets to prefetch now.
            later: buckets the next call prefetches (announced now, started there).

        Raises:
            CollectiveMismatchError: the ranks gather different buckets or for different modules (on every rank).
        """
        for b in self._verify_announced():
            self._start(b)
        starting = [b for b in dict.fromkeys((*need, *ahead)) if self._state[b] is Gathered.FREE]
        if starting:
            self._verify(self._words(frame.STARTING, phase, where, starting), phase)
            for b in starting:
                self._start(b)
        coming = [b for b in dict.fromkeys(later) if self._state[b] is Gathered.FREE]
        if coming:
            self._announced = (self._words(frame.ANNOUNCING, phase, where, coming), phase, coming)
        for b in need:
            self._finish(b)

    def gather_all(self) -> None:
        """Gather every bucket (collective)."""
        self.gather(2, -1, range(len(self.buckets)))

    def free_all(self, keep: Sequence[int] = ()) -> None:
        """Free every bucket but ``keep``."""
        for b in range(len(self.buckets)):
            if b not in keep:
                self.free(b)

    def storages(self) -> set[int]:
        """The data pointers of the buckets' flat buffers (a tensor sharing one views a gathered parameter)."""
        return {f.untyped_storage().data_ptr() for f in self._flats}

    def gathered_flats(self) -> list[Any]:
        """The flat buffers of the buckets that are whole now (what the model's parameters view)."""
        return [flat for b, flat in enumerate(self._flats) if self._state[b] is Gathered.FULL]

    def write_back(self) -> None:
        """Copy every gathered bucket's segment of this rank back into :attr:`segments` (the model's parameters were
        written: ``load_state_dict``, ``summon_full_params``)."""
        rank = self.comm.rank
        with torch.no_grad():
            for b, flat in enumerate(self._flats):
                if self._state[b] is Gathered.FULL:
                    lo = self.plan.lows[b]  # type: ignore[union-attr]
                    self.segments[b].copy_(flat.detach()[lo:lo + self.plan.counts[b][rank]])  # type: ignore[union-attr]

    def stand_in(self, tensor: Any) -> Any:
        """A read-only array of ``tensor``'s full shape holding one element, of its dtype or, with mixed precision,
        the dtype its gradient is reduced in (the engine lays the buckets out by shapes and dtypes)."""
        dtype = tensor.dtype if self.precision is None else self.precision.reduce(tensor.dtype)
        return stand_in(tensor, dtype, self.shapes.get(id(tensor), tuple(tensor.shape)))
