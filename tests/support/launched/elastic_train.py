"""An elastic training script: two models (SGD with momentum at zero=0, AdamW at zero=1) under distopt.elastic.run.

Usage (by tests/support/elastic_job.py): ``torchrun --nnodes MIN:MAX ... elastic_train.py OUT_DIR [options]``.

Both models see the same batches from one :class:`distopt.elastic.ElasticSampler`
(48 samples, 2 per rank per step, 2 epochs); a commit every 3 steps. Every
worker appends one JSON line per step to ``OUT_DIR/steps.<pid>.jsonl`` (world
size, restart count, the commit it resumed from, rank, step, epoch, the batch's indices) and one line per
commit. Rank 0 writes ``OUT_DIR/final.pt`` (both models' state) at the end.

Options:
  --stop-after-commit K   every worker ends the process (os._exit(0)) right after commit K: the first half
                          of a reference run; a second job with the same run id resumes from it.
  --pause-after-commit K  in the first world only, after commit K and 2 more steps: the ranks in
                          --pause-ranks write ``OUT_DIR/paused.rank<r>`` (pid, agent pid) and sleep until
                          killed; the others go on into the next step's collectives.
  --pause-ranks all|last  which ranks pause (default last).
  --commit-dir DIR        this node's commit directory (each "node" of a one-machine test has its own, so
                          that a node that joins has none and receives the commit by broadcast).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import distopt
from distopt import elastic

N, B, EPOCHS, EVERY = 48, 2, 2, 3
BASE_LR = 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stop-after-commit", type=int, default=0)
    p.add_argument("--pause-after-commit", type=int, default=0)
    p.add_argument("--pause-ranks", choices=("all", "last"), default="last")
    p.add_argument("--commit-dir", type=Path, required=True)
    args = p.parse_args()
    started = time.time()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(N, 8, generator=gen, dtype=torch.float64)
    y_all = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    opt_a = distopt.DistOpt(torch.optim.SGD(model_a.parameters(), lr=BASE_LR, momentum=0.9), model=model_a)
    opt_b = distopt.DistOpt(torch.optim.AdamW(model_b.parameters(), lr=0.01), model=model_b, zero=1)
    world, rank = opt_a.world_size, opt_a.global_rank
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    def scale_lr() -> None:  # a learning rate that follows the world size, as a reset callback
        for group in opt_a.param_groups:
            group["lr"] = BASE_LR * opt_a.world_size / 2

    scale_lr()
    sampler = elastic.ElasticSampler(N, B, seed=7)
    state = elastic.State(model=model_a, optimizer=opt_a, sampler=sampler, model_b=model_b, optimizer_b=opt_b,
                          epoch=0, step=0)
    state.register_reset_callbacks([scale_lr])
    log = open(args.out / f"steps.{os.getpid()}.jsonl", "a")

    resumed = {"from": 0}  # the commit this worker resumed from (0: a fresh start)

    def record(**fields: object) -> None:
        row = {"world": world, "restart": restart, "rank": rank, "resumed": resumed["from"], **fields}
        log.write(json.dumps(row) + "\n")
        log.flush()

    @elastic.run(commit_dir=args.commit_dir)
    def train(state: elastic.State) -> None:
        resumed["from"] = state.commits
        record(event="start", commits=state.commits, step=state.step, seconds=time.time() - started,
               at=time.time())
        first_world = state.commits == 0
        while state.epoch < EPOCHS:
            sampler.set_epoch(state.epoch)
            for batch in sampler:
                x, y = x_all[batch], y_all[batch]
                for model, opt in ((model_a, opt_a), (model_b, opt_b)):
                    opt.zero_grad()
                    loss = ((model(x) - y) ** 2).sum() / B  # an empty last batch adds nothing
                    loss.backward()
                    opt.step()
                sampler.record_batch()
                state.step += 1
                record(event="step", step=state.step, epoch=state.epoch, idx=batch, at=time.time())
                if state.step % EVERY == 0:
                    state.commit()
                    record(event="commit", commits=state.commits, step=state.step)
                    if state.commits == args.stop_after_commit:
                        log.close()
                        os._exit(0)
                pause = args.pause_after_commit
                if first_world and pause and state.step == pause * EVERY + 2:
                    if args.pause_ranks == "all" or rank == world - 1:
                        (args.out / f"paused.rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")
                        while True:
                            time.sleep(1)
            state.epoch += 1
        if rank == 0:
            torch.save({"a": model_a.state_dict(), "b": model_b.state_dict()}, args.out / "final.pt")
        record(event="done", step=state.step)

    train(state)
    log.close()
    opt_a.close()
    opt_b.close()


if __name__ == "__main__":
    sys.exit(main())
