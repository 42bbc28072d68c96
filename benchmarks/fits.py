"""A model that does not fit one rank: DDP, distopt ``zero=0|3`` and FSDP2 under a per-rank memory cap.

Run (a driver: it starts the torchrun jobs itself)::

    python benchmarks/fits.py                        # W = 4, an 84.1M-parameter GPT, params + AdamW = 1.5x the cap
    python benchmarks/fits.py --ratio 0.6            # a looser cap (params + AdamW = 0.6x the cap)
    python benchmarks/fits.py --gpt 4096,256,4,8,32,2 --ratio 0.3 --variants zero3 --steps 2 \
        --elastic-steps 6 --kill-after-step 3     # an 8.4M-parameter GPT: about a minute

**The cap.** With P parameter elements, "float32 parameters plus AdamW state" is 12·P BYTES (4 for the
parameter, 8 for the two moments). ``--ratio R`` sets every rank's cap to 12·P / R: at R > 1 the model's
parameters and optimizer state do not fit one rank. Each worker (``fits_worker.py``, :class:`fits_worker.Cap`)
reads its ``VmData`` after ``import torch`` and ``init_process_group`` (the baseline, 255-265 MiB here) and
sets ``RLIMIT_DATA`` to the baseline plus the cap: the cap bounds what building and training the model adds
to the process's private writable memory. An allocation past it fails inside torch (``RuntimeError:
DefaultCPUAllocator: can't allocate memory``) or Python (``MemoryError``); the worker reports it as
``"status": "oom"`` with the phase (``build``, ``step k``), instead of the kernel's OOM killer. The workers
run with glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` at 128 KiB, so that freed
tensors go back to the kernel (glibc's default dynamic threshold keeps freed blocks of up to 32 MiB in the
heap: ``VmData`` then measures its cache, not the live memory).

**What bounds R for ``zero=3``.** From the end of backward to the update a rank holds 16·P/W BYTES (float32
segment, two AdamW moments, float32 gradient segment): at W = 4 that is 4·P, one third of 12·P, so R = 3 leaves
nothing for the gathered modules, the gradient buckets, the activations and the process's own growth (threads,
allocator, autograd: 30-75 MiB here) (``docs/sharding.md``, "Models that do not fit"). The default R = 1.5 is a model
that does not fit (parameters and AdamW state 1.5x the cap); the ratios at which each variant trained on the
2-core VM are in ``docs/performance.md``.

Variants (``--variants``; ``fits_worker.py`` describes each): ``ddp``, ``zero0`` (CPU-built models), ``fsdp2``
and ``fsdp2_bf16`` (meta-built, ``fully_shard`` per block and the root, the second with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``), ``zero3`` and ``zero3_bf16``
(meta-built, ``DistOpt(AdamW, zero=3, model=m)``, the second with ``param_dtype=torch.bfloat16,
reduce_dtype=torch.float32``); one ``torchrun --nproc-per-node W`` job each, ``--steps`` steps. The float32
reference of the losses: one process, no cap, plain AdamW on the CPU-built model, every rank's batch of
each step concatenated (the mean of the ranks' losses is its loss).

**Elastic part** (``fits_elastic.py``): ``torchrun --nnodes 1 --nproc-per-node W --max-restarts 1`` (c10d
rendezvous on this machine) runs ``zero=3`` (float32; ``--elastic-bf16``) under ``distopt.elastic.run``
inside the cap of ``--elastic-ratio`` (default ``--ratio``), committing every ``--every`` steps (sharded);
after step ``--kill-after-step`` the last rank's worker is SIGKILLed, the agent restarts every worker, and
they resume from the last commit. An uninterrupted run of the same command is the reference:
``bitwise`` is true when every rank's digest of its shard of the parameters and AdamW state after the last
step equals the reference's (``losses_equal``: and every step's loss on every rank, the redone ones too).
``restored_s``: from the kill until every restarted worker has restored the commit; ``recovery_s``: until
the last rank's first step in the restarted world has ended.

Prints a table and writes ``benchmarks/results/fits.json`` (``--out``): ``results[variant]`` with
``status`` (``ok``/``oom``/``error``), ``where``, ``error``, ``peak_rss_mib`` and ``peak_growth_mib`` (max
over ranks; growth: ``VmData`` above the baseline, what the cap limits; ``peak_growth_mib_by_step``: the
peak so far after the build and after each step), ``s_per_step`` (median over the
steps after the first of the slowest rank's time), ``first_step_s``, ``gather_bytes``/``reduce_bytes``
(per step), ``loss``/``loss_reference``/``loss_diff`` (after the last step); ``elastic`` with the recovery.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import _common

VARIANTS = ("ddp", "zero0", "fsdp2", "fsdp2_bf16", "zero3", "zero3_bf16")
HERE = Path(__file__).resolve().parent
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpt", default="8192,512,8,24,64,2",
                   help="GPT vocab,d_model,heads,layers,seq_len,batch (default 8192,512,8,24,64,2: 84.1M parameters)")
    p.add_argument("--nproc", type=int, default=4, help="ranks W (default 4)")
    p.add_argument("--ratio", type=float, default=1.5,
                   help="float32 parameters + AdamW state (12 BYTES per parameter) over the per-rank cap (default 1.5)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=4, help="steps per variant (default 4)")
    p.add_argument("--elastic-ratio", type=float, default=None, help="the elastic part's ratio (default --ratio)")
    p.add_argument("--elastic-steps", type=int, default=8, help="the elastic part's steps (default 8)")
    p.add_argument("--every", type=int, default=2, help="steps between commits (default 2)")
    p.add_argument("--kill-after-step", type=int, default=5, help="the step after which a worker is killed")
    p.add_argument("--elastic-bf16", action="store_true", help="the elastic part with bfloat16 mixed precision")
    p.add_argument("--no-elastic", action="store_true", help="skip the elastic part")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--out", type=Path, default=_common.default_out("fits"), help="JSON output path")
    args = p.parse_args(argv)
    args.keys = [k for k in args.variants.split(",") if k]
    unknown = sorted(set(args.keys) - set(VARIANTS))
    if unknown or not args.keys:
        p.error(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(VARIANTS)}")
    try:
        vocab, d_model, heads, layers, seq_len, batch = (int(v) for v in args.gpt.split(","))
    except ValueError:
        p.error(f"--gpt: expected six integers vocab,d_model,heads,layers,seq_len,batch, got {args.gpt!r}")
    if min(vocab, d_model, heads, layers, seq_len, batch) < 1 or d_model % heads:
        p.error(f"--gpt: every value must be >= 1 and d_model a multiple of heads, got {args.gpt!r}")
    if args.nproc < 1 or args.steps < 1:
        p.error(f"--nproc and --steps must be >= 1, got {args.nproc} and {args.steps}")
    if args.ratio <= 0 or (args.elastic_ratio is not None and args.elastic_ratio <= 0):
        p.error("--ratio and --elastic-ratio must be > 0")
    if not 0 < args.kill_after_step < args.elastic_steps:
        p.error(f"--kill-after-step must be in 1 .. --elastic-steps - 1 ({args.elastic_steps - 1})")
    return args


def params_of(spec: str) -> int:
    """Parameter elements of ``netsim_worker.make_gpt`` with ``spec`` (untied head, biases, LayerNorms)."""
    vocab, d, _, layers, seq_len, _ = (int(v) for v in spec.split(","))
    return 2 * vocab * d + seq_len * d + layers * (12 * d * d + 13 * d) + 2 * d


def _env() -> dict[str, str]:
    return {**os.environ, **MALLOC, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_variant(args: argparse.Namespace, key: str, cap: int, folder: Path) -> list[dict[str, Any]]:
    """One torchrun job of ``key`` (or the one-process ``reference``); its ranks' records."""
    worker = [str(HERE / "fits_worker.py"), str(folder), "--variant", key, "--gpt", args.gpt,
              "--steps", str(args.steps), "--cap-bytes", str(cap)]
    if key == "reference":
        cmd = [sys.executable, *worker, "--world", str(args.nproc)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_common.free_port()), *worker]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=args.timeout)
    ranks = 1 if key == "reference" else args.nproc
    files = [folder / f"{key}.rank{r}.json" for r in range(ranks)]
    if not all(f.is_file() for f in files):
        raise SystemExit(f"the {key} job wrote no record on some rank (exit {res.returncode}):\n"
                         f"{(res.stdout + res.stderr)[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def summarise(recs: list[dict[str, Any]], ref: dict[str, Any] | None) -> dict[str, Any]:
    """A variant's row from its ranks' records (see the module docs)."""
    oom = [r for r in recs if r["status"] == "oom"]
    bad = oom or [r for r in recs if r["status"] != "ok"]
    out: dict[str, Any] = {
        "status": "oom" if oom else ("error" if bad else "ok"), "cap_mib": recs[0]["cap_mib"],
        "baseline_mib": max(r["baseline_mib"] for r in recs),
        "peak_growth_mib": max(r["peak_growth_mib"] for r in recs),
        "peak_growth_mib_per_rank": [round(r["peak_growth_mib"], 1) for r in recs],
        "peak_rss_mib": max(r["peak_rss_mib"] for r in recs),
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in recs],
        "peak_growth_mib_by_step": [round(max(r["growth_mib"][i][0] for r in recs), 1)  # after build, each step
                                    for i in range(min(len(r.get("growth_mib", [])) for r in recs))]}
    if bad:
        out.update(where=bad[0].get("where"), error=bad[0].get("error"), failed_ranks=[r["rank"] for r in bad])
        return out
    steps = [max(r["step_s"][i] for r in recs) for i in range(len(recs[0]["step_s"]))]
    loss = statistics.fmean(r["losses"][-1] for r in recs)
    out.update(where="done", params=recs[0]["params"], first_step_s=steps[0],
               s_per_step=statistics.median(steps[1:] or steps), step_s=steps,
               gather_bytes=recs[0].get("gather_bytes", 0), reduce_bytes=recs[0].get("reduce_bytes", 0),
               loss=loss, losses=[statistics.fmean(r["losses"][i] for r in recs) for i in range(len(steps))])
    if ref is not None and ref["status"] == "ok":
        out.update(loss_reference=ref["losses"][-1], loss_diff=loss - ref["losses"][-1])
    return out


