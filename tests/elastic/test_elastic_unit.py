"""distopt.elastic's pure parts, in process: the sampler's arithmetic, the commit files, State, the launch check."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from distopt.checkpoint import TMP_SUFFIX, dump_into
from distopt.elastic import ElasticLaunchError, ElasticSampler, SnapshotDir, State, check_launch

pytestmark = pytest.mark.unit

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job7", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _consume(sampler: ElasticSampler, world: int, steps: int) -> list[int]:
    """``steps`` steps of every rank of a world of ``world`` (each rank's own sampler state, as on a job)."""
    ranks = [ElasticSampler(sampler.num_samples, sampler.batch_size, seed=sampler.seed, rank=r, world_size=world)
             for r in range(world)]
    for s in ranks:
        s.load_state_dict(sampler.state_dict())
    seen: list[int] = []
    iters = [iter(s) for s in ranks]
    for _ in range(steps):
        for it in iters:
            seen.extend(next(it))
        for s in ranks:
            s.record_batch()
    sampler.load_state_dict(ranks[0].state_dict())
    return seen


@pytest.mark.parametrize("worlds", [(3, 2), (2, 3), (4, 1, 3), (1, 4)])
def test_sampler_every_sample_once_across_world_changes(worlds: tuple[int, ...]) -> None:
    sampler = ElasticSampler(50, 3, seed=5)
    seen: list[int] = []
    for world in worlds[:-1]:
        seen += _consume(sampler, world, 2)
    seen += _consume(sampler, worlds[-1], -(-(50 - sampler.processed) // (3 * worlds[-1])))
    assert sorted(seen) == list(range(50))
    assert sampler.processed == 50 and len(sampler) == 0


def test_sampler_order_is_the_world_independent_permutation() -> None:
    a, b = ElasticSampler(20, 2, seed=3, world_size=2), ElasticSampler(20, 5, seed=3, rank=2, world_size=4)
    np.testing.assert_array_equal(a.order(), b.order())
    np.testing.assert_array_equal(a.order(), np.random.default_rng((3, 0)).permutation(20))
    a.set_epoch(1)
    assert not np.array_equal(a.order(), b.order())
    assert list(ElasticSampler(6, 2, shuffle=False, rank=1, world_size=2)) == [[1, 3], [5]]


def test_sampler_last_window_uneven_and_empty_share() -> None:
    s = ElasticSampler(7, 2, shuffle=False, rank=2, world_size=3)
    assert list(s) == [[2, 5], []] and len(s) == 2  # the second window holds sample 6 alone
    s = ElasticSampler(7, 1, shuffle=False, rank=2, world_size=3)
    assert list(s) == [[2], [5], []] and len(s) == 3


def test_sampler_set_epoch_keeps_a_restored_position() -> None:
    s = ElasticSampler(10, 2)
    s.record_batch()
    s.set_epoch(0)
    assert s.processed == 2
    s.set_epoch(1)
    assert (s.epoch, s.processed) == (1, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0, batch_size=2), "num_samples must be a positive int"),
    (dict(num_samples=4, batch_size=2.0), "batch_size must be a positive int"),
    (dict(num_samples=4, batch_size=2, seed=-1), "seed must be an int >= 0"),
    (dict(num_samples=4, batch_size=2, rank=2, world_size=2), r"rank must be an int in \[0, 2\)"),
])
def test_sampler_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ElasticSampler(**kwargs)


def test_sampler_refuses_a_state_of_another_dataset() -> None:
    with pytest.raises(ValueError, match="num_samples=10, seed=0; this sampler has num_samples=12"):
        ElasticSampler(12, 2).load_state_dict(ElasticSampler(10, 2).state_dict())


