"""The runs of ``examples/cnn_mpi.py`` that the tests check, made by ONE ``mpiexec -n 2`` job per test run.

Each run used to be a job of its own (about 5 s of start-up each: two Python
processes importing PyTorch and loading the data, for a few seconds of
training). :func:`cnn_run` returns one run's output; the first call starts
the job for every run in :data:`RUNS` (``tests/support/launched/cnn_runs.py``
calls the example's ``main(argv)`` for each in turn), later calls read the
cached outputs. Every run trains from the seed with its own model, optimizer
and ``DistOpt``, exactly as the script does on its own.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.support.harness import ROOT, rank_streams, run_job

sys.path.insert(0, str(ROOT / "examples"))
import fashion_mnist  # noqa: E402

DATA_DIR = os.environ.get("FASHION_MNIST_DIR", fashion_mnist.DEFAULT_DIR)
HAVE_DATA = all(fashion_mnist.find_file(DATA_DIR, stem) for stem in fashion_mnist.FILES.values())
SMOKE = ["--max-steps", "20", "--eval-limit", "1000", "--data-dir", DATA_DIR]
STRATEGY_STEPS = ["--max-steps", "60", "--eval-limit", "2000", "--data-dir", DATA_DIR, "--threads", "1"]
STRATEGY_OPTIONS = ["plain", "half", "partialUpdate", "sparseTopK", "sparseThreshold"]
COMPRESSED_FLAGS = {"dgc": ["--dist-option", "dgc", "--dgc-warmup-steps", "1", "--dgc-clip-norm", "5"],
                    "powerSGD": ["--dist-option", "powerSGD", "--powersgd-start-step", "1"]}

#: name -> cnn_mpi.py's arguments: the smoke run (``mpiexec -n 2 python examples/cnn_mpi.py`` cut to 20
#: steps; also the docs' first CPU run), DGC and PowerSGD through their flags, and 60 steps of each
#: SINGA-style strategy.
RUNS: dict[str, list[str]] = {
    "smoke": [*SMOKE, "--threads", "1"],
    **{name: [*SMOKE, "--threads", "1", *flags] for name, flags in COMPRESSED_FLAGS.items()},
    **{f"strategy-{option}": [*STRATEGY_STEPS, "--dist-option", option] for option in STRATEGY_OPTIONS},
}
#: The job's limit: the sum of what each run had as a job of its own was 1260 s; a stalled collective
#: fails its run after DISTOPT_TIMEOUT (20 s) and the job goes on with the next.
JOB_TIMEOUT = 600.0


@dataclass
class Run:
    """One run's outcome: ``ok`` on every rank, and its ``mpiexec -l`` style output (``[rank] line``)."""

    name: str
    argv: list[str]
    ok: bool
    stdout: str


_CACHE: dict[str, object] = {}


def _split(out: str) -> dict[str, Run]:
    """The job's ``mpiexec -l`` output, demultiplexed per rank (:func:`tests.support.harness.rank_streams`:
    Hydra interleaves the ranks' chunks, even inside a line) and cut at each rank's ``=== RUN`` lines;
    what a rank printed before the first run (e.g. at import) belongs to the first run, and what it
    printed after a run's end (e.g. at exit) to that run."""
    lines: dict[str, list[str]] = {name: [] for name in RUNS}
    ends: dict[str, list[str]] = {name: [] for name in RUNS}
    for rank, text in sorted(rank_streams(out).items()):
        current = next(iter(RUNS))
        for line in text.splitlines():
            line = line.rstrip()
            if (m := re.fullmatch(r"=== RUN (\S+)", line)) and m.group(1) in RUNS:
                current = m.group(1)
            elif (m := re.fullmatch(r"=== END (\S+) (.*)", line)) and m.group(1) in RUNS:
                ends[m.group(1)].append(m.group(2))
            else:
                lines[current].append(f"[{rank}] {line}")
    return {name: Run(name, argv, ends[name] == ["ok", "ok"], "\n".join(lines[name]) + "\n")
            for name, argv in RUNS.items()}


def cnn_run(name: str) -> Run:
    """The run ``name`` of :data:`RUNS` (the job runs once per test run, at the first call).

    Raises:
        AssertionError: the job overran :data:`JOB_TIMEOUT` (the stalled ranks and their runs named)
            or ended without running every run; raised again at every later call.
    """
    if "runs" not in _CACHE and "error" not in _CACHE:
        manifest = Path(tempfile.mkdtemp(prefix="distopt-cnn-runs-")) / "manifest.json"
        manifest.write_text(json.dumps(RUNS))
        try:
            res = run_job([sys.executable, str(ROOT / "tests" / "support" / "launched" / "cnn_runs.py"),
                           str(manifest)], n=2, timeout=JOB_TIMEOUT)
            assert res.returncode == 0, f"the example runs' job failed (exit {res.returncode}):\n{res.stdout[-6000:]}"
            _CACHE["runs"] = _split(res.stdout)
        except Exception as exc:  # noqa: BLE001 - kept: every later call fails the same way, no second job
            _CACHE["error"] = exc
    if "error" in _CACHE:
        raise AssertionError(f"{type(_CACHE['error']).__name__}: {_CACHE['error']}")
    return _CACHE["runs"][name]  # type: ignore[index]
