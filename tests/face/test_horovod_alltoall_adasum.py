"""Horovod's tests of ``alltoall`` (uneven splits, gradients), ``reducescatter``'s gradient and Adasum, against distopt.

Rewritten from horovod/horovod ``test/parallel/test_torch.py`` (``test_horovod_alltoall*``,
``test_horovod_reducescatter_grad*``, ``test_horovod_reducescatter_adasum``) and
``test/parallel/test_adasum_pytorch.py`` (orthogonal, parallel, stability), with the same inputs and assertions in
distopt's names: ``hvd.alltoall(t, splits)`` is ``opt.all_to_all(t, splits)``, ``hvd.allreduce(t, op=hvd.Adasum)`` is
``opt.all_reduce(t, op="adasum")``, process sets are :func:`distopt.comm.groups.split` groups, the differentiable
forms are ``distopt.autograd``'s, NumPy's and torch's global seeds are per-rank generators. Two deliberate
differences: a reduce-scatter's gradient is distopt's (the gradient of the sum of every rank's loss: the all-gather of
the chunks' gradients, divided by W for ``"avg"``) where Horovod's backward scales by the set size for ``Sum``; and
Horovod's GPU-only Adasum cases (orthogonal, parallel) run on CPU tensors (``test_horovod_alltoall_splits_on_gpu``,
CUDA splits, is not here). Adasum is also proven against a NumPy implementation of the paper's
formula (float64, 1e-10), as an op and as ``strategies.Adasum``.

Each case runs on every rank: in the simulated world (threads) and on real processes, MPI at W = 2 and 4 (``mpiexec``,
the run-long pools of :mod:`tests.support.pool`) and torch.distributed and shm at W = 2.
"""
from __future__ import annotations

import itertools
import math
import sys
import types

import numpy as np
import pytest

import distopt
from distopt.comm.groups import split
from distopt.comm.uneven import all_to_all_v
from distopt.errors import CollectiveMismatchError
from distopt.strategies import Adasum
from tests.support.backends import run_case

torch = pytest.importorskip("torch")
ag = pytest.importorskip("distopt.autograd")
from tests.support.sim_split import sim_can_split  # noqa: F401 (autouse: simulated ranks split)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64, torch.float16]
REAL = [("mpi", 2), ("mpi", 4), ("torch", 2), ("shm", 2)]




def _opt(comm):
    return distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, abort_on_exception=False)


def _hvd_rows(rank: int, ranks, dim: int, dtype):
    """Exactly Horovod's construction (unsqueeze(1), then cat along dim 1, ``dim - 1`` times)."""
    tensor = torch.Tensor([i for i in ranks for _ in range(rank + 1)])
    for _ in range(dim - 1):
        tensor = tensor.unsqueeze(1)
        tensor = torch.cat((tensor, tensor), dim=1)
    return tensor.to(dtype)


def _sets(comm):
    """Horovod's even and odd process sets: this rank's group and its global ranks."""
    size = comm.size
    even, odd = [r for r in range(size) if r % 2 == 0], [r for r in range(size) if r % 2 == 1]
    groups = [split(comm, even, name="even")] + ([split(comm, odd, name="odd")] if odd else [])
    mine = next(g for g in groups if g.is_member)
    return mine, (even if comm.rank % 2 == 0 else odd), groups


# ------------------------------------------------------------------ cases (run on every rank)
def case_alltoall(rank: int, comm) -> None:
    """test_horovod_alltoall, _equal_split, _process_sets, _grad, _equal_split_grad, _grad_process_sets."""
    opt, size = _opt(comm), comm.size
    group, set_ranks, groups = _sets(comm)
    for dtype, dim in itertools.product(DTYPES, [1, 2, 3]):
        tensor = _hvd_rows(rank, range(size), dim, dtype)
        splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
        for collected, received in (opt.all_to_all(tensor, splits), (opt.all_to_all(tensor), None),
                                    opt.all_to_all(tensor, splits, async_op=True).wait()):
            assert collected.dtype == dtype
            collected = collected.float()
            assert collected.min() == rank and collected.max() == rank, "incorrect collected tensor"
            assert collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1), "wrong number of values"
            assert received is None or received.tolist() == [rk + 1 for rk in range(size)], "incorrect received_splits"
        tensor = _hvd_rows(rank, set_ranks, dim, dtype)
        collected, received = opt.all_to_all(tensor, torch.tensor([rank + 1] * len(set_ranks), dtype=torch.int32),
                                             group=group)
        assert collected.float().min() == rank and collected.float().max() == rank
        assert collected.numel() == sum(rk + 1 for rk in set_ranks) * 2 ** (dim - 1)
        assert received.tolist() == [rk + 1 for rk in set_ranks] and received.dtype == torch.int32
    for dtype, dim, how in itertools.product([torch.float32, torch.float64], [1, 2, 3], ["splits", "equal", "set"]):
        ranks = set_ranks if how == "set" else range(size)
        tensor = _hvd_rows(rank, ranks, dim, dtype).requires_grad_()
        if how == "equal":
            collected = ag.all_to_all(tensor, comm=comm)
        else:
            splits = torch.tensor([rank + 1] * len(ranks), dtype=torch.int32)
            collected, _ = ag.all_to_all(tensor, splits, comm=group if how == "set" else comm)
        collected.backward(torch.ones(collected.shape, dtype=dtype))
        err = np.linalg.norm(np.ones(tensor.shape) - tensor.grad.data.numpy())
        assert err < 1e-8, f"gradient {tensor.grad} differs from ones ({how}, {dtype}, dim {dim})"
    for g in groups:
        g.close()


