"""``zero=3`` learns which module reads which parameter without gathering the whole model: a deep model with reads
outside the reading module's subtree trains bitwise as ``zero=0`` while its first step holds a fraction of it."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import units_cases as cases
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("first", ["none", "no_grad", "raises"])
@pytest.mark.parametrize("backend", tiered(["sim", "torch"]))
def test_zero3_first_forward_gathers_module_by_module(backend: str, first: str) -> None:
    """Also after an evaluation, and after a first forward that raised (learnt again from the next one)."""
    ref = run_case(backend, 2, cases.case_deep, 0, first)
    got = run_case(backend, 2, cases.case_deep, 3, first)
    for rank in range(2):
        for i, (a, b) in enumerate(zip(ref[rank]["params"], got[rank]["params"])):
            assert np.array_equal(a, b), f"rank {rank} parameter {i} off zero=0's by {np.abs(a - b).max()}"
        peaks, full = got[rank]["peaks"], got[rank]["full"]
        # six blocks: the first step, like the later ones, holds a few modules' buckets whole, not the model
        assert 0 < peaks[0] < full / 3, (peaks, full)
        assert peaks[0] <= max(peaks[1:]), peaks
        assert "'tok.weight' is freed" in got[rank]["error"] and "T()" in got[rank]["error"], got[rank]["error"]


@pytest.mark.unit
def test_zero3_another_models_freed_parameter_in_a_first_forward_is_named() -> None:
    for rank, error in enumerate(run_case("sim", 2, cases.case_two_models)):
        assert "parameter 'weight' is freed" in error and "add()" in error, (rank, error)
