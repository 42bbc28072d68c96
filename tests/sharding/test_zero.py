"""The sharded optimizer (``DistOpt(zero=1|2)``) against ``zero=0``: bitwise at W <= 2, float rounding above.

Fast cases run in the simulated world; the same cases run on MPI, shm and
torch.distributed at W = 2 and 3 (``@pytest.mark.parametrize("backend")``).
"""
from __future__ import annotations

import io

import numpy as np
import pytest

import distopt
from distopt.sharding.plan import plan_shards
from distopt.sharding.policy import SPARE_BUFFERS
from distopt.core.buckets import plan_buckets
from tests.support import zero_cases as cases
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

REAL = ["mpi", "shm", "torch"]


def _same(ref: list, got: list, world: int, what: str, exact: bool = True) -> None:
    """``got`` equals ``ref`` bitwise at W <= 2, to float32 rounding above; replicas of ``got`` identical."""
    for r, (a_rank, b_rank) in enumerate(zip(ref, got)):
        for i, (a, b, c) in enumerate(zip(a_rank, b_rank, got[0])):
            a, b, c = (np.asarray(x) for x in (a, b, c))
            assert np.array_equal(b, c), f"{what}: rank {r} parameter {i} differs from rank 0's"
            if world <= 2 and exact:
                assert np.array_equal(a, b), f"{what}: rank {r} parameter {i} differs from zero=0 by {np.abs(a - b).max()}"
            else:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.unit
def test_plan_splits_every_bucket_within_one_element_and_covers_it_once():
    buckets = plan_buckets([((5, 3), np.float32), ((1,), np.float32), ((7,), np.float32), ((2,), np.float32)],
                           4, 6)
    for world in (1, 2, 3, 4, 7):
        plans = [plan_shards(buckets, r, world) for r in range(world)]
        for b, bucket in enumerate(buckets):
            counts = plans[0].counts[b]
            assert sum(counts) == bucket.size and max(counts) - min(counts) <= 1
            covered = np.zeros(bucket.size, dtype=int)
            for r, plan in enumerate(plans):
                for p in plan.pieces:
                    if p.bucket == b:
                        slot = next(s for s in bucket.slots if s.index == p.index)
                        covered[slot.offset + p.start:slot.offset + p.stop] += 1
            assert (covered == 1).all(), (world, b, covered)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("strategy", ["dense", "half"])
@pytest.mark.unit
def test_arrays_sharded_equal_unsharded(world, zero, strategy):
    for threshold in (None, 10):
        ref = run_case("sim", world, cases.case_arrays, 0, strategy, threshold)
        got = run_case("sim", world, cases.case_arrays, zero, strategy, threshold)
        _same([r["params"] for r in ref], [g["params"] for g in got], world, f"zero={zero} {strategy}")
        full = ref[0]["stats"]["optimizer_state_bytes"]
        for r in range(world):
            mine = got[r]["stats"]["optimizer_state_bytes"]
            assert mine <= full / world + 4 * 64 + 4, (r, mine, full)  # 1/W plus at most one element per bucket
        assert got[0]["stats"]["wire_bytes"] == ref[0]["stats"]["wire_bytes"]
        assert got[0]["stats"]["gather_bytes"] == got[0]["stats"]["wire_bytes"] * (1 if strategy == "dense" else 2)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw-foreach", "adamw-single"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.unit
def test_torch_sharded_equal_unsharded(optimizer, world, zero):
    ref = run_case("sim", world, cases.case_torch, 0, optimizer, {})
    got = run_case("sim", world, cases.case_torch, zero, optimizer, {})
    _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{optimizer} zero={zero}")
    a, b = ref[0]["state"]["state"], got[0]["state"]["state"]
    assert sorted(a) == sorted(b)
    for k in a:
        for name, v in a[k].items():
            if world <= 2:
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[k][name])), (k, name)
    state = [g["stats"]["optimizer_state_bytes"] for g in got]
    assert max(state) < ref[0]["stats"]["optimizer_state_bytes"] / world + 40 * 4 * 3, state
    if zero == 2:
        kept = SPARE_BUFFERS * got[0]["bucket_bytes"]  # the bucket buffers kept for the next step
        assert max(g["stats"]["gradient_bytes"] for g in got) <= kept  # the segments went with the update


