"""``SyncBatchNorm`` / ``convert_sync_batchnorm`` against one process's ``nn.BatchNorm*d`` over the concatenated batch.

Cases are ``fn(rank, comm, *args)`` (:mod:`tests.support.backends`): the fast ones in
the simulated world, the same on MPI, shm and torch.distributed (gloo) at
W = 2 and 3 with different per-rank batch sizes (one rank's may be 0).
``torch.nn.SyncBatchNorm`` itself cannot be the reference on this machine:
its forward raises ValueError for CPU tensors ("SyncBatchNorm expected input
tensor to be on GPU"), and ``torch.batch_norm_stats`` has no CPU kernel.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np
import pytest

from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

from distopt.errors import CollectiveMismatchError  # noqa: E402
from distopt.torch.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, has_sync_batchnorm  # noqa: E402

REAL = ["mpi", "shm", "torch"]
SPATIAL = {2: (), 3: (5,), 4: (3, 4), 5: (2, 3, 2)}  # (N, C), (N, C, L), (N, C, H, W), (N, C, D, H, W)
SIZES = {2: (3, 5), 3: (4, 0, 6)}  # per-rank batch sizes: different, one empty at W = 3
BN = {2: "BatchNorm1d", 3: "BatchNorm1d", 4: "BatchNorm2d", 5: "BatchNorm3d"}


def _data(ndim: int, sizes: tuple[int, ...], channels: int, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    """The global batch, output gradient, affine parameters and initial running statistics (NumPy: threads)."""
    rng = np.random.default_rng(seed)
    shape = (sum(sizes), channels, *SPATIAL[ndim])
    offset = rng.normal(size=(1, channels) + (1,) * (ndim - 2)) * 3
    return {"x": (rng.normal(size=shape) * 2 + offset).astype(dtype), "dy": rng.normal(size=shape).astype(dtype),
            "w": rng.uniform(0.5, 1.5, channels).astype(dtype), "b": rng.normal(size=channels).astype(dtype),
            "rm": rng.normal(size=channels).astype(dtype), "rv": rng.uniform(0.5, 2, channels).astype(dtype)}


def _run(layer: Any, d: dict[str, np.ndarray], lo: int, hi: int, steps: int) -> dict[str, np.ndarray]:
    """``steps`` training forwards and backwards of ``layer`` on rows ``lo:hi``; outputs, gradients, buffers."""
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(d["w"]))
        layer.bias.copy_(torch.from_numpy(d["b"]))
        layer.running_mean.copy_(torch.from_numpy(d["rm"]))
        layer.running_var.copy_(torch.from_numpy(d["rv"]))
    out: dict[str, np.ndarray] = {}
    for step in range(steps):
        x = torch.from_numpy(d["x"][lo:hi] * (1 + step)).requires_grad_(True)
        layer.weight.grad = layer.bias.grad = None
        y = layer(x)
        (y * torch.from_numpy(d["dy"][lo:hi])).sum().backward()
        out.update(y=y.detach().numpy().copy(), dx=x.grad.numpy().copy())
    out.update(dw=layer.weight.grad.numpy().copy(), db=layer.bias.grad.numpy().copy(),
               rm=layer.running_mean.numpy().copy(), rv=layer.running_var.numpy().copy(),
               nbt=layer.num_batches_tracked.numpy().copy())
    return out


def reference(ndim: int, sizes: tuple[int, ...], channels: int, dtype: str, momentum: float | None,
              steps: int) -> dict[str, np.ndarray]:
    """One process's ``nn.BatchNorm*d`` over the concatenated batch."""
    layer = getattr(torch.nn, BN[ndim])(channels, momentum=momentum, dtype=getattr(torch, dtype))
    return _run(layer, _data(ndim, sizes, channels, dtype), 0, sum(sizes), steps)


