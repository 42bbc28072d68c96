"""Horovod's tests of grouped collectives, pre/postscale and Product, rewritten against distopt's names.

Each ``case_*`` is a ``test_horovod_*`` of Horovod's ``test/parallel/test_torch.py`` (named in its docstring) with
the same inputs and assertions, run on every rank (:func:`tests.support.backends.run_case`): in the simulated world
at W = 1, 2, 4 (not 3: Horovod's float16 references, ``fp16(x) * 3`` in float32, are not float16 numbers, and its
threshold there is 0) and on real processes: MPI at W = 2 and 4 (``mpiexec``), shm and torch.distributed (gloo) at
W = 2, on the run-long worker pools, each under the harness's hard timeout. CPU tensors only (the CUDA dtypes and
``test_horovod_grouped_allreduce_cpu_gpu_error`` need GPUs). What differs from Horovod, by design:

* distopt's ``all_reduce`` and ``grouped_all_reduce`` are in place (Horovod's ``allreduce_`` and
  ``grouped_allreduce_``), so the out-of-place tests pass clones;
* integer averaging is refused (TypeError on every rank) where Horovod floor-divides: those dtypes assert the refusal;
* ``op`` defaults to ``"sum"`` (Horovod's grouped reducescatter: Average), so every call names its op.

The one-process references (distinct data per rank) and the bad-input errors are in ``test_grouped_reference.py``.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import distopt
from distopt.comm.groups import split
from tests.support.sim_split import sim_can_split  # noqa: F401 (autouse: simulated ranks split)
from tests.support.backends import run_case, tiered

torch = pytest.importorskip("torch")

WORLDS = tiered([("sim", 1), ("sim", 2), ("sim", 4), ("mpi", 2), ("mpi", 4), ("shm", 2), ("torch", 2)])
INT_TYPES = (torch.int32, torch.int64)
#: Horovod's CPU dtypes for reductions (IntTensor, LongTensor, FloatTensor, DoubleTensor, HalfTensor) and gathers.
REDUCE_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64, torch.float16)
GATHER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64,
                 torch.float16)
DIMS = (1, 2, 3)




def _opt(comm):
    return distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm, abort_on_exception=False)


def _threshold(size: int, dtype) -> float:
    """Horovod's: exact up to 3 ranks and for integers, then 1e-4 (below 10 ranks)."""
    return 0 if size <= 3 or dtype in INT_TYPES else 1e-4


def _fp32(*values):
    """Horovod's ``convert_cpu_fp16_to_fp32``."""
    return [v.float() if v.dtype == torch.float16 else v for v in values]


def _wide(tensor):
    """Horovod's reference precision of scaling (CPU): integers in float64, float16 in float32, others their own."""
    dtype = tensor.dtype
    return tensor.to(torch.float32 if dtype == torch.float16 else torch.float64 if dtype in INT_TYPES else dtype)


def _scaled(factor: float, tensor, dtype):
    """Horovod's reference: ``factor * tensor`` in :func:`_wide`'s precision, cast back to ``dtype``."""
    wide = _wide(tensor.to(dtype))
    return (torch.tensor(factor, dtype=torch.float64).to(wide.dtype) * _wide(tensor)).to(dtype)


def _sets(comm, rank: int):
    """Horovod's even and odd process sets: (this rank's group, its members, both groups)."""
    evens, odds = list(range(0, comm.size, 2)), list(range(1, comm.size, 2))
    groups = split(comm, evens, name="even"), split(comm, odds, name="odd")
    return (groups[0], evens, groups) if rank % 2 == 0 else (groups[1], odds, groups)


def _close(groups) -> None:
    for group in groups:
        group.close()


def _random(gen, *shape):
    """Horovod's ``torch.FloatTensor(*shape).random_(-100, 100)`` after ``torch.manual_seed(1234)``, drawn from a
    generator of this case's own (the simulated world's ranks are threads of one process)."""
    return torch.FloatTensor(*shape).random_(-100, 100, generator=gen)


