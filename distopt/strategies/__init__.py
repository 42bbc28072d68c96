"""Strategies: how gradients (or parameters) are averaged across ranks, one module each.

:class:`GradientStrategy` (per bucket) and :class:`ParameterAverager` (after the local update) are the two kinds of
:class:`Strategy` the step path drives; :class:`Dense` (plain all-reduce, the default), :class:`Half` (16-bit wire),
:class:`Sparse` (top-K / threshold with error feedback), :class:`DGC` (Deep Gradient Compression), :class:`PowerSGD`
(rank-r low-rank compression) and :class:`Adasum` (Horovod's adaptive summation) are gradient strategies,
:class:`Partial` (one chunk of parameters per step) a parameter averager. :class:`Residuals` is the error-feedback
memory of the compressing ones; :data:`REGISTRY` lists every strategy with example configurations.
"""
from .adasum import Adasum
from .base import (NOT_STARTED, BucketContext, Done, GradientStrategy, Handle, LocalInfo, NotStarted,
                   ParameterAverager, Strategy, UpdateContext)
from .dense import Dense
from .dgc import DGC
from .half import Half
from .memory import Residuals
from .partial import ChunkCursor, Partial
from .powersgd import PowerSGD
from .registry import REGISTRY, Example, register
from .sparse import Sparse, average_sparse

__all__ = ["Strategy", "GradientStrategy", "ParameterAverager", "LocalInfo", "BucketContext", "UpdateContext",
           "Done", "Handle", "NotStarted", "NOT_STARTED", "Dense", "Half", "Sparse", "Partial", "DGC", "PowerSGD",
           "ChunkCursor", "Residuals", "average_sparse", "REGISTRY", "Example", "register", "Adasum"]
