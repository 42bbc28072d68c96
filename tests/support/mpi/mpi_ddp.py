"""DDP semantics under mpiexec: the key PyTorch idioms against one process on the whole batch (float64)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402
from tests.support.failing_backward import FailingBackward  # noqa: E402

B, STEPS = 3, 3
OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])


def _model(seed: int):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def _batch(step: int, n: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


def _update(model, target, x, y, how):
    target.zero_grad()
    if how == "accumulate":
        half = x.shape[0] // 2 if x.shape[0] > 1 else 1
        parts = [slice(0, half), slice(half, x.shape[0])]
        for i, part in enumerate(parts):
            loss = torch.nn.functional.mse_loss(model(x[part]), y[part]) * (part.stop - part.start) / x.shape[0]
            if isinstance(target, DistOpt) and i == 0:
                with target.no_sync():
                    loss.backward()
            else:
                loss.backward()
    else:
        torch.nn.functional.mse_loss(model(x), y).backward()
    if how == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    target.step()


@OVERLAP
@pytest.mark.parametrize("how", ["step", "inner_step", "clip", "accumulate"])
def test_idiom_equals_one_process(world, how, overlap):
    model = _model(world.rank)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistOpt(inner, overlap=overlap)
    ref = _model(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        x, y = _batch(s, B * world.size)
        mine = slice(world.rank * B, world.rank * B + B)
        target = inner if how == "inner_step" else opt
        _update(model, target, x[mine], y[mine], how if how != "accumulate" else "accumulate")
        _update(ref, ref_opt, x, y, "clip" if how == "clip" else "step")
    diff = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
    assert diff < 1e-12, diff
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = world.allgather(mine.numpy())
    assert all((e == everyone[0]).all() for e in everyone), "replicas differ"
    opt.close()


@OVERLAP
def test_h37_exception_in_backward_on_every_rank_recovers(world, overlap):
    g = torch.Generator().manual_seed(world.rank)
    l1, l2 = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    opt = DistOpt(torch.optim.SGD([l1.weight, l2.weight], lr=0.01), overlap=overlap, buffSize=9)
    for trial in range(6):
        for step in range(3):
            x = torch.randn(4, 3, generator=g)
            key = ("mpi", overlap, trial, step)
            if step == 1:
                FailingBackward.armed.add(key)
            opt.zero_grad()
            try:
                (l2(FailingBackward.apply(l1(x), key)) ** 2).sum().backward()
            except RuntimeError as exc:
                assert "simulated" in str(exc)
                opt.zero_grad()
                continue
            if step == 2:
                before = [l1.weight.detach().clone(), l2.weight.detach().clone()]
                local = torch.autograd.grad((l2(l1(x)) ** 2).sum(), [l1.weight, l2.weight])
                mean = [torch.tensor(sum(world.allgather(t.numpy())) / world.size) for t in local]
            opt.step()
        for b, m, p in zip(before, mean, [l1.weight, l2.weight]):
            assert float((p.detach() - (b - 0.01 * m)).abs().max()) < 1e-4, trial
    opt.close()


def _bucket_view_run(world, view: bool, set_to_none: bool, overlap: bool, fail: bool):
    """4 batches (the second skipped, after a backward that raises when ``fail``, once the buckets of
    model[2] started: fusion buffers of 20 elements)."""
    torch.manual_seed(world.rank)  # rank 0's init is broadcast
    model = torch.nn.Sequential(torch.nn.Linear(50, 300), torch.nn.Tanh(), torch.nn.Linear(300, 20)).double()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), overlap=overlap, buffSize=20,
                  model=model, gradient_as_bucket_view=view)
    g = torch.Generator().manual_seed(world.rank)
    for step in range(4):
        x, y = torch.randn(8, 50, generator=g, dtype=torch.float64), torch.randn(8, 20, generator=g, dtype=torch.float64)
        if step == 1 and not fail:
            continue
        opt.zero_grad(set_to_none=set_to_none)
        key = ("bucket_view", view, set_to_none, overlap, step)
        if step == 1:
            FailingBackward.armed.add(key)
        try:
            torch.nn.functional.mse_loss(model[2](FailingBackward.apply(torch.tanh(model[0](x)), key)), y).backward()
        except RuntimeError as exc:
            assert "simulated" in str(exc)
            opt.zero_grad(set_to_none=set_to_none)  # completes the reductions started on .grad memory first
            continue
        opt.step()
    out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    opt.close()
    return out


@OVERLAP
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_gradient_as_bucket_view_is_bitwise_the_default(world, set_to_none, overlap):
    """MPI's asynchronous all-reduce on the .grad views: the same parameters and .grad as without the
    option, and a backward that raised (after some buckets started) changes nothing."""
    off = _bucket_view_run(world, False, set_to_none, overlap, False)
    on = _bucket_view_run(world, True, set_to_none, overlap, False)
    failed = _bucket_view_run(world, True, set_to_none, overlap, True)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    assert all(torch.equal(a, b) for a, b in zip(on, failed))
    everyone = world.allgather(torch.cat([t.reshape(-1) for t in on]).numpy())
    assert all((e == everyone[0]).all() for e in everyone), "replicas differ"
