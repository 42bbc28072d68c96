"""A DDP training script ported to DistOpt (``tests/support/launched/ddp_port.py``) against DDP itself, in
the same job, under torchrun and mpiexec: ResNet-style CNN with fused BatchNorm + activation layers, AdamW,
a per-step cosine schedule, torch's ``clip_grad_norm_``, accumulation through ``model.no_sync()``, a
rank-0 checkpoint writer, and a resume loaded into the optimizer before the wrap.

At every zero stage every loss, parameter and buffer equals DDP's bitwise (W = 2); at ``zero=2`` the
script clips with ``opt.clip_grad_norm_`` (``.grad`` is sharded there), which computes torch's formula over
every rank's pieces. Every resume equals the uninterrupted run bitwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.harness import ROOT, launcher_flags, mpiexec
from tests.support.torch_workers import free_port

pytest.importorskip("torch")
pytestmark = pytest.mark.job

SCRIPT = ROOT / "tests" / "support" / "launched" / "ddp_port.py"
LIMIT = 240.0


def _launch(launcher: str, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DISTOPT_TIMEOUT": "60"}
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT), str(out)]
    else:
        cmd = [mpiexec(), *launcher_flags(), "-n", "2", sys.executable, str(SCRIPT), str(out)]
    try:
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT)
    except subprocess.TimeoutExpired as exc:
        done = sorted(p.name for p in out.glob("rank*.json"))
        raise AssertionError(f"{launcher}: the job overran {LIMIT:.0f} s; ranks that finished: {done}\n"
                             f"{(exc.stdout or '')[-3000:]}") from None
    assert res.returncode == 0, f"{launcher} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_a_ddp_script_ported_equals_ddp_at_every_zero_stage_and_resumes_exactly(launcher, tmp_path):
    _launch(launcher, tmp_path)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["backend"] == ("torch" if launcher == "torchrun" else "mpi") and got["world"] == 2
        ddp = got["ddp"]
        assert ddp["resumed"] == ddp["final"] and ddp["resumed_losses"] == ddp["straight"]
        for variant in ("zero0", "zero1", "zero2"):
            run = got[variant]
            where = f"{launcher} rank {rank} {variant}"
            assert run["resumed"] == run["final"], f"{where}: the resumed run differs from the straight one"
            assert run["resumed_losses"] == run["straight"], where
            assert run["straight"] == ddp["straight"], f"{where}: losses differ from DDP's"
            assert run["final"] == ddp["final"], f"{where}: parameters differ from DDP's"
            assert run["buffers"] == ddp["buffers"], f"{where}: buffers differ from DDP's"
