"""Launch mismatches (issue 30, item 8): under an MPI launcher a backend whose world is smaller than the
launcher's raises on every process, naming the launcher and both sizes, unless asked for on purpose."""
from __future__ import annotations

import pytest

from distopt.launch import world
from distopt.launch.ranks import INDEPENDENT_ENV, mpi_launcher

HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
TORCHRUN_ONE = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.unit
def test_the_mpi_launcher_is_named_with_its_size():
    assert mpi_launcher(HYDRA) == ("MPICH/Hydra mpiexec (PMI_SIZE=2)", 2)
    assert mpi_launcher(OPEN_MPI) == ("Open MPI's mpiexec (OMPI_COMM_WORLD_SIZE=4)", 4)
    assert mpi_launcher({"RANK": "0"}) is None


@pytest.mark.unit
@pytest.mark.parametrize("env, backend, launcher, size", [
    (HYDRA, "single", "MPICH/Hydra mpiexec (PMI_SIZE=2)", 2),
    (OPEN_MPI, "single", "Open MPI's mpiexec (OMPI_COMM_WORLD_SIZE=4)", 4),
    ({**HYDRA, **TORCHRUN_ONE}, None, "MPICH/Hydra mpiexec (PMI_SIZE=2)", 2),  # a torchrun-style port
    ({**HYDRA, **TORCHRUN_ONE}, "torch", "MPICH/Hydra mpiexec (PMI_SIZE=2)", 2),
])
def test_a_world_smaller_than_the_mpi_launch_is_refused(env, backend, launcher, size):
    with pytest.raises(ValueError) as err:
        world.build_world(backend=backend, env=env)
    message = str(err.value)
    assert launcher in message and f"a job of {size} processes" in message and "world of 1" in message, message
    assert INDEPENDENT_ENV in message, message


@pytest.mark.unit
def test_independent_copies_when_asked_for():
    comm, info = world.build_world(backend="single", env={**HYDRA, INDEPENDENT_ENV: "1"})
    assert (comm.name, comm.size, info.world_size) == ("single", 1, 1)
    comm.close()


@pytest.mark.unit
def test_a_launcher_of_one_process_is_not_a_mismatch():
    comm, _ = world.build_world(backend="single", env={**HYDRA, "PMI_RANK": "0", "PMI_SIZE": "1",
                                                       "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert comm.size == 1
    comm.close()
