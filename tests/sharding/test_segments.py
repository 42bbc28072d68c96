"""A reduced segment is copied only when it views memory that is to be freed or reused (``sync._own``)."""
from __future__ import annotations

import numpy as np
import pytest

from distopt.sharding.sync import ShardedStep, _own
from distopt.core.bucket_run import BucketRun

pytestmark = pytest.mark.unit


def test_a_segment_owning_its_memory_is_kept_and_a_view_into_a_larger_buffer_is_copied():
    whole = np.arange(8, dtype=np.float32)
    assert _own(whole) is whole
    part = whole[2:6]
    owned = _own(part)
    assert owned is not part and owned.base is None
    np.testing.assert_array_equal(owned, [2, 3, 4, 5])


def test_a_numpy_view_of_a_whole_torch_tensor_is_kept_and_of_part_of_one_copied():
    """The torch backend returns each segment as a NumPy view of a new tensor: no copy is needed (one
    was made of every segment at every zero=2 step before)."""
    torch = pytest.importorskip("torch")
    segment = torch.arange(6, dtype=torch.float32).numpy()
    assert segment.base is not None and _own(segment) is segment
    part = torch.arange(6, dtype=torch.float32)[1:4].numpy()
    assert _own(part) is not part
    tail = torch.arange(6, dtype=torch.float32)[:3].numpy()  # the storage's start, not all of it
    owned = _own(tail)
    assert owned is not tail
    np.testing.assert_array_equal(owned, [0, 1, 2])


def test_held_bytes_count_every_segment_whatever_holds_its_memory():
    """A torch segment's NumPy view has a base; its bytes still count (they read 0 when only base-less
    arrays were counted)."""
    torch = pytest.importorskip("torch")
    step = ShardedStep.__new__(ShardedStep)  # only the segments matter here
    runs = [BucketRun(0, None, 0, segment=torch.zeros(5, dtype=torch.float32).numpy()),
            BucketRun(1, None, 0, segment=np.zeros(3, np.float64)), BucketRun(2, None, 0)]  # the last not landed
    step.bind(runs)
    assert step.held_bytes == 5 * 4 + 3 * 8
