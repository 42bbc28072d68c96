"""Metric and object collectives with a bad or differing argument on one rank: an error on every rank, no hang
(found by a newcomer's trial: different metric names summed silently; a bad root on one rank hung the others)."""
from __future__ import annotations

import numpy as np
import pytest

from distopt.metrics import broadcast_object, reduce_metrics
from tests.support.backends import run_case, tiered


def case_metric_and_object_errors(rank: int, comm) -> dict:
    out = {}
    calls = {
        "keys": lambda: reduce_metrics(comm, {"b": 1.0} if rank == 1 else {"a": 1.0}),
        "shape": lambda: reduce_metrics(comm, {"a": np.ones(2 if rank == 0 else 3)}),
        "mean": lambda: reduce_metrics(comm, {"a": 1.0}, mean=("z",) if rank == 0 else ()),
        "roots": lambda: broadcast_object(comm, "x", root=comm.size + 4 if rank == 1 else 0),
        "bad_root": lambda: broadcast_object(comm, "x", root=-1),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 (reported to the test)
            out[name] = f"{type(exc).__name__}: {exc}"
    out["sum"] = reduce_metrics(comm, {"n": float(rank), "v": np.ones(2)}, mean=("n",))
    out["object"] = broadcast_object(comm, {"from": rank}, root=comm.size - 1)
    return out


@pytest.mark.parametrize(("backend", "size"), tiered([("sim", 3), ("mpi", 3), ("shm", 2), ("torch", 2)]))
def test_metric_and_object_arguments_are_checked_on_every_rank(backend, size):
    for res in run_case(backend, size, case_metric_and_object_errors):
        assert res["keys"].startswith("CollectiveMismatchError: all_reduce_metrics: metric set differs across ranks"), res
        assert "rank 1: {'b': ()}" in res["keys"], res["keys"]
        assert res["shape"].startswith("CollectiveMismatchError"), res["shape"]
        assert res["mean"].startswith("KeyError") and "on rank 0: mean names 'z', which is not among" in res["mean"], res["mean"]
        assert res["roots"].startswith("CollectiveMismatchError: broadcast_object: root differs across ranks (rank 0: 0, rank 1: "), res
        assert res["bad_root"].startswith("ValueError: broadcast_object: root must be an int in"), res["bad_root"]
        assert res["sum"]["n"] == (size - 1) / 2 and res["sum"]["v"].tolist() == [size, size]
        assert res["object"] == {"from": size - 1}