def elastic_job(args: argparse.Namespace, cap: int, folder: Path, kill: bool) -> tuple[list[dict], float | None, int]:
    """One ``torchrun --nnodes 1`` elastic job (see the module docs): its JSON lines, the kill's time, exit code."""
    folder.mkdir(parents=True)
    port, run_id = _common.free_port(), f"fits-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", run_id, "--monitor-interval", "0.2", str(HERE / "fits_elastic.py"), str(folder),
           "--commit-dir", str(folder / "commits"), "--gpt", args.gpt, "--steps", str(args.elastic_steps),
           "--every", str(args.every), "--cap-bytes", str(cap)]
    cmd += ["--kill-after-step", str(args.kill_after_step)] if kill else []
    cmd += ["--bf16"] if args.elastic_bf16 else []
    env = {**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    log = open(folder / "agent.log", "w")
    agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    killed_at, deadline = None, time.monotonic() + args.timeout
    try:
        while agent.poll() is None:
            if kill and killed_at is None and (folder / "paused").is_file():
                time.sleep(0.05)
                pid = int((folder / "paused").read_text())
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise SystemExit(f"the elastic job overran {args.timeout:.0f} s:\n"
                                 f"{(folder / 'agent.log').read_text()[-4000:]}")
            time.sleep(0.05)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
    rows = [json.loads(line) for f in sorted(folder.glob("steps.*.jsonl")) for line in f.read_text().splitlines()]
    return rows, killed_at, agent.returncode


def elastic_part(args: argparse.Namespace, cap: int, folder: Path) -> dict[str, Any]:
    """The reference and the killed run; recovery time, bitwise equality, peak memory (see the module docs)."""
    ref, _, ref_code = elastic_job(args, cap, folder / "reference", kill=False)
    rows, killed_at, code = elastic_job(args, cap, folder / "killed", kill=True)

    def ends(rs: list[dict]) -> dict[int, dict]:
        return {r["rank"]: r for r in rs if r["event"] == "end" and r["status"] == "ok"}

    ref_end, end = ends(ref), ends(rows)
    failed = [r for r in ref + rows if r["event"] == "end" and r["status"] != "ok"
              and not (r in rows and killed_at is not None and r["restart"] == 0)]  # the kill's own failures
    out: dict[str, Any] = {
        "ratio": args.elastic_ratio or args.ratio, "cap_mib": cap / (1 << 20), "bf16": args.elastic_bf16,
        "reference_exit": ref_code, "exit": code, "killed": killed_at is not None,
        "status": "ok" if not failed and killed_at is not None and len(end) == len(ref_end) == args.nproc else
        ("oom" if any(r["status"] == "oom" for r in failed) else "error"),  # a restart the kill did not cause fails
        "peak_growth_mib": max((r["peak_growth_mib"] for r in ref + rows if r["event"] == "end"), default=None),
        "peak_rss_mib": max((r["peak_rss_mib"] for r in ref + rows if r["event"] == "end"), default=None),
        "commit_ms": statistics.fmean([r["ms"] for r in ref if r["event"] == "commit"] or [float("nan")])}
    if failed:  # an out-of-memory record first: the others saw their peer go
        first = sorted(failed, key=lambda r: r["status"] != "oom")[0]
        out.update(where=first.get("where"), error=first.get("error"), failed_restart=first["restart"])
    firsts = [r["at"] for r in rows if r["event"] == "step" and r["restart"] == 1]
    resumed = [r for r in rows if r["event"] == "start" and r["restart"] == 1]
    if killed_at is not None and firsts and resumed:
        first_by_rank = {}
        for r in rows:
            if r["event"] == "step" and r["restart"] == 1:
                first_by_rank.setdefault(r["rank"], r["at"])
        out.update(restored_s=max(r["at"] for r in resumed) - killed_at,
                   recovery_s=max(first_by_rank.values()) - killed_at, resumed_from_step=resumed[0]["step"],
                   steps_redone=args.kill_after_step - resumed[0]["step"])
    if out["status"] == "ok":
        out["bitwise"] = all(end[k]["sha256"] == ref_end[k]["sha256"] for k in ref_end)
        losses = {(r["rank"], r["step"]): r["loss"] for r in ref if r["event"] == "step"}
        out["losses_equal"] = all(losses[(r["rank"], r["step"])] == r["loss"] for r in rows if r["event"] == "step")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = params_of(args.gpt)
    cap = round(12 * params / args.ratio)
    env = _common.env_info(mpi=False)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="distopt-fits-bench-") as tmp:
        ref = run_variant(args, "reference", 0, Path(tmp))[0]
        for key in args.keys:
            results[key] = summarise(run_variant(args, key, cap, Path(tmp)), ref)
        elastic = None
        if not args.no_elastic:
            ecap = round(12 * params / (args.elastic_ratio or args.ratio))
            elastic = elastic_part(args, ecap, Path(tmp) / "elastic")
    data = {"benchmark": "fits", "world_size": args.nproc, "gpt": args.gpt, "params": params,
            "params_adamw_bytes": 12 * params, "ratio": args.ratio, "cap_bytes": cap,
            "reference": {"losses": ref["losses"], "status": ref["status"], "peak_rss_mib": ref["peak_rss_mib"]},
            "results": results, "elastic": elastic,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "env": _common.finish_env(env)}
    mib = 1 << 20
    rows = [[k, r["status"] if r["status"] == "ok" else f"{r['status']} at {r.get('where')}",
             f"{r['peak_growth_mib']:.0f}", f"{r['peak_rss_mib']:.0f}", r.get("s_per_step"),
             f"{r['gather_bytes'] / mib:.1f}" if "gather_bytes" in r else None,
             f"{r['reduce_bytes'] / mib:.1f}" if "reduce_bytes" in r else None,
             r.get("loss"), f"{r['loss_diff']:+.2e}" if "loss_diff" in r else None] for k, r in results.items()]
    print(_common.table(["variant", "status", "peak growth MiB", "peak RSS MiB", "s/step", "gathered MiB/step",
                         "reduced MiB/step", "loss", "vs float32 ref"], rows,
                        f"GPT {args.gpt}: {params:,} parameters, params + AdamW {12 * params / mib:.0f} MiB = "
                        f"{args.ratio:g} x the per-rank cap of {cap / mib:.0f} MiB; W = {args.nproc}, "
                        f"{args.steps} steps; float32 reference loss {ref['losses'][-1]:.6f}"))
    if elastic is not None:
        print(_common.table(["figure", "value"], [[k, f"{v:.3f}" if isinstance(v, float) else v]
                                                  for k, v in elastic.items() if k != "error"],
                            "elastic (torchrun --nnodes 1, one worker killed), zero=3"))
        if elastic.get("error"):
            print(f"elastic error: {elastic['error']}")
    print(f"wrote {_common.write_json(args.out, data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
