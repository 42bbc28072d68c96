"""Where training scripts touch a sharded optimizer: ``.grad`` and clipping (H69), state loaded before the wrap.

Stage 1 keeps the whole averaged gradient in ``.grad``, so torch's clipping and any edit act on what
the update reads and give ``zero=0``'s result; stage 2 keeps the gradient sharded and any use of the
``.grad`` placeholder raises on every rank, naming ``opt.clip_grad_norm_``.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.support import zero_seam_cases as cases
from tests.support.backends import run_case, tiered
from tests.support.simworld import run_world

torch = pytest.importorskip("torch")

BACKENDS = tiered(["sim", "mpi", "shm", "torch"])
TORCH_MODES = ["torch", "torch-inf", "value", "zero-grads"]


def _reference(backend: str, world: int, mode: str) -> list[dict]:
    """zero=0 with torch's own clipping (the distopt modes clip as torch does, by the global norm)."""
    ref_mode = {"distopt": "torch", "distopt-inf": "torch-inf"}.get(mode, mode)
    return run_case(backend, world, cases.case_h69_clipping, 0, ref_mode)


def _check_bitwise(ref: list[dict], got: list[dict], world: int, mode: str) -> None:
    for r in range(world):
        assert "error" not in got[r], got[r]
        assert got[r]["norms"] == ref[r]["norms"], f"{mode} rank {r}: {got[r]['norms']} vs {ref[r]['norms']}"
        for i, (a, b) in enumerate(zip(got[r]["params"], ref[r]["params"])):
            assert np.array_equal(a, b), f"{mode}: rank {r} parameter {i} differs from zero=0's"
        assert ref[r]["norms"][0] > 0.05  # the clip is active


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("zero", [1, 2])
def test_h69_distopt_clipping_equals_torch_clipping_at_zero0(backend, zero):
    """Bitwise: at zero=2 the norm is torch's formula over every rank's pieces (the MLP's 256-element
    weights straddle the two ranks' segments of their 128-element buckets)."""
    for mode in ("distopt", "distopt-inf"):
        _check_bitwise(_reference(backend, 2, mode), run_case(backend, 2, cases.case_h69_clipping, zero, mode), 2,
                       mode)


@pytest.mark.unit
@pytest.mark.parametrize("world", [3, 4])
def test_h69_zero2_clipping_is_bitwise_at_three_and_four_ranks(world):
    for mode in ("distopt", "distopt-inf"):
        _check_bitwise(_reference("sim", world, mode), run_case("sim", world, cases.case_h69_clipping, 2, mode),
                       world, mode)


@pytest.mark.parametrize("backend", BACKENDS)
def test_h69_torch_clipping_and_grad_edits_at_zero1_equal_zero0(backend):
    for mode in TORCH_MODES:
        ref = _reference(backend, 2, mode)
        got = run_case(backend, 2, cases.case_h69_clipping, 1, mode)
        for r in range(2):
            assert "error" not in got[r], got[r]
            assert got[r]["norms"] == ref[r]["norms"], (mode, r)  # the global norm, not a shard's
            for i, (a, b) in enumerate(zip(got[r]["params"], ref[r]["params"])):
                assert np.array_equal(a, b), f"{mode}: rank {r} parameter {i} differs from zero=0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_h69_torch_clipping_and_grad_edits_at_zero2_raise_on_every_rank(backend):
    for mode in TORCH_MODES:
        got = run_case(backend, 2, cases.case_h69_clipping, 2, mode)
        for r in range(2):
            assert "error" in got[r], f"{mode}: rank {r} did not raise"
            assert "opt.clip_grad_norm_" in got[r]["error"] and "zero=2" in got[r]["error"], got[r]["error"]


