"""What ``import distopt`` loads: every worker of every job pays it at start-up."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.job

#: Loaded only by the calls that need them: ml_dtypes costs about 1 s of CPU per process; the GPU and
#: PyTorch stacks are optional and heavy.
LAZY = ("ml_dtypes", "torch", "cupy")


def test_import_distopt_leaves_heavy_optional_modules_unloaded():
    probe = "import sys, distopt, distopt.launch, distopt.comm.shm; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(out.stdout.split())
    assert "distopt.comm.shm" in loaded, out.stdout[-2000:]
    assert not loaded & set(LAZY), sorted(loaded & set(LAZY))
