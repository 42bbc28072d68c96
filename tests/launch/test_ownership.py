"""DistOpt.close() releases only what the DistOpt owns (issue 30, item 7): the shared world of
distopt.init() stays open for its other users until the last one closes, a group's communicator
stays open, a communicator the DistOpt built is closed, one handed as comm= stays its owner's."""
from __future__ import annotations

import numpy as np
import pytest

import distopt
from distopt import SGD, DistOpt
from distopt.comm import create
from distopt.comm.groups import split
from distopt.errors import CommunicatorClosedError
from distopt.launch import world as world_mod
from distopt.launch.ranks import RankInfo
from tests.support.simworld import run_world


def _step(opt: DistOpt) -> float:
    w = np.zeros(3, np.float32)
    opt.step([w], [np.ones(3, np.float32)])
    return float(w[0])


@pytest.fixture
def fresh_world(monkeypatch):
    """distopt.init() on the single backend, without touching another test's world."""
    monkeypatch.setattr(world_mod, "_current", None)
    world = distopt.init(backend="single")
    yield world
    world.close()


@pytest.mark.unit
def test_closing_one_distopt_keeps_the_init_world_for_the_others(fresh_world):
    first, second = DistOpt(SGD(lr=1.0)), DistOpt(SGD(lr=1.0))
    assert fresh_world.users == 3  # the script (init) and two DistOpts
    first.close()
    assert not fresh_world.comm.closed and world_mod.current() is fresh_world
    with pytest.raises(CommunicatorClosedError, match="closed single communicator"):
        _step(first)
    assert _step(second) == -1.0  # the other DistOpt still trains over the shared world
    second.close()
    assert not fresh_world.comm.closed  # the script still holds it: later DistOpts share it again
    third = DistOpt(SGD(lr=1.0), world=fresh_world)
    fresh_world.close()  # the script lets go while a DistOpt uses it: it stays open for that one
    assert not fresh_world.comm.closed and _step(third) == -1.0
    third.close()  # the last user: the world closes with it
    assert fresh_world.comm.closed and world_mod.current() is None and fresh_world.users == 0
    third.close()  # idempotent: no second release
    assert fresh_world.users == 0
    with pytest.raises(CommunicatorClosedError, match="world was closed"):
        DistOpt(SGD(lr=1.0), world=fresh_world)


@pytest.mark.unit
def test_world_given_explicitly_is_shared_too(fresh_world):
    opt = DistOpt(SGD(lr=1.0), world=fresh_world)
    group = distopt.new_group([0], world=fresh_world)
    opt.close()
    assert not fresh_world.comm.closed and fresh_world.users == 1
    assert group.comm is not None and not group.comm.closed
    group.close()


@pytest.mark.unit
def test_a_group_communicator_outlives_the_distopt_on_it():
    parent = create("single")
    group = split(parent, [0], name="solo")
    opt = DistOpt(SGD(lr=1.0), group=group)
    assert _step(opt) == -1.0
    opt.close()
    assert not group.comm.closed and not parent.closed
    with pytest.raises(CommunicatorClosedError):
        _step(opt)
    group.comm.barrier()  # still usable by its owner
    group.close()
    parent.close()


@pytest.mark.unit
def test_a_built_communicator_is_closed_and_a_handed_one_stays_its_owners(monkeypatch):
    monkeypatch.setattr(world_mod, "_current", None)
    built = DistOpt(SGD(lr=1.0), backend="single")
    built.close()
    assert built.comm.closed
    handed = create("single")
    opt = DistOpt(SGD(lr=1.0), comm=handed)
    assert opt.comm is handed  # the caller's object itself
    _step(opt)
    opt.close()
    assert not handed.closed  # as DDP leaves the process group it was given
    second = DistOpt(SGD(lr=1.0), comm=handed)  # the owner's communicator serves a later DistOpt
    _step(second)
    second.close()
    handed.close()
    assert handed.closed


@pytest.mark.unit
def test_shared_world_views_keep_one_sequence_on_a_simulated_world():
    """Two DistOpts over one two-rank world alternate steps; closing one leaves the other in step."""
    def rank_fn(rank, comm):
        world = world_mod.World(comm, RankInfo(rank, 2, rank, 2, 0, 1, "explicit"))
        a, b = DistOpt(SGD(lr=1.0), world=world), DistOpt(SGD(lr=1.0), world=world)
        out = [_step(a), _step(b)]
        a.close()
        out.append(_step(b))
        b.close()
        return out, comm.closed

    assert run_world(2, rank_fn) == [([-1.0, -1.0, -1.0], True)] * 2
