"""Mixed precision at ``zero=0|1|2|3`` (``DistOpt(param_dtype=, reduce_dtype=)``, FSDP2's ``MixedPrecisionPolicy``)
against a one-process emulation of the same policy (:mod:`tests.support.mixed_precision_cases`): bitwise at W = 2.

The emulation keeps float32 masters, runs each rank's batch through a ``param_dtype`` copy of them, casts each
gradient to ``reduce_dtype``, sums the ranks' gradients in rank order and divides by W, then steps a float32 AdamW.
Also: the bytes gathered per step (half of float32's for bfloat16; none at ``zero=0``), clipping, ``GradScaler`` with
float16 (steps skipped on overflow included), checkpoints and ``summon_full_params`` holding the float32 masters, a
model built on the meta device (``zero=3``), and the arguments refused.
"""
from __future__ import annotations

import copy
from typing import Any

import pytest

import distopt
from tests.support import mixed_precision_cases as mp
from tests.support.backends import run_case, tiered
from tests.support.zero_cases import _model

torch = pytest.importorskip("torch")


def _bitwise(backend: str, net: str, param_dtype: str | None, reduce_dtype: str | None, steps: int,
             options: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``case_train`` at W=2 and assert its masters equal the emulation's bitwise on every rank, and each
    rank's losses the emulation's losses of that rank; returns the ranks' results."""
    got = run_case(backend, 2, mp.case_train, net, param_dtype, reduce_dtype, steps, options)
    ref = mp.emulate(2, net, param_dtype, reduce_dtype, steps, options)
    what = f"{net} {param_dtype}/{reduce_dtype} {options}"
    for rank, g in enumerate(got):
        assert len(g["params"]) == len(ref["params"])
        for i, (a, b) in enumerate(zip(ref["params"], g["params"])):
            assert a.dtype == b.dtype == torch.float32, f"{what}: parameter {i} is {b.dtype} (masters are float32)"
            assert torch.equal(a, b), f"{what}: rank {rank} parameter {i} off the emulation by {(a - b).abs().max()}"
        assert g["losses"] == ref["losses"][rank], f"{what}: rank {rank}'s losses"
    assert any(not torch.equal(a, b) for a, b in zip(ref["params"], mp.emulate(2, net, param_dtype, reduce_dtype,
                                                                                 0, options)["params"])), what
    return got


ZEROS = [0, 1, 2, 3]


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("net", ["gpt", "mlp"])
@pytest.mark.unit
def test_bf16_params_float32_reduce_equals_the_emulation_bitwise(net, zero):
    """The GPT-style model (embeddings, attention, LayerNorm, a tied head) and an MLP with float inputs."""
    got = _bitwise("sim", net, "bfloat16", "float32", 4, {"zero": zero})
    for g in got:
        assert g["seen"] == ["torch.bfloat16"], g["seen"]  # the output and the parameters inside forward
        assert g["rest"] == ["torch.bfloat16"], g["rest"]  # the dtype forward sees, held as one element
        assert {dtype for dtype, _ in g["saved"].values()} <= {"torch.float32", "torch.bool"}  # the masters


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.unit
def test_bf16_gathers_move_half_the_bytes_of_float32(zero):
    """``stats["step_gather_bytes"]`` of each step: exactly half of float32's (none at ``zero=0``); the reduction
    (float32) moves the same bytes, and half of them with ``reduce_dtype=bfloat16``."""
    fp32 = run_case("sim", 2, mp.case_train, "gpt", None, None, 3, {"zero": zero})
    bf16 = run_case("sim", 2, mp.case_train, "gpt", "bfloat16", "float32", 3, {"zero": zero})
    low = run_case("sim", 2, mp.case_train, "gpt", "bfloat16", "bfloat16", 3, {"zero": zero})
    for a, b, c in zip(fp32, bf16, low):
        assert all((x > 0) == (zero > 0) for x in a["gathered"]) and all(x > 0 for x in a["wired"]), a
        assert b["gathered"] == c["gathered"] == [x // 2 for x in a["gathered"]] and a["gathered"][0] % 2 == 0, (a, b)
        assert b["wired"] == a["wired"], (a, b)
        assert c["wired"] == [x // 2 for x in a["wired"]], (a, c)


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("net,param_dtype,reduce_dtype,steps,options", [
    ("gpt", "bfloat16", "float32", 4, {"clip": 0.5}),
    ("gpt", "bfloat16", None, 4, {}),  # FSDP2's default: the reduction in param_dtype
    ("gpt", None, "bfloat16", 4, {}),  # float32 compute, a bfloat16 reduction
    ("mlp", "float16", "float32", 6, {"scaler": True, "scale": 2.0 ** 21}),
    ("gpt", "float16", "float32", 4, {"scaler": True, "scale": 2.0 ** 21, "clip": 1.0}),
    ("gpt", "bfloat16", "float32", 3, {"no_sync": True, "reshard": False}),
    ("mlp", "bfloat16", "float32", 3, {"no_sync": True, "buff": 40}),
], ids=["clip", "reduce_in_bf16", "reduce_dtype_alone", "grad_scaler_fp16", "grad_scaler_fp16_clip",
        "no_sync_no_reshard", "no_sync_small_buckets"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf in an overflowed sum
@pytest.mark.unit
def test_policies_clipping_and_grad_scaler_equal_the_emulation_bitwise(net, param_dtype, reduce_dtype, steps,
                                                                       options, zero):
    if zero < 3:  # reshard_after_forward is zero=3's
        options = {k: v for k, v in options.items() if k != "reshard"}
    got = _bitwise("sim", net, param_dtype, reduce_dtype, steps, {**options, "zero": zero})
    if options.get("scaler"):
        scales = got[0]["scales"]
        assert {tuple(g["scales"]) for g in got} == {tuple(scales)}
        skipped = sum(1 for a, b in zip([options["scale"], *scales], scales) if b < a)
        assert 0 < skipped < steps, scales  # some steps overflowed in float16 and were skipped, others applied


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.unit
def test_overlapped_param_gather_equals_the_emulation_bitwise(zero):
    """``overlap_param_gather=True``: the ``param_dtype`` gathers left in flight until the next forward."""
    _bitwise("sim", "gpt", "bfloat16", "float32", 3, {"zero": zero, "overlap_gather": True})


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.unit
def test_checkpoint_holds_float32_masters_and_resumes_bitwise(tmp_path, zero):
    path = str(tmp_path / "ckpt.pt")
    straight = run_case("sim", 2, mp.case_resume, str(tmp_path / "straight.pt"), False, 0, 4, True, zero)
    first = run_case("sim", 2, mp.case_resume, path, False, 0, 2, True, zero)
    resumed = run_case("sim", 2, mp.case_resume, path, True, 2, 2, True, zero)
    for f in first:
        assert f["model_dtypes"] == ["torch.bool", "torch.float32"] and f["optimizer_dtypes"] == ["torch.float32"], f
    for s, r in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(s["params"], r["params"]))
    # the last checkpoint (mixed precision) into a float32 run, which saves it again: into a mixed-precision run
    for mixed in (False, True):
        for got in run_case("sim", 2, mp.case_resume, path, True, 4, 0, mixed, zero):
            assert all(torch.equal(a, b) for a, b in zip(resumed[0]["params"], got["loaded"])), mixed


@pytest.mark.unit
def test_checkpoint_of_one_stage_resumes_at_another_bitwise(tmp_path):
    """``distopt.save(model.state_dict(), opt)`` of a mixed-precision run at one stage loads at another: the float32
    masters and the optimizer's float32 state in torch's layout."""
    straight = run_case("sim", 2, mp.case_resume, str(tmp_path / "straight.pt"), False, 0, 4, True, 0)
    for saved, loaded in ((0, 2), (2, 1), (1, 3), (3, 0)):
        path = str(tmp_path / f"{saved}-{loaded}.pt")
        run_case("sim", 2, mp.case_resume, path, False, 0, 2, True, saved)
        for s, r in zip(straight, run_case("sim", 2, mp.case_resume, path, True, 2, 2, True, loaded)):
            assert all(torch.equal(a, b) for a, b in zip(s["params"], r["params"])), (saved, loaded)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.unit
def test_sharded_checkpoint_with_parameter_elements_resumes_bitwise(zero):
    straight = run_case("sim", 2, mp.case_sharded, None, 0, 4, zero)
    first = run_case("sim", 2, mp.case_sharded, None, 0, 2, zero)
    resumed = run_case("sim", 2, mp.case_sharded, [f["shard"] for f in first], 2, 2, zero)
    for s, r in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(s["params"], r["params"]))


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.unit
def test_summon_full_params_gathers_and_writes_the_float32_masters(zero):
    for got in run_case("sim", 2, mp.case_summon, zero):
        assert got["inside"] == ["torch.float32"] and got["out"] == "torch.bfloat16", got
        for a, b in zip(got["before"], got["after"]):
            assert torch.equal(a * 0.5, b)  # halved in float32, not rounded to bfloat16
        assert any(not torch.equal(a, a.bfloat16().float()) for a in got["before"])  # the masters need float32


def case_meta(rank: int, comm: Any, reference: Any, steps: int) -> list[Any]:
    """:func:`tests.sharding.test_meta_init.case_gpt`'s GPT, built on the meta device (``reference`` None) or copied,
    at ``zero=3`` with bfloat16/float32: the whole parameters after ``steps`` AdamW steps."""
    from tests.sharding.test_meta_init import CONTEXT, GPT, SEED, VOCAB

    torch.set_num_threads(1)
    if reference is None:
        torch.manual_seed(SEED)
        with torch.device("meta"):
            model = GPT()
    else:
        model = copy.deepcopy(reference)
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=3e-3), comm=comm, zero=3, buffSize=600,
                          model=model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for s in range(steps):
        tokens = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=torch.Generator().manual_seed(100 * s + rank))
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    with opt.summon_full_params():
        return [p.detach().clone() for p in model.parameters()]


@pytest.mark.unit
def test_meta_built_model_with_mixed_precision_equals_the_cpu_built_one():
    from tests.sharding.test_meta_init import GPT, SEED

    torch.manual_seed(SEED)
    reference = GPT()
    cpu = run_case("sim", 2, case_meta, reference, 3)
    meta = run_case("sim", 2, case_meta, None, 3)
    for c, m in zip(cpu, meta):
        assert all(torch.equal(a, b) for a, b in zip(c, m))
    assert any(not torch.equal(a, b) for a, b in zip(reference.parameters(), meta[0]))


@pytest.mark.parametrize("backend,zero", tiered([("torch", 3), ("mpi", 3), ("torch", 0), ("torch", 1), ("torch", 2)]))
def test_real_processes_equal_the_emulation_bitwise(backend, zero):
    for g in _bitwise(backend, "gpt", "bfloat16", "float32", 3, {"zero": zero}):
        assert g["seen"] == ["torch.bfloat16"]


def case_frozen(rank: int, comm: Any, zero: int) -> dict[str, Any]:
    """The MLP at ``zero`` with bfloat16 compute, its first parameter frozen from the start: two steps, then the
    second parameter frozen too and a third step (its error, or ``"ok"``)."""
    torch.set_num_threads(1)
    model = _model()
    frozen = next(model.parameters())
    original = frozen.detach().clone()
    frozen.requires_grad_(False)
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=1e-2), comm=comm, zero=zero, model=model,
                          buffSize=600, param_dtype=torch.bfloat16)
    out: dict[str, Any] = {"third": "ok"}
    for s in range(3):
        if s == 2:
            list(model.parameters())[1].requires_grad_(False)
            out["saved"] = next(iter(model.state_dict().values()))
        opt.zero_grad()
        try:
            model(torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * s + rank))).float().sum().backward()
            opt.step()
        except RuntimeError as exc:
            out["third"] = str(exc)
    out.update(original=original, rest=str(frozen.dtype))
    return out


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.unit
def test_frozen_parameters_keep_float32_masters_and_a_new_layout_raises_at_zero_1_2(zero):
    """A frozen parameter is a ``param_dtype`` copy too, its float32 master in ``model.state_dict()`` bitwise; a
    layout change (``requires_grad`` toggled) works at ``zero=0`` and raises at ``zero=1|2`` (the masters are
    this rank's pieces of the first layout), naming it, on every rank."""
    for got in run_case("sim", 2, case_frozen, zero):
        assert got["rest"] == "torch.bfloat16" and torch.equal(got["saved"], got["original"]), got
        if zero == 0:
            assert got["third"] == "ok", got["third"]
        else:
            assert "layout of DistOpt's construction" in got["third"] and "requires_grad changed" in got["third"]


