"""``GradScaler`` when one element of the averaged gradient overflows: it sees the overflow on every rank at every
stage, though at ``zero=1|2`` each rank's optimizer holds only its pieces, so every rank skips the step and lowers
the scale, as at ``zero=0`` (the ranks then gather the same parameters, and no collective is left unpaired)."""
from __future__ import annotations

from typing import Any

import pytest

import distopt
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")


def case_overflow(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """Two linear layers with SGD in one bucket at ``zero``; at the first of 3 steps rank 0's gradient of one weight
    element is inf (so is the average there, on every rank: in one rank's pieces only). Returns the parameters and
    the scale after each step."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, zero=zero,
                          buffSize=64, model=model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def poison(grad: Any) -> Any:
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    hook = model[0].weight.register_hook(poison) if rank == 0 else None
    scales = []
    for s in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.full((3, 6), float(rank + s + 1))).sum()).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        if hook is not None:
            hook.remove()
            hook = None
    with opt.summon_full_params():
        params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return {"params": params, "scales": scales}


@pytest.mark.parametrize("backend", tiered(["sim", "torch"]))
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_an_overflow_in_one_ranks_pieces_skips_the_step_on_every_rank(backend: str, zero: int) -> None:
    ref = run_case(backend, 2, case_overflow, 0)
    got = run_case(backend, 2, case_overflow, zero)
    assert ref[0]["scales"] == [2.0, 2.0, 2.0], ref[0]["scales"]  # skipped, then two steps at the halved scale
    for rank, (g, r) in enumerate(zip(got, ref)):
        assert g["scales"] == r["scales"], f"zero={zero} rank {rank}: scales {g['scales']} against {r['scales']}"
        for i, (a, b) in enumerate(zip(g["params"], r["params"])):
            assert torch.equal(a, b), f"zero={zero} rank {rank}: parameter {i} differs from zero=0"
