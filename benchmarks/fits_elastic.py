"""The elastic worker of ``benchmarks/fits.py``: the meta-built GPT at ``zero=3`` under ``distopt.elastic.run``,
inside the per-rank memory cap of ``fits_worker.py``.

Usage (by ``benchmarks/fits.py``, under ``torchrun --nnodes 1 --nproc-per-node W --max-restarts 1`` with a
c10d rendezvous and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)::

    fits_elastic.py OUT --commit-dir DIR --gpt SPEC --steps N --every K --cap-bytes C [--kill-after-step S]
        [--bf16]

Every ``K`` steps the ranks commit (``state.commit()``: each rank its own shard,
``opt.state_dict(sharded=True, params=True)``, into ``DIR`` on tmpfs). With ``--kill-after-step S``, in the
first world (restart 0) the last rank writes ``OUT/paused`` (its pid) after step S and sleeps until the driver
SIGKILLs it; torchrun's agent then restarts every worker, which resume from the last commit. Each worker
appends JSON lines to ``OUT/steps.<pid>.jsonl``: ``start`` (restart count, the commit it resumed from),
``step`` (step, wall time, this rank's loss), ``commit`` (its ms), ``end`` (``status`` ``ok``/``oom``/
``error``, ``sha256``: a digest of this rank's shard of the parameters and AdamW state after the last step,
``peak_growth_mib`` and ``peak_rss_mib`` as in ``fits_worker.py``).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import fits_worker as fw  # this folder's module (the repository root on sys.path, the cap)
import torch
import torch.distributed as dist
from netsim_worker import make_gpt

import distopt
from distopt import elastic


def digest(opt: Any) -> str:
    """SHA-256 of every tensor of this rank's ``state_dict(sharded=True, params=True)`` (its segments of the
    parameters and its AdamW state), with their paths, in order (hex). Plain values are left out: they hold
    ``stats`` counters, which a restarted world counts afresh (its first forward's gather, the wait time)."""
    h = hashlib.sha256()

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            h.update(path.encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
    walk(opt.state_dict(sharded=True, params=True), "")
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--commit-dir", type=Path, required=True)
    p.add_argument("--gpt", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--cap-bytes", type=int, default=0)
    p.add_argument("--kill-after-step", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cap = fw.Cap(args.cap_bytes)
    log = open(args.out / f"steps.{os.getpid()}.jsonl", "a")

    def record(**fields: Any) -> None:
        log.write(json.dumps({"rank": rank, "restart": restart, "at": time.time(), **fields}) + "\n")
        log.flush()

    vocab, d_model, heads, layers, seq_len, n = fw.spec(args.gpt)
    end: dict[str, Any] = {"status": "ok", "where": "build"}
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = make_gpt(vocab, d_model, heads, layers, seq_len)
        mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if args.bf16 else {}
        opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), **fw.ADAMW), backend="torch", model=model,
                              zero=3, timeout=180, **mixed)
        state = elastic.State(model=model, optimizer=opt, step=0)

        @elastic.run(commit_dir=args.commit_dir)
        def train(state: elastic.State) -> None:
            record(event="start", resumed=state.commits, step=state.step)
            while state.step < args.steps:
                end["where"] = f"step {state.step + 1}"
                tokens = fw.batch(vocab, seq_len, n, state.step, rank)
                opt.zero_grad()
                loss = fw.loss_of(model, tokens)
                loss.backward()
                opt.step()
                state.step += 1
                record(event="step", step=state.step, loss=float(loss.detach()))
                if state.step % args.every == 0:
                    end["where"] = f"commit after step {state.step}"
                    t0 = time.perf_counter()
                    state.commit()
                    record(event="commit", step=state.step, ms=1e3 * (time.perf_counter() - t0))
                if restart == 0 and state.step == args.kill_after_step and rank == world - 1:
                    (args.out / "paused").write_text(str(os.getpid()))
                    while True:
                        time.sleep(1)

        train(state)
        end["where"] = "digest"
        end["sha256"] = digest(opt)
        opt.close()
    except BaseException as exc:  # noqa: BLE001 - reported; the agent sees a failed worker
        end["status"] = "oom" if fw.is_oom(exc) else "error"
        end["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    cap.lift()
    record(event="end", **end, peak_growth_mib=cap.growth() / fw.MIB, cap_mib=args.cap_bytes / fw.MIB,
           baseline_mib=cap.baseline / fw.MIB,
           peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    log.close()
    os._exit(0 if end["status"] == "ok" else 1)


if __name__ == "__main__":
    main()
