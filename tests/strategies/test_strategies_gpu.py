"""Every registered strategy on CuPy arrays over the NCCL backend gives its NumPy twin's bits, at W = 2, 3
and 4, and replicas stay identical; the step's host synchronisations do not grow with the number of
tensors (findings F13, F14).

The NCCL worlds are threads, one device each: the stand-in's machine has
them; a real machine needs W GPUs (else the cases skip). The NumPy twin runs
the same script over the simulated world's host communicator.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.strategies import DGC
from distopt.strategies.registry import REGISTRY, Example
from tests.support.gpu import devices, is_standin, load_cupy, run_nccl_world
from tests.support.simworld import run_world
from tests.support.strategy_data import SHAPES, grads_for, params_for

pytestmark = [pytest.mark.gpu, pytest.mark.unit]
cupy = load_cupy()

EXAMPLES = {**REGISTRY, "dgc-clip": Example("dgc-clip", DGC, {"sparsity": 0.75, "momentum": 0.9, "clip_norm": 3.0,
                                                               "warmup_steps": 1, "warmup_sparsity": (0.5,)},
                                             local_momentum=0.0)}


def _train(example: Example | None, size: int, on_gpu: bool, steps: int = 4, **options) -> list[list[np.ndarray]]:
    """Every rank's parameters after ``steps`` steps of ``example`` (None: DistOpt's default strategy, with
    ``options``), on CuPy over NCCL or on NumPy."""
    def rank_fn(rank, comm):
        strategy = {} if example is None else {"strategy": example.build()}  # one object per rank
        momentum = 0.9 if example is None else example.local_momentum
        opt = DistOpt(SGD(lr=0.05, momentum=momentum), comm=comm, **options, **strategy)
        params = [p.astype(np.float32) for p in params_for(SHAPES)]
        if on_gpu:
            params = [cupy.asarray(p) for p in params]
        opt.sync_params(params)
        for s in range(steps):
            grads = grads_for(s, rank, SHAPES, np.float32)
            opt.step(params, [cupy.asarray(g) for g in grads] if on_gpu else grads, threshold=100)
        return [cupy.asnumpy(p) if on_gpu else p for p in params]

    return run_nccl_world(size, rank_fn, timeout=120) if on_gpu else run_world(size, rank_fn, timeout=120)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_strategy_on_cupy_over_nccl_equals_numpy_twin(kind, size):
    example = EXAMPLES[kind]
    for module in example.requires:
        pytest.importorskip(module)
    if example.worlds is not None and size not in example.worlds:
        pytest.skip(f"{kind} runs at world sizes {example.worlds}")
    if kind == "half-bf16" and int(cupy.__version__.split(".")[0]) < 14:
        pytest.skip("bfloat16 on the device needs CuPy 14")
    twin = _train(example, size, on_gpu=False)
    with devices(size):
        gpu = _train(example, size, on_gpu=True)
    for rank in range(size):
        for got, expect in zip(gpu[rank], twin[rank]):
            np.testing.assert_array_equal(got, expect, err_msg=f"{kind}, rank {rank} of {size}")
        if example.build().identical_replicas:  # Partial averages one chunk a step: replicas differ by design
            for got, first in zip(gpu[rank], gpu[0]):
                np.testing.assert_array_equal(got, first, err_msg=f"{kind}: rank {rank} differs from rank 0")


def _syncs_per_step(tensors: int, **kwargs) -> int:
    """The stand-in's host synchronisations in one step (after a first one) of ``tensors`` gradients at
    world size 1 over NCCL."""
    counts = []

    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm, **kwargs)
        params = [cupy.zeros(64, dtype=cupy.float32) for _ in range(tensors)]
        for step in range(2):
            grads = [cupy.full(64, step + 1.0, dtype=cupy.float32) for _ in range(tensors)]
            before = cupy._state.counters.host_syncs
            opt.step(params, grads, threshold=64)  # a bucket per tensor
            counts.append(cupy._state.counters.host_syncs - before)

    with devices(1):
        run_nccl_world(1, rank_fn)
    return counts[-1]


@pytest.mark.skipif(not is_standin(cupy), reason="counts the stand-in's host synchronisations")
def test_f13_check_finite_syncs_once_per_step_whatever_the_tensor_count():
    """F13: the finiteness checks are one fused flag read each per step, not one ``bool()`` per gradient:
    one of the gradients before the reduction (the step's agreement) and one of the reduced ones (an
    overflowing sum of finite values)."""
    assert _syncs_per_step(40, check_finite=True) == _syncs_per_step(4, check_finite=True) == 2


@pytest.mark.skipif(not is_standin(cupy), reason="counts the stand-in's host synchronisations")
def test_f14_dgc_clipping_stays_on_the_device():
    """F14: DGC's per-bucket clipping compares and scales on the device: no host synchronisation per
    bucket (the selection of small tensors needs none either)."""
    def dgc():
        return DGC(sparsity=0.5, momentum=0.9, clip_norm=1.0, warmup_steps=0)

    assert _syncs_per_step(40, strategy=dgc()) == _syncs_per_step(4, strategy=dgc())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("zero", [1, 2])
def test_f21_zero_on_cupy_over_nccl_equals_numpy_twin(zero, size):
    """F21: ZeRO's sharded collectives through NCCL at W > 1, with segments of unequal length (NCCL's
    padded paths): ``zero=1|2`` on CuPy arrays give the NumPy twin's bits, every rank the same."""
    twin = _train(None, size, on_gpu=False, steps=3, zero=zero)
    with devices(size):
        gpu = _train(None, size, on_gpu=True, steps=3, zero=zero)
    for rank in range(size):
        for got, expect, first in zip(gpu[rank], twin[rank], gpu[0]):
            np.testing.assert_array_equal(got, expect)
            np.testing.assert_array_equal(got, first)
