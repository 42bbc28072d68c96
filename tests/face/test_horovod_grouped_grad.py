"""The differentiable grouped collectives (``distopt.autograd.grouped_*``): Horovod's grad tests, a one-process
reference, bad input.

Horovod's ``test_horovod_grouped_allreduce_grad`` (and ``_average``, ``_process_sets``),
``test_horovod_grouped_allgather_grad`` and ``test_horovod_grouped_reducescatter_grad`` (horovod/horovod
``test/parallel/test_torch.py``) with the same inputs and assertions, in distopt's names: ``hvd.grouped_allreduce(ts,
average=False)`` is ``ag.grouped_all_reduce(ts, "sum", comm=...)``, process sets are
:func:`distopt.comm.groups.split` groups, ``torch.manual_seed`` is a per-rank generator (the simulated ranks are
threads). CPU tensors only (Horovod's CUDA dtypes need GPUs). Two expected gradients are distopt's, not Horovod's,
because distopt's gradient is that of the global function (the sum of every rank's loss), as its ungrouped
``all_gather`` and ``reduce_scatter`` define it (``distopt/autograd.py``, ``docs/porting.md``):

* ``grouped_all_gather``: this rank's rows of the SUMMED gradient, W * rank in the test, where Horovod's backward
  averages (rank);
* ``grouped_reduce_scatter`` with ``"sum"``: the all-gather of the chunks' gradients, ones in the test, where Horovod's
  backward multiplies by the set size (W).

The reference case (distinct data per rank, one backward through all outputs at once) is checked against torch's
autograd of the global function in one process, float64 to 1e-12. Worlds: the simulated world (W = 1, 2, 4), MPI
(W = 2, 4), shm and torch.distributed (W = 2), on the run-long worker pools, each case under a hard timeout.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from distopt.comm.groups import split
from distopt.errors import CollectiveMismatchError
from tests.support.sim_split import sim_can_split  # noqa: F401 (autouse: simulated ranks split)
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")
ag = pytest.importorskip("distopt.autograd")

WORLDS = tiered([("sim", 1), ("sim", 2), ("sim", 4), ("mpi", 2), ("mpi", 4), ("shm", 2), ("torch", 2)])
DIMS = (1, 2, 3)




def _sets(comm, rank: int):
    """Horovod's even and odd process sets: (this rank's group, its members, both groups)."""
    evens, odds = list(range(0, comm.size, 2)), list(range(1, comm.size, 2))
    groups = split(comm, evens, name="even"), split(comm, odds, name="odd")
    return (groups[0], evens, groups) if rank % 2 == 0 else (groups[1], odds, groups)


def _random(gen, *shape):
    """Horovod's ``torch.FloatTensor(*shape).random_(-100, 100)`` after ``torch.manual_seed(1234)``."""
    return torch.FloatTensor(*shape).random_(-100, 100, generator=gen)


def _assert_grads(grads, expected, what: str) -> None:
    """Horovod's check: ``np.linalg.norm(expected - grad) < 1e-8`` for every tensor."""
    for grad in grads:
        err = np.linalg.norm(expected - grad)
        assert err < 0.00000001, f"{what}: gradient {grad} differs from expected {expected}, error: {err}"


# ------------------------------------------------------------------ Horovod's cases (run on every rank)
def case_grouped_allreduce_grad(rank: int, comm) -> int:
    """test_horovod_grouped_allreduce_grad, _grad_average and _grad_process_sets."""
    size, checks = comm.size, 0
    sets = _sets(comm, rank) if size > 1 else None
    for how, dtype, dim in itertools.product(("sum", "avg", "set"), (torch.float32, torch.float64), DIMS):
        if how == "set" and sets is None:
            continue
        gen = torch.Generator().manual_seed(1234)
        even = [_random(gen, *([17] * dim)) for _ in range(5)]
        odd = [_random(gen, *([17] * dim)) for _ in range(5)] if how == "set" else even
        tensors = [t.to(dtype).requires_grad_() for t in (even if rank % 2 == 0 else odd)]
        target = sets[0] if how == "set" else comm
        summed = ag.grouped_all_reduce(tensors, "avg" if how == "avg" else "sum", comm=target)
        for s in summed:
            s.backward(torch.ones([17] * dim, dtype=dtype))
        scale = 1 if how == "avg" else len(sets[1]) if how == "set" else size
        _assert_grads([t.grad.data.numpy() for t in tensors], np.ones([17] * dim) * scale, f"{how} {dtype} {dim}")
        checks += 1
    for group in sets[2] if sets else ():
        group.close()
    return checks