def case_uneven_values(rank: int, comm) -> dict:
    """The MoE pattern: rank r sends (r + j) % 3 rows ``(row index + 1000 r, r)`` to rank j (0 rows included), with
    NumPy and list splits; the gradient of the loss sum_r (r + 1) * out_r."""
    opt, size = _opt(comm), comm.size
    sends = [(rank + j) % 3 for j in range(size)]
    x = np.stack([np.arange(sum(sends)) + 1000 * rank, np.full(sum(sends), rank)], axis=1).astype(np.int64)
    out, got = opt.all_to_all(x, np.array(sends, dtype=np.int32))
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y, got_list = ag.all_to_all(t, sends, comm=comm)
    (y * (rank + 1)).sum().backward()
    return {"out": out, "got": got, "got_list": got_list, "y": y.detach().numpy(), "grad": t.grad.numpy()}


def case_errors(rank: int, comm) -> list:
    """Horovod's alltoall error tests and bad splits on one rank: every rank raises the same error."""
    opt, size = _opt(comm), comm.size

    def attempt(fn):
        try:
            fn()
            return ("ok", "")
        except (TypeError, ValueError, RuntimeError) as exc:
            return (type(exc).__name__, str(exc))

    shape = [2 * size] * 3
    shape[1] = 10 * (rank + 1)
    out = [
        attempt(lambda: opt.all_to_all(torch.empty(size, dtype=torch.int32 if rank % 2 else torch.float32))),
        attempt(lambda: opt.all_to_all(torch.empty(size + 1))),
        attempt(lambda: opt.all_to_all(torch.empty(size - 1), torch.ones(size, dtype=torch.int32))),
        attempt(lambda: opt.all_to_all(torch.empty(size), torch.empty(size, dtype=torch.float32))),
        attempt(lambda: opt.all_to_all(torch.ones(shape))),
        attempt(lambda: opt.all_to_all(np.zeros(size), [1] * (size + (rank == size - 1)))),
        attempt(lambda: opt.all_to_all(np.zeros(size), [size + 1, -1] + [0] * (size - 2) if rank == 1 else [1] * size)),
        attempt(lambda: opt.all_to_all(np.zeros(size), [1] * size if rank == 0 else None)),
        attempt(lambda: opt.all_to_all(np.zeros((size, 2 + rank)), [1] * size)),
        attempt(lambda: opt.reduce_scatter(torch.ones(size * 4, size * 4), op="adasum")),
        attempt(lambda: opt.all_reduce(torch.ones(4, dtype=torch.int32), op="adasum")),
        attempt(lambda: opt.all_to_all(torch.ones(size), [1.5] * size, async_op=True).wait()),
    ]
    t = np.full(2, rank + 1.0)
    opt.all_reduce(t)  # the world still works
    out.append(("sum", t.tolist()))
    return out


