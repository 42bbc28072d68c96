"""Start the processes of a single-node job, fail-fast.

Two forms, after SINGA's multiprocess launch (one ``NcclIdHolder`` shared by
``nprocs`` workers), PyTorch's ``torch.multiprocessing.spawn`` and ``torchrun``:

* :func:`spawn` runs ``fn(nccl_id, gpu_num, gpu_per_node, *args)`` in
  ``nprocs`` processes started with the ``spawn`` method;
* ``python -m distopt.launch -n 4 script.py args...`` runs four copies of a
  script with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
  and ``DISTOPT_JOB_ID`` set, e.g. for
  ``ShmCommunicator(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
  os.environ["DISTOPT_JOB_ID"])``.

In both, the first worker that fails (raises, exits non-zero or is killed)
ends the job: the others get SIGTERM, then SIGKILL after a grace period, all
are reaped, and the failure is reported with its rank.
"""
from __future__ import annotations

import argparse
import logging
import logging.handlers
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from tqdm import tqdm

from .errors import DistOptError
from .nccl_id import NcclIdHolder, new_job_id

__all__ = ["WorkerFailedError", "spawn", "progress", "main"]

T = TypeVar("T")

_LOG_FORMAT = "[rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class WorkerFailedError(DistOptError):
    """A worker of :func:`spawn` failed; the other workers were terminated.

    Attributes:
        rank: the failing (or, after the job timeout, first stalled) rank.
        exitcode: its exit code (negative: killed by that signal), or None.
        traceback: the formatted traceback of the worker's exception, or "".
    """

    def __init__(self, rank: int, reason: str, traceback_text: str = "",
                 exitcode: int | None = None) -> None:
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback_text
        message = f"rank {rank} {reason}"
        if traceback_text:
            message += f"\n--- traceback of rank {rank} ---\n{traceback_text}"
        super().__init__(message)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _worker(fn: Callable[..., Any], rank: int, nprocs: int, holder: NcclIdHolder,
            args: tuple, conn: Connection, log_queue: Any, log_level: int) -> None:
    """Child side of :func:`spawn`: forward logs, run ``fn``, report a failure."""
    level = log_level if rank == 0 else max(log_level, logging.WARNING)
    handler = logging.handlers.QueueHandler(log_queue)
    handler.setLevel(level)

    def tag(record: logging.LogRecord) -> bool:
        record.rank = rank
        return True

    handler.addFilter(tag)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    try:
        fn(holder, rank, nprocs, *args)
    except (Exception, KeyboardInterrupt):
        conn.send((time.monotonic(), traceback.format_exc()))
        sys.exit(1)
    finally:
        conn.close()


def _forward_records(log_queue: Any, handler: logging.Handler) -> None:
    """Parent side of log forwarding: write records until a None arrives."""
    while True:
        record = log_queue.get()
        if record is None:
            return
        handler.handle(record)