# ------------------------------------------------------------------ cases (run on every rank)
def case_grouped_allreduce(rank: int, comm) -> int:
    """test_horovod_grouped_allreduce, _average, _inplace and _process_sets."""
    opt, size, checks = _opt(comm), comm.size, 0
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        gen = torch.Generator().manual_seed(1234)
        tensors = [_random(gen, *([17] * dim)).to(dtype) for _ in range(5)]
        summed = opt.grouped_all_reduce([t.clone() for t in tensors], op="sum")
        pairs = [_fp32(t, s) for t, s in zip(tensors, summed)]
        multiplied = [t * size for t, _ in pairs]
        assert all(torch.allclose(s, m, _threshold(size, dtype)) for (_, s), m in zip(pairs, multiplied))
        # _average
        if dtype in INT_TYPES:
            with pytest.raises(TypeError, match=r"grouped_all_reduce on rank 0: arrays\[0\]: op='avg'"):
                opt.grouped_all_reduce([t.clone() for t in tensors], op="avg")
        else:
            averaged = opt.grouped_all_reduce([t.clone() for t in tensors], op="avg")
            assert all(torch.allclose(*_fp32(a, t), _threshold(size, dtype)) for a, t in zip(averaged, tensors))
        # _inplace
        gen = torch.Generator().manual_seed(1234)
        raw = [_random(gen, *([17] * dim)) for _ in range(5)]
        multiplied = [(t * size).to(dtype) for t in raw]
        inplace = [t.to(dtype) for t in raw]
        opt.grouped_all_reduce(inplace, op="sum")
        assert all(torch.allclose(*_fp32(t, m), _threshold(size, dtype)) for t, m in zip(inplace, multiplied))
        checks += 3
    if size < 2:
        return checks
    group, members, groups = _sets(comm, rank)
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):  # _process_sets
        gen = torch.Generator().manual_seed(1234)
        even = [_random(gen, *([17] * dim)) for _ in range(5)]
        odd = [_random(gen, *([17] * dim)) for _ in range(5)]
        tensors = [t.to(dtype) for t in (even if rank % 2 == 0 else odd)]
        summed = opt.grouped_all_reduce([t.clone() for t in tensors], op="sum", group=group)
        pairs = [_fp32(t, s) for t, s in zip(tensors, summed)]
        assert all(torch.allclose(s, t * len(members), _threshold(len(members), dtype)) for t, s in pairs)
        checks += 1
    _close(groups)
    return checks


def case_grouped_allgather(rank: int, comm) -> int:
    """test_horovod_grouped_allgather and _process_sets."""
    opt, size, checks = _opt(comm), comm.size, 0
    group, members, groups = _sets(comm, rank) if size > 1 else (None, [0], ())
    for (target, ranks), dtype, dim in itertools.product(((None, list(range(size))), (group, members)),
                                                        GATHER_DTYPES, DIMS):
        tensors = [torch.FloatTensor(*([17] * dim)).fill_(1).mul_(rank).to(dtype) for _ in range(5)]
        gathered = opt.grouped_all_gather(tensors, group=target)
        gathered = [_fp32(g)[0] for g in gathered]
        assert all(list(g.shape) == [17 * len(ranks)] + [17] * (dim - 1) for g in gathered)
        for g in gathered:
            for i, value in enumerate(ranks):
                rank_tensor = g[i * 17:(i + 1) * 17]
                assert list(rank_tensor.shape) == [17] * dim
                assert rank_tensor.data.min() == value and rank_tensor.data.max() == value
        checks += 1
    _close(groups)
    return checks


