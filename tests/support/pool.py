"""Worker pools that live for the whole test run: one per real backend and world size.

``run_case("mpi"|"shm"|"torch", W, fn, *args)`` used to start a job per
case (``mpiexec`` or spawned processes: about 5 s on MPI and shm, 14-28 s
on torch, nearly all of it start-up). A :class:`Pool` starts the W worker
processes once and hands them one case after another, the way mpi4py's own
test runner and torch's ``MultiProcessTestCase`` pay start-up per file.

Protocol, through files in the pool's folder:

* the test process writes ``case-K.pkl`` (target, arguments, port; renamed
  into place, so a worker never reads half a file);
* every rank builds a fresh communicator for the case (MPI: a new
  communicator over ``COMM_WORLD``; shm: a new job id; torch: a new default
  process group on a new port), runs ``fn(rank, comm, *args)``, closes the
  communicator, and writes ``result-K-R.pkl`` (the result, or the
  traceback of what it raised); ``at-R`` holds the case it is in.

A case that overruns its limit, or a worker that dies, kills the whole pool
and fails with the stalled ranks named (and the case each was in); the
next case starts a new pool.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]

#: Collective deadline inside the workers, in seconds.
TIMEOUT = 20.0
#: Seconds between two looks at the pool's folder: the test process, and a worker right after a case.
POLL = 0.002
#: The longest a worker idles between two looks (its wait grows from POLL, so idle pools cost no CPU).
IDLE_POLL = 0.05
#: The environment variable naming the test process: workers end when it is gone.
OWNER_ENV = "DISTOPT_TEST_POOL_OWNER"


class Pool:
    """W long-lived worker processes of one backend (``mpi``, ``shm`` or ``torch``).

    Args:
        backend: ``"mpi"``, ``"shm"`` or ``"torch"``.
        size: the world size W.
    """

    def __init__(self, backend: str, size: int) -> None:
        self.backend, self.size = backend, size
        self.dir = Path(tempfile.mkdtemp(prefix=f"distopt-pool-{backend}{size}-"))
        self.count = 0
        self.log = open(self.dir / "output.log", "w+")  # noqa: SIM115 (lives as long as the pool)
        env = dict(os.environ)
        env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "DISTOPT_TIMEOUT": str(TIMEOUT),
                    OWNER_ENV: str(os.getpid())})
        if backend == "mpi":
            from tests.support.harness import launcher_flags, mpiexec

            cmd = [mpiexec(), *launcher_flags(), "-n", str(size), sys.executable, "-m", "tests.support.pool", "mpi",
                   str(self.dir)]
        else:
            cmd = [sys.executable, "-m", "tests.support.pool", backend, str(self.dir), str(size)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def alive(self) -> bool:
        """True while the worker processes run."""
        return self.proc.poll() is None

    def _tail(self) -> str:
        self.log.flush()
        return (self.dir / "output.log").read_text(errors="replace")[-6000:]

    def _where(self, rank: int) -> str:
        f = self.dir / f"at-{rank}"
        return f.read_text() if f.exists() else "start-up (never reached a case)"

    def run(self, target: str, args: tuple, timeout: float) -> list[Any]:
        """Run the case ``target`` (``module:function``) with ``args`` on every rank; results in rank order.

        Raises:
            AssertionError: a rank raised (its traceback), the case overran
                ``timeout`` seconds or a worker died (the stalled ranks named;
                the pool is then closed).
        """
        from tests.support.torch_workers import free_port

        k = self.count
        self.count += 1
        tmp = self.dir / f"case-{k}.tmp"
        tmp.write_bytes(pickle.dumps((target, args, free_port())))
        tmp.rename(self.dir / f"case-{k}.pkl")
        deadline = time.monotonic() + timeout
        results = [self.dir / f"result-{k}-{r}.pkl" for r in range(self.size)]
        while not all(f.exists() for f in results):
            if not self.alive or time.monotonic() > deadline:
                missing = [r for r, f in enumerate(results) if not f.exists()]
                why = (f"overran {timeout:.0f} s" if self.alive else f"lost its workers (exit {self.proc.poll()})")
                stalled = "\n".join(f"rank {r} stalled in: {self._where(r)}" for r in missing)
                tail = self._tail()
                self.close()
                raise AssertionError(f"{target} on the {self.backend} pool (W={self.size}) {why}\n{stalled}\n"
                                     f"--- pool output tail ---\n{tail}")
            time.sleep(POLL)
        outcomes = [pickle.loads(f.read_bytes()) for f in results]
        for f in results:
            f.unlink()
        failed = [(r, text) for r, (ok, text) in enumerate(outcomes) if not ok]
        if failed:
            raise AssertionError(f"{target} failed on the {self.backend} pool (W={self.size}):\n"
                                 + "\n".join(f"--- rank {r} ---\n{text}" for r, text in failed))
        return [value for _, value in outcomes]

    def stop(self) -> None:
        """Ask the workers to end (the stop file); :meth:`close` waits for them."""
        if self.alive:
            (self.dir / "stop").touch()

    def close(self) -> None:
        """End the workers (a stop file, then SIGKILL after a few seconds) and remove the folder."""
        if self.alive:
            self.stop()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[tuple[str, int], Pool] = {}


def run_pooled(backend: str, size: int, target: str, args: tuple, timeout: float) -> list[Any]:
    """Run one case on the pool of ``backend`` at world size ``size`` (started on first use, restarted
    after a failure that killed it)."""
    pool = _POOLS.get((backend, size))
    if pool is None or not pool.alive:
        pool = _POOLS[(backend, size)] = Pool(backend, size)
    return pool.run(target, args, timeout)


#: The pools the ``world`` tier uses: every real backend at W = 1 to 4.
PRESTART = tuple((backend, size) for backend in ("mpi", "shm", "torch") for size in (1, 2, 3, 4))


def prestart(pools: tuple[tuple[str, int], ...] = PRESTART) -> None:
    """Start ``pools`` (``(backend, size)`` pairs) now, without waiting for their workers: a pool's first
    case then finds them started (or waits for the rest of their start-up). A backend this machine lacks
    (no PyTorch, no ``mpiexec``) is left to its first case, which reports it (or is skipped)."""
    from tests.support.harness import mpiexec

    try:
        have_mpi = bool(mpiexec())
    except RuntimeError:
        have_mpi = False
    have = {"mpi": have_mpi, "shm": True, "torch": importlib.util.find_spec("torch") is not None}
    for key in pools:
        if key not in _POOLS and have[key[0]]:
            _POOLS[key] = Pool(*key)


def discard(backend: str, size: int) -> None:
    """Close the pool of ``backend`` at ``size`` (after a case that may have left it out of step); the
    next case starts a new one."""
    pool = _POOLS.pop((backend, size), None)
    if pool is not None:
        pool.close()


def close_pools() -> None:
    """End every pool (at the end of the test run, from ``tests/conftest.py``): every pool is asked first, so
    their workers end together."""
    for pool in _POOLS.values():
        pool.stop()
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


# --- the worker side -------------------------------------------------------------------------------


def resolve(target: str) -> Callable[..., Any]:
    """The case function named ``module:function``."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def communicator(backend: str, rank: int, size: int, port: int, job_id: str) -> Any:
    """A new communicator of ``backend`` for one case: MPI over ``COMM_WORLD``, torch.distributed on
    127.0.0.1:``port``, shared memory under ``job_id``; collectives bounded by :data:`TIMEOUT`."""
    from distopt.comm import create

    if backend == "mpi":
        return create("mpi", timeout=TIMEOUT)
    if backend == "torch":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        return create("torch", rank=rank, size=size, timeout=TIMEOUT)
    return create("shm", rank=rank, size=size, job_id=job_id, timeout=TIMEOUT)


