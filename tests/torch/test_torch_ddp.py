"""DDP semantics with a PyTorch optimizer, in a simulated world of 2 threads (float64, against one process).

Each idiom runs on 2 ranks with different inits (rank 0's are broadcast)
and half of the batch each, and is compared with one process on the whole
batch (mean loss, so the average of the ranks' gradients is the full-batch
gradient). ``RESULTS`` records the measured difference for the closing note.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402
from tests.support.simworld import run_world  # noqa: E402

pytestmark = pytest.mark.unit

W, B, STEPS = 2, 4, 3
RESULTS: dict[str, tuple[float, bool]] = {}


def make_model(seed: int) -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def batch(step: int, micro: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return (torch.randn(W * B, 5, generator=g, dtype=torch.float64),
            torch.randn(W * B, 3, generator=g, dtype=torch.float64))


def loss_of(model: Any, x: Any, y: Any) -> Any:
    return torch.nn.functional.mse_loss(model(x), y)


# An idiom: (model, inner optimizer, opt or None for the reference, x, y, step) -> None (one update).
Idiom = Callable[[Any, Any, Any, Any, Any, int], None]


def compare(name: str, idiom: Idiom, overlap: bool, make_opt: Callable[[Any], Any] | None = None,
            momentum: float = 0.9, **kwargs: Any) -> tuple[float, bool]:
    """Run ``idiom`` on 2 ranks and on one process; return (max |difference|, replicas bitwise identical)."""
    make_opt = make_opt or (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum))
    ref = make_model(0)
    ref_opt = make_opt(ref)
    for s in range(STEPS):
        x, y = batch(s)
        idiom(ref, ref_opt, None, x, y, s)

    def rank_fn(rank: int, comm: Any) -> list[Any]:
        model = make_model(rank)
        inner = make_opt(model)
        opt = DistOpt(inner, comm=comm, overlap=overlap, **kwargs)
        mine = slice(rank * B, rank * B + B)
        for s in range(STEPS):
            x, y = batch(s)
            idiom(model, inner, opt, x[mine], y[mine], s)
        return [p.detach().clone() for p in model.parameters()]

    ranks = run_world(W, rank_fn)
    diff = max(float((a - b).abs().max()) for a, b in zip(ranks[0], ref.parameters()))
    same = all(torch.equal(a, b) for a, b in zip(ranks[0], ranks[1]))
    RESULTS[f"{name}[{'overlap' if overlap else 'no_overlap'}]"] = (diff, same)
    return diff, same


def plain_step(model, inner, opt, x, y, s):  # noqa: ARG001
    inner.zero_grad()
    loss_of(model, x, y).backward()
    (opt or inner).step()


def inner_step(model, inner, opt, x, y, s):  # noqa: ARG001
    inner.zero_grad()
    loss_of(model, x, y).backward()
    inner.step()  # the wrapped optimizer's own step


def clip_step(model, inner, opt, x, y, s):  # noqa: ARG001
    (opt or inner).zero_grad()
    loss_of(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    (opt or inner).step()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("name,idiom", [("opt_step", plain_step), ("inner_step", inner_step),
                                        ("clip_grad_norm", clip_step)])
def test_idiom_equals_one_process(name, idiom, overlap):
    diff, same = compare(name, idiom, overlap)
    assert diff < 1e-12 and same, (diff, same)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_lr_scheduler_on_the_inner_optimizer(overlap):
    sched: dict[int, Any] = {}

    def idiom(model, inner, opt, x, y, s):
        if id(inner) not in sched:
            sched[id(inner)] = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
        plain_step(model, inner, opt, x, y, s)
        sched[id(inner)].step()

    diff, same = compare("lr_scheduler", idiom, overlap)
    assert diff < 1e-12 and same, (diff, same)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_grad_scaler_amp_recipe(overlap):
    """scale(loss).backward(); unscale_; clip; scaler.step(opt); update: same result, same scale everywhere."""
    scalers: dict[int, Any] = {}
    scales: dict[int, list[float]] = {}

    def idiom(model, inner, opt, x, y, s):
        scaler = scalers.setdefault(id(inner), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
        target = opt or inner
        target.zero_grad()
        loss = loss_of(model, x, y)
        if s == 1:
            loss = loss * float("inf") if opt is None or opt.rank_in_global == 0 else loss  # an overflow on one rank
        scaler.scale(loss).backward()
        scaler.unscale_(target)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(target)
        scaler.update()
        scales.setdefault(id(inner), []).append(scaler.get_scale())

    diff, same = compare("grad_scaler", idiom, overlap)
    assert diff < 1e-12 and same, (diff, same)
    assert len({tuple(v) for v in scales.values()}) == 1, scales  # one skip decision, one scale sequence
    assert list(scales.values())[0][1] < 2.0 ** 10  # step 2 was skipped (scale halved)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("how", ["no_sync", "backward_passes_per_step"])
def test_accumulation_equals_the_full_batch(how, overlap):
    """zero_grad once per update, loss / k, two micro-batches: equal to the full batch (float64)."""
    k = 2

    def idiom(model, inner, opt, x, y, s):
        target = opt or inner
        target.zero_grad()
        half = x.shape[0] // k
        for m in range(k):
            part = slice(m * half, m * half + half)
            loss = loss_of(model, x[part], y[part]) / k
            if opt is not None and how == "no_sync" and m < k - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        target.step()

    extra = {"backward_passes_per_step": k} if how == "backward_passes_per_step" else {}
    diff, same = compare(f"accumulation_{how}", idiom, overlap, **extra)
    assert diff < 1e-12 and same, (diff, same)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_grad_is_the_average_when_backward_returns(overlap):
    ref = make_model(0)
    x, y = batch(0)
    loss_of(ref, x, y).backward()

    def rank_fn(rank, comm):
        model = make_model(rank)
        DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, overlap=overlap)
        mine = slice(rank * B, rank * B + B)
        loss_of(model, x[mine], y[mine]).backward()
        return [p.grad.clone() for p in model.parameters()]

    ranks = run_world(W, rank_fn)
    for a, b, want in zip(ranks[0], ranks[1], ref.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.grad, rtol=0, atol=1e-12)


def test_torch_tensors_in_collectives_and_metrics():
    def rank_fn(rank, comm):
        opt = DistOpt(torch.optim.SGD(make_model(rank).parameters(), lr=0.1), comm=comm)
        t = torch.tensor([1.0, 2.0]) * (rank + 1)
        assert opt.all_reduce(t) is t
        b = torch.full((3,), float(rank))
        opt.broadcast(b, root=1)
        m = opt.all_reduce_metrics({"loss": torch.tensor(rank + 1.0), "per_class": torch.tensor([rank, 1.0])},
                                   mean=("loss",))
        return t.tolist(), b.tolist(), m["loss"], m["per_class"].tolist(), opt.all_gather_object({"r": rank})

    for t, b, loss, per_class, gathered in run_world(W, rank_fn):
        assert t == [3.0, 6.0] and b == [1.0, 1.0, 1.0] and loss == 1.5 and per_class == [1.0, 2.0]
        assert gathered == [{"r": 0}, {"r": 1}]


def test_broadcast_state_restores_root_everywhere():
    """A checkpoint restored on rank 0 only: parameters and optimizer state (momentum, lr) reach rank 1."""
    def rank_fn(rank, comm):
        model = make_model(rank)
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = DistOpt(inner, comm=comm, model=model)
        opt.broadcast_state()  # empty optimizer state works
        if rank == 0:
            source = make_model(7)
            src_opt = torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9)
            loss_of(source, *batch(0)).backward()
            src_opt.step()
            src_opt.param_groups[0]["lr"] = 0.02
            model.load_state_dict(source.state_dict())
            inner.load_state_dict(src_opt.state_dict())
        opt.broadcast_state(root=0)
        bufs = [inner.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()], bufs, inner.param_groups[0]["lr"]

    (p0, m0, lr0), (p1, m1, lr1) = run_world(W, rank_fn)
    assert lr0 == lr1 == 0.02
    assert all(torch.equal(a, b) for a, b in zip(p0 + m0, p1 + m1))


def test_array_average_in_place_without_update():
    def rank_fn(rank, comm):
        from distopt import SGD

        opt = DistOpt(SGD(lr=1.0), comm=comm)
        params = [np.zeros(3), np.zeros(2)]
        grads = [np.full(3, rank + 1.0), np.full(2, 10.0 * rank)]
        out = opt.average(params, grads)
        return params, out, grads

    for params, out, grads in run_world(W, rank_fn):
        assert all((p == 0).all() for p in params)
        assert out[0] is grads[0] and grads[0].tolist() == [1.5] * 3 and grads[1].tolist() == [5.0, 5.0]


def test_model_names_differ_raise_on_every_rank():
    from distopt import CollectiveMismatchError

    def rank_fn(rank, comm):
        model = make_model(0)
        if rank == 1:
            model = torch.nn.Sequential()
            model.add_module("first", torch.nn.Linear(5, 7).double())
        try:
            DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    for msg in run_world(W, rank_fn):
        assert "rank 0: '0.weight', rank 1: 'first.weight'" in msg, msg


def test_close_removes_the_hooks_from_the_model_and_optimizer():
    """A closed DistOpt no longer runs in the model's backward or the optimizer's step: a new one over
    the same model trains as if the first never existed."""
    from distopt.comm import create

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    first = DistOpt(sgd, comm=create("single"), model=model)
    first.close()
    second = DistOpt(sgd, comm=create("single"), model=model)
    model(torch.ones(5, 3)).sum().backward()  # the first one's hooks would raise CommunicatorClosedError
    sgd.step()
    assert second.stats.steps == 1 and first.stats.steps == 0
    second.close()


@pytest.mark.parametrize("initial", [True, False], ids=["ddp_divisor", "active_divisor"])
@pytest.mark.parametrize("overlap", [True, False])
def test_join_with_a_torch_optimizer_keeps_replicas_identical_and_divides_as_asked(overlap, initial):
    """Rank 0 has 2 batches, rank 1 has 4, in the DDP idiom inside ``opt.join()``: while rank 0 shadows,
    both ranks step with rank 1's gradient divided by the world size (DDP's default: the joined rank
    contributes zeros) or, with ``divide_by_initial_world_size=False``, by the ranks that contributed.
    Rank 1 joined last."""
    counts = [2, 4]

    def rank_fn(rank, comm):
        model = make_model(seed=rank)
        opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, overlap=overlap,
                      divide_by_initial_world_size=initial)
        with opt.join() as joined:
            for step in range(counts[rank]):
                x, y = batch(step)
                mine = slice(B * rank, B * (rank + 1))
                opt.zero_grad()
                loss_of(model, x[mine], y[mine]).backward()
                opt.step()
        return [p.detach().clone() for p in model.parameters()], joined.last_joined

    ranks = run_world(W, rank_fn)
    ref = make_model(seed=0)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(max(counts)):
        x, y = batch(step)
        active = [r for r in range(W) if step < counts[r]]
        sgd.zero_grad()
        sum(loss_of(ref, x[B * r:B * (r + 1)], y[B * r:B * (r + 1)]) for r in active).div(
            W if initial else len(active)).backward()
        sgd.step()
    assert [last for _, last in ranks] == [1, 1]
    for a, b in zip(ranks[0][0], ranks[1][0]):
        assert torch.equal(a, b)
    assert max(float((a - b).abs().max()) for a, b in zip(ranks[0][0], ref.parameters())) < 1e-12
