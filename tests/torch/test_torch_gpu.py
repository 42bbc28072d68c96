"""The torch side of the GPU review: distopt's CuPy work on torch's current CUDA stream (F6), and no host
synchronisation per layer or per tensor in SyncBatchNorm's statistics (F15) and sharded clipping (F16).

Torch's CUDA tensors need a real device: those cases skip elsewhere. The
host reads are counted on CPU tensors, where each ``float()``/``item()``/
``cpu()``/``tolist()`` of a tensor stands for a device-to-host copy on CUDA,
with the same code path forced (``_count_on_host``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.support.gpu import devices, is_standin, load_cupy, require_real_device
from tests.support.simworld import run_world

torch = pytest.importorskip("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

from distopt import DistOpt  # noqa: E402

cupy = load_cupy()


class HostReads(TorchFunctionMode):
    """Counts the tensor reads that copy a CUDA tensor to the host (a synchronisation each)."""

    READS = {torch.Tensor.__float__, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.__int__,
             torch.Tensor.__bool__}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


class _FakeCuda:
    """What ``torch_stream`` reads of a CUDA tensor."""

    is_cuda = True
    device = torch.device("cuda", 1)


@pytest.mark.gpu
@pytest.mark.unit
@pytest.mark.skipif(not is_standin(cupy), reason="a stand-in stream poses as torch's")
def test_f6_cupy_work_runs_on_torchs_current_stream(monkeypatch):
    """F6: inside the scope distopt enters for CUDA parameters, CuPy's current stream is torch's current
    stream of the parameter's device (not CuPy's default), so distopt's kernels and NCCL are ordered with
    the script's under ``torch.cuda.stream(s)``; CPU tensors leave CuPy alone."""
    from distopt.torch.adapter import torch_stream

    with devices(2):
        cupy.cuda.Device(1).use()
        theirs = cupy.cuda.Stream(non_blocking=True)
        asked = []

        class TorchStream:
            cuda_stream = theirs.ptr

        def current_stream(device):
            asked.append(device)
            return TorchStream()

        monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
        assert cupy.cuda.get_current_stream() != theirs
        with torch_stream(_FakeCuda()):
            assert cupy.cuda.get_current_stream() == theirs
            g = cupy.zeros(3, dtype=cupy.float32)
            cupy._standin.launch(lambda: g._a.__setitem__(Ellipsis, 7.0), stream=theirs)
            assert (g + 0).get().tolist() == [7.0] * 3  # the script's queued kernel ran first
        assert asked == [torch.device("cuda", 1)] and cupy.cuda.get_current_stream() != theirs
        with torch_stream(torch.zeros(2)):
            assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.null


@pytest.mark.gpu
@pytest.mark.unit
def test_f6_overlap_under_a_side_stream_equals_the_default_stream():
    """F6 on a real device: a model trained under ``torch.cuda.stream(s)`` equals the default stream's."""
    require_real_device()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    import distopt

    results = []
    for side in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 8)).cuda()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = distopt.DistOpt(sgd, nccl_id=distopt.NcclIdHolder(), gpu_num=0, gpu_per_node=1, buffSize=70000)
        stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.cuda.stream(stream):
            for _ in range(5):
                x = torch.randn(64, 256, device="cuda", generator=g)
                sgd.zero_grad()
                opt.backward_and_update(model(x).square().mean())
        torch.cuda.synchronize()
        results.append([p.detach().cpu() for p in model.parameters()])
        opt.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
def test_f15_sync_batchnorm_count_travels_on_the_host(monkeypatch, world):
    """F15: where the sums stay on a GPU, the count goes in a host all-reduce of its own: no tensor read
    per layer, the same bits as the one-buffer route, and bad input still raises on every rank."""
    from distopt.torch import sync_stats
    from distopt.torch.sync_batchnorm import SyncBatchNorm
    from tests.torch.test_sync_batchnorm import SIZES, _data, _run, case_eval_and_errors

    sizes = SIZES[world]

    def case(rank: int, comm: Any) -> dict[str, np.ndarray]:
        layer = SyncBatchNorm(3, momentum=0.1, comm=comm, dtype=torch.float64)
        lo = sum(sizes[:rank])
        before = len(comm.calls)
        out = _run(layer, _data(4, sizes, 3, "float64"), lo, lo + sizes[rank], 2)
        out["calls"] = np.array([n for _, n in comm.calls[before:]])
        return out

    def run(on_host: bool) -> tuple[list[Any], int]:
        monkeypatch.setattr(sync_stats, "_count_on_host", lambda x, comm: on_host)
        reads = HostReads()
        real = sync_stats.global_stats

        def counted(*args: Any) -> Any:
            with reads:
                return real(*args)

        monkeypatch.setattr(sync_stats, "global_stats", counted)
        got = run_world(world, case)
        monkeypatch.setattr(sync_stats, "global_stats", real)
        return got, reads.count

    one_buffer, reads_before = run(False)
    split, reads_after = run(True)
    assert reads_before == 2 * world and reads_after == 0  # 2 forwards on every rank
    for a, b in zip(one_buffer, split):
        assert a.pop("calls").tolist() == [7, 6] * 2 and b.pop("calls").tolist() == [1, 6, 6] * 2
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    found = run_world(world, case_eval_and_errors)
    for r, f in enumerate(found):
        assert ("expects a 2-D to 5-D input" if r == 0 else "another rank's input was unusable") in f["ndim"]


def _clip_reads(layers: int) -> list[int]:
    """Every rank's tensor reads in one ``opt.clip_grad_norm_`` at ``zero=2``, W = 2, ``layers`` layers."""
    def rank_fn(rank: int, comm: Any) -> int:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(layers)])
        opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, zero=2, buffSize=50)
        model(torch.full((3, 6), rank + 1.0)).square().sum().backward()
        reads = HostReads()
        with reads:
            norm = opt.clip_grad_norm_(0.1)
        assert norm > 0.1
        opt.close()
        return reads.count

    return run_world(2, rank_fn)


@pytest.mark.unit
def test_f16_sharded_clipping_reads_the_norms_once():
    """F16: the norms of the whole pieces reach the host in one copy, the straddling pieces' values in
    one, and the norms table goes back in one: the reads do not grow with the number of tensors."""
    few, many = _clip_reads(2), _clip_reads(8)
    assert few == many and max(many) <= 2, (few, many)