@pytest.mark.unit
def test_bad_arguments_are_refused_naming_them():
    model = _model()

    def build(opt: Any = None, **kwargs: Any) -> Any:
        return distopt.DistOpt(opt or torch.optim.AdamW(model.parameters()), backend="single", model=model,
                               **{"zero": 3, **kwargs})

    for bad in (torch.int32, "bfloat16", torch.bool):
        with pytest.raises(ValueError, match=r"param_dtype must be a floating-point torch\.dtype"):
            build(param_dtype=bad)
    with pytest.raises(ValueError, match=r"reduce_dtype must be a floating-point torch\.dtype"):
        build(param_dtype=torch.bfloat16, reduce_dtype=torch.int64)
    for zero in (0, 1, 2):
        for bad in (torch.int32, torch.bool):
            with pytest.raises(ValueError, match=r"param_dtype must be a floating-point torch\.dtype"):
                build(zero=zero, param_dtype=bad)
        with pytest.raises(ValueError, match=r"reduce_dtype must be a floating-point torch\.dtype"):
            build(zero=zero, reduce_dtype="float32")
        with pytest.raises(ValueError, match=r"param_dtype=/reduce_dtype= .* need model=your_module"):
            distopt.DistOpt(torch.optim.AdamW(model.parameters()), backend="single", zero=zero,
                            param_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"need model=your_module, and gradient_as_bucket_view=False"):
            build(zero=min(zero, 1), reduce_dtype=torch.float32, gradient_as_bucket_view=True)
        fresh = _model()
        opt = distopt.DistOpt(torch.optim.AdamW(fresh.parameters()), backend="single", model=fresh, zero=zero,
                              param_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"add_param_group\(\) with param_dtype=/reduce_dtype="):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        opt.close()
    with pytest.raises(TypeError, match="param_dtype= and reduce_dtype= .* need a torch.optim.Optimizer"):
        distopt.DistOpt(distopt.SGD(lr=0.1), backend="single", param_dtype=torch.bfloat16)
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).double())
    for zero in ZEROS:
        with pytest.raises(ValueError, match=r"every trained parameter in one dtype.*float64"):
            distopt.DistOpt(torch.optim.AdamW(mixed.parameters()), backend="single", zero=zero, model=mixed,
                            param_dtype=torch.bfloat16)