def case_grouped_reducescatter(rank: int, comm) -> int:
    """test_horovod_grouped_reducescatter, _average, _prescale, _postscale, _scalar_error and _process_sets."""
    opt, size, checks = _opt(comm), comm.size, 0
    factors = {"prescale": np.random.RandomState(12345), "postscale": np.random.RandomState(12345)}  # np.random.seed
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
        threshold = _threshold(size, dtype)
        gen = torch.Generator().manual_seed(1234)
        tensors = [_random(gen, *([size * 4] * dim)).to(dtype) for _ in range(5)]
        summed = opt.grouped_reduce_scatter(tensors, op="sum")
        pairs = [_fp32(t, s) for t, s in zip(tensors, summed)]
        assert all(torch.allclose(t[rank * 4:(rank + 1) * 4] * size, s, threshold) for t, s in pairs)
        if dtype in INT_TYPES:  # _average
            with pytest.raises(TypeError, match="op='avg'"):
                opt.grouped_reduce_scatter(tensors, op="avg")
        else:
            averaged = opt.grouped_reduce_scatter(tensors, op="avg")
            pairs = [_fp32(t, a) for t, a in zip(tensors, averaged)]
            assert all(torch.allclose(t[rank * 4:(rank + 1) * 4], a, threshold) for t, a in pairs)
        for scale in ("prescale", "postscale"):  # _prescale, _postscale
            factor = factors[scale].uniform()
            gen = torch.Generator().manual_seed(1234)
            tensors = [_random(gen, *([size * 4] * dim)).to(dtype) for _ in range(5)]
            got = opt.grouped_reduce_scatter(tensors, op="sum", **{f"{scale}_factor": factor})
            if scale == "prescale":
                expected = [_fp32(_scaled(factor, t, dtype))[0][rank * 4:(rank + 1) * 4] * size for t in tensors]
            else:
                expected = [_fp32(_scaled(factor, size * _wide(t), dtype))[0][rank * 4:(rank + 1) * 4]
                            for t in tensors]
            assert all(torch.allclose(e, _fp32(g)[0], threshold) for e, g in zip(expected, got))
        checks += 4
    scalar, tensor = torch.tensor(float(rank)), torch.zeros((3, 1))  # _scalar_error
    with pytest.raises(ValueError, match=r"grouped_reduce_scatter on rank 0: arrays\["):
        opt.grouped_reduce_scatter([tensor, scalar])
    if size < 2:
        return checks + 1
    group, members, groups = _sets(comm, rank)
    me, n = members.index(rank), len(members)
    for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):  # _process_sets
        gen = torch.Generator().manual_seed(1234)
        even = [_random(gen, *([len(range(0, size, 2)) * 4] * dim)) for _ in range(5)]
        odd = [_random(gen, *([len(range(1, size, 2)) * 4] * dim)) for _ in range(5)]
        tensors = [t.to(dtype) for t in (even if rank % 2 == 0 else odd)]
        summed = opt.grouped_reduce_scatter(tensors, op="sum", group=group)
        expected = [t[me * 4:(me + 1) * 4] * n for t in tensors]
        assert all(torch.allclose(*_fp32(e, s), _threshold(n, dtype)) for e, s in zip(expected, summed))
        checks += 1
    _close(groups)
    return checks + 1


def case_allreduce_product(rank: int, comm) -> int:
    """test_horovod_allreduce_product."""
    opt, size, checks = _opt(comm), comm.size, 0
    for dtype, dim in itertools.product((torch.int32, torch.int64, torch.float32, torch.float64), DIMS):
        gen = torch.Generator().manual_seed(1234)
        tensors = _random(gen, size, *([17] * dim)).to(dtype)
        result = opt.all_reduce(tensors[rank, ...].clone(), op="product")
        reference = tensors.prod(0).to(dtype)
        assert torch.allclose(result, reference, _threshold(size, dtype))
        checks += 1
    return checks


def case_allreduce_scale(rank: int, comm) -> int:
    """test_horovod_allreduce_prescale and _postscale."""
    opt, size, checks = _opt(comm), comm.size, 0
    for scale, dtype, dim in itertools.product(("prescale", "postscale"), REDUCE_DTYPES, DIMS):
        gen = torch.Generator().manual_seed(1234)
        factor = np.random.RandomState(1234).uniform()  # np.random.seed(1234); np.random.uniform()
        tensor = _random(gen, *([17] * dim)).to(dtype)
        summed = opt.all_reduce(tensor.clone(), op="sum", **{f"{scale}_factor": factor})
        if scale == "prescale":
            multiplied = _fp32(_scaled(factor, tensor, dtype))[0] * size
        else:
            multiplied = _fp32(_scaled(factor, size * _wide(tensor), dtype))[0]
        assert torch.allclose(_fp32(summed)[0], multiplied, _threshold(size, dtype))
        checks += 1
    return checks


