"""CUDA arrays on the host backends (MPI and shared memory), staged through host memory.

Needs CuPy and a CUDA device (skips cleanly elsewhere): world size 1 in
this process, so that one GPU suffices; the multi-rank logic is the NumPy
path the MPI and shm suites already test.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.unit]

from tests.support.gpu import load_cupy, require_device  # noqa: E402

cupy = load_cupy()


@pytest.fixture(scope="module", params=["mpi", "shm"])
def comm(request):
    require_device()
    from distopt.comm import create
    from distopt.launch.nccl_id import NcclIdHolder

    c = create("mpi") if request.param == "mpi" else create("shm", rank=0, size=1, job_id=NcclIdHolder().job_id)
    yield c
    c.close()


def test_collectives_on_cupy_arrays(comm):
    a = cupy.arange(6, dtype=cupy.float32)
    assert comm.all_reduce(a, op="avg") is a
    np.testing.assert_array_equal(a.get(), np.arange(6))
    h = comm.all_reduce_async(cupy.ones(3, dtype=cupy.float16)) if hasattr(comm, "all_reduce_async") else None
    if h is not None:
        np.testing.assert_array_equal(h.wait().get(), np.ones(3))
    b = cupy.full(4, 2.0)
    assert comm.broadcast(b) is b
    g = comm.all_gather(cupy.arange(3))
    assert isinstance(g, cupy.ndarray) and g.shape == (1, 3)
    parts = comm.all_gather_v(cupy.arange(5, dtype=cupy.int64))
    assert isinstance(parts[0], cupy.ndarray) and parts[0].get().tolist() == list(range(5))


def test_distopt_over_mpi_with_cupy_parameters_equals_numpy():
    require_device()
    import distopt

    results = []
    for xp in (np, cupy):
        opt = distopt.DistOpt(distopt.SGD(lr=0.1, momentum=0.9), backend="mpi")
        params = [xp.zeros(300, dtype=xp.float32), xp.zeros(7, dtype=xp.float32)]
        opt.sync_params(params)
        for s in range(3):
            grads = [xp.asarray(np.random.default_rng(s).standard_normal(p.shape).astype(np.float32)) for p in params]
            opt.step(params, grads)
            opt.step_half(params, [g.copy() for g in grads])
        results.append([p.get() if xp is cupy else p for p in params])
        opt.close()
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
