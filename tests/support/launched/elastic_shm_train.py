"""An elastic training script for ``python -m distopt.launch --min-np/--max-np`` (the shared-memory backend).

Usage: ``python -m distopt.launch -n N --min-np MIN --max-np MAX --run-id ID elastic_shm_train.py OUT [options]``.

Two models (SGD with momentum at ``zero=0``, AdamW at ``zero=1``, float64) see the
same batches of one :class:`distopt.elastic.ElasticSampler` (48 samples, 2 per
rank per step, 2 epochs); a commit every 3 steps; the commits go to the default
``/dev/shm/distopt-elastic-<ID>``. Every copy appends JSON lines to
``OUT/steps.<pid>.jsonl``: a ``start`` line once the commit is restored (with
``t0``, the process's start, and ``at``, both ``time.time()``), one ``step``
line per step (world size, restart count, rank, job id, the commit it resumed
from, step, epoch, the batch's indices, ``at``) and one ``commit`` line per
commit. Rank 0 writes ``OUT/final.pt`` (both models' state) at the end.

Options (each acts in the first world only: the copies that did not resume from a commit):
  --stop-after-commit K   every copy ends (os._exit(0)) right after commit K: the first half of a reference
                          run; a second launch with the same run id resumes from it.
  --pause-after-commit K  after commit K and 2 more steps the last rank writes OUT/paused.rank<r> (its pid)
                          and sleeps until killed; the others go on into the next step's collectives.
  --hold-after-step S     after step S every rank writes OUT/held.rank<r> (its pid) and waits until
                          OUT/go exists, then goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

T0 = time.time()

import torch  # noqa: E402

import distopt  # noqa: E402
from distopt import elastic  # noqa: E402

N, B, EPOCHS, EVERY = 48, 2, 2, 3
BASE_LR = 0.05


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stop-after-commit", type=int, default=0)
    p.add_argument("--pause-after-commit", type=int, default=0)
    p.add_argument("--hold-after-step", type=int, default=0)
    args = p.parse_args()
    restart = int(os.environ["DISTOPT_RESTART_COUNT"])
    job = os.environ["DISTOPT_JOB_ID"]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(N, 8, generator=gen, dtype=torch.float64)
    y_all = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    opt_a = distopt.DistOpt(torch.optim.SGD(model_a.parameters(), lr=BASE_LR, momentum=0.9), model=model_a)
    opt_b = distopt.DistOpt(torch.optim.AdamW(model_b.parameters(), lr=0.01), model=model_b, zero=1)
    world, rank = opt_a.world_size, opt_a.global_rank

    def scale_lr() -> None:  # a learning rate that follows the world size, as a reset callback
        for group in opt_a.param_groups:
            group["lr"] = BASE_LR * opt_a.world_size / 2

    scale_lr()
    sampler = elastic.ElasticSampler(N, B, seed=7)
    state = elastic.State(model=model_a, optimizer=opt_a, sampler=sampler, model_b=model_b, optimizer_b=opt_b,
                          epoch=0, step=0)
    state.register_reset_callbacks([scale_lr])
    log = open(args.out / f"steps.{os.getpid()}.jsonl", "a")
    resumed = {"from": 0}

    def record(**fields: object) -> None:
        row = {"world": world, "restart": restart, "rank": rank, "job": job, "resumed": resumed["from"],
               **fields}
        log.write(json.dumps(row) + "\n")
        log.flush()

    @elastic.run
    def train(state: elastic.State) -> None:
        resumed["from"] = state.commits
        record(event="start", commits=state.commits, step=state.step, t0=T0, at=time.time())
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
                    state.commit()  # in a world that grows: every rank exits here (distopt.elastic.regroup)
                    record(event="commit", commits=state.commits, step=state.step)
                    if state.commits == args.stop_after_commit:
                        log.close()
                        os._exit(0)
                if first_world and args.hold_after_step == state.step:
                    (args.out / f"held.rank{rank}").write_text(str(os.getpid()))
                    while not (args.out / "go").exists():
                        time.sleep(0.02)
                pause = args.pause_after_commit
                if first_world and pause and state.step == pause * EVERY + 2 and rank == world - 1:
                    (args.out / f"paused.rank{rank}").write_text(str(os.getpid()))
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