def _watch(procs: list, conns: dict[Connection, int], timeout: float | None
           ) -> tuple[int, str, str] | None:
    """Wait for the workers; return (rank, traceback, reason) of the first failure.

    ``reason`` is "" for a worker that reported an exception (its exit code is
    known only once it is reaped).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    conns = dict(conns)
    while running:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            stalled = sorted(running.values())
            return (stalled[0], "", f"did not finish within the {timeout:g} s job timeout "
                    f"(still running: {', '.join(f'rank {r}' for r in stalled)})")
        failures = []  # (time, rank, traceback, reason)
        for obj in wait([*running, *conns], remaining):
            if obj in conns:
                try:
                    when, text = obj.recv()
                except EOFError:  # the worker closed its end: it is exiting
                    del conns[obj]
                    continue
                failures.append((when, conns[obj], text, ""))
            else:
                rank = running.pop(obj)
                procs[rank].join()
                if procs[rank].exitcode != 0:
                    failures.append((time.monotonic(), rank, "", _describe_exit(procs[rank].exitcode)))
        if failures:
            _, rank, text, reason = min(failures)
            return rank, text, reason
    return None


def _stop(procs: list, join_timeout: float, spare: int | None = None) -> None:
    """SIGTERM every live worker but ``spare``, SIGKILL after ``join_timeout`` s, reap all."""
    alive = [p for p in procs if p.is_alive()]
    for rank, p in enumerate(procs):
        if p in alive and rank != spare:
            p.terminate()
    deadline = time.monotonic() + join_timeout
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            p.kill()
            p.join()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), *,
          nccl_id: NcclIdHolder | None = None, timeout: float | None = None,
          join_timeout: float = 5.0, log_level: int = logging.INFO) -> None:
    """Run ``fn(nccl_id, gpu_num, gpu_per_node, *args)`` in ``nprocs`` processes.

    Processes are started with the ``spawn`` method, so ``fn`` and ``args``
    must be picklable (``fn`` defined at the top level of an importable
    module). ``gpu_num`` is the rank (0 .. nprocs-1), ``gpu_per_node`` is
    ``nprocs``. Workers' ``logging`` records are written to this process's
    stdout as ``[rank R] LEVEL logger: message``: records at ``log_level`` and
    above from rank 0, WARNING and above from the others. A KeyboardInterrupt
    in this process terminates every worker and propagates. Afterwards any
    shared-memory segment of the job left by a killed worker is unlinked.

    Args:
        fn: the worker function.
        nprocs: number of processes.
        args: extra positional arguments for ``fn``.
        nccl_id: the job's ticket; a new :class:`NcclIdHolder` by default.
        timeout: wall-clock limit of the whole job, in seconds (None: none).
        join_timeout: seconds a terminated worker gets between SIGTERM and
            SIGKILL (the failing worker gets as long to exit by itself).
        log_level: level of the records forwarded from rank 0.

    Raises:
        ValueError: ``nprocs < 1``.
        WorkerFailedError: a worker raised, exited non-zero or was killed by a
            signal, or the job overran ``timeout``; carries the rank, the exit
            code and the worker's traceback.
    """
    from .comm.shm import unlink_segments

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    holder = nccl_id if nccl_id is not None else NcclIdHolder()
    ctx = multiprocessing.get_context("spawn")
    log_queue = ctx.Queue()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    listener = threading.Thread(target=_forward_records, args=(log_queue, handler),
                                name="distopt-log-listener", daemon=True)
    listener.start()
    procs: list = []
    conns: dict[Connection, int] = {}
    failure = None
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"distopt-rank{rank}",
                               args=(fn, rank, nprocs, holder, tuple(args), writer, log_queue, log_level))
            proc.start()
            writer.close()
            procs.append(proc)
            conns[reader] = rank
        failure = _watch(procs, conns, timeout)
    finally:
        _stop(procs, join_timeout, spare=None if failure is None else failure[0])
        for reader in conns:
            reader.close()
        log_queue.put(None)
        listener.join(join_timeout)
        if listener.is_alive():  # stuck on a record cut short by a kill
            log_queue.cancel_join_thread()
        log_queue.close()
        unlink_segments(holder.job_id, untrack=True)
    if failure is not None:
        rank, text, reason = failure
        code = procs[rank].exitcode
        raise WorkerFailedError(rank, reason or f"raised an exception ({_describe_exit(code)})",
                                text, code)


def progress(iterable: Iterable[T], rank: int, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable)`` on rank 0; the bare iterable (no bar) on the others."""
    return tqdm(iterable, **kwargs) if rank == 0 else iterable


def _terminate(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM the live children, SIGKILL after ``grace`` s, reap all."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m distopt.launch -n N script.py args...``; returns the exit status.

    0 when every copy exits 0; otherwise the first failing rank's exit code
    (128 + signal number for a signal), after terminating the others; 130 on
    Ctrl-C, 143 on SIGTERM (the children are terminated too).
    """
    parser = argparse.ArgumentParser(
        prog="python -m distopt.launch",
        description="Run N copies of a Python script as one single-node job, fail-fast.")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when ending the job (default 5)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error("-n must be >= 1")
    job_id = new_job_id()
    procs: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for rank in range(ns.nproc):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(ns.nproc), LOCAL_WORLD_SIZE=str(ns.nproc),
                       DISTOPT_JOB_ID=job_id)
            procs.append(subprocess.Popen([sys.executable, ns.script, *ns.args], env=env))
        while True:
            for rank, p in enumerate(procs):
                code = p.poll()
                if code:
                    print(f"distopt.launch: rank {rank} {_describe_exit(code)}; "
                          "terminating the other ranks", file=sys.stderr, flush=True)
                    return code if code > 0 else 128 - code
            if all(p.returncode == 0 for p in procs):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("distopt.launch: interrupted; terminating all ranks", file=sys.stderr, flush=True)
        return 130
    finally:
        _terminate(procs, ns.grace)


if __name__ == "__main__":
    sys.exit(main())
