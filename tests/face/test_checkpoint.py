"""Checkpoints that travel: weights-only loads, other world sizes, corrupt files, rank-0 restore.

Simulated worlds of threads (tests/support/simworld.py) sharing one directory; the
real-process resume runs live in tests/launch/test_reliability.py.
"""
from __future__ import annotations

import io
import logging
import pickle

import numpy as np
import pytest

import distopt
from distopt import SGD, DistOpt
from distopt.strategies import REGISTRY, Dense, Partial, Sparse
from tests.support.simworld import RankFailed, run_world

pytestmark = pytest.mark.unit

torch = pytest.importorskip("torch")

def _train(comm, strategy, steps=3, momentum=0.9):
    opt = DistOpt(SGD(lr=0.1, momentum=momentum), comm=comm, strategy=strategy)
    params = [np.zeros(8, np.float32), np.zeros(3, np.float32)]
    opt.sync_params(params)
    for s in range(steps):
        rng = np.random.default_rng(10 * s + comm.rank)
        opt.step(params, [rng.standard_normal(p.shape).astype(np.float32) for p in params], threshold=4)
    return opt, params


@pytest.mark.parametrize("example", REGISTRY.values(), ids=lambda e: e.id)
def test_state_dict_round_trips_through_torch_load_weights_only(example):
    for module in example.requires:
        pytest.importorskip(module)

    def rank_fn(rank, comm):
        opt, params = _train(comm, example.build(), momentum=example.local_momentum)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        restored = torch.load(buf, weights_only=True)  # raises on anything but tensors and plain data
        fresh, again = _train(comm, example.build(), steps=0, momentum=example.local_momentum)
        for p, q in zip(again, params):
            p[...] = q
        fresh.load_state_dict(restored)
        g = [np.full(p.shape, 0.5 + rank, np.float32) for p in params]
        opt.step(params, [x.copy() for x in g], threshold=4)
        fresh.step(again, [x.copy() for x in g], threshold=4)
        return params, again

    for a, b in run_world(2, rank_fn):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))  # bitwise the same next step


@pytest.mark.parametrize("world", [1, 3])
def test_checkpoint_written_at_w2_resumes_at_another_world_size(tmp_path, caplog, world):
    path = tmp_path / "ckpt.pt"

    def writer(rank, comm):
        opt, params = _train(comm, Sparse(density=0.25, select="topk"))
        distopt.save(path, params, opt)
        return opt.state_dict()

    written = run_world(2, writer)

    def reader(rank, comm):
        opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=Sparse(density=0.25, select="topk"))
        params = distopt.load(path, opt)
        return params, opt.state_dict()

    with caplog.at_level(logging.WARNING, logger="distopt"):
        results = run_world(world, reader)
    assert "written with world size 2, this job has %d" % world in caplog.text
    for params, state in results:
        assert isinstance(params[0], np.ndarray) and params[0].shape == (8,)
        assert state["stats"]["steps"] == written[0]["stats"]["steps"] == 3
        momenta = state["local"]["momentum_buffers"]
        assert all(torch.equal(m["__array__"], w["__array__"])
                   for m, w in zip(momenta, written[0]["local"]["momentum_buffers"]))
        assert state["rank_local"]["strategy"]["residuals"]["values"] == []  # residuals start at zero


def test_partial_cursor_is_kept_at_another_world_size(tmp_path):
    path = tmp_path / "ckpt.pt"

    def writer(rank, comm):
        opt, params = _train(comm, Partial(chunk_size=4), steps=1)  # chunks [8 elements] and [3]
        distopt.save(path, params, opt)
        return opt.strategy.cursor.position

    (position, _) = run_world(2, writer)

    def reader(rank, comm):
        opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=Partial(chunk_size=4))
        distopt.load(path, opt)
        return opt.strategy.cursor.position

    assert run_world(3, reader) == [position] * 3 and position == 1


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_checkpoint_is_a_clear_error_on_every_rank(tmp_path, damage):
    path = tmp_path / "ckpt.pt"
    run_world(2, lambda rank, comm: distopt.save(path, [], _train(comm, Dense())[0]))
    raw = path.read_bytes()
    path.write_bytes({"truncated": raw[: len(raw) // 2], "garbage": b"not a checkpoint" * 10, "empty": b""}[damage])

    def reader(rank, comm):
        opt = DistOpt(SGD(lr=0.1), comm=comm)
        with pytest.raises(ValueError, match="is truncated or corrupt"):
            distopt.load(path, opt)
        return True

    assert run_world(2, reader) == [True, True]


def test_a_checkpoint_cannot_run_code_at_load_time(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(pickle.dumps({"format": 2, "payload": _Evil()}))

    def reader(rank, comm):
        with pytest.raises(ValueError, match="is not allowed in a distopt checkpoint"):
            distopt.load(path, DistOpt(SGD(lr=0.1), comm=comm))

    run_world(1, reader)
    assert not (tmp_path / "pwned").exists()


class _Evil:
    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(__file__).parent / "pwned",))


def test_older_format_is_refused_with_its_version(tmp_path):
    path = tmp_path / "old.pkl"
    buf = io.BytesIO()
    torch.save({"model": [], "opt": {}, "world_size": 1}, buf)
    path.write_bytes(buf.getvalue())
    with pytest.raises(RankFailed, match="has format 1; this distopt reads format 2"):
        run_world(1, lambda rank, comm: distopt.load(path, DistOpt(SGD(lr=0.1), comm=comm)))


def test_rank0_only_restore_then_broadcast_state(tmp_path):
    """Horovod's recipe: only rank 0 reads the checkpoint, then broadcast_state() synchronises everyone."""
    path = tmp_path / "model.pt"

    def make(comm, seed):
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, sgd, DistOpt(sgd, comm=comm, model=model)

    def writer(rank, comm):
        model, sgd, opt = make(comm, 0)
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": sgd.state_dict()}, path)
        comm.barrier()
        return [p.detach().clone() for p in model.parameters()]

    trained = run_world(2, writer)[0]

    def reader(rank, comm):
        model, sgd, opt = make(comm, 100 + rank)  # fresh, different weights per rank
        if rank == 0:
            saved = torch.load(path, weights_only=True)
            model.load_state_dict(saved["model"])
            sgd.load_state_dict(saved["opt"])
        opt.broadcast_state(root=0)
        state = [sgd.state[p]["momentum_buffer"].clone() for p in model.parameters()]
        return [p.detach().clone() for p in model.parameters()], state

    (p0, m0), (p1, m1) = run_world(2, reader)
    assert all(torch.equal(a, b) for a, b in zip(p0, trained)) and all(torch.equal(a, b) for a, b in zip(p1, p0))
    assert all(torch.equal(a, b) for a, b in zip(m0, m1))
