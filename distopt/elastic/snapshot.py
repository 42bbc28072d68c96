"""Commits that outlive a worker process: one file per commit in the node's shared memory (``/dev/shm``).

torchrun's agent restarts every worker when the world changes, so a commit held
only in a worker's memory would die with it. Each commit is therefore also
written, atomically (a temporary name, then ``os.replace``), to
``/dev/shm/distopt-elastic-<run id>/commit-<seq>.rank<rank>.pt``: memory, not
disk, and gone when the machine is. A reader never sees a partial commit: the
file appears complete under its final name, or not at all.

One process writes in a node's directory (the node's local rank 0), so after a
write everything else there is stale and removed: the older commits, of any rank
(a node's rank may change when the world re-forms), and the temporary file a
writer killed mid-write left. A node keeps one commit (two for a moment).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

__all__ = ["SnapshotDir"]

_NAME = re.compile(r"commit-(\d+)\.rank(\d+)\.pt")
_TEMPORARY = re.compile(r"commit-(\d+)\.rank(\d+)\.tmp\d+")


class SnapshotDir:
    """The commit files of one run on this node.

    Args:
        run_id: torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``); it names the directory.
        root: where the directory lives (``/dev/shm``, a tmpfs, by default).

    Raises:
        ValueError: a run id that is empty or holds a path separator.
    """

    def __init__(self, run_id: str, root: str | os.PathLike = "/dev/shm") -> None:
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise ValueError(f"distopt.elastic: the run id must be a plain name, got {run_id!r}")
        self.path = Path(root) / f"distopt-elastic-{run_id}"

    def write(self, seq: int, rank: int, payload: bytes) -> Path:
        """Store commit ``seq`` of ``rank`` (``payload``: the serialised commit, bytes), atomically, then remove
        the directory's older commits (of any rank) and any other temporary file (a writer killed mid-write
        left it). Returns the file's path.

        Raises:
            OSError: the directory or the file cannot be written (e.g. ``/dev/shm`` is full).
        """
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        final = self.path / f"commit-{seq}.rank{rank}.pt"
        tmp = final.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(payload)
        os.replace(tmp, final)
        for other in self.path.iterdir():
            done = _NAME.fullmatch(other.name)
            if (int(done.group(1)) < seq) if done else bool(_TEMPORARY.fullmatch(other.name)):
                other.unlink(missing_ok=True)
        return final

    def newest(self) -> tuple[int, Path] | None:
        """``(seq, path)`` of the newest commit on this node (of any rank), or None."""
        found = [(s, p) for p, (s, _) in self._files()]
        return max(found) if found else None

    def remove(self) -> None:
        """Delete the run's directory (at the end of a successful run)."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _files(self) -> list[tuple[Path, tuple[int, int]]]:
        if not self.path.is_dir():
            return []
        out = []
        for p in self.path.iterdir():
            m = _NAME.fullmatch(p.name)
            if m:
                out.append((p, (int(m.group(1)), int(m.group(2)))))
        return out
