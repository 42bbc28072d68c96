"""A rank's own sharded state, loaded at the same world size, is taken piece by piece: no rank consolidates the state
into whole tensors (at ``zero=3`` that would be the whole model's optimizer state). At ``zero=3``, where the
parameters live in the shards, training continues bitwise; at ``zero=1|2`` a shard holds only this rank's pieces of
the replicated parameters."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import own_shard_cases as cases
from tests.support.backends import run_case

torch = pytest.importorskip("torch")


@pytest.mark.unit
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_own_sharded_state_loads_without_consolidating(zero: int) -> None:
    for rank, res in enumerate(run_case("sim", 2, cases.case_own_shard, zero)):
        assert res["state_loaded"], f"rank {rank}: the loaded state is not the saved pieces'"
        assert not res["consolidated"], f"rank {rank} consolidated its own shard"
        if zero == 3:
            for i, (a, b) in enumerate(zip(res["ref"], res["got"])):
                assert np.array_equal(np.asarray(a), np.asarray(b)), f"rank {rank} parameter {i}"
