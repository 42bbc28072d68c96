"""Which device a local rank uses, among the devices it can see (:func:`device_index`)."""
from __future__ import annotations

from collections.abc import Mapping

__all__ = ["device_index"]


def _count_visible(value: str) -> int:
    """Devices a ``CUDA_VISIBLE_DEVICES`` value exposes: entries up to the first invalid one."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break  # CUDA ignores this entry and everything after it (e.g. "-1", "NoDevFiles")
        count += 1
    return count


def device_index(local_rank: int, env: Mapping[str, str], device_count: int | None = None,
                 local_size: int | None = None) -> int:
    """The device this local rank should use, among the devices it can see.

    The index is relative to the visible devices, i.e. what ``cupy.cuda.Device(i)`` and ``torch.device("cuda", i)``
    take, not the physical GPU number. Without ``CUDA_VISIBLE_DEVICES`` and ``device_count`` it is ``local_rank``.
    With ``CUDA_VISIBLE_DEVICES`` listing ``k`` devices (otherwise ``k = device_count``; both given: the smaller):

    * ``k == 1``: 0. The launcher gave each process its own GPU (e.g. ``srun --gpus-per-task=1``); using
      ``local_rank`` here asks for a device that does not exist (DeepSpeed #3165).
    * ``local_rank < k`` (and ``local_size <= k`` when given): ``local_rank``.
    * otherwise: ``ValueError``. More local ranks than devices would put two ranks on one GPU, which NCCL refuses
      ("Duplicate GPU detected"); wrapping around with a modulo would hide that.

    Args:
        local_rank: This process's rank on its node (``RankInfo.local_rank``).
        env: The environment (only ``CUDA_VISIBLE_DEVICES`` is read).
        device_count: Devices this process can see (e.g. ``torch.cuda.device_count()``), or ``None`` if unknown.
        local_size: Processes on this node, or ``None`` if unknown. When given, every local rank fails alike if the
            node has too few devices, instead of only the highest ones.

    Returns:
        The device index, in ``[0, k)``.

    Raises:
        ValueError: ``local_rank`` is negative or not below ``local_size``; no device is visible; or there are more
            local ranks than visible devices.
    """
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    if local_size is not None and not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, local_size={local_size}), got {local_rank}")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = _count_visible(visible)
        where = f"CUDA_VISIBLE_DEVICES={visible!r}"
        if device_count is not None and device_count < count:
            count, where = device_count, f"{where} with device_count={device_count}"
    elif device_count is not None:
        count, where = device_count, f"device_count={device_count}"
    else:
        return local_rank
    if count < 1:
        raise ValueError(f"no visible device ({where})")
    if count == 1:
        return 0
    needed = max(local_rank + 1, local_size or 0)
    if needed > count:
        raise ValueError(f"{needed} local ranks but only {count} visible devices ({where}): ranks would "
                         "share a GPU, which NCCL refuses ('Duplicate GPU detected'); start at most "
                         f"{count} processes per node or make more devices visible")
    return local_rank
