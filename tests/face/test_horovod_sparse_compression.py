"""The raw sparse all-reduce, the tensor compressors and ``set_backward_passes_per_step``: Horovod's tests, one-process
references, bad input.

Horovod's ``test_async_sparse_allreduce`` (and ``_process_sets``) and ``test_compression_fp16`` (horovod/horovod
``test/parallel/test_torch.py``) with the same inputs and assertions, in distopt's names:
``hvd.sparse_allreduce_async(t, name, op=hvd.Average)`` is ``opt.sparse_all_reduce(t, op="avg", async_op=True)``
(``handle()`` is ``handle.wait()``), ``hvd.allreduce(t)`` (Horovod's default, Average) is ``opt.all_reduce(t,
op="avg")``, ``hvd.Compression.fp16`` is ``distopt.Compression.fp16``; ``torch.rand``'s per-process stream is a
generator seeded by the rank (the simulated ranks are threads of one process). ``set_backward_passes_per_step``
(Horovod's ``DistributedOptimizer`` method, which Horovod's torch tests do not exercise) is tested against NumPy and
torch references. Worlds: the simulated world (W = 1, 2, 3, 4), MPI (W = 2, 4), shm and torch.distributed (W = 2), on
the run-long worker pools, each case under a hard timeout.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

import distopt
from distopt.comm.groups import split
from distopt.errors import CollectiveMismatchError
from distopt.strategies import Half
from tests.support.sim_split import sim_can_split  # noqa: F401 (autouse: simulated ranks split)
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

WORLDS = tiered([("sim", 1), ("sim", 2), ("sim", 3), ("sim", 4), ("mpi", 2), ("mpi", 4), ("shm", 2), ("torch", 2)])
MULTI = [p for p in WORLDS if p.values[1] > 1]




def _opt(comm, **kw):
    return distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, abort_on_exception=False, **kw)


def _attempt(fn) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except (TypeError, ValueError, RuntimeError, CollectiveMismatchError) as exc:
        return (type(exc).__name__, str(exc))


# ------------------------------------------------------------------ the sparse all-reduce
def case_async_sparse_allreduce(rank: int, comm) -> int:
    """test_async_sparse_allreduce and _process_sets (on torch.distributed a group's collectives are blocking: its
    async collectives need a group of a group, which torch's backend does not make)."""
    opt, size, checks = _opt(comm), comm.size, 0
    gen = torch.Generator().manual_seed(rank)

    def random_sparse_tensor(*shape):
        t = torch.rand(*shape, generator=gen)
        t[t < 0.8] = 0
        return t.to_sparse()

    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    groups = [split(comm, evens, name="even"), split(comm, odds, name="odd")] if size > 1 else []
    for group in [None] + [g for g in groups if g.is_member]:  # Horovod's _process_sets skips one worker
        tensor_sizes = [17, 32, 81, 12, 15, 23, 22] * 5
        tensors = [random_sparse_tensor(d0, 10) for d0 in tensor_sizes]
        allreduced_tensors = [opt.all_reduce(t.to_dense(), op="avg", group=group) for t in tensors]
        handles = [opt.sparse_all_reduce(t, op="avg", group=group, async_op=group is None or comm.name != "torch")
                   for t in tensors]
        handles = [h if isinstance(h, distopt.CollectiveHandle) else types.SimpleNamespace(wait=lambda h=h: h)
                   for h in handles]
        allgathered_tensors = [handle.wait() for handle in handles]
        for reduced, gathered in zip(allreduced_tensors, allgathered_tensors):
            assert torch.allclose(reduced, gathered.to_dense(), 1e-6)
        checks += 1
    for group in groups:
        group.close()
    opt.close()
    return checks


def _sparse_inputs(rank: int, w: int) -> list:
    """Rank ``rank``'s sparse tensors: float64 (uncoalesced, repeated indices), hybrid float16 (sparse_dim 1), int64
    with no entry on rank 0, and a complex one."""
    rng = np.random.default_rng(700 + rank)
    idx = rng.integers(0, 6, (2, 5 + rank))
    out = [torch.sparse_coo_tensor(torch.tensor(idx), torch.tensor(rng.standard_normal(5 + rank)), (6, 6),
                               check_invariants=True)]
    rows = rng.choice(8, 3, replace=False)
    out.append(torch.sparse_coo_tensor(torch.tensor(rows).reshape(1, -1),
                                       torch.tensor(rng.integers(-4, 5, (3, 2, 2)), dtype=torch.float16), (8, 2, 2),
                                       check_invariants=True))
    nnz = 0 if rank == 0 else rank + 1
    out.append(torch.sparse_coo_tensor(torch.tensor(rng.integers(0, 4, (1, nnz))),
                                       torch.tensor(rng.integers(-9, 9, nnz)), (4,), check_invariants=True))
    out.append(torch.sparse_coo_tensor(torch.tensor(rng.integers(0, 3, (2, 2))),
                                       torch.tensor(rng.standard_normal(2) + 1j * rng.standard_normal(2)), (3, 3),
                                       check_invariants=True))
    return out


def case_sparse_reference(rank: int, comm) -> list:
    """sum and avg of :func:`_sparse_inputs` (int64: sum only); each result's indices, values, size, coalesced flag."""
    opt = _opt(comm)
    out = []
    for op in ("sum", "avg"):
        for t in _sparse_inputs(rank, comm.size):
            if op == "avg" and not t.is_floating_point() and not t.is_complex():
                continue
            r = opt.sparse_all_reduce(t, op=op)
            out.append((op, r._indices().numpy(), r._values().numpy(), tuple(r.shape), r.is_coalesced(),
                        t.is_coalesced()))
    opt.close()
    return out


def _check_sparse_reference(results: list, w: int) -> None:
    """Bitwise: every rank's entries concatenated in rank order (values / W in their dtype for avg), not coalesced;
    the coalesced result is the dense sum (float64 to 1e-12)."""
    inputs = [_sparse_inputs(r, w) for r in range(w)]
    expect = []
    for op in ("sum", "avg"):
        for k, t in enumerate(inputs[0]):
            if op == "avg" and not t.is_floating_point() and not t.is_complex():
                continue
            idx = np.concatenate([ins[k]._indices().numpy() for ins in inputs], axis=1)
            vals = torch.cat([ins[k]._values() for ins in inputs])
            expect.append((op, idx, (vals / w if op == "avg" else vals).numpy(), tuple(t.shape), k))
    for res in results:
        assert len(res) == len(expect) == 7
        for (op, idx, vals, shape, k), (got_op, got_idx, got_vals, got_shape, coalesced, _) in zip(expect, res):
            assert got_op == op and got_shape == shape and (not coalesced or len(vals) < 2)  # torch: nnz < 2 is
            assert got_idx.dtype == np.int64 and got_vals.dtype == vals.dtype
            np.testing.assert_array_equal(got_idx, idx)
            np.testing.assert_array_equal(got_vals, vals)
            dense = sum(ins[k].to_dense().to(torch.complex128 if ins[k].is_complex() else torch.float64)
                        for ins in inputs) / (w if op == "avg" else 1)
            got = torch.sparse_coo_tensor(torch.tensor(got_idx), torch.tensor(got_vals), shape, check_invariants=True)
            got = got.coalesce().to_dense()
            tol = 1e-12 if got_vals.dtype != np.float16 else 1e-3
            np.testing.assert_allclose(got.numpy().astype(dense.numpy().dtype), dense.numpy(), rtol=tol, atol=tol)


def case_sparse_errors(rank: int, comm) -> list:
    opt, size = _opt(comm), comm.size
    sparse = torch.ones(4, 2).to_sparse()
    out = [_attempt(lambda: opt.sparse_all_reduce(torch.ones(4, 2) if rank == size - 1 else sparse)),
           _attempt(lambda: opt.sparse_all_reduce(torch.ones(4, dtype=torch.int32).to_sparse(), op="avg")),
           _attempt(lambda: opt.sparse_all_reduce(torch.ones(4 + rank, 2).to_sparse())),
           _attempt(lambda: opt.sparse_all_reduce(sparse, op="max" if rank == 0 else "sum")),
           _attempt(lambda: opt.sparse_all_reduce(sparse.double() if rank == 0 else sparse)),
           _attempt(lambda: opt.sparse_all_reduce(torch.ones(4, 2).to_sparse(1 + (rank == 0)))),
           _attempt(lambda: opt.sparse_all_reduce(np.ones(3), async_op=True).wait())]
    out.append(("sum", opt.sparse_all_reduce(sparse).coalesce().to_dense().tolist()))
    opt.close()
    return out


def _check_sparse_errors(results: list, w: int) -> None:
    want = [("TypeError", f"sparse_all_reduce on rank {w - 1}: tensor must be a torch sparse COO tensor, got layout "
                          "torch.strided (a dense tensor: use all_reduce)"),
            ("TypeError", "sparse_all_reduce on rank 0: op='avg' divides floating-point values, got dtype torch.int32"),
            ("CollectiveMismatchError", "sparse_all_reduce: size differs across ranks (rank 0: [4, 2], rank 1: [5, 2]"),
            ("ValueError", "sparse_all_reduce on rank 0: op must be one of ('sum', 'avg'), got 'max'"),
            ("CollectiveMismatchError", "sparse_all_reduce: dtype differs across ranks (rank 0: torch.float64, "),
            ("CollectiveMismatchError", "sparse_all_reduce: sparse_dim differs across ranks (rank 0: 2, rank"),
            ("TypeError", "sparse_all_reduce on rank 0: tensor must be a torch sparse COO tensor, got ndarray")]
    for res in results:
        assert len(res) == len(want) + 1
        for (kind, text), got in zip(want, res):
            assert got[0] == kind and got[1].startswith(text), got
        assert res[-1] == ("sum", [[float(w)] * 2] * 4)
    assert all(res == results[0] for res in results)


# ------------------------------------------------------------------ compression (local)
@pytest.mark.unit
def test_compression_fp16():
    """Horovod's test_compression_fp16, with distopt.Compression.fp16."""
    valid_dtypes = [torch.float32, torch.float64]
    invalid_dtypes = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    tensor_size = [5] * 3
    compression = distopt.Compression.fp16
    for dtype in valid_dtypes:
        tensor = torch.ones(tensor_size, dtype=dtype)
        tensor_compressed, ctx = compression.compress(tensor)
        assert tensor_compressed.dtype == torch.float16
        tensor_decompressed = compression.decompress(tensor_compressed, ctx)
        assert tensor_decompressed.dtype == dtype
        expected = np.ones(tensor_size)
        err = np.linalg.norm(expected - tensor_decompressed.data.numpy())
        assert err < 0.00000001
    for dtype in invalid_dtypes:
        tensor = torch.ones(tensor_size, dtype=dtype)
        tensor_compressed, ctx = compression.compress(tensor)
        assert tensor_compressed.dtype == dtype
        tensor_decompressed = compression.decompress(tensor_compressed, ctx)
        assert tensor_decompressed.dtype == dtype
        if dtype != torch.int8:  # Cannot cast to NumPy with a CharTensor
            expected = np.ones(tensor_size)
            err = np.linalg.norm(expected - tensor_decompressed.data.numpy())
            assert err < 0.00000001


@pytest.mark.unit
def test_compressors_against_casts_bitwise():
    """fp16 is the round-to-nearest cast and back (torch and NumPy, bitwise); none returns the object itself; bool and
    complex pass through fp16 unchanged."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000) * np.logspace(-9, 6, 1000)  # float16 subnormals, rounding and inf
    for tensor in (torch.tensor(x), torch.tensor(x, dtype=torch.float32), x, x.astype(np.float32)):
        small, ctx = distopt.Compression.fp16.compress(tensor)
        back = distopt.Compression.fp16.decompress(small, ctx)
        with np.errstate(over="ignore"):
            want = np.asarray(tensor).astype(np.float16)
        np.testing.assert_array_equal(np.asarray(small), want)
        np.testing.assert_array_equal(np.asarray(back), want.astype(np.asarray(tensor).dtype))
        assert back.dtype == tensor.dtype and type(back) is type(tensor)
        assert distopt.Compression.none.compress(tensor) == (tensor, None)
        assert distopt.Compression.none.decompress(tensor, None) is tensor
    for tensor in (torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.complex64), np.ones(3, np.int16)):
        small, ctx = distopt.Compression.fp16.compress(tensor)
        assert small is tensor and distopt.Compression.fp16.decompress(small, ctx) is tensor


def case_compression_strategy(rank: int, comm) -> dict:
    """``compression=Compression.fp16`` steps as ``strategy=Half()``; none as the default; the bad combinations."""
    out = {}
    for name, kw in (("fp16", {"compression": distopt.Compression.fp16}), ("half", {"strategy": Half()}),
                     ("none", {"compression": distopt.Compression.none()}), ("dense", {})):
        params = [np.linspace(-1, 1, 7), np.ones((3, 2))]
        opt = _opt(comm, **kw)
        opt.step(params, [np.full(7, 0.1 * (rank + 1)) ** 3, np.full((3, 2), rank / 3)])
        out[name] = (type(opt.strategy).__name__, opt.strategy.settings(), [p.copy() for p in params])
        opt.close()
    out["errors"] = [_attempt(lambda: _opt(comm, compression=distopt.Compression.fp16, strategy=Half())),
                     _attempt(lambda: _opt(comm, compression=object())),
                     _attempt(lambda: _opt(comm, compression="fp16"))]
    return out


# ------------------------------------------------------------------ set_backward_passes_per_step
def _micro(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng([900, rank, step]).standard_normal(4)


def case_passes_arrays(rank: int, comm) -> dict:
    """An array model: 1 pass, then 3 (the mean of 3 micro-batches), then 1 again; the bad calls in between."""
    opt, params = _opt(comm), [np.zeros(4)]
    out = {"default": opt.backward_passes_per_step, "after": []}
    for passes, micro in ((1, 1), (3, 3), (1, 2)):
        opt.set_backward_passes_per_step(passes)
        out.setdefault("read", []).append(opt.backward_passes_per_step)
        for _ in range(micro):
            opt.step(params, [_micro(rank, len(out["after"]))])
            out["after"].append(params[0].copy())
        if passes == 3:
            opt.step(params, [_micro(rank, 99)])  # one held micro-batch
            out["held"] = _attempt(lambda: opt.set_backward_passes_per_step(2))
            opt.discard_accumulation()
    out["errors"] = [_attempt(lambda: opt.set_backward_passes_per_step(0 if rank == 0 else 2)),
                     _attempt(lambda: opt.set_backward_passes_per_step(2.0)),
                     _attempt(lambda: opt.set_backward_passes_per_step(True)),
                     _attempt(lambda: opt.set_backward_passes_per_step(2 + rank))]
    out["final"] = opt.backward_passes_per_step
    opt.close()
    return out


def _check_passes_arrays(results: list, w: int) -> None:
    def mean(k: int) -> np.ndarray:  # the average over ranks of micro-batch k
        return np.mean([_micro(r, k) for r in range(w)], axis=0)

    p0 = -0.1 * mean(0)
    p1 = p0 - 0.1 * np.mean([mean(k) for k in (1, 2, 3)], axis=0)  # micro-batches 1 and 2 only accumulated
    p2 = p1 - 0.1 * mean(4)
    want = [p0, p0, p0, p1, p2, p2 - 0.1 * mean(5)]
    for rank, res in enumerate(results):
        assert res["default"] == 1 and res["read"] == [1, 3, 1] and res["final"] == 1
        for got, exp in zip(res["after"], want):
            np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-14)
        assert res["held"][0] == "RuntimeError" and res["held"][1].startswith(
            "set_backward_passes_per_step on rank 0: 1 backward pass(es) are accumulated and not averaged yet")
        kinds = [e[0] for e in res["errors"]]
        assert kinds == ["ValueError", "TypeError", "TypeError", "CollectiveMismatchError"], res["errors"]
        assert res["errors"][0][1] == ("set_backward_passes_per_step on rank 0: passes must be >= 1 (backward passes "
                                       "per update), got 0")
        assert "passes differs across ranks (rank 0: 2, rank 1: 3" in res["errors"][3][1]
    assert all(res["errors"] == results[0]["errors"] for res in results)


def case_passes_torch(rank: int, comm) -> dict:
    """A torch model: 2 backward passes per update after the setter (the held pass refuses a change), then 1."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False).double()
    opt = distopt.DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, abort_on_exception=False)
    out = {"read": [opt.backward_passes_per_step], "grads": []}
    opt.set_backward_passes_per_step(2)
    out["read"].append(opt.backward_passes_per_step)
    opt.zero_grad()
    for k in range(2):
        model(torch.tensor(_micro(rank, k)).reshape(1, 4)).sum().backward()
        out["grads"].append(model.weight.grad.clone().numpy())
        if k == 0:
            out["held"] = _attempt(lambda: opt.set_backward_passes_per_step(1))
    opt.step()
    opt.set_backward_passes_per_step(1)
    opt.zero_grad()
    model(torch.tensor(_micro(rank, 2)).reshape(1, 4)).sum().backward()
    out["grads"].append(model.weight.grad.clone().numpy())
    out["read"].append(opt.backward_passes_per_step)
    opt.close()
    return out


