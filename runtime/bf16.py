"""bfloat16 in NumPy: conversions (round to nearest even), distances in ulp, the unit roundoff.

bf16 values travel as their 16 bits in uint16 arrays (NumPy has no bf16).  Used by the oracle and
the executors of runtime/testing, and by the engines that say what a check must admit.
"""

from __future__ import annotations

import numpy as np

#: Unit roundoff of bf16: what a partial sum rounded to bf16 once (combine partials crossing an
#: RDMA-class link travel as bf16 on every backend) moves, relative to its magnitude.
BF16_ROUNDOFF = 2.0 ** -8


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest, ties to even; NaN stays a (quiet) NaN."""
    a = np.ascontiguousarray(x, dtype=np.float32)
    u = a.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), rounded)
    return rounded


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_ulp_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in units in the last place of bf16 (both bf16 bits); +0 and -0 are equal."""
    def ordered(v):
        i = np.asarray(v, dtype=np.uint16).astype(np.int32)
        return np.where(i & 0x8000, -(i & 0x7FFF), i)
    return np.abs(ordered(a) - ordered(b))