def test_snapshot_dir_keeps_the_newest_commit_alone(tmp_path: Path) -> None:
    d = SnapshotDir("job", tmp_path)
    assert d.newest() is None and d.held() == {}
    d.write(1, 0, 2, b"one-0")
    d.write(1, 1, 2, b"one-1")  # a sharded commit: one part per rank
    assert sorted(p.name for p in d.path.iterdir()) == ["commit-1.part0of2.pt", "commit-1.part1of2.pt"]
    (d.path / f".commit-2.part1of2.pt.host.999999.x{TMP_SUFFIX}").write_bytes(b"tw")  # killed mid-write
    assert d.newest() == 1 and sorted(d.held()) == [(1, 2)]  # a temporary file is never read
    d.write(2, 0, 1, b"two")
    assert sorted(p.name for p in d.path.iterdir())[-2:] == ["commit-1.part1of2.pt", "commit-2.part0of1.pt"]
    writing = d.path / f".commit-3.part1of2.pt.host.{os.getpid()}.x{TMP_SUFFIX}"  # another rank, already at 3
    writing.write_bytes(b"th")
    d.prune(2)  # once every rank stored commit 2
    assert sorted(p.name for p in d.path.iterdir()) == [writing.name, "commit-2.part0of1.pt"]
    writing.unlink()
    assert d.newest() == 2 and d.held()[(2, 1)][0].read_bytes() == b"two"
    d.remove()
    assert not d.path.exists() and d.newest() is None


