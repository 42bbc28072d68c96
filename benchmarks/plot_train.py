"""Accuracy per epoch and wire bytes of ``benchmarks/train.py`` runs: a PNG and a Markdown table.

Run on the JSON files that ``train.py --out`` wrote (one or more; runs are
matched by strategy and process count)::

    python benchmarks/plot_train.py benchmarks/results/e10_*.json --procs 2 --png docs/strategies_accuracy.png

Prints one Markdown row per DistOpt run: the wire / dense bytes of the last
epoch (the steady state: after DGC's warm-up and PowerSGD's dense steps),
the same over the whole run, the evaluation accuracy after the last epoch,
the difference from ``plain``'s in percentage points, and the best epoch's
accuracy. The PNG (matplotlib) plots evaluation accuracy per epoch, one
line per strategy.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

#: Row order and labels (the example's default settings of each strategy).
LABELS = {"plain": "plain", "dgc": "DGC 99.9 %", "powerSGD": "PowerSGD rank 2", "sparseTopK": "top-K 1 %",
          "sparseThreshold": "threshold 0.01", "half": "half (float16)", "partialUpdate": "partial (3 chunks)"}


def load_runs(paths: list[Path], procs: int) -> list[dict[str, Any]]:
    """The DistOpt runs at ``procs`` processes in ``paths`` (later files win), in :data:`LABELS` order."""
    runs: dict[str, dict[str, Any]] = {}
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            if run["impl"] == "distopt" and run["procs"] == procs:
                runs[run["strategy"]] = run
    order = list(LABELS)
    return sorted(runs.values(), key=lambda r: order.index(r["strategy"]) if r["strategy"] in order else len(order))


def table(runs: list[dict[str, Any]]) -> str:
    """The Markdown table (see the module docs)."""
    plain = next((r for r in runs if r["strategy"] == "plain"), None)
    lines = ["| strategy | wire / dense, last epoch | wire / dense, whole run | eval acc after "
             f"{runs[0]['epochs']} epochs | vs plain (points) | best epoch's acc |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        last = r["history"][-1]
        d = f"{(r['eval_acc'] - plain['eval_acc']) * 100:+.2f}" if plain is not None else "-"
        best = max(h["eval_acc"] for h in r["history"])
        lines.append(f"| {LABELS.get(r['strategy'], r['strategy'])} | {last.get('epoch_wire_ratio', 1.0):.4f} "
                     f"| {r['wire_ratio']:.4f} | {r['eval_acc']:.4f} | {d} | {best:.4f} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], png: Path) -> None:
    """Evaluation accuracy per epoch, one line per strategy, into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r in runs:
        epochs = [h["epoch"] + 1 for h in r["history"]]
        ax.plot(epochs, [h["eval_acc"] for h in r["history"]], marker="o", markersize=3,
                label=LABELS.get(r["strategy"], r["strategy"]))
    ax.set_xlabel("epoch")
    ax.set_ylabel("evaluation accuracy (10,000 test images)")
    ax.set_title(f"Seed CNN on Fashion-MNIST, {runs[0]['procs']} processes")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+", type=Path, help="train.py output files")
    p.add_argument("--procs", type=int, default=2, help="process count of the runs to show (default 2)")
    p.add_argument("--png", type=Path, default=None, help="write the accuracy plot here (needs matplotlib)")
    args = p.parse_args(argv)
    runs = load_runs(args.json, args.procs)
    if not runs:
        raise SystemExit(f"no distopt runs at {args.procs} processes in {', '.join(map(str, args.json))}")
    print(table(runs))
    if args.png is not None:
        plot(runs, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
