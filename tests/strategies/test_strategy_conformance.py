"""Every registered strategy against the generic invariants, in a simulated world of W = 1, 2 and 3 threads.

The twin of the backend conformance suite: each example of
:data:`distopt.strategies.REGISTRY` (its id is in the test id, e.g.
``[2-sparse-topk]``) runs through ``DistOpt.step`` on a small float64 NumPy
model (four parameters of different shapes, one of a single element, no
size divisible by 2 or 3, fused and unfused buckets) with rank-dependent
gradients, and must keep:

* replicas bitwise identical after every step (after ``average_params`` for
  a strategy that declares ``identical_replicas = False``);
* a state round trip (``state_dict`` into a fresh ``DistOpt``, plus the
  parameters) giving a bitwise-identical next step, reported counters
  included;
* rank 0's value for a parameter added or resized between steps;
* ``join()`` accepted (identical parameters after uneven step counts) or
  refused with ValueError on every rank, as ``supports_join`` declares;
* the state untouched by a step that ``check_finite`` skips;
* one control collective per step in steady state;
* a CollectiveMismatchError on every rank when rank 1 builds the strategy
  with another setting.

A newly registered strategy is tested here without new test code.
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from distopt import SGD, CollectiveMismatchError, DistOpt
from distopt.core.counters import Counters
from distopt.strategies import REGISTRY, Example
from tests.support.simworld import run_world

pytestmark = pytest.mark.unit

SHAPES = [(5, 7), (1,), (7,), (5, 1, 5)]  # 35, 1, 7, 25 elements
THRESHOLD, BUFF_SIZE = 16, 20              # (5, 7) and (5, 1, 5) alone; (1,) and (7,) fused
EXAMPLES = [pytest.param(e, id=e.id) for e in REGISTRY.values()]
WORLDS = pytest.mark.parametrize("world", [1, 2, 3])
EVERY_EXAMPLE = pytest.mark.parametrize("example", EXAMPLES)


def _needs(example: Example, world: int) -> None:
    for module in example.requires:
        pytest.importorskip(module)
    if example.worlds is not None and world not in example.worlds:
        pytest.skip(f"{example.id} runs at world sizes {example.worlds}")


def _opt(comm: Any, example: Example, strategy: Any = None, **kwargs: Any) -> DistOpt:
    return DistOpt(SGD(lr=0.1, momentum=example.local_momentum), comm=comm,
                   strategy=example.build() if strategy is None else strategy, buffSize=BUFF_SIZE, **kwargs)


def _params(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)  # different per rank: the first step broadcasts rank 0's
    return [rng.standard_normal(s) for s in SHAPES]


def _grads(step: int, rank: int, params: list[np.ndarray]) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * step + 17 * rank)
    return [rng.standard_normal(p.shape) for p in params]


def _step(opt: DistOpt, params: list[np.ndarray], step: int, rank: int) -> None:
    opt.step(params, _grads(step, rank, params), threshold=THRESHOLD)


def _same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested containers of arrays (NumPy, or torch tensors of a checkpoint) and plain values."""
    a, b = (x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x for x in (a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _counts(opt: DistOpt) -> dict[str, float]:
    return {k: v for k, v in opt.stats.items() if k != "wait_seconds"}


# --------------------------------------------------------------------- replicas
@WORLDS
@EVERY_EXAMPLE
def test_replicas_bitwise_identical_after_every_step(example, world):
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example)
        params = _params(rank)
        first = [p.copy() for p in _params(0)]
        after = []
        for s in range(5):
            _step(opt, params, s, rank)
            if not example.cls.identical_replicas:
                opt.average_params(params)
            after.append([p.copy() for p in params])
        return after, first, _counts(opt)

    results = run_world(world, rank_fn)
    for after, _, _ in results[1:]:
        for step, (mine, theirs) in enumerate(zip(results[0][0], after)):
            assert _same(mine, theirs), f"step {step}"
    assert not _same(results[0][0][-1], results[0][1])  # the parameters moved
    for _, _, counts in results:
        assert counts["steps"] == 5
        assert set(example.cls.counter_names) <= set(counts)  # the strategy reported what it declares


# ---------------------------------------------------------------- state round trip
@WORLDS
@EVERY_EXAMPLE
def test_state_round_trip_gives_a_bitwise_identical_next_step(example, world):
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example)
        params = _params(rank)
        for s in range(3):
            _step(opt, params, s, rank)
        if not example.cls.identical_replicas:
            opt.sync_params(params)  # a checkpoint holds one copy of the parameters, which a restore broadcasts
        saved, saved_params = pickle.dumps(opt.state_dict()), [p.copy() for p in params]
        _step(opt, params, 3, rank)
        fresh = _opt(comm, example)
        again = [p.copy() for p in saved_params]
        fresh.load_state_dict(pickle.loads(saved))
        _step(fresh, again, 3, rank)
        return params, again, _counts(opt), _counts(fresh)

    for params, again, counts, restored in run_world(world, rank_fn):
        assert _same(params, again)
        assert counts == restored


