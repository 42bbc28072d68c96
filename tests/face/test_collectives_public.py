"""DistOpt's public collectives (shapes, groups, async_op) and the differentiable ones (distopt.autograd).

Cases run on every rank (``fn(rank, comm)``, :func:`tests.support.backends.run_case`): in the simulated world
(threads; its communicator gets a stand-in ``split``) at W = 1, 2 and 3, where the numerics are proven,
and once per real backend at W = 3 on MPI (``mpiexec``), shm and torch.distributed (gloo), on the run-long
worker pools, each under the harness's hard timeout. On the torch
backend the results are compared with torch.distributed's own collectives and
``torch.distributed.nn.functional``'s gradients.
"""
from __future__ import annotations


import numpy as np
import pytest

import distopt
from distopt.comm.groups import split
from distopt.errors import CollectiveMismatchError, CollectiveTimeoutError, CommunicatorClosedError
from tests.support.backends import run_case
from tests.support.sim_split import sim_can_split  # noqa: F401 (autouse: simulated ranks split)
from tests.support.simworld import run_world

torch = pytest.importorskip("torch")
ag = pytest.importorskip("distopt.autograd")

REAL = ["mpi", "shm", "torch"]




def _opt(comm):
    return distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, abort_on_exception=False)


def _try(fn):
    try:
        fn()
        return ("ok", "")
    except (TypeError, ValueError, CollectiveMismatchError) as exc:
        return (type(exc).__name__, str(exc))


