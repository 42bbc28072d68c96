"""Where DDP scripts meet distopt's features (issue 30): GradScaler with check_finite (H70), join() with a
per-step LR scheduler (H72), sparse embeddings with SGD momentum (H75), ``convert_sync_batchnorm`` on a
BatchNorm subclass with its own forward, ``model.no_sync``, ``distopt.autograd`` after ``import distopt``,
and no deprecation or NumPy warnings from distopt's own calls.

The cases are in :mod:`tests.support.ddp_seam_cases`; each runs in the simulated world (``unit``) and on
MPI, shm and torch.distributed (``world``).
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from tests.support import ddp_seam_cases as cases
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

import distopt  # noqa: E402

BACKENDS = tiered(["sim", "mpi", "shm", "torch"])


def _same(a: list, b: list, what: str) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"{what}: tensor {i} differs"


# ----------------------------------------------------------------------------------------------- H70
@pytest.mark.parametrize("backend", BACKENDS)
def test_h70_grad_scaler_with_an_inf_on_one_rank_skips_alike_at_every_zero_stage(backend):
    """Both bad steps skipped on every rank, the scale halved alike, zero=1/2 bitwise zero=0, with and without
    check_finite (a check_finite skip leaves NaN in .grad, so GradScaler records the inf)."""
    results = {(zero, cf): run_case(backend, 2, cases.case_h70_scaler, zero, cf)
               for zero in (0, 1, 2) for cf in (False, True)}
    for (zero, cf), got in results.items():
        for r, res in enumerate(got):
            assert "error" not in res, (zero, cf, r, res)
            assert res["scales"] == [1024.0, 512.0, 256.0, 256.0], (zero, cf, r, res["scales"])
            _same(res["params"][1], res["params"][0], f"zero={zero} check_finite={cf} rank {r}: step 1 applied")
            _same(res["params"][2], res["params"][0], f"zero={zero} check_finite={cf} rank {r}: step 2 applied")
            assert not np.array_equal(res["params"][3][0], res["params"][0][0])  # step 3 is applied
            _same(res["params"][3], got[0]["params"][3], f"zero={zero} check_finite={cf}: rank {r} differs")
            _same(res["params"][3], results[(0, cf)][r]["params"][3], f"zero={zero} check_finite={cf} vs zero=0")
            _same(res["params"][3], results[(zero, False)][r]["params"][3], f"zero={zero}: check_finite on/off")


@pytest.mark.unit
def test_h70_check_finite_skip_leaves_nan_gradients_until_step_or_zero_grad():
    def rank_fn(rank, comm):
        p = torch.zeros(3, requires_grad=True)
        opt = distopt.DistOpt(torch.optim.SGD([p], lr=1.0), comm=comm, check_finite=True)
        (p * torch.tensor([float("inf") if rank else 1.0, 1.0, 1.0])).sum().backward()
        nan = bool(torch.isnan(p.grad).all())
        opt.step()
        after_step = p.grad
        (p * 2).sum().backward()  # not skipped: the average lands as before
        grad = p.grad.clone()
        opt.zero_grad()
        return nan, after_step, p.detach().clone(), grad, opt.stats["skipped_steps"]

    for nan, after_step, p, grad, skipped in run_case("sim", 2, rank_fn):
        assert nan and after_step is None and skipped == 1
        assert torch.equal(p, torch.zeros(3)) and torch.equal(grad, torch.full((3,), 2.0))


# ----------------------------------------------------------------------------------------------- H72
@pytest.mark.parametrize("backend", BACKENDS)
def test_h72_join_with_a_per_step_lr_scheduler(backend):
    """No error; zero=1/2 equal zero=0; identical parameters and buffers on every rank (the joined ranks'
    shadow steps update with the stepping ranks' learning rate, not their own frozen one)."""
    world = 3 if backend == "sim" else 2
    ref = run_case(backend, world, cases.case_h72_join_scheduler, 0)
    for zero in (0, 1, 2):
        got = ref if zero == 0 else run_case(backend, world, cases.case_h72_join_scheduler, zero)
        for r, res in enumerate(got):
            assert "error" not in res, (zero, r, res)
            assert res["lr"] == pytest.approx(1e-2 * 0.7 ** (2 + 2 * r))  # each rank's own scheduler
            _same(res["params"] + res["buffers"], got[0]["params"] + got[0]["buffers"], f"zero={zero}: rank {r}")
            for a, b in zip(res["params"], ref[r]["params"]):
                if world <= 2:
                    assert np.array_equal(a, b), f"zero={zero} differs from zero=0"
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_h72_shadow_rank_updates_with_the_stepping_ranks_settings():
    """A joined rank with another (frozen) lr applies the stepping rank's update: p moves by the stepping
    rank's lr times the average gradient, and the joined rank's own lr is kept."""
    def rank_fn(rank, comm):
        p = torch.zeros(2, requires_grad=True)
        opt = distopt.DistOpt(torch.optim.SGD([p], lr=1.0), comm=comm)
        with opt.join():
            if rank == 0:
                for lr in (0.5, 0.25):
                    opt.param_groups[0]["lr"] = lr
                    opt.zero_grad()
                    (p * torch.tensor([2.0, 4.0])).sum().backward()
                    opt.step()
        return p.detach().clone(), opt.param_groups[0]["lr"]

    (p0, lr0), (p1, lr1) = run_case("sim", 2, rank_fn)
    want = -(0.5 + 0.25) * torch.tensor([1.0, 2.0])  # the sum divided by the world size
    assert torch.equal(p0, want) and torch.equal(p1, want)
    assert (lr0, lr1) == (0.25, 1.0)


@pytest.mark.unit
def test_h72_differing_settings_among_stepping_ranks_still_raise():
    def rank_fn(rank, comm):
        p = torch.zeros(2, requires_grad=True)
        opt = distopt.DistOpt(torch.optim.SGD([p], lr=1.0 + rank), comm=comm)
        try:
            p.sum().backward()  # the average runs at the end of backward
            opt.step()
        except distopt.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    for text in run_case("sim", 2, rank_fn):
        assert "param_groups[0]['lr']" in text, text


# ----------------------------------------------------------------------------------------------- H75
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_h75_sparse_embeddings_with_sgd_momentum(backend, sparse_as_dense):
    """Within 2e-6 of one process on the concatenated batches, padding row 0, identical replicas, no
    exception (the statistics, optimizer_state_bytes of sparse momentum buffers, included)."""
    worlds = (2, 3) if backend == "sim" else (2,)
    for world in worlds:
        ref = cases.reference_h75(world)
        got = run_case(backend, world, cases.case_h75_sparse_momentum, sparse_as_dense)
        for r, res in enumerate(got):
            for i, (a, b) in enumerate(zip(res["params"], ref)):
                np.testing.assert_allclose(a, b, rtol=0, atol=2e-6, err_msg=f"W={world} rank {r} parameter {i}")
            assert not res["params"][0][0].any(), "the padding row moved"
            _same(res["params"], got[0]["params"], f"W={world}: rank {r}")
            assert all(b > 0 for b in res["state_bytes"]), res["state_bytes"]


# ------------------------------------------------------------------------------ BatchNorm subclasses
@pytest.mark.unit
def test_converted_batchnorm_act_keeps_its_forward_in_eval_and_copies():
    ref = cases.bn_act_model()
    conv = distopt.convert_sync_batchnorm(cases.bn_act_model())
    layer = conv[1]
    assert type(layer).__name__ == "SyncBatchNormAct2d" and isinstance(layer, cases.BatchNormAct2d)
    assert isinstance(layer.act, torch.nn.ReLU)
    ref.eval()
    conv.eval()
    x = cases.bn_act_batch(0, 6)
    assert torch.equal(conv(x), ref(x))
    assert (layer(conv[0](x)) >= 0).all() and (conv[0](x) < 0).any()  # the activation runs
    for copied in (copy.deepcopy(conv), pickle.loads(pickle.dumps(conv))):
        assert type(copied[1]) is type(layer) and torch.equal(copied(x), ref(x))
    assert distopt.convert_sync_batchnorm(conv) is conv and type(conv[1]) is type(layer)  # converted once


@pytest.mark.parametrize("backend", BACKENDS)
def test_converted_batchnorm_act_trained_equals_one_process_on_the_concatenated_batch(backend):
    sizes = (3, 5)
    ref = cases.reference_bn_act(sizes)
    for r, res in enumerate(run_case(backend, 2, cases.case_bn_act, sizes)):
        assert res["class"] == "SyncBatchNormAct2d"
        for name in ("params", "buffers"):
            for a, b in zip(res[name], ref[name]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"rank {r} {name}")
        np.testing.assert_allclose(res["eval"], ref["eval"], rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_batchnorm_subclass_without_a_batch_norm_call_raises_naming_the_class():
    for text in run_case("sim", 2, cases.case_bn_without_batch_norm_call):
        assert "HandMadeNorm" in text and "F.batch_norm" not in text and "batch_norm" in text, text


# ------------------------------------------------------------------------------------------ habits
@pytest.mark.parametrize("backend", tiered(["sim", "shm"]))
def test_model_no_sync_is_opt_no_sync_with_model(backend):
    """timm's ``hasattr(model, "no_sync")``: the first micro-batch stays local, the update is the average of
    the summed micro-batches; ``opt.close()`` takes the attribute away."""
    ref = cases.reference_no_sync(2)
    for r, res in enumerate(run_case(backend, 2, cases.case_model_no_sync)):
        assert res["found"] and not res["after_close"]
        for a, b in zip(res["first"], cases.local_grads(r)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(res["params"], ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_a_model_with_its_own_no_sync_keeps_it():
    def rank_fn(rank, comm):  # noqa: ARG001
        model = torch.nn.Linear(2, 1)
        own = object()
        model.no_sync = own
        distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, model=model)
        plain = torch.nn.Linear(2, 1)
        opt = distopt.DistOpt(torch.optim.SGD(plain.parameters(), lr=0.1), comm=comm, model=plain)
        return model.no_sync is own, copy.deepcopy(plain).no_sync is plain.no_sync, type(plain).__dict__.get("no_sync"), \
            callable(pickle.loads(pickle.dumps(plain)).no_sync), opt is not None

    for kept, shared, on_class, stand_in, _ in run_case("sim", 2, rank_fn):
        assert kept and shared and on_class is None and stand_in


@pytest.mark.unit
def test_import_distopt_reaches_distopt_autograd():
    import sys

    assert distopt.__getattr__("autograd") is sys.modules["distopt.autograd"]
    assert callable(distopt.autograd.all_reduce)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_deprecation_or_numpy_warnings_from_distopt_calls(backend):
    for zero in (0, 1, 2):
        for r, seen in enumerate(run_case(backend, 2, cases.case_no_warnings, zero)):
            assert not seen, f"zero={zero} rank {r}: {seen}"
