"""Fully sharded parameters (``DistOpt(zero=3)``) against ``zero=0``: bitwise at W <= 2, float rounding above.

The numerics run in the simulated world at W = 1 to 4, and on MPI, shm and
torch.distributed at W = 2, 3 and 4; memory at rest is asserted from ``stats``.
"""
from __future__ import annotations

import numpy as np
import pytest

import distopt
from distopt.sharding.policy import SPARE_BUFFERS
from tests.support import zero3_cases as cases3
from tests.support import zero_cases as cases
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

OPTIONS = [{}, {"clip": 0.05}, {"accumulate": 2}, {"scaler": True}, {"scaler": True, "poison_step": 1},
           {"check_finite": True, "poison_step": 2}, {"strategy": "half"}, {"reshard_after_forward": False},
           {"reshard_after_forward": False, "accumulate": 2, "clip": 0.05}]
IDS = ["plain", "clip", "no_sync", "grad_scaler", "grad_scaler_inf", "check_finite_inf", "half", "no_reshard",
       "no_reshard_no_sync_clip"]


def _same(ref: list, got: list, world: int, what: str) -> None:
    """``got`` equals ``ref`` bitwise at W <= 2, to float32 rounding above; the replicas of ``got`` identical."""
    for r, (a_rank, b_rank) in enumerate(zip(ref, got)):
        assert len(a_rank) == len(b_rank), what
        for i, (a, b, c) in enumerate(zip(a_rank, b_rank, got[0])):
            a, b, c = (np.asarray(x) for x in (a, b, c))
            assert np.array_equal(b, c), f"{what}: rank {r} parameter {i} differs from rank 0's"
            if world <= 2:
                assert np.array_equal(a, b), f"{what}: rank {r} parameter {i} off zero=0's by {np.abs(a - b).max()}"
            else:
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-foreach"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.unit
def test_zero3_equals_zero0(optimizer, world):
    for options, name in zip(OPTIONS, IDS):
        ref = run_case("sim", world, cases.case_torch, 0, optimizer, options)
        got = run_case("sim", world, cases.case_torch, 3, optimizer, options)
        _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{optimizer} zero=3 {name}")
        if options.get("scaler"):
            assert {g["scale"] for g in got} == {ref[0]["scale"]}, name
        if options.get("check_finite"):
            assert got[0]["stats"]["skipped_steps"] == ref[0]["stats"]["skipped_steps"] == 1


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_zero3_without_reshard_after_forward_gathers_once_per_step(world):
    resharded = run_case("sim", world, cases.case_torch, 3, "sgd", {})
    kept = run_case("sim", world, cases.case_torch, 3, "sgd", {"reshard_after_forward": False})
    _same([r["params"] for r in resharded], [k["params"] for k in kept], 2, "reshard_after_forward=False")
    full = sum(p.numel() * 4 for p in resharded[0]["params"])
    # each step gathers everything once (False) or in forward and backward (True), the first one too
    assert kept[0]["stats"]["gather_bytes"] == cases.STEPS * full + full  # + summon_full_params at the end
    assert resharded[0]["stats"]["gather_bytes"] > kept[0]["stats"]["gather_bytes"] + full
    # ... and every bucket at most once in each of forward and backward (a prefetch freed unused re-gathers)
    assert resharded[0]["stats"]["gather_bytes"] <= cases.STEPS * 2 * full + full


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.unit
def test_zero3_gpt_style_model_equals_zero0(world, optimizer):
    """Embeddings, attention, LayerNorm and a tied head, with a no_sync micro-batch and clipping each step."""
    ref = run_case("sim", world, cases3.case_gpt_train, 0, optimizer, None, None, 0, 3)
    got = run_case("sim", world, cases3.case_gpt_train, 3, optimizer, None, None, 0, 3)
    _same([r["params"] for r in ref], [g["params"] for g in got], world, f"GPT {optimizer} zero=3")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.unit
def test_zero3_gpt_style_checkpoint_saved_at_two_resumes_at_one_three_and_four(optimizer):
    first = run_case("sim", 2, cases3.case_gpt_train, 3, optimizer, None, None, 0, 3)
    shards = [f["shard"] for f in first]
    for world in (1, 3, 4):
        ref = run_case("sim", world, cases3.case_gpt_train, 0, optimizer, first[0]["full"], None, 3, 2)
        assert not torch.equal(ref[0]["params"][0], first[0]["params"][0]), "the resumed steps changed nothing"
        for how, blob, blobs in (("consolidated", first[0]["full"], None), ("sharded", None, shards)):
            got = run_case("sim", world, cases3.case_gpt_train, 3, optimizer, blob, blobs, 3, 2)
            _same([r["params"] for r in ref], [g["params"] for g in got], world,
                  f"GPT {optimizer} zero=3 {how} W=2 -> W={world}")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.unit
