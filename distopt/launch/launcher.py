"""Start the processes of a single-node job, fail-fast.

Two forms, after SINGA's multiprocess launch (one ``NcclIdHolder`` shared by
``nprocs`` workers), PyTorch's ``torch.multiprocessing.spawn`` and ``torchrun``:

* :func:`spawn` runs ``fn(nccl_id, gpu_num, gpu_per_node, *args)`` in
  ``nprocs`` processes started with the ``spawn`` method;
* ``python -m distopt.launch -n 4 script.py args...`` (or ``-m module``)
  runs four copies of any distopt script unchanged, with ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``DISTOPT_JOB_ID``
  set: ``DistOpt(opt)`` (:func:`distopt.launch.world.build_world`) then joins the
  job over shared memory.

In both, the first worker that fails (raises, exits non-zero or is killed)
ends the job: the others get SIGTERM, then SIGKILL after a grace period, all
are reaped, and the failure is reported with its rank. When the launching
process itself is ended (SIGTERM, SIGINT, or SIGKILL), the workers end too:
they get SIGTERM from the kernel when their parent dies (Linux
``PR_SET_PDEATHSIG``), and the job's shared-memory segments are removed
(by the launcher on SIGTERM/SIGINT, by the workers' resource tracker after
a SIGKILL). Both launchers install their own SIGTERM and SIGINT handlers,
so SIGINT ends the job even where the launcher started with it ignored (a
background shell job, ``nohup``, some CI runners); the workers, started
after that, do not inherit the ignored SIGINT.
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

from ._pdeath import _prctl_pdeathsig, die_with_parent
from ..errors import DistOptError
from .logs import LOG_FORMAT, rank_filter
from .nccl_id import NcclIdHolder, new_job_id
from .info import JOB_ID_ENV

__all__ = ["WorkerFailedError", "spawn", "progress", "main"]

T = TypeVar("T")



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
    above from rank 0, WARNING and above from the others. Called from the
    main thread, it makes SIGINT a KeyboardInterrupt and SIGTERM a
    ``SystemExit(143)`` until it returns, even where SIGINT was ignored; either
    terminates every worker and propagates. Afterwards any shared-memory
    segment of the job left by a killed worker is unlinked.

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
    previous = _end_on_signals()
    try:
        for rank in range(nprocs):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_worker, name=f"distopt-rank{rank}",
                               args=(fn, rank, nprocs, holder, tuple(args), writer, log_queue, log_level,
                                     os.getpid()))
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
        raise WorkerFailedError(rank, reason or f"raised an exception ({_describe_exit(code)})",
                                text, code)


def _exit_143(*_: Any) -> None:
    sys.exit(128 + signal.SIGTERM)


def _end_on_signals() -> dict[int, Any]:
    """In the main thread, make SIGTERM a ``SystemExit(143)`` and SIGINT a KeyboardInterrupt (so cleanup runs).

    Installed whatever the inherited disposition (a background shell job starts with SIGINT ignored).

    Returns:
        The previous handlers Python can put back; empty outside the main thread (no handler is set there).
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _exit_143),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    return {sig: handler for sig, handler in previous.items() if handler is not None}


def progress(iterable: Iterable[T], rank: int, **kwargs: Any) -> Iterable[T]:
    """``tqdm(iterable, **kwargs)`` on rank 0; the bare iterable (no bar) on the others.

    Raises:
        ImportError: tqdm is not installed (on every rank alike), naming the
            extra that installs it.
    """
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError(f"distopt.launch.progress needs tqdm ({exc}): pip install 'distopt[progress]'") from exc
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


def _child_setup() -> None:
    """``preexec_fn`` of the CLI's children: SIGTERM when the launcher dies, even by SIGKILL."""
    _prctl_pdeathsig(signal.SIGTERM)


def _tag_lines(source: Any, sink: Any, prefix: bytes) -> None:
    """Copy ``source`` to ``sink`` line by line, each line prefixed (one write per line)."""
    for line in iter(source.readline, b""):
        sink.write(prefix + line)
        sink.flush()
    source.close()


_DESCRIPTION = """\
Run N copies of a Python script (or module) as one single-node distopt job, fail-fast.

Each copy gets RANK and LOCAL_RANK (0..N-1), WORLD_SIZE and LOCAL_WORLD_SIZE (N) and
DISTOPT_JOB_ID (shared): distopt.DistOpt(opt) in the script then joins the job over
shared memory, so any distopt script runs unchanged, e.g.

  python -m distopt.launch -n 2 examples/cnn_mpi.py --epochs 1
  python -m distopt.launch -n 4 --tag-output -m mypackage.train --lr 0.1

The first copy that fails (non-zero exit, signal) ends the job: the others get SIGTERM,
then SIGKILL after --grace seconds; its traceback is on stderr and its exit code is the
launcher's. If the launcher is ended (SIGTERM, Ctrl-C, even SIGKILL) the copies end too
and the job's shared-memory segments are removed.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distopt.launch", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes (copies)")
    parser.add_argument("-m", dest="module", metavar="MODULE",
                        help="run a module (as python -m MODULE) instead of a script")
    parser.add_argument("--tag-output", action="store_true",
                        help="prefix every line of stdout and stderr with [rank R]")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when ending the job (default 5)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script.py args...",
                        help="the script and its arguments (with -m: the module's arguments)")
    return parser


def _start(rank: int, nproc: int, job_id: str, argv: list[str], tag: bool
           ) -> tuple[subprocess.Popen, list[threading.Thread]]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), **{JOB_ID_ENV: job_id})
    pipe = subprocess.PIPE if tag else None
    proc = subprocess.Popen([sys.executable, *argv], env=env, stdout=pipe, stderr=pipe,
                            preexec_fn=_child_setup if sys.platform.startswith("linux") else None)
    threads = []
    if tag:
        prefix = f"[rank {rank}] ".encode()
        for source, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            thread = threading.Thread(target=_tag_lines, args=(source, sink, prefix), daemon=True)
            thread.start()
            threads.append(thread)
    return proc, threads


def main(argv: list[str] | None = None) -> int:
    """``python -m distopt.launch -n N [--tag-output] (script.py | -m module) args...``; returns the exit status.

    0 when every copy exits 0; otherwise the first failing rank's exit code
    (128 + signal number for a signal), after terminating the others; 130 on
    SIGINT (Ctrl-C, even where the launcher started with SIGINT ignored), 143
    on SIGTERM (the children are terminated too). The job's shared-memory
    segments are removed at the end in every case.
    """
    from ..comm.shm import unlink_segments

    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error("-n must be >= 1")
    if ns.module is None and not ns.command:
        parser.error("give a script (script.py args...) or a module (-m MODULE args...)")
    command = ["-m", ns.module, *ns.command] if ns.module else ns.command
    job_id = new_job_id()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    _end_on_signals()
    try:
        for rank in range(ns.nproc):
            proc, tagging = _start(rank, ns.nproc, job_id, command, ns.tag_output)
            procs.append(proc)
            threads += tagging
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
        for thread in threads:
            thread.join(ns.grace)
        unlink_segments(job_id)

