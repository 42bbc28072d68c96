"""Strategies: how gradients (or parameters) are averaged across ranks, one module each.

:class:`Strategy` is the interface the step engine drives; :class:`Dense`
(plain all-reduce, the default), :class:`Half` (16-bit wire),
:class:`Sparse` (top-K / threshold with error feedback) and
:class:`Partial` (one chunk of parameters per step) implement it.
"""
from .base import BucketContext, Done, Strategy, UpdateContext
from .dense import Dense
from .half import Half
from .partial import ChunkCursor, Partial
from .sparse import Residuals, Sparse, average_sparse

__all__ = ["Strategy", "BucketContext", "UpdateContext", "Done", "Dense", "Half", "Sparse", "Partial",
           "ChunkCursor", "Residuals", "average_sparse"]