# ------------------------------------------------------------------ cases (run on every rank)
def case_shapes(rank: int, comm) -> dict:
    """all_gather of N-D rows that differ per rank (0 rows on rank 0), reduce_scatter, all_to_all;
    NumPy and torch, in place or new as documented."""
    opt, w = _opt(comm), comm.size
    out: dict = {}
    x = np.full((rank, 2, 3), rank, dtype=np.float32)
    out["gather_v"] = opt.all_gather(x)
    out["gather_eq"] = opt.all_gather(np.arange(4, dtype=np.int64).reshape(2, 2) + 10 * rank)
    t = torch.full((rank + 1, 2), float(rank), dtype=torch.bfloat16)
    got = opt.all_gather(t)
    out["gather_torch"] = (type(got).__name__, str(got.dtype), got.float().tolist())
    base = np.arange(w * 2 * 3, dtype=np.float64).reshape(w * 2, 3)
    keep = base * (rank + 1)
    out["rs_sum"] = opt.reduce_scatter(keep)
    out["rs_unchanged"] = bool(np.array_equal(keep, base * (rank + 1)))
    out["rs_max"] = opt.reduce_scatter(keep, op="max")
    out["rs_avg_torch"] = opt.reduce_scatter(torch.from_numpy(keep.copy()), op="avg").tolist()
    a = (np.arange(w * 2) // 2 + 100 * rank).astype(np.int32).reshape(w * 2, 1)  # chunk j holds j + 100*rank
    out["a2a"] = opt.all_to_all(a)
    out["a2a_torch"] = opt.all_to_all(torch.from_numpy(a.copy())).tolist()
    out["empty"] = opt.reduce_scatter(np.zeros((0, 4))).shape
    r = np.full(3, rank + 1.0)
    out["in_place"] = opt.all_reduce(r) is r and opt.broadcast(r, root=w - 1) is r
    return out


def case_errors(rank: int, comm) -> list:
    """Arguments bad or different on one rank: every rank raises the same error at once."""
    opt, w = _opt(comm), comm.size
    out = [
        _try(lambda: opt.all_gather(np.zeros((2, 3 if rank == 1 else 4)))),
        _try(lambda: opt.all_gather(np.zeros(()) if rank == 1 else np.zeros(2))),
        _try(lambda: opt.all_gather(np.zeros(2, np.float32 if rank == 1 else np.float64))),
        _try(lambda: opt.reduce_scatter(np.zeros(w + (rank == 1)))),
        _try(lambda: opt.reduce_scatter(np.zeros((w, 2)) if rank else np.zeros((w, 3)))),
        _try(lambda: opt.all_to_all(np.zeros(w, np.int64 if rank == 1 else np.int32))),
        _try(lambda: opt.all_reduce(np.arange(3), op="avg")),
        _try(lambda: opt.reduce_scatter(np.arange(w), op="avg")),
        _try(lambda: opt.all_gather([1, 2])),
    ]
    t = np.full(2, rank + 1.0)
    opt.all_reduce(t)  # the world still works
    out.append(("sum", t.tolist()))
    return out


def case_async(rank: int, comm) -> dict:
    """Many async collectives in flight while a training step runs on the main thread; FIFO completion;
    errors at wait() on every rank; close()."""
    opt, w = _opt(comm), comm.size
    out: dict = {}
    arrays = [np.full(1000, float(rank + i)) for i in range(6)]
    handles = [opt.all_reduce(a, async_op=True) for a in arrays]
    params, grads = [np.ones(10)], [np.full(10, float(rank))]
    opt.step(params, grads)  # the engine's collectives on DistOpt's communicator, meanwhile
    more = {
        "gather": opt.all_gather(np.full((rank + 1, 2), rank, dtype=np.int64), async_op=True),
        "rs": opt.reduce_scatter(np.arange(w * 2.0).reshape(w, 2) * (rank + 1), async_op=True),
        "a2a": opt.all_to_all(np.arange(w) + 10 * rank, async_op=True),
        "bcast": opt.broadcast(np.full(3, float(rank)), root=w - 1, async_op=True),
        "bad": opt.all_gather(np.zeros((2, 3 if rank == 1 else 2)), async_op=True),
        "torch": opt.all_reduce(torch.full((4,), rank + 1.0), async_op=True),
    }
    last = opt.all_reduce(np.ones(2), async_op=True)
    out["last"] = last.wait().tolist()
    out["fifo"] = all(h.is_completed() for h in handles + list(more.values()))
    out["in_place"] = all(h.wait() is a for h, a in zip(handles, arrays))
    out["sums"] = [float(h.wait()[0]) for h in handles]
    for name in ("gather", "rs", "a2a", "bcast"):
        out[name] = np.asarray(more[name].wait()).tolist()
    out["torch"] = more["torch"].wait().tolist()
    try:
        more["bad"].wait()
        out["bad"] = "no error"
    except CollectiveMismatchError as exc:
        out["bad"] = str(exc)
    out["params"] = params[0].tolist()
    out["repeat"] = opt.all_reduce(np.full(2, 1.0), op="max", async_op=True).wait().tolist()
    opt.close()
    try:
        opt.all_reduce(np.ones(1), async_op=True)
        out["closed"] = "no error"
    except CommunicatorClosedError as exc:
        out["closed"] = str(exc)
    return out


def case_groups(rank: int, comm) -> dict:
    """group= on every public collective (ranks 0 and W-1); a rank outside gets ValueError."""
    opt, w = _opt(comm), comm.size
    g = split(comm, [0, w - 1], name="ends")
    out: dict = {}
    if g.is_member:
        a = np.full(3, rank + 1.0)
        out["sum"] = opt.all_reduce(a, group=g).tolist()
        out["gather"] = opt.all_gather(np.full((rank + 1, 2), rank), group=g).tolist()
        out["rs"] = opt.reduce_scatter(np.arange(4.0).reshape(2, 2) * (rank + 1), group=g).tolist()
        out["a2a"] = opt.all_to_all(np.array([10 * rank, 10 * rank + 1]), group=g).tolist()
        out["bcast"] = opt.broadcast(np.full(2, float(rank)), root=1, group=g).tolist()
        out["objects"] = opt.all_gather_object(rank, group=g)
        out["agree"] = opt.agree(rank == 0, "all", group=g)
        out["metrics"] = opt.all_reduce_metrics({"n": 1.0}, group=g)
        try:
            out["async"] = opt.all_reduce(np.full(2, float(rank)), group=g, async_op=True).wait().tolist()
        except ValueError as exc:  # the torch backend cannot split a group
            out["async"] = f"ValueError: {exc}"
        out["mismatch"] = _try(lambda: opt.all_gather(np.zeros((1, 2 + (rank != 0))), group=g))
    else:
        out["outside"] = _try(lambda: opt.all_reduce(np.ones(1), group=g))
    b = np.full(2, rank + 1.0)
    out["world"] = opt.all_reduce(b).tolist()
    g.close()
    return out


def _composite(fn, comm, rank: int, v):
    """f(X) = avg_r(v_r * fn(avg_r(X)[rank])): X's row r is rank r's contribution; replicated input and
    output make gradcheck's per-rank Jacobians those of the global function (see the report)."""
    def f(x):
        mine = ag.all_reduce(x, "avg", comm=comm)[rank]
        return ag.all_reduce(v * fn(mine), "avg", comm=comm)
    return f


def case_gradcheck(rank: int, comm) -> dict:
    """torch.autograd.gradcheck (float64) of every differentiable collective, plus explicit gradients."""
    w = comm.size
    out: dict = {}
    x = torch.randn(w, w, 1, generator=torch.Generator().manual_seed(7), dtype=torch.float64, requires_grad=True)

    def v_of(shape):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)

    rows = sum(range(w))  # rank r contributes r rows (0 on rank 0)
    checks = {
        "all_reduce_sum": (lambda c: ag.all_reduce(c, "sum", comm=comm), (w, 1)),
        "all_reduce_avg": (lambda c: ag.all_reduce(c, "avg", comm=comm), (w, 1)),
        "all_gather_v": (lambda c: ag.all_gather(c[:rank], comm=comm), (rows, 1)),
        "all_gather_eq": (lambda c: ag.all_gather(c, comm=comm), (w * w, 1)),
        "broadcast_0": (lambda c: ag.broadcast(c, 0, comm=comm), (w, 1)),
        "broadcast_last": (lambda c: ag.broadcast(c, w - 1, comm=comm), (w, 1)),
    }
    for name, (fn, shape) in checks.items():
        out[name] = torch.autograd.gradcheck(_composite(fn, comm, rank, v_of(shape)), (x,), raise_exception=False)
    # explicit gradients: loss = sum over ranks of (rank + 1) * output
    a = torch.full((2,), 1.0, dtype=torch.float64, requires_grad=True)
    (ag.all_reduce(a, comm=comm) * (rank + 1)).sum().backward()
    out["grad_sum"] = a.grad.tolist()
    b = torch.ones(rank + 1, 2, dtype=torch.float64, requires_grad=True)
    (ag.all_gather(b, comm=comm) * (rank + 1)).sum().backward()
    out["grad_gather"] = b.grad.tolist()
    c = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (ag.broadcast(c, w - 1, comm=comm) * (rank + 1)).sum().backward()
    out["grad_bcast"] = c.grad.tolist()
    d = torch.ones(2, dtype=torch.float64, requires_grad=True)
    y = ag.all_reduce(d, "max", comm=comm)
    try:
        y.sum().backward()
        out["max_backward"] = "no error"
    except RuntimeError as exc:
        out["max_backward"] = str(exc)
    out["out_of_place"] = bool((d == 1).all()) and y is not d
    out["via_distopt"] = ag.all_reduce(torch.ones(1), comm=_opt(comm)).tolist()
    out["mismatch"] = _try(lambda: ag.all_gather(torch.zeros(1, 2 + (rank == 1)), comm=comm))
    return out


