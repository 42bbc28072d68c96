"""Per-bucket averaging strategies: sparsified and partial (plain and half: :mod:`distopt.overlap`).

Each function takes a communicator and one flat gradient (or parameter)
bucket and averages it across ranks in place, returning the bytes this rank
handed to the collectives. State (error-feedback residuals, the partial
cursor) lives in explicit objects with ``state_dict``/``load_state_dict``.
"""
from .partial import ChunkCursor
from .sparse import Residuals, average_sparse

__all__ = ["average_sparse", "Residuals", "ChunkCursor"]