def _owner_gone() -> bool:
    try:
        os.kill(int(os.environ[OWNER_ENV]), 0)
    except ProcessLookupError:
        return True
    return False


def serve(backend: str, rank: int, size: int, folder: str, job_id: str = "") -> None:
    """The worker loop of rank ``rank``: run each case file in turn until the stop file appears
    (or the test process is gone)."""
    d = Path(folder)
    os.environ["DISTOPT_TEST_POOL_AT"] = str(d / f"at-{rank}")  # where an inner suite records its test
    k = 0
    while True:
        case = d / f"case-{k}.pkl"
        pause = POLL
        while not case.exists():
            if (d / "stop").exists() or (pause == IDLE_POLL and _owner_gone()):
                return
            time.sleep(pause)
            pause = min(IDLE_POLL, pause * 1.5)
        target, args, port = pickle.loads(case.read_bytes())
        (d / f"at-{rank}").write_text(f"case {k}: {target}")
        try:
            comm = communicator(backend, rank, size, port, f"{job_id}-c{k}")
            try:
                outcome = (True, resolve(target)(rank, comm, *args))
            finally:
                comm.close()
        except BaseException:  # noqa: BLE001 (reported to the test process, which fails the case)
            outcome = (False, traceback.format_exc())
        try:
            blob = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001
            blob = pickle.dumps((False, f"result of {target} does not pickle:\n{traceback.format_exc()}"))
        tmp = d / f"result-{k}-{rank}.tmp"
        tmp.write_bytes(blob)
        tmp.rename(d / f"result-{k}-{rank}.pkl")
        (d / f"at-{rank}").write_text(f"idle after case {k}")
        k += 1


def _spawned(nccl_id: Any, rank: int, size: int, backend: str, folder: str) -> None:
    serve(backend, rank, size, folder, nccl_id.job_id)


if __name__ == "__main__":
    if sys.argv[1] == "mpi":
        from mpi4py import MPI

        serve("mpi", MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), sys.argv[2])
    else:
        from distopt.launch import spawn

        spawn(_spawned, int(sys.argv[3]), (sys.argv[1], sys.argv[2]))
