"""``DistOpt(AdamW, zero=3, model=m)`` over a model built on the meta device never holds the whole model: the peak
growth of each rank's resident set while it builds the model and DistOpt, in real processes (mpiexec -n 2, a GPT of
12 blocks, 9.8M float32 parameters, 40 MB, its largest module 2 MB), against building the same model on the CPU; and
while every rank's sharded checkpoint (``state_dict(sharded=True, params=True)``) streams into a fresh meta-built one,
against one shard plus the rank's own optimizer state."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.support.harness import run_job

pytest.importorskip("torch")
pytestmark = [pytest.mark.job, pytest.mark.timeout(300)]

SLACK = 4 * 2**20  # bytes: the interpreter's own allocations while it samples
SCRIPT = "tests/support/launched/meta_memory.py"


def _rows(mode: str, *folder: str) -> list[dict]:
    proc = run_job([sys.executable, SCRIPT, mode, *folder], 2, 240)
    assert proc.returncode == 0, proc.stdout[-3000:]
    rows = [json.loads(m) for m in re.findall(r"\{[^{}]*\"growth\"[^{}]*\}", proc.stdout)]
    assert sorted(r["rank"] for r in rows) == [0, 1], proc.stdout
    return rows


def test_meta_construction_peak_is_one_share_plus_the_largest_module_plus_two_buckets(tmp_path: Path) -> None:
    meta, cpu, load = _rows("meta", str(tmp_path)), _rows("cpu"), _rows("load", str(tmp_path))
    for r in meta:
        world = r["world"]
        assert r["model_bytes"] >= 10 * r["largest_module_bytes"], r  # the bound is well below the model
        assert r["held_bytes"] <= r["model_bytes"] // world + r["bucket_bytes"], r
        bound = r["model_bytes"] / world + r["largest_module_bytes"] + 2 * r["bucket_bytes"] + SLACK
        assert r["growth"] <= bound, r
        assert bound < r["model_bytes"], r  # so the CPU build below cannot meet it
    for r in cpu:
        assert r["growth"] >= r["model_bytes"], r  # the CPU build holds the whole model
    assert len({r["checksum"] for r in meta + cpu}) == 1  # both built the same values
    for r in load:  # the shard being read (its file's bytes) and this rank's new AdamW state; never two shards
        assert r["growth"] <= r["file_bytes"] + r["state_bytes"] + 2 * r["bucket_bytes"] + SLACK, r
        assert r["growth"] < 2 * r["file_bytes"], r
    print(json.dumps(meta + cpu + load))
