"""H98: writing whole weights inside ``summon_full_params(writeback=True)`` on one rank only: with
``modifier_rank`` every rank keeps that rank's values; without it every rank raises and (at ``zero=3``) the
write is discarded everywhere. Never a mix of new and old values."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402


def _mlp() -> Any:
    """Its initial values do not matter here (rank 0's are broadcast; every check is against written ones)."""
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))


def case_one_rank_write(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """83 parameter elements, buckets smaller than the model; rank 0 alone copies "pretrained" weights."""
    model = _mlp()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=zero, model=model,
                          buffSize=16)
    pretrained = [torch.full_like(p, 0.25 * (i + 1)) for i, p in enumerate(_mlp().parameters())]
    found: dict[str, Any] = {}
    with opt.summon_full_params(writeback=True, modifier_rank=0), torch.no_grad():
        if rank == 0:
            for p, w in zip(model.parameters(), pretrained):
                p.copy_(w)
    with opt.summon_full_params(writeback=False):
        found["modifier"] = [p.detach().clone().numpy() for p in model.parameters()]
    try:
        with opt.summon_full_params(writeback=True), torch.no_grad():
            if rank == 1:
                for p in model.parameters():
                    p.add_(1.0)
    except RuntimeError as exc:
        found["error"] = str(exc)
    if zero == 3:
        with opt.summon_full_params(writeback=False):
            found["after_error"] = [p.detach().clone().numpy() for p in model.parameters()]
    with pytest.raises(ValueError, match="modifier_rank must be None or a rank in"):
        with opt.summon_full_params(modifier_rank=comm.size):
            pass
    opt.close()
    found["pretrained"] = [w.numpy() for w in pretrained]
    return found


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("backend", tiered(["sim", "mpi", "shm", "torch"]))
def test_h98_one_rank_writes_are_every_ranks_or_an_error_on_every_rank(backend: str, zero: int) -> None:
    results = run_case(backend, 2, case_one_rank_write, zero)
    for rank, found in enumerate(results):
        for got, want in zip(found["modifier"], found["pretrained"]):
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, zero={zero}")
        assert "rank(s) [1] wrote the parameters and rank(s) [0] did not" in found["error"], found.get("error")
        assert "modifier_rank=1" in found["error"]
        if zero == 3:  # discarded everywhere: the modifier's values stay
            assert "discarded on every rank" in found["error"]
            for got, want in zip(found["after_error"], found["pretrained"]):
                np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: a mix after the refused write")
