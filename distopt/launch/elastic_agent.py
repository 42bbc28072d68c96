"""Elastic mode of ``python -m distopt.launch`` (``--min-np``/``--max-np``): re-form the world instead of failing.

The launcher plays the part of torchrun's elastic agent (and of Horovod Elastic's driver) on one machine; its user's
guide (failures, growth by ``SIGUSR1``, stopping) is ``docs/elastic.md``. It runs *worlds* of copies one after the
other; each world has a fresh job id, so a fresh set of shared-memory segments, and every copy of it gets
``DISTOPT_RUN_ID``, ``DISTOPT_RESTART_COUNT`` and ``DISTOPT_GROW_FILE`` (:mod:`distopt.launch.info`);
``distopt.elastic.run`` in the copies resumes every world from the run's newest commit.

* **Growth**: the launcher creates the grow file; at their next ``state.commit()`` the copies agree (rank 0 looks, a
  broadcast tells the others), stop right after the commit is written and exit with
  :data:`~distopt.launch.info.REGROUP_EXIT`; the larger world then resumes from that commit. Not a restart.
* A failure after a copy already exited 0 (the training function had returned on every rank) is not restarted: the
  launcher fails as in its fail-fast mode.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .exits import describe_exit
from .info import GROW_FILE_ENV, REGROUP_EXIT, RESTART_COUNT_ENV, RUN_ID_ENV
from .nccl_id import new_job_id

__all__ = ["ElasticConfig", "ElasticAgent", "elastic_config"]

_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
_COMMIT = re.compile(r"commit-(\d+)\.part\d+of\d+\.pt")
POLL_S = 0.05  # how often the copies' exits and the growth requests are looked at


@dataclass(frozen=True)
class ElasticConfig:
    """What ``--min-np``, ``--max-np``, ``--max-restarts`` and ``--run-id`` asked for (validated).

    Attributes:
        nproc: copies in the first world (``-n``).
        min_np: the fewest copies a world may have; a failure that leaves fewer ends the run.
        max_np: the most copies a world may have (``SIGUSR1`` adds one up to it).
        max_restarts: failures the run survives (a growth is not a restart).
        run_id: names the commits (``/dev/shm/distopt-elastic-<run id>``), the same in every world.
        commit_root: where ``distopt.elastic.run`` keeps the commits by default (for the final message).
    """

    nproc: int
    min_np: int
    max_np: int
    max_restarts: int
    run_id: str
    commit_root: Path = Path("/dev/shm")


def elastic_config(nproc: int, min_np: int | None, max_np: int | None, max_restarts: int | None,
                   run_id: str | None) -> ElasticConfig | None:
    """The elastic configuration of the CLI's options, or None (fail-fast mode) when neither ``--min-np`` nor
    ``--max-np`` is given. Defaults: ``--min-np`` and ``--max-np`` are ``-n`` (Horovod's ``--min-np`` default),
    ``--max-restarts`` 3.

    Raises:
        ValueError: (the CLI prints it as a usage error) ``--max-restarts`` or ``--run-id`` without
            ``--min-np``/``--max-np``; ``--min-np`` < 1 or > ``-n``; ``--max-np`` < ``-n``;
            ``--max-restarts`` < 0; no ``--run-id``, or one that is not a plain name (letters, digits,
            ``_ . -``, at most 100, not starting with ``.`` or ``-``).
    """
    if min_np is None and max_np is None:
        extra = [name for name, v in (("--max-restarts", max_restarts), ("--run-id", run_id)) if v is not None]
        if extra:
            raise ValueError(f"{' and '.join(extra)}: elastic mode only; give --min-np and/or --max-np too")
        return None
    min_np = nproc if min_np is None else min_np
    max_np = nproc if max_np is None else max_np
    if not 1 <= min_np <= nproc:
        raise ValueError(f"--min-np must be in [1, -n] = [1, {nproc}], got {min_np} (-n is the first world's "
                         "size; a world smaller than --min-np ends the run)")
    if max_np < nproc:
        raise ValueError(f"--max-np must be >= -n ({nproc}), got {max_np}")
    max_restarts = 3 if max_restarts is None else max_restarts
    if max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {max_restarts}")
    if run_id is None:
        raise ValueError("elastic mode needs --run-id ID: it names the run's commits in /dev/shm "
                         "(like torchrun's --rdzv-id); a relaunch with the same id resumes from them")
    if not _RUN_ID.fullmatch(run_id):
        raise ValueError(f"--run-id must be a plain name (letters, digits, '_', '.', '-'; at most 100; not "
                         f"starting with '.' or '-'), got {run_id!r}")
    return ElasticConfig(nproc, min_np, max_np, max_restarts, run_id)


#: ``start(nproc, job_id, env, procs, threads)``: start a world of ``nproc`` copies with the extra
#: environment ``env``, appending each copy to ``procs`` (rank order) and its output threads to ``threads``.
StartWorld = Callable[[int, str, "dict[str, str]", "list[subprocess.Popen]", "list[threading.Thread]"], None]
#: ``end(procs, threads)``: terminate what runs of a world (SIGTERM, SIGKILL after the grace time) and reap it.
EndWorld = Callable[["list[subprocess.Popen]", "list[threading.Thread]"], None]


@dataclass
class _Outcome:
    """How a world ended: ``kind`` is ``done`` (every copy exited 0), ``grow`` (the copies stopped at a commit
    for a larger world) or ``failed`` (``failed``: ``(rank, status)`` of the copies seen failing)."""

    kind: str
    failed: list[tuple[int, int]] = field(default_factory=list)
    finished: bool = False  # a copy had exited 0 before the failure
    at: float = 0.0  # time.monotonic() when it was seen


class ElasticAgent:
    """The restart loop of the elastic launcher (see the module docstring).

    Args:
        config: the validated options.
        start: starts a world (:data:`StartWorld`).
        end: ends a world (:data:`EndWorld`).
        grace: seconds a world's copies get to exit by themselves after the first one stopped for growth.
        err: where the launcher's lines go (stderr).
    """

    def __init__(self, config: ElasticConfig, start: StartWorld, end: EndWorld, grace: float = 5.0,
                 err: Any = None) -> None:
        self.config, self.start, self.end, self.grace = config, start, end, grace
        self.err = err if err is not None else sys.stderr
        self.requests = 0  # SIGUSR1s not yet looked at
        self.pending = 0  # copies the next world adds
        self.grow_file = Path()

    def say(self, text: str) -> None:
        """One line on stderr, ``distopt.launch: `` first."""
        print(f"distopt.launch: {text}", file=self.err, flush=True)

    def run(self) -> int:
        """Run worlds until one finishes (0) or the run stops (the failed copy's status: its exit code, or 128
        + the signal's number). ``SIGUSR1`` is handled while it runs (in the main thread only)."""
        from ..comm.shm import unlink_segments

        tmp = Path(tempfile.mkdtemp(prefix=f"distopt-launch-{self.config.run_id}-"))
        self.grow_file = tmp / "grow"
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGUSR1, self._on_sigusr1) if main else None
        slots, restarts = self.config.nproc, 0
        try:
            while True:
                job_id = new_job_id()
                self.grow_file.unlink(missing_ok=True)
                env = {RUN_ID_ENV: self.config.run_id, RESTART_COUNT_ENV: str(restarts),
                       GROW_FILE_ENV: str(self.grow_file)}
                procs: list[subprocess.Popen] = []
                threads: list[threading.Thread] = []
                try:
                    self.start(slots, job_id, env, procs, threads)
                    outcome = self._watch(procs, slots)
                finally:
                    self.end(procs, threads)
                    unlink_segments(job_id)
                if outcome.kind == "done":
                    if self.pending:
                        self.say(f"the job ended before its next commit; the {self.pending} copies asked for "
                                 "were not started")
                    return 0
                if outcome.kind == "grow":
                    slots, self.pending = slots + self.pending, 0
                    self.say(f"every copy stopped at its commit; starting a world of {slots} copies "
                             f"(ended in {time.monotonic() - outcome.at:.2f} s)")
                    continue
                left = min(self.config.max_np, slots - len(outcome.failed) + self.pending)
                status = self._stop_status(outcome, left, restarts)
                if status is not None:
                    return status
                restarts, slots, self.pending = restarts + 1, left, 0
                self.say(f"restart {restarts} of --max-restarts {self.config.max_restarts}: a world of {slots} "
                         f"copies resumes from the newest commit of run {self.config.run_id} (the failed world "
                         f"ended in {time.monotonic() - outcome.at:.2f} s)")
        finally:
            if main and previous is not None:
                signal.signal(signal.SIGUSR1, previous)
            shutil.rmtree(tmp, ignore_errors=True)

    def _on_sigusr1(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        self.requests += 1

    def _offer_growth(self, slots: int) -> None:
        """Turn the SIGUSR1s received into pending copies (up to ``--max-np``) and create the grow file."""
        asked = self.requests
        if not asked:
            return
        self.requests -= asked
        added = max(0, min(asked, self.config.max_np - slots - self.pending))
        if added:
            self.pending += added
            self.grow_file.touch()
            self.say(f"SIGUSR1: growing from {slots} to {slots + self.pending} copies at the next commit")
        if added < asked:
            self.say(f"SIGUSR1: already {slots + self.pending} copies of --max-np {self.config.max_np}; "
                     f"{asked - added} request(s) ignored")

    def _watch(self, procs: list[subprocess.Popen], slots: int) -> _Outcome:
        """Poll the world until it ends (see :class:`_Outcome`)."""
        stopping_since: float | None = None
        while True:
            self._offer_growth(slots)
            codes = [p.poll() for p in procs]
            growing = self.grow_file.exists()
            stopped = [r for r, c in enumerate(codes) if c == REGROUP_EXIT and growing]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and r not in stopped]
            now = time.monotonic()
            if failed:
                return _Outcome("failed", failed, finished=0 in codes, at=now)
            if stopped:
                stopping_since = stopping_since or now
                if None not in codes or now - stopping_since > self.grace:
                    return _Outcome("grow", at=stopping_since)
            elif codes and all(c == 0 for c in codes):
                return _Outcome("done", at=now)
            time.sleep(POLL_S)

    def _stop_status(self, outcome: _Outcome, left: int, restarts: int) -> int | None:
        """After a failure: the launcher's exit status when the run cannot go on (with its line on stderr),
        or None to restart a world of ``left`` copies (the slots left, with the pending growth)."""
        for rank, code in outcome.failed:
            self.say(f"rank {rank} {describe_exit(code)}; terminating the other ranks")
        first = outcome.failed[0][1]
        status = first if first > 0 else 128 - first
        if outcome.finished:
            why = "another copy had already finished (exit 0), so the training had ended: not restarting"
        elif left < self.config.min_np:
            why = f"{left} cop{'y' if left == 1 else 'ies'} left, below --min-np {self.config.min_np}: stopping"
        elif restarts >= self.config.max_restarts:
            why = f"--max-restarts {self.config.max_restarts} reached ({restarts} restarts used): stopping"
        else:
            return None
        self.say(f"{why} (exit status {status}); {self._commit_note()}")
        return status

    def _commit_note(self) -> str:
        """Where the run's newest commit stays, and how to resume from it or remove it."""
        run_id = self.config.run_id
        path = self.config.commit_root / f"distopt-elastic-{run_id}"
        seqs = [int(m.group(1)) for p in path.glob("agent-*/*") if (m := _COMMIT.fullmatch(p.name))]
        if not seqs:
            return (f"no commit of run {run_id} in {path} (none was made, or the script gave "
                    "distopt.elastic.run another commit_dir)")
        return (f"commit {max(seqs)} stays in {path}: the same command with --run-id {run_id} resumes from "
                f"it; remove that directory to start afresh")