def test_zero3_holds_one_over_w_at_rest(world):
    """Parameters and optimizer state at rest <= 1/W of the whole amount plus 2 buckets, plus the bucket buffers
    kept for the next step; no gradient."""
    ref = run_case("sim", world, cases3.case_memory, 0)
    got = run_case("sim", world, cases3.case_memory, 3)
    _same([r["params"] for r in ref], [g["params"] for g in got], world, "memory case")
    full = ref[0]["elements"] * 4 * 4  # float32 parameters, gradients and Adam's two moments
    for r, g in enumerate(got):
        for step, held in enumerate(g["held"]):
            total = held["parameter_bytes"] + held["gradient_bytes"] + held["optimizer_state_bytes"]
            assert total <= full / world + (2 + SPARE_BUFFERS) * g["bucket_bytes"], (r, step, held, full)
            # the gradient segments go once the update consumed them (FSDP frees its sharded gradients at
            # zero_grad): what stays is the bucket buffers kept for the next step
            assert held["gradient_bytes"] <= SPARE_BUFFERS * g["bucket_bytes"], (r, step, held)
            assert held["parameter_bytes"] <= ref[0]["held"][step]["parameter_bytes"] / world + g["bucket_bytes"]
            assert 0 < held["gathered_bytes_peak"] <= ref[0]["held"][step]["parameter_bytes"]
        assert g["own_after_eval"] == 0, "an evaluation's gathered parameters stayed"
    assert ref[0]["held"][-1]["gathered_bytes_peak"] == 0


@pytest.mark.parametrize("buff", [150, 400, 1000])
@pytest.mark.unit
def test_zero3_prefetches_no_bucket_it_frees_unused(buff):
    """Blocks whose modules run in another order than they are registered: every gather a module starts
    for a later one (a prefetch, announced or not) is used before it is freed."""
    for r, counts in enumerate(run_case("sim", 2, cases3.case_gathered, 3, buff)):
        assert counts["started"] > 0 and counts["wasted"] == 0, (r, counts)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_zero3_activation_checkpointing_second_forward_and_no_grad_eval(world, reentrant):
    ref = run_case("sim", world, cases3.case_checkpointed, 0, reentrant)
    _same(ref, run_case("sim", world, cases3.case_checkpointed, 3, reentrant), world, "checkpointed")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_zero3_frozen_parameters_stay_whole(world):
    ref = run_case("sim", world, cases3.case_frozen, 0)
    got = run_case("sim", world, cases3.case_frozen, 3)
    assert {g[-1] for g in got} == {(13, 7)}  # the frozen weight keeps its shape at rest
    _same([r[:-1] for r in ref], [g[:-1] for g in got], world, "frozen first layer")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_zero3_model_state_dict_is_whole_and_load_writes_the_shards(world):
    ref = run_case("sim", world, cases3.case_state_dict, 0)
    got = run_case("sim", world, cases3.case_state_dict, 3)
    for g in got:
        assert sorted(g["saved"]) == sorted(ref[0]["saved"])
        for k, v in ref[0]["saved"].items():
            if world <= 2:
                assert torch.equal(g["saved"][k], v), k
            else:
                torch.testing.assert_close(g["saved"][k], v, rtol=1e-5, atol=1e-6)
    _same([r["params"] for r in ref], [g["params"] for g in got], world, "after load_state_dict")


@pytest.mark.parametrize("backend", tiered(["sim", "mpi"]))
def test_zero3_checkpoint_saved_at_two_resumes_at_one_two_and_three(backend):
    first = run_case(backend, 2, cases.case_resume, 3, None, None, 2)
    shards = [f["shard"] for f in first]
    for world in (1, 2, 3):
        ref = run_case(backend, world, cases.case_resume, 0, first[0]["full"], None, 2)
        for zero, how, blob, blobs in ((0, "consolidated", first[0]["full"], None),
                                       (3, "consolidated", first[0]["full"], None), (3, "sharded", None, shards)):
            got = run_case(backend, world, cases.case_resume, zero, blob, blobs, 2)
            _same([r["params"] for r in ref], [g["params"] for g in got], world,
                  f"zero=3 {how} W=2 -> zero={zero} W={world}")


