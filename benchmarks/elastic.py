"""Elastic recovery under torchrun's agent: a node killed, the time until the survivors step again.

Usage::

    python benchmarks/elastic.py                  # 3 nodes of 1 worker, a 27.4M-parameter GPT, AdamW zero=1
    python benchmarks/elastic.py --gpt 512,64,4,2,32,4 --steps 8 --every 2   # a quick run

Three torchrun agents (``--nnodes 2:3``, c10d rendezvous on this machine, keep-alive 1 s x 3,
last call 1 s; see ``tests/support/elastic_job.py``) run ``benchmarks/elastic_worker.py``. After commit 2
and two more steps the last rank stops, and this script SIGKILLs it and its agent. Printed (JSON
``results`` and a table): ``detect_s``, from the kill to the last survivor's collective error;
``recovery_s``, from the first survivor's error to the last survivor's first step in the new world
(the issue's "loss detected -> first step of the new world"); ``kill_to_step_s``; the commit's
cost (ms, mean per rank and commit, in the 3-rank world) and size (bytes); the step time (ms) in each world.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from tempfile import mkdtemp

import _common
from _common import default_out, env_info, finish_env, table, write_json

from tests.support.elastic_job import ElasticJob, read_steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt", default="8192,512,8,6,64,2", help="GPT vocab,d_model,heads,layers,seq_len,batch")
    p.add_argument("--steps", type=int, default=14, help="steps in all (default 14)")
    p.add_argument("--every", type=int, default=4, help="steps between commits (default 4)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds for the whole job")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _step_ms(rows: list[dict], world: int) -> float:
    at = sorted(r["at"] for r in rows if r["event"] == "step" and r["world"] == world and r["rank"] == 0)
    gaps = [b - a for a, b in zip(at, at[1:])]
    return 1e3 * statistics.median(gaps) if gaps else float("nan")


def summarise(rows: list[dict], killed_at: float) -> dict:
    """The figures of the module docstring from the workers' JSON lines."""
    lost = [r["at"] for r in rows if r["event"] == "lost"]
    firsts: dict[int, float] = {}
    for r in rows:
        if r["event"] == "step" and r["world"] == 2 and r["resumed"] > 0:
            firsts[r["rank"]] = min(firsts.get(r["rank"], r["at"]), r["at"])
    commits = [r for r in rows if r["event"] == "commit" and r["world"] == 3]
    restart = [r["seconds"] for r in rows if r["event"] == "start" and r["resumed"] > 0]
    return {"detect_s": max(lost) - killed_at, "recovery_s": max(firsts.values()) - min(lost),
            "kill_to_step_s": max(firsts.values()) - killed_at,
            "worker_start_s": max(restart), "commit_ms": statistics.mean(r["ms"] for r in commits),
            "commit_bytes": commits[0]["bytes"], "step_ms_world3": _step_ms(rows, 3),
            "step_ms_world2": _step_ms(rows, 2), "survivors_lost": len(lost)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = Path(mkdtemp(prefix="distopt-elastic-bench-"))
    out = base / "out"
    out.mkdir()
    worker = _common.BENCH_DIR / "elastic_worker.py"
    job = ElasticJob(out, worker, ["--gpt", args.gpt, "--steps", str(args.steps), "--every", str(args.every)],
                     nnodes="2:3", run_id=f"bench-{uuid.uuid4().hex[:8]}")
    info = env_info(mpi=False)
    try:
        for node in range(3):
            job.add_agent(node)
        job.wait_for(out / "paused.rank2", args.timeout)
        killed_at = time.time()
        job.kill_node(out / "paused.rank2")
        codes = job.wait(args.timeout)
    finally:
        job.close()
    if sorted(codes) != [-9, 0, 0]:
        sys.stderr.write(f"the elastic job failed: agents' exit codes {codes}\n{job.report()}\n")
        return 1
    results = summarise(read_steps(out), killed_at)
    data = {"benchmark": "elastic", "gpt": args.gpt, "steps": args.steps, "every": args.every,
            "results": results, "env": finish_env(info)}
    path = write_json(args.out or default_out("elastic"), data)
    print(table(["figure", "value"], [[k, f"{v:.3f}" if isinstance(v, float) else v] for k, v in results.items()],
                title=f"elastic recovery, GPT {args.gpt}, AdamW zero=1, 3 -> 2 nodes"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