@pytest.mark.unit
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_state_loaded_before_the_wrap_is_kept_and_sharded(world, zero, optimizer):
    ref = run_case("sim", world, cases.case_state_before_wrap, 0, optimizer)
    got = run_case("sim", world, cases.case_state_before_wrap, zero, optimizer)
    for r in range(world):
        for i, (a, b) in enumerate(zip(got[r]["params"], ref[r]["params"])):
            if world <= 2:
                assert np.array_equal(a, b), f"rank {r} parameter {i} differs from zero=0"
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert sorted(got[r]["state"]) == sorted(ref[r]["state"])
        for n, entry in ref[r]["state"].items():
            for k, v in entry.items():
                np.testing.assert_allclose(got[r]["state"][n][k], v, rtol=1e-5, atol=1e-7, err_msg=f"{n}.{k}")


def _same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for n, entry in want.items():
        for k, v in entry.items():
            assert np.array_equal(got[n][k], v), f"parameter {n} {k} differs from the saved state"


@pytest.mark.parametrize("backend", BACKENDS)
def test_h87_sharded_checkpoint_with_a_missing_stale_or_duplicated_shard(backend):
    saved = run_case(backend, 2, cases.case_h87_save)
    s2, s4 = [r["shard2"] for r in saved], [r["shard4"] for r in saved]
    want = saved[0]["full4"]
    for label, blobs in (("a", [s4[0], s4[1]]), ("d", [s4[1], s4[0]])):
        for r, res in enumerate(run_case(backend, 3, cases.case_h87_load, blobs)):
            assert "error" not in res, (label, r, res)
            _same_state(res["full"], want)
    bad = {"b": (3, [s4[0]], "rank(s) [1] missing"),
           "c": (3, [s4[0], s2[1]], "different steps"),
           "e": (2, {"own": [s4[0], s2[1]]}, "a stale shard"),
           "f": (2, [s4[0], s4[0]], "rank(s) [0] twice")}
    for label, (world, blobs, text) in bad.items():
        for r, res in enumerate(run_case(backend, world, cases.case_h87_load, blobs)):
            assert "error" in res, f"({label}) rank {r} loaded silently"
            assert text in res["error"], (label, r, res["error"])


@pytest.mark.unit
@pytest.mark.parametrize("first, second", [(1, 0), (0, 1), (2, 2), (0, 0)])
def test_overlapping_distopts_with_a_sharded_one_are_refused_at_construction(first, second):
    for r, text in enumerate(run_case("sim", 2, cases.case_overlapping, first, second)):
        if first == second == 0:
            assert text == "built", text  # zero=0 shares: the first built averages (tested elsewhere)
        else:
            assert "parameters ['#0 (8, 4)', '#1 (8,)'] belong to another live DistOpt" in text, (r, text)


@pytest.mark.unit
@pytest.mark.parametrize("zero", [1, 2])
def test_rank0_only_state_dict_after_consolidate_state_dict_equals_zero0(zero):
    ref = run_case("sim", 2, cases.case_rank0_writer, 0, False)[0]["state"]
    got = run_case("sim", 2, cases.case_rank0_writer, zero, True)[0]
    assert "error" not in got, got
    assert sorted(got["state"]) == sorted(ref)
    for n, entry in ref.items():
        for k, v in entry.items():
            assert np.array_equal(got["state"][n][k], v), f"parameter {n} {k}"


@pytest.mark.unit
def test_rank0_only_state_dict_without_consolidate_fails_naming_the_fix():
    # the simulated collectives time out after 3 s (half the world's limit), as the DistOpt's own timeout
    got = run_world(2, lambda rank, comm: cases.case_rank0_writer(rank, comm, 1, False), timeout=6.0)[0]
    assert got["type"] == "CollectiveTimeoutError", got  # the other rank never calls a collective again
    assert "consolidate_state_dict(to=0)" in got["error"] and "state_dict()" in got["error"], got


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank0_only_state_dict_while_the_others_step_fails_at_once_on_every_rank(backend):
    """The others' next step meets rank 0's consolidation: a mismatch on both ranks at once (not the
    timeout), rank 0's naming the fix."""
    got = run_case(backend, 2, cases.case_rank0_writer, 1, False, True)
    for r in range(2):
        assert got[r].get("type") == "CollectiveMismatchError", (r, got[r])
    assert "consolidate_state_dict(to=0)" in got[0]["error"] and "state_dict()" in got[0]["error"], got[0]
