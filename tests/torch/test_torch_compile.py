"""H57 (last variant): under ``torch.compile``, after another compiled model of the same architecture ran in
the process, the wrapped model's buffers are still broadcast from rank 0 before each training forward:
every rank's BatchNorm buffers equal the eager run's."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402


def _model(seed: int) -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, tuple(p.shape)).astype(np.float32)))
    return model


def case_h57(rank: int, comm: Any, compiled: bool) -> list[Any]:
    x = [torch.from_numpy(np.random.default_rng(10 * s + rank).normal(rank, 1 + rank, (6, 4)).astype(np.float32))
         for s in range(3)]
    if compiled:  # another model of the same architecture, compiled and run first in this process
        torch.compile(_model(5))(x[0])
    model = _model(0)
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    run = torch.compile(model) if compiled else model
    for s in range(3):
        opt.zero_grad()
        run(x[s]).square().mean().backward()
        opt.step()
    buffers = [b.detach().clone().numpy() for b in model.buffers()]
    opt.close()
    return buffers


@pytest.mark.parametrize("backend", tiered(["mpi", "torch"]))
def test_h57_compiled_model_after_another_compiled_model_broadcasts_buffers(backend: str) -> None:
    eager = run_case(backend, 2, case_h57, False)
    compiled = run_case(backend, 2, case_h57, True, timeout=300)
    for rank in range(2):
        for a, b in zip(compiled[rank], eager[rank]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"rank {rank}")
