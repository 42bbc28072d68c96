"""Checkpoint cases: NumPy scalars (H50), values the safe loader refuses, damaged files reported on every rank.

Simulated worlds of threads (tests/support/simworld.py, whose timeout names the
stalled rank) sharing one directory; the same cases under ``mpiexec -n 2``
are in tests/support/mpi/mpi_checkpoint_cases.py.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile

import numpy as np
import pytest

import distopt
from distopt import SGD, DistOpt
from distopt.strategies import Sparse
from tests.support.harness import run_mpi_suite
from tests.support.simworld import run_world

torch = pytest.importorskip("torch")

Point = collections.namedtuple("Point", "x y")


class Custom:
    pass


def _h50_state(net):
    return {"model": net.state_dict(), "epoch": np.int64(3), "best_acc": np.float64(0.91), "lr": np.float32(0.1),
            "hist": [np.float64(1.0)]}


def _torch_opt(comm):
    net = torch.nn.Linear(3, 2)
    return net, DistOpt(torch.optim.SGD(net.parameters(), lr=0.1), comm=comm, model=net)


def _errors(size, fn):
    """Run ``fn(rank, comm)`` on every rank of a simulated world; every rank's exception (None: none)."""
    def body(rank, comm):
        try:
            fn(rank, comm)
        except Exception as exc:  # noqa: BLE001 (compared below)
            return exc
        return None

    return run_world(size, body)


@pytest.mark.unit
def test_h50_numpy_scalars_round_trip_on_every_rank(tmp_path):
    path = tmp_path / "ckpt.pt"

    def rank_fn(rank, comm):
        net, opt = _torch_opt(comm)
        saved = _h50_state(net)
        distopt.save(path, saved, opt)
        return saved, distopt.load(path, opt)

    for saved, loaded in run_world(2, rank_fn):
        for key in ("epoch", "best_acc", "lr"):
            assert loaded[key] == saved[key] and type(loaded[key]) is type(saved[key]), key
        assert loaded["hist"] == saved["hist"] and type(loaded["hist"][0]) is np.float64
        assert all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items())
    plain = torch.load(path, weights_only=True)  # plain torch reads it too
    assert plain["model"]["epoch"] == {"__scalar__": 3, "dtype": "int64"}


@pytest.mark.parametrize("value, key, kind", [
    (Custom(), "model_state['extra']", "test_checkpoint_cases.Custom"),
    (Point(1, 2), "model_state['extra']", "test_checkpoint_cases.Point"),
    ({"when": np.datetime64("2024-01-01")}, "model_state['extra']['when']", "numpy.datetime64"),
    ({np.int64(1): 2.0}, "model_state['extra']", "numpy.int64"),
], ids=["class", "namedtuple", "datetime64", "numpy_key"])
@pytest.mark.unit
def test_a_value_the_safe_loader_refuses_is_refused_at_save_on_every_rank(tmp_path, value, key, kind):
    path = tmp_path / "ckpt.pt"

    def rank_fn(rank, comm):
        net, opt = _torch_opt(comm)
        distopt.save(path, {**_h50_state(net), "extra": value}, opt)

    errors = _errors(2, rank_fn)
    assert [type(e) for e in errors] == [TypeError, TypeError], errors
    assert str(errors[0]) == str(errors[1]) and str(errors[0]).startswith(f"save on rank 0: {key} ")
    assert kind in str(errors[0])
    assert not path.exists()


def _write_format2(path, model):
    buf = io.BytesIO()
    torch.save({"format": 2, "world_size": 2, "strategy": {}, "model": model, "opt": {}}, buf)
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("content", ["numpy_scalar", "foreign_class"])
@pytest.mark.unit
def test_an_intact_file_the_loader_refuses_is_not_called_corrupt(tmp_path, content):
    """A file another writer made (numpy scalar pickled by torch.save, a class in a bare pickle)."""
    path = tmp_path / "ckpt.pt"
    if content == "numpy_scalar":
        _write_format2(path, {"best_acc": np.float64(0.91)})
        reason = "WeightsUnpickler error: Unsupported global"
    else:
        path.write_bytes(pickle.dumps({"format": 2, "extra": Custom()}))
        reason = "test_checkpoint_cases.Custom is not allowed in a distopt checkpoint"
    errors = _errors(2, lambda rank, comm: distopt.load(path, DistOpt(SGD(lr=0.1), comm=comm)))
    assert [type(e) for e in errors] == [ValueError, ValueError], errors
    for e in errors:
        assert "is intact" in str(e) and reason in str(e) and "corrupt" not in str(e), str(e)


@pytest.mark.unit
def test_a_flipped_byte_in_a_tensor_is_corrupt(tmp_path):
    """torch.load reads such a file without complaint; its CRC-32 does not match."""
    path = tmp_path / "ckpt.pt"
    _write_format2(path, {"w": torch.arange(100.0)})
    raw = bytearray(path.read_bytes())
    entry = next(e for e in zipfile.ZipFile(path).infolist() if e.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26:entry.header_offset + 30])
    raw[entry.header_offset + 30 + name_len + extra_len + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    errors = _errors(2, lambda rank, comm: distopt.load(path, DistOpt(SGD(lr=0.1), comm=comm)))
    for e in errors:
        assert isinstance(e, ValueError) and "is truncated or corrupt" in str(e) and "data/0 fails its CRC-32" in str(e)


def _sparse_opt(comm):
    opt = DistOpt(SGD(lr=0.1, momentum=0.9), comm=comm, strategy=Sparse(density=0.25, select="topk"))
    params = [np.zeros(8, np.float32)]
    opt.sync_params(params)
    opt.step(params, [np.random.default_rng(comm.rank).standard_normal(8).astype(np.float32)])
    return opt, params


@pytest.mark.parametrize("damaged_rank", [0, 1])
@pytest.mark.unit
def test_a_truncated_residual_file_is_reported_on_every_rank(tmp_path, damaged_rank):
    path = tmp_path / "ckpt.pt"

    def writer(rank, comm):
        opt, params = _sparse_opt(comm)
        distopt.save(path, params, opt)

    run_world(2, writer)
    residuals = tmp_path / f"ckpt.pt.rank{damaged_rank}.residuals"
    residuals.write_bytes(residuals.read_bytes()[:100])

    errors = _errors(2, lambda rank, comm: distopt.load(path, _sparse_opt(comm)[0]))
    assert [type(e) for e in errors] == [ValueError, ValueError], errors
    assert str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith(f"load on rank {damaged_rank}: checkpoint {residuals} is truncated or corrupt")


@pytest.mark.unit
def test_a_file_one_rank_cannot_write_is_reported_on_every_rank(tmp_path):
    path = tmp_path / "ckpt.pt"
    (tmp_path / "ckpt.pt.rank1.residuals").mkdir()  # rank 1's residual file cannot replace a directory
    (tmp_path / "ckpt.pt.rank1.residuals" / "keep").touch()

    def writer(rank, comm):
        opt, params = _sparse_opt(comm)
        distopt.save(path, params, opt)

    errors = _errors(2, writer)
    assert all(isinstance(e, IsADirectoryError) and str(e).startswith("save on rank 1: ") for e in errors), errors


@pytest.mark.timeout(300)
@pytest.mark.world
def test_cases_under_mpiexec_w2():
    pytest.importorskip("mpi4py")
    run_mpi_suite("mpi_checkpoint_cases.py", 2)
