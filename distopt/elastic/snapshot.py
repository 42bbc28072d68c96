"""Commits that outlive a worker process: files in the node's shared memory (``/dev/shm``).

torchrun's agent restarts every worker when the world changes, so a commit held only in a worker's memory
would die with it. Each part of a commit (:class:`~distopt.elastic.State`: one part, or one per rank with a
sharded optimizer) is therefore written, atomically (:func:`distopt.checkpoint.write_atomically`), to
``/dev/shm/distopt-elastic-<run id>/agent-<agent pid>/commit-<seq>.part<k>of<n>.pt``: memory, not disk, and
gone when the machine is. A reader never sees a partial file, and a restore takes only a commit whose every
part is held somewhere.

Several torchrun agents may share one host (as every test and first try does), so each agent's commits live
in a directory of its own (the agent outlives the workers it restarts). Once every rank has stored a commit,
the agent's local rank 0 removes what is older there (older commits, and the temporary files of writers
killed mid-write); another agent's files are never touched. Commits are looked for in every agent's
directory of the run on this host, so a job relaunched with the same run id resumes from what any agent
left. An agent keeps one commit (two for a moment).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..checkpoint import TMP_SUFFIX, dump_into, write_atomically

__all__ = ["SnapshotDir"]

_NAME = re.compile(r"commit-(\d+)\.part(\d+)of(\d+)\.pt")
_TMP = re.compile(r"\.commit-(\d+)\.part\d+of\d+\.pt\..*" + re.escape(TMP_SUFFIX))


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

    def write(self, seq: int, part: int, parts: int, payload: bytes | dict[str, Any]) -> Path:
        """Store part ``part`` of ``parts`` of commit ``seq`` atomically: ``payload`` is its bytes, or the part
        itself, streamed into the file in the checkpoint format (:func:`~distopt.checkpoint.dump_into`: no copy of
        its bytes in memory); returns the file's path.

        Raises:
            OSError: the directory or the file cannot be written (e.g. ``/dev/shm`` is full).
            TypeError: the part holds a value the checkpoint format refuses.
        """
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.path / f"commit-{seq}.part{part}of{parts}.pt"
        if isinstance(payload, bytes):
            write_atomically(final, lambda f: f.write(payload))
        else:
            write_atomically(final, lambda f: dump_into(payload, "distopt.elastic.State", f))
        return final

    def prune(self, seq: int) -> None:
        """Remove this agent's commits older than ``seq`` and the temporary files of commits up to ``seq`` (call it
        once every rank stored commit ``seq``: those writes are over, while another rank of this agent may already
        be writing commit ``seq + 1``)."""
        for other in (self.path.iterdir() if self.path.is_dir() else ()):
            done, tmp = _NAME.fullmatch(other.name), _TMP.fullmatch(other.name)
            if (done and int(done.group(1)) < seq) or (tmp and int(tmp.group(1)) <= seq):
                other.unlink(missing_ok=True)

    def held(self) -> dict[tuple[int, int], dict[int, Path]]:
        """The commit parts on this host (any agent of the run): ``{(seq, parts): {part: path}}``."""
        out: dict[tuple[int, int], dict[int, Path]] = {}
        for folder in (self.run.iterdir() if self.run.is_dir() else ()):
            for p in (folder.iterdir() if folder.is_dir() else ()):
                m = _NAME.fullmatch(p.name)
                if m:
                    out.setdefault((int(m.group(1)), int(m.group(3))), {})[int(m.group(2))] = p
        return out

    def newest(self) -> int | None:
        """The newest commit with a part on this host, or None."""
        held = self.held()
        return max(seq for seq, _ in held) if held else None

    def remove(self) -> None:
        """Delete the run's directory, every agent's (at the end of a successful run, when no rank commits
        or reads any more)."""
        shutil.rmtree(self.run, ignore_errors=True)