def case_grouped_allgather_grad(rank: int, comm) -> int:
    """test_horovod_grouped_allgather_grad (distopt's gradient: W times Horovod's, see the module docs)."""
    size, checks = comm.size, 0
    for dtype, dim in itertools.product((torch.float32, torch.float64), DIMS):
        tensor_sizes = ([3, 2, 7, 4, 6, 8, 10] * 5)[:size]
        tensors = [torch.FloatTensor(*([tensor_sizes[rank]] + [17] * (dim - 1))).fill_(1).mul_(rank).to(dtype)
                   .requires_grad_() for _ in range(5)]
        grad_ys = torch.cat([torch.ones([n] + [17] * (dim - 1), dtype=dtype) * r
                             for r, n in enumerate(tensor_sizes)], dim=0)
        gathered = ag.grouped_all_gather(tensors, comm=comm)
        for g in gathered:
            g.backward(grad_ys)
        expected = np.ones([tensor_sizes[rank]] + [17] * (dim - 1)) * rank * size  # Horovod: * rank
        _assert_grads([t.grad.data.numpy() for t in tensors], expected, f"{dtype} {dim}")
        checks += 1
    return checks


def case_grouped_reducescatter_grad(rank: int, comm) -> int:
    """test_horovod_grouped_reducescatter_grad (distopt's gradient: 1/W of Horovod's, see the module docs), and the
    same with ``"avg"`` (the gradient divided by W in the tensor's dtype)."""
    size, checks = comm.size, 0
    for op, dtype, dim in itertools.product(("sum", "avg"), (torch.float32, torch.float64, torch.float16), DIMS):
        gen = torch.Generator().manual_seed(1234)
        tensors = [_random(gen, *([size * 4] * dim)).to(dtype).requires_grad_() for _ in range(5)]
        summed = ag.grouped_reduce_scatter(tensors, op, comm=comm)
        grad_shape = [4] + [size * 4] * (dim - 1)
        for s in summed:
            assert list(s.shape) == grad_shape
            s.backward(torch.ones(grad_shape, dtype=dtype))
        scale = float(torch.tensor(1.0, dtype=dtype) / size) if op == "avg" else 1.0  # Horovod's Sum: size
        _assert_grads([t.grad.data.double().numpy() for t in tensors], np.ones([size * 4] * dim) * scale,
                      f"{op} {dtype} {dim}")
        checks += 1
    return checks


# ------------------------------------------------------------------ the one-process reference
def _ref_data(rank: int, w: int) -> dict:
    """Rank ``rank``'s inputs and loss weights (float64; an int64 tensor rides along forward only)."""
    rng = np.random.default_rng(500 + rank)
    normal = rng.standard_normal
    return {"reduce": [normal((3, 2)), normal(5), normal((2, 2, 2))],
            "gather": [normal((rank + 1, 3)), normal((2 * rank, 2)), normal(4)],  # 0 rows on rank 0
            "scatter": [normal((2 * w, 3)), normal(w)],
            "w_reduce": [normal((3, 2)), normal(5), normal((2, 2, 2))],
            "w_scatter": [normal((2, 3)), normal(1)]}


