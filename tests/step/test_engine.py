"""The step engine and the strategy objects, in a simulated world of threads (milliseconds, no mpiexec).

Numerics are proven against one process on the whole batch (float64,
1e-10); SINGA's per-call methods against the strategy objects (bitwise);
the two bugs of the old centre (join after sparse/partial, a bucket whose
layout changes) for every SINGA method, overlap on and off. The invariants
of every registered strategy object are in ``tests/strategies/test_strategy_conformance.py``.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from distopt import SGD, CollectiveMismatchError, CommunicatorClosedError, DistOpt
from distopt.strategies import Dense, Half, Partial, Sparse
from tests.support import models
from tests.support.simworld import RankFailed, run_world, second_world

pytestmark = pytest.mark.unit

STRATEGIES = {  # SINGA's methods and the strategy objects they build
    "plain": (Dense, {}, lambda o, p, g, t: o.step(p, g, t)),
    "half": (Half, {"wire": "float16"}, lambda o, p, g, t: o.step_half(p, g, t)),
    "topk": (Sparse, {"density": 0.3, "select": "topk"}, lambda o, p, g, t: o.step_sparse(p, g, t, 0.3, True)),
    "threshold": (Sparse, {"density": 0.05}, lambda o, p, g, t: o.step_sparse(p, g, t, 0.05, False)),
    "partial": (Partial, {}, lambda o, p, g, t: o.step_partial(p, g, t)),
}


def _opt(comm, sgd=None, **kwargs) -> DistOpt:
    return DistOpt(sgd if sgd is not None else SGD(lr=0.1, momentum=0.9), comm=comm, **kwargs)


def _grads(step: int, rank: int, params) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return [rng.standard_normal(p.shape).astype(p.dtype) for p in params]


class _Loss:
    """An array model's loss whose backward() yields (param, grad) pairs, last parameter first."""

    def __init__(self, params, grads):
        self.params, self.grads = params, grads

    def backward(self):
        for i in reversed(range(len(self.params))):
            yield self.params[i], self.grads[i]


# ------------------------------------------------------------ equivalence
@pytest.mark.parametrize("world", [1, 2, 4])
def test_dense_n_ranks_equal_one_process_on_the_whole_batch(world):
    """W ranks with batch B each == one process on W*B (float64, 1e-10), momentum + weight decay."""
    B, steps = 3, 4
    ref = [p.copy() for p in models.mlp_params(seed=0)]
    sgd = SGD(lr=0.2, momentum=0.9, weight_decay=1e-3)
    for s in range(steps):
        x, y = models.batch(s, B * world)
        for p, g in zip(ref, models.mlp_grads(ref, x, y)):
            sgd.update(p, g)

    def rank_fn(rank, comm):
        params = models.mlp_params(seed=rank)  # different inits: rank 0's are broadcast
        opt = _opt(comm, SGD(lr=0.2, momentum=0.9, weight_decay=1e-3), buffSize=40)
        opt.sync_params(params)
        for s in range(steps):
            x, y = models.batch(s, B * world)
            mine = slice(B * rank, B * rank + B)
            opt.step(params, models.mlp_grads(params, x[mine], y[mine]), threshold=30)
        return params

    for params in run_world(world, rank_fn):
        for got, want in zip(params, ref):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


# --------------------------------------------- SINGA methods == strategy objects
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_singa_methods_equal_strategy_objects_bitwise(kind, overlap, world):
    cls, kwargs, singa_step = STRATEGIES[kind]

    def rank_fn(rank, comm):
        out = []
        for use_object in (True, False):
            params = [p.astype(np.float32) for p in models.mlp_params(seed=rank)]
            strategy = cls(**kwargs) if use_object else None
            opt = _opt(comm, strategy=strategy, buffSize=20, overlap=overlap)
            opt.sync_params(params)
            for s in range(4):
                grads = _grads(s, rank, params)
                if use_object:
                    opt.backward_and_update(_Loss(params, grads), threshold=16) if s % 2 else \
                        opt.step(params, grads, threshold=16)
                else:
                    singa_step(opt, params, grads, 16)
            out.append(params)
        return out

    results = run_world(world, rank_fn)
    for ours, singa in results:
        for a, b in zip(ours, singa):
            assert np.array_equal(a, b)
    if kind != "partial":  # replicas identical after every averaged step
        for other, _ in results[1:]:
            assert all(np.array_equal(a, b) for a, b in zip(other, results[0][0]))