def case_layer(rank: int, comm: Any, ndim: int, sizes: tuple[int, ...], channels: int, dtype: str,
               momentum: float | None, steps: int, convert: bool) -> dict[str, np.ndarray]:
    """This rank's part of the batch through SyncBatchNorm (or a converted BatchNorm); grads also averaged."""
    torch.set_num_threads(1)
    if convert:
        layer = convert_sync_batchnorm(getattr(torch.nn, BN[ndim])(channels, momentum=momentum,
                                                                   dtype=getattr(torch, dtype)), comm=comm)
        assert isinstance(layer, SyncBatchNorm)
    else:
        layer = SyncBatchNorm(channels, momentum=momentum, comm=comm, dtype=getattr(torch, dtype))
    calls = getattr(comm, "calls", None)
    before = None if calls is None else len(calls)
    lo = sum(sizes[:rank])
    out = _run(layer, _data(ndim, sizes, channels, dtype), lo, lo + sizes[rank], steps)
    if calls is not None:  # the simulated world records its collectives: one forward, one backward per step
        assert calls[before:] == [("all_reduce", 2 * channels + 1), ("all_reduce", 2 * channels)] * steps, calls
    for name in ("dw", "db"):  # DDP/DistOpt semantics: the average of the per-rank gradients
        out[f"{name}_avg"] = comm.all_reduce(out[name].astype(np.float64), op="avg")
    return out


def case_all_inputs(rank: int, comm: Any, sizes: tuple[int, ...]) -> list[dict[str, np.ndarray]]:
    """Every input rank, float64 and float32, momentum 0.3 and None, plain and converted: one job per backend."""
    return [case_layer(rank, comm, ndim, sizes, channels, dtype, momentum, 2, convert)
            for ndim, channels, dtype, momentum, convert in _VARIANTS]


_VARIANTS = [(2, 3, "float64", 0.3, False), (3, 4, "float64", None, True), (4, 2, "float64", 0.3, True),
             (5, 3, "float64", 0.3, False), (4, 40, "float64", 0.1, False), (3, 4, "float32", 0.3, False)]


def _check(got: list[dict[str, np.ndarray]], ref: dict[str, np.ndarray], sizes: tuple[int, ...], dtype: str,
           what: str) -> None:
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == "float64" else {"rtol": 1e-5, "atol": 2e-5}
    world = len(sizes)
    for name in ("y", "dx"):
        np.testing.assert_allclose(np.concatenate([g[name] for g in got]), ref[name], err_msg=f"{what} {name}", **tol)
    for name in ("dw", "db"):
        np.testing.assert_allclose(sum(g[name].astype(np.float64) for g in got), ref[name], err_msg=f"{what} {name}",
                                   **tol)
        for r, g in enumerate(got):
            np.testing.assert_allclose(g[f"{name}_avg"] * world, ref[name], err_msg=f"{what} {name} averaged on "
                                       f"rank {r}", **tol)
    for name in ("rm", "rv", "nbt"):
        for r, g in enumerate(got):
            np.testing.assert_allclose(g[name], ref[name], err_msg=f"{what} {name} rank {r}", **tol)
            assert np.array_equal(g[name], got[0][name]), f"{what}: rank {r}'s {name} differs from rank 0's"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("ndim", [2, 3, 4, 5])
@pytest.mark.unit
def test_simulated_world_matches_batchnorm_over_the_concatenated_batch(world, ndim):
    sizes = SIZES[world]
    for channels, dtype, momentum, convert in ((3, "float64", 0.3, False), (2, "float64", None, True),
                                               (3, "float32", 0.1, False)):
        got = run_case("sim", world, case_layer, ndim, sizes, channels, dtype, momentum, 2, convert)
        _check(got, reference(ndim, sizes, channels, dtype, momentum, 2), sizes, dtype,
               f"sim W={world} {ndim}-D {dtype} momentum={momentum}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", REAL)
@pytest.mark.world
def test_real_processes_match_batchnorm_over_the_concatenated_batch(backend, world):
    sizes = SIZES[world]
    results = run_case(backend, world, case_all_inputs, sizes, timeout=180)
    for i, (ndim, channels, dtype, momentum, convert) in enumerate(_VARIANTS):
        _check([r[i] for r in results], reference(ndim, sizes, channels, dtype, momentum, 2), sizes, dtype,
               f"{backend} W={world} {ndim}-D C={channels} {dtype} momentum={momentum} convert={convert}")


