"""``DistOpt(..., gradient_as_bucket_view=True)`` (PyTorch DDP's option), 2 ranks in a simulated world.

The same training run with the option on and off must give bitwise the same
parameters and ``.grad`` on every rank; with it on, every trainable
``.grad`` lives in the engine's bucket buffers and the engine holds no
second copy of the gradients.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.support.failing_backward import FailingBackward  # noqa: E402

from distopt import SGD, DistOpt  # noqa: E402
from distopt.comm import create  # noqa: E402
from distopt.strategies import REGISTRY, GradientStrategy, Half, Partial  # noqa: E402
from tests.support.simworld import run_world  # noqa: E402

pytestmark = pytest.mark.unit

W, B, STEPS = 2, 4, 3
OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
EXAMPLES = {e.id: e for e in REGISTRY.values() if issubclass(e.cls, GradientStrategy)}  # every bucket strategy
OVERLAPPING = [i for i, e in EXAMPLES.items() if e.cls.supports_overlap]
AFTER_BACKWARD = [i for i, e in EXAMPLES.items() if not e.cls.supports_overlap]
STRATEGIES: dict[str, tuple[Callable[[], Any], Any, float]] = {  # id: (strategy, model dtype, momentum)
    i: (e.build, torch.float32 if e.cls is Half else torch.float64, e.local_momentum) for i, e in EXAMPLES.items()}


class _Late:
    """A started all-reduce whose result lands in the array only at ``wait()`` (as MPI and NCCL may)."""

    def __init__(self, array: Any, result: Any) -> None:
        self.array, self.result, self.done = array, result, False

    def test(self) -> bool:
        return self.done

    def wait(self) -> Any:
        if not self.done:
            self.array[...] = self.result
            self.done = True
        return self.array


class LateComm:
    """A simulated communicator whose asynchronous all-reduce writes its result at ``wait()``."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def all_reduce_async(self, array: Any, op: str = "sum") -> _Late:
        result = self._comm.all_reduce(array.copy(), op, kind="all_reduce_async")
        return _Late(array, result)


class Net(torch.nn.Module):
    """Two layers, and a head that rank 0 never uses (its gradient is None there)."""

    def __init__(self, seed: int, dtype: Any) -> None:
        super().__init__()
        self.l1, self.l2, self.extra = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(5, 3)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        self.to(dtype)

    def loss(self, x: Any, y: Any, rank: int) -> Any:
        out = self.l2(torch.tanh(self.l1(x)))
        if rank == 1:
            out = out + self.extra(x)
        return torch.nn.functional.mse_loss(out, y)


def batch(step: int, micro: int, dtype: Any) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(B, 5, generator=g).to(dtype), torch.randn(B, 3, generator=g).to(dtype)


def train(how: str, set_to_none: bool, overlap: bool, strategy: str, view: bool) -> list[Any]:
    """Run STEPS updates of idiom ``how`` on 2 ranks; per rank, (parameters, grads, opt, model) after it.

    ``how``: ``"step"`` (backward, step), ``"backward_and_update"``, ``"no_sync"`` or ``"passes"``
    (two micro-batches of loss / 2, the first local only).
    """
    make, dtype, momentum = STRATEGIES[strategy]
    for module in EXAMPLES[strategy].requires:
        pytest.importorskip(module)

    def rank_fn(rank: int, sim: Any) -> Any:
        comm = LateComm(sim)  # results land at wait(), as MPI and NCCL may
        model = Net(rank, dtype)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        opt = DistOpt(inner, comm=comm, overlap=overlap, buffSize=16, strategy=make(),
                      backward_passes_per_step=2 if how == "passes" else 1, gradient_as_bucket_view=view)
        for s in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            if how in ("step", "backward_and_update"):
                loss = model.loss(*batch(s, rank, dtype), rank)
                if how == "step":
                    loss.backward()
                    opt.step()
                else:
                    opt.backward_and_update(loss)
                continue
            for m in range(2):
                loss = model.loss(*batch(s, 10 * rank + m, dtype), rank) / 2
                if how == "no_sync" and m == 0:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        params = [p.detach().clone() for p in model.parameters()]
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        return params, grads, opt, model

    return run_world(W, rank_fn)


def same(a: list[Any], b: list[Any]) -> bool:
    """Bitwise equal lists of tensors (None where both are None)."""
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and
                                    x.dtype == y.dtype and x.numpy().tobytes() == y.numpy().tobytes())
                                    for x, y in zip(a, b))


