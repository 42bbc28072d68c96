"""H100, H103: several ``backward()`` calls before one ``step()`` accumulate into what the step applies at
every ``zero`` stage, with or without ``retain_graph`` and ``no_sync()``, as one process on the N*B batch
(float64, 1e-10). At ``zero=2|3`` each backward outside ``no_sync()`` reduce-scatters into the sharded
gradient (FSDP's accumulation); ``zero=1`` stays bitwise equal to ``zero=0`` (DDP's order of sums)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402

W, B, STEPS = 2, 3, 3


class Heads(torch.nn.Module):
    """A trunk with three output heads (H100's model), float64."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(5, 8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 1 + k) for k in range(3)])
        self.double()
        rng = np.random.default_rng(0)  # not torch's global generator: the simulated ranks are threads
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(p.shape))))

    def forward(self, x: Any) -> list[Any]:
        h = torch.tanh(self.trunk(x))
        return [head(h) for head in self.heads]


def _batch(step: int, micro: int, ranks: range) -> Any:
    rng = np.random.default_rng(100 * step + micro)
    full = rng.standard_normal((W * B, 5))
    return torch.from_numpy(np.concatenate([full[r * B:(r + 1) * B] for r in ranks]))


def _train(model: Any, opt: Any, ranks: range, idiom: str, no_sync: Any) -> None:
    """``STEPS`` steps of ``idiom`` over this process's rows ``ranks`` of each batch."""
    for step in range(STEPS):
        opt.zero_grad()
        if idiom == "retain":  # one forward, three losses, backward(retain_graph=True) each
            outs = model(_batch(step, 0, ranks))
            for k, out in enumerate(outs):
                (out.square().mean() * (k + 1)).backward(retain_graph=k < 2)
        else:  # three micro-batches, a forward and a backward each
            for micro in range(3):
                inside = (idiom == "no_sync" and micro < 2) or (idiom == "mixed" and micro == 1)
                with no_sync() if inside else _nothing():
                    sum(o.square().mean() for o in model(_batch(step, micro, ranks))).backward()
        opt.step()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def reference(idiom: str, optimizer: str) -> list[Any]:
    """One process on the N*B batch (the mean over W ranks' means of B rows is the mean over N*B rows)."""
    model = Heads()
    opt = _optimizer(optimizer, model.parameters())
    _train(model, opt, range(W), idiom, _nothing)
    return [p.detach().numpy().copy() for p in model.parameters()]


def _optimizer(name: str, params: Any) -> Any:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if name == "sgd" else torch.optim.Adam(params, lr=0.01)


def case_accumulate(rank: int, comm: Any, zero: int, idiom: str, optimizer: str) -> dict[str, Any]:
    model = Heads()
    opt = distopt.DistOpt(_optimizer(optimizer, model.parameters()), comm=comm, zero=zero, model=model,
                          buffSize=40)
    _train(model, opt, range(rank, rank + 1), idiom, opt.no_sync)
    with opt.summon_full_params(writeback=False):
        params = [p.detach().numpy().copy() for p in model.parameters()]
    stats = dict(opt.stats)
    opt.close()
    return {"params": params, "stats": stats}


@pytest.mark.unit
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("idiom", ["retain", "micro", "no_sync", "mixed"])
def test_h100_h103_accumulation_at_every_stage_equals_one_process(idiom: str, optimizer: str) -> None:
    """Every stage equals one process on the N*B batch; zero=1 equals zero=0 bitwise (both all-reduce the
    accumulated ``.grad``), zero=3 equals zero=2 bitwise (both reduce-scatter into the shard)."""
    ref = reference(idiom, optimizer)
    runs = {zero: run_case("sim", W, case_accumulate, zero, idiom, optimizer) for zero in (0, 1, 2, 3)}
    for zero, ranks in runs.items():
        for rank, got in enumerate(ranks):
            for a, b in zip(got["params"], ref):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"zero={zero} rank {rank}")
    for rank in range(W):
        for a, b in zip(runs[0][rank]["params"], runs[1][rank]["params"]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(runs[2][rank]["params"], runs[3][rank]["params"]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", tiered(["mpi", "shm", "torch"]))
def test_h103_accumulation_without_no_sync_at_zero_3_on_every_backend(backend: str) -> None:
    ref = reference("micro", "adam")
    for zero in (2, 3):
        for rank, got in enumerate(run_case(backend, W, case_accumulate, zero, "micro", "adam")):
            for a, b in zip(got["params"], ref):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"{backend} zero={zero} rank {rank}")


@pytest.mark.parametrize("backend", tiered(["mpi", "torch"]))
def test_h100_retain_graph_heads_at_zero_2_on_every_backend(backend: str) -> None:
    ref = reference("retain", "sgd")
    for rank, got in enumerate(run_case(backend, W, case_accumulate, 2, "retain", "sgd")):
        for a, b in zip(got["params"], ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10, err_msg=f"{backend} rank {rank}")


def case_discarded(rank: int, comm: Any, zero: int) -> list[Any]:
    """A backward whose gradients ``zero_grad()`` discards before the next one: the step applies only the
    second backward's."""
    model = Heads()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=zero, model=model,
                          buffSize=40)
    rows = range(rank, rank + 1)
    sum(o.square().mean() for o in model(_batch(0, 0, rows))).backward()
    opt.zero_grad()
    sum(o.square().mean() for o in model(_batch(0, 1, rows))).backward()
    opt.step()
    with opt.summon_full_params(writeback=False):
        params = [p.detach().numpy().copy() for p in model.parameters()]
    opt.close()
    return params


@pytest.mark.unit
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_zero_grad_between_backwards_discards_the_first_at_every_stage(zero: int) -> None:
    model = Heads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sum(o.square().mean() for o in model(_batch(0, 1, range(W)))).backward()
    opt.step()
    ref = [p.detach().numpy() for p in model.parameters()]
    for got in run_case("sim", W, case_discarded, zero):
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-10)
