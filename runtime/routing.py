"""Top-k routing arrays as every rank holds them: experts placed on ranks, indices checked.

`topk_idx` [R, T, k]: the global experts of each token of each rank (-1: an empty slot); routing
weights [R, T, k] float32 beside it.  The layout (runtime/layout) and the oracle
(runtime/testing/oracle.py) read routings only through these checks.
"""

from __future__ import annotations

import numpy as np

PLACEMENTS = ("blocked", "strided")


def expert_rank(experts: int, num_ranks: int, placement: str) -> tuple[np.ndarray, np.ndarray]:
    """(rank of each expert, local index of each expert on its rank), int64 [E] each."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected 'blocked' or 'strided', got {placement!r}")
    if num_ranks < 1 or experts < 1 or experts % num_ranks:
        raise ValueError(f"experts: {experts} experts cannot be divided evenly among {num_ranks} ranks")
    e = np.arange(experts, dtype=np.int64)
    epr = experts // num_ranks
    if placement == "blocked":
        return e // epr, e % epr
    return e % num_ranks, e // num_ranks


def check_topk(topk_idx, experts: int, num_ranks: int | None = None, topk: int | None = None) -> np.ndarray:
    """Validate top-k indices [R, T, k] (integers in -1..E-1, no expert twice in a token);
    returns them as int64.  Errors are ValueErrors that name the argument."""
    a = np.asarray(topk_idx)
    if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"topk_idx: expected integer expert indices, got dtype {a.dtype}")
    if a.ndim != 3:
        raise ValueError(f"topk_idx: expected shape [ranks, tokens, topk], got {list(a.shape)}")
    if num_ranks is not None and a.shape[0] != num_ranks:
        raise ValueError(f"topk_idx: has {a.shape[0]} ranks, the plan has {num_ranks}")
    if topk is not None and a.shape[2] != topk:
        raise ValueError(f"topk_idx: has {a.shape[2]} slots per token, the workload's topk is {topk}")
    a = a.astype(np.int64, copy=False)
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -1 or hi >= experts:
            bad = np.argwhere((a < -1) | (a >= experts))[0]
            raise ValueError(f"topk_idx: expert indices must lie in -1..{experts - 1} (-1: empty slot); "
                             f"rank {bad[0]}, token {bad[1]}, slot {bad[2]} holds {int(a[tuple(bad)])}")
        if a.shape[2] > 1:
            s = np.sort(a, axis=2)
            dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
            if dup.any():
                r, t, _ = np.argwhere(dup)[0]
                raise ValueError(f"topk_idx: token {t} of rank {r} lists the same expert twice: "
                                 f"{a[r, t].tolist()}")
    return a


def check_weights(weights, shape: tuple[int, ...]) -> np.ndarray:
    w = np.asarray(weights)
    if not (np.issubdtype(w.dtype, np.floating)):
        raise ValueError(f"weights: expected floating-point routing weights, got dtype {w.dtype}")
    if w.shape != tuple(shape):
        raise ValueError(f"weights: expected shape {list(shape)} (as topk_idx), got {list(w.shape)}")
    w = w.astype(np.float32, copy=False)
    if not np.isfinite(w).all():
        raise ValueError("weights: routing weights must be finite")
    return w
