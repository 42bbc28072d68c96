"""DGC and PowerSGD under mpiexec (run by ``tests/strategies/test_dgc_powersgd_mpi.py`` at W=2).

Conventions as ``mpi_strategies.py``: every test performs its collectives
first and asserts at the end, on values identical on every rank.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

import distopt
from distopt import SGD
from distopt.strategies import DGC, PowerSGD

SHAPES = [(20, 5, 3, 3), (20,), (64, 90), (64,)]
STRATEGIES = {
    "dgc": lambda: DGC(sparsity=0.99, momentum=0.9, clip_norm=10.0, warmup_steps=2),
    "powersgd": lambda: PowerSGD(matrix_rank=2, start_step=2),
}


def _grads(step, rank):
    rng = np.random.default_rng(100 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _same_everywhere(world, arrays) -> bool:
    mine = [a.tobytes() for a in arrays]
    return all(other == mine for other in world.allgather(mine))


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_replicas_identical_and_checkpoint_resume(make, world, kind):
    """Bitwise-equal replicas after every step over MPI; distopt.save/load (per-rank files) resumes
    with bitwise the same next steps; wire bytes stay well below dense once compressing."""
    opt = make(SGD(lr=0.05), strategy=STRATEGIES[kind]())
    params = [np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in enumerate(SHAPES)]
    opt.sync_params(params)
    same = []
    for s in range(6):
        opt.step(params, _grads(s, world.rank))
        same.append(_same_everywhere(world, params))
    path = Path(tempfile.gettempdir()) / f"distopt-{kind}-{world.bcast(np.random.randint(1 << 30))}.ckpt"
    distopt.save(path, [p.copy() for p in params], opt)
    before = opt.stats.wire_bytes, opt.stats.dense_bytes
    for s in (6, 7):
        opt.step(params, _grads(s, world.rank))
    late_ratio = (opt.stats.wire_bytes - before[0]) / (opt.stats.dense_bytes - before[1])
    fresh = make(SGD(lr=0.05), strategy=STRATEGIES[kind]())
    again = distopt.load(path, fresh)
    fresh.sync_params(again)
    for s in (6, 7):
        fresh.step(again, _grads(s, world.rank))
    resumed = all(np.array_equal(a, b) for a, b in zip(params, again))
    everyone_resumed = world.allgather(resumed)
    world.Barrier()
    if world.rank == 0:
        for f in path.parent.glob(path.name + "*"):
            f.unlink()
    assert all(same), same
    assert all(everyone_resumed), everyone_resumed
    assert late_ratio < 0.1, late_ratio
