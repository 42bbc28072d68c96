"""An elastic training script: two models (SGD with momentum at zero=0, AdamW at zero=1) under distopt.elastic.run.

Usage (by tests/support/elastic_job.py): ``torchrun --nnodes MIN:MAX ... elastic_train.py OUT_DIR [options]``.

Both models see the same batches from one :class:`distopt.elastic.ElasticSampler`
(48 samples, 2 per rank per step, 2 epochs); a commit every 3 steps. Every
worker appends one JSON line per step to ``OUT_DIR/steps.<pid>.jsonl`` (world
size, restart count, rank, node (its commit directory's name), the commit it resumed from, step, epoch, the
batch's indices) and one line per commit. Rank 0 writes ``OUT_DIR/final.pt`` (both models' state) at the end.

Options:
  --stop-after-commit K   every worker ends the process (os._exit(0)) right after commit K: the first half
                          of a reference run; a second job with the same run id resumes from it.
  --pause-after-commit K  in the first world only, after commit K and 2 more steps: the ranks in
                          --pause-ranks write ``OUT_DIR/paused.rank<r>`` (pid, agent pid) and sleep until
                          killed; the others go on into the next step's collectives.
  --pause-ranks RANKS     which ranks pause: all, last (the default) or a comma list (``1,2``).
  --pause-in-rejoin PHASE in the first world that resumes (its workers' nodes hold a commit), that world's last
                          rank pauses (writes ``OUT_DIR/paused-<PHASE>.rank<r>`` and sleeps until killed), once
                          per job, at PHASE: ``join``, before it joins the process group (the other ranks wait
                          in the join); ``restore``, inside distopt.elastic.run's restore, once it found its
                          node's commit (the other ranks wait in the restore's all-gather).
  --die-in-commit K       in the first world (a fresh start), its last rank pauses inside commit K (writes
                          ``OUT_DIR/paused-commit.rank<r>``) at --die-at: ``shard``, before the AdamW
                          optimizer's shard is taken (the other ranks wait in the commit's first broadcast,
                          no node holds its part of commit K); ``write``, after half of its own part is
                          written to the temporary name (the part was broadcast: the other nodes hold every
                          part of commit K and go on).
  --timeout S             DistOpt's timeout (every collective and the join of the process group; default 300).
  --commit-dir DIR        this node's commit directory (each "node" of a one-machine test has its own, so
                          that a node that joins has none and receives the commit by broadcast).

The start line (after the restore) and every commit's line list this node's commit files (``files``), so
that a test can check what a node keeps in its shared memory.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import distopt
from distopt import elastic
from distopt.elastic import snapshot

N, B, EPOCHS, EVERY = 48, 2, 2, 3
BASE_LR = 0.05


def pause(out: Path, phase: str, rank: int) -> None:
    """Write ``out/paused-<phase>.rank<rank>`` (this pid and the agent's) and sleep until killed."""
    (out / f"paused-{phase}.rank{rank}").write_text(f"{os.getpid()} {os.getppid()}")
    while True:
        time.sleep(1)


def _die_in_commit(out: Path, seq: int, at: str, rank: int, opt: distopt.DistOpt, state: elastic.State) -> None:
    """Make this rank pause inside commit ``seq`` (see ``--die-in-commit``): before ``opt``'s shard is taken
    (``at="shard"``: in ``opt.state_dict(sharded=True, ...)``), or after half of its own part's bytes are
    written to its temporary name (``at="write"``: inside ``SnapshotDir.write``'s
    :func:`distopt.checkpoint.write_atomically`, which renames once all is written)."""
    if at == "shard":
        state_dict = opt.state_dict

        def paused_state_dict(*a: object, **kw: object) -> dict:
            if state.commits == seq - 1:  # State.commit counts the commit once it is serialised
                pause(out, "commit", rank)
            return state_dict(*a, **kw)

        opt.state_dict = paused_state_dict
        return
    original = snapshot.write_atomically

    def half_then_pause(path: Path, write: Any) -> None:
        if not path.name.startswith(f"commit-{seq}.part{rank}of"):  # its own part, after it was broadcast
            return original(path, write)

        def half(f: Any) -> None:
            whole = io.BytesIO()
            write(whole)
            data = whole.getvalue()
            f.write(data[:len(data) // 2])
            f.flush()
            pause(out, "commit", rank)
            f.write(data[len(data) // 2:])

        return original(path, half)

    snapshot.write_atomically = half_then_pause


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stop-after-commit", type=int, default=0)
    p.add_argument("--pause-after-commit", type=int, default=0)
    p.add_argument("--pause-ranks", default="last")
    p.add_argument("--pause-in-rejoin", choices=("join", "restore"), default=None)
    p.add_argument("--die-in-commit", type=int, default=0)
    p.add_argument("--die-at", choices=("shard", "write"), default="write")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--commit-dir", type=Path, required=True)
    args = p.parse_args()
    started = time.time()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])  # counts failures only, as this agent saw them
    last = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
    node_dir = args.commit_dir / f"distopt-elastic-{os.environ['TORCHELASTIC_RUN_ID']}"
    fresh = not list(node_dir.glob("agent-*/commit-*.pt"))  # no commit on this node: the job's first world

    def rejoin_pause(phase: str) -> None:
        if args.pause_in_rejoin == phase and last and not list(args.out.glob(f"paused-{phase}.*")):
            pause(args.out, phase, int(os.environ["RANK"]))

    if not fresh:
        rejoin_pause("join")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(N, 8, generator=gen, dtype=torch.float64)
    y_all = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    model_a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    model_b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()
    opt_a = distopt.DistOpt(torch.optim.SGD(model_a.parameters(), lr=BASE_LR, momentum=0.9), model=model_a,
                            timeout=args.timeout)
    opt_b = distopt.DistOpt(torch.optim.AdamW(model_b.parameters(), lr=0.01), model=model_b, zero=1,
                            timeout=args.timeout)
    world, rank = opt_a.world_size, opt_a.global_rank
    held = elastic.SnapshotDir.held

    def paused_held(self: elastic.SnapshotDir) -> dict:
        found = held(self)
        if found:
            rejoin_pause("restore")
        return found

    elastic.SnapshotDir.held = paused_held  # distopt.elastic.run's restore calls it first

    def scale_lr() -> None:  # a learning rate that follows the world size, as a reset callback
        for group in opt_a.param_groups:
            group["lr"] = BASE_LR * opt_a.world_size / 2

    scale_lr()
    sampler = elastic.ElasticSampler(N, B, seed=7)
    state = elastic.State(model=model_a, optimizer=opt_a, sampler=sampler, model_b=model_b, optimizer_b=opt_b,
                          epoch=0, step=0)
    state.register_reset_callbacks([scale_lr])
    if args.die_in_commit and fresh and last:
        _die_in_commit(args.out, args.die_in_commit, args.die_at, rank, opt_b, state)
    log = open(args.out / f"steps.{os.getpid()}.jsonl", "a")

    resumed = {"from": 0}  # the commit this worker resumed from (0: a fresh start)

    def node_files() -> list[str]:
        return sorted(f.name for f in node_dir.glob("agent-*/*"))

    def record(**fields: object) -> None:
        row = {"world": world, "restart": restart, "rank": rank, "node": args.commit_dir.name,
               "resumed": resumed["from"], **fields}
        log.write(json.dumps(row) + "\n")
        log.flush()

    @elastic.run(commit_dir=args.commit_dir)
    def train(state: elastic.State) -> None:
        elastic.SnapshotDir.held = held  # the restore is over
        resumed["from"] = state.commits
        record(event="start", commits=state.commits, step=state.step, seconds=time.time() - started,
               at=time.time(), files=node_files())
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
                    record(event="commit", commits=state.commits, step=state.step, files=node_files())
                    if state.commits == args.stop_after_commit:
                        log.close()
                        os._exit(0)
                pause = args.pause_after_commit
                if first_world and pause and state.step == pause * EVERY + 2:
                    ranks = {"all": range(world), "last": [world - 1]}.get(args.pause_ranks)
                    if rank in (ranks or [int(r) for r in args.pause_ranks.split(",")]):
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
