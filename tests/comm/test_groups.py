"""Process groups (``distopt.new_group``, ``DistOpt(group=)``) and the hierarchical all-reduce.

Real processes: ``mpiexec -n 4`` (MPI), spawned processes (shm, torch.distributed over gloo), through
:func:`tests.support.backends.run_case`. A hierarchical layout of 2 nodes x 2 processes is given to
:func:`~distopt.comm.hierarchy.hierarchical_for` as host names (``node0``, ``node1``); the root-only
test gives each rank its own UTS namespace instead, so the automatic choice reads real host names.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from distopt.comm.groups import Group, split
from distopt.comm.hierarchy import HierarchicalCommunicator, _eligible, hierarchical_for
from distopt.comm.single import SingleCommunicator
from distopt.errors import CollectiveMismatchError
from tests.support import conformance
from tests.support.backends import run_case
from tests.support.harness import rank_streams, run_job
from tests.support.torch_workers import free_port

GROUP_BACKENDS = ("mpi", "shm", "torch")
HIER_BACKENDS = ("mpi", "torch")


def _node(rank: int) -> str:
    return f"node{rank // 2}"


# ------------------------------------------------------------------ cases (run on every rank)
def case_group_collectives(rank: int, comm) -> dict:
    """Two groups of a 4-rank world, sums inside each, then the world still works."""
    evens, odds = split(comm, [2, 0], name="evens"), split(comm, [1, 3])
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    a = np.array([rank + 1.0, 10.0 * rank])
    mine.require("sum").all_reduce(a)
    try:
        other.require("sum")
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    world = np.array([float(rank)])
    comm.all_reduce(world)
    out = {"sum": a.tolist(), "group_rank": mine.rank, "ranks": list(mine.ranks), "refused": refused,
           "world": float(world[0]), "name": evens.name}
    evens.close(), odds.close()
    return out


def case_group_mismatch(rank: int, comm) -> str:
    """Rank 3 names other members: every rank gets the error, naming the group."""
    try:
        split(comm, [1, 2] if rank == 3 else [1, 3], name="dp1")
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def case_bad_ranks(rank: int, comm) -> str:
    """Only rank 1 passes a rank outside the world: every rank raises, naming rank 1."""
    try:
        split(comm, [0, 9] if rank == 1 else [0, 1])
    except ValueError as exc:
        return str(exc)
    return "no error"


def _dp_batch(rank: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1000 + rank)
    return [(rng.standard_normal((8, 6)), rng.standard_normal((8, 3))) for _ in range(steps)]


def case_data_parallel_halves(rank: int, comm, steps: int) -> list[list[float]]:
    """A 2 x 2 layout: model-parallel half ``rank % 2``, data-parallel over ranks {h, h + 2}."""
    import torch

    from distopt import DistOpt

    groups = [split(comm, [0, 2], name="dp0"), split(comm, [1, 3], name="dp1")]
    half = rank % 2
    torch.manual_seed(100 + half)
    model = torch.nn.Linear(6, 3).double()
    opt = DistOpt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), group=groups[half], model=model)
    assert opt.world_size == 2 and opt.rank_in_global == rank // 2
    for x, y in _dp_batch(rank, steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    check = np.ones(3)
    comm.all_reduce(check)  # the world communicator is untouched by the groups' traffic
    assert check.tolist() == [4.0] * 3
    opt.close()
    groups[1 - half].close()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def _reference_half(half: int, steps: int) -> list[list[float]]:
    """One process on the concatenated batches of the group's two ranks."""
    import torch

    torch.manual_seed(100 + half)
    model = torch.nn.Linear(6, 3).double()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for (x0, y0), (x1, y1) in zip(_dp_batch(half, steps), _dp_batch(half + 2, steps)):
        sgd.zero_grad()
        x, y = np.concatenate([x0, x1]), np.concatenate([y0, y1])
        torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        sgd.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def case_non_member(rank: int, comm) -> str:
    """``DistOpt(group=)`` on a rank outside the group: ValueError naming it (collective-free)."""
    import torch

    from distopt import DistOpt

    g = split(comm, [0], name="solo")
    if rank == 0:
        g.close()
        return "member"
    try:
        DistOpt(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), group=g)
    except ValueError as exc:
        return str(exc)
    return "no error"


def case_hier_conformance(rank: int, comm) -> bool:
    """The backend conformance suite (plain and sharded collectives) on the hierarchical communicator."""
    h = hierarchical_for(comm, True, host=_node(rank))
    assert isinstance(h, HierarchicalCommunicator)
    conformance.run_all(h)
    conformance.run_shards(h)
    big = np.arange(70_000, dtype=np.float32) * (rank + 1)  # above MIN_BYTES: the hierarchical path
    h.all_reduce(big)
    np.testing.assert_array_equal(big, np.arange(70_000, dtype=np.float32) * 10)
    mismatch = np.ones(40_000 if rank == 3 else 50_000, np.float32)  # large: the agreement catches it
    with pytest.raises(CollectiveMismatchError, match="element count"):
        h.all_reduce(mismatch)
    h.close()
    return True