def case_reducescatter_grad(rank: int, comm) -> None:
    """test_horovod_reducescatter_grad, _grad_average, _grad_process_sets (distopt's gradient: see the module docs)."""
    size = comm.size
    group, set_ranks, groups = _sets(comm)
    for dtype, dim, how in itertools.product([torch.float32, torch.float64, torch.float16], [1, 2, 3],
                                             ["sum", "avg", "set"]):
        n = len(set_ranks) if how == "set" else size
        gen = torch.Generator().manual_seed(1234)  # torch.manual_seed(1234), per rank (the simulated ranks are threads)
        tensor = torch.FloatTensor(*([n * 4] * dim)).random_(-100, 100, generator=gen).to(dtype).requires_grad_()
        summed = ag.reduce_scatter(tensor, "avg" if how == "avg" else "sum", comm=group if how == "set" else comm)
        assert list(summed.shape) == [4] + [n * 4] * (dim - 1)
        summed.backward(torch.ones([4] + [n * 4] * (dim - 1), dtype=dtype))
        scale = float(torch.tensor(1.0, dtype=dtype) / size) if how == "avg" else 1.0  # 1 / W in the tensor's dtype
        expected = np.ones([n * 4] * dim) * scale  # Horovod: size (Sum), 1 (Average): see the module docs
        err = np.linalg.norm(expected - tensor.grad.data.double().numpy())
        assert err < 1e-8, f"gradient differs from expected ({how}, {dtype}, dim {dim}): error {err}"
    for g in groups:
        g.close()


def _are_close(data_type, true_vec, comp_vec) -> bool:
    """test_adasum_pytorch.py's check: relative error / 100 below the dtype's epsilon."""
    return np.linalg.norm(true_vec - comp_vec) / np.linalg.norm(true_vec) / 100.0 < np.finfo(data_type).eps


def case_adasum_horovod(rank: int, comm) -> list:
    """test_adasum_pytorch.py: orthogonal (a sum), parallel (an average), stability at tiny and huge magnitudes."""
    opt, size = _opt(comm), comm.size
    failures = []
    for data_type in (np.float32, np.float16):
        rs = np.random.RandomState(2)  # np.random.seed(2), per rank (the simulated ranks are threads)
        for kind, all_ns in (("orthogonal", [size * 20 - 17, size * 2 + 1, size + 2, 2 ** 19]),
                             ("parallel", [size * 20 - 13, size * 2 + 1, size + 2, 2 ** 19])):
            qs, tensors = [], []
            for n in all_ns:
                a = rs.normal(0, 1, (n, size) if kind == "orthogonal" else (n, 1)).astype(np.float64)
                q = np.linalg.qr(a)[0] if kind == "orthogonal" else a @ rs.normal(0, 1, (size, 1)).T
                q = q.astype(data_type)
                qs.append(q.astype(np.float64))
                tensors.append(torch.from_numpy(np.ascontiguousarray(q[:, rank])))
            handles = [opt.all_reduce(t, op="adasum", async_op=True) for t in tensors]
            reduced = [h.wait() for h in handles]
            expected = [q.sum(axis=1) / (1 if kind == "orthogonal" else size) for q in qs]
            failures += [(kind, str(data_type), n) for n, e, r in zip(all_ns, expected, reduced)
                         if not _are_close(data_type, e, r.numpy().astype(np.float64))]
        for kind in ("stability", "stability_2"):
            rs = np.random.RandomState(2)
            a = rs.normal(0, np.finfo(data_type).tiny if kind == "stability" else 1, (1024, 1))
            if kind == "stability":
                r = rs.normal(0, 1, (size, 1))
            else:
                lo, hi = float(np.finfo(data_type).tiny), math.sqrt(float(np.finfo(data_type).max))
                r = np.array([hi ** ((i + 1) / size) * lo ** ((size - i - 1) / size) for i in range(size)])
                r = r.reshape(size, 1)
                rs.shuffle(r)
            q = (a @ r.T).astype(data_type).astype(np.float64)
            tensor = torch.from_numpy(q[:, rank].astype(data_type))
            opt.all_reduce(tensor, op="adasum")
            if not _are_close(data_type, q.sum(axis=1) / size, tensor.numpy().astype(np.float64)):
                failures.append((kind, str(data_type), 1024))
    return failures