@pytest.mark.unit
def test_zero3_distopt_save_at_two_loads_at_three(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    run_case("sim", 2, cases.case_save_load, 3, path, False)
    ref = run_case("sim", 3, cases.case_save_load, 0, path, True)
    _same(ref, run_case("sim", 3, cases.case_save_load, 3, path, True), 3, "distopt.load at W=3")


@pytest.mark.parametrize("backend,world", tiered([(b, w) for b in ("mpi", "shm", "torch") for w in (2, 3, 4)]))
def test_zero3_backends_equal_zero0(backend, world):
    for optimizer, options in (("sgd", {"accumulate": 2}), ("adamw-foreach", {"clip": 0.05})):
        ref = run_case(backend, world, cases.case_torch, 0, optimizer, options)
        got = run_case(backend, world, cases.case_torch, 3, optimizer, options)
        _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{backend} {optimizer} {options}")
    for optimizer in ("sgd", "adamw"):
        ref = run_case(backend, world, cases3.case_gpt_train, 0, optimizer, None, None, 0, 2)
        got = run_case(backend, world, cases3.case_gpt_train, 3, optimizer, None, None, 0, 2)
        _same([r["params"] for r in ref], [g["params"] for g in got], world, f"{backend} GPT {optimizer}")


@pytest.mark.parametrize("backend", tiered(["sim", "mpi", "shm", "torch"]))
def test_zero3_module_run_on_one_rank_only_raises_on_every_rank(backend):
    messages = run_case(backend, 2, cases3.case_one_rank_forward, timeout=60)
    for m in messages:
        assert "zero=3: the ranks gather different parameters" in m and "rank 0: forward of module '2'" in m, m


@pytest.mark.parametrize("backend", tiered(["sim", "mpi", "shm", "torch"]))
@pytest.mark.parametrize("counts,reshard", [((3, 1), True), ((1, 0), True), ((1, 0), False)])
def test_zero3_uneven_no_grad_forwards_raise_at_once_on_every_rank(backend, counts, reshard):
    """Generation on one rank: its no-grad forward's gather meets the other's backward gather, or (the other
    keeping its forward's buckets for backward) its step header, the same check frame; every rank raises naming
    both, long before the communicator's timeout (20 s in the pools) would end a wait."""
    for rank, got in enumerate(run_case(backend, 2, cases3.case_uneven_no_grad_forwards, counts, reshard,
                                        timeout=60)):
        m = got["error"]
        assert m.startswith("CollectiveMismatchError") and "rank 0: forward of module '" in m, (rank, m)
        assert ("rank 1: backward of module" if reshard else "rank 1: the step's parameter check") in m, m
        assert got["seconds"] < 10, (rank, got)


@pytest.mark.parametrize("backend", tiered(["sim", "mpi", "shm", "torch"]))
def test_zero3_layer_skipped_on_one_rank_inside_forward_raises_on_every_rank(backend):
    messages = run_case(backend, 2, cases3.case_one_rank_skips_a_layer, timeout=60)
    for m in messages:
        assert "zero=3: the ranks gather different parameters" in m, m
        assert "rank 0: forward of module '2'" in m and "rank 1: forward of module '3'" in m, m


@pytest.mark.unit
def test_zero3_misuse_raises_on_every_rank():
    for out in run_case("sim", 2, cases3.case_errors):
        assert out["outside forward"].startswith("RuntimeError: zero=3: parameter '0.weight' is freed"), out
        assert "summon_full_params" in out["outside forward"], out
        assert "summon_full_params() inside a forward pass" in out["summon inside forward"], out
        assert "join() is not supported with zero=3" in out["join"], out
        assert "zero=3 shards the parameters in the layout of DistOpt's construction" in out["layout change"], out


@pytest.mark.unit
def test_zero3_bad_settings_are_refused_at_construction():
    model = cases._model()
    with pytest.raises(ValueError, match="zero=3 gathers each module's parameters.*model=your_module"):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=3)
    with pytest.raises(ValueError, match="zero=3 frees each parameter.*torch.optim.Optimizer and model="):
        distopt.DistOpt(distopt.SGD(lr=0.1), backend="single", zero=3)
    with pytest.raises(ValueError, match="zero=3 frees each gradient bucket"):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=3, model=model,
                        gradient_as_bucket_view=True)
    with pytest.raises(ValueError, match="elementwise"):
        distopt.DistOpt(torch.optim.LBFGS(model.parameters()), backend="single", zero=3, model=model)
    with pytest.raises(ValueError, match="reshard_after_forward=False keeps zero=3's"):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=2, model=model,
                        reshard_after_forward=False)
    from distopt.strategies import Sparse

    with pytest.raises(ValueError, match="supports sharding"):
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), backend="single", zero=3, model=model,
                        strategy=Sparse(density=0.1))
