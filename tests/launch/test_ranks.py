"""Rank and device derivation (pure functions) plus one 2-process check."""
from __future__ import annotations

import time

import pytest

from distopt.launch.ranks import RankInfo, device_index, from_env, from_explicit, from_hosts, resolve
from tests.support.harness import run_mpi_suite


def triple(info: RankInfo | None) -> tuple[int, int, int]:
    assert info is not None
    return info.global_rank, info.local_rank, info.world_size


OMPI = {"OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"}


# --- shared case H23 ---------------------------------------------------------

@pytest.mark.parametrize("env, expected, source", [
    (OMPI, (7, 3, 8), "OMPI"),
    ({"PMI_RANK": "6", "MPI_LOCALRANKID": "2", "PMI_SIZE": "8"}, (6, 2, 8), "MPICH"),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}, (5, 1, 8), "Slurm"),
    ({"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}, (4, 0, 8), "torchrun"),
], ids=["OMPI", "MPICH", "Slurm", "torchrun"])
@pytest.mark.unit
def test_h23_launcher_env(env, expected, source):
    for info in (from_env(env), resolve(env=env)):
        assert triple(info) == expected
        assert info.source == source


@pytest.mark.unit
def test_h23_round_robin_hosts_no_env():
    hosts = ["A", "B", "A", "B"]  # 4 MPI ranks round-robin on two hosts
    gpu_per_node = 2
    assert from_env({}) is None
    infos = [from_hosts(hosts, r) for r in range(4)]
    assert [i.local_rank for i in infos] == [0, 0, 1, 1]  # rank0->0, rank1->0, rank2->1, rank3->1
    assert [i.node_rank for i in infos] == [0, 1, 0, 1]
    assert all(i.local_size == 2 and i.num_nodes == 2 and i.world_size == 4 for i in infos)
    dev = [device_index(i.local_rank, {}, device_count=gpu_per_node, local_size=i.local_size) for i in infos]
    assert dev[0] != dev[2]  # the two ranks on host A
    assert dev[1] != dev[3]  # and on host B
    # what rank % gpu_per_node would have given: both host-A ranks on GPU 0
    assert [r % gpu_per_node for r in (0, 2)] == [0, 0]


@pytest.mark.unit
def test_h23_single_visible_device():
    assert device_index(1, {"CUDA_VISIBLE_DEVICES": "3"}) == 0
    assert device_index(1, {"CUDA_VISIBLE_DEVICES": "3"}, device_count=1, local_size=2) == 0


@pytest.mark.unit
def test_h23_explicit_wins_over_env():
    info = resolve(gpu_num=1, gpu_per_node=4, env=OMPI)
    assert triple(info) == (1, 1, 4)
    assert info.source == "explicit"
    info = resolve(gpu_num=1, gpu_per_node=4, node_rank=1, num_nodes=2, env=OMPI)
    assert triple(info) == (5, 1, 8)
    assert (info.node_rank, info.num_nodes, info.local_size) == (1, 2, 4)


# --- environment -------------------------------------------------------------

@pytest.mark.unit
def test_no_launcher_info_is_single_process():
    assert from_env({"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0"}) is None
    assert resolve(env={}) == RankInfo(0, 1, 0, 1, 0, 1, "single")


@pytest.mark.unit
def test_full_variable_sets():
    info = from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                     "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"})
    assert info == RankInfo(5, 8, 1, 4, 1, 2, "torchrun")
    info = from_env({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "3"})
    assert info == RankInfo(7, 8, 3, 4, None, None, "OMPI")  # NODE_RANK is not a node index
    info = from_env({"PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"})
    assert info == RankInfo(6, 8, 2, 4, None, None, "MPICH")


@pytest.mark.unit
def test_slurm_local_size_only_when_even():
    base = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
            "SLURM_NNODES": "2"}
    assert from_env(base) == RankInfo(5, 8, 1, None, 1, 2, "Slurm")
    assert from_env({**base, "SLURM_NTASKS_PER_NODE": "4"}).local_size == 4
    assert from_env({**base, "SLURM_NTASKS_PER_NODE": "5"}).local_size is None  # 8 != 2*5
    assert from_env({**base, "SLURM_NTASKS_PER_NODE": "4(x2)"}).local_size is None


@pytest.mark.unit
def test_precedence():
    slurm = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1"}  # inherited batch shell
    torch = {"RANK": "4", "LOCAL_RANK": "0", "WORLD_SIZE": "8"}
    pmi = {"PMI_RANK": "6", "MPI_LOCALRANKID": "2", "PMI_SIZE": "8"}
    assert from_env({**slurm, **OMPI}).source == "OMPI"
    assert from_env({**slurm, **pmi}).source == "MPICH"
    assert from_env({**OMPI, **pmi}).source == "OMPI"
    assert from_env({**OMPI, **torch}).source == "torchrun"
    assert from_env({**slurm, **torch}).source == "torchrun"


