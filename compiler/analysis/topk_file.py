"""Routings from `.npy` files: the one reader behind `--routing FILE.npy` of the compiler
(analysis/routing.py: a measured routing the volumes are sampled from) and of `epcc run` and the
tests (runtime/testing/inputs.py: the top-k indices every rank dispatches).

NumPy only: the runtime reads files with it where the compiler is not installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..files import NPY_MAX_BYTES, FileError, read_npy


class TopkFileError(ValueError):
    """The file is missing, not a .npy array, or not top-k indices (the message names the file)."""


def read(path: str | Path, limit: int = NPY_MAX_BYTES) -> np.ndarray:
    """The array in `path`: a regular file of at most `limit` bytes holding a .npy array of
    numbers (epcc.files.read_npy: no pickles, the header checked before anything is allocated)."""
    try:
        return read_npy(path, "a routing .npy file", limit)
    except FileError as e:
        raise TopkFileError(str(e)) from None


def topk_rows(arr: np.ndarray, path: str | Path, topk: int, experts: int, *, empty_slots: bool) -> np.ndarray:
    """`arr`, integer top-k indices [N, topk], checked and as int64: `topk` columns, at least one
    row, every index in 0..experts-1 (or -1, an empty slot, where `empty_slots`), no expert twice
    in a row."""
    if not np.issubdtype(arr.dtype, np.integer) or arr.ndim != 2:
        raise TopkFileError(f"{path}: expected integer top-k indices [N, {topk}], got {arr.dtype} {list(arr.shape)}")
    if arr.shape[1] != topk:
        raise TopkFileError(f"{path}: top-k indices have {arr.shape[1]} columns; the workload's topk is {topk}")
    if arr.shape[0] == 0:
        raise TopkFileError(f"{path}: no tokens (shape {list(arr.shape)}): a measured routing needs at least one row")
    lo = -1 if empty_slots else 0
    if arr.min() < lo or arr.max() >= experts:
        raise TopkFileError(f"{path}: expert indices must lie in {lo}..{experts - 1}"
                            + (" (-1: an empty slot)" if empty_slots else ""))
    a = arr.astype(np.int64)
    s = np.sort(a, axis=1)
    if ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any():
        raise TopkFileError(f"{path}: a token lists the same expert twice")
    return a
