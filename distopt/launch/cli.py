"""``python -m distopt.launch``: run N copies of a script (or module) as one single-node job, fail-fast.

The user's guide is ``docs/launch.md``. Each copy gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
and ``DISTOPT_JOB_ID``, so ``DistOpt(opt)`` (:func:`distopt.launch.backend_rule.build_world`) joins the job over shared
memory. With more than one copy and no ``OMP_NUM_THREADS`` set, each copy gets ``OMP_NUM_THREADS=1`` (as torchrun
does): N copies of OpenMP/OpenBLAS each starting one thread per CPU oversubscribe the node. A failing copy, or a
signal to the launcher, ends the job as :mod:`~distopt.launch.launcher` describes; with ``--min-np``/``--max-np`` the
launcher is elastic instead (:mod:`distopt.launch.elastic_agent`).
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from ._pdeath import _prctl_pdeathsig
from .elastic_agent import ElasticAgent, ElasticConfig, elastic_config
from .exits import describe_exit, end_on_signals
from .info import JOB_ID_ENV
from .nccl_id import new_job_id

__all__ = ["main"]


def _end(procs: list[subprocess.Popen], threads: list[threading.Thread], grace: float) -> None:
    """SIGTERM the live children, SIGKILL after ``grace`` s, reap all; then join their output threads."""
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
    for thread in threads:
        thread.join(grace)


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

Elastic mode (--min-np and/or --max-np; the script uses distopt.elastic.run), e.g.

  python -m distopt.launch -n 3 --min-np 2 --max-np 4 --run-id job42 train.py

A copy that fails ends its world; a new world of the copies left (its slot is dropped)
resumes from the last commit, while at least --min-np are left and --max-restarts allow.
`kill -USR1 <launcher pid>` adds one copy (up to --max-np) at the next commit.
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
    elastic = parser.add_argument_group("elastic mode (docs/elastic.md)")
    elastic.add_argument("--min-np", type=int, help="elastic: the fewest copies a world may have (default -n)")
    elastic.add_argument("--max-np", type=int, help="elastic: the most copies; SIGUSR1 adds one (default -n)")
    elastic.add_argument("--max-restarts", type=int, help="elastic: failures the run survives (default 3)")
    elastic.add_argument("--run-id", help="elastic (required): names the run's commits in /dev/shm")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="script.py args...",
                        help="the script and its arguments (with -m: the module's arguments)")
    return parser


def _thread_env(nproc: int, env: dict[str, str]) -> dict[str, str]:
    """``{"OMP_NUM_THREADS": "1"}`` for a job of more than one copy whose ``env`` does not set it, else ``{}``."""
    return {"OMP_NUM_THREADS": "1"} if nproc > 1 and "OMP_NUM_THREADS" not in env else {}


def _start(nproc: int, job_id: str, env: dict[str, str], procs: list[subprocess.Popen],
           threads: list[threading.Thread], *, argv: list[str], tag: bool, threads_env: dict[str, str]) -> None:
    """Start ``nproc`` copies, appending each to ``procs`` (rank order) and its output threads to ``threads``."""
    for rank in range(nproc):
        child_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                         LOCAL_WORLD_SIZE=str(nproc), **{JOB_ID_ENV: job_id}, **{**threads_env, **env})
        pipe = subprocess.PIPE if tag else None
        proc = subprocess.Popen([sys.executable, *argv], env=child_env, stdout=pipe, stderr=pipe,
                                preexec_fn=_child_setup if sys.platform.startswith("linux") else None)
        procs.append(proc)
        if tag:
            prefix = f"[rank {rank}] ".encode()
            for source, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                thread = threading.Thread(target=_tag_lines, args=(source, sink, prefix), daemon=True)
                thread.start()
                threads.append(thread)


def _run_elastic(config: ElasticConfig, command: list[str], tag: bool, threads_env: dict[str, str],
                 grace: float) -> int:
    """The elastic launcher's exit status (:class:`~distopt.launch.elastic_agent.ElasticAgent`)."""
    print(f"distopt.launch: elastic run {config.run_id}: {config.nproc} copies (--min-np {config.min_np}, "
          f"--max-np {config.max_np}, --max-restarts {config.max_restarts}); kill -USR1 {os.getpid()} adds one",
          file=sys.stderr, flush=True)
    try:
        return ElasticAgent(config, functools.partial(_start, argv=command, tag=tag, threads_env=threads_env),
                            functools.partial(_end, grace=grace), grace).run()
    except KeyboardInterrupt:
        print("distopt.launch: interrupted; terminating all ranks", file=sys.stderr, flush=True)
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m distopt.launch -n N [--tag-output] (script.py | -m module) args...``; returns the exit status.

    0 when every copy exits 0; otherwise the first failing rank's exit code (128 + signal number for a signal), after
    terminating the others; 130 on SIGINT (Ctrl-C, even where the launcher started with it ignored), 143 on SIGTERM
    (the children are terminated too); in elastic mode, :class:`~distopt.launch.elastic_agent.ElasticAgent`'s status.
    """
    from ..comm.shm import unlink_segments

    parser = _parser()
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error("-n must be >= 1")
    if ns.module is None and not ns.command:
        parser.error("give a script (script.py args...) or a module (-m MODULE args...)")
    try:
        elastic = elastic_config(ns.nproc, ns.min_np, ns.max_np, ns.max_restarts, ns.run_id)
    except ValueError as exc:
        parser.error(str(exc))
    command = ["-m", ns.module, *ns.command] if ns.module else ns.command
    job_id = new_job_id()
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    end_on_signals()
    threads_env = _thread_env(ns.nproc if elastic is None else elastic.max_np, dict(os.environ))
    if threads_env:
        print(f"distopt.launch: OMP_NUM_THREADS=1 for each of the {ns.nproc} processes (it was not set); set it "
              "to give each process more threads", file=sys.stderr, flush=True)
    if elastic is not None:
        return _run_elastic(elastic, command, ns.tag_output, threads_env, ns.grace)
    try:
        _start(ns.nproc, job_id, {}, procs, threads, argv=command, tag=ns.tag_output, threads_env=threads_env)
        while True:
            for rank, p in enumerate(procs):
                code = p.poll()
                if code:
                    print(f"distopt.launch: rank {rank} {describe_exit(code)}; "
                          "terminating the other ranks", file=sys.stderr, flush=True)
                    return code if code > 0 else 128 - code
            if all(p.returncode == 0 for p in procs):
                return 0
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("distopt.launch: interrupted; terminating all ranks", file=sys.stderr, flush=True)
        return 130
    finally:
        _end(procs, threads, ns.grace)
        unlink_segments(job_id)

