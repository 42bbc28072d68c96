"""The step engine: the step header, the bucket layout, and the step's pipeline, for any strategy.

Per step (the data flow of ``docs/design.md``) the ranks all-gather one small "step header": digests of the parameter
shapes/dtypes, of the strategy's settings and of the local optimizer's hyper-parameters (compared among the stepping
ranks only: :func:`~distopt.step.agreement.shadow_settings`), whether this rank's parameter list changed, whether it is
inside ``join()`` and, for gradients already known, whether one is missing or not finite. Different digests raise
:class:`~distopt.errors.CollectiveMismatchError` on every rank naming the first difference; a changed parameter list on
any rank makes every rank take rank 0's parameters (broadcast, never averaged: averaging independent random inits would
shrink them) and lays the buckets out anew. The step's :class:`~distopt.step.pipeline.BucketPipeline` then needs one
more small all-reduce only when the header could not settle the step: a steady-state step costs one control collective,
overlapped or not (``zero=2``, whose vote on the reduced values carries the flags: two)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..comm.base import Communicator
from ..core.buckets import DEFAULT_THRESHOLD, Bucket, is_float, pack, plan_buckets, unpack
from ..core.counters import Counters
from ..errors import CollectiveMismatchError
from ..sharding import frame
from ..sharding.plan import ShardPlan
from ..sharding.policy import BucketSync
from ..strategies.base import GradientStrategy
from ..comm.consensus import digest
from .agreement import GroupSettings, check_same, shadow_settings
from .outcome import Agreement, Outcome, Pending, not_finite
from ..comm.launcher import Launcher
from .pipeline import BucketPipeline

__all__ = ["Engine", "DEFAULT_THRESHOLD", "FIRST_BUCKET"]

FIRST_BUCKET = 262144
"""ELEMENTS of the first reverse-order bucket (1 MiB of float32, as PyTorch DDP), so reduction starts early."""


@dataclass
class _Layout:
    """One bucket layout of the current parameter list, with its packing buffers. ``buffers`` holds, per bucket, its
    flat buffer (``bucket.size`` elements of ``bucket.dtype``) or None until one is needed, kept while the layout lives;
    with ``gradient_as_bucket_view`` they are the gradients' memory (each ``.grad`` a view into one), allocated by the
    PyTorch adapter."""

    key: int
    buckets: list[Bucket]
    shards: ShardPlan | None = None
    buffers: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buffers = [None] * len(self.buckets)


class Engine:
    """Drives any :class:`~distopt.strategies.Strategy` over one communicator.

    Args:
        comm: the communicator.
        buff_size: capacity of a fusion buffer in ELEMENTS (>= 1).
        check_finite: skip a step on every rank when any rank's gradient has a NaN or inf.
        counters: the counters to update (``DistOpt.stats``).
        divide_by_initial_world_size: while some ranks have joined, divide the sum by the world size (PyTorch DDP's
            default: joined ranks contribute zeros); False divides by the ranks that contributed.
        sync: what the step does with each bucket's reduction (:mod:`distopt.sharding.policy`): all-reduce (the
            default) or, sharded, reduce-scatter.
    """

    def __init__(self, comm: Communicator, buff_size: int, check_finite: bool, counters: Counters,
                 divide_by_initial_world_size: bool = True, sync: BucketSync | None = None) -> None:
        self.comm, self.buff_size, self.check_finite, self.counters = comm, buff_size, check_finite, counters
        self.sync = BucketSync() if sync is None else sync
        self.agreement = Agreement(comm, counters, check_finite, divide_by_initial_world_size)
        self.context = self.agreement.context
        self.layout: _Layout | None = None  # the last step's layout
        self.launch = Launcher(comm)
        self._specs: tuple[Any, ...] | None = None
        self._specs_digest: tuple[Any, int] = (None, 0)
        self._layouts: dict[tuple[int, bool, bool], _Layout] = {}
        self.adopted: tuple[Any, ...] | None = None  # a shadow step's settings of the stepping ranks
        #: zero=3: the header travels in the parameter gathers' check frame (:mod:`~distopt.sharding.frame`);
        #: module position -> name, for its error. None: a plain all-gather.
        self.frame_names: Callable[[], Mapping[int, str]] | None = None

    def broadcast_params(self, params: Sequence[Any], settings: Mapping[str, Any],
                         names: Sequence[str] | None = None) -> None:
        """Check that all ranks hold the same parameters and ``settings``, then take rank 0's values
        (``names``: the parameters' names, for the error).

        Raises:
            CollectiveMismatchError: on every rank, naming the first difference.
        """
        params = list(params)
        check_same(self.comm, params, settings, names)
        for bucket in plan_buckets([(p.shape, p.dtype) for p in params], DEFAULT_THRESHOLD, self.buff_size):
            flat, viewed = pack(bucket, params)
            self.comm.broadcast(flat, root=0)
            if not viewed:
                unpack(bucket, flat, params)
        specs = tuple((p.shape, p.dtype) for p in params)
        if specs != self._specs:  # the next step with these parameters needs no second broadcast
            self._specs, self._layouts = specs, {}

    def known(self, params: Sequence[Any]) -> None:
        """Take ``params`` (arrays, or stand-ins of their shapes and dtypes) as the parameter list already identical
        on every rank, so its first step broadcasts nothing (stage 3 keeps rank 0's values sharded from the start)."""
        self._specs, self._layouts = tuple((p.shape, p.dtype) for p in params), {}

    def float_buckets(self, strategy: GradientStrategy, params: Sequence[Any], threshold: int) -> list[Bucket]:
        """The float buckets a step of ``strategy`` over ``params`` lays out (``threshold`` in ELEMENTS, resolved)."""
        if not strategy.reduces:
            return []
        reverse = strategy.supports_overlap
        first = min(FIRST_BUCKET, self.buff_size) if reverse else None
        buckets = plan_buckets([(p.shape, p.dtype) for p in params], threshold, self.buff_size, reverse=reverse,
                               first_bucket=first)
        return [b for b in buckets if is_float(b.dtype)]

    def _agree(self, strategy: GradientStrategy, params: list[Any], threshold: int, joined: bool,
               grads: Sequence[Any] | None, groups: GroupSettings | None,
               shadow: bool = False, names: Sequence[str] | None = None) -> tuple[_Layout, Outcome | None]:
        """The step header (see the module docs): this step's layout, and its outcome when the header settled it."""
        reverse = strategy.supports_overlap
        specs = tuple((p.shape, p.dtype) for p in params)  # dtype objects: str() per step is costly
        full = {"world_size": self.comm.size, "buffSize": self.buff_size, "threshold": threshold,
                "reverse": reverse, **self.sync.describe(), **strategy.describe()}
        if specs != self._specs_digest[0]:
            self._specs_digest = (specs, digest([[list(shape), str(dtype)] for shape, dtype in specs]))
        # gradients: 0 known and every float one present; 1 not known yet, the reduction settles them;
        # 2 known with some missing, or not known and the flags must settle them
        if grads is not None:
            unsettled = 2 * any(g is None for p, g in zip(params, grads) if is_float(p))
        else:
            unsettled = 1 if self.sync.reduction_settles(self.check_finite, strategy, params) else 2
        bad = self.check_finite and not unsettled and not_finite(grads)  # type: ignore[arg-type]
        header = np.array([self._specs_digest[1], digest(full), int(specs != self._specs), int(joined),
                           unsettled, int(bad), 0 if groups is None else groups.digest, int(shadow)],
                          dtype=np.int64)
        if self.frame_names is None:
            everyone = self.launch.call(self.comm.all_gather, header)  # after what its worker thread holds
        else:  # zero=3: the gather checks' frame, so a rank in a module's gather meets this at once
            everyone = frame.rows(frame.exchange(self.launch, self.comm.size, self.comm.rank, frame.HEADER,
                                                 header).wait(), self.comm.size)
            if (everyone[:, 0] != frame.HEADER).any():
                raise frame.mismatch(everyone, self.frame_names)
            everyone = everyone[:, 1:]
        self.counters.control_collectives += 1
        stepping = everyone[everyone[:, 7] == 0, 6]  # a shadow step's own optimizer settings are not compared
        if (everyone[:, :2] != everyone[0, :2]).any() or (stepping != stepping[:1]).any():
            check_same(self.comm, params, {**full, **(groups.values if groups is not None and not shadow else {})},
                       names)
            raise CollectiveMismatchError("parameters or settings differ across ranks (digests differ)")
        self.adopted = shadow_settings(self.comm, everyone[:, 6], everyone[:, 7], groups, shadow)
        if everyone[:, 3].any() and not strategy.supports_join:
            raise ValueError(f"join() supports strategies with supports_join (plain, half), not {strategy.name!r}: "
                             f"rank(s) {np.flatnonzero(everyone[:, 3]).tolist()} are inside join()")
        if everyone[:, 2].any():
            self.broadcast_params(params, full, names)
        slot = (threshold, reverse, strategy.reduces)
        if slot not in self._layouts:
            floats = self.float_buckets(strategy, params, threshold)
            shards = self.sync.plan(floats, self.comm.rank, self.comm.size)
            self._layouts[slot] = _Layout(digest([self._specs_digest[1], threshold, reverse]), floats, shards=shards)
        settled = None
        present = [is_float(p) for p in params]
        if not everyone[:, 3:5].any():  # nobody joined, every rank holds every float gradient
            settled = Outcome(present, self.comm.size, bool(everyone[:, 5].any()))
        elif not everyone[:, 3].any() and everyone[:, 4].max() == 1 and not everyone[:, 5].any():
            settled = Pending(present, self.comm.size, False)
        return self._layouts[slot], settled

    def begin(self, strategy: GradientStrategy, params: Sequence[Any], threshold: int | None,
              joined: bool = False, views: bool = True, grads: Sequence[Any] | None = None,
              bucket_view: bool = False, groups: GroupSettings | None = None,
              shadow: bool = False, names: Sequence[str] | None = None) -> BucketPipeline:
        """Agree on the step, then return its pipeline (buckets may start at once: overlap).

        Args:
            threshold: ELEMENTS above which a parameter is a bucket of its own; None: the strategy's
                ``default_threshold``.
            joined: this rank is inside ``join()`` (stepping or shadowing).
            views: see :class:`~distopt.step.pipeline.BucketPipeline`.
            bucket_view: see :class:`~distopt.step.pipeline.BucketPipeline`; the caller fills the layout's buffers,
                ``pipeline.buffers``, before the first gradient is ready.
            grads: the step's gradients when backward has already run (the header then settles the step's
                outcome); None during backward.
            groups: the local optimizer's hyper-parameters, compared across ranks in the same header.
            shadow: a joined rank's shadow step: its ``groups`` are not compared; :attr:`adopted` holds the stepping
                ranks' where they differ.
            names: the parameters' names (module paths), for the errors.

        Raises:
            CollectiveMismatchError: parameters or settings (the optimizer's included) differ across ranks, on every
                rank, naming the first.
            ValueError: a rank has joined and the strategy does not support ``join``.
        """
        params = list(params)
        threshold = strategy.threshold(threshold)
        with self.context("parameter check"):
            layout, settled = self._agree(strategy, params, threshold, joined, grads, groups, shadow, names)
        self.layout = layout
        buffers = self.sync.buffers(layout.buffers)
        sync = self.sync.begin(self.launch, layout.shards, layout.buckets, buffers, self.comm, self.context,
                               self.counters)
        return BucketPipeline(strategy, layout.buckets, buffers, layout.key, params, self.launch,
                              self.comm, self.counters, self.agreement, views, bucket_view, settled, sync)

    def average_arrays(self, bucket: Bucket, arrays: Sequence[Any], where: str) -> int:
        """All-reduce the arrays of one bucket layout to their mean, in place; returns the bytes sent."""
        flat, viewed = pack(bucket, arrays)
        with self.context(where):
            self.comm.all_reduce(flat, op="avg")
        if not viewed:
            unpack(bucket, flat, list(arrays))
        return int(flat.nbytes)

    def close(self) -> None:
        """Stop the reduction thread (backends without asynchronous all-reduce)."""
        self.launch.close()
