"""Peak memory of an elastic commit at ``zero=1|2|3`` against the consolidated state (mpiexec -n W).

Usage: ``mpiexec -n W python commit_memory.py``. For each of ``zero=1, 2, 3`` every rank prints one JSON line: the growth of its
resident set (bytes, sampled every millisecond by a thread reading ``/proc/self/statm``) during
``State.commit()`` (sharded: this rank's part) and during what a consolidating commit does
(``torch.save(opt.state_dict())`` into memory), the bytes of its shard of the optimizer state and of the
parameters, the whole state's bytes, and the largest bucket's.
"""
from __future__ import annotations

import io
import json

import torch
from rss import peak_growth  # this folder's module (run as a script)

import distopt
from distopt import elastic





def measure(zero: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M parameters, 16.8 MB
    buff = 4 * 1024 * 1024  # elements per bucket: 4 buckets
    opt = distopt.DistOpt(torch.optim.Adam(model.parameters(), lr=1e-3), zero=zero, model=model, buffSize=buff)
    state = elastic.State(model=model, optimizer=opt)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 1024)).pow(2).mean().backward()
        opt.step()
    numel = sum(p.numel() for p in model.parameters())
    shard = opt.state_dict(sharded=True)["distopt_shard"]["pieces"]
    shard_elems = sum(stop - start for _, start, stop, st in shard if st)

    def consolidated() -> bytes:
        f = io.BytesIO()
        torch.save(opt.state_dict(), f)
        return f.getvalue()

    commit = peak_growth(lambda: state.commit())[0]
    whole = peak_growth(consolidated)[0]  # its buffer freed at once
    print(json.dumps({"rank": opt.global_rank, "world": opt.world_size, "zero": zero,
                      "commit_growth": commit, "consolidated_growth": whole,
                      "part_bytes": state.part_bytes,
                      "shard_state_bytes": 2 * 4 * shard_elems, "shard_param_bytes": 4 * shard_elems,
                      "state_bytes": 2 * 4 * numel, "bucket_bytes": 4 * buff}), flush=True)
    opt.close()


def main() -> None:
    for zero in (1, 2, 3):
        measure(zero)


if __name__ == "__main__":
    main()
