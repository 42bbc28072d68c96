"""How much gradient communication hides behind the backward pass (issue: overlap).

Run under MPI with the world size from the launcher::

    mpiexec -n 2 python benchmarks/overlap.py [--quick]
    MPIR_CVAR_ASYNC_PROGRESS=1 mpiexec -n 2 python benchmarks/overlap.py   # MPICH progress thread

For each model (the seed's CNN, and an MLP of about 25M parameters), in one
job: the time of a training step with ``DistOpt(overlap=True)`` and with
``overlap=False`` (the same buckets started after backward), a step without
any communication (backward + optimizer step alone), and ``t_comm`` = the
reduction of the same gradients alone (``DistOpt.step`` on precomputed
gradients). Times are the max over ranks of the median of timed iterations.
hidden = (t_no_overlap - t_overlap) / t_comm: the fraction of communication
that overlap hid. The DDP idiom (``opt.zero_grad(); loss.backward();
opt.step()``, overlap on) runs twice more, with ``.grad`` in tensors of its
own and with ``gradient_as_bucket_view=True`` (``.grad`` views into the
buckets); ``grad memory`` = bytes of the distinct storages holding the
gradients and the engine's bucket buffers, over the gradients' bytes (1.0:
one copy; 2.0: the engine holds a second). Writes
``benchmarks/results/overlap.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import _common  # noqa: F401  (repository root on sys.path)
import torch
from _common import default_out, env_info, run_mpi_main, table, write_json
from mpi4py import MPI

import distopt


def cnn() -> torch.nn.Module:
    """The seed's CNN (431,080 parameters)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 20, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(20, 50, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(800, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))


def mlp() -> torch.nn.Module:
    """An MLP of 25,180,170 parameters in 8 tensors (large layers, long backward)."""
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 1024), torch.nn.ReLU(),
                               torch.nn.Linear(1024, 10))


MODELS = {"cnn": (cnn, (64, 1, 28, 28)), "mlp25M": (mlp, (256, 1024))}


def timed(fn, warmup: int, iters: int, comm: MPI.Comm) -> float:
    """Max over ranks of the median seconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        comm.Barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def gradient_memory(opt: distopt.DistOpt, model: torch.nn.Module) -> float:
    """Bytes of the distinct memory regions holding ``.grad`` and the engine's buffers, over the gradient bytes."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    regions = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
    for layout in opt.engine._layouts.values():
        for buffer in layout.buffers.values():
            start = buffer.__array_interface__["data"][0]
            regions[start] = max(regions.get(start, 0), int(buffer.nbytes))
    return sum(regions.values()) / sum(g.numel() * g.element_size() for g in grads)


def measure(name: str, warmup: int, iters: int, comm: MPI.Comm) -> dict[str, float]:
    build, shape = MODELS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    y = torch.randint(0, 10, (shape[0],))
    out: dict[str, float] = {}
    model = build()
    n_params = sum(p.numel() for p in model.parameters())
    for label, overlap in (("overlap", True), ("no_overlap", False)):
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        opt = distopt.DistOpt(sgd, overlap=overlap)

        def step() -> None:
            sgd.zero_grad()
            opt.backward_and_update(torch.nn.functional.cross_entropy(model(x), y))

        out[label] = timed(step, warmup, iters, comm)
        if overlap:
            out["buckets_started_in_backward_per_step"] = opt.stats["buckets_started_in_backward"] / opt.stats["steps"]
        opt.close()
    for label, view in (("ddp_idiom", False), ("bucket_view", True)):  # loss.backward(); opt.step()
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        opt = distopt.DistOpt(sgd, gradient_as_bucket_view=view)

        def ddp_step() -> None:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        out[label] = timed(ddp_step, warmup, iters, comm)
        out[f"{label}_grad_memory"] = gradient_memory(opt, model)
        opt.close()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)

    def compute_only() -> None:
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sgd.step()

    out["compute"] = timed(compute_only, warmup, iters, comm)
    params = [p.detach().numpy() for p in model.parameters()]
    grads = [p.detach().numpy().copy() for p in model.parameters()]
    comm_only = distopt.DistOpt(distopt.SGD(lr=1e-9), overlap=False)
    out["comm"] = timed(lambda: comm_only.step(params, [g.copy() for g in grads]), warmup, iters, comm)
    comm_only.close()
    out["params"] = n_params
    out["hidden"] = (out["no_overlap"] - out["overlap"]) / out["comm"] if out["comm"] > 0 else float("nan")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up, 3 timed steps, the CNN only")
    parser.add_argument("--out", default=str(default_out("overlap")))
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // comm.size))
    warmup, iters = (1, 3) if args.quick else (3, 10)
    names = ["cnn"] if args.quick else list(MODELS)
    results = {name: measure(name, warmup, iters, comm) for name in names}
    if comm.rank == 0:
        rows = [[n, f"{r['params']:,}", f"{r['compute'] * 1e3:.1f}", f"{r['comm'] * 1e3:.1f}",
                 f"{r['no_overlap'] * 1e3:.1f}", f"{r['overlap'] * 1e3:.1f}", f"{r['hidden']:.2f}",
                 f"{r['buckets_started_in_backward_per_step']:.1f}", f"{r['ddp_idiom'] * 1e3:.1f}",
                 f"{r['ddp_idiom_grad_memory']:.2f}", f"{r['bucket_view'] * 1e3:.1f}",
                 f"{r['bucket_view_grad_memory']:.2f}"] for n, r in results.items()]
        print(table(["model", "params", "compute ms", "comm ms", "no overlap ms", "overlap ms", "hidden",
                     "buckets in backward", "ddp idiom ms", "grad memory", "bucket view ms", "grad memory (view)"],
                    rows,
                    title=f"overlap, {comm.size} ranks, async progress "
                          f"{os.environ.get('MPIR_CVAR_ASYNC_PROGRESS', '0')}"))
        write_json(args.out, {"benchmark": "overlap", "world_size": comm.size, "quick": args.quick,
                              "async_progress": os.environ.get("MPIR_CVAR_ASYNC_PROGRESS", "0"),
                              "env": env_info(), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(run_mpi_main(main))
