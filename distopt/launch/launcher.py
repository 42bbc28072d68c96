""":func:`spawn`: start the worker processes of a single-node job from Python, fail-fast.

After SINGA's multiprocess launch (one ``NcclIdHolder`` shared by the workers) and PyTorch's
``torch.multiprocessing.spawn``; its command-line sibling, ``python -m distopt.launch -n 4 script.py``, is
:mod:`~distopt.launch.cli`.

In both (``docs/launch.md``), the first worker that fails ends the job (the others get SIGTERM, then SIGKILL after a
grace period), and ending the launcher ends the workers: they get SIGTERM from the kernel when their parent dies
(Linux ``PR_SET_PDEATHSIG``), and the job's shared-memory segments are removed (by the launcher on SIGTERM/SIGINT, by
the workers' resource tracker after a SIGKILL). Both launchers install their own SIGTERM and SIGINT
handlers, so SIGINT ends the job even where the launcher started with it ignored (a background shell job, ``nohup``,
some CI runners); the workers, started after that, do not inherit the ignored SIGINT.
"""
from __future__ import annotations

import logging
import logging.handlers
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ._pdeath import die_with_parent
from ..errors import DistOptError
from .exits import describe_exit, end_on_signals
from .logs import LOG_FORMAT, rank_filter
from .nccl_id import NcclIdHolder

__all__ = ["WorkerFailedError", "spawn"]


class WorkerFailedError(DistOptError):
    """A worker of :func:`spawn` failed; the other workers were terminated.

    Attributes:
        rank: the failing (or, after the job timeout, first stalled) rank.
        exitcode: its exit code (negative: killed by that signal), or None.
        traceback: the formatted traceback of the worker's exception, or "".
    """

    def __init__(self, rank: int, reason: str, traceback_text: str = "", exitcode: int | None = None) -> None:
        self.rank, self.exitcode, self.traceback = rank, exitcode, traceback_text
        message = f"rank {rank} {reason}"
        if traceback_text:
            message += f"\n--- traceback of rank {rank} ---\n{traceback_text}"
        super().__init__(message)


def _worker(fn: Callable[..., Any], rank: int, nprocs: int, holder: NcclIdHolder,
            args: tuple, conn: Connection, log_queue: Any, log_level: int, parent: int) -> None:
    """Child side of :func:`spawn`: die with the parent, forward logs, run ``fn``, report a failure."""
    die_with_parent(parent)
    level = log_level if rank == 0 else max(log_level, logging.WARNING)
    handler = logging.handlers.QueueHandler(log_queue)
    handler.setLevel(level)
    handler.addFilter(rank_filter(rank))
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
    for record in iter(log_queue.get, None):
        handler.handle(record)


def _watch(procs: list, conns: dict[Connection, int], timeout: float | None) -> tuple[int, str, str] | None:
    """Wait for the workers; return (rank, traceback, reason) of the first failure. ``reason`` is "" for a worker
    that reported an exception (its exit code is known only once it is reaped)."""
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
                    failures.append((time.monotonic(), rank, "", describe_exit(procs[rank].exitcode)))
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

    Processes are started with the ``spawn`` method, so ``fn`` and ``args`` must be picklable (``fn`` defined at the
    top level of an importable module). ``gpu_num`` is the rank (0 .. nprocs-1), ``gpu_per_node`` is ``nprocs``.
    Workers' ``logging`` records are written to this process's stdout as ``[rank R] LEVEL logger: message``: records
    at ``log_level`` and above from rank 0, WARNING and above from the others. Called from the main thread, it makes
    SIGINT a KeyboardInterrupt and SIGTERM a ``SystemExit(143)`` until it returns, even where SIGINT was ignored;
    either terminates every worker and propagates. Afterwards any shared-memory segment of the job left by a killed
    worker is unlinked.

    Args:
        fn: the worker function.
        nprocs: number of processes.
        args: extra positional arguments for ``fn``.
        nccl_id: the job's ticket; a new :class:`NcclIdHolder` by default.
        timeout: wall-clock limit of the whole job, in seconds (None: none).
        join_timeout: seconds a terminated worker gets between SIGTERM and SIGKILL (the failing worker gets as long
            to exit by itself).
        log_level: level of the records forwarded from rank 0.

    Raises:
        ValueError: ``nprocs < 1``.
        WorkerFailedError: a worker raised, exited non-zero or was killed by a signal, or the job overran
            ``timeout``; carries the rank, the exit code and the worker's traceback.
    """
    from ..comm.shm import unlink_segments

    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    holder = nccl_id if nccl_id is not None else NcclIdHolder()
    ctx = multiprocessing.get_context("spawn")
    log_queue = ctx.Queue()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    listener = threading.Thread(target=_forward_records, args=(log_queue, handler),
                                name="distopt-log-listener", daemon=True)
    listener.start()
    procs: list = []
    conns: dict[Connection, int] = {}
    failure = None
    previous = end_on_signals()
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"distopt-rank{rank}",
                               args=(fn, rank, nprocs, holder, tuple(args), writer, log_queue, log_level, os.getpid()))
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
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        rank, text, reason = failure
        code = procs[rank].exitcode
        raise WorkerFailedError(rank, reason or f"raised an exception ({describe_exit(code)})", text, code)
