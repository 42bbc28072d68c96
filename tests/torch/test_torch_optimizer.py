"""DistOpt as the torch optimizer, against one process (tests/support/torch_optimizer_cases.py).

Every item runs in the simulated world at W = 2 and 3; ``test_every_item_on``
runs them all again on the real backends (MPI, shm, torch.distributed) at
W = 2 and 3. float64 throughout: where the arithmetic is the same the
comparison is bitwise, else to 1e-10.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distopt.strategies import REGISTRY  # noqa: E402
from tests.support import torch_optimizer_cases as cases  # noqa: E402
from tests.support.backends import run_case  # noqa: E402

WORLDS = (2, 3)
TOL = 1e-10


def _close(a: Any, b: Any, tol: float = TOL) -> bool:
    return float((a - b).abs().max()) <= tol


def _identical(results: list[Any], pick: Any = lambda r: r) -> bool:
    first = pick(results[0])
    return all(torch.equal(pick(r), first) for r in results[1:])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", cases.SCHEDULERS)
@pytest.mark.unit
def test_lr_schedulers_accept_it_and_match_one_process(kind: str, world: int):
    _check_scheduler(run_case("sim", world, cases.case_scheduler, kind), kind, world)


def _check_scheduler(results: list[Any], kind: str, world: int) -> None:
    lrs, params = cases.reference_scheduler(kind, world)
    for is_optimizer, got_lrs, got in results:
        assert is_optimizer
        assert got_lrs == lrs, kind
        assert _close(got, params), kind
    assert _identical(results, lambda r: r[2])


def _check_state_dict(results: list[dict[str, Any]]) -> None:
    for out in results:
        assert out["keys"] == ["distopt", "param_groups", "state"]
        assert torch.equal(out["resumed"], out["uninterrupted"])  # resume is bitwise the uninterrupted run
        assert out["steps_restored"] == 2
        assert float(out["plain_step"]) == 2.0
        assert torch.equal(out["from_plain"], out["single_exp_avg"])
        assert out["old_format_warned"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_state_dict_is_torchs_layout_and_loads_both_ways(world: int):
    _check_state_dict(run_case("sim", world, cases.case_state_dict))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("line_search", [None, "strong_wolfe"], ids=["plain", "strong_wolfe"])
@pytest.mark.unit
def test_h61_lbfgs_step_closure_equals_one_process(line_search: str | None, world: int):
    """Every closure evaluation's gradient and loss are averaged: the ranks evaluate the closure as often
    as one process on the full batch does, and land where it lands."""
    _check_lbfgs(run_case("sim", world, cases.case_lbfgs, line_search), line_search, world)


def _check_lbfgs(results: list[Any], line_search: str | None, world: int) -> None:
    evals, params = cases.reference_lbfgs(line_search, world)
    assert [n for n, _ in results] == [evals] * world
    assert _identical(results, lambda r: r[1])
    assert _close(results[0][1], params, 1e-8)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_learning_rates_that_drift_apart_raise_on_every_rank(world: int):
    messages = run_case("sim", world, cases.case_lr_mismatch)
    for m in messages:
        assert "param_groups[0]['lr']" in m and "rank 0: 0.1" in m, m


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_broadcast_state_carries_the_schedulers(world: int):
    assert run_case("sim", world, cases.case_broadcast_state) == [(0.0125, 3)] * world


def _check_join(results: list[Any], world: int) -> None:
    assert _identical(results, lambda r: r[0])  # parameters
    assert _identical(results, lambda r: r[1])  # buffers, after the final sync from the last rank to join
    assert [r[2] for r in results] == [world - 1] * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("counts", ["rank0_first", "rank0_last"])
@pytest.mark.unit
def test_h51_join_with_a_batchnorm_model(counts: str, world: int):
    """Uneven batch counts with buffers broadcast before each forward: joined ranks (rank 0 among them)
    shadow the broadcasts of the ranks still training; parameters and buffers end identical."""
    per_rank = [2] + [4] * (world - 1) if counts == "rank0_first" else [4] + [2] * (world - 1)
    results = run_case("sim", world, cases.case_join_batchnorm, per_rank)
    assert _identical(results, lambda r: r[0]) and _identical(results, lambda r: r[1])
    assert [r[2] for r in results] == [(world - 1) if counts == "rank0_first" else 0] * world


def _check_horovod(results: list[dict[str, Any]], world: int) -> None:
    clipped, after = cases.reference_horovod_idioms(world)
    n_params = sum(p.numel() for p in cases.make_model().parameters())
    for out in results:
        assert _close(out["clipped"], clipped)
        assert _close(out["toggle"], after)
        assert out["started_in_backward"] >= 1
        assert out["toggle_wire_bytes"] == 8 * n_params  # one float64 reduction for two micro-batches


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_horovod_and_ddp_idioms(world: int):
    _check_horovod(run_case("sim", world, cases.case_horovod_idioms), world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["once", "twice", "passes", "no_sync"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.unit
def test_h48_activation_checkpointing(reentrant: bool, variant: str, world: int):
    """Every use of a checkpointed block is summed as in one process, and one step makes one reduction."""
    _check_checkpointing(run_case("sim", world, cases.case_checkpointing, reentrant, variant), variant, world)


def _check_checkpointing(results: list[Any], variant: str, world: int) -> None:
    want = cases.reference_checkpointing(variant, world)
    n_params = sum(p.numel() for p in cases.make_model().parameters())
    for params, wire in results:
        assert _close(params, want)
        assert wire == 8 * n_params
    assert _identical(results, lambda r: r[0])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_two_distopts_over_overlapping_parameters_average_each_gradient_once(world: int):
    assert run_case("sim", world, cases.case_two_optimizers) == [cases.expected_two_optimizers(world)] * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_distopt_save_and_load_keep_torch_layout_and_per_rank_residuals(world: int, tmp_path):
    for uninterrupted, resumed in run_case("sim", world, cases.case_save_load, str(tmp_path / "ckpt.pt")):
        assert torch.equal(uninterrupted, resumed)


def _dtype_ok(got: Any, want: Any, strategy: str, world: int) -> bool:
    """Dense: bitwise. A 16-bit wire rounds each rank's predivided gradient (and a backend may sum in 16
    bits): within 4 units of the wire's rounding of the update, plus one of the parameter's own."""
    if strategy == "dense":
        return torch.equal(got, want)
    wire = torch.finfo(torch.bfloat16 if strategy == "half_bf16" else torch.float16).eps
    mean = (world + 1) / 2
    tol = 0.1 * mean * 4 * wire + torch.finfo(want.dtype).eps * float(want.abs().max())
    return got.dtype == want.dtype and float((got.double() - want.double()).abs().max()) <= tol


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("strategy", ["dense", "half", "half_bf16"])
@pytest.mark.parametrize("dtypes", [["bfloat16"], cases.DTYPES], ids=["bfloat16", "mixed"])
@pytest.mark.unit
def test_h55_every_floating_dtype(dtypes: list[str], strategy: str, world: int):
    """bfloat16 (and float16, float32, float64 in one model): the parameters keep their dtype, the update
    is the average of the local gradients (bitwise with a dense wire, else within the wire's rounding),
    replicas identical."""
    results = run_case("sim", world, cases.case_dtypes, dtypes, strategy)
    want = [w for d, w in zip(cases.DTYPES, cases.expected_dtypes(world)) if d in dtypes]
    for params, names in results:
        assert names == [f"torch.{d}" for d in dtypes]
        assert all(_dtype_ok(p, w, strategy, world) for p, w in zip(params, want))
    assert _identical(results, lambda r: torch.cat([p.double().reshape(-1) for p in r[0]]))


def _check_collective_errors(results: list[Any], world: int) -> None:
    for got in results:
        assert len(got) == 5
        for (kind, text), (want_kind, want_text) in zip(got, cases.expected_collective_errors(world)):
            assert kind == want_kind and want_text in text, (kind, text)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_collective_argument_errors_are_raised_on_every_rank_at_once(world: int):
    _check_collective_errors(run_case("sim", world, cases.case_collective_errors), world)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("backend", ["mpi", "shm", "torch"])
@pytest.mark.world
def test_every_item_on(backend: str, world: int, tmp_path):
    results = run_case(backend, world, cases.case_every_item, str(tmp_path / "ckpt.pt"), timeout=240)
    assert all(torch.equal(*r["save_load"]) for r in results)
    _check_collective_errors([r["collective_errors"] for r in results], world)
    want = cases.expected_dtypes(world)
    for r in results:
        for strategy, params in zip(("dense", "half", "half_bf16"), r["dtypes"]):
            assert all(_dtype_ok(p, w, strategy, world) for p, w in zip(params, want)), (backend, strategy)
    for kind in cases.SCHEDULERS:
        _check_scheduler([r["scheduler"][kind] for r in results], kind, world)
    _check_surface([r["surface"] for r in results], world)
    for how in ("no_sync", "passes"):
        _check_identical_pair([r["join_accumulating"][how] for r in results])
    _check_state_dict([r["state_dict"] for r in results])
    for search in (None, "strong_wolfe"):
        _check_lbfgs([r["lbfgs"][search] for r in results], search, world)
    for (example_id, dtype) in results[0]["strategy_dtypes"]:
        _check_strategy_dtype([r["strategy_dtypes"][example_id, dtype] for r in results], dtype)
    assert all("param_groups[0]['lr']" in r["lr_mismatch"] for r in results)
    assert [r["broadcast_state"] for r in results] == [(0.0125, 3)] * world
    _check_join([r["join"] for r in results], world)
    _check_horovod([r["horovod"] for r in results], world)
    for reentrant, variant in results[0]["checkpointing"]:
        _check_checkpointing([r["checkpointing"][reentrant, variant] for r in results], variant, world)
    assert [r["two"] for r in results] == [cases.expected_two_optimizers(world)] * world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.unit
def test_step_hooks_zero_grad_and_add_param_group(world: int):
    _check_surface(run_case("sim", world, cases.case_optimizer_surface), world)


def _check_surface(results: list[Any], world: int) -> None:
    mean = sum(r + 1.0 for r in range(world)) / world
    for out in results:
        assert out["hooks"] == ["pre", "post"] and out["zeroed"] and out["none"]
        assert out["broadcast"].tolist() == [0.0, 0.0]
        assert out["extra"].tolist() == [-mean, -mean]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("example_id", sorted(REGISTRY))
@pytest.mark.unit
def test_h55_16_bit_parameters_in_every_strategy(example_id: str, dtype: str):
    """Every registered strategy steps 16-bit PyTorch parameters: they keep their dtype, replicas agree."""
    _check_strategy_dtype(run_case("sim", 2, cases.case_strategy_dtype, example_id, dtype), dtype)


def _check_strategy_dtype(results: list[Any], dtype: str) -> None:
    assert all(r.dtype == getattr(torch, dtype) for r in results)
    assert _identical(results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("how", ["no_sync", "passes"])
@pytest.mark.unit
def test_h51_join_with_a_batchnorm_model_and_accumulation(how: str, world: int):
    """Inside join() the buffers are broadcast (and shadowed) once per step, at its first forward."""
    _check_identical_pair(run_case("sim", world, cases.case_join_batchnorm_accumulating, [2] + [4] * (world - 1),
                                   how))


def _check_identical_pair(results: list[Any]) -> None:
    assert _identical(results, lambda r: r[0]) and _identical(results, lambda r: r[1])
