"""The torch.distributed backend: conformance at 1, 2 and 4 spawned processes, timeouts, close."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from distopt.comm import create  # noqa: E402
from distopt.launch import spawn  # noqa: E402
from tests import torch_workers  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_conformance(nprocs):
    spawn(torch_workers.conformance_worker, nprocs, (torch_workers.free_port(),), timeout=100)


@pytest.mark.timeout(60)
def test_skipped_collective_times_out():
    spawn(torch_workers.skip_worker, 2, (torch_workers.free_port(),), timeout=50)


def test_needs_master_addr(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT, which are not set: start the script with torchrun"):
        create("torch", rank=0, size=1, timeout=5)