def buffers_of(opt: DistOpt) -> list[Any]:
    """The engine's bucket buffers (arrays), every layout."""
    return [buf for layout in opt.engine._layouts.values() for buf in layout.buffers if buf is not None]


# ---------------------------------------------------------------- 1. bitwise
@OVERLAP
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("how", ["step", "backward_and_update", "no_sync", "passes"])
@pytest.mark.parametrize("strategy", OVERLAPPING)
def test_bitwise_equal_to_the_option_off(strategy, how, set_to_none, overlap):
    off = train(how, set_to_none, overlap, strategy, view=False)
    on = train(how, set_to_none, overlap, strategy, view=True)
    for rank in range(W):
        assert same(on[rank][0], off[rank][0]), f"parameters differ on rank {rank}"
        assert same(on[rank][1], off[rank][1]), f".grad differs on rank {rank}"
    assert same(on[0][0], on[1][0]) and same(on[0][1], on[1][1])  # replicas identical
    assert on[0][1][4] is not None  # the head rank 0 never uses got the average of rank 1's gradient
    assert not same(on[0][0], [p.detach() for p in Net(0, STRATEGIES[strategy][1]).parameters()])  # it trained


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("strategy", AFTER_BACKWARD)
def test_bitwise_for_the_strategies_that_reduce_after_backward(strategy, set_to_none):
    off = train("step", set_to_none, False, strategy, view=False)
    on = train("step", set_to_none, False, strategy, view=True)
    for rank in range(W):
        assert same(on[rank][0], off[rank][0]) and same(on[rank][1], off[rank][1]), rank
    assert any(isinstance(b, np.ndarray) and np.shares_memory(on[0][3].l1.weight.grad.numpy(), b)
               for b in buffers_of(on[0][2]))


# ---------------------------------------------------------------- 2. views
def grad_in_buffers(p: Any, buffers: list[Any]) -> bool:
    """True when ``p.grad`` shares memory with one of the engine's buffers (and its storage starts there)."""
    ptr = p.grad.untyped_storage().data_ptr()
    return any(np.shares_memory(p.grad.numpy(), b) and ptr == b.__array_interface__["data"][0] for b in buffers)


@OVERLAP
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("view", [True, False], ids=["view", "no_view"])
def test_grad_is_a_view_into_the_bucket_buffers(view, set_to_none, overlap):
    for params, grads, opt, model in train("step", set_to_none, overlap, "dense", view):
        buffers = buffers_of(opt)
        assert len(buffers) >= 2  # buffSize=16: several buckets
        trainable = [p for p in model.parameters() if p.grad is not None]
        assert len(trainable) == 6
        assert all(grad_in_buffers(p, buffers) == view for p in trainable), view
        assert all(any(np.shares_memory(p.grad.numpy(), b) for b in buffers) == view for p in trainable)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_requires_grad_switch_gives_new_buffers_and_views(set_to_none):
    """Same shapes, other parameters trained: new buffers, and a frozen .grad never aliases a trained one."""
    def rank_fn(rank, comm, view):
        w1, w2, f = (torch.zeros(2, dtype=torch.float64, requires_grad=True) for _ in range(3))
        f.requires_grad_(False)
        opt = DistOpt(torch.optim.SGD([w1, w2, f], lr=1.0), comm=comm, gradient_as_bucket_view=view)
        r = rank + 1.0
        out = []
        for step in range(3):
            if step == 1:
                w2.requires_grad_(False)
                f.requires_grad_(True)
            opt.zero_grad(set_to_none=set_to_none)
            sum(((t * c).sum() for t, c in zip((w1, w2, f), (r, 10 * r, 100 * r)))).backward()
            opt.step()
            out.append(([t.detach().clone() for t in (w1, w2, f)],
                        [None if t.grad is None else t.grad.clone() for t in (w1, w2, f)],
                        [b.__array_interface__["data"][0] for b in buffers_of(opt)]))
        return out, (w1, w2, f), buffers_of(opt)

    off = run_world(W, lambda r, c: rank_fn(r, c, False))
    on = run_world(W, lambda r, c: rank_fn(r, c, True))
    for (out_on, _, _), (out_off, _, _) in zip(on, off):
        for (p_on, g_on, _), (p_off, g_off, _) in zip(out_on, out_off):
            assert same(p_on, p_off) and same(g_on, g_off)
    out, (w1, w2, f), buffers = on[0]
    assert set(out[0][2]).isdisjoint(out[1][2])  # new buffers after the switch
    assert out[1][2] == out[2][2]  # then kept
    assert grad_in_buffers(w1, buffers) and grad_in_buffers(f, buffers)
    if w2.grad is not None:  # frozen: its old view is not in the new buffers
        assert not any(np.shares_memory(w2.grad.numpy(), b) for b in buffers)


