"""Sharded elastic commits: at ``zero=1|2|3`` each rank commits its own shard (optimizer state and parameter
elements), and a restore at another world size re-shards from the parts, one at a time, bitwise equal to a
restore through a consolidated checkpoint. Simulated ranks (threads); the real launches are in
``test_elastic_torchrun.py``."""
from __future__ import annotations

import pytest

from tests.support import own_shard_cases as own_cases
from tests.support import zero_cases as cases
from tests.support.backends import run_case

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.world


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_sharded_commit_restores_at_w_minus_and_plus_one_as_the_consolidated_route(zero: int) -> None:
    saved = run_case("sim", 2, cases.case_elastic_parts, zero, None, 0)
    parts = [s["part"] for s in saved]
    first = run_case("sim", 2, cases.case_resume, zero, None, None, 2)
    for world in (1, 2, 3):
        ref = run_case("sim", world, cases.case_resume, zero, first[0]["full"], None, 2)
        got = run_case("sim", world, cases.case_elastic_parts, zero, parts, 2)
        for r, (a, b) in enumerate(zip(ref, got)):
            for i, (x, y) in enumerate(zip(a["params"], b["params"])):
                assert torch.equal(x, y), f"zero={zero} W=2 -> W={world}: rank {r} parameter {i}"


@pytest.mark.parametrize("zero", [1, 3])
def test_restore_at_the_same_world_reads_each_rank_its_own_part_at_zero3(zero: int, tmp_path) -> None:
    """A restarted world of the commit's size, every rank's part on its node: at ``zero=3`` each rank reads only its
    own part (its parameters live in it); at ``zero=1`` every part is streamed (the parameters are replicated, a
    part holds only its rank's pieces). Either way training goes on bitwise as without the restart."""
    ref = run_case("sim", 2, own_cases.case_restore_own, zero, str(tmp_path), False)
    got = run_case("sim", 2, own_cases.case_restore_own, zero, str(tmp_path), True)
    for r, (a, b) in enumerate(zip(ref, got)):
        assert b["own"] is (zero == 3), (r, b["own"])
        for i, (x, y) in enumerate(zip(a["params"], b["params"])):
            assert torch.equal(x, y), f"zero={zero}: rank {r} parameter {i}"