def _check_passes_torch(results: list, w: int) -> None:
    for rank, res in enumerate(results):
        assert res["read"] == [1, 2, 1]
        np.testing.assert_array_equal(res["grads"][0][0], _micro(rank, 0))  # held locally, not averaged
        both = np.mean([_micro(r, 0) + _micro(r, 1) for r in range(w)], axis=0)
        np.testing.assert_allclose(res["grads"][1][0], both, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(res["grads"][2][0], np.mean([_micro(r, 2) for r in range(w)], axis=0),
                                   rtol=1e-12, atol=1e-14)
        assert res["held"][0] == "RuntimeError" and "1 backward pass(es) are accumulated" in res["held"][1]


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_async_sparse_allreduce(backend, world):
    assert run_case(backend, world, case_async_sparse_allreduce, timeout=180) == [1 + (world > 1)] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_sparse_all_reduce_against_one_process_reference(backend, world):
    _check_sparse_reference(run_case(backend, world, case_sparse_reference, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), MULTI)
def test_sparse_all_reduce_bad_input_raises_on_every_rank(backend, world):
    _check_sparse_errors(run_case(backend, world, case_sparse_errors, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), [p for p in WORLDS if p.values[1] in (1, 2)])
def test_compression_maps_onto_the_half_strategy(backend, world):
    for res in run_case(backend, world, case_compression_strategy, timeout=120):
        assert res["fp16"][:2] == res["half"][:2] == ("Half", {"wire": "float16", "predivide": None, "clip": None})
        assert res["none"][0] == res["dense"][0] == "Dense"
        for a, b in ((res["fp16"][2], res["half"][2]), (res["none"][2], res["dense"][2])):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)  # bitwise the strategy it stands for
        assert res["errors"][0][0] == "ValueError" and "is strategy=Half()" in res["errors"][0][1]
        assert res["errors"][1][0] == res["errors"][2][0] == "TypeError"
        assert res["errors"][2][1].startswith("compression must be distopt.Compression.none or "
                                              "distopt.Compression.fp16, got str")


@pytest.mark.parametrize(("backend", "world"), MULTI)
def test_set_backward_passes_per_step_array_model(backend, world):
    _check_passes_arrays(run_case(backend, world, case_passes_arrays, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_set_backward_passes_per_step_torch_model(backend, world):
    _check_passes_torch(run_case(backend, world, case_passes_torch, timeout=120), world)
