"""Several runs of ``examples/cnn_mpi.py`` in one MPI job, one after the other (:mod:`tests.support.examples`).

``mpiexec -n N python tests/support/launched/cnn_runs.py MANIFEST``: MANIFEST is a
JSON object ``{name: argv}``; every rank calls the example's own ``main(argv)``
(imported, not copied, as ``benchmarks/train.py`` does) for each run in turn,
between the lines ``=== RUN <name>`` and ``=== END <name> ok|failed`` (a run
that raises prints its traceback and the job goes on with the next run, after
a barrier). Starting Python, mpi4py, PyTorch and the data once for all runs
keeps the example tests fast; each run builds its own model, optimizer and
``DistOpt`` from the seed, as a fresh process would.

Under :func:`tests.support.harness.run_job`, each rank writes the run it is in
to the progress folder, so an overrun names the stalled ranks and their runs.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))

import cnn_mpi  # noqa: E402


def main(manifest_path: str) -> int:
    runs = json.loads(Path(manifest_path).read_text())
    rank = MPI.COMM_WORLD.Get_rank()
    progress = os.environ.get("DISTOPT_TEST_PROGRESS")
    for name, argv in runs.items():
        if progress:
            Path(progress, f"rank{rank}").write_text(f"run {name}: {' '.join(argv)}")
        print(f"=== RUN {name}", flush=True)
        try:
            status = cnn_mpi.main(argv)
            outcome = "ok" if status in (0, None) else f"failed (exit {status})"
        except SystemExit as exc:
            outcome = "ok" if exc.code in (0, None) else f"failed (exit {exc.code})"
        except BaseException:  # noqa: BLE001 - reported, then the next run
            traceback.print_exc(file=sys.stdout)
            outcome = "failed"
        print(f"=== END {name} {outcome}", flush=True)
        MPI.COMM_WORLD.Barrier()
    if progress:
        Path(progress, f"rank{rank}").write_text("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
