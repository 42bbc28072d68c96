"""The handed cases H32-H37 and H47 with a PyTorch optimizer, 2 ranks in a simulated world."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.support.failing_backward import FailingBackward  # noqa: E402

from distopt import CollectiveMismatchError, CollectiveTimeoutError, DistOpt  # noqa: E402
from distopt.strategies import Half  # noqa: E402
from tests.support.simworld import RankFailed, run_world  # noqa: E402

pytestmark = pytest.mark.unit

OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])


def linear_loss(params: list[Any], coeffs: list[Any]) -> Any:
    return sum((p * c).sum() for p, c in zip(params, coeffs))


@OVERLAP
def test_h32_clip_grad_norm_acts_on_the_average(overlap):
    def rank_fn(rank, comm):
        p = torch.zeros(2, requires_grad=True)
        opt = DistOpt(torch.optim.SGD([p], lr=1.0), comm=comm, overlap=overlap)
        g = torch.tensor([6.0, 8.0]) if rank == 0 else torch.zeros(2)
        linear_loss([p], [g]).backward()
        torch.nn.utils.clip_grad_norm_([p], 5.0)
        opt.step()
        return p.detach().clone(), [c for c, _ in comm.calls].count("all_reduce_async")

    for p, reduces in run_world(2, rank_fn):
        assert p.tolist() == pytest.approx([-3.0, -4.0], abs=2e-6)  # torch clips by 5 / (5 + 1e-6)
        assert reduces == 1  # one gradient bucket: clipping did not reduce again


@OVERLAP
def test_h33_non_finite_skip_is_decided_on_the_reduced_gradient(overlap):
    def rank_fn(rank, comm):
        p = torch.zeros(2, requires_grad=True)
        opt = DistOpt(torch.optim.SGD([p], lr=1.0), comm=comm, overlap=overlap, check_finite=True)
        out = []
        for g in ([float("inf"), 1.0] if rank == 0 else [1.0, 1.0], [1.0, 1.0] if rank == 0 else [3.0, 3.0]):
            opt.zero_grad()
            linear_loss([p], [torch.tensor(g)]).backward()
            opt.step()
            out.append((p.detach().clone().tolist(), opt.stats["skipped_steps"]))
        return out

    for out in run_world(2, rank_fn):
        assert out == [([0.0, 0.0], 1), ([-2.0, -2.0], 1)]


@OVERLAP
def test_h33c_overflowing_half_precision_sum_is_skipped(overlap):
    def rank_fn(rank, comm):  # noqa: ARG001
        p = torch.zeros(2, requires_grad=True)
        opt = DistOpt(torch.optim.SGD([p], lr=1e-5), comm=comm, overlap=overlap, check_finite=True,
                      strategy=Half(wire="float16", predivide=1.0))
        linear_loss([p], [torch.tensor([40000.0, 1.0])]).backward()
        opt.step()
        return p.detach().clone().tolist(), opt.stats["skipped_steps"]

    for p, skipped in run_world(2, rank_fn):
        assert p == [0.0, 0.0] and skipped == 1


@OVERLAP
def test_h34_frozen_parameter_in_the_optimizer(overlap):
    def rank_fn(rank, comm):
        w1, w2 = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
        f = torch.ones(2, requires_grad=False)
        opt = DistOpt(torch.optim.SGD([w1, w2, f], lr=1.0), comm=comm, overlap=overlap)
        r = rank + 1.0
        linear_loss([w1, w2, f], [torch.full((2,), r), torch.full((2,), 10 * r), torch.full((2,), 100 * r)]).backward()
        opt.step()
        f.requires_grad_(True)  # unfrozen between steps: the layout follows on every rank
        w2.requires_grad_(False)
        opt.zero_grad()
        linear_loss([w1, w2, f], [torch.full((2,), r), torch.full((2,), 10 * r), torch.full((2,), 100 * r)]).backward()
        opt.step()
        return [t.detach().clone().tolist() for t in (w1, w2, f)]

    for w1, w2, f in run_world(2, rank_fn):
        assert w1 == [-3.0, -3.0] and w2 == [-15.0, -15.0] and f == [-149.0, -149.0]


def test_h35_buffers_broadcast_at_construction_and_synced_on_demand():
    def rank_fn(rank, comm):
        bn = torch.nn.BatchNorm1d(2)
        if rank == 0:
            with torch.no_grad():
                bn.weight.copy_(torch.tensor([5.0, 6.0]))
                bn.running_mean.copy_(torch.tensor([1.0, 2.0]))
                bn.running_var.copy_(torch.tensor([3.0, 4.0]))
        opt = DistOpt(torch.optim.SGD(bn.parameters(), lr=0.1), comm=comm, model=bn)
        after_wrap = (bn.weight.detach().clone(), bn.running_mean.clone(), bn.running_var.clone())
        x = torch.tensor([[0.0, 0.0], [2.0, 2.0]]) + 10 * rank
        bn(x).sum().backward()
        opt.step()
        after_step = bn.running_mean.clone()
        bn(x)  # the next training forward starts from rank 0's buffers (broadcast_buffers=True)
        second = bn.running_mean.clone()
        opt.sync_buffers("average")
        return after_wrap, after_step, second, bn.running_mean.clone()

    (w0, m0, v0), step0, second0, avg0 = run_world(2, rank_fn)[0]
    results = run_world(2, rank_fn)
    (w1, m1, v1), step1, second1, avg1 = results[1]
    assert w1.tolist() == [5.0, 6.0] and m1.tolist() == [1.0, 2.0] and v1.tolist() == [3.0, 4.0]
    torch.testing.assert_close(step0, torch.tensor([1.0, 1.9]))
    torch.testing.assert_close(step1, torch.tensor([2.0, 2.9]))  # 0.9*[1,2] + 0.1*[11,11]
    torch.testing.assert_close(second1, 0.9 * step0 + 0.1 * torch.tensor([11.0, 11.0]))
    assert torch.equal(avg0, results[0][3]) and torch.equal(results[0][3], avg1)
    torch.testing.assert_close(avg1, (second0 + second1) / 2)


@OVERLAP
def test_h36_sparse_gradients_averaged_sparse_or_densified(overlap):
    def rank_fn(rank, comm, dense):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        torch.nn.init.zeros_(emb.weight)
        opt = DistOpt(torch.optim.SGD(emb.parameters(), lr=1.0), comm=comm, overlap=overlap, sparse_as_dense=dense)
        ids = torch.tensor([0]) if rank == 0 else torch.tensor([2, 0])
        emb(ids).sum().backward()
        assert emb.weight.grad.is_sparse != dense  # averaged as sparse (distopt.torch.sparse), or densified
        opt.step()
        return emb.weight.detach().clone()

    for w in run_world(2, lambda r, c: rank_fn(r, c, False)):
        assert w.tolist() == [[-1.0, -1.0], [0.0, 0.0], [-0.5, -0.5], [0.0, 0.0]]
    for w in run_world(2, lambda r, c: rank_fn(r, c, True)):
        assert w.tolist() == [[-1.0, -1.0], [0.0, 0.0], [-0.5, -0.5], [0.0, 0.0]]


def _h37(overlap: bool, failing: set[int], trial: int, timeout: float = 10.0) -> list[Any]:
    def rank_fn(rank, comm):
        g = torch.Generator().manual_seed(rank)
        l1, l2 = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            l1.weight.copy_(torch.randn(3, 3, generator=g))
            l2.weight.copy_(torch.randn(3, 3, generator=g))
        opt = DistOpt(torch.optim.SGD([l1.weight, l2.weight], lr=0.01), comm=comm, overlap=overlap, buffSize=9)
        grads3 = None
        for step in range(3):
            x = torch.randn(4, 3, generator=g)
            key = ("h37", trial, rank, step)
            if step == 1 and rank in failing:
                FailingBackward.armed.add(key)
            opt.zero_grad()
            try:
                (l2(FailingBackward.apply(l1(x), key)) ** 2).sum().backward()
            except RuntimeError as exc:
                if "simulated out-of-memory" not in str(exc):
                    raise
                opt.zero_grad()  # frees the gradients of the skipped batch
                continue
            if step == 2:
                before = [l1.weight.detach().clone(), l2.weight.detach().clone()]
                local = torch.autograd.grad((l2(l1(x)) ** 2).sum(), [l1.weight, l2.weight])
                grads3 = (before, local)
            opt.step()
        return grads3, [l1.weight.detach().clone(), l2.weight.detach().clone()]

    return run_world(2, rank_fn, timeout=timeout)


@OVERLAP
@pytest.mark.parametrize("trial", range(3))
def test_h37_exception_in_backward_on_every_rank_recovers(overlap, trial):
    (before0, local0), after0 = _h37(overlap, {0, 1}, trial)[0]
    results = _h37(overlap, {0, 1}, 100 + trial)
    (_, local_a), after_a = results[0]
    (_, local_b), after_b = results[1]
    assert all(torch.equal(a, b) for a, b in zip(after_a, after_b))
    for before, ga, gb, after in zip(results[0][0][0], local_a, local_b, after_a):
        torch.testing.assert_close(after, before - 0.01 * (ga + gb) / 2, rtol=0, atol=1e-6)


@OVERLAP
def test_h37_exception_on_one_rank_ends_with_a_clear_error(overlap):
    with pytest.raises(RankFailed) as info:
        _h37(overlap, {0}, 999, timeout=4.0)  # the other rank's collective times out after 2 s
    assert isinstance(info.value.__cause__, (CollectiveMismatchError, CollectiveTimeoutError))


@OVERLAP
@pytest.mark.parametrize("via", ["distopt", "inner"])
def test_h47_param_groups_and_a_group_added_later(overlap, via):
    def rank_fn(rank, comm):
        a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
        inner = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1, "momentum": 0.9}])
        opt = DistOpt(inner, comm=comm, overlap=overlap)
        r = rank + 1.0
        seen = []
        for _ in range(2):
            opt.zero_grad()
            linear_loss([a, b], [torch.full((2,), r), torch.full((2,), 10 * r)]).backward()
            opt.step()
            seen.append((a.tolist(), b.tolist()))
        c = torch.full((2,), 1.0 if rank == 0 else 7.0, requires_grad=True)
        (opt if via == "distopt" else inner).add_param_group({"params": [c], "lr": 0.5})
        opt.zero_grad()
        linear_loss([a, b, c], [torch.full((2,), r), torch.full((2,), 10 * r), torch.full((2,), r)]).backward()
        opt.step()
        return seen, a.tolist(), c.tolist()

    for seen, a, c in run_world(2, rank_fn):
        assert seen[0] == ([-1.5, -1.5], [-1.5, -1.5])
        assert seen[1][0] == [-3.0, -3.0]
        assert seen[1][1] == pytest.approx([-4.35, -4.35], abs=1e-6)
        assert a == [-4.5, -4.5] and c == [0.25, 0.25]


@OVERLAP
def test_h33b_nan_with_the_option_off_is_identical_on_every_rank(overlap):
    def rank_fn(rank, comm):
        p = torch.zeros(2, requires_grad=True)
        opt = DistOpt(torch.optim.SGD([p], lr=1.0), comm=comm, overlap=overlap)
        linear_loss([p], [torch.tensor([float("nan"), 1.0] if rank == 0 else [1.0, 1.0])]).backward()
        opt.step()
        return p.detach().numpy().copy()

    p0, p1 = run_world(2, rank_fn)
    assert p0.tobytes() == p1.tobytes()  # NaN in the same slot, the same bits
    assert np.isnan(p0[0]) and p0[1] == -1.0


@OVERLAP
def test_h47c_tied_weight_gets_the_average_of_both_uses(overlap):
    e0 = torch.arange(6.0).reshape(3, 2) / 10

    def local_loss(e, rank):
        h = e[torch.tensor([0, 2] if rank == 0 else [1, 1])]  # embedding lookup
        return (h @ e.T).pow(2).sum()  # output projection with the same weight

    want = e0 - (_grad_of(local_loss, e0, 0) + _grad_of(local_loss, e0, 1)) / 2  # both uses, averaged

    def rank_fn(rank, comm):
        e = torch.nn.Parameter(e0.clone() + rank)  # rank 0's value is broadcast
        opt = DistOpt(torch.optim.SGD([e], lr=1.0), comm=comm, overlap=overlap)
        local_loss(e, rank).backward()
        opt.step()
        return e.detach().clone()

    for e in run_world(2, rank_fn):
        assert (e - want).abs().max().item() < 1e-5


def _grad_of(loss_fn, e0, rank):
    e = e0.clone().requires_grad_(True)
    loss_fn(e, rank).backward()
    return e.grad
