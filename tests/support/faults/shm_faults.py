"""Fault-injecting workers for the shm backend, run by :func:`distopt.launch.spawn`.

Each takes SINGA's ``(nccl_id, gpu_num, gpu_per_node, *args)`` and builds
``DistOpt(SGD(...), nccl_id=holder, gpu_num=rank, gpu_per_node=size,
backend="shm")``: the multiprocessing launch mode over shared memory
(``backend="shm"`` is forced so a machine with CuPy does not pick NCCL).
They live at the top level of an importable module so that the ``spawn``
start method can pickle them by reference.

Workers that report what they saw put ``(rank, outcome)`` tuples on a
multiprocessing queue, ``outcome`` being ``"ok"`` or
``"<ExceptionName>: <message>"``.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from distopt import SGD, DistOpt, DistOptError


def make_opt(nccl_id, rank: int, size: int, timeout: float, **kwargs) -> DistOpt:
    return DistOpt(SGD(lr=kwargs.pop("lr", 0.1)), nccl_id=nccl_id, gpu_num=rank, gpu_per_node=size,
                   backend="shm", timeout=timeout, **kwargs)


def _outcome(error: BaseException | None) -> str:
    return "ok" if error is None else f"{type(error).__name__}: {error}"


def boom_worker(nccl_id, rank: int, size: int, pid_dir: str, timeout: float) -> None:
    """H02: every rank builds DistOpt; rank 1 raises ValueError("boom"); the others step."""
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    opt = make_opt(nccl_id, rank, size, timeout, lr=1.0)
    if rank == 1:
        raise ValueError("boom")
    p = np.zeros(4, np.float32)
    opt.step([p], [np.ones(4, np.float32)])


def sigkill_worker(nccl_id, rank: int, size: int, steps: int, kill_at: int, timeout: float,
                   pid_dir: str, results=None) -> None:
    """Dense training of ``steps`` steps; rank 1 SIGKILLs itself at the start of step ``kill_at`` (1-based).

    With ``results`` (a queue) the survivors catch the error of the step they
    were in and report ``(rank, outcome, seconds the step took)``; without,
    the error propagates (as in a real script).
    """
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    opt = make_opt(nccl_id, rank, size, timeout)
    params = [np.zeros((8, 4), np.float32), np.zeros(4, np.float32)]
    for step in range(1, steps + 1):
        if rank == 1 and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            opt.step(params, [np.full(p.shape, rank + 1.0, np.float32) for p in params])
        except DistOptError as exc:
            if results is None:
                raise
            results.put((rank, _outcome(exc), time.monotonic() - start))
            return
    if results is not None:
        results.put((rank, "ok", 0.0))


def skip_worker(nccl_id, rank: int, size: int, then: str, steps: int, timeout: float, results,
                release) -> None:
    """Rank 1 runs ``steps - 1`` dense steps, the others ``steps``; then (see tests/support/faults/skip_collective.py)

    * ``"agree"``: every rank calls ``opt.agree(True)``;
    * ``"idle"``: rank 1 waits on ``release`` (a multiprocessing Event) without
      calling distopt; the others set it once their step has failed.
    """
    opt = make_opt(nccl_id, rank, size, timeout)
    p = np.zeros(6, np.float32)
    error = None
    try:
        for _ in range(steps - 1 if rank == 1 else steps):
            opt.step([p], [np.ones(6, np.float32)])
        if then == "agree" or rank != 1:
            opt.agree(True)
        else:
            release.wait(30)
    except DistOptError as exc:
        error = exc
    finally:
        if rank != 1:
            release.set()
    results.put((rank, _outcome(error)))
    opt.close()


def strategy_mismatch_worker(nccl_id, rank: int, size: int, warm: bool, results) -> None:
    """Rank 0 calls ``step_half`` while the others call ``step`` (optionally after one common dense step).

    Reports ``(rank, outcome, params unchanged by the failed step)``.
    """
    opt = make_opt(nccl_id, rank, size, 5.0, lr=1.0)
    p = np.zeros(5, np.float32)
    if warm:
        opt.step([p], [np.ones(5, np.float32)])
    before = p.copy()
    error = None
    try:
        if rank == 0:
            opt.step_half([p], [np.ones(5, np.float32)])
        else:
            opt.step([p], [np.ones(5, np.float32)])
    except DistOptError as exc:
        error = exc
    results.put((rank, _outcome(error), bool(np.array_equal(p, before))))
    opt.close()