def adasum_reference(vectors: list[np.ndarray]) -> np.ndarray:
    """The paper's pairwise formula over Horovod's tree (ranks paired 0-1, 2-3, then the pairs), in float64."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, aa, bb = a @ b, a @ a, b @ b
            ca = 1.0 - dot / (2 * aa) if aa >= math.sqrt(sys.float_info.min) else 1.0
            cb = 1.0 - dot / (2 * bb) if bb >= math.sqrt(sys.float_info.min) else 1.0
            pairs.append(ca * a + cb * b)
        level = pairs
    return level[0]


SHAPES = [(5, 7), (1,), (7,), (5, 1, 5), (0,), (3, 2)]


def _grads(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    grads = [rng.standard_normal(s) for s in SHAPES]
    grads[1] = np.full(1, 1e-170)  # below sqrt(DBL_MIN) once squared: Horovod's coefficient 1
    grads[5] = grads[5] * (0 if rank == 1 else 1)  # a zero vector on one rank
    return grads


def case_adasum_reference(rank: int, comm) -> dict:
    """all_reduce(op="adasum") of several float64 arrays (one with a torch tensor, one with factors), and two steps
    of DistOpt with strategies.Adasum (fused and unfused buckets)."""
    opt = _opt(comm)
    grads = _grads(rank)
    ops = [opt.all_reduce(g.copy(), op="adasum") for g in grads]
    ops.append(opt.all_reduce(torch.from_numpy(grads[0].copy()), op="adasum").numpy())
    ops.append(opt.all_reduce(grads[2].copy(), op="adasum", prescale_factor=0.5, postscale_factor=3.0))
    params = [np.linspace(-1, 1, int(np.prod(s))).reshape(s) for s in SHAPES]
    stepper = distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, strategy=Adasum(), buffSize=20)
    stepper.sync_params(params)
    after = []
    for step in range(2):
        stepper.step(params, [g * (step + 1) for g in _grads(rank)], threshold=16)
        after.append([p.copy() for p in params])
    return {"ops": ops, "after": after}


def case_all_to_all_v_backend(rank: int, comm) -> dict:
    """The backends' all_to_all_v against the padded fallback and the expected segments (bool, float16, int64), and
    different matrices on one rank."""
    size = comm.size
    matrix = [[(i + 2 * j) % 3 for j in range(size)] for i in range(size)]
    fallback = types.SimpleNamespace(rank=rank, size=size, all_to_all=comm.all_to_all)
    out = {}
    for dtype in (np.bool_, np.float16, np.int64):
        x = ((np.arange(sum(matrix[rank])) + 100 * rank) % 7).astype(dtype)
        out[np.dtype(dtype).name] = (comm.all_to_all_v(x, matrix), all_to_all_v(fallback, x, matrix))
    bad = [row[:] for row in matrix]
    if rank == 0:
        bad[1][0] += 1
    try:
        comm.all_to_all_v(np.zeros(sum(bad[rank])), bad)
        out["mismatch"] = "no error"
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


# ------------------------------------------------------------------ expectations
def _check_uneven(results: list, w: int) -> None:
    def sent(i: int) -> list[int]:
        return [(i + j) % 3 for j in range(w)]

    for me, res in enumerate(results):
        parts = []
        for i in range(w):
            start = sum(sent(i)[:me])
            rows = np.arange(start, start + sent(i)[me])
            parts.append(np.stack([rows + 1000 * i, np.full(rows.size, i)], axis=1))
        expect = np.concatenate(parts).astype(np.int64)
        np.testing.assert_array_equal(res["out"], expect)
        assert res["out"].dtype == np.int64 and res["got"].dtype == np.int32
        assert res["got"].tolist() == res["got_list"] == [(i + me) % 3 for i in range(w)]
        np.testing.assert_array_equal(res["y"], expect.astype(np.float64))
        grad = np.concatenate([np.full((n, 2), j + 1.0) for j, n in enumerate(sent(me))])
        np.testing.assert_array_equal(res["grad"], grad.reshape(-1, 2))


def _check_errors(results: list, w: int) -> None:
    want = [("CollectiveMismatchError", "all_to_all: dtype differs across ranks"),
            ("ValueError", f"all_to_all on rank 0: all_to_all splits the first dimension into {w} equal chunks"),
            ("ValueError", "all_to_all on rank 0: splits must be ints >= 0 summing to the first dimension"),
            ("ValueError", "all_to_all on rank 0: splits must hold integers (ROWS sent to each rank), got dtype "
                           "torch.float32"),
            ("CollectiveMismatchError", "all_to_all: shape beyond the first dimension differs across ranks"),
            ("ValueError", f"all_to_all on rank {w - 1}: splits must be {w} ints"),
            ("ValueError", "all_to_all on rank 1: splits must be ints >= 0 summing to the first dimension"),
            ("CollectiveMismatchError", "all_to_all: arguments differs across ranks"),
            ("CollectiveMismatchError", "all_to_all: shape beyond the first dimension differs across ranks"),
            ("ValueError", "reduce_scatter on rank 0: op='adasum' is an all_reduce reduction only"),
            ("TypeError", "all_reduce on rank 0: op='adasum' combines floating-point arrays"),
            ("ValueError", f"all_to_all on rank 0: splits must be {w} ints")]
    for rank, res in enumerate(results):
        assert len(res) == len(want) + 1
        for (kind, text), got in zip(want, res):
            assert got[0] == kind and got[1].startswith(text), (rank, got)
        assert res[-1] == ("sum", [w * (w + 1) / 2] * 2)
    assert all(res == results[0] for res in results)  # the same error, word for word, on every rank


def _check_adasum_reference(results: list, w: int) -> None:
    grads = [_grads(r) for r in range(w)]
    expect = [adasum_reference([g[k].reshape(-1) for g in grads]).reshape(SHAPES[k]) for k in range(len(SHAPES))]
    expect += [expect[0], 1.5 * expect[2]]  # the torch tensor; postscale 3 * adasum(0.5 g)
    assert expect[1][0] == w * 1e-170  # coefficient 1: a plain sum
    params = [np.linspace(-1, 1, int(np.prod(s))).reshape(s) for s in SHAPES]
    steps = []
    for step in range(2):
        params = [p - 0.1 * adasum_reference([g[k].reshape(-1) * (step + 1) for g in grads]).reshape(p.shape)
                  for k, p in enumerate(params)]
        steps.append(params)
    for res in results:
        for got, want in zip(res["ops"], expect):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
        for got_step, want_step in zip(res["after"], steps):
            for got, want in zip(got_step, want_step):
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
        for got, first in zip(res["ops"] + res["after"][-1], results[0]["ops"] + results[0]["after"][-1]):
            np.testing.assert_array_equal(got, first)  # the same bits on every rank


def _check_backend_v(results: list, w: int) -> None:
    matrix = [[(i + 2 * j) % 3 for j in range(w)] for i in range(w)]
    for me, res in enumerate(results):
        for name, (got, padded) in ((k, v) for k, v in res.items() if k != "mismatch"):
            xs = [((np.arange(sum(matrix[i])) + 100 * i) % 7).astype(name) for i in range(w)]
            expect = np.concatenate([x[sum(matrix[i][:me]):sum(matrix[i][:me + 1])] for i, x in enumerate(xs)])
            assert got.dtype == padded.dtype == expect.dtype
            np.testing.assert_array_equal(got, expect)
            np.testing.assert_array_equal(padded, expect)
        assert "differs across ranks" in res["mismatch"], res["mismatch"]


# ------------------------------------------------------------------ tests: the simulated world (in process)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.unit
def test_horovod_alltoall_sim(world):
    run_case("sim", world, case_alltoall)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.unit
def test_alltoall_uneven_values_and_gradient_sim(world):
    _check_uneven(run_case("sim", world, case_uneven_values), world)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.unit
def test_horovod_alltoall_errors_on_every_rank_sim(world):
    _check_errors(run_case("sim", world, case_errors), world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.unit
def test_horovod_reducescatter_grad_sim(world):
    run_case("sim", world, case_reducescatter_grad)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.unit
def test_horovod_adasum_sim(world):
    assert run_case("sim", world, case_adasum_horovod) == [[]] * world


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.unit
def test_adasum_against_numpy_reference_sim(world):
    _check_adasum_reference(run_case("sim", world, case_adasum_reference), world)


@pytest.mark.unit
def test_adasum_refuses_a_world_that_is_not_a_power_of_two():
    def body(rank, comm):
        out = []
        for fn in (lambda: _opt(comm).all_reduce(np.ones(3), op="adasum"),
                   lambda: distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, strategy=Adasum()).step(
                       [np.ones(2)], [np.ones(2)])):
            try:
                fn()
                out.append("no error")
            except ValueError as exc:
                out.append(str(exc))
        return out

    for res in run_case("sim", 3, body):
        assert res[0].startswith("all_reduce on rank 0: op='adasum' needs a power-of-two number of ranks"), res
        assert "the Adasum strategy needs a power-of-two number of ranks" in res[1], res
        assert "got 3" in res[0] and "got 3" in res[1]


# ------------------------------------------------------------------ tests: real processes
@pytest.mark.parametrize("backend,world", REAL)
@pytest.mark.world
def test_horovod_alltoall_real(backend, world):
    run_case(backend, world, case_alltoall, timeout=240)
    _check_uneven(run_case(backend, world, case_uneven_values, timeout=120), world)
    _check_errors(run_case(backend, world, case_errors, timeout=120), world)
    _check_backend_v(run_case(backend, world, case_all_to_all_v_backend, timeout=120), world)


@pytest.mark.parametrize("backend,world", REAL)
@pytest.mark.world
def test_horovod_reducescatter_grad_real(backend, world):
    run_case(backend, world, case_reducescatter_grad, timeout=240)


@pytest.mark.parametrize("backend,world", REAL)
@pytest.mark.world
def test_horovod_adasum_real(backend, world):
    assert run_case(backend, world, case_adasum_horovod, timeout=240) == [[]] * world
    _check_adasum_reference(run_case(backend, world, case_adasum_reference, timeout=120), world)