def case_reducescatter_scale(rank: int, comm) -> int:
    """test_horovod_reducescatter_prescale and _postscale."""
    opt, size, checks = _opt(comm), comm.size, 0
    for scale in ("prescale", "postscale"):
        factors = np.random.RandomState(12345)  # np.random.seed(12345), of this case's own
        for dtype, dim in itertools.product(REDUCE_DTYPES, DIMS):
            gen = torch.Generator().manual_seed(1234)
            factor = factors.uniform()
            tensor = _random(gen, *([size * 4] * dim)).to(dtype)
            summed = opt.reduce_scatter(tensor, op="sum", **{f"{scale}_factor": factor})
            if scale == "prescale":
                expected = _fp32(_scaled(factor, tensor, dtype))[0][rank * 4:(rank + 1) * 4] * size
            else:
                expected = _fp32(_scaled(factor, size * _wide(tensor), dtype))[0][rank * 4:(rank + 1) * 4]
            summed = _fp32(summed)[0]
            assert list(summed.shape) == list(expected.shape)
            assert summed.data.sub(expected).max() <= _threshold(size, dtype)
            checks += 1
    return checks


def case_async_grouped(rank: int, comm) -> dict:
    """One handle for the whole group (Horovod's grouped ``*_async``), results in input order."""
    opt, size = _opt(comm), comm.size
    tensors = [torch.full((2 * size, 3), rank + 1.0), torch.arange(2 * size, dtype=torch.int64) + rank]
    handles = {"sum": opt.grouped_all_reduce([t.clone() for t in tensors], op="sum", async_op=True,
                                             postscale_factor=0.5),
               "gather": opt.grouped_all_gather(tensors, async_op=True),
               "rs": opt.grouped_reduce_scatter(tensors, op="max", async_op=True)}
    out = {name: [t.tolist() for t in h.wait()] for name, h in handles.items()}
    out["handle"] = type(handles["sum"]).__name__
    opt.close()
    return out


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_allreduce(backend, world):
    assert run_case(backend, world, case_grouped_allreduce, timeout=180) == \
        [45 + (15 if world > 1 else 0)] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_allgather(backend, world):
    assert run_case(backend, world, case_grouped_allgather, timeout=180) == [48] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_grouped_reducescatter(backend, world):
    assert run_case(backend, world, case_grouped_reducescatter, timeout=180) == \
        [61 + (15 if world > 1 else 0)] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_allreduce_product(backend, world):
    assert run_case(backend, world, case_allreduce_product, timeout=120) == [12] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_allreduce_prescale_and_postscale(backend, world):
    assert run_case(backend, world, case_allreduce_scale, timeout=120) == [30] * world


@pytest.mark.parametrize(("backend", "world"), WORLDS)
def test_horovod_reducescatter_prescale_and_postscale(backend, world):
    assert run_case(backend, world, case_reducescatter_scale, timeout=120) == [30] * world


@pytest.mark.parametrize(("backend", "world"), [p for p in WORLDS if p.values[0] != "sim"])
def test_grouped_async_one_handle(backend, world):
    for rank, res in enumerate(run_case(backend, world, case_async_grouped, timeout=120)):
        tri = world * (world + 1) / 2
        assert res["handle"] == "CollectiveHandle"
        assert res["sum"] == [[[tri / 2] * 3] * (2 * world), [(2 * i * world + world * (world - 1)) // 4
                                                             for i in range(2 * world)]]
        assert res["gather"][0] == [[r + 1.0] * 3 for r in range(world) for _ in range(2 * world)]
        assert res["gather"][1] == [i + r for r in range(world) for i in range(2 * world)]
        assert res["rs"] == [[[float(world)] * 3] * 2, [2 * rank + world - 1, 2 * rank + world]]