def case_reference(rank: int, comm) -> dict:
    """One backward through every output of each grouped call, loss = sum_i <weights_i, output_i>."""
    d, out = _ref_data(rank, comm.size), {}
    for op in ("sum", "avg"):
        xs = [torch.tensor(a, requires_grad=True) for a in d["reduce"]]
        ys = ag.grouped_all_reduce(xs + ([torch.arange(3) + rank] if op == "sum" else []), op, comm=comm)
        sum((y * torch.tensor(c)).sum() for y, c in zip(ys, d["w_reduce"])).backward()
        out[f"reduce_{op}"] = ([y.detach().numpy() for y in ys], [x.grad.numpy() for x in xs])
        xs = [torch.tensor(a, requires_grad=True) for a in d["scatter"]]
        ys = ag.grouped_reduce_scatter(xs, op, comm=comm)
        sum((y * torch.tensor(c)).sum() for y, c in zip(ys, d["w_scatter"])).backward()
        out[f"scatter_{op}"] = ([y.detach().numpy() for y in ys], [x.grad.numpy() for x in xs])
    xs = [torch.tensor(a, requires_grad=True) for a in d["gather"]]
    ys = ag.grouped_all_gather(xs, comm=comm)
    weights = [torch.full(y.shape, rank + 1.0) * torch.arange(y.shape[0]).reshape(-1, *[1] * (y.dim() - 1))
               for y in ys]
    sum((y * c).sum() for y, c in zip(ys, weights)).backward()
    out["gather"] = ([y.detach().numpy() for y in ys], [x.grad.numpy() for x in xs])
    return out


def _reference(w: int) -> dict:
    """torch's autograd of the global function, in one process: every rank's inputs as leaves, the loss summed."""
    data = [_ref_data(r, w) for r in range(w)]
    out = {}
    for op in ("sum", "avg"):
        xs = [[torch.tensor(a, requires_grad=True) for a in d["reduce"]] for d in data]
        ys = [sum(x[i] for x in xs) / (w if op == "avg" else 1) for i in range(3)]
        sum((y * torch.tensor(c)).sum() for d in data for y, c in zip(ys, d["w_reduce"])).backward()
        ints = [sum(np.arange(3) + r for r in range(w))] if op == "sum" else []
        out[f"reduce_{op}"] = [([y.detach().numpy() for y in ys] + ints, [x.grad.numpy() for x in xs[r]])
                               for r in range(w)]
        xs = [[torch.tensor(a, requires_grad=True) for a in d["scatter"]] for d in data]
        full = [sum(x[i] for x in xs) / (w if op == "avg" else 1) for i in range(2)]
        ys = [[f.reshape(w, -1, *f.shape[1:])[r].reshape(-1, *f.shape[1:]) for f in full] for r in range(w)]
        sum((y * torch.tensor(c)).sum() for r, d in enumerate(data) for y, c in zip(ys[r], d["w_scatter"])).backward()
        out[f"scatter_{op}"] = [([y.detach().numpy() for y in ys[r]], [x.grad.numpy() for x in xs[r]])
                                for r in range(w)]
    xs = [[torch.tensor(a, requires_grad=True) for a in d["gather"]] for d in data]
    ys = [torch.cat([x[i] for x in xs]) for i in range(3)]
    loss = 0
    for r in range(w):
        loss = loss + sum((y * (torch.full(y.shape, r + 1.0) * torch.arange(y.shape[0]).reshape(
            -1, *[1] * (y.dim() - 1)))).sum() for y in ys)
    loss.backward()
    out["gather"] = [([y.detach().numpy() for y in ys], [x.grad.numpy() for x in xs[r]]) for r in range(w)]
    return out


def _check_reference(results: list, w: int) -> None:
    expect = _reference(w)
    for rank, res in enumerate(results):
        for key, per_rank in expect.items():
            (want_out, want_grad), (got_out, got_grad) = per_rank[rank], res[key]
            assert len(got_out) == len(want_out) and len(got_grad) == len(want_grad), key
            for got, want in zip(got_out + got_grad, want_out + want_grad):
                assert got.shape == np.shape(want), (key, got.shape, np.shape(want))
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{key} on rank {rank}")
        assert res["reduce_sum"][0][3].dtype == np.int64  # the integer tensor: forward only


