"""zero=3 on CUDA tensors (CuPy views of the gathered buffers) against zero=0, world size 1; its NumPy twin
runs everywhere (``test_zero3.py``, and the raw array view below). Skips cleanly without CuPy, torch's CUDA
build or a device."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.mark.unit
def test_raw_array_views_a_tensor_and_leaves_its_storage_resizable():
    from distopt.torch.zero.params import raw_array

    t = torch.arange(6, dtype=torch.float32)
    a = raw_array(t, np.dtype(np.float32))
    a[2] = 40.0
    assert t[2].item() == 40.0 and t.untyped_storage().resizable()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(24)  # a torch .numpy() view would have pinned it
    assert raw_array(torch.empty(0), np.dtype(np.float32)).size == 0


def _cuda_runs(**where) -> list[list]:
    """zero=0 and zero=3 on a small CUDA model, 3 AdamW steps each: their parameters."""
    import distopt

    runs = []
    for zero in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3)).cuda()
        opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=0.01), zero=zero, model=model, buffSize=40,
                              **where())
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 7, device="cuda", generator=g)).pow(2).mean().backward()
            opt.step()
        with opt.summon_full_params():
            runs.append([p.detach().cpu().clone() for p in model.parameters()])
        opt.close()
    return runs


def _require_cuda() -> None:
    from tests.support.gpu import load_cupy, require_real_device

    load_cupy()
    require_real_device()
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")


@pytest.mark.gpu
@pytest.mark.unit
def test_zero3_on_cuda_equals_zero0():
    _require_cuda()
    from distopt.comm import create

    for a, b in zip(*_cuda_runs(lambda: {"comm": create("single")})):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.unit
def test_f21_zero3_over_nccl_at_world_size_1_equals_zero0():
    """F21: the parameters' all-gather into raw CuPy views of the freed tensors, through NCCL."""
    _require_cuda()
    import distopt

    for a, b in zip(*_cuda_runs(lambda: {"nccl_id": distopt.NcclIdHolder(), "gpu_num": 0, "gpu_per_node": 1})):
        assert torch.equal(a, b)