@pytest.mark.unit
def test_slurm_allocation_shell_is_not_a_launch():
    assert from_env({"SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1"}) is None


@pytest.mark.parametrize("env, words", [
    ({"OMPI_COMM_WORLD_RANK": "8", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     ["OMPI", "OMPI_COMM_WORLD_RANK=8", "OMPI_COMM_WORLD_SIZE=8", "global_rank"]),
    ({"PMI_RANK": "3", "MPI_LOCALRANKID": "0"}, ["MPICH", "PMI_RANK=3", "PMI_SIZE not set"]),
    ({"RANK": "1", "WORLD_SIZE": "2"}, ["torchrun", "LOCAL_RANK not set"]),
    ({"LOCAL_RANK": "1"}, ["torchrun", "RANK and WORLD_SIZE not set"]),
    ({"SLURM_PROCID": "1"}, ["Slurm", "SLURM_NTASKS and SLURM_LOCALID not set"]),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     ["torchrun", "LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2", "local_rank"]),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
      "SLURM_NNODES": "2"}, ["Slurm", "SLURM_NODEID=2", "node_rank"]),
    ({"PMI_RANK": "x", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, ["PMI_RANK='x'", "not an integer"]),
    ({"PMI_RANK": "-1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"}, ["PMI_RANK=-1"]),
])
@pytest.mark.unit
def test_inconsistent_env_raises(env, words):
    with pytest.raises(ValueError) as err:
        from_env(env)
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ValueError):
        resolve(env=env)


# --- hosts -------------------------------------------------------------------

@pytest.mark.unit
def test_from_hosts_block_and_uneven():
    hosts = ["n1", "n1", "n1", "n2", "n0"]
    infos = [from_hosts(hosts, r) for r in range(5)]
    assert [(i.local_rank, i.local_size, i.node_rank) for i in infos] == [
        (0, 3, 0), (1, 3, 0), (2, 3, 0), (0, 1, 1), (0, 1, 2)]
    assert all(i.num_nodes == 3 and i.source == "hosts" for i in infos)


@pytest.mark.unit
def test_from_hosts_bad_rank():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        from_hosts(["a", "b"], 2)
    with pytest.raises(ValueError):
        from_hosts([], 0)


# --- explicit ----------------------------------------------------------------

@pytest.mark.unit
def test_explicit():
    assert from_explicit(3, 4, node_rank=2, num_nodes=3) == RankInfo(11, 12, 3, 4, 2, 3, "explicit")


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpu_num=5, gpu_per_node=4), "gpu_num must be in [0, gpu_per_node=4), got 5"),
    (dict(gpu_num=-1, gpu_per_node=4), "gpu_num must be in [0, gpu_per_node=4), got -1"),
    (dict(gpu_num=0, gpu_per_node=0), "gpu_per_node must be >= 1, got 0"),
    (dict(gpu_num=0, gpu_per_node=2, num_nodes=0), "num_nodes must be >= 1, got 0"),
    (dict(gpu_num=0, gpu_per_node=2, node_rank=2, num_nodes=2), "node_rank must be in [0, num_nodes=2), got 2"),
])
@pytest.mark.unit
def test_explicit_validation(kwargs, message):
    with pytest.raises(ValueError) as err:
        from_explicit(**kwargs)
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        resolve(**kwargs, env={})
    assert str(err.value) == message


@pytest.mark.unit
def test_explicit_type_check():
    with pytest.raises(TypeError, match="gpu_num must be an int"):
        from_explicit(1.0, 4)  # type: ignore[arg-type]


@pytest.mark.unit
def test_resolve_needs_gpu_num_and_gpu_per_node_together():
    with pytest.raises(ValueError, match="gpu_num was given without gpu_per_node"):
        resolve(gpu_num=1, env={})
    with pytest.raises(ValueError, match="gpu_per_node was given without gpu_num"):
        resolve(gpu_per_node=4, env=OMPI)
    with pytest.raises(ValueError, match="node_rank=1 and num_nodes=2 apply only together"):
        resolve(node_rank=1, num_nodes=2, env={})


@pytest.mark.unit
def test_resolve_env_before_mpi():
    class NoComm:  # any collective on it would fail
        def __getattr__(self, name):
            raise AssertionError(f"mpi_comm.{name} used although the environment answered")
    assert resolve(env=OMPI, mpi_comm=NoComm()).source == "OMPI"


