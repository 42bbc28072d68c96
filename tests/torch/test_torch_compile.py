"""H57: under ``torch.compile`` the wrapped model's buffers are broadcast from rank 0 before each training
forward, as in the eager run: compiled after the wrap, compiled (and run) before it, and (the last variant)
after another compiled model of the same architecture ran in the process. Every rank's BatchNorm buffers
equal the eager run's."""
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


def case_h57(rank: int, comm: Any, variant: str) -> list[Any]:
    """``variant``: ``eager``; ``alone`` (the wrapped model compiled after the wrap); ``before_wrap``
    (compiled, and run once, before ``DistOpt`` exists); ``after_other`` (another model of the same
    architecture compiled and run first in this process)."""
    x = [torch.from_numpy(np.random.default_rng(10 * s + rank).normal(rank, 1 + rank, (6, 4)).astype(np.float32))
         for s in range(3)]
    if variant == "after_other":
        torch.compile(_model(5))(x[0])
    model = _model(0)
    run = torch.compile(model) if variant != "eager" else model
    if variant == "before_wrap":
        with torch.no_grad():
            run.eval()(x[0])  # compiled and run in eval mode (no buffer update) before the wrap
        run.train()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
    for s in range(3):
        opt.zero_grad()
        run(x[s]).square().mean().backward()
        opt.step()
    buffers = [b.detach().clone().numpy() for b in model.buffers()]
    opt.close()
    return buffers


@pytest.mark.parametrize("backend", tiered(["mpi", "torch"]))
@pytest.mark.parametrize("variant", ["alone", "before_wrap", "after_other"])
def test_h57_compiled_model_broadcasts_buffers_as_the_eager_run(backend: str, variant: str) -> None:
    eager = run_case(backend, 2, case_h57, "eager")
    compiled = run_case(backend, 2, case_h57, variant, timeout=300)
    for rank in range(2):
        for a, b in zip(compiled[rank], eager[rank]):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=f"rank {rank}")