@pytest.mark.parametrize("kind", ["plain", "half"])
def test_overlap_equals_post_backward_bitwise(kind):
    """An array loss yielding (param, grad): overlapped buckets == post-backward, and they start in backward."""
    cls, kwargs, _ = STRATEGIES[kind]

    def rank_fn(rank, comm):
        out = []
        for overlap in (True, False):
            params = [p.astype(np.float32) for p in models.mlp_params(seed=rank)]
            opt = _opt(comm, strategy=cls(**kwargs), buffSize=20, overlap=overlap)
            opt.sync_params(params)
            for s in range(3):
                opt.backward_and_update(_Loss(params, _grads(s, rank, params)), threshold=16)
            out.append((params, opt.stats["buckets_started_in_backward"]))
        return out

    for (a, started), (b, none) in run_world(2, rank_fn):
        assert started > 0 and none == 0
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------ bug 1: join after any strategy
@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_join_without_step_inside_after_any_strategy(kind):
    """Rank 1 runs one step of the strategy, then enters and leaves join() without a step inside while
    rank 0 still steps: supported strategies keep replicas equal; the others raise ValueError everywhere."""
    cls, kwargs, singa_step = STRATEGIES[kind]

    def rank_fn(rank, comm):
        opt = _opt(comm, SGD(lr=0.1))
        params = [np.zeros(6), np.zeros(3)]
        singa_step(opt, params, _grads(0, rank, params), 4)
        try:
            with opt.join():
                if rank == 0:
                    singa_step(opt, params, _grads(1, rank, params), 4)
        except ValueError as exc:
            return "ValueError", str(exc)
        return "ok", [p.copy() for p in params]

    results = run_world(2, rank_fn)
    if cls.supports_join:
        assert [r[0] for r in results] == ["ok", "ok"]
        assert all(np.array_equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    else:
        assert [r[0] for r in results] == ["ValueError", "ValueError"], results
        assert all(cls.name in r[1] for r in results)


def test_join_after_sparse_when_the_other_rank_steps_outside_join():
    """The joined rank shadows a sparse step of a rank that is not in join(): ValueError on both ranks."""

    def rank_fn(rank, comm):
        opt = _opt(comm, SGD(lr=0.1))
        params = [np.zeros(8)]
        opt.step_sparse(params, _grads(0, rank, params), spars=0.5, topK=True)
        try:
            if rank == 1:
                with opt.join():
                    pass
            else:
                opt.step_sparse(params, _grads(1, rank, params), spars=0.5, topK=True)
        except ValueError as exc:
            return str(exc)
        return None

    messages = run_world(2, rank_fn)
    assert all(m is not None and "sparse" in m for m in messages), messages


# ------------------------------------------------- bug 2: a bucket whose layout changes
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_layout_change_new_parameter_gets_rank0_value(kind, overlap):
    """step([w1(4), w3(3)]) then step([w1, w3, w2(2)]) (w2 joins the fused bucket), then w2 resized and
    w3 removed: buffers of the right size, rank 0's value for every new parameter, replicas equal."""
    cls, kwargs, _ = STRATEGIES[kind]

    def rank_fn(rank, comm):
        opt = _opt(comm, SGD(lr=0.1), strategy=cls(**kwargs), overlap=overlap)
        w1, w3 = np.full(4, 1.0 + rank), np.full(3, 2.0 + rank)
        seen = []
        for params in ([w1, w3], [w1, w3, np.full(2, 10.0 + rank)], [w1, np.full(5, 20.0 + rank)]):
            opt.step(params, [None] * len(params))  # no gradient: shows what the layout sync did
            seen.append([p.copy() for p in params])
            opt.backward_and_update(_Loss(params, _grads(len(seen), rank, params)))
            seen.append([p.copy() for p in params])
        return seen

    ranks = run_world(2, rank_fn)
    np.testing.assert_array_equal(ranks[1][2][2], np.full(2, 10.0))  # w2: rank 0's value
    np.testing.assert_array_equal(ranks[1][4][1], np.full(5, 20.0))  # resized: rank 0's value
    if kind != "partial":
        for a, b in zip(ranks[0], ranks[1]):
            assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- agreement
def test_different_strategies_across_ranks_error_on_every_rank():
    def rank_fn(rank, comm):
        opt = _opt(comm, strategy=Dense() if rank == 0 else Half())
        try:
            opt.step([np.zeros(4)], [np.ones(4)])
        except CollectiveMismatchError as exc:
            return str(exc)
        return None

    messages = run_world(2, rank_fn)
    assert all(m is not None and "strategy" in m and "step 1" in m for m in messages), messages


def test_strategy_argument_is_checked():
    with pytest.raises(RankFailed, match="TypeError: strategy must be a distopt.strategies.Strategy"):
        run_world(1, lambda rank, comm: _opt(comm, strategy="sparse"))


# -------------------------------------------------------------------- state
@pytest.mark.parametrize("kind", ["topk", "partial"])
def test_state_round_trip_gives_bitwise_the_same_next_step(kind):
    cls, kwargs, _ = STRATEGIES[kind]

    def rank_fn(rank, comm):
        params = [np.arange(10.0) * (rank + 1)]
        opt = _opt(comm, SGD(lr=0.1, momentum=0.9), strategy=cls(**kwargs))
        for s in range(3):
            opt.step(params, _grads(s, rank, params), threshold=4)
        saved, saved_params = opt.state_dict(), [p.copy() for p in params]
        opt.step(params, _grads(3, rank, params), threshold=4)
        fresh = _opt(comm, SGD(lr=0.1, momentum=0.9), strategy=cls(**kwargs))
        again = [p.copy() for p in saved_params]
        fresh.sync_params(again)
        fresh.load_state_dict(saved)
        fresh.step(again, _grads(3, rank, again), threshold=4)
        return params, again

    for a, b in run_world(2, rank_fn):
        assert np.array_equal(a[0], b[0])


def test_old_state_format_is_refused_clearly():
    def rank_fn(rank, comm):
        opt = _opt(comm)
        with pytest.raises(ValueError, match="format 1"):
            opt.load_state_dict({"local": None, "stats": {}, "residuals": {}, "cursor": {"position": 0}})

    run_world(1, rank_fn)


def test_stats_are_counters_readable_as_a_dict():
    def rank_fn(rank, comm):
        opt = _opt(comm)
        opt.step([np.zeros(4, np.float32)], [np.ones(4, np.float32)])
        return opt.stats

    stats = run_world(2, rank_fn)[0]
    assert stats.steps == stats["steps"] == 1
    assert stats["wire_bytes"] == stats.dense_bytes == 16
    assert dict(stats)["skipped_steps"] == 0
    with pytest.raises(KeyError):
        stats["no_such_counter"]


# ------------------------------------------------------------------ PyTorch
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("kind", ["plain", "half", "topk", "partial"])
def test_torch_singa_methods_equal_strategy_objects_bitwise(kind, overlap, world):
    """A torch model: backward_and_update with a strategy object == SINGA's method, bitwise."""
    torch = pytest.importorskip("torch")
    cls, kwargs, _ = STRATEGIES[kind]
    singa = {"plain": lambda o, loss: o.backward_and_update(loss, 300),
             "half": lambda o, loss: o.backward_and_update_half(loss, 300),
             "topk": lambda o, loss: o.backward_and_sparse_update(loss, 300, 0.3, True),
             "partial": lambda o, loss: o.backward_and_partial_update(loss, 300)}[kind]

    def rank_fn(rank, comm):
        out = []
        for use_object in (True, False):
            model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
            with torch.no_grad():  # per-rank inits from a local generator (threads share the global one)
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
            sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            opt = _opt(comm, sgd, strategy=cls(**kwargs) if use_object else None, buffSize=100, overlap=overlap)
            for s in range(3):
                g = torch.Generator().manual_seed(10 * s + rank)
                x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
                sgd.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.backward_and_update(loss, 300) if use_object else singa(opt, loss)
            out.append([p.detach().numpy().copy() for p in model.parameters()])
            out.append(opt.stats["buckets_started_in_backward"])
        return out

    results = run_world(world, rank_fn)
    for ours, started, singa_params, _ in results:
        assert all(np.array_equal(a, b) for a, b in zip(ours, singa_params))
        assert (started > 0) == (overlap and cls.supports_overlap)
    if kind != "partial":
        assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(r[0], results[0][0]))


