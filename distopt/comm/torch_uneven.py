"""The torch backend's uneven all-to-all: one ``all_to_all_single`` with split sizes.

:class:`TorchUneven` is a mixin of :class:`~distopt.comm.torchdist.TorchCommunicator` (it uses its control block,
process group and bounded waits). The array moves as its bytes (any dtype, gloo or NCCL), the split sizes being
``matrix`` row ``rank`` (sends) and column ``rank`` (receives) times the item size; see :mod:`distopt.comm.uneven`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from .lifecycle import collective
from .torch_arrays import FlatTensor, descriptor_code
from .uneven import check_matrix, received

if TYPE_CHECKING:
    from .control import ControlBlock

__all__ = ["TorchUneven"]


class TorchUneven:
    """The uneven all-to-all of :class:`~distopt.comm.torchdist.TorchCommunicator` (a mixin)."""

    rank: int
    size: int
    _group: Any
    _ctl: ControlBlock
    _complete: Callable[[Any, FlatTensor, str], None]

    @collective
    def all_to_all_v(self, array: Any, matrix: Sequence[Sequence[int]]) -> Any:
        """Uneven all-to-all (``all_to_all_single`` with split sizes): ``matrix[i][j]`` ELEMENTS from rank i to rank
        j; see :mod:`distopt.comm.uneven`.

        Returns:
            A new 1-D array (the caller's type) of ``sum(matrix[i][rank] for i)`` elements, rank i's segment after
            rank i-1's.

        Raises:
            ValueError: ``array`` not 1-D, a bad matrix (:func:`~distopt.comm.uneven.check_matrix`).
            TypeError: unsupported array type, non-contiguous.
            CollectiveMismatchError: the matrices (compared as a CRC-32) or dtypes differ, on every rank.
            CollectiveTimeoutError: the deadline passed or a peer exited.
        """
        rows = check_matrix(array, matrix, self.rank, self.size)
        t = FlatTensor(array)
        gets = received(rows, self.rank)
        out = t.new(sum(gets))
        flat = [n for row in rows for n in row]
        what = self._ctl.agree_counts("all_to_all_v", sum(flat), descriptor_code(t, 0), flat)
        if self.size == 1:
            out.copy_(t.flat)
        elif sum(flat):
            item = t.flat.element_size()
            self._complete(dist.all_to_all_single(out.view(torch.uint8), t.flat.view(torch.uint8),
                                                  output_split_sizes=[n * item for n in gets],
                                                  input_split_sizes=[n * item for n in rows[self.rank]],
                                                  group=self._group, async_op=True), t, what)
        return t.back(out)

