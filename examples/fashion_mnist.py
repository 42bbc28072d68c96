"""Load MNIST-format IDX files (Fashion-MNIST, MNIST) with NumPy only.

A directory must hold the four files of the dataset, each gzip-compressed
(``.gz``) or raw::

    train-images-idx3-ubyte[.gz]  train-labels-idx1-ubyte[.gz]
    t10k-images-idx3-ubyte[.gz]   t10k-labels-idx1-ubyte[.gz]

Debian's ``dataset-fashion-mnist`` package installs them in
``/usr/share/datasets/fashion-mnist`` (the default here).

Example::

    from fashion_mnist import load
    train_x, train_y, test_x, test_y = load()   # (60000, 1, 28, 28) float32, int64 ...
"""
from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np

__all__ = ["DEFAULT_DIR", "FILES", "read_idx", "find_file", "load", "add_data_args"]

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
# IDX type codes (third byte of the magic number) -> big-endian dtypes
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _missing_message(data_dir: Path, missing: list[str]) -> str:
    return (
        f"MNIST-format IDX files not found in {data_dir}: missing {', '.join(missing)} "
        "(gzip '.gz' or raw). Install Debian's dataset-fashion-mnist package "
        "('apt-get install dataset-fashion-mnist', files in " + DEFAULT_DIR + ") "
        "or pass --data-dir pointing at any directory of MNIST/Fashion-MNIST IDX files."
    )


def find_file(data_dir: str | Path, stem: str) -> Path | None:
    """Path of ``stem`` or ``stem.gz`` in ``data_dir`` (raw preferred), or None."""
    for name in (stem, stem + ".gz"):
        path = Path(data_dir) / name
        if path.is_file():
            return path
    return None


def read_idx(path: str | Path) -> np.ndarray:
    """Parse one IDX file (gzip or raw) into an array of its declared shape.

    The header is ``0x00 0x00 <type> <ndim>`` followed by ``ndim`` big-endian
    uint32 sizes; the data follows in C order.

    Args:
        path: the file; a name ending in ``.gz`` is decompressed.

    Returns:
        Array of shape ``dims`` in the file's element type (native byte order).

    Raises:
        ValueError: bad magic number, unknown type code, or a data size that
            does not match the header.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()})")
    ndim = raw[3]
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValueError(f"{path}: header says {dims} x {dtype.itemsize} bytes = {expected} bytes of data, "
                         f"file holds {len(raw) - offset}")
    return np.frombuffer(raw, dtype=dtype, offset=offset).reshape(dims).astype(dtype.newbyteorder("="))


def check_dir(data_dir: str | Path = DEFAULT_DIR) -> dict[str, Path]:
    """Paths of the four files in ``data_dir``.

    Raises:
        SystemExit: a file is missing; the message says how to get the data.
    """
    paths = {key: find_file(data_dir, stem) for key, stem in FILES.items()}
    missing = [FILES[key] for key, path in paths.items() if path is None]
    if missing:
        raise SystemExit(_missing_message(Path(data_dir), missing))
    return paths  # type: ignore[return-value]


def load(data_dir: str | Path = DEFAULT_DIR, normalize: bool = True
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training and test sets of an MNIST-format dataset.

    Args:
        data_dir: directory of the four IDX files (see the module docstring).
        normalize: if True, standardise with the training set's mean and
            standard deviation of the [0, 1] pixels (the same constants for
            both sets); if False, return pixels scaled to [0, 1].

    Returns:
        ``(train_x, train_y, test_x, test_y)``: images float32 of shape
        ``(N, 1, 28, 28)``, labels int64 of shape ``(N,)``.

    Raises:
        SystemExit: files missing (see :func:`check_dir`).
        ValueError: a malformed file, or image and label counts differ.
    """
    paths = check_dir(data_dir)
    arrays = {key: read_idx(path) for key, path in paths.items()}
    out = []
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(f"{split} set: images {x.shape} and labels {y.shape} do not match "
                             "(expected (N, rows, cols) and (N,))")
        out += [(x.astype(np.float32) / 255.0)[:, None], y.astype(np.int64)]
    if normalize:
        mean, std = float(out[0].mean()), float(out[0].std())
        for i in (0, 2):
            out[i] -= mean
            out[i] /= std
    return out[0], out[1], out[2], out[3]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--data-dir`` to an example's argument parser."""
    parser.add_argument("--data-dir", default=DEFAULT_DIR,
                        help=f"directory of MNIST-format IDX files, gz or raw (default {DEFAULT_DIR})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Print the shapes and statistics of an IDX dataset.")
    add_data_args(p)
    a = p.parse_args()
    for name, arr in zip(("train_x", "train_y", "test_x", "test_y"), load(a.data_dir, normalize=False)):
        print(f"{name}: shape {arr.shape} dtype {arr.dtype} min {arr.min()} max {arr.max()}")
