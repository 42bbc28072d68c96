"""Grouped collectives, scale factors and ``"product"`` against one-process references, and their bad input.

Every rank draws its own data (small integers where sums and products must be exact on any backend's reduction order,
normal float64 elsewhere); the test process recomputes every rank's data and reduces it with NumPy, in float64 where the
reference needs it: integers and small-integer floats bitwise, float64 to rtol 1e-10, scaled float32/float16 to their
precision. Worlds: the simulated world (W = 1, 2, 3), MPI (W = 2, 4), shm and torch.distributed (W = 2).
"""
from __future__ import annotations

import numpy as np
import pytest

import distopt
from distopt.comm.scaled import check_scale, scale_in_place
from distopt.errors import CollectiveMismatchError
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

WORLDS = tiered([("sim", 1), ("sim", 2), ("sim", 3), ("mpi", 2), ("mpi", 4), ("shm", 2), ("torch", 2)])
PRE, POST = 0.3, 1.7


def _opt(comm):
    return distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, abort_on_exception=False)


def _inputs(rank: int, w: int) -> list[np.ndarray]:
    """Rank ``rank``'s arrays: float64 normal, then small integers as float32, int32, int64, float16, and bool."""
    rng = np.random.default_rng(1000 + rank)
    small = lambda shape, dt: rng.integers(-2, 3, shape).astype(dt)  # noqa: E731
    return [rng.standard_normal((2 * w, 3)), small((w, 5), np.float32), small((3 * w,), np.int32),
            small((w, 2, 2), np.int64), small((2 * w,), np.float16), rng.integers(0, 2, (w, 3)).astype(bool),
            np.zeros((0, 4))]


#: (elements, dtype): 5 travel in the control block (MPI, torch), 700 in the collective itself.
PRODUCT_CASES = [(n, d) for n in (5, 700) for d in ("float64", "float32", "int32", "int64", "float16", "bool")]


def _factors(rank: int, n: int, dtype: str) -> np.ndarray:
    """Rank ``rank``'s data for one product: +-1 and +-2 (products exact at W <= 4), or mostly True."""
    rng = np.random.default_rng([50, rank, n, len(dtype)])
    return rng.random(n) < 0.8 if dtype == "bool" else rng.choice([-2, -1, 1, 2], n).astype(dtype)


def _try(fn) -> tuple[str, str]:
    try:
        fn()
        return ("ok", "")
    except (TypeError, ValueError, CollectiveMismatchError) as exc:
        return (type(exc).__name__, str(exc))


# ------------------------------------------------------------------ cases (run on every rank)
def case_reference(rank: int, comm) -> dict:
    """The grouped calls, the factors and product on this rank's :func:`_inputs` (torch tensors among them)."""
    opt, w = _opt(comm), comm.size
    out: dict = {}
    for op in ("sum", "max", "min", "product"):
        arrays = [a.copy() for a in _inputs(rank, w)] + [np.array(rank + 2.0)]  # a 0-d array too
        arrays[3] = torch.from_numpy(arrays[3])
        got = opt.grouped_all_reduce(arrays, op=op)
        out[op] = ([g is a for g, a in zip(got, arrays)], [np.asarray(a).copy() for a in arrays])
    floats = [a for a in _inputs(rank, w) if a.dtype.kind == "f"]
    out["avg"] = opt.grouped_all_reduce(floats, op="avg")
    scaled = [a for a in _inputs(rank, w) if a.dtype != bool]
    out["scaled"] = opt.grouped_all_reduce(scaled, op="sum", prescale_factor=PRE, postscale_factor=POST)
    out["avg_scaled"] = opt.grouped_all_reduce([a for a in _inputs(rank, w) if a.dtype.kind == "f"], op="avg",
                                               prescale_factor=PRE, postscale_factor=POST)
    out["single"] = [opt.all_reduce(_inputs(rank, w)[2], op="sum", prescale_factor=PRE, postscale_factor=POST),
                     opt.all_reduce(_inputs(rank, w)[0], op="product"),
                     opt.reduce_scatter(_inputs(rank, w)[0], op="avg", prescale_factor=PRE, postscale_factor=POST)]
    for op in ("sum", "product", "avg"):
        arrays = [a for a in _inputs(rank, w) if op != "avg" or a.dtype.kind == "f"]
        kept = [a.copy() for a in arrays]
        factors = {"prescale_factor": PRE, "postscale_factor": POST} if op == "avg" else {}
        out[f"rs_{op}"] = opt.grouped_reduce_scatter(arrays, op=op, **factors)
        out[f"rs_{op}_unchanged"] = all(np.array_equal(a, k) for a, k in zip(arrays, kept))
    differ = [np.full((rank, 3), rank, np.float32), np.arange(rank + 1, dtype=np.int64) + 10 * rank,
              np.zeros((0, 2)), torch.full((2, 2), float(rank), dtype=torch.float64), np.ones(rank % 2, bool)]
    out["gather_differ"] = [np.asarray(g) for g in opt.grouped_all_gather(differ)]
    same = _inputs(rank, w)
    out["gather_same"] = opt.grouped_all_gather(same)
    out["empty"] = opt.grouped_all_reduce([]), opt.grouped_all_gather(()), opt.grouped_reduce_scatter([])
    return out


