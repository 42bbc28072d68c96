"""Whether a gradient hook runs in a nested backward pass (reentrant activation checkpointing).

``torch.utils.checkpoint(..., use_reentrant=True)`` runs its block's backward as a nested ``torch.autograd.backward``
from inside the outer backward's autograd Function; a parameter of a block used twice then gets two gradient hooks,
one per nested pass. The follower hands such gradients to the bucket pipeline only when the outer backward ends.
"""
from __future__ import annotations

import os
import sys

__all__ = ["inside_nested_backward"]


def inside_nested_backward() -> bool:
    """Whether the calling hook runs in a backward pass started from inside another one's autograd Function (see the
    module docs), on any thread."""
    frame = sys._getframe(2)
    in_backward = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward":
            in_backward = True
        elif in_backward and code.co_name == "apply" and code.co_filename.endswith(_FUNCTION_FILE):
            return True
        frame = frame.f_back
    return False


_FUNCTION_FILE = os.path.join("autograd", "function.py")
