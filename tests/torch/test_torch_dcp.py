"""``torch.distributed.checkpoint`` at every ``zero`` stage: ``get_state_dict``/``set_state_dict`` with
``dcp.save``/``dcp.load``, saved at W=2 and resumed at W=1, 2 and 3 into any stage; distopt's own state
(its step count) survives the round trip."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support import dcp_cases as cases
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")


def _same(a: list, b: list, world: int, what: str) -> None:
    """Bitwise at W <= 2 (every stage equals zero=0 there), float rounding above."""
    for rank, (x, y) in enumerate(zip(a, b)):
        for p, q in zip(x, y):
            if world <= 2:
                assert torch.equal(p, q), f"{what}: rank {rank} differs"
            else:
                np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=0, atol=1e-6, err_msg=f"{what}: rank {rank}")


@pytest.mark.parametrize("backend", tiered(["torch"]))  # the pool's MPI world has no torch default group
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dcp_save_at_two_loads_at_one_two_and_three_into_any_stage(backend: str, zero: int, tmp_path: Path) -> None:
    directory = str(tmp_path / "ckpt")
    run_case(backend, 2, cases.case_dcp, zero, directory, "save", 2)
    straight = run_case(backend, 2, cases.case_reference, 4)
    for world, into in ((2, zero), (3, zero), (1, 0), (3, (zero + 1) % 4)):
        got = run_case(backend, world, cases.case_dcp, into, directory, "dcp", 2)
        ref = run_case(backend, world, cases.case_dcp, 0, directory, "plain", 2)
        assert [g["restored"] for g in got] == [2] * world, "distopt's step count did not survive"
        _same([g["params"] for g in got], [r["params"] for r in ref], world, f"zero={zero} W=2 -> zero={into} W={world}")
        if world == 2:
            _same([g["params"] for g in got], straight, 2, "resumed vs uninterrupted")


@pytest.mark.parametrize("backend", tiered(["torch"]))
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_elastic_state_is_a_stateful_that_dcp_saves_at_two_and_loads_at_three(backend: str, zero: int,
                                                                              tmp_path: Path) -> None:
    directory = str(tmp_path / "state")
    run_case(backend, 2, cases.case_state, zero, directory, "save", 2)
    for world in (2, 3):
        got = run_case(backend, world, cases.case_state, zero, directory, "load", 2)
        ref = run_case(backend, world, cases.case_dcp, 0, directory, "plain", 2)
        assert [g["restored"] for g in got] == [(2, 2 * 2 * 3, 7)] * world, "step count, sampler position or value lost"
        _same([g["params"] for g in got], [r["params"] for r in ref], world, f"State zero={zero} W=2 -> W={world}")
