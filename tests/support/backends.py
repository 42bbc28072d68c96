"""Run one case function on W ranks over a chosen backend: the simulated world, MPI, shm or torch.distributed.

A case is a top-level function ``fn(rank, comm, *args) -> result`` of an
importable test module; its result must pickle. ``run_case(backend, W, fn,
*args)`` returns the results in rank order:

* ``"sim"``: W threads of this process (:func:`tests.support.simworld.run_world`);
* ``"mpi"``, ``"shm"``, ``"torch"``: the run-long worker pool of that
  backend and W (:mod:`tests.support.pool`: ``mpiexec -n W``, or W processes from
  :func:`distopt.launch.spawn`), under a hard limit that names the stalled
  ranks.
"""
from __future__ import annotations

from typing import Any, Callable

from tests.support.pool import run_pooled
from tests.support.simworld import run_world

BACKENDS = ("sim", "mpi", "shm", "torch")


def tiered(cases: list[Any]) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``, each marked with its tier: ``unit`` for the simulated
    world (threads of this process), ``world`` for a real backend (processes).

    A case is a backend name or a tuple whose first item is one.
    """
    import pytest

    out = []
    for case in cases:
        values = case if isinstance(case, tuple) else (case,)
        out.append(pytest.param(*values, marks=pytest.mark.unit if values[0] == "sim" else pytest.mark.world))
    return out


def run_case(backend: str, size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, comm, *args)`` on ``size`` ranks of ``backend``; the results in rank order.

    A real backend runs the case on the run-long worker pool of that backend
    and world size (:mod:`tests.support.pool`).

    Raises:
        AssertionError: a rank failed or the case overran ``timeout`` (naming the ranks).
    """
    if backend == "sim":
        return run_world(size, lambda rank, comm: fn(rank, comm, *args))
    return run_pooled(backend, size, f"{fn.__module__}:{fn.__name__}", args, timeout)