def case_errors(rank: int, comm) -> list:
    """Bad or different arguments on one rank: every rank raises the same error; then the world still works."""
    opt, w = _opt(comm), comm.size
    one = rank == 1
    out = [
        _try(lambda: opt.grouped_all_reduce([np.ones(2)] * (3 if one else 2))),
        _try(lambda: opt.grouped_all_reduce([np.ones(2), np.ones(3 if one else 2)])),
        _try(lambda: opt.grouped_all_reduce([np.ones(2), np.ones(2, np.float32 if one else np.float64)])),
        _try(lambda: opt.grouped_all_gather([np.ones((1, 2)), np.ones((rank + 1, 3 if one else 2))])),
        _try(lambda: opt.grouped_reduce_scatter([np.ones(w), np.ones(w, np.int32 if one else np.int64)])),
        _try(lambda: opt.grouped_all_reduce([np.ones(2), np.ones(2, bool)], prescale_factor=2.0)),
        _try(lambda: opt.grouped_all_reduce([np.ones(2, bool) if one else np.ones(2)], postscale_factor=0.5)),
        _try(lambda: opt.all_reduce(np.ones(2, bool), prescale_factor=0.5)),
        _try(lambda: opt.reduce_scatter(np.ones(w, bool), postscale_factor=3)),
        _try(lambda: opt.all_reduce(np.ones(2), prescale_factor="2")),
        _try(lambda: opt.grouped_all_reduce([], prescale_factor=float("nan"))),
        _try(lambda: opt.all_reduce(np.ones(2), prescale_factor=0.5 if one else 0.25)),
        _try(lambda: opt.grouped_reduce_scatter([np.ones(w), np.array(1.0)])),
        _try(lambda: opt.grouped_reduce_scatter([np.ones(w + (1 if one else 0))])),
        _try(lambda: opt.grouped_all_reduce([np.arange(3)], op="avg")),
        _try(lambda: opt.grouped_all_reduce([np.ones(2)], op="prod")),
        _try(lambda: opt.grouped_all_reduce(np.ones(3))),
        _try(lambda: opt.grouped_all_reduce([np.ones(2), [1.0, 2.0]])),
        _try(lambda: opt.grouped_all_reduce([] if rank == 0 else [np.ones(1)])),
    ]
    t = [np.full(2, rank + 1.0), np.full(3, rank + 1, np.int32)]
    opt.grouped_all_reduce(t)
    out.append(("sum", [a.tolist() for a in t]))
    return out


def case_backend_product(rank: int, comm) -> dict:
    """``"product"`` on the backend itself: small (carried in the control block) and large all-reduces of every
    dtype, and the reduce-scatter (not on torch: gloo's host reduce-scatter table lacks it)."""
    out: dict = {}
    for n, dtype in PRODUCT_CASES:
        a = _factors(rank, n, dtype)
        out[(n, dtype)] = comm.all_reduce(a.copy(), op="product").copy()
        if comm.name != "torch":
            out[("rs", n, dtype)] = np.asarray(comm.reduce_scatter(a.copy(), None, "product"))
    return out