@pytest.mark.unit
def test_rank_info_validates():
    with pytest.raises(ValueError, match="global_rank"):
        RankInfo(2, 2, 0, 1, 0, 1, "x")
    with pytest.raises(ValueError, match="local_rank"):
        RankInfo(0, 2, 2, 2, 0, 1, "x")
    with pytest.raises(ValueError, match="local_size"):
        RankInfo(0, 2, 0, 3, 0, 1, "x")
    with pytest.raises(ValueError, match="node_rank"):
        RankInfo(0, 2, 0, 1, 1, 1, "x")
    info = RankInfo(0, 1, 0, 1, 0, 1, "x")
    with pytest.raises(AttributeError):
        info.global_rank = 1  # type: ignore[misc]


class FakeComm:
    """Stands in for an mpi4py communicator: rank ``rank`` of a job whose shared-memory
    leaders and processor names are given (allgather answers them in that order)."""

    def __init__(self, rank: int, leaders: list[int], names: list[str]):
        self.rank, self.leaders, self.gathered = rank, leaders, [leaders, names]

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return len(self.leaders)

    def Split_type(self, split_type, key):
        return self

    def bcast(self, value, root):
        return self.leaders[self.rank]

    def Free(self):
        pass

    def allgather(self, value):
        return self.gathered.pop(0)


@pytest.mark.unit
def test_mpi_branch_uses_shared_memory_groups():
    pytest.importorskip("mpi4py")
    leaders, names = [0, 1, 0, 1], ["A", "B", "A", "B"]
    infos = [resolve(env={}, mpi_comm=FakeComm(r, leaders, names)) for r in range(4)]
    assert [(i.local_rank, i.local_size, i.node_rank, i.num_nodes) for i in infos] == [
        (0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
    assert {i.source for i in infos} == {"mpi"}


@pytest.mark.unit
def test_mpi_branch_falls_back_to_host_names_when_shared_split_is_all_singletons():
    pytest.importorskip("mpi4py")
    leaders, names = [0, 1, 2, 3], ["A", "A", "B", "B"]  # AMReX #3382: every rank alone
    infos = [resolve(env={}, mpi_comm=FakeComm(r, leaders, names)) for r in range(4)]
    assert [(i.local_rank, i.local_size, i.node_rank) for i in infos] == [
        (0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]


# --- devices -----------------------------------------------------------------

@pytest.mark.unit
def test_device_index_visible_devices():
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert [device_index(r, env) for r in range(4)] == [0, 1, 2, 3]
    assert device_index(1, {"CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}) == 1
    assert device_index(1, {"CUDA_VISIBLE_DEVICES": "MIG-a"}) == 0
    assert device_index(3, {}) == 3  # nothing known: the local rank
    assert device_index(1, {}, device_count=2) == 1
    assert device_index(1, {}, device_count=1) == 0


@pytest.mark.parametrize("local_rank, env, count, size", [
    (2, {"CUDA_VISIBLE_DEVICES": "0,1"}, None, None),
    (0, {"CUDA_VISIBLE_DEVICES": "0,1"}, None, 3),  # rank 0 fails too, like its neighbours
    (2, {"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}, None, None),  # CUDA stops at the invalid entry
    (2, {}, 2, None),
    (2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2, None),  # the runtime sees fewer
])
@pytest.mark.unit
def test_more_local_ranks_than_devices_raises(local_rank, env, count, size):
    with pytest.raises(ValueError, match="visible devices.*share a GPU.*Duplicate GPU"):
        device_index(local_rank, env, device_count=count, local_size=size)


@pytest.mark.parametrize("env, count", [({"CUDA_VISIBLE_DEVICES": ""}, None),
                                        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
                                        ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
                                        ({}, 0)])
@pytest.mark.unit
def test_no_visible_device_raises(env, count):
    with pytest.raises(ValueError, match="no visible device"):
        device_index(0, env, device_count=count)


@pytest.mark.unit
def test_device_index_argument_checks():
    with pytest.raises(ValueError, match="local_rank must be >= 0"):
        device_index(-1, {})
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, local_size=2\), got 2"):
        device_index(2, {}, local_size=2)


# --- real processes ----------------------------------------------------------

@pytest.mark.world
def test_two_processes_resolve_from_mpi():
    """mpiexec -n 2 (the MPI pool's ranks): resolve(mpi_comm=COMM_WORLD, env={}) gives local ranks {0, 1},
    distinct devices."""
    start = time.monotonic()
    outs = run_mpi_suite("mpi_ranks.py", 2, 60.0)
    elapsed = time.monotonic() - start
    assert len(outs) == 2, outs  # both ranks reported
    assert [out.count("2 passed") for out in outs] == [1, 1], outs  # one line per rank
    assert elapsed < 30.0, f"2-process rank check took {elapsed:.1f} s"


@pytest.mark.unit
def test_srun_pmi2_uses_slurm_local_rank():
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE without MPI_LOCALRANKID: Slurm's variables give the local rank."""
    env = {"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
    info = from_env(env)
    assert (info.global_rank, info.local_rank, info.world_size, info.source) == (5, 1, 8, "Slurm")
