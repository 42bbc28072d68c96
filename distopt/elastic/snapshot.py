"""Commits that outlive a worker process: one file per commit in the node's shared memory (``/dev/shm``).

torchrun's agent restarts every worker when the world changes, so a commit held
only in a worker's memory would die with it. Each commit is therefore also
written, atomically (:func:`distopt.checkpoint.write_atomically`: a temporary name, then
``os.replace``), to
``/dev/shm/distopt-elastic-<run id>/commit-<seq>.rank<rank>.pt``: memory, not
disk, and gone when the machine is. A reader never sees a partial commit: the
file appears complete under its final name, or not at all.

Several torchrun agents may share one host (as every test and first try
does), so each agent's commits live in a directory of its own,
``distopt-elastic-<run id>/agent-<agent pid>/`` (the agent outlives the
workers it restarts; torch's rendezvous names a node by its host and pid as
well). One process writes in it (the agent's local rank 0), so after a write
everything else there is stale and removed: the older commits, of any rank
(a rank may change when the world re-forms), and the temporary file a writer
killed mid-write left; another agent's files are never touched. The newest
commit is looked for in every agent's directory of the run on this host, so
a job relaunched with the same run id resumes from what any agent left. An
agent keeps one commit (two for a moment).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..checkpoint import TMP_SUFFIX, write_atomically

__all__ = ["SnapshotDir"]

_NAME = re.compile(r"commit-(\d+)\.rank(\d+)\.pt")


class SnapshotDir:
    """The commit files of one run on this node.

    Args:
        run_id: torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``); it names the run's directory.
        root: where the directory lives (``/dev/shm``, a tmpfs, by default).
        agent: the agent whose commits these are (default: this worker's parent process, the agent);
            it names :attr:`path` inside the run's directory.

    Raises:
        ValueError: a run id that is empty or holds a path separator.
    """

    def __init__(self, run_id: str, root: str | os.PathLike = "/dev/shm", agent: int | None = None) -> None:
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise ValueError(f"distopt.elastic: the run id must be a plain name, got {run_id!r}")
        self.run = Path(root) / f"distopt-elastic-{run_id}"
        self.path = self.run / f"agent-{os.getppid() if agent is None else int(agent)}"

    def write(self, seq: int, rank: int, payload: bytes) -> Path:
        """Store commit ``seq`` of ``rank`` (``payload``: the serialised commit, bytes), atomically, then remove
        the directory's older commits (of any rank) and any other temporary file (a writer killed mid-write
        left it). Returns the file's path.

        Raises:
            OSError: the directory or the file cannot be written (e.g. ``/dev/shm`` is full).
        """
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.path / f"commit-{seq}.rank{rank}.pt"
        write_atomically(final, lambda f: f.write(payload))
        for other in self.path.iterdir():  # one writer here: any other temporary file is a killed write's
            done = _NAME.fullmatch(other.name)
            if (int(done.group(1)) < seq) if done else other.name.endswith(TMP_SUFFIX):
                other.unlink(missing_ok=True)
        return final

    def newest(self) -> tuple[int, Path] | None:
        """``(seq, path)`` of the newest commit on this host (of any rank and agent of the run), or None."""
        found = [(s, p) for p, (s, _) in self._files()]
        return max(found) if found else None

    def remove(self) -> None:
        """Delete the run's directory, every agent's (at the end of a successful run, when no rank commits
        or reads any more)."""
        shutil.rmtree(self.run, ignore_errors=True)

    def _files(self) -> list[tuple[Path, tuple[int, int]]]:
        out = []
        for folder in (self.run.iterdir() if self.run.is_dir() else ()):
            for p in (folder.iterdir() if folder.is_dir() else ()):
                m = _NAME.fullmatch(p.name)
                if m:
                    out.append((p, (int(m.group(1)), int(m.group(2)))))
        return out
