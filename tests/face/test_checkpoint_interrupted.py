"""``distopt.save`` interrupted: its temporary file is removed on an error and on SIGTERM, and a later save
of the same path sweeps those a killed writer left (issue 30, item 9)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import distopt
from distopt import checkpoint
from tests.support.simworld import run_world

ROOT = Path(__file__).resolve().parents[2]


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(checkpoint.TMP_SUFFIX))


@pytest.mark.job
def test_sigterm_during_a_save_removes_its_temporary_file(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        import distopt.checkpoint as ck

        def interrupted(f):  # half a file written, then the job is ended
            f.write(b"partial")
            f.flush()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)

        ck.write_atomically(Path({str(tmp_path)!r}) / "ck.pt", interrupted)
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == -signal.SIGTERM  # it still ends by the signal
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_a_failed_write_removes_its_temporary_file(tmp_path, monkeypatch):
    def broken(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.write_atomically(tmp_path / "ck.pt", broken)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_a_later_save_sweeps_the_temporary_files_of_killed_writers(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    pid = int(dead.stdout)  # a process of this host that has ended
    host = socket.gethostname()
    stale = tmp_path / f".ck.pt.{host}.{pid}.abc123{checkpoint.TMP_SUFFIX}"
    alive = tmp_path / f".ck.pt.{host}.{os.getpid()}.def456{checkpoint.TMP_SUFFIX}"  # a save in progress
    other_host = tmp_path / f".ck.pt.elsewhere.{pid}.ghi789{checkpoint.TMP_SUFFIX}"
    other_file = tmp_path / f".other.pt.{host}.{pid}.jkl012{checkpoint.TMP_SUFFIX}"
    for p in (stale, alive, other_host, other_file):
        p.write_bytes(b"partial")

    def rank_fn(rank, comm):  # noqa: ARG001
        opt = distopt.DistOpt(distopt.SGD(lr=0.1), comm=comm)
        opt.sync_params([np.zeros(3, np.float32)])
        return distopt.save(tmp_path / "ck.pt", {"w": np.ones(3, np.float32)}, opt)

    assert run_world(2, rank_fn) == [True, False]
    assert _temporaries(tmp_path) == sorted(p.name for p in (alive, other_host, other_file))
    assert (tmp_path / "ck.pt").exists()
