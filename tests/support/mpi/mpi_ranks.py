"""Rank resolution on real processes (run under mpiexec -n 2 by tests/launch/test_ranks.py)."""
from __future__ import annotations

import os

import pytest
from mpi4py import MPI

from distopt.launch.ranks import device_index, from_env, from_hosts, resolve


def test_resolve_from_mpi_comm(world):
    info = resolve(mpi_comm=world, env={})  # env={}: only the communicator counts
    assert info.source == "mpi"
    assert (info.global_rank, info.world_size) == (world.Get_rank(), world.Get_size())
    by_host = from_hosts(world.allgather(MPI.Get_processor_name()), world.Get_rank())
    assert (info.local_rank, info.local_size, info.node_rank, info.num_nodes) == (
        by_host.local_rank, by_host.local_size, by_host.node_rank, by_host.num_nodes)
    # per node: local ranks 0..local_size-1 and as many distinct devices (on one host, as the
    # outer test runs it: local ranks {0, 1}, local_size 2 == world size at -n 2)
    on_node = [(n, r) for n, r in world.allgather((info.node_rank, info.local_rank)) if n == info.node_rank]
    assert sorted(r for _, r in on_node) == list(range(info.local_size))
    device = device_index(info.local_rank, {}, device_count=info.local_size, local_size=info.local_size)
    devices = [d for n, d in world.allgather((info.node_rank, device)) if n == info.node_rank]
    assert len(set(devices)) == len(devices) == info.local_size, devices


def test_launcher_env_matches_mpi(world):
    """The launcher's own variables (Hydra: PMI_RANK, MPI_LOCALRANKID) agree with the communicator."""
    by_env = from_env(os.environ)
    by_mpi = resolve(mpi_comm=world, env={})
    if by_env is None:
        pytest.skip("not started by a launcher that sets rank variables")
    assert (by_env.global_rank, by_env.world_size, by_env.local_rank, by_env.local_size) == (
        by_mpi.global_rank, by_mpi.world_size, by_mpi.local_rank, by_mpi.local_size)
