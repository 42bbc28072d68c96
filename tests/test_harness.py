"""The test harness's clean-up of MPICH's shared-memory segments left by SIGKILLed ranks."""
from __future__ import annotations

import mmap
import os
import time
import uuid
from pathlib import Path

import pytest

from tests.support.harness import mpich_segments, remove_orphaned_mpich_segments

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")]


def test_only_old_unmapped_segments_made_during_the_run_are_removed():
    tag = uuid.uuid4().hex[:8]
    names = {kind: f"mpich_shm_{tag}{kind}_0" for kind in ("orphan", "before", "fresh", "mapped")}
    paths = {kind: Path("/dev/shm") / name for kind, name in names.items()}
    old = time.time() - 60
    try:
        for kind, path in paths.items():
            path.write_bytes(b"\0" * 4096)
            if kind != "fresh":
                os.utime(path, (old, old))
        before = mpich_segments() - {names["orphan"], names["fresh"], names["mapped"]}
        assert names["before"] in before
        with open(paths["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = remove_orphaned_mpich_segments(before)
        assert names["orphan"] in removed and not paths["orphan"].exists()
        for kind in ("before", "fresh", "mapped"):
            assert names[kind] not in removed and paths[kind].exists(), kind
    finally:
        for path in paths.values():
            path.unlink(missing_ok=True)
