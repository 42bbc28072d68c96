"""Gradient-compression kernels: sparsification, scatter-add and half-precision casts.

Pure array functions with a NumPy implementation and a CuPy one chosen when the input is a CuPy array (CuPy is
imported only then). Error feedback (Stich et al. 2018) is applied by the caller, not here.
"""
from __future__ import annotations

from .cast import WIRE_DTYPES, from_wire, half_scales, to_wire
from .densify import densify
from .threshold import threshold_indices
from .topk import k_for, topk_indices

__all__ = ["WIRE_DTYPES", "densify", "from_wire", "half_scales", "k_for", "threshold_indices", "to_wire",
           "topk_indices"]
