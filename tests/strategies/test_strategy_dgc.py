"""DGC (:mod:`distopt.strategies.dgc`) in a simulated world of threads: the paper's math by hand.

Warm-up, momentum correction and masking against hand-computed values (3
steps at W=2), the per-tensor selection, the local clipping at
``clip_norm / sqrt(W)``, the refusal of a local optimizer with its own
momentum before any collective, and the constructor's checks. The generic
invariants run in ``tests/strategies/test_strategy_conformance.py``; error-feedback
mass in ``tests/strategies/test_strategy_memory.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt import SGD, DistOpt
from distopt.strategies import DGC
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- DGC, by hand
# W=2, one bucket of 8 float32 elements, the same gradient every step per rank, momentum 0.5,
# warm-up: step 0 at 75 % sparsity (k=2: 2 ranks x 2 pairs x 8 bytes = 32 >= 32 dense bytes, so the
# selection travels densely), steps 1 and 2 at 87.5 % (k=1, 16 < 32 bytes: pairs).
#
# rank 0, g = [4, 1, 0, 0, 0, 0, 0, 2]:
#   step 0: u = g;                       v = u = [4, 1, 0.., 2];          send {0: 4, 7: 2}; v = u = [0, 1, 0..]
#   step 1: u = .5u + g = [4, 1.5, .., 2]; v += u -> [4, 2.5, .., 2];     send {0: 4};  v = [0, 2.5, .., 2], u = [0, 1.5, .., 2]
#   step 2: u = [4, 1.75, .., 3];        v = [4, 4.25, .., 5];            send {7: 5};  v = [4, 4.25, 0..], u = [4, 1.75, 0..]
# rank 1, g = [1, 0, 3, 0, 0, 0, 0, .5]:
#   step 0: v = g;                       send {2: 3, 0: 1};  v = u = [0.., .5]
#   step 1: u = [1, 0, 3, .., .75];      v = [1, 0, 3, .., 1.25];         send {2: 3};  v = [1, 0.., 1.25], u = [1, 0.., .75]
#   step 2: u = [1.5, 0, 3, .., .875];   v = [2.5, 0, 3, .., 2.125];      send {2: 3};  v = [2.5, 0.., 2.125], u = [1.5, 0.., .875]
# applied averages: step 0 [2.5, 0, 1.5, 0, 0, 0, 0, 1], step 1 [2, 0, 1.5, 0..], step 2 [0, 0, 1.5, 0, 0, 0, 0, 2.5]
HAND_GRADS = [[4, 1, 0, 0, 0, 0, 0, 2], [1, 0, 3, 0, 0, 0, 0, 0.5]]
HAND_APPLIED = [[2.5, 0, 1.5, 0, 0, 0, 0, 1], [2, 0, 1.5, 0, 0, 0, 0, 0], [0, 0, 1.5, 0, 0, 0, 0, 2.5]]
HAND_STATE = {0: ([4, 1.75, 0, 0, 0, 0, 0, 0], [4, 4.25, 0, 0, 0, 0, 0, 0]),          # (u, v) after step 2
              1: ([1.5, 0, 0, 0, 0, 0, 0, 0.875], [2.5, 0, 0, 0, 0, 0, 0, 2.125])}


def test_dgc_warmup_momentum_correction_and_masking_by_hand_w2():
    def rank_fn(rank, comm):
        strategy = DGC(sparsity=0.875, momentum=0.5, warmup_steps=1, warmup_sparsity=(0.75,))
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=strategy)
        w = np.zeros(8, np.float32)
        opt.sync_params([w])
        applied, wire = [], []
        for _ in range(3):
            before = w.copy()
            sent_before = opt.stats.wire_bytes
            opt.step([w], [np.array(HAND_GRADS[rank], np.float32)])
            applied.append(before - w)
            wire.append(opt.stats.wire_bytes - sent_before)
        (u,), (v,) = strategy.velocity.buffers.values(), strategy.accumulated.buffers.values()
        return applied, wire, u.copy(), v.copy(), strategy.state_dict()["steps"], dict(opt.stats)

    for rank, (applied, wire, u, v, steps, stats) in enumerate(run_world(2, rank_fn)):
        np.testing.assert_array_equal(np.array(applied), np.array(HAND_APPLIED, np.float32))
        np.testing.assert_array_equal(u, np.array(HAND_STATE[rank][0], np.float32))
        np.testing.assert_array_equal(v, np.array(HAND_STATE[rank][1], np.float32))
        assert wire == [32, 8, 8]  # dense transport, then one (int32, float32) pair per step
        assert stats["sparse_dense_fallbacks"] == 1 and stats["sparse_entries"] == 4
        assert steps == 3


def test_dgc_default_warmup_schedule_by_step():
    dgc = DGC(warmup_steps=10)  # the paper's 75 %, 93.75 %, 98.4375 %, 99.6 %, then 99.9 %
    assert [dgc.density(s) for s in (0, 9, 10, 19, 20, 30, 39, 40, 10**6)] == \
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.004, 0.004, 0.001, 0.001]
    assert DGC().density(0) == 0.001  # no warm-up
    assert DGC(sparsity=0.999).density(0) * 431080 == 431.08  # decimal form: k = 432, not 433


def test_dgc_selects_per_tensor_not_per_bucket():
    """Two tensors fused in one bucket, one with 100x larger gradients: each still sends its own top 1."""
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=DGC(sparsity=0.9, momentum=0.0))
        params = [np.zeros(10), np.zeros((2, 5))]
        opt.sync_params(params)
        grads = [np.arange(1.0, 11.0) * 100, np.arange(1.0, 11.0).reshape(2, 5)]
        opt.step(params, grads)
        return [np.flatnonzero(p).tolist() for p in params], opt.stats.wire_bytes

    (nonzero, wire), = run_world(1, rank_fn)
    assert nonzero == [[9], [9]] and wire == 2 * (4 + 8)  # int32 index, float64 value


def test_dgc_clips_each_ranks_gradient_to_norm_over_sqrt_w():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=1.0), comm=comm, strategy=DGC(sparsity=0.0, momentum=0.0, clip_norm=2.0))
        w = np.zeros(4)
        opt.sync_params([w])
        opt.step([w], [np.array([3.0, 4.0, 0, 0]) * (rank + 1)])  # norms 5 and 10, bound 2/sqrt(4) = 1
        return -w

    for applied in run_world(4, rank_fn):
        np.testing.assert_allclose(applied, [0.6, 0.8, 0, 0], rtol=0, atol=1e-15)


def test_dgc_refuses_distopt_sgd_with_momentum_before_any_collective():
    def rank_fn(rank, comm):
        opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=DGC())
        w = np.zeros(3)
        opt.sync_params([w])
        calls = len(comm.calls)
        with pytest.raises(ValueError, match=r"distopt\.SGD\.momentum is 0\.9, expected 0.*DGC\(momentum=0\.9"):
            opt.step([w], [np.ones(3)])
        return len(comm.calls) - calls

    assert run_world(2, rank_fn) == [0, 0]


def test_dgc_refuses_torch_sgd_with_momentum():
    torch = pytest.importorskip("torch")

    def rank_fn(rank, comm):
        model = torch.nn.Linear(3, 2)
        groups = [{"params": [model.weight]}, {"params": [model.bias], "momentum": 0.5}]
        opt = DistOpt(torch.optim.SGD(groups, lr=0.1, momentum=0.0), comm=comm, strategy=DGC())
        with pytest.raises(ValueError, match=r"torch\.optim\.SGD\.param_groups\[1\]\['momentum'\] is 0\.5"):
            opt.backward_and_update(model(torch.ones(4, 3)).sum())
        opt.close()  # its hooks leave the model (and it closes the world's communicator)
        from distopt.comm import create

        ok = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1), comm=create("single"), strategy=DGC(sparsity=0.5))
        ok.backward_and_update(model(torch.ones(4, 3)).sum())  # momentum 0: runs
        return ok.stats.steps

    assert run_world(1, rank_fn) == [1]


def test_dgc_constructor_arguments_are_checked():
    assert DGC() == DGC() and hash(DGC()) == hash(DGC()) and DGC() != DGC(sparsity=0.99)  # settings hashable
    for bad, match in [(dict(sparsity=1.0), "sparsity must be in"), (dict(momentum=1.0), "momentum must be"),
                       (dict(clip_norm=0.0), "clip_norm must be"), (dict(warmup_steps=-1), "warmup_steps"),
                       (dict(warmup_sparsity=(0.5, 1.5)), r"warmup_sparsity\[1\]")]:
        with pytest.raises(ValueError, match=match):
            DGC(**bad)