# ------------------------------------------------------------ observability, lifecycle
def test_bucket_reductions_are_named_ranges_in_torch_profiler():
    pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile

    def rank_fn(rank, comm):
        opt = _opt(comm, SGD(lr=0.1), buffSize=8)
        params = [np.zeros(6, np.float32), np.zeros(5, np.float32)]
        opt.sync_params(params)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step(params, _grads(0, rank, params), threshold=4)
        return {e.key for e in prof.key_averages()}

    names = run_world(1, rank_fn)[0]
    assert {"distopt.plain start bucket 1/2", "distopt.plain finish bucket 2/2"} <= names, sorted(names)


def test_stats_report_seconds_waiting_and_close_is_idempotent_in_a_with_block():
    with DistOpt(SGD(lr=1.0), backend="single") as opt:  # a communicator it built, so close() closes it
        p = [np.zeros(3)]
        opt.step(p, [np.ones(3)])
        assert opt.stats.wait_seconds > 0.0 and opt.stats["wait_seconds"] == opt.stats.wait_seconds
    opt.close()  # a second close does nothing
    with pytest.raises(CommunicatorClosedError, match="closed single communicator"):
        opt.step(p, [np.ones(3)])


class _FakeDevice:
    """A stand-in for the NCCL backend on CPU: float arrays are "device" arrays (stream-ordered, no host
    wait); integer arrays are host buffers (the engine's header and flags), which the real backend
    either hands to its host ``control`` communicator or stages through the device with one host wait
    each (counted in ``host_syncs``, as ``NcclCommunicator`` does)."""

    name = "fake-device"

    def __init__(self, inner, control=None):
        self.inner, self.control, self.rank, self.size = inner, control, inner.rank, inner.size
        self.host_syncs = 0

    def _route(self, array):
        if array.dtype.kind in "iub":
            if self.control is not None:
                return self.control
            self.host_syncs += 1
        return self.inner

    def all_reduce(self, array, op="sum"):
        return self._route(array).all_reduce(array, op)

    def all_reduce_async(self, array, op="sum"):
        return self._route(array).all_reduce_async(array, op)

    def broadcast(self, array, root=0):
        return self._route(array).broadcast(array, root)

    def all_gather(self, array):
        return self._route(array).all_gather(array)

    def all_gather_v(self, array):
        return self._route(array).all_gather_v(array)

    def barrier(self):
        self.inner.barrier()

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("kind", ["plain", "half"])
def test_steady_state_steps_never_wait_on_the_device_with_a_host_control_plane(kind):
    cls, kwargs, _ = STRATEGIES[kind]

    def rank_fn(rank, comm, control):
        device = _FakeDevice(comm, control)
        opt = _opt(device, SGD(lr=0.1), strategy=cls(**kwargs), buffSize=16)
        params = [np.zeros(20, np.float32), np.zeros(5, np.float32)]
        opt.sync_params(params)
        for s in range(4):
            opt.backward_and_update(_Loss(params, _grads(s, rank, params)), threshold=8)
        return opt.stats.host_syncs, params

    control = second_world(2)
    with_plane = run_world(2, lambda rank, comm: rank_fn(rank, comm, control(rank)))
    without = run_world(2, lambda rank, comm: rank_fn(rank, comm, None))
    assert [syncs for syncs, _ in with_plane] == [0, 0]
    # the header every step (host arrays: the flags are settled from the reduced gradients, no all-reduce)
    assert all(syncs >= 4 for syncs, _ in without)
    assert all(np.array_equal(a, b) for a, b in zip(with_plane[0][1], without[0][1]))


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_steady_state_step_after_backward_costs_one_control_collective(kind):
    """The step header settles a step whose gradients are known, present and finite everywhere;
    a rank missing a gradient costs the flags all-reduce as well."""
    cls, kwargs, call = STRATEGIES[kind]
    header, flags = ("all_gather", 8), ("all_reduce", 2 + 2)  # 8 int64; one int32 per parameter + 2

    def rank_fn(rank, comm):
        opt = _opt(comm, strategy=cls(**kwargs), buffSize=16)
        params = [np.zeros(20, np.float32), np.zeros(5, np.float32)]
        per_step, counted = [], []
        for s in range(4):
            grads = _grads(s, rank, params)
            if s == 3 and rank == 1:
                grads[1] = None
            before = len(comm.calls)
            control = opt.stats.control_collectives
            call(opt, params, grads, 8)
            per_step.append(comm.calls[before:])
            counted.append(opt.stats.control_collectives - control)
        return per_step, [p.copy() for p in params], counted

    results = run_world(2, rank_fn)
    for per_step, _, counted in results:
        assert [per_step[2].count(header), per_step[2].count(flags)] == [1, 0], per_step[2]
        assert [per_step[3].count(header), per_step[3].count(flags)] == [1, 1], per_step[3]
        assert counted[2:] == [1, 2]  # DistOpt.stats counts them too
    if kind != "partial":  # partial averages one chunk per step: replicas differ between syncs by design
        assert all(np.array_equal(a, b) for a, b in zip(results[0][1], results[1][1]))


@pytest.mark.parametrize("name,hint", [("topk", 'Sparse(select="topk", density=0.01)'), ("fp16", 'Half(wire="float16")'),
                                       ("PowerSGD", "PowerSGD()"), ("fancy", "e.g. distopt.strategies.Dense()")])
def test_a_strategy_named_by_a_string_is_answered_with_the_object(name, hint):
    """``strategy="topk"`` (a DDP hook's or Horovod's habit) names the strategy object to pass."""
    import distopt

    with pytest.raises(TypeError, match=f"got the string '{name}': pass .*" + re.escape(hint)):
        distopt.DistOpt(distopt.SGD(lr=0.1), strategy=name)