def case_vs_torch_dist(rank: int, comm) -> dict:
    """The torch backend: DistOpt's collectives and distopt.autograd against torch.distributed's own."""
    import torch.distributed as dist
    from torch.distributed.nn import functional as dnn

    opt, w = _opt(comm), comm.size
    gen = torch.Generator().manual_seed(rank)
    out: dict = {}
    x = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    ref = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(ref, x)
    out["all_gather"] = torch.equal(opt.all_gather(x), torch.cat(ref))
    y = torch.randn(w * 2, 3, generator=gen, dtype=torch.float64)
    ref2 = torch.empty_like(y)
    dist.all_to_all_single(ref2, y)
    out["all_to_all"] = torch.equal(opt.all_to_all(y), ref2)
    summed = y.clone()
    dist.all_reduce(summed)
    out["reduce_scatter"] = torch.allclose(opt.reduce_scatter(y), summed.chunk(w)[rank], rtol=0, atol=1e-12)
    weight = torch.randn(w * 2, 3, generator=gen, dtype=torch.float64)
    world = dist.group.WORLD  # explicit: torch.distributed.nn binds its default group once, at import
    for name, ours, theirs in (
        ("ad_all_reduce", lambda t: ag.all_reduce(t, comm=comm), lambda t: dnn.all_reduce(t, group=world)),
        ("ad_all_gather", lambda t: ag.all_gather(t, comm=comm), lambda t: torch.cat(dnn.all_gather(t, group=world))),
        ("ad_broadcast", lambda t: ag.broadcast(t, w - 1, comm=comm), lambda t: dnn.broadcast(t, w - 1, group=world)),
    ):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(a), theirs(b)
        (ya * weight[:ya.shape[0]]).sum().backward()
        (yb * weight[:yb.shape[0]]).sum().backward()
        out[name] = bool(torch.allclose(ya, yb) and torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12))
    return out


