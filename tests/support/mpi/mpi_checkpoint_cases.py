"""Checkpoint cases under mpiexec -n 2: NumPy scalars (H50), refused values, a truncated residual file.

Run by ``tests/face/test_checkpoint_cases.py``. As tests/support/mpi/mpi_checkpoint.py:
each test performs all its collectives first, catching errors, then
gathers what every rank saw and asserts on values identical on every rank,
so a failing check fails on every rank alike. Collectives have a 20 s
deadline, so an error raised on one rank only would show as a
CollectiveTimeoutError on the other, well inside the harness's job limit.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import distopt
from distopt import SGD, DistOpt
from distopt.comm.mpi import MPICommunicator
from distopt.strategies import Sparse

torch = pytest.importorskip("torch")
DEADLINE = 20.0


@pytest.fixture
def shared_dir(world):
    """A fresh directory every rank sees (rank 0 makes it, removes it afterwards)."""
    if world.size != 2:
        pytest.skip(f"the cases are stated for W=2, this job has W={world.size}")
    path = Path(world.bcast(tempfile.mkdtemp(prefix="distopt-ckpt-cases-") if world.rank == 0 else None, root=0))
    yield path
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _attempt(fn):
    """``(result, None)`` or ``(None, "ErrorClass: message")``, and the seconds it took."""
    start = time.monotonic()
    try:
        return fn(), None, time.monotonic() - start
    except Exception as exc:  # noqa: BLE001 (gathered and compared by the caller)
        return None, f"{type(exc).__name__}: {exc}", time.monotonic() - start


def test_h50_numpy_scalars_round_trip(world, shared_dir):
    net = torch.nn.Linear(3, 2)
    opt = DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm=MPICommunicator(timeout=DEADLINE), model=net)
    saved = {"model": net.state_dict(), "epoch": np.int64(3), "best_acc": np.float64(0.91), "lr": np.float32(0.1),
             "hist": [np.float64(1.0)]}

    def save_then_load():
        distopt.save(shared_dir / "ckpt.pt", saved, opt)
        return distopt.load(shared_dir / "ckpt.pt", opt)

    loaded, error, _ = _attempt(save_then_load)
    same = error is None and all(loaded[k] == saved[k] and type(loaded[k]) is type(saved[k])
                                 for k in ("epoch", "best_acc", "lr", "hist"))
    opt.close()
    assert world.allgather((error, same)) == [(None, True)] * 2


def test_a_refused_value_fails_save_on_every_rank(world, shared_dir):
    opt = DistOpt(SGD(lr=0.1), comm=MPICommunicator(timeout=DEADLINE))
    _, error, seconds = _attempt(lambda: distopt.save(shared_dir / "ckpt.pt", {"when": np.datetime64("2024-01-01")},
                                                      opt))
    opt.close()
    everyone = world.allgather((error, seconds < DEADLINE))
    assert everyone[0] == everyone[1], everyone
    assert everyone[0][0].startswith("TypeError: save on rank 0: model_state['when'] is of type numpy.datetime64")
    assert everyone[0][1], f"save took the {DEADLINE} s deadline: {everyone}"
    assert not (shared_dir / "ckpt.pt").exists()


def test_a_truncated_residual_file_is_reported_on_every_rank(world, shared_dir):
    def sparse_opt():
        opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=MPICommunicator(timeout=DEADLINE),
                      strategy=Sparse(density=0.25, select="topk"))
        params = [np.zeros(8, np.float32)]
        opt.sync_params(params)
        opt.step(params, [np.random.default_rng(world.rank).standard_normal(8).astype(np.float32)])
        return opt, params

    path = shared_dir / "ckpt.pt"
    writer, params = sparse_opt()
    _, save_error, _ = _attempt(lambda: distopt.save(path, params, writer))
    writer.close()
    residuals = shared_dir / "ckpt.pt.rank1.residuals"
    if world.rank == 1:
        residuals.write_bytes(residuals.read_bytes()[:100])
    world.Barrier()
    reader, _ = sparse_opt()
    _, error, seconds = _attempt(lambda: distopt.load(path, reader))
    reader.close()
    everyone = world.allgather((save_error, error, seconds < DEADLINE))
    assert everyone[0] == everyone[1], everyone
    assert everyone[0][0] is None
    assert everyone[0][1].startswith(f"ValueError: load on rank 1: checkpoint {residuals} is truncated or corrupt")
    assert everyone[0][2], f"load took the {DEADLINE} s deadline: {everyone}"
