"""DDP semantics under mpiexec: the key PyTorch idioms against one process on the whole batch (float64)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402
from tests.test_torch_cases import _Boom as Boom  # noqa: E402

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
                Boom.armed["fail"].add(key)
            opt.zero_grad()
            try:
                (l2(Boom.apply(l1(x), key)) ** 2).sum().backward()
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