# ------------------------------------------------------------------ references
def _rank_order(parts: list[np.ndarray], op: str) -> np.ndarray:
    ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply}[op]
    if parts[0].dtype == bool:
        ufunc = {"sum": np.logical_or, "max": np.logical_or, "min": np.logical_and, "product": np.logical_and}[op]
    wide = np.float32 if parts[0].dtype == np.float16 else parts[0].dtype
    acc = parts[0].astype(wide)
    for p in parts[1:]:
        acc = ufunc(acc, p.astype(wide))
    return acc.astype(parts[0].dtype)


def _scale(x: np.ndarray, f: float) -> np.ndarray:
    """Horovod's scaling, independently: integers in float64 truncated, 16-bit floats in float32."""
    if x.dtype.kind in "iu":
        return np.trunc(x.astype(np.float64) * f).astype(x.dtype)
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(f)).astype(np.float16)
    return (x * x.dtype.type(f)).astype(x.dtype)


def _close(got, want) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.dtype == np.float64:
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    elif want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-6 if want.dtype == np.float32 else 2e-3)
    else:
        np.testing.assert_array_equal(got, want)


def _check_reference(results: list, w: int) -> None:
    everyone = [_inputs(r, w) for r in range(w)]
    each = lambda i: [everyone[r][i] for r in range(w)]  # noqa: E731
    n = len(everyone[0])
    for rank, res in enumerate(results):
        for op in ("sum", "max", "min", "product"):
            same, arrays = res[op]
            assert all(same)  # in place: the arrays themselves
            for i in range(n):
                want = _rank_order(each(i), op)
                (_close if i == 0 else np.testing.assert_array_equal)(arrays[i], want)
            zero_d = _rank_order([np.array(r + 2.0) for r in range(w)], op)
            assert arrays[n].shape == () and arrays[n] == zero_d
        floats = [i for i in range(n) if everyone[0][i].dtype.kind == "f"]
        for got, i in zip(res["avg"], floats):
            _close(got, (_rank_order(each(i), "sum").astype(np.float64) / w).astype(everyone[0][i].dtype))
        for got, i in zip(res["scaled"], [i for i in range(n) if everyone[0][i].dtype != bool]):
            _close(got, _scale(_rank_order([_scale(x, PRE) for x in each(i)], "sum"), POST))
        for got, i in zip(res["avg_scaled"], floats):
            _close(got, _scale(_rank_order([_scale(x, PRE) for x in each(i)], "sum"), POST / w))
        single = res["single"]
        _close(single[0], _scale(_rank_order([_scale(x, PRE) for x in each(2)], "sum"), POST))
        _close(single[1], np.prod(np.stack(each(0)), axis=0))
        rows = 2 * w // w
        _close(single[2], _scale(_rank_order([_scale(x, PRE) for x in each(0)], "sum"), POST / w)[rank * rows:
                                                                                               (rank + 1) * rows])
        for op in ("sum", "product", "avg"):
            picked = [i for i in range(n) if op != "avg" or everyone[0][i].dtype.kind == "f"]
            assert res[f"rs_{op}_unchanged"] and len(res[f"rs_{op}"]) == len(picked)
            for got, i in zip(res[f"rs_{op}"], picked):
                if op == "avg":
                    full = _scale(_rank_order([_scale(x, PRE) for x in each(i)], "sum"), POST / w)
                else:
                    full = _rank_order(each(i), op)
                k = full.shape[0] // w
                _close(got, full[rank * k:(rank + 1) * k])
        differ = res["gather_differ"]
        np.testing.assert_array_equal(differ[0], np.concatenate([np.full((r, 3), r, np.float32) for r in range(w)]))
        np.testing.assert_array_equal(differ[1], np.concatenate([np.arange(r + 1) + 10 * r for r in range(w)]))
        assert differ[0].dtype == np.float32 and differ[1].dtype == np.int64 and differ[2].shape == (0, 2)
        np.testing.assert_array_equal(differ[3], np.concatenate([np.full((2, 2), float(r)) for r in range(w)]))
        assert differ[4].shape == (sum(r % 2 for r in range(w)),) and differ[4].dtype == bool
        for i, got in enumerate(res["gather_same"]):
            np.testing.assert_array_equal(got, np.concatenate(each(i)))
            assert got.dtype == everyone[0][i].dtype
        assert res["empty"] == ([], [], [])