# ------------------------------------------------------------------ expectations
def _check_shapes(results: list, w: int) -> None:
    rows = np.concatenate([np.full((r, 2, 3), r, np.float32) for r in range(w)])
    eq = np.concatenate([np.arange(4).reshape(2, 2) + 10 * r for r in range(w)])
    base = np.arange(w * 2 * 3, dtype=np.float64).reshape(w * 2, 3)
    tri = w * (w + 1) / 2
    for rank, res in enumerate(results):
        assert res["gather_v"].shape == (sum(range(w)), 2, 3) and res["gather_v"].dtype == np.float32
        np.testing.assert_array_equal(res["gather_v"], rows)
        np.testing.assert_array_equal(res["gather_eq"], eq)
        assert res["gather_eq"].dtype == np.int64
        assert res["gather_torch"] == ("Tensor", "torch.bfloat16",
                                       [[float(r)] * 2 for r in range(w) for _ in range(r + 1)])
        np.testing.assert_array_equal(res["rs_sum"], (base * tri)[2 * rank:2 * rank + 2])
        assert res["rs_unchanged"]
        np.testing.assert_array_equal(res["rs_max"], (base * w)[2 * rank:2 * rank + 2])
        np.testing.assert_allclose(res["rs_avg_torch"], (base * tri / w)[2 * rank:2 * rank + 2])
        expect = np.array([[rank + 100 * i] for i in range(w) for _ in range(2)], dtype=np.int32)
        np.testing.assert_array_equal(res["a2a"], expect)
        assert res["a2a"].dtype == np.int32
        assert res["a2a_torch"] == expect.tolist()
        assert res["empty"] == (0, 4)
        assert res["in_place"]


