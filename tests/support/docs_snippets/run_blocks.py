"""Run several documentation code blocks in one MPI job (or one plain process), one after the other.

``mpiexec -n N python run_blocks.py MANIFEST RESULTS``: MANIFEST is a JSON
list of ``{"id", "path", "workdir"}``; every rank executes each block's file
as ``__main__`` in a fresh namespace, inside the block's working directory,
with its stdout captured. After each block the ranks exchange their outcome
(over ``MPI.COMM_WORLD``, not through distopt) and stop at the first block
that failed on any rank, since the ranks may be out of step after it. Rank 0
writes RESULTS: ``{id: {"ok", "seconds", "ranks": [{"ok", "error", "stdout"}]}}``.

``python run_blocks.py --local MANIFEST RESULTS`` runs the blocks in this one
process, without MPI (the plain-``python`` blocks): each block's outcome is
written as it finishes, and the process environment, ``sys.path`` and
``sys.argv`` are restored after each block.

Starting Python, mpi4py and PyTorch once for all blocks keeps the
documentation tests fast; each block still starts from a fresh namespace
(and from fresh ``DistOpt`` objects, each with its own duplicated
communicator).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback


def run_one(path: str, workdir: str) -> tuple[bool, str, str]:
    """Execute ``path`` as ``__main__`` in ``workdir``; return (ok, error text, stdout)."""
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__main__", "__file__": path})  # noqa: S102 - the point of the runner
        return True, "", out.getvalue()
    except SystemExit as exc:
        if exc.code in (None, 0):
            return True, "", out.getvalue()
        return False, f"SystemExit({exc.code!r})", out.getvalue()
    except BaseException:  # noqa: BLE001 - report anything a block raises
        return False, traceback.format_exc(), out.getvalue()
    finally:
        os.chdir(cwd)


def main_local(manifest_path: str, results_path: str) -> int:
    """Every block of the manifest in this process, the environment restored after each."""
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    results = {}
    for block in manifest:
        env, path, argv = dict(os.environ), list(sys.path), list(sys.argv)
        start = time.perf_counter()
        ok, error, stdout = run_one(block["path"], block["workdir"])
        os.environ.clear()
        os.environ.update(env)
        sys.path[:], sys.argv[:] = path, argv
        results[block["id"]] = {"ok": ok, "seconds": time.perf_counter() - start,
                                "ranks": [{"ok": ok, "error": error, "stdout": stdout}]}
        with open(results_path, "w", encoding="utf-8") as f:  # after every block: a later crash keeps these
            json.dump(results, f)
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "--local":
        return main_local(*argv[1:])
    from mpi4py import MPI

    manifest_path, results_path = argv
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    world = MPI.COMM_WORLD
    results = {}
    for block in manifest:
        start = time.perf_counter()
        ok, error, stdout = run_one(block["path"], block["workdir"])
        ranks = world.allgather({"ok": ok, "error": error, "stdout": stdout})
        every_ok = all(r["ok"] for r in ranks)
        results[block["id"]] = {"ok": every_ok, "seconds": time.perf_counter() - start, "ranks": ranks}
        if world.Get_rank() == 0:  # write after every block: a later crash keeps the earlier results
            with open(results_path, "w", encoding="utf-8") as f:
                json.dump(results, f)
        if not every_ok:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
