"""zero=3 on CUDA tensors (CuPy views of the gathered buffers) against zero=0, world size 1; its NumPy twin
runs everywhere (``test_zero3.py``, and the raw array view below). Skips cleanly without CuPy, torch's CUDA
build or a device."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


@pytest.mark.unit
def test_raw_array_views_a_tensor_and_leaves_its_storage_resizable():
    from distopt.sharding.params import raw_array

    t = torch.arange(6, dtype=torch.float32)
    a = raw_array(t, np.dtype(np.float32))
    a[2] = 40.0
    assert t[2].item() == 40.0 and t.untyped_storage().resizable()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(24)  # a torch .numpy() view would have pinned it
    assert raw_array(torch.empty(0), np.dtype(np.float32)).size == 0


@pytest.mark.gpu
@pytest.mark.unit
def test_zero3_on_cuda_equals_zero0():
    pytest.importorskip("cupy")
    from tests.support.gpu import require_device

    require_device()
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import distopt
    from distopt.comm import create

    runs = []
    for zero in (0, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.GELU(), torch.nn.Linear(13, 3)).cuda()
        opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=0.01), comm=create("single"), zero=zero,
                              model=model, buffSize=40)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(5, 7, device="cuda", generator=g)).pow(2).mean().backward()
            opt.step()
        with opt.summon_full_params():
            runs.append([p.detach().cpu().clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