def _check_errors(results: list, w: int) -> None:
    want = [("CollectiveMismatchError", "grouped_all_reduce: number of arrays differs across ranks (rank 0: 2, "
                                        "rank 1: 3"),
            ("CollectiveMismatchError", "grouped_all_reduce: shape of each array differs across ranks (rank 0: "
                                        "[(2,), (2,)], rank 1: [(2,), (3,)]"),
            ("CollectiveMismatchError", "grouped_all_reduce: dtype of each array differs across ranks (rank 0: "
                                        "['float64', 'float64'], rank 1: ['float64', 'float32']"),
            ("CollectiveMismatchError", "grouped_all_gather: shape beyond the first dimension of each array differs "
                                        "across ranks (rank 0: [(1, 2), (1, 2)], rank 1: [(1, 2), (2, 3)]"),
            ("CollectiveMismatchError", "grouped_reduce_scatter: dtype of each array differs across ranks"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays[1]: prescale_factor=2.0 cannot scale a bool array"),
            ("TypeError", "grouped_all_reduce on rank 1: arrays[0]: postscale_factor=0.5 cannot scale a bool array"),
            ("TypeError", "all_reduce on rank 0: prescale_factor=0.5 cannot scale a bool array"),
            ("TypeError", "reduce_scatter on rank 0: postscale_factor=3.0 cannot scale a bool array"),
            ("TypeError", "all_reduce on rank 0: prescale_factor must be a real number (int or float), got '2'"),
            ("ValueError", "grouped_all_reduce on rank 0: prescale_factor must be finite, got nan"),
            ("CollectiveMismatchError", "all_reduce: arguments differs across ranks (rank 0: {'op': 'sum', "
                                        "'prescale_factor': 0.25"),
            ("ValueError", "grouped_reduce_scatter on rank 0: arrays[1]: grouped_reduce_scatter needs arrays of at "
                           "least 1 dimension, got a 0-d one"),
            ("ValueError", f"grouped_reduce_scatter on rank 1: arrays[0]: grouped_reduce_scatter splits the first "
                           f"dimension into {w} equal chunks"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays[0]: op='avg' is not supported for dtype int64"),
            ("ValueError", "grouped_all_reduce on rank 0: op must be one of ('sum', 'avg', 'max', 'min', 'product'), "
                           "got 'prod'"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays must be a list of arrays or tensors, got ndarray"),
            ("TypeError", "grouped_all_reduce on rank 0: arrays[1]: expected a NumPy/CuPy array or a torch tensor, "
                          "got list"),
            ("CollectiveMismatchError", "grouped_all_reduce: number of arrays differs across ranks (rank 0: 0, rank")]
    for rank, res in enumerate(results):
        assert len(res) == len(want) + 1
        for (kind, text), got in zip(want, res):
            assert got[0] == kind and got[1].startswith(text), (rank, kind, text, got)
        assert res == results[0]  # the same error on every rank
        assert res[-1] == ("sum", [[w * (w + 1) / 2] * 2, [w * (w + 1) // 2] * 3])


def _check_backend_product(results: list, w: int, backend: str) -> None:
    for rank, res in enumerate(results):
        for n, dtype in PRODUCT_CASES:
            want = _rank_order([_factors(r, n, dtype) for r in range(w)], "product")
            np.testing.assert_array_equal(res[(n, dtype)], want)
            assert res[(n, dtype)].dtype == want.dtype
            if backend != "torch":
                counts = [n // w + (r < n % w) for r in range(w)]  # split_counts
                lo = sum(counts[:rank])
                got = res[("rs", n, dtype)]
                np.testing.assert_array_equal(got, want[lo:lo + counts[rank]])
                assert got.dtype == want.dtype


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_grouped_scaled_and_product_against_one_process_reference(backend, world):
    _check_reference(run_case(backend, world, case_reference, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), [p for p in WORLDS if p.values[1] > 1])
def test_bad_and_mismatched_arguments_raise_on_every_rank(backend, world):
    _check_errors(run_case(backend, world, case_errors, timeout=120), world)


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_backend_product_every_dtype(backend, world):
    _check_backend_product(run_case(backend, world, case_backend_product, timeout=120), world, backend)


@pytest.mark.unit
def test_grouped_on_the_single_backend():
    from distopt.comm.single import SingleCommunicator

    opt = _opt(SingleCommunicator())
    a, b = np.array([-7, 7], np.int32), torch.tensor([1.5, -2.5], dtype=torch.float16)
    assert opt.grouped_all_reduce([a, b], op="product", prescale_factor=0.5)[0] is a
    assert a.tolist() == [-3, 3] and b.tolist() == [0.75, -1.25]
    rs = opt.grouped_reduce_scatter([np.arange(4.0), torch.ones(2, 2)], op="avg", postscale_factor=2.0)
    assert rs[0].tolist() == [0.0, 2.0, 4.0, 6.0] and rs[1].tolist() == [[2.0, 2.0]] * 2
    assert [g.tolist() for g in opt.grouped_all_gather([np.ones((2, 1)), torch.zeros(0)])] == [[[1.0], [1.0]], []]
    c = np.ones(2)
    assert opt.grouped_all_reduce(x for x in (c,))[0] is c  # any iterable of arrays, read once


@pytest.mark.unit
def test_scale_precision_is_horovods():
    ints = np.array([-7, 7, 100], np.int64)
    assert scale_in_place(ints, 0.5).tolist() == [-3, 3, 50]  # float64, truncated toward zero (C++'s cast)
    half = np.array([0.1, 3.0], np.float16)
    want = (half.astype(np.float32) * np.float32(1 / 3)).astype(np.float16)  # float32, rounded once
    assert scale_in_place(half, 1 / 3).tobytes() == want.tobytes()
    single = np.array([0.1, 3.0], np.float32)
    assert scale_in_place(single.copy(), 0.1).tobytes() == (single * np.float32(0.1)).tobytes()
    flags = np.array([True, False])
    assert scale_in_place(flags, 1.0) is flags and check_scale("prescale_factor", 1, bool) == 1.0
    with pytest.raises(TypeError, match="prescale_factor=2.0 cannot scale a bool array"):
        check_scale("prescale_factor", 2.0, bool)
    with pytest.raises(TypeError, match="must be a real number"):
        check_scale("postscale_factor", True, np.float32)
    with pytest.raises(ValueError, match="must be finite"):
        check_scale("postscale_factor", float("inf"), np.float32)
    assert check_scale("prescale_factor", np.float32(0.5), np.int8) == 0.5


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.unit
def test_dense_predivide_is_horovods_gradient_predivide_factor(world):
    """``Dense(predivide=f)``: ``(f / W) * sum_r((1 / f) * g_r)``, rank order, bitwise; a lone gradient above the
    view threshold (reduced in place) and a packed bucket, float32 and float64."""
    from distopt.strategies import Dense
    from tests.support.simworld import run_world

    f = 8.0 / 3.0

    def grads(rank):
        rng = np.random.default_rng(7 + rank)
        return [rng.standard_normal(70_000).astype(np.float32), rng.standard_normal((3, 4)), rng.standard_normal(5)]

    def body(rank, comm):
        opt = distopt.DistOpt(distopt.SGD(lr=1.0), comm=comm, abort_on_exception=False,
                              strategy=Dense(predivide=f))
        params = [np.zeros_like(g) for g in grads(0)]
        opt.sync_params(params)
        opt.step(params, grads(rank))
        return params

    everyone = [grads(r) for r in range(world)]
    for params in run_world(world, body):
        for i, got in enumerate(params):
            parts = [scale_in_place(everyone[r][i].copy(), 1.0 / f) for r in range(world)]
            total = parts[0].copy()
            for p in parts[1:]:
                total += p
            want = -scale_in_place(total, f / world)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), i
            np.testing.assert_allclose(got, -np.mean([e[i] for e in everyone], axis=0), rtol=1e-5, atol=1e-6)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="predivide must be finite and > 0"):
            Dense(predivide=bad)
    assert Dense().settings() == {} and Dense(predivide=2).settings() == {"predivide": 2.0}
