"""DDP semantics for a PyTorch optimizer: ``.grad`` holds the average when ``loss.backward()`` returns.

As in PyTorch's ``DistributedDataParallel``: a post-accumulate-grad hook on every parameter that requires a gradient
hands the final ``.grad`` to the step's bucket pipeline during backward (``overlap=True``), and one callback queued on
the autograd engine (``Variable._execution_engine.queue_callback``) finishes every bucket at the end of backward,
writing the strategy's cross-rank average into ``.grad``. Whatever runs between backward and the update
(``clip_grad_norm_``, ``GradScaler.unscale_``, the user's own code) sees the averaged gradient, and any ``step()``
(DistOpt's or the inner optimizer's, e.g. called by ``GradScaler.step``) updates identically on every rank: step pre-
and post-hooks on the inner optimizer reduce gradients accumulated but not yet averaged (``no_sync``,
``backward_passes_per_step``) and hand the step to :meth:`~distopt.step.runner.StepRunner.finish_step`.

This is PyTorch's one route (hook -> follower -> runner -> engine -> pipeline -> strategy -> comm),
``backward_and_update``, SINGA's methods and ``join()``'s shadow steps included; on CUDA on torch's current stream.
With ``model=``, errors name parameters by module path. The rules it keeps are in ``docs/design.md``, "The PyTorch
follower's rules".
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..core.buckets import VIEW_THRESHOLD
from ..step.agreement import borrowed
from ..step.outcome import Outcome
from ..step.pipeline import BucketPipeline
from ..step.runner import StepRunner
from ..step.strategy_set import slots
from ..strategies.base import Strategy
from .adapter import TorchOptimizer, as_array, on_torch_stream, torch_stream
from .bucket_views import BucketViews
from .closure import averaged_closure
from .model_no_sync import attach_no_sync
from .nested import inside_nested_backward
from .not_finite import NotFiniteGrads
from .owners import check_sharing, claim, release
from .sink import GradientSink
from .sparse import SparseGrads
from .step_record import BackwardRecord, Phase, StepRecord

__all__ = ["Follower"]


class Follower:
    """Follows the backward passes and steps of one PyTorch optimizer (see the module docs).

    Args:
        runner: the :class:`~distopt.step.runner.StepRunner` every step goes through.
        local: the torch local optimizer whose tensors are hooked here.
        passes_per_step: backward passes accumulated per reduction, >= 1.
        sparse_as_dense: average sparse gradients densely in the buckets; else as sparse (:mod:`distopt.torch.sparse`).
        bucket_view: make every ``.grad`` a view into its bucket's buffer (``gradient_as_bucket_view``).
        model: the ``torch.nn.Module``, whose ``require_backward_grad_sync`` attribute (DDP's toggle), when False,
            makes a backward accumulate as inside ``no_sync()``, and which gets DDP's ``model.no_sync()`` unless it
            has one (:mod:`distopt.torch.model_no_sync`); None: no such toggle.
        sink: where the reduced gradients go (:class:`~distopt.torch.sink.GradientSink`, or a sharded optimizer's).

    Attributes:
        passes: backward passes accumulated since the last reduction.
        no_sync_depth: nesting depth of ``no_sync()``.
        views: the :class:`~distopt.torch.bucket_views.BucketViews`, or None without ``gradient_as_bucket_view``.
        not_finite: the NaN gradients of a skipped step (:class:`~distopt.torch.not_finite.NotFiniteGrads`).

    Raises:
        ValueError: ``passes_per_step < 1``.
    """

    def __init__(self, runner: StepRunner, local: TorchOptimizer, passes_per_step: int, sparse_as_dense: bool,
                 bucket_view: bool, model: Any = None, sink: GradientSink | None = None) -> None:
        if passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes_per_step}")
        self.runner, self.local, self.k = runner, local, passes_per_step
        self.sink = GradientSink() if sink is None else sink
        self.sparse = SparseGrads(runner.engine, local.optimizer, sparse_as_dense or bucket_view or self.sink.densify)
        self.views, self.model = BucketViews() if bucket_view else None, model
        self.passes = self.no_sync_depth = self.skip_depth = 0
        self._request: tuple[Strategy, int | None] | None = None  # the strategy of the next backward
        self.record, self.backward = StepRecord(), BackwardRecord()
        self._tensors: list[Any] = []
        self._index_of: dict[int, int] = {}
        self.not_finite = NotFiniteGrads()
        self._names = {} if model is None else {id(p): n for n, p in model.named_parameters()}
        own = local.params()
        check_sharing(own, self, lambda ix: [f"{self._names.get(id(own[i]), f'#{i}')} {tuple(own[i].shape)}"
                                             for i in ix])
        local.handles.append(local.optimizer.register_step_pre_hook(self._pre_step))
        local.handles.append(local.optimizer.register_step_post_hook(self._post_step))
        local.hook(local.params(), self.on_grad)
        attach_no_sync(model, self, local.handles)

    def join_phase(self) -> str:
        """``"no"`` outside ``join()``; inside, ``"first"`` before the first backward of a step, ``"later"``
        once a backward of it accumulated (``no_sync``, ``backward_passes_per_step``)."""
        return ("later" if self.passes else "first") if self.runner.joining else "no"

    def forward_syncs(self) -> bool:
        """Whether a backward started now averages (outside ``no_sync()`` and with the model's
        ``require_backward_grad_sync``): DDP's test for broadcasting buffers at the next forward."""
        return self.no_sync_depth == 0 and getattr(self.model, "require_backward_grad_sync", True)

    def _owned(self) -> list[Any]:
        """The trainable tensors this follower averages: those no other live follower claimed first."""
        return [t for t in self.local.trainable() if claim(t, self)]

    def release(self) -> None:
        """Give up the tensors this follower averages (``DistOpt.close()``): another DistOpt may claim them."""
        release(self.local.params(), self)

    def _current(self) -> Strategy:
        return self.runner.strategy if self.record.strategy is None else self.record.strategy

    # ------------------------------------------------------------ backward
    def on_grad(self, param: Any) -> None:
        """Post-accumulate-grad hook: ``param.grad`` is final for this backward pass."""
        import torch

        task = torch._C._current_graph_task_id()
        nested = task in self.backward.nested
        if not nested and task != self.backward.task:
            nested = self._place(task)
        if not slots(self._current()).gradients.reduces or not self.sparse.on_grad(param):
            return  # nothing to reduce, or averaged as sparse at the end of backward
        pipeline = self.record.pipeline
        if pipeline is not None and not nested:  # a nested backward's gradient is packed at the end
            index = self._index_of.get(id(param))
            if index is not None:
                if self.views is not None:
                    self.views.adopt(param, index)
                with torch_stream(param):  # CUDA: on torch's current stream
                    if pipeline.ready(index, as_array(param.grad)):
                        self.sink.packed(param, pipeline)  # zero=2|3: .grad dropped once packed

    def _place(self, task: int) -> bool:
        """A hook of graph task ``task``, which is not the followed backward's: returns whether it is a nested
        backward's (reentrant checkpointing), starting or ending backward passes as needed. Graph task ids grow: the
        backward that encloses nested ones has a smaller id than they do."""
        backward = self.backward
        if inside_nested_backward():
            if backward.task is None and not backward.await_outer:  # the backward starts in a nested one
                self._new_backward(None)
                self.backward.await_outer = True
            self.backward.nested.add(task)
            return True
        if backward.await_outer and task < min(backward.nested):  # the enclosing backward, reached at last
            backward.await_outer, backward.task = False, task
            from torch.autograd import Variable

            Variable._execution_engine.queue_callback(self._end_of_backward)
            return False
        self._finish_awaited()
        self._new_backward(task)
        return False

    def _finish_awaited(self) -> None:
        """End a backward whose enclosing graph task showed no hook of its own (all in checkpoints)."""
        if self.backward.await_outer:
            self.backward.await_outer = False
            self._end_of_backward()

    def _new_backward(self, task: int | None) -> None:
        """The first final gradient of a backward pass: its strategy, whether it reduces; queue its end
        (on graph task ``task``; None: the enclosing task is not known yet)."""
        from torch.autograd import Variable

        self.backward = BackwardRecord(task)
        record = self.record
        # a pipeline still held: the previous backward raised before its end; drained before this backward reuses
        # gradient memory (bucket views) or communicates
        self.drain(outside_backward=True)
        record.strategy, record.threshold = self._request or (self.runner.strategy, None)
        gradients = slots(record.strategy).gradients
        self.backward.syncing = gradients.reduces and self.forward_syncs() and self.passes + 1 >= self.k
        if not gradients.reduces:
            return  # a parameter averager: nothing to reduce in backward
        if task is not None:
            Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.backward.syncing and self.runner.overlap and gradients.supports_overlap:
            record.pipeline = self._begin()

    def _end_of_backward(self) -> None:
        syncing, self.backward = self.backward.syncing, BackwardRecord()
        self.sink.end_of_backward()
        if syncing:
            self.reduce()
        else:
            self.passes += 1
            self.record.phase = Phase.ACCUMULATED

    def _begin(self, shadow: bool | None = None) -> BucketPipeline:
        """A step's header and pipeline; after backward the header carries the gradients (``shadow``: a joined
        rank's, all None). Nothing is reduced in place here: ``VIEW_THRESHOLD`` fuses up to ``buffSize``."""
        strategy = self._current()
        self._tensors = self.sparse.layout(self._owned())  # sparse tensors are averaged on their own
        self._index_of = {id(t): i for i, t in enumerate(self._tensors)}
        threshold = self._threshold(strategy, self.record.threshold)
        grads = None if shadow is None else [None if shadow else self.sparse.array(t, True) for t in self._tensors]
        names = [self._names.get(id(t), "?") for t in self._tensors] if self._names else None
        pipeline = self.runner.begin(strategy, self.sink.arrays(self._tensors), threshold,
                                     views=False, bucket_view=self.views is not None, grads=grads,
                                     shadow=bool(shadow), names=names)
        if self.views is not None:
            self.views.bind(pipeline, self._tensors)
        return pipeline

    def _threshold(self, strategy: Strategy, asked: int | None) -> int | None:
        """The step's threshold: a dense strategy's default (``VIEW_THRESHOLD``) fuses up to ``buffSize``."""
        return self.runner.engine.buff_size if asked is None and strategy.default_threshold == VIEW_THRESHOLD else asked

    def planned(self) -> tuple[list[Any], list[Any]]:
        """The tensors and float buckets of the held strategy's next step (the layout stage 3 keeps)."""
        tensors, gradients = self.sparse.layout(self._owned()), slots(self.runner.strategy).gradients
        threshold = gradients.threshold(self._threshold(self.runner.strategy, None))
        return tensors, self.runner.engine.float_buckets(gradients, self.sink.arrays(tensors), threshold)

    def drain(self, outside_backward: bool = False) -> None:
        """Complete and drop the reductions of a backward that raised (collective on every rank).

        Args:
            outside_backward: called between backward passes (a step, ``zero_grad``, a new backward): a pipeline
                still held belongs to a backward that raised (False: nothing to drain).
        """
        if outside_backward and self.record.pipeline is not None:
            stale, self.record.pipeline = self.record.pipeline, None
            stale.abandon()

    @on_torch_stream
    def reduce(self, shadow: bool = False) -> Outcome:
        """Average the accumulated ``.grad`` of every trainable parameter now (collective); ``.grad`` becomes None
        where no rank has a gradient, and everywhere when ``check_finite`` skips the step.

        Args:
            shadow: a joined rank's shadow step: it contributes zeros (not its ``.grad``) and gets the others' average.
        """
        pipeline, self.record.pipeline = self.record.pipeline, None
        if pipeline is None:
            pipeline = self._begin(shadow)
        for i, t in enumerate(self._tensors if self.views is not None else ()):
            self.views.adopt(t, i)
        grads = self.sink.reduced_into([None if shadow else self.sparse.array(t) for t in self._tensors])
        outcome = self.runner.complete(pipeline, grads, active=not shadow)
        self.passes = 0
        bad = self.sparse.reduce(outcome, shadow)
        skipped = bad or not outcome.applies
        self.record.phase = Phase.SKIPPED if skipped else Phase.REDUCED
        self.sink.adopt(pipeline, self._tensors, grads, outcome, skipped, shadow,
                        None if self.views is None else self.views.views)
        self.sparse.give_back(self._tensors, skipped)
        if skipped and not shadow and outcome.active and (bad or outcome.skipped):  # check_finite
            sparse = [t for t in self.sparse.owned if self.sparse.is_sparse(t)]
            self.not_finite.mark(self._tensors, outcome.present, sparse)
        self.local.hook(self._tensors, self.on_grad)
        return outcome

    # ---------------------------------------------------------------- step
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG002
        self._finish_awaited()
        self.drain(outside_backward=True)
        self.not_finite.drop()
        if not slots(self._current()).gradients.reduces or self.skip_depth:
            return
        phase = self.record.phase
        if phase is Phase.ACCUMULATED or (phase is Phase.IDLE and any(t.grad is not None for t in self._owned())):
            self.reduce()

    @on_torch_stream
    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG002
        strategy = self._current()
        applied = self.record.phase is not Phase.SKIPPED
        self.sink.after_step(applied)
        params = self.local.arrays() if slots(strategy).averager.averages else []
        self.runner.finish_step(strategy, params, self.record.threshold, applied)
        self.record.clear()
        self.local.hook(self.local.params(), self.on_grad)

    def backward_and_step(self, strategy: Strategy, loss: Any, threshold: int | None) -> None:
        """``loss.backward()`` averaged with ``strategy`` (and ``threshold``), then ``optimizer.step()``
        unless the backward only accumulated (``backward_passes_per_step``)."""
        self._request = (strategy, threshold)
        try:
            loss.backward()
        finally:
            self._request = None
        if self.passes == 0:
            self.local.optimizer.step()

    def step(self, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)`` (:mod:`distopt.torch.closure`); returns the averaged loss, or None
        without a closure."""
        if closure is None:
            return self.local.optimizer.step()
        if self.record.phase is not Phase.ACCUMULATED:  # gradients left from before are not this step's
            self.record.phase = Phase.REDUCED
        return self.local.optimizer.step(averaged_closure(closure, self.runner.engine.comm))

    def shadow(self) -> int:
        """One shadow step of a joined rank (collective); returns the active ranks (0: all joined)."""
        self.drain(outside_backward=True)
        outcome = self.reduce(shadow=True)
        if outcome.applies:  # with the stepping ranks' hyper-parameters (a per-step LR scheduler's lr)
            with borrowed(self.local.optimizer.param_groups, self.runner.engine.adopted):
                self.local.optimizer.step()  # the pre-hook finds the step reduced; the post-hook finishes it
        else:
            self.record.phase = Phase.IDLE
        return outcome.active

    def zero_grad(self, set_to_none: bool) -> None:
        """Complete a raised backward's reductions, then the inner optimizer's ``zero_grad``."""
        self.drain(outside_backward=True)
        self.not_finite.drop()
        self.sink.before_zero_grad()
        self.local.optimizer.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Horovod's ``synchronize()``: average what was accumulated without being averaged (``no_sync``,
        ``backward_passes_per_step``) now; a no-op when ``.grad`` holds the average already (collective)."""
        self._finish_awaited()
        self.drain(outside_backward=True)
        if self.record.phase is Phase.ACCUMULATED and slots(self._current()).gradients.reduces:
            self.reduce()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's ``skip_synchronize()``: a ``step()`` inside does not average (after ``synchronize()``)."""
        self.skip_depth += 1
        try:
            yield
        finally:
            self.skip_depth -= 1

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate in ``.grad`` without communicating (DDP's ``no_sync``)."""
        self.no_sync_depth += 1
        try:
            yield
        finally:
            self.no_sync_depth -= 1