# ------------------------------------------------------------------ bad input
def case_errors(rank: int, comm) -> list:
    """Each bad call raises the same error on every rank; the world still works after them."""
    def attempt(fn):
        try:
            fn()
            return ("ok", "")
        except (TypeError, ValueError, RuntimeError, CollectiveMismatchError) as exc:
            return (type(exc).__name__, str(exc))

    one = torch.ones(2 * comm.size, requires_grad=True)

    def backward_of(call, op):
        ys = call([one, torch.ones(comm.size, dtype=torch.float64, requires_grad=True)], op, comm=comm)
        (ys[0].sum() + ys[1].sum()).backward()

    return [
        attempt(lambda: ag.grouped_all_reduce(one if rank == 0 else [one], comm=comm)),
        attempt(lambda: ag.grouped_all_gather([one, "x"] if rank == comm.size - 1 else [one, one], comm=comm)),
        attempt(lambda: ag.grouped_reduce_scatter([one] * (1 + (rank == 0)), comm=comm)),
        attempt(lambda: ag.grouped_reduce_scatter([torch.ones(2 * comm.size + 1)], comm=comm)),
        attempt(lambda: ag.grouped_all_reduce([torch.ones(2, dtype=torch.int32)], "avg", comm=comm)),
        attempt(lambda: backward_of(ag.grouped_all_reduce, "max")),
        attempt(lambda: backward_of(ag.grouped_reduce_scatter, "product")),
        attempt(lambda: ag.grouped_all_reduce([torch.eye(2).to_sparse() if rank == 0 else torch.eye(2)], comm=comm)),
        ("empty", ag.grouped_all_gather([], comm=comm)),
        ("sum", ag.grouped_all_reduce([torch.full((2,), rank + 1.0)], comm=comm)[0].tolist()),
    ]


def _check_errors(results: list, w: int) -> None:
    want = [("TypeError", "grouped_all_reduce on rank 0: arrays must be a list of arrays or tensors, got Tensor"),
            ("TypeError", f"grouped_all_gather on rank {w - 1}: arrays[1]: expected a NumPy/CuPy array or a torch "
                          "tensor, got str (the grouped autograd collectives take torch tensors)"),
            ("CollectiveMismatchError", "grouped_reduce_scatter: number of arrays differs across ranks"),
            ("ValueError", "grouped_reduce_scatter on rank 0: arrays[0]: grouped_reduce_scatter splits the first "
                           f"dimension into {w} equal chunks"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays[0]: op='avg'"),
            ("RuntimeError", "grouped_all_reduce(op='max') has no gradient in distopt"),
            ("RuntimeError", "grouped_reduce_scatter(op='product') has no gradient in distopt"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays[0]: tensor of shape (2, 2) is sparse")]
    for rank, res in enumerate(results):
        assert len(res) == len(want) + 2
        for (kind, text), got in zip(want, res):
            assert got[0] == kind and got[1].startswith(text), (rank, got)
        assert res[-2] == ("empty", [])
        assert res[-1] == ("sum", [w * (w + 1) / 2] * 2)
    assert all(res == results[0] for res in results)  # the same error, word for word, on every rank


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_allreduce_grad(backend, world):
    assert run_case(backend, world, case_grouped_allreduce_grad, timeout=180) == \
        [12 + (6 if world > 1 else 0)] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_allgather_grad(backend, world):
    assert run_case(backend, world, case_grouped_allgather_grad, timeout=120) == [6] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_reducescatter_grad(backend, world):
    assert run_case(backend, world, case_grouped_reducescatter_grad, timeout=180) == [18] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_grouped_grads_against_one_process_reference(backend, world):
    _check_reference(run_case(backend, world, case_reference, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), [p for p in WORLDS if p.values[1] > 1])
def test_grouped_autograd_bad_input_raises_on_every_rank(backend, world):
    _check_errors(run_case(backend, world, case_errors, timeout=120), world)
