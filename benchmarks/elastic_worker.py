"""The worker of ``benchmarks/elastic.py``: a GPT with AdamW at ``zero=1`` under ``distopt.elastic.run``.

Usage (by benchmarks/elastic.py, under torchrun's elastic agent): ``elastic_worker.py OUT --commit-dir DIR
--gpt SPEC --steps N --every K --pause-after-commit C``. Every worker appends JSON lines to
``OUT/steps.<pid>.jsonl``: ``start`` (world size, the commit it resumed from, seconds since the process
began), ``commit`` (its duration in ms and the commit's bytes), ``step`` (wall time), ``lost`` (when a
collective reported the lost peer) and ``done``. In the first world, after commit C and 2 more steps, the
last rank writes ``OUT/paused.rank<r>`` (pid and agent pid) and sleeps until the driver kills it.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

BEGAN = time.time()

import _common  # noqa: E402,F401  (the repository root on sys.path)
import torch  # noqa: E402

import distopt  # noqa: E402
from distopt import elastic  # noqa: E402
from distopt.errors import DistOptError  # noqa: E402
from netsim_worker import make_gpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--commit-dir", type=Path, required=True)
    p.add_argument("--gpt", default="8192,512,8,6,64,2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--pause-after-commit", type=int, default=2)
    args = p.parse_args()
    vocab, d_model, heads, layers, seq_len, batch = (int(v) for v in args.gpt.split(","))
    torch.manual_seed(0)
    model = make_gpt(vocab, d_model, heads, layers, seq_len)
    opt = distopt.DistOpt(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, zero=1)
    rank, world = opt.global_rank, opt.world_size
    state = elastic.State(model=model, optimizer=opt, step=0)
    log = open(args.out / f"steps.{os.getpid()}.jsonl", "a")

    def record(**fields: object) -> None:
        log.write(json.dumps({"world": world, "rank": rank, "at": time.time(), **fields}) + "\n")
        log.flush()

    @elastic.run(commit_dir=args.commit_dir)
    def train(state: elastic.State) -> None:
        resumed = state.commits
        record(event="start", resumed=resumed, seconds=time.time() - BEGAN)
        try:
            while state.step < args.steps:
                g = torch.Generator().manual_seed(1000 * state.step + rank)
                tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
                loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1),
                                                         tokens[:, 1:].flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.step += 1
                record(event="step", step=state.step, resumed=resumed)
                if state.step % args.every == 0:
                    t0 = time.perf_counter()
                    state.commit()
                    ms = 1e3 * (time.perf_counter() - t0)
                    record(event="commit", commits=state.commits, ms=ms, bytes=state.part_bytes)
                if (resumed == 0 and state.step == args.pause_after_commit * args.every + 2
                        and rank == world - 1):
                    (args.out / f"paused.rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")
                    while True:
                        time.sleep(1)
        except DistOptError:
            record(event="lost", step=state.step)
            raise
        record(event="done", step=state.step)

    train(state)
    opt.close()


if __name__ == "__main__":
    main()
