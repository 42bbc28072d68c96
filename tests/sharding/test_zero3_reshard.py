"""H104: with ``reshard_after_forward=True`` every bucket is freed after the forward that used it (the
root's and the last module's too), so nothing stays gathered between forward and backward; with False
everything stays. Results are the same either way, and equal zero=0."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402


class Scaled(torch.nn.Module):
    """``scale * head(body(x))``: a root parameter beside two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 2)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        rng = np.random.default_rng(0)  # not torch's global generator: the simulated ranks are threads
        with torch.no_grad():
            for p in (*self.body.parameters(), *self.head.parameters()):
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)) * 0.3)

    def forward(self, x: Any) -> Any:
        return self.scale * self.head(torch.tanh(self.body(x)))


def case_reshard(rank: int, comm: Any, zero: int, reshard: bool) -> dict[str, Any]:
    model = Scaled()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=zero, model=model,
                          buffSize=16, reshard_after_forward=reshard)
    found: dict[str, Any] = {"between": [], "after": []}
    for step in range(3):
        opt.zero_grad()
        x = torch.full((3, 4), 0.1 * (rank + 1) + step)
        loss = model(x).square().mean()
        found["between"].append(opt.stats["gathered_bytes"])
        loss.backward()
        found["after"].append(opt.stats["gathered_bytes"])
        opt.step()
    with opt.summon_full_params(writeback=False):
        found["params"] = [p.detach().clone().numpy() for p in model.parameters()]
    found["model_bytes"] = sum(p.numel() * 4 for p in Scaled().parameters())
    opt.close()
    return found


@pytest.mark.parametrize("backend", tiered(["sim", "shm"]))
def test_h104_reshard_after_forward_frees_every_bucket(backend: str) -> None:
    ref = run_case(backend, 2, case_reshard, 0, True)
    freed = run_case(backend, 2, case_reshard, 3, True)
    kept = run_case(backend, 2, case_reshard, 3, False)
    for rank in range(2):
        assert freed[rank]["between"][1:] == [0, 0], freed[rank]["between"]  # the first forward learns the units
        assert kept[rank]["between"][1:] == [kept[rank]["model_bytes"]] * 2, kept[rank]["between"]
        assert freed[rank]["after"] == kept[rank]["after"] == [0, 0, 0]
        for a, b, c in zip(freed[rank]["params"], kept[rank]["params"], ref[rank]["params"]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)


def case_grad_edit(rank: int, comm: Any, zero: int) -> str:
    model = Scaled()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=zero, model=model,
                          buffSize=16)
    x = torch.full((3, 4), 0.1 * (rank + 1))
    model(x).square().mean().backward()
    model(x).square().mean().backward()  # accumulation outside no_sync() is honoured
    try:
        model.head.weight.grad.mul_(0.5)  # an edit of .grad is not
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt.close()
    return "no error"


@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.unit
def test_an_edit_of_grad_at_zero_2_and_3_names_the_stage_in_force(zero: int) -> None:
    """A second backward accumulates (tests/sharding/test_zero_accumulation.py); an edit of the placeholder
    ``.grad`` after it is refused, naming the stage in force (not always zero=2) and opt.clip_grad_norm_."""
    from tests.support.simworld import run_world

    for message in run_world(2, lambda rank, comm: case_grad_edit(rank, comm, zero)):
        assert f"DistOpt(zero={zero}) keeps each gradient sharded" in message, message
        assert "opt.clip_grad_norm_" in message, message


def case_counts(rank: int, comm: Any) -> dict[str, Any]:
    model = Scaled()
    whole = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=3, model=model,
                          buffSize=16)
    found = {"whole": whole, "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()},
             "sizes": {n: (tuple(p.size()), p.dim(), p.ndim, p.nelement()) for n, p in model.named_parameters()},
             "count": sum(p.numel() for p in model.parameters()),
             "held": sum(p.untyped_storage().nbytes() for p in model.parameters())}
    try:
        model.head.weight.sum()
    except RuntimeError as exc:
        found["error"] = str(exc)
    opt.close()
    return found


@pytest.mark.unit
def test_zero3_parameters_between_steps_report_the_models_size() -> None:
    """As FSDP2's DTensor parameters: ``p.shape``/``p.numel()`` of a freed parameter answer the whole
    parameter's, so ``sum(p.numel() ...)`` counts the model; it holds one element, and computing with it
    still raises naming it."""
    from tests.support.simworld import run_world

    for found in run_world(2, case_counts):
        assert found["shapes"] == found["whole"]
        for name, (size, dim, ndim, nelement) in found["sizes"].items():
            assert size == found["whole"][name] and dim == ndim == len(size)
            assert nelement == int(np.prod(size))
        assert found["count"] == 4 * 6 + 6 + 6 * 2 + 2 + 1
        assert found["held"] == 4 * 5  # one float32 element per parameter
        assert "'head.weight' is freed" in found["error"], found["error"]
