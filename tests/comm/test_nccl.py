"""NCCL backend at world size 1 on a GPU (skips cleanly without CuPy or a device).

NCCL refuses two ranks on one GPU, so on a single-GPU machine only world
size 1 can be checked; multi-rank logic is covered by the MPI/shm suites.
"""
from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
pytestmark = [pytest.mark.gpu, pytest.mark.unit]

from tests.support.gpu import require_device  # noqa: E402


@pytest.fixture(scope="module")
def comm():
    require_device()
    from distopt.comm.nccl import NcclCommunicator, new_unique_id

    c = NcclCommunicator(rank=0, size=1, unique_id=new_unique_id(), device=0)
    yield c
    c.close()


def test_all_reduce_sum_avg_bool(comm):
    a = cupy.arange(10, dtype=cupy.float32)
    comm.all_reduce(a)
    np.testing.assert_array_equal(a.get(), np.arange(10))
    comm.all_reduce(a, op="avg")
    np.testing.assert_array_equal(a.get(), np.arange(10))
    b = cupy.array([True, False])
    comm.all_reduce(b)
    np.testing.assert_array_equal(b.get(), [True, False])
    with pytest.raises(TypeError, match="avg"):
        comm.all_reduce(cupy.arange(3, dtype=cupy.int32), op="avg")


def test_h30_stream_ordered_after_producer(comm):
    """H30: a large kernel writes the buffer right before the all-reduce, no explicit sync."""
    expect = np.arange(2**20, dtype=np.float32)
    for _ in range(50):
        g = cupy.arange(2**20, dtype=cupy.float32) * 1
        comm.all_reduce(g, op="avg")
        np.testing.assert_array_equal(g.get(), expect)


def test_broadcast_gather(comm):
    a = cupy.ones((2, 3), dtype=cupy.float64)
    comm.broadcast(a)
    assert comm.all_gather(a).shape == (1, 2, 3)
    parts = comm.all_gather_v(cupy.arange(4, dtype=cupy.float32))
    np.testing.assert_array_equal(parts[0].get(), np.arange(4))
    comm.barrier()


def test_steady_state_plain_and_half_steps_never_wait_on_the_host(comm):  # noqa: ARG001
    """The spawn mode's NCCL DistOpt has a shared-memory control plane: after the first step, plain and
    half steps add no host synchronisation (``stats.host_syncs``)."""
    import distopt

    holder = distopt.NcclIdHolder()
    opt = distopt.DistOpt(distopt.SGD(lr=0.1), nccl_id=holder, gpu_num=0, gpu_per_node=1)
    assert opt.comm.control is not None and opt.comm.control.name == "shm"
    p = [cupy.zeros(1000, dtype=cupy.float32), cupy.zeros(10, dtype=cupy.float32)]
    opt.step(p, [cupy.ones_like(x) for x in p])
    first = opt.stats.host_syncs
    for _ in range(3):
        opt.step(p, [cupy.ones_like(x) for x in p])
        opt.step_half(p, [cupy.ones_like(x) for x in p])
    assert opt.stats.host_syncs == first == 0
    np.testing.assert_allclose(p[0].get(), -0.7, rtol=1e-3)
    opt.close()


def test_distopt_from_nccl_id_holder_all_strategies(comm):  # noqa: ARG001 (fixture: skips without a GPU)
    """The multiprocessing mode's ticket builds a 1-process NCCL DistOpt; every strategy runs on CuPy."""
    import distopt

    holder = distopt.NcclIdHolder()
    assert holder.nccl_id is not None
    opt = distopt.DistOpt(distopt.SGD(lr=1.0), nccl_id=holder, gpu_num=0, gpu_per_node=1)
    assert opt.comm.name == "nccl"
    p = cupy.zeros(1000, dtype=cupy.float32)
    g = cupy.arange(1000, dtype=cupy.float32) / 1000
    opt.step([p], [g.copy()])
    np.testing.assert_allclose(p.get(), -np.arange(1000) / 1000, rtol=1e-6)
    opt.step_half([p], [g.copy()])
    np.testing.assert_allclose(p.get(), -2 * np.arange(1000) / 1000, rtol=1e-3, atol=1e-3)
    before = p.copy()
    opt.step_sparse([p], [g.copy()], spars=0.01, topK=True)
    assert int(cupy.count_nonzero(p - before)) == 10  # exactly k = 1% of 1000 entries moved
    opt.step_partial([p], [g.copy()])
    opt.close()


def test_torch_cuda_overlap_matches_post_backward(comm):  # noqa: ARG001 (fixture: skips without a GPU)
    """PyTorch on CUDA through NCCL: hooks start buckets during backward; results equal overlap=False."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    import distopt

    results = []
    for overlap in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512),
                                    torch.nn.Tanh(), torch.nn.Linear(512, 8)).cuda()
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = distopt.DistOpt(sgd, nccl_id=distopt.NcclIdHolder(), gpu_num=0, gpu_per_node=1,
                              buffSize=70000, overlap=overlap)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(5):
            x = torch.randn(32, 64, device="cuda", generator=g)
            sgd.zero_grad()
            opt.backward_and_update(model(x).square().mean(), threshold=100000)
        torch.cuda.synchronize()
        if overlap:
            assert opt.stats["buckets_started_in_backward"] > 0
        results.append([p.detach().cpu().numpy() for p in model.parameters()])
        opt.close()
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


def test_host_wait_bounded_and_aborts(comm):  # noqa: ARG001 (fixture: skips without a GPU)
    """Host waits are bounded: with the device still busy past the deadline, barrier() aborts and raises."""
    from distopt.comm.nccl import NcclCommunicator, new_unique_id
    from distopt.errors import CollectiveTimeoutError

    c = NcclCommunicator(rank=0, size=1, unique_id=new_unique_id(), device=0, timeout=5)
    flags = np.array([1, 2, 3], dtype=np.int32)
    c.all_reduce(flags)  # a host array: staged through the device, bounded host wait
    np.testing.assert_array_equal(flags, [1, 2, 3])
    a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
    for _ in range(5):  # ~0.1 s of queued device work, enqueued without waiting
        a = a @ a
    c.timeout = 0.0
    with pytest.raises(CollectiveTimeoutError, match="aborted"):
        c.barrier()
    c.close()  # idempotent after the abort


def test_sharded_collectives_at_world_size_1(comm):
    """reduce_scatter(_async), all_gather_into(_async), all_to_all on CuPy and (staged) NumPy arrays, and
    the shared argument checks; the conformance suite's sharded checks at world size 1."""
    from tests.support import conformance

    a = cupy.arange(7, dtype=cupy.float32)
    got = comm.reduce_scatter(a, op="avg")
    assert isinstance(got, cupy.ndarray) and got is not a
    np.testing.assert_array_equal(got.get(), np.arange(7))
    np.testing.assert_array_equal(comm.reduce_scatter_async(a, [7], op="max").wait().get(), np.arange(7))
    assert comm.all_gather_into(a) is a and comm.all_gather_into_async(a, [7]).wait() is a
    rows = comm.all_to_all(cupy.arange(6, dtype=cupy.int64).reshape(1, 2, 3))
    np.testing.assert_array_equal(rows.get(), np.arange(6).reshape(1, 2, 3))
    with pytest.raises(ValueError, match="counts must sum"):
        comm.reduce_scatter(a, [6])
    with pytest.raises(ValueError, match="shape .size=1"):
        comm.all_to_all(cupy.ones((2, 2)))
    for check in conformance.SHARD_CHECKS:  # NumPy arrays, staged through the device
        check(comm)
