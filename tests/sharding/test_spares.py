"""The bucket buffers a sharded step keeps for the next one (distopt.core.spares)."""
from __future__ import annotations

import numpy as np
import pytest

from distopt.core.spares import Spares
from tests.support import zero_cases as cases
from tests.support.backends import run_case


@pytest.mark.unit
def test_spares_reuse_the_smallest_fit_and_keep_the_largest():
    spares, made = Spares(2), []

    def new(n: int, dtype: type = np.float32) -> np.ndarray:
        made.append(n)
        return np.empty(n, dtype)

    a, b, c = (spares.take(n, np.float32, new) for n in (10, 30, 20))
    assert made == [10, 30, 20]
    for buf in (a, b, c):
        spares.give(buf)
    assert spares.held_bytes == (30 + 20) * 4  # the 10-element buffer was dropped: two kept, the largest
    assert spares.take(15, np.float32, new) is c  # the smallest that fits
    assert spares.take(8, np.float64, lambda n: new(n, np.float64)).dtype == np.float64 and made[-1] == 8  # a new one
    assert spares.take(31, np.float32, new).shape == (31,) and made[-1] == 31  # none large enough
    assert spares.take(1, np.float32, new) is b
    with pytest.raises(ValueError, match="limit must be >= 0"):
        Spares(-1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_zero2_takes_its_bucket_buffers_from_the_kept_ones_after_the_first_step(world):
    """Buckets are packed one at a time after backward and each is dropped once its reduce-scatter completed, so two
    kept buffers serve every bucket of every later step."""
    for r, fresh in enumerate(run_case("sim", world, cases.case_fresh_buffers, 2)):
        assert fresh[0] >= 1 and fresh[1:] == [0] * (len(fresh) - 1), (r, fresh)
