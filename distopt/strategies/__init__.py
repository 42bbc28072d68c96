"""Strategies: how gradients (or parameters) are averaged across ranks, one module each.

:class:`Strategy` is the interface the step engine drives; :class:`Dense`
(plain all-reduce, the default), :class:`Half` (16-bit wire),
:class:`Sparse` (top-K / threshold with error feedback),
:class:`Partial` (one chunk of parameters per step), :class:`DGC` (Deep
Gradient Compression) and :class:`PowerSGD` (rank-r low-rank compression)
implement it.
"""
from .base import BucketContext, Done, Strategy, UpdateContext
from .dense import Dense
from .dgc import DGC
from .half import Half
from .partial import ChunkCursor, Partial
from .powersgd import PowerSGD
from .sparse import Residuals, Sparse, average_sparse

__all__ = ["Strategy", "BucketContext", "UpdateContext", "Done", "Dense", "Half", "Sparse", "Partial", "DGC",
           "PowerSGD", "ChunkCursor", "Residuals", "average_sparse"]