def case_eval_and_errors(rank: int, comm: Any) -> dict[str, Any]:
    """Eval mode communicates nothing; bad inputs raise on every rank; different num_features: mismatch."""
    torch.set_num_threads(1)
    found: dict[str, Any] = {}
    layer = SyncBatchNorm(3, comm=comm)
    calls = getattr(comm, "calls", None)
    before = None if calls is None else len(calls)
    layer.eval()
    found["eval"] = layer(torch.ones(2 + rank, 3, 4)).detach().numpy()
    unsynced = SyncBatchNorm(3, comm=comm, track_running_stats=False).eval()
    found["eval_local"] = unsynced(torch.arange(6.0).reshape(2, 3) * (rank + 1)).detach().numpy()
    if calls is not None:
        assert len(calls) == before, calls[before:]
    layer.train()
    bad = torch.ones(4, 3, 2, 2, 2, 2) if rank == 0 else torch.ones(4, 3)  # 6-D on rank 0 only
    with pytest.raises(ValueError) as info:
        layer(bad)
    found["ndim"] = str(info.value)
    bad = torch.ones(4, 5) if rank == comm.size - 1 else torch.ones(4, 3)  # 5 channels on the last rank only
    with pytest.raises(ValueError) as info:
        layer(bad)
    found["channels"] = str(info.value)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        layer(torch.ones(1 if rank == 0 else 0, 3))
    with pytest.raises(CollectiveMismatchError) as info:
        SyncBatchNorm(3 + rank, comm=comm)(torch.ones(2, 3 + rank))
    found["mismatch"] = str(info.value)
    return found


@pytest.mark.parametrize("backend", tiered(["sim", *REAL]))
def test_eval_does_not_communicate_and_bad_inputs_fail_on_every_rank(backend):
    world = 3 if backend == "sim" else 2
    found = run_case(backend, world, case_eval_and_errors, timeout=120)
    for r, f in enumerate(found):
        np.testing.assert_allclose(f["eval"], np.full((2 + r, 3, 4), 1 / np.sqrt(1 + 1e-5)), rtol=1e-6)
        local = (torch.arange(6.0).reshape(2, 3) * (r + 1)).numpy()
        expect = (local - local.mean(0)) / np.sqrt(local.var(0) + 1e-5)
        np.testing.assert_allclose(f["eval_local"], expect, rtol=1e-5, atol=1e-6)
        assert ("expects a 2-D to 5-D input" if r == 0 else "another rank's input was unusable") in f["ndim"]
        assert ("expects 3 channels" if r == world - 1 else "another rank's input was unusable") in f["channels"]
        assert "SyncBatchNorm(" in f["mismatch"] and "DistOpt.join()" in f["mismatch"], f["mismatch"]


def _model(comm: Any) -> Any:
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3), torch.nn.BatchNorm1d(3))
    rng = np.random.default_rng(1)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.from_numpy(rng.normal(size=tuple(p.shape)) * 0.3))
    return net if comm is None else convert_sync_batchnorm(net, comm=comm)


def _batch(step: int, lo: int, hi: int) -> Any:
    rng = np.random.default_rng(100 + step)
    return torch.from_numpy(rng.normal(size=(9, 2, 4, 4)))[lo:hi]


def case_distopt_training(rank: int, comm: Any, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """DistOpt + a converted model: 3 SGD steps on per-rank slices of each global batch; the loss is the sum
    over this rank's samples times W / global batch, so the average gradient is that of the global mean."""
    import distopt

    torch.set_num_threads(1)
    model = convert_sync_batchnorm(_model(None), comm=comm).double()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), comm=comm, model=model,
                          abort_on_exception=False)
    lo = sum(sizes[:rank])
    for step in range(3):
        opt.zero_grad()
        (model(_batch(step, lo, lo + sizes[rank])).pow(2).sum() * len(sizes) / sum(sizes)).backward()
        opt.step()
    assert all(m.comm is comm for m in model.modules() if isinstance(m, SyncBatchNorm))
    return [t.detach().numpy().copy() for t in model.state_dict().values()]


