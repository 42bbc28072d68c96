"""Fully sharded parameters (``zero=3``) against DDP, ZeRO stages 0-2, ZeroRedundancyOptimizer and FSDP2.

Run (a driver: it starts the jobs itself)::

    python benchmarks/zero3.py                         # W = 2 under torchrun, a 27.3M-parameter GPT
    python benchmarks/zero3.py --launcher mpiexec      # distopt on MPI; its peers on gloo over the MPI ranks
    python benchmarks/zero3.py --quick --gpt 512,64,4,2,32,4

The GPT-style model (token and position embeddings, pre-LN attention and
MLP blocks, an untied head) trains with AdamW, every variant from seed 0 on
the same data: ``ddp``; ``zero0`` ... ``zero3`` (``DistOpt(AdamW,
model=..., zero=k)``); ``zero3_keep`` (``zero=3`` with
``reshard_after_forward=False``: one all-gather per step, the whole model
gathered during forward and backward); ``zero_torch`` (DDP and torch's
``ZeroRedundancyOptimizer``); ``fsdp2`` (torch's ``fully_shard`` on every
block and the root: ZeRO-3's peer). The jobs, the timing (interleaved
rounds, the max over ranks per iteration) and the memory columns are
``benchmarks/zero.py``'s (its docstring); ``parameter_bytes`` is what rank
0's parameters hold at rest after the last step (``zero=3``: its segments;
FSDP2: its local shards), and distopt's rows add ``gathered_bytes_peak``,
the most parameter BYTES ``zero=3`` held gathered at one time in the last
step.

Prints a table and writes ``benchmarks/results/zero3.json`` (``--out``):
``results[variant]`` with ``time_ms``, ``x_ddp``, ``peak_rss_mib``,
``parameter_bytes``, ``optimizer_state_bytes``, ``gradient_bytes`` and
``max_abs_diff_vs_ddp``.
"""
from __future__ import annotations

import sys

import zero

VARIANTS = ("ddp", "zero0", "zero1", "zero2", "zero3", "zero3_keep", "zero_torch", "fsdp2")

if __name__ == "__main__":
    sys.exit(zero.main(None, "zero3", VARIANTS, __doc__))
