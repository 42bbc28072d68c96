"""Run one case function on W ranks over a chosen backend: the simulated world, MPI, shm or torch.distributed.

A case is a top-level function ``fn(rank, comm, *args) -> result`` of an
importable test module; its result must pickle. ``run_case(backend, W, fn,
*args)`` returns the results in rank order:

* ``"sim"``: W threads of this process (:func:`tests.simworld.run_world`);
* a real backend: by default the run-long worker pool of that backend and
  W (:mod:`tests.pool`); with ``fresh=True`` a job of its own:
* ``"mpi"``: ``mpiexec -n W python -m tests.backends ...`` (real processes,
  the MPI backend), under a hard limit that names the stalled ranks;
* ``"shm"`` and ``"torch"``: W processes from :func:`distopt.launch.spawn`
  (shared memory; torch.distributed over gloo on 127.0.0.1).

Results travel as one pickle file per rank in a temporary folder.
"""
from __future__ import annotations

import importlib
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from tests.harness import run_job
from tests.pool import run_pooled
from tests.simworld import run_world

BACKENDS = ("sim", "mpi", "shm", "torch")


def tiered(cases: list[Any]) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``, each marked with its tier: ``unit`` for the simulated
    world (threads of this process), ``world`` for a real backend (processes).

    A case is a backend name or a tuple whose first item is one.
    """
    import pytest

    out = []
    for case in cases:
        backend = case[0] if isinstance(case, tuple) else case
        mark = pytest.mark.unit if backend == "sim" else pytest.mark.world
        out.append(pytest.param(*case, marks=mark) if isinstance(case, tuple) else pytest.param(case, marks=mark))
    return out

#: Collective deadline inside the workers, in seconds.
TIMEOUT = 20.0


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_and_save(fn: Callable[..., Any], rank: int, comm: Any, args: tuple, out: str) -> None:
    result = fn(rank, comm, *args)
    Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))


def _spawned(nccl_id: Any, rank: int, size: int, backend: str, target: str, out: str, args: tuple,
             port: int) -> None:
    from distopt.comm import create

    if backend == "torch":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        comm = create("torch", rank=rank, size=size, timeout=TIMEOUT)
    else:
        comm = create("shm", rank=rank, size=size, job_id=nccl_id.job_id, timeout=TIMEOUT)
    try:
        _run_and_save(_resolve(target), rank, comm, args, out)
    finally:
        comm.close()


def run_case(backend: str, size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0,
             fresh: bool = False) -> list[Any]:
    """``fn(rank, comm, *args)`` on ``size`` ranks of ``backend``; the results in rank order.

    A real backend runs the case on the run-long worker pool of that backend
    and world size (:mod:`tests.pool`); ``fresh=True`` starts a job of its
    own instead (for a case that must own its processes).

    Raises:
        AssertionError: a rank failed or the job overran ``timeout`` (naming the ranks).
    """
    if backend == "sim":
        return run_world(size, lambda rank, comm: fn(rank, comm, *args))
    target = f"{fn.__module__}:{fn.__name__}"
    if not fresh:
        return run_pooled(backend, size, target, args, timeout)
    with tempfile.TemporaryDirectory(prefix="distopt-case-") as out:
        if backend == "mpi":
            blob = pickle.dumps(args).hex()
            res = run_job([sys.executable, "-m", "tests.backends", target, out, blob], n=size, timeout=timeout,
                          collective_timeout=TIMEOUT)
            assert res.returncode == 0, f"{target} failed under mpiexec -n {size}:\n{res.stdout[-8000:]}"
        else:
            from distopt.launch import spawn
            from tests.torch_workers import free_port

            spawn(_spawned, size, (backend, target, out, args, free_port()), timeout=timeout)
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(size)]


def _mpi_main(target: str, out: str, blob: str) -> None:
    from distopt.comm import create

    comm = create("mpi", timeout=TIMEOUT)
    try:
        _run_and_save(_resolve(target), comm.rank, comm, pickle.loads(bytes.fromhex(blob)), out)
    finally:
        comm.close()


if __name__ == "__main__":
    _mpi_main(*sys.argv[1:4])
