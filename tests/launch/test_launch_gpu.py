"""The GPU side of the launch modes, on the stand-in (or a real machine): the launcher process never
touches CUDA or NCCL (F17), spawn picks shared memory when NCCL cannot load (F1) or there are fewer
devices than processes (F2), one ticket serves every communicator of a job (F3), and NCCL's id travels
over MPI under ``mpiexec``."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.gpu import devices, is_standin, load_cupy, standin_env
from tests.support.harness import ROOT, run_job

cupy = load_cupy()
standin_only = pytest.mark.skipif(not is_standin(cupy), reason="runs worker processes on the stand-in")
SCRIPT = str(ROOT / "tests/support/launched/gpu_job.py")


@pytest.mark.gpu
@pytest.mark.unit
@standin_only
def test_f17_the_ticket_and_the_launcher_never_touch_cuda():
    """F17: making the job's ticket initialises no CUDA and starts no NCCL bootstrap root in the launching
    process (each NCCL communicator's id is made by its rank 0)."""
    import distopt

    with devices(1):
        distopt.NcclIdHolder()
        assert (cupy._state.counters.cuda_inits, cupy._state.counters.nccl_roots) == (0, 0)


@pytest.mark.gpu
@pytest.mark.unit
def test_f2_spawn_uses_nccl_only_with_a_device_per_process():
    """F2: more processes than visible devices is shared memory (the GPUs shared); a device each is NCCL;
    NCCL asked for with too few devices fails at once on every rank, naming the count."""
    import distopt
    from distopt.comm.nccl import NcclCommunicator
    from distopt.launch.backend_rule import _spawned_backend
    from distopt.launch.info import Launch

    holder = distopt.NcclIdHolder()
    with devices(1):
        assert _spawned_backend(Launch({}, 5.0, 1, 2, holder), None) == "shm"
        with pytest.raises(ValueError, match="2 processes but 1 visible CUDA device.*share the GPUs"):
            NcclCommunicator.from_launch(Launch({}, 5.0, 1, 2, holder))
    with devices(2):
        assert _spawned_backend(Launch({}, 5.0, 1, 2, holder), None) == "nccl"


def _spawn(env: dict[str, str]) -> str:
    res = subprocess.run([sys.executable, SCRIPT, "spawn"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    return out


def _results(out: str) -> dict[int, list[tuple[str, float]]]:
    found: dict[int, list[tuple[str, float]]] = {}
    for rank, backend, value in re.findall(r"rank (\d) backend (\w+) result (-?[\d.]+)", out):
        found.setdefault(int(rank), []).append((backend, float(value)))
    return found


@pytest.mark.gpu
@pytest.mark.job
@standin_only
def test_f1_spawn_runs_over_shared_memory_when_nccl_cannot_load():
    """F1: a CuPy whose NCCL cannot load (``available = False``) runs the spawn job to the end over shared
    memory, and says why once."""
    out = _spawn(standin_env(devices=2, nccl="0"))
    assert _results(out) == {0: [("shm", -1.5)] * 2, 1: [("shm", -1.5)] * 2}, out
    assert out.count("cannot load NCCL") == 2, out  # rank 0 says it, once per DistOpt


@pytest.mark.gpu
@pytest.mark.job
@standin_only
def test_f2_spawn_on_one_device_shares_it_and_f3_a_device_each_is_nccl_twice_from_one_ticket():
    """F2: two processes on one device share it over shared memory; F3: with two devices, NCCL, and a
    second DistOpt from the same ticket agrees on a fresh NCCL id (a reused one would fail)."""
    out = _spawn(standin_env(devices=1))
    assert _results(out) == {0: [("shm", -1.5)] * 2, 1: [("shm", -1.5)] * 2}, out
    assert "2 processes but 1 visible CUDA device" in out
    out = _spawn(standin_env(devices=2))
    assert _results(out) == {0: [("nccl", -1.5)] * 2, 1: [("nccl", -1.5)] * 2}, out


@pytest.mark.gpu
@pytest.mark.job
@standin_only
def test_nccl_under_mpiexec_gets_its_id_over_mpi():
    """``mpiexec -n 2`` with ``backend="nccl"``: rank 0 makes the NCCL id and MPI broadcasts it."""
    env = standin_env(devices=2)
    res = run_job([sys.executable, SCRIPT, "mpi"], 2, timeout=120, env={k: env[k] for k in
                                                                        ("PYTHONPATH", "CUPY_STANDIN_DEVICES")})
    assert res.returncode == 0, res.stdout[-4000:]
    assert _results(res.stdout) == {0: [("nccl", -1.5)], 1: [("nccl", -1.5)]}, res.stdout