# ---------------------------------------------------------------- 3. memory
def gradient_memory(opt: DistOpt, model: Any) -> tuple[int, int]:
    """(bytes of the trainable gradients, bytes of their distinct storages plus the engine's buffers)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    regions = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    for b in buffers_of(opt):
        start = b.__array_interface__["data"][0]
        regions[start] = max(regions.get(start, 0), int(b.nbytes))
    return sum(g.numel() * g.element_size() for g in grads), sum(regions.values())


@OVERLAP
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_memory_one_copy_of_the_gradients_instead_of_two(set_to_none, overlap):
    ratios = {}
    for view in (True, False):
        for rank, (_, _, opt, model) in enumerate(train("step", set_to_none, overlap, "dense", view)):
            grad_bytes, held = gradient_memory(opt, model)
            ratios[view, rank] = held / grad_bytes
    for rank in range(W):
        assert 0.99 < ratios[True, rank] < 1.01, ratios  # the buckets are the gradients
        assert 1.95 < ratios[False, rank] < 2.3, ratios  # the gradients, and a second copy in the buckets


# ---------------------------------------------------------------- 4. errors
def test_array_model_raises():
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        DistOpt(SGD(lr=0.1), comm=create("single"), gradient_as_bucket_view=True)


def test_strategy_without_gradient_reduction_raises():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="gradient_as_bucket_view.*'partial'"):
        DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=create("single"), strategy=Partial(),
                gradient_as_bucket_view=True)


def test_join_raises():
    model = torch.nn.Linear(3, 2)
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=create("single"), gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        with opt.join():
            pass
    opt.close()


# ------------------------------------------------ 5. a backward that raises


def _failing_run(view: bool, fail: bool, set_to_none: bool, trial: str) -> list[Any]:
    """3 batches; with ``fail`` the second one's backward raises on both ranks after l2's bucket started,
    and that batch is skipped; without, the batch is skipped without running it. The started
    reductions land at ``wait()``, so one completed late would overwrite the next gradients."""
    def rank_fn(rank, sim):
        comm = LateComm(sim)
        g = torch.Generator().manual_seed(rank)
        l1, l2 = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 2).double()
        with torch.no_grad():
            for p in (*l1.parameters(), *l2.parameters()):
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        opt = DistOpt(torch.optim.SGD([*l1.parameters(), *l2.parameters()], lr=0.1, momentum=0.9), comm=comm,
                      buffSize=10, gradient_as_bucket_view=view)
        started = None
        for step in range(3):
            x = torch.randn(4, 3, generator=g, dtype=torch.float64)
            if step == 1 and not fail:
                continue
            key = ("bucket_view", trial, rank, step)
            if step == 1:
                FailingBackward.armed.add(key)
            opt.zero_grad(set_to_none=set_to_none)
            before = len(comm.calls)
            try:
                (l2(FailingBackward.apply(l1(x), key)) ** 2).sum().backward()
            except RuntimeError as exc:
                if "simulated out-of-memory" not in str(exc):
                    raise
                started = [c for c, _ in comm.calls[before:]].count("all_reduce_async")
                opt.zero_grad(set_to_none=set_to_none)  # completes the started reductions, then frees/zeroes
                continue
            opt.step()
        params = [p.detach().clone() for p in (*l1.parameters(), *l2.parameters())]
        return params, [p.grad.clone() for p in (*l1.parameters(), *l2.parameters())], started

    return run_world(W, rank_fn, timeout=10)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_backward_that_raises_on_every_rank_then_a_normal_step(set_to_none):
    clean = _failing_run(True, False, set_to_none, "clean")
    failed = _failing_run(True, True, set_to_none, f"failed-{set_to_none}")
    off = _failing_run(False, True, set_to_none, f"off-{set_to_none}")
    for rank in range(W):
        assert failed[rank][2] >= 1  # a reduction had started on .grad memory when backward raised
        assert same(failed[rank][0], clean[rank][0]) and same(failed[rank][1], clean[rank][1]), rank
        assert same(failed[rank][0], off[rank][0]), rank
    assert same(failed[0][0], failed[1][0])