def case_hier_against_flat(rank: int, comm) -> dict:
    """Large float sums and averages: hierarchical vs flat, identical bits on every rank; async in flight."""
    h = hierarchical_for(comm, True, host=_node(rank))
    rng = np.random.default_rng(rank)
    out: dict = {"rel": [], "same_everywhere": True}
    for dtype, n, op in ((np.float32, 100_003, "sum"), (np.float64, 30_001, "avg"), (np.float32, 1 << 20, "avg")):
        x = rng.standard_normal(n).astype(dtype)
        ref, got = x.copy(), x.copy()
        comm.all_reduce(ref, op)
        h.all_reduce(got, op)
        everyone = comm.all_gather(got)
        out["same_everywhere"] &= bool((everyone == everyone[0]).all())
        out["rel"].append(float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    arrays = [rng.standard_normal(20_000 + 7 * i) for i in range(5)]
    refs = [a.copy() for a in arrays]
    for r in refs:
        comm.all_reduce(r, "avg")
    handles = [h.all_reduce_async(a, "avg") for a in arrays]
    handles[3].test()
    order = [4, 1, 3, 0, 2] if rank % 2 else [0, 2, 1, 4, 3]  # ranks wait in different orders
    for i in order:
        assert handles[i].wait() is arrays[i]
    out["async_abs"] = max(float(np.max(np.abs(a - r))) for a, r in zip(arrays, refs))
    h.close()
    return out


def case_hier_training(rank: int, comm, steps: int) -> list[list[float]]:
    """distopt.SGD with momentum, float64, through the hierarchical communicator (overlapped buckets)."""
    from distopt import SGD, DistOpt

    h = hierarchical_for(comm, True, host=_node(rank))
    rng = np.random.default_rng(7)
    params = [rng.standard_normal(s) for s in ((300, 40), (40,), (5000,))]
    opt = DistOpt(SGD(lr=0.05, momentum=0.9), comm=h, buffSize=6000)
    assert opt.comm is h
    opt.sync_params(params)
    for step in range(steps):
        g = np.random.default_rng(100 * step + rank)
        opt.step(params, [g.standard_normal(p.shape) for p in params])
    return [p.reshape(-1).tolist() for p in params]


def _reference_training(steps: int, world: int) -> list[np.ndarray]:
    from distopt import SGD

    rng = np.random.default_rng(7)
    params = [rng.standard_normal(s) for s in ((300, 40), (40,), (5000,))]
    sgd = SGD(lr=0.05, momentum=0.9)
    for step in range(steps):
        grads = [np.zeros_like(p) for p in params]
        for r in range(world):
            g = np.random.default_rng(100 * step + r)
            for acc, p in zip(grads, params):
                acc += g.standard_normal(p.shape)
        for p, acc in zip(params, grads):
            sgd.update(p, acc / world)
    return [p.reshape(-1) for p in params]


# ------------------------------------------------------------------ tests
@pytest.mark.unit
def test_eligible_layouts():
    assert _eligible([[0, 1], [2, 3]]) == ""
    assert "one node" in _eligible([[0, 1, 2, 3]])
    assert "different numbers" in _eligible([[0, 1, 2], [3]])
    assert "one process per node" in _eligible([[0], [1]])


@pytest.mark.unit
def test_hierarchical_choice_on_one_process():
    comm = SingleCommunicator()
    assert hierarchical_for(comm, None) is comm and hierarchical_for(comm, False) is comm
    with pytest.raises(ValueError, match="hierarchical=True needs several nodes.*one node"):
        hierarchical_for(comm, True)
    g = split(comm, [0])
    assert isinstance(g, Group) and g.rank == 0 and g.size == 1
    with pytest.raises(ValueError, match=r"ranks must be in \[0, 1\)"):
        split(comm, [1])
    with pytest.raises(TypeError, match="ranks must be ints"):
        split(comm, ["0"])


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.world
def test_groups_reduce_inside_each_group(backend):
    results = run_case(backend, 4, case_group_collectives)
    for rank, res in enumerate(results):
        members = [0, 2] if rank % 2 == 0 else [1, 3]
        assert res["ranks"] == members and res["group_rank"] == members.index(rank)
        assert res["sum"] == [sum(m + 1.0 for m in members), sum(10.0 * m for m in members)]
        assert res["world"] == 6.0 and res["name"] == "evens"
        assert "not a member of process group" in res["refused"]


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.world
def test_groups_disagreeing_members_raise_on_every_rank_naming_the_group(backend):
    for message in run_case(backend, 4, case_group_mismatch):
        assert message.startswith("new_group 'dp1': member list differs across ranks"), message
        assert "ranks 0-2: [1, 3], rank 3: [1, 2]" in message, message


@pytest.mark.world
def test_groups_bad_ranks_raise_on_every_rank():
    for message in run_case("mpi", 2, case_bad_ranks):
        assert message.startswith("new_group on rank 1: ranks must be in") and "[0, 2)" in message, message


@pytest.mark.parametrize("backend", GROUP_BACKENDS)
@pytest.mark.world
def test_groups_train_the_data_parallel_halves_of_a_2x2_layout(backend):
    steps = 4
    results = run_case(backend, 4, case_data_parallel_halves, steps, timeout=180)
    for rank, params in enumerate(results):
        expect = _reference_half(rank % 2, steps)
        for got, want in zip(params, expect):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert results[0] == results[2] and results[1] == results[3]


@pytest.mark.world
def test_groups_distopt_on_a_rank_outside_the_group():
    results = run_case("mpi", 2, case_non_member)
    assert results[0] == "member"
    assert "DistOpt(group=): this rank is not a member of process group 'solo'" in results[1], results[1]


@pytest.mark.parametrize("backend", HIER_BACKENDS)
@pytest.mark.world
def test_hierarchical_passes_the_backend_conformance_suite(backend):
    assert run_case(backend, 4, case_hier_conformance, timeout=240) == [True] * 4


@pytest.mark.parametrize("backend", HIER_BACKENDS)
@pytest.mark.world
def test_hierarchical_matches_flat_and_is_identical_on_every_rank(backend):
    for res in run_case(backend, 4, case_hier_against_flat, timeout=180):
        assert res["same_everywhere"]
        assert max(res["rel"]) < 1e-5, res["rel"]  # re-association only (float32 at W = 4)
        assert res["async_abs"] < 1e-12


@pytest.mark.parametrize("backend", HIER_BACKENDS)
@pytest.mark.world
def test_hierarchical_training_equals_one_process(backend):
    steps = 3
    results = run_case(backend, 4, case_hier_training, steps, timeout=180)
    expect = _reference_training(steps, 4)
    for params in results:
        for got, want in zip(params, expect):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    assert all(r == results[0] for r in results)


AUTO = textwrap.dedent("""
    import socket, sys
    import numpy as np
    import distopt
    from distopt.comm.hierarchy import HierarchicalCommunicator
    world = distopt.init(timeout=20)
    for name in sys.argv[1:]:  # one DistOpt per choice, in turn, over the same world
        choice = {"auto": None, "off": False, "on": True}[name]
        opt = distopt.DistOpt(distopt.SGD(lr=0.1), hierarchical=choice, world=world)
        x = np.full(100_000, world.rank + 1.0, dtype=np.float32)
        opt.all_reduce(x)
        print(f"RANK {world.rank} {name} {socket.gethostname()} {isinstance(opt.comm, HierarchicalCommunicator)} "
              f"{float(x[0])}", flush=True)
        opt.close()
""")

#: Gives each rank its own UTS namespace with host name node<rank // 2>, then runs the rest of argv.
_UTS = ["unshare", "--uts", "sh", "-c", 'hostname "node$(( ${PMI_RANK:-${RANK:-0}} / 2 ))" && exec "$0" "$@"']


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a UTS namespace (host name) per rank")
@pytest.mark.parametrize(("launcher", "expected"), [("mpiexec", {"auto": False, "on": True, "off": False}),
                                                   ("torchrun", {"auto": True, "off": False})],
                         ids=["mpiexec", "torchrun"])
@pytest.mark.world
def test_hierarchical_is_chosen_from_the_host_names(tmp_path, launcher, expected):
    """Ranks in UTS namespaces node0, node0, node1, node1: the automatic choice is hierarchical on the torch
    backend only (MPI's own all-reduce keeps its traffic inside the nodes); True and False are obeyed.
    One job per launcher builds a DistOpt for each choice in turn."""
    script = tmp_path / "auto.py"
    script.write_text(AUTO)
    argv = [*_UTS, sys.executable, str(script), *expected]
    if launcher == "mpiexec":
        res = run_job(argv, n=4, timeout=90)
        streams = rank_streams(res.stdout)  # ranks' lines interleave, even mid-line
        out = res.stdout
    else:
        port = str(free_port())
        res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                              "--master-port", port, "--no-python", *argv], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "DISTOPT_TIMEOUT": "20"})
        out = res.stdout + res.stderr
        streams = {r: res.stdout for r in range(4)}  # whole lines may share a line: search all of it
    assert res.returncode == 0, out[-4000:]
    for choice, expect in expected.items():
        for r in range(4):
            assert f"RANK {r} {choice} node{r // 2} {expect} 10.0" in streams.get(r, ""), (choice, out[-4000:])