# ------------------------------------------------------------------ layout change
@WORLDS
@EVERY_EXAMPLE
def test_layout_change_keeps_rank0s_value(example, world):
    """A parameter added, then one resized and one removed between steps: the new ones take rank 0's value."""
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example)
        params = _params(rank)
        _step(opt, params, 0, rank)
        added = params + [np.full(3, 10.0 + rank)]
        opt.step(added, [None] * len(added), threshold=THRESHOLD)  # no gradient: shows what the layout sync did
        seen = [added[-1].copy()]
        _step(opt, added, 1, rank)
        resized = [added[0], np.full(4, 20.0 + rank), *added[2:4]]
        opt.step(resized, [None] * len(resized), threshold=THRESHOLD)
        seen.append(resized[1].copy())
        _step(opt, resized, 2, rank)
        if not example.cls.identical_replicas:
            opt.average_params(resized)
        return seen, resized

    results = run_world(world, rank_fn)
    for seen, resized in results:
        assert _same(seen, [np.full(3, 10.0), np.full(4, 20.0)])
        assert _same(resized, results[0][1])


# --------------------------------------------------------------------------- join
@WORLDS
@EVERY_EXAMPLE
def test_join_is_accepted_or_refused_as_declared(example, world):
    """Rank r steps ``world - r`` times inside join(): with ``supports_join`` the ranks that finished early
    shadow the others and all end identical; without it, every rank raises ValueError (at W=1 too)."""
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example)
        params = _params(rank)
        _step(opt, params, 0, rank)
        try:
            with opt.join():
                for s in range(world - rank):
                    _step(opt, params, 1 + s, rank)
        except ValueError as exc:
            return "ValueError", str(exc)
        if not example.cls.identical_replicas:
            opt.average_params(params)
        return "ok", params

    results = run_world(world, rank_fn)
    if example.cls.supports_join:
        assert [r[0] for r in results] == ["ok"] * world, results
        assert all(_same(r[1], results[0][1]) for r in results)
    else:
        assert [r[0] for r in results] == ["ValueError"] * world, results
        assert all(example.cls.name in r[1] for r in results)


# -------------------------------------------------------------------- skipped step
@WORLDS
@EVERY_EXAMPLE
def test_skipped_step_leaves_the_state_untouched(example, world):
    """The last rank's gradient is NaN: check_finite skips the step on every rank, and nothing changes."""
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example, check_finite=True)
        params = _params(rank)
        for s in range(3):
            _step(opt, params, s, rank)
        before = pickle.dumps((opt.strategy.state_dict(), opt.state_dict()["local"], params))
        grads = _grads(3, rank, params)
        if rank == world - 1:
            grads[2][0] = np.nan
        opt.step(params, grads, threshold=THRESHOLD)
        after = pickle.dumps((opt.strategy.state_dict(), opt.state_dict()["local"], params))
        return before, after, opt.stats.skipped_steps, opt.stats.steps

    for before, after, skipped, steps in run_world(world, rank_fn):
        assert _same(pickle.loads(after), pickle.loads(before))
        assert (skipped, steps) == (1, 3)


# -------------------------------------------------------------- control collectives
@WORLDS
@EVERY_EXAMPLE
def test_one_control_collective_per_step_in_steady_state(example, world):
    _needs(example, world)

    def rank_fn(rank, comm):
        opt = _opt(comm, example)
        params = _params(rank)
        per_step = []
        for s in range(6):
            before = opt.stats["control_collectives"]
            _step(opt, params, s, rank)
            per_step.append(opt.stats["control_collectives"] - before)
        return per_step

    for per_step in run_world(world, rank_fn):
        assert per_step[3:] == [1, 1, 1], per_step


# ------------------------------------------------------------------ settings mismatch
@pytest.mark.parametrize("world", [2, 3])
@EVERY_EXAMPLE
def test_settings_mismatch_raises_on_every_rank(example, world):
    """Rank 1 builds the example's ``mismatch`` configuration; a strategy without settings has none."""
    _needs(example, world)
    if example.mismatch is None:
        assert example.build().settings() == {}, "a strategy with settings needs a mismatch example"
        return
    assert example.build_mismatch().settings() != example.build().settings()

    def rank_fn(rank, comm):
        opt = _opt(comm, example, example.build_mismatch() if rank == 1 else None)
        try:
            _step(opt, _params(rank), 0, rank)
        except CollectiveMismatchError as exc:
            return str(exc)
        return None

    messages = run_world(world, rank_fn)
    assert all(m is not None and "differs" in m for m in messages), messages


# ------------------------------------------------------------- reported counters
def test_counters_hold_what_strategies_report():
    """Strategy-reported counts read through the mapping, round-trip, and cannot shadow a step counter."""
    stats = Counters()
    stats.declare(["sparse_entries"])
    assert stats["sparse_entries"] == 0 and "sparse_dense_fallbacks" not in stats
    stats.add("sparse_entries", 3)
    stats.add("sparse_dense_fallbacks", 1)
    stats.steps = 2
    assert dict(stats)["sparse_entries"] == 3 and stats["sparse_dense_fallbacks"] == 1
    assert list(stats)[-2:] == ["sparse_entries", "sparse_dense_fallbacks"] and len(stats) == len(dict(stats))
    restored = Counters()
    restored.load_state_dict(pickle.loads(pickle.dumps(stats.state_dict())))
    assert dict(restored) == dict(stats) and restored.steps == 2
    with pytest.raises(ValueError, match="'steps' is a step counter"):
        stats.add("steps", 1)
    with pytest.raises(KeyError):
        stats["no_such_counter"]
