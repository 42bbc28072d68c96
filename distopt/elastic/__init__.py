"""Elastic training: when a worker dies or joins, the job goes on from the last commit.

* :class:`~distopt.elastic.state.State`: the model, the optimizer, the sampler and
  the script's values; ``commit()`` snapshots them, ``restore()`` rolls back.
* :func:`~distopt.elastic.run.run`: runs ``fn(state)`` in the world that torchrun's
  elastic agent formed, resuming from the world's newest commit after a restart.
* :class:`~distopt.elastic.sampler.ElasticSampler`: per-rank batches whose global
  position survives a change of world size (every sample of an epoch once).
* :class:`~distopt.elastic.snapshot.SnapshotDir`: the commits in the node's shared memory.
* :mod:`~distopt.elastic.heartbeat`: under torchrun, a peer that goes silent without
  closing its connections (a frozen node) is seen within ``run(lost_after=...)`` seconds.

See docs/elastic.md for the commands, the guarantees and how this compares with
Horovod Elastic and torchrun's agent alone.
"""
from __future__ import annotations

from .run import ElasticLaunchError, check_launch, run
from .sampler import ElasticSampler
from .snapshot import SnapshotDir
from .state import State

__all__ = ["ElasticLaunchError", "ElasticSampler", "SnapshotDir", "State", "check_launch", "run"]
