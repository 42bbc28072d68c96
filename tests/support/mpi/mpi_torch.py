"""The PyTorch adapter under mpiexec: equivalence with one process on the global batch."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from distopt import DistOpt  # noqa: E402

B = 3
STEPS = 4


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["sgd_momentum", "adam"])
def test_torch_adapter_equivalence(world, kind):
    def make_opt(model):
        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=0.01)
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)

    model = _model(seed=world.rank)  # rank-dependent init: the adapter broadcasts rank 0's
    opt = DistOpt(make_opt(model))
    ref = _model(seed=0)
    ref_opt = make_opt(ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q), "parameters must equal rank 0's right after DistOpt()"
    for step in range(STEPS):
        x, y = _batch(step, B * world.size)
        mine = slice(world.rank * B, (world.rank + 1) * B)
        model.zero_grad()
        opt.backward_and_update(torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=0, atol=1e-10)
    opt.close()


def test_torch_unused_parameter_on_some_ranks(world):
    """H05 for torch: a branch unused on odd ranks gets the zero-filled average, nothing shifts."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    c = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = DistOpt(torch.optim.SGD([a, b, c], lr=1.0))
    r = world.rank
    loss = (a * (1.0 + 4 * (r % 2))).sum() + (c * (3.0 + 4 * (r % 2))).sum()
    if r % 2 == 0:
        loss = loss + (b * 2.0).sum()
    opt.backward_and_update(loss)
    W, odd = world.size, world.size // 2
    np.testing.assert_allclose(a.detach().numpy(), -(1 * (W - odd) + 5 * odd) / W)
    np.testing.assert_allclose(b.detach().numpy(), -2.0 * (W - odd) / W)
    np.testing.assert_allclose(c.detach().numpy(), -(3 * (W - odd) + 7 * odd) / W)
    opt.close()


def test_ddp_habits_find_torch_default_group_over_the_mpi_world(world):
    """A ported DDP script's other torch.distributed calls work under mpiexec: distopt's MPI world made torch's
    default (gloo) process group, with MPI's ranks and world size."""
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    opt = DistOpt(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    assert (dist.get_rank(), dist.get_world_size()) == (world.rank, world.size)
    total = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(total)  # metric code
    assert total.item() == world.size * (world.size + 1) / 2
    sampler = DistributedSampler(list(range(10 * world.size)), shuffle=False)
    assert list(sampler) == list(range(world.rank, 10 * world.size, world.size))
    dist.barrier()
    opt.close()
    assert dist.is_initialized()  # the script's to destroy, as under torchrun