@pytest.mark.parametrize("options", [{"strategy": "half"}, {"clip": 0.05}, {"accumulate": 2},
                                     {"overlap_param_gather": True}, {"scaler": True},
                                     {"scaler": True, "poison_step": 1}, {"check_finite": True, "poison_step": 2}],
                         ids=["half", "clip", "no_sync", "overlap_param_gather", "grad_scaler", "grad_scaler_inf",
                              "check_finite_inf"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_torch_sharded_composes(options, world):
    ref = run_case("sim", world, cases.case_torch, 0, "adam", options)
    for zero in (1, 2):
        got = run_case("sim", world, cases.case_torch, zero, "adam", options)
        # the global norm of the shards sums squares in another order than torch's: float rounding
        _same([r["params"] for r in ref], [g["params"] for g in got], world, f"zero={zero} {options}",
              exact=not options.get("clip"))
        if options.get("clip"):
            np.testing.assert_allclose(got[0]["norms"], ref[0]["norms"], rtol=1e-5)
            assert got[0]["norms"] == got[1]["norms"]
        if options.get("scaler"):
            assert {g["scale"] for g in got} == {ref[0]["scale"]}
        if options.get("check_finite"):
            assert got[0]["stats"]["skipped_steps"] == ref[0]["stats"]["skipped_steps"] == 1


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.world
def test_backends_sharded_equal_unsharded(backend, world):
    ref = run_case(backend, world, cases.case_torch, 0, "adamw-foreach", {})
    got = run_case(backend, world, cases.case_torch, 1, "adamw-foreach", {})
    _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{backend} zero=1")
    ref = run_case(backend, world, cases.case_arrays, 0, "dense", None)
    got = run_case(backend, world, cases.case_arrays, 2, "dense", None)
    _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{backend} arrays zero=2")


@pytest.mark.unit
def test_single_communicator_sharded_equals_unsharded():
    from distopt.comm import create

    runs = {}
    for zero in (0, 1, 2):
        runs[zero] = cases.case_torch(0, create("single"), zero, "adam", {})["params"]
    for zero in (1, 2):
        for a, b in zip(runs[0], runs[zero]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", tiered(["sim", "mpi"]))
def test_checkpoint_saved_at_two_resumes_at_one_two_and_three(backend):
    first = run_case(backend, 2, cases.case_resume, 1, None, None, 2)
    straight = run_case(backend, 2, cases.case_resume, 1, None, None, 4)
    again = run_case(backend, 2, cases.case_resume, 1, first[0]["full"], None, 2)
    _same([s["params"] for s in straight], [a["params"] for a in again], 2, "resumed at W=2 vs uninterrupted")
    shards = [f["shard"] for f in first]
    for world in (1, 2, 3):
        ref = run_case(backend, world, cases.case_resume, 0, first[0]["full"], None, 2)
        for how, blob, blobs in (("consolidated", first[0]["full"], None), ("sharded", None, shards)):
            got = run_case(backend, world, cases.case_resume, 1, blob, blobs, 2)
            _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{how} W=2 -> W={world}")
        for zero in (0, 2, 3):  # the list of shards loads into any stage
            got = run_case(backend, world, cases.case_resume, zero, None, shards, 2)
            _same([r["params"] for r in ref], [g["params"] for g in got], world, f"shards -> zero={zero} W={world}")


@pytest.mark.parametrize("backend", tiered(["sim", "mpi"]))
@pytest.mark.parametrize("saved_at", [1, 2, 3])
def test_shards_with_parameters_stream_into_a_fresh_model_at_every_stage(backend, saved_at):
    """Shards holding the parameters' elements (``params=True``), read one at a time into a model built
    from another seed, at W-1, W and W+1 and every stage: bitwise what the consolidated checkpoint gives."""
    first = run_case(backend, 2, cases.case_resume, saved_at, None, None, 2)
    shards = [f["shard_params"] for f in first]
    for world in (1, 2, 3):
        ref = run_case(backend, world, cases.case_resume, saved_at, first[0]["full"], None, 2)
        for zero in (1, 2, 3):
            got = run_case(backend, world, cases.case_resume, zero, None, shards, 2, True)
            for r, (a, b) in enumerate(zip(ref, got)):
                for i, (x, y) in enumerate(zip(a["params"], b["params"])):
                    assert torch.equal(x, y), f"W=2 zero={saved_at} -> W={world} zero={zero}: rank {r} param {i}"


@pytest.mark.unit
def test_sharded_state_of_another_rank_is_refused():
    first = run_case("sim", 2, cases.case_resume, 1, None, None, 1)
    saved = torch.load(io.BytesIO(first[1]["shard"]), weights_only=True)
    model = cases._model()
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters()), backend="single", zero=1)
    with pytest.raises(ValueError, match="rank 1 of 2's shard"):
        opt.load_state_dict({k: v for k, v in saved.items() if k != "distopt_model"})
    opt.close()


@pytest.mark.unit
def test_ranks_with_different_zero_raise_on_every_rank():
    messages = run_case("sim", 2, cases.case_mismatched_zero)
    assert all("zero" in m for m in messages), messages


@pytest.mark.unit
def test_bad_settings_are_refused_at_construction():
    from distopt.strategies import DGC, Partial, PowerSGD, Sparse

    model = cases._model()
    for bad in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="zero must be one of"):
            distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=bad)
    for strategy in (Sparse(density=0.1), DGC(), PowerSGD(matrix_rank=2), Partial()):
        with pytest.raises(ValueError, match="supports sharding"):
            distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=1, strategy=strategy)
    with pytest.raises(ValueError, match="elementwise"):
        distopt.DistOpt(torch.optim.LBFGS(model.parameters()), backend="single", zero=1)

    class Lamb(torch.optim.Optimizer):
        pass

    with pytest.raises(ValueError, match="elementwise"):
        distopt.DistOpt(Lamb(model.parameters(), {}), backend="single", zero=2)

    class Declared:
        elementwise = True

        def update(self, param, grad):
            param -= grad

    distopt.DistOpt(Declared(), backend="single", zero=1).close()

    class Undeclared:
        def update(self, param, grad):
            param -= grad

    with pytest.raises(ValueError, match="elementwise"):
        distopt.DistOpt(Undeclared(), backend="single", zero=1)
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=2,
                        gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match="model="):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=1,
                        overlap_param_gather=True)
    with pytest.raises(ValueError, match="sharded=True"):
        opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single")
        opt.state_dict(sharded=True)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_layout_changes_reshard_the_state(world):
    ref = run_case("sim", world, cases.case_layout_change, 0)
    for zero in (1, 2):
        _same(ref, run_case("sim", world, cases.case_layout_change, zero), world, f"zero={zero} layout changes")


@pytest.mark.parametrize("backend,world", tiered([("sim", 2), ("sim", 3), ("shm", 3)]))
def test_join_with_uneven_inputs(backend, world):
    ref = run_case(backend, world, cases.case_join, 0)
    _same(ref, run_case(backend, world, cases.case_join, 1), world, "zero=1 join")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_gpt_style_adamw_loss_curve_equals_unsharded(world):
    ref = run_case("sim", world, cases.case_gpt, 0)
    for zero in (1, 2):
        got = run_case("sim", world, cases.case_gpt, zero)
        assert got[0] == got[-1]
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)  # clipping's global norm: float rounding


@pytest.mark.unit
def test_distopt_save_at_two_loads_at_three(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run_case("sim", 2, cases.case_save_load, 1, path, False)
    ref = run_case("sim", 3, cases.case_save_load, 0, path, True)
    _same(ref, run_case("sim", 3, cases.case_save_load, 2, path, True), 3, "distopt.load at W=3")
