"""The copies' side of ``python -m distopt.launch``'s elastic mode: stop at a commit when the launcher grows the world.

The elastic launcher (:mod:`distopt.launch.elastic_agent`) asks for a larger
world by creating a file whose path every copy has in ``DISTOPT_GROW_FILE``.
After each commit is written, rank 0 looks for it and broadcasts what it saw
(one small collective per commit, so that every rank decides at the same
commit); if it is there every rank exits with ``REGROUP_EXIT``, and the
launcher starts the larger world, which resumes from that commit. Growth
therefore loses no step (torchrun's agent, which restarts at once, loses the
steps since the last commit).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..launch.info import GROW_FILE_ENV, REGROUP_EXIT

__all__ = ["grow_check"]


def grow_check(opt: Any, env: Mapping[str, str]) -> Callable[[], None] | None:
    """The after-commit check of a copy started by the elastic launcher, or None for any other launch.

    Args:
        opt: the job's :class:`distopt.DistOpt` (its ``broadcast_object``: collective).
        env: the environment (``DISTOPT_GROW_FILE``).

    The check returns when no growth is pending; otherwise rank 0 writes one line on stderr and every rank
    raises ``SystemExit(REGROUP_EXIT)`` (a ``BaseException``: a script's ``except Exception`` does not stop
    it; ``finally`` blocks and exit handlers run).
    """
    path = env.get(GROW_FILE_ENV)
    if not path:
        return None

    def check() -> None:
        grow = opt.broadcast_object(os.path.exists(path) if opt.global_rank == 0 else None, root=0)
        if not grow:
            return
        if opt.global_rank == 0:
            sys.stderr.write(f"distopt.elastic: the launcher grows the world; the {opt.world_size} ranks stop "
                             "after this commit and the larger world resumes from it\n")
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(REGROUP_EXIT)

    return check