def _check_errors(results: list, w: int) -> None:
    want = [("CollectiveMismatchError", "all_gather: shape beyond the first dimension differs across ranks "
             "(rank 0: (2, 4), rank 1: (2, 3)"),
            ("ValueError", "all_gather on rank 1: all_gather needs an array of at least 1 dimension"),
            ("CollectiveMismatchError", "all_gather: dtype differs across ranks (rank 0: float64, rank 1: "
             "float32"),
            ("ValueError", f"reduce_scatter on rank 1: reduce_scatter splits the first dimension into {w} equal"),
            ("CollectiveMismatchError", "reduce_scatter: shape differs across ranks (rank 0: "),
            ("CollectiveMismatchError", "all_to_all: dtype differs across ranks"),
            ("TypeError", "all_reduce on rank 0: op='avg' is not supported for dtype int64"),
            ("TypeError", "reduce_scatter on rank 0: op='avg'"),
            ("TypeError", "all_gather on rank 0: expected a NumPy/CuPy array or a torch tensor, got list")]
    for rank, res in enumerate(results):
        for (kind, text), got in zip(want, res):
            assert got[0] == kind and got[1].startswith(text), (rank, got)
        assert res[-1] == ("sum", [w * (w + 1) / 2] * 2)


def _check_async(results: list, w: int) -> None:
    tri = w * (w - 1) / 2
    for rank, res in enumerate(results):
        assert res["last"] == [float(w)] * 2 and res["fifo"] and res["in_place"]
        assert res["sums"] == [tri + w * i for i in range(6)]
        assert res["gather"] == [[r, r] for r in range(w) for _ in range(r + 1)]
        assert res["rs"] == [[2.0 * rank * w * (w + 1) / 2, (2.0 * rank + 1) * w * (w + 1) / 2]]
        assert res["a2a"] == [rank + 10 * i for i in range(w)]
        assert res["bcast"] == [float(w - 1)] * 3
        assert res["torch"] == [w * (w + 1) / 2] * 4
        assert w == 1 or res["bad"].startswith("all_gather: shape beyond the first dimension differs across ranks")
        np.testing.assert_allclose(res["params"], 1 - 0.1 * tri / w)
        assert res["repeat"] == [1.0, 1.0]
        assert "closed" in res["closed"]


def _check_groups(results: list, w: int, backend: str) -> None:
    for rank, res in enumerate(results):
        assert res["world"] == [w * (w + 1) / 2] * 2
        if rank not in (0, w - 1):
            assert res["outside"][0] == "ValueError" and "not a member of process group 'ends'" in res["outside"][1]
            continue
        me = 0 if rank == 0 else 1
        assert res["sum"] == [1.0 + w] * 3
        assert res["gather"] == [[0, 0]] + [[w - 1, w - 1]] * w
        assert res["rs"] == (np.arange(4.0).reshape(2, 2) * (1 + w))[me:me + 1].tolist()
        assert res["a2a"] == [me, 10 * (w - 1) + me]
        assert res["bcast"] == [float(w - 1)] * 2
        assert res["objects"] == [0, w - 1] and res["agree"] is False and res["metrics"] == {"n": 2.0}
        if backend == "torch" and w > 2:
            assert res["async"].startswith("ValueError") and "group of a group" in res["async"]
        else:
            assert res["async"] == [float(w - 1)] * 2
        assert res["mismatch"][0] == "CollectiveMismatchError"


def _check_gradcheck(results: list, w: int) -> None:
    tri = w * (w + 1) / 2
    for rank, res in enumerate(results):
        for name in ("all_reduce_sum", "all_reduce_avg", "all_gather_v", "all_gather_eq", "broadcast_0",
                     "broadcast_last"):
            assert res[name] is True, (rank, name)
        assert res["grad_sum"] == [tri] * 2
        assert res["grad_gather"] == [[tri] * 2] * (rank + 1)
        assert res["grad_bcast"] == ([tri] * 2 if rank == w - 1 else [0.0] * 2)
        assert "has no gradient" in res["max_backward"] and res["out_of_place"]
        assert res["via_distopt"] == [float(w)]
        assert w == 1 or res["mismatch"][0] == "CollectiveMismatchError" and "rank 1: (1, 3)" in res["mismatch"][1]


