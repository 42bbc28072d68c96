"""H101: complex parameters and buffers, averaged as DDP averages them (the real view of twice the length),
at ``zero=0`` and ``zero=1``, on every backend, against one process on the concatenated batch."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402

W, B, STEPS = 2, 3, 4


class Rotary(torch.nn.Module):
    """A real layer beside a complex parameter and a complex buffer (fairseq2's RoPE frequencies)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.phase = torch.nn.Parameter(torch.tensor([1 + 2j, 3 - 1j, -0.5 + 0.25j], dtype=torch.complex64))
        self.register_buffer("freq", torch.tensor([1j, 2.0, 0.5 - 0.5j], dtype=torch.complex64))

    def forward(self, x: Any) -> Any:
        z = x[:, :3].to(torch.complex64) * self.phase * self.freq
        return self.lin(x).square().mean() + z.abs().square().mean()


def _data(step: int) -> Any:
    return torch.from_numpy(np.random.default_rng(step).standard_normal((W * B, 4)).astype(np.float32))


def _model() -> Any:
    """The same initial values on every call and thread (a local generator: the ranks of the simulated world
    are threads, which would interleave draws from torch's global one)."""
    model = Rotary()
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for p in model.lin.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)) * 0.3)
    return model


def case_complex(rank: int, comm: Any, zero: int) -> list[np.ndarray]:
    model = _model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=0.05), comm=comm, zero=zero, model=model)
    for step in range(STEPS):
        opt.zero_grad()
        model(_data(step)[rank * B:(rank + 1) * B]).backward()
        opt.step()
    out = [torch.view_as_real(p.detach()).numpy().copy() if p.is_complex() else p.detach().numpy().copy()
           for p in model.parameters()]
    opt.close()
    return out


def _reference() -> list[np.ndarray]:
    """One process on the W*B batch: the mean of the per-rank losses (DDP's average of gradients)."""
    model = _model()
    adam = torch.optim.Adam(model.parameters(), lr=0.05)
    for step in range(STEPS):
        adam.zero_grad()
        x = _data(step)
        (sum(model(x[r * B:(r + 1) * B]) for r in range(W)) / W).backward()
        adam.step()
    return [torch.view_as_real(p.detach()).numpy() if p.is_complex() else p.detach().numpy()
            for p in model.parameters()]


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("backend", tiered(["sim", "mpi", "shm", "torch"]))
def test_h101_complex_parameters_average_as_ddp(backend: str, zero: int) -> None:
    ref = _reference()
    for rank, got in enumerate(run_case(backend, W, case_complex, zero)):
        for name, a, b in zip(("phase", "lin.weight", "lin.bias"), got, ref):  # a module's own parameters first
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{name} on rank {rank}, zero={zero}")
