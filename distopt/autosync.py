"""DDP semantics for a PyTorch optimizer: ``.grad`` holds the average when ``loss.backward()`` returns.

As in PyTorch's ``DistributedDataParallel``: a post-accumulate-grad hook on
every parameter that requires a gradient hands the final ``.grad`` to the
step's bucket pipeline during backward (``overlap=True``), and one callback
queued on the autograd engine (``Variable._execution_engine.queue_callback``)
finishes every bucket at the end of backward, writing the strategy's
cross-rank average into ``.grad``. Whatever runs between backward and the
update (``clip_grad_norm_``, ``GradScaler.unscale_``, the user's own code)
sees the averaged gradient, and any ``step()`` (DistOpt's or the inner
optimizer's, e.g. called by ``GradScaler.step``) updates identically on
every rank.

Step pre- and post-hooks on the inner optimizer (so they run whichever
``step()`` the user calls) reduce gradients that were accumulated but not
yet averaged (``no_sync``, ``backward_passes_per_step``), count the steps,
and run a non-reducing strategy's after-update (``Partial`` averages a chunk
of parameters after the local update).

Rules:

* Only parameters with ``requires_grad`` are hooked and laid out; the
  layout follows ``requires_grad`` changes between steps on every rank, and
  frozen parameters never move.
* Accumulation: inside ``with opt.no_sync():``, or for the first ``k - 1``
  backward passes of ``backward_passes_per_step=k``, gradients accumulate in
  ``.grad`` locally; the next backward outside (the k-th) averages the
  accumulated sum. With ``loss / k`` and ``zero_grad()`` once per update
  this equals the full-batch update.
* A step skipped by ``check_finite`` sets every ``.grad`` to None, so the
  following ``step()`` changes nothing.
* A backward that raises leaves its started reductions in buffers the
  pipeline owns (never in ``.grad``); they are completed and dropped
  before the next reduction, on every rank. With
  ``gradient_as_bucket_view`` those buffers ARE the ``.grad`` memory: the
  started reductions write the sum of the ranks' partial gradients there
  when they complete (at the next ``DistOpt.zero_grad()``, ``step()`` or
  backward, whichever comes first); ``DistOpt.zero_grad()`` completes them
  before it zeroes or drops the gradients, so the next step is right.
* ``gradient_as_bucket_view`` (PyTorch DDP's): the layout's bucket buffers
  are tensors of the parameters' dtype and device, allocated here once per
  layout (and trainable-parameter list), and every ``.grad`` is made a view
  into its bucket when its final gradient is ready (copied into the view
  if it is another tensor, untouched if it is the view already). The
  pipeline then reduces each bucket in place and unpacks nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .torch import as_array

if TYPE_CHECKING:
    from .opt import DistOpt
    from .pipeline import BucketPipeline
    from .torch import TorchOptimizer

__all__ = ["AutoSync"]


class AutoSync:
    """Follows the backward passes of one PyTorch optimizer's parameters (see the module docs).

    Args:
        face: the :class:`~distopt.DistOpt` (its engine, strategy, stats).
        local: the torch local optimizer whose hooks call :meth:`on_grad`.
        passes_per_step: backward passes accumulated per reduction, >= 1.
        sparse_as_dense: densify sparse gradients (``nn.Embedding(sparse=True)``)
            before reducing them; otherwise they raise ``TypeError``.
        threshold: fusion threshold in elements (see ``DistOpt.step``).
        bucket_view: make every ``.grad`` a view into its bucket's buffer
            (``gradient_as_bucket_view``, see the module docs).

    Attributes:
        passes: backward passes accumulated since the last reduction.
        no_sync_depth: nesting depth of ``no_sync()``.
        bucket_view: as the argument.
    """

    def __init__(self, face: DistOpt, local: TorchOptimizer, passes_per_step: int, sparse_as_dense: bool,
                 threshold: int | None, bucket_view: bool = False) -> None:
        if passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes_per_step}")
        self.face, self.local, self.k = face, local, passes_per_step
        self.sparse_as_dense, self.threshold = sparse_as_dense, threshold
        self.bucket_view = bucket_view
        self._views: list[Any] = []  # per trainable tensor, its .grad view into the bucket buffers
        self._views_for: tuple[Any, tuple[int, ...]] | None = None  # (layout buffers, tensor ids) they view
        self.passes = 0
        self.no_sync_depth = 0
        self._task: int | None = None
        self._syncing = False
        self._pipeline: BucketPipeline | None = None
        self._stale: BucketPipeline | None = None
        self._tensors: list[Any] = []
        self._index_of: dict[int, int] = {}
        self._pending = False
        self._reduced = False
        self._skipped = False
        local.follower = self
        local.handles.append(local.optimizer.register_step_pre_hook(self._pre_step))
        local.handles.append(local.optimizer.register_step_post_hook(self._post_step))
        local.hook(local.params())

    # ------------------------------------------------------------ backward
    def on_grad(self, param: Any) -> None:
        """Post-accumulate-grad hook: ``param.grad`` is final for this backward pass.

        Raises:
            TypeError: a sparse gradient without ``sparse_as_dense=True``.
        """
        import torch

        if not self.face.strategy.reduces_gradients:
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._new_backward(task)
        if param.grad is not None and param.grad.is_sparse:
            if not self.sparse_as_dense:
                raise TypeError(
                    f"parameter of shape {tuple(param.shape)} got a sparse gradient (e.g. nn.Embedding(sparse="
                    "True)); distopt averages dense gradients only: use a dense embedding, or "
                    "DistOpt(..., sparse_as_dense=True) to densify sparse gradients before averaging")
            param.grad = param.grad.to_dense()
        if self._pipeline is not None:
            index = self._index_of.get(id(param))
            if index is not None:
                if self.bucket_view:
                    self._adopt(index)
                self._pipeline.ready(index, as_array(param.grad))

    def _new_backward(self, task: int) -> None:
        """The first final gradient of a backward pass: decide whether it reduces; queue its end."""
        from torch.autograd import Variable

        self._task = task
        if self._pipeline is not None:  # the previous backward raised before its end
            self._stale, self._pipeline = self._pipeline, None
            self.drain()  # before this backward reuses gradient memory (bucket views) or communicates
        self._syncing = self.no_sync_depth == 0 and self.passes + 1 >= self.k
        Variable._execution_engine.queue_callback(self._end_of_backward)
        if self._syncing and self.face.overlap and self.face.strategy.supports_overlap:
            self._pipeline = self._begin()

    def _end_of_backward(self) -> None:
        self._task = None
        if self._syncing:
            self.reduce()
        else:
            self.passes += 1
            self._pending = True

    def _begin(self) -> BucketPipeline:
        self.drain()
        self._tensors = self.local.trainable()
        self._index_of = {id(t): i for i, t in enumerate(self._tensors)}
        pipeline = self.face._begin(self.face.strategy, [as_array(t) for t in self._tensors], self.threshold,
                                    joined=self.face._joining, views=False, bucket_view=self.bucket_view)
        if self.bucket_view:
            self._bind_views(pipeline)
        return pipeline

    def _bind_views(self, pipeline: BucketPipeline) -> None:
        """Allocate the layout's bucket buffers as tensors and the ``.grad`` views into them, once per
        layout and trainable-parameter list (a new layout or list: new buffers, new views)."""
        import torch

        owner = (pipeline.buffers, tuple(id(t) for t in self._tensors))
        if self._views_for is not None and self._views_for[0] is owner[0] and self._views_for[1] == owner[1]:
            return
        pipeline.buffers.clear()  # never reuse memory a parameter no longer trained may still hold as .grad
        views: list[Any] = [None] * len(self._tensors)
        for b, bucket in enumerate(pipeline.buckets):
            ref = self._tensors[bucket.slots[0].index]
            flat = torch.zeros(bucket.size, dtype=ref.dtype, device=ref.device)  # bucket.size ELEMENTS
            pipeline.buffers[b] = as_array(flat)
            for s in bucket.slots:
                views[s.index] = flat[s.offset:s.offset + s.size].view(s.shape)
        self._views, self._views_for = views, owner

    def _adopt(self, index: int) -> None:
        """Make tensor ``index``'s ``.grad`` its bucket view: copy a gradient held elsewhere into the
        view, then point ``.grad`` at it (the old tensor is freed); the view itself is left as it is."""
        tensor, view = self._tensors[index], self._views[index]
        grad = tensor.grad
        if grad is not None and (grad.data_ptr() != view.data_ptr() or grad.stride() != view.stride()):
            view.copy_(grad)
            tensor.grad = view

    def drain(self, outside_backward: bool = False) -> None:
        """Complete and drop the reductions of a backward that raised (collective on every rank).

        Args:
            outside_backward: called between backward passes (a step,
                ``zero_grad``): a pipeline still held belongs to a backward
                that raised.
        """
        if outside_backward and self._pipeline is not None:
            self._stale, self._pipeline = self._pipeline, None
        stale, self._stale = self._stale, None
        if stale is not None:
            stale.abandon()

    def reduce(self) -> None:
        """Average the accumulated ``.grad`` of every trainable parameter now (collective).

        Sets ``.grad`` to None where no rank has a gradient, and everywhere
        when ``check_finite`` skips the step.
        """
        import torch

        pipeline, self._pipeline = self._pipeline, None
        if pipeline is None:
            pipeline = self._begin()
        strategy = self.face.strategy
        self.face.active_strategy = strategy
        if self.bucket_view:
            for i in range(len(self._tensors)):
                self._adopt(i)
        grads = [None if t.grad is None else as_array(t.grad) for t in self._tensors]
        outcome = self.face.engine.complete(pipeline, grads)
        self.passes, self._pending, self._reduced = 0, False, True
        self._skipped = not outcome.applies
        for i, (t, g, ok) in enumerate(zip(self._tensors, grads, outcome.present)):
            if self._skipped or not ok:
                t.grad = None
            elif t.grad is None and self.bucket_view:
                t.grad = self._views[i]  # its slot (zeros here) holds the average of the other ranks
            elif t.grad is None:
                t.grad = torch.from_numpy(g) if hasattr(g, "__array_interface__") else torch.from_dlpack(g)
        self.local.hook(self._tensors)

    # ---------------------------------------------------------------- step
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG002
        if self.local.engine_path:
            return
        self.drain(outside_backward=True)
        if not self.face.strategy.reduces_gradients:
            return
        if self._pending or (not self._reduced and any(t.grad is not None for t in self.local.trainable())):
            self.reduce()

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:  # noqa: ARG002
        if self.local.engine_path:
            return
        strategy = self.face.strategy
        if strategy.reduces_gradients:
            self.face.stats.steps += int(not self._skipped)
        else:
            self.face.stats.steps += 1
            self.face._after_update(strategy, self.local.arrays(), self.threshold)
        self._reduced = self._skipped = False
        self.local.hook(self.local.params())