@pytest.mark.parametrize("backend", tiered(["sim", "mpi"]))
def test_distopt_training_with_converted_model_equals_one_process(backend):
    sizes = (2, 0, 3)
    got = run_case(backend, 3, case_distopt_training, sizes, timeout=120)
    model = _model(None).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        sgd.zero_grad()
        (model(_batch(step, 0, sum(sizes))).pow(2).sum() / sum(sizes)).backward()
        sgd.step()
    for r, state in enumerate(got):
        for (name, ref), value in zip(model.state_dict().items(), state):
            np.testing.assert_allclose(value, ref.numpy(), rtol=1e-6, atol=1e-8, err_msg=f"rank {r} {name}")


def case_join(rank: int, comm: Any, with_model: bool) -> dict[str, Any]:
    """Rank 0 trains 3 batches, rank 1 one, inside join(): every rank must raise quickly, never hang."""
    import distopt

    torch.set_num_threads(1)
    model = _model(comm).double()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, abort_on_exception=False,
                          model=model if with_model else None)
    start = time.monotonic()
    try:
        with opt.join():
            for step in range(3 if rank == 0 else 1):
                opt.zero_grad()
                model(_batch(step, 4 * rank, 4 * rank + 4)).pow(2).sum().backward()
                opt.step()
    except Exception as exc:  # noqa: BLE001 (reported to the test)
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "mismatch": isinstance(exc, CollectiveMismatchError)}
    return {"type": None, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("backend", tiered(["sim", *REAL]))
def test_join_with_sync_batchnorm_fails_fast_on_every_rank(backend):
    for with_model in ((True, False) if backend == "sim" else (True,)):
        found = run_case(backend, 2, case_join, with_model, timeout=120)
        for r, f in enumerate(found):
            assert f["mismatch"], f"rank {r} did not raise CollectiveMismatchError: {f}"
            assert f["seconds"] < 15, f"rank {r} took {f['seconds']:.1f} s (a timeout, not a mismatch?)"
        assert "SyncBatchNorm(4) forward" in found[0]["message"] and "DistOpt.join()" in found[0]["message"]


@pytest.mark.unit
def test_convert_keeps_tensors_settings_and_requires_grad():
    net = torch.nn.Sequential(torch.nn.BatchNorm1d(3, eps=1e-3, momentum=None),
                              torch.nn.Sequential(torch.nn.BatchNorm3d(2, affine=False)),
                              torch.nn.BatchNorm2d(4, track_running_stats=False))
    net[0].weight.requires_grad_(False)
    net[2].eval()
    tensors = {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}
    converted = convert_sync_batchnorm(net)
    assert converted is net and has_sync_batchnorm(net) and not has_sync_batchnorm(torch.nn.Linear(2, 2))
    assert all(isinstance(m, SyncBatchNorm) for m in (net[0], net[1][0], net[2]))
    assert {n: t for n, t in [*net.named_parameters(), *net.named_buffers()]}.keys() == tensors.keys()
    for name, t in [*net.named_parameters(), *net.named_buffers()]:
        assert t is tensors[name], name
    assert net[0].weight.requires_grad is False and net[0].bias.requires_grad
    assert (net[0].eps, net[0].momentum, net[1][0].affine, net[2].track_running_stats) == (1e-3, None, False, False)
    assert net[0].training and not net[2].training
    assert isinstance(convert_sync_batchnorm(torch.nn.BatchNorm2d(5)), SyncBatchNorm)
    with pytest.raises(ValueError, match="not initialized"):
        convert_sync_batchnorm(torch.nn.LazyBatchNorm2d())


@pytest.mark.unit
def test_comm_sources_groups_copies_and_pickling():
    import copy

    from distopt.comm.groups import Group
    from distopt.comm.single import SingleCommunicator

    single = SingleCommunicator()
    with pytest.raises(ValueError, match="not both"):
        SyncBatchNorm(2, comm=single, group=Group((0,), "g", single, 1))
    outside = SyncBatchNorm(2, group=Group((1,), "odd", None, 2))
    outside.eval()
    outside(torch.ones(3, 2))  # eval mode never needs the communicator
    with pytest.raises(ValueError, match="not a member of process group 'odd'|not a member"):
        outside.train()(torch.ones(3, 2))
    layer = SyncBatchNorm(2, group=Group((0,), "g", single, 1))
    assert layer.comm is single
    x = torch.randn(5, 2, 3)
    ref = torch.nn.BatchNorm1d(2)
    torch.testing.assert_close(layer(x), ref(x))  # a world of one: plain batch norm
    assert copy.deepcopy(layer).comm is single
    restored = pickle.loads(pickle.dumps(layer))
    with pytest.raises(RuntimeError, match="set_comm"):
        restored(x)
    restored.set_comm(type("Holder", (), {"comm": single})())
    torch.testing.assert_close(restored.running_mean, layer.running_mean)
    restored(x)
    with pytest.raises(TypeError, match="Communicator"):
        SyncBatchNorm(2, comm=object())(x)
    with pytest.raises(ValueError, match="2-D to 5-D"):
        layer(torch.ones(4))


def case_variants(rank: int, comm: Any) -> dict[str, Any]:
    """An input without grad (no backward all-reduce), affine=False, frozen weight and bias."""
    d = _data(3, SIZES[2], 3, "float64")
    lo, hi = (0, 3) if rank == 0 else (3, 8)
    x, dy = torch.from_numpy(d["x"][lo:hi]), torch.from_numpy(d["dy"][lo:hi])
    out: dict[str, Any] = {}
    layer = SyncBatchNorm(3, comm=comm, dtype=torch.float64)
    before = len(comm.calls)
    (layer(x) * dy).sum().backward()
    out["no_grad_calls"] = comm.calls[before:]
    out["no_grad_dw"] = layer.weight.grad.numpy().copy()
    plain = SyncBatchNorm(3, affine=False, comm=comm, dtype=torch.float64)
    frozen = SyncBatchNorm(3, comm=comm, dtype=torch.float64).requires_grad_(False)
    for name, m in (("plain", plain), ("frozen", frozen)):
        xg = x.clone().requires_grad_(True)
        y = m(xg)
        (y * dy).sum().backward()
        out[name] = (y.detach().numpy(), xg.grad.numpy(), None if m.weight is None else m.weight.grad)
    return out


@pytest.mark.unit
def test_input_without_grad_affine_false_and_frozen_parameters():
    got = run_case("sim", 2, case_variants)
    d = _data(3, SIZES[2], 3, "float64")
    x, dy = torch.from_numpy(d["x"]), torch.from_numpy(d["dy"])
    for r, g in enumerate(got):
        assert g["no_grad_calls"] == [("all_reduce", 7)], g["no_grad_calls"]  # forward only
    ref = torch.nn.BatchNorm1d(3, dtype=torch.float64)
    (ref(x) * dy).sum().backward()
    np.testing.assert_allclose(got[0]["no_grad_dw"] + got[1]["no_grad_dw"], ref.weight.grad.numpy(), rtol=1e-6)
    for name, affine in (("plain", False), ("frozen", True)):
        ref = torch.nn.BatchNorm1d(3, affine=affine, dtype=torch.float64)
        xg = x.clone().requires_grad_(True)
        y = ref(xg)
        (y * dy).sum().backward()
        np.testing.assert_allclose(np.concatenate([g[name][0] for g in got]), y.detach().numpy(), rtol=1e-6,
                                   atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.concatenate([g[name][1] for g in got]), xg.grad.numpy(), rtol=1e-6,
                                   atol=1e-6, err_msg=name)
        assert all(g[name][2] is None for g in got), name


@pytest.mark.unit
def test_default_comm_is_the_current_world_else_init(monkeypatch):
    from distopt.comm.single import SingleCommunicator
    from distopt.launch import world

    single = SingleCommunicator()
    monkeypatch.setattr(world, "_current", world.World(single, None))
    layer = SyncBatchNorm(2)
    layer(torch.randn(4, 2))
    assert layer.comm is single
    other = SingleCommunicator()
    monkeypatch.setattr(world, "_current", None)
    monkeypatch.setattr(world, "init", lambda: world.World(other, None))
    fresh = SyncBatchNorm(2)
    assert fresh.comm is other
    assert SyncBatchNorm(2, comm=world.World(single, None)).comm is single  # anything with .comm