# ------------------------------------------------------------------ tests: the simulated world (fast)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.unit
def test_shapes_sim(world):
    _check_shapes(run_case("sim", world, case_shapes), world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_argument_errors_on_every_rank_sim(world):
    _check_errors(run_case("sim", world, case_errors), world)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.unit
def test_async_sim(world):
    _check_async(run_case("sim", world, case_async), world)


@pytest.mark.unit
def test_async_runs_on_a_dedicated_communicator_made_once():
    def body(rank, comm):
        opt = _opt(comm)
        handles = [opt.all_reduce(np.ones(5), async_op=True) for _ in range(4)]
        before = list(comm.calls)
        opt.all_reduce(np.ones(3))  # a blocking call in between: only its own collectives on the parent
        handles += [opt.all_gather(np.ones(2), async_op=True)]
        [h.wait() for h in handles]
        return before, comm.calls[len(before):]

    for before, after in run_world(2, body):
        assert [k for k, _ in before] == ["all_gather"]  # the split's agreement, once
        assert [k for k, _ in after] == ["all_gather", "all_reduce"]


@pytest.mark.unit
def test_async_timeout_is_raised_at_wait():
    def body(rank, comm):
        opt = _opt(comm)
        opt.all_reduce(np.ones(2), async_op=True).wait()
        if rank == 1:
            return "skipped"
        try:
            opt.all_reduce(np.ones(2), async_op=True).wait()
        except CollectiveTimeoutError as exc:
            return f"timeout: {exc}"
        return "no error"

    results = run_world(2, body, timeout=6.0)
    assert results[0].startswith("timeout") and results[1] == "skipped"


@pytest.mark.unit
def test_async_needs_a_communicator_that_splits():
    class NoSplit:
        name, rank, size = "mine", 0, 1

    from distopt.async_collectives import AsyncCollectives

    with pytest.raises(TypeError, match="has no split"):
        AsyncCollectives().submit(NoSplit(), "all_reduce", lambda c: None)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.unit
def test_groups_sim(world):
    _check_groups(run_case("sim", world, case_groups), world, "sim")


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.unit
def test_gradcheck_sim(world):
    _check_gradcheck(run_case("sim", world, case_gradcheck), world)


@pytest.mark.unit
def test_autograd_resolves_its_communicator():
    from distopt.comm.single import SingleCommunicator

    comm = SingleCommunicator()
    assert ag.resolve(comm) is comm
    assert ag.resolve(distopt.launch.world.World(comm, None)) is comm
    with pytest.raises(TypeError, match="comm must be"):
        ag.resolve(3)


# ------------------------------------------------------------------ tests: real processes, W = 3
# The numerics are proven in the simulated world at W = 1, 2 and 3 (the *_sim tests above); on each real
# backend the same cases run once, at W = 3 (more ranks than cores, uneven splits), for the transport.
@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("world", [3])
@pytest.mark.world
def test_shapes_and_errors_real(backend, world):
    _check_shapes(run_case(backend, world, case_shapes, timeout=120), world)
    _check_errors(run_case(backend, world, case_errors, timeout=120), world)


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("world", [3])
@pytest.mark.world
def test_async_real(backend, world):
    _check_async(run_case(backend, world, case_async, timeout=120), world)


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.world
def test_groups_real(backend):
    _check_groups(run_case(backend, 3, case_groups, timeout=120), 3, backend)


@pytest.mark.parametrize("backend", REAL)
@pytest.mark.parametrize("world", [3])
@pytest.mark.world
def test_gradcheck_real(backend, world):
    _check_gradcheck(run_case(backend, world, case_gradcheck, timeout=180), world)


@pytest.mark.parametrize("world", [3])
@pytest.mark.world
def test_against_torch_distributed(world):
    for res in run_case("torch", world, case_vs_torch_dist, timeout=120):
        assert res == {k: True for k in res} and len(res) == 6, res