@pytest.mark.parametrize("run_id", ["", "a/b", ".."])
def test_snapshot_dir_refuses_a_path_as_run_id(run_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the run id must be a plain name"):
        SnapshotDir(run_id, tmp_path)


def test_state_commit_restore_round_trip_is_a_copy() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = ElasticSampler(8, 2)
    state = State(model=model, optimizer=opt, sampler=sampler, epoch=0, step=4)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.commit()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    opt.step()  # live tensors move on; the commit must not
    sampler.record_batch()
    state.epoch, state.step = 1, 9
    state.restore()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    assert (state.epoch, state.step, sampler.processed, state.commits) == (0, 4, 0, 1)


def test_a_stored_commit_is_restored_from_its_file_and_no_earlier_part_is_held_while_the_next_is_made(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    state = State(model=model, step=0)
    seen = []

    def store(seq: int, part: dict) -> Path:
        seen.append(isinstance(part, dict))  # the part itself, streamed into the file: not its bytes
        path = tmp_path / f"commit-{seq}"
        with open(path, "wb") as f:
            dump_into(part, "test", f)
        return path

    made = State._part

    def part(seq: int) -> dict:
        seen.append(not isinstance(state._committed, bytes))  # no bytes of the last commit held while this is made
        return made(state, seq)

    object.__setattr__(state, "_part", part)
    state._attach(store)
    state.commit()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    state.step = 1
    state.commit()
    assert seen == [True] * 4 and state._committed == tmp_path / "commit-2"  # a path, not the bytes
    assert state.part_bytes == (tmp_path / "commit-2").stat().st_size > 0
    with torch.no_grad():
        model.weight.add_(1.0)
    state.step = 5
    state.restore()
    assert state.step == 1 and all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_state_errors() -> None:
    with pytest.raises(RuntimeError, match="nothing was committed yet"):
        State(epoch=0).restore()
    with pytest.raises(ValueError, match=r"value names \['commit'\] are taken"):
        State(commit=1)
    state = State(epoch=0)
    with pytest.raises(AttributeError, match="'batch' is not a plain value"):
        state.batch = 3
    with pytest.raises(AttributeError, match="has no value 'batch'"):
        _ = state.batch


def test_check_launch_accepts_elastic_torchrun() -> None:
    assert check_launch(TORCHRUN) == "job7"


@pytest.mark.parametrize("env, match", [
    ({"PMI_RANK": "0"}, "does not work under mpiexec/mpirun: an MPI communicator cannot lose or gain"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "does not work under mpiexec"),
    ({"PMIX_RANK": "2"}, "does not work under mpiexec"),
    ({"DISTOPT_JOB_ID": "x", "RANK": "0"}, "does not work under python -m distopt.launch"),
    ({}, "needs torchrun's elastic agent"),
    ({**TORCHRUN, "TORCHELASTIC_RUN_ID": "none"}, "needs an explicit --rdzv-id"),
    ({"TORCHELASTIC_RUN_ID": "j"}, "needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),
])
def test_check_launch_refuses_what_cannot_be_elastic(env: dict, match: str) -> None:
    with pytest.raises(ElasticLaunchError, match=match) as info:
        check_launch(env)
    assert "torchrun --nnodes" in str(info.value)


def test_lost_world_line_says_where_the_commit_stays(tmp_path: Path) -> None:
    from distopt.elastic.run import _lost_world

    kept = SnapshotDir("job7", tmp_path)
    kept.write(2, 0, 1, b"two")
    line = _lost_world(RuntimeError("peer gone"), 0, 3, kept, "job7", torchrun=True)
    assert line.startswith("distopt.elastic: rank 0 of 3 lost the world (RuntimeError: peer gone)")
    assert "fewer nodes than torchrun's --nnodes MIN are left" in line and "RendezvousTimeoutError" in line
    assert f"commit 2 stays in {kept.run} on this node, and a job relaunched with --rdzv-id job7 resumes" in line
    line = _lost_world(RuntimeError("x"), 1, 2, SnapshotDir("job8", tmp_path), "job8", torchrun=False)
    assert "torchrun" not in line and line.endswith("newest commit; nothing is committed on this node yet.\n")


def test_agents_on_one_host_keep_their_commits_apart(tmp_path: Path) -> None:
    """Several torchrun agents of one run on one host: a writer's clean-up never removes another agent's
    commit or half-written file, and every agent (a relaunch's too) finds every part on the host."""
    first, second = SnapshotDir("job", tmp_path, agent=101), SnapshotDir("job", tmp_path, agent=202)
    second.write(1, 1, 2, b"one")
    half = second.path / f".commit-2.part1of2.pt.host.4242.x{TMP_SUFFIX}"  # the second agent's writer, mid-write
    half.write_bytes(b"tw")
    first.write(2, 0, 2, b"two-0")
    first.prune(2)
    assert half.exists() and (second.path / "commit-1.part1of2.pt").exists()
    second.write(2, 1, 2, b"two-1")
    relaunched = SnapshotDir("job", tmp_path, agent=303)
    for d in (first, second, relaunched):
        parts = d.held()[(2, 2)]
        assert d.newest() == 2 and [parts[k].read_bytes() for k in (0, 1)] == [b"two-0", b"two-1"]
    relaunched.remove()
    assert not first.run.exists()


def test_elastic_sampler_read_before_set_epoch_says_so() -> None:
    """A loop that reads a batch before ``set_epoch`` gets a clear error naming it, not a bare
    StopIteration; a restored sampler at the end of an epoch still iterates (nothing left) after set_epoch."""
    sampler = ElasticSampler(8, 2, world_size=2)
    for _ in sampler:
        sampler.record_batch()
    with pytest.raises(RuntimeError, match=r"epoch 0 is used up .* call sampler.set_epoch\(1\)"):
        next(iter(sampler))
    sampler.set_epoch(1)
    assert len(list(sampler)) == 2
    restored = ElasticSampler(8, 2, world_size=2)
    restored.load_state_dict({"epoch": 3, "processed": 8, "num_samples": 8, "seed": 0})
    restored.set_epoch(3)  # the resumed loop's call for the epoch in hand
    assert list(restored) == []


def test_a_commit_the_store_could_not_write_is_still_restored_from_memory() -> None:
    model = torch.nn.Linear(3, 2)
    state = State(model=model, step=0)

    def full(seq: int, part: dict) -> Path:
        raise OSError(28, "No space left on device")

    state._attach(full)
    state.step = 3
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OSError):
        state.commit()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.step = 4
    state.restore()
    assert state.commits == 1 and state.step == 3
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
