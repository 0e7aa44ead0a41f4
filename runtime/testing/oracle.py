"""The dispatch/combine oracle: what EP dispatch and combine must produce, in plain NumPy.

Independent of the compiler and of any plan or layout: it reads only the routing (top-k expert
indices per token), the expert placement and the payload.  Every executor (the NumPy reference
of runtime/testing/reference.py, the CPU engine, the CUDA kernels) is compared against it.

Dispatch, for every destination rank d: the rows of every (token, expert) pair with the expert
on d, in the documented order (docs/runtime.md): by local expert ascending, then home rank, then
token index.  An index of -1 in `topk_idx` is an empty slot.  Combine: for every home rank h and
token t, out[h, t] = sum over the token's experts e of w_e * y(row of (h, t, e)), accumulated in
fp32 (the caller rounds to bf16 when comparing).

Token-major (the workload's `layout token`, DeepEP V1 intranode): destination rank d receives
every token with at least one expert on d ONCE, ordered by (home rank, token), with the token's
top-k as seen from d (the local expert id where the expert is on d, else -1; the weight there,
else 0) and the rows per local expert.  Its combine is the adjoint: out[h, t] = sum over the
token's destination ranks d of y_d[row of (h, t)], unweighted (the expert computation on d has
weighted and reduced its local experts into that row).

Also here: the comparison helpers the `epcc run` command, the bench and the tests share (bf16
conversions: runtime/bf16.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bf16 import bf16_to_f32, bf16_ulp_diff, f32_to_bf16
from ..routing import check_topk, check_weights, expert_rank


# --------------------------------------------------------------------------- dispatch


@dataclass
class RankRecv:
    """What one destination rank receives."""

    rows: np.ndarray  # uint8 [n, row_bytes]
    src: np.ndarray  # int64 [n, 3]: (home rank, token, global expert)
    weights: np.ndarray  # float32 [n]
    counts: np.ndarray  # int64 [E/R]: rows per local expert


def recv_order(topk_idx: np.ndarray, experts: int, placement: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per destination rank: (src [n, 3] (home, token, expert), slot j of the expert in the
    token's top-k [n]) in the documented order (local expert, home rank, token)."""
    topk = check_topk(topk_idx, experts)
    rank_of, local_of = expert_rank(experts, topk.shape[0], placement)
    return [_rank_order(topk, rank_of, local_of, d) for d in range(topk.shape[0])]


def rank_recv_order(topk_idx: np.ndarray, experts: int, placement: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """recv_order(...)[rank] alone: what one rank receives, without ordering every other rank's
    rows (a GPU check's rank needs only its own)."""
    topk = check_topk(topk_idx, experts)
    if not 0 <= rank < topk.shape[0]:
        raise ValueError(f"rank: expected 0..{topk.shape[0] - 1}, got {rank}")
    rank_of, local_of = expert_rank(experts, topk.shape[0], placement)
    return _rank_order(topk, rank_of, local_of, rank)


def _rank_order(topk: np.ndarray, rank_of: np.ndarray, local_of: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, j) of destination d (recv_order).  np.nonzero lists the slots in (home, token, slot)
    order and a token names an expert at most once (check_topk), so a stable sort by local expert
    alone gives the (local expert, home, token) order; its keys in the narrowest integer type
    (uint8 for up to 256 local experts) sort in linear time."""
    h, t, j = np.nonzero((topk >= 0) & (rank_of[np.maximum(topk, 0)] == d))
    e = topk[h, t, j]
    keys = local_of[e].astype(np.min_scalar_type(int(local_of.max()) if local_of.size else 0))
    order = np.argsort(keys, kind="stable")
    return (np.stack([h[order], t[order], e[order]], axis=1).astype(np.int64).reshape(-1, 3),
            j[order].astype(np.int64))


def _payload(x_rows, R: int, T: int) -> np.ndarray:
    """x_rows (uint8 [R, T, row_bytes], or a list of R [T, row_bytes]) as one array."""
    if isinstance(x_rows, (list, tuple)):
        x = np.stack([np.asarray(r) for r in x_rows]) if len(x_rows) else np.zeros((0, T, 0), np.uint8)
    else:
        x = np.asarray(x_rows)
    if x.dtype != np.uint8 or x.ndim != 3 or x.shape[:2] != (R, T):
        raise ValueError(f"x_rows: expected uint8 [{R}, {T}, row_bytes], got {x.dtype} {list(x.shape)}")
    return x


def dispatch_oracle(topk_idx, experts: int, placement: str, x_rows, weights=None) -> list[RankRecv]:
    """Per destination rank d: the rows it receives (x_rows [R, T, row_bytes] uint8, opaque
    payload rows), their (home, token, expert), routing weights and per-local-expert counts."""
    topk = check_topk(topk_idx, experts)
    R, T, k = topk.shape
    x = _payload(x_rows, R, T)
    w = check_weights(weights, topk.shape) if weights is not None else np.ones(topk.shape, np.float32)
    rank_of, local_of = expert_rank(experts, R, placement)
    epr = experts // R
    out = []
    for src, j in recv_order(topk, experts, placement):
        h, t, e = src[:, 0], src[:, 1], src[:, 2]
        out.append(RankRecv(rows=x[h, t], src=src, weights=w[h, t, j],
                            counts=np.bincount(local_of[e], minlength=epr).astype(np.int64)))
    return out


@dataclass
class TokenRecv:
    """What one destination rank receives in the token-major layout."""

    rows: np.ndarray  # uint8 [n, row_bytes]: recv_x
    src: np.ndarray  # int64 [n, 2]: (home rank, token)
    topk_idx: np.ndarray  # int64 [n, k]: local expert id on this rank, -1 elsewhere
    topk_weights: np.ndarray  # float32 [n, k]: the weight of those slots, 0 elsewhere
    counts: np.ndarray  # int64 [E/R]: num_recv_tokens_per_expert


def token_recv_order(topk_idx: np.ndarray, experts: int, placement: str) -> list[np.ndarray]:
    """Per destination rank: (home, token) [n, 2] of the tokens with an expert on it, by (home
    rank, token)."""
    topk = check_topk(topk_idx, experts)
    R = topk.shape[0]
    rank_of, _ = expert_rank(experts, R, placement)
    dest = np.where(topk >= 0, rank_of[np.maximum(topk, 0)], -1)
    return [np.argwhere((dest == d).any(axis=2)).astype(np.int64).reshape(-1, 2) for d in range(R)]


def token_dispatch_oracle(topk_idx, experts: int, placement: str, x_rows, weights=None) -> list[TokenRecv]:
    """Per destination rank d, token-major: every token with an expert on d once (x_rows as in
    :func:`dispatch_oracle`), its top-k as seen from d, and the rows per local expert."""
    topk = check_topk(topk_idx, experts)
    R, T, k = topk.shape
    x = _payload(x_rows, R, T)
    w = check_weights(weights, topk.shape) if weights is not None else np.ones(topk.shape, np.float32)
    rank_of, local_of = expert_rank(experts, R, placement)
    out = []
    for d, src in enumerate(token_recv_order(topk, experts, placement)):
        h, t = src[:, 0], src[:, 1]
        e = topk[h, t].reshape(-1, k)
        on = (e >= 0) & (rank_of[np.maximum(e, 0)] == d)
        out.append(TokenRecv(rows=x[h, t], src=src, topk_idx=np.where(on, local_of[np.maximum(e, 0)], -1),
                             topk_weights=np.where(on, w[h, t].reshape(-1, k), 0).astype(np.float32),
                             counts=np.bincount(local_of[e[on]], minlength=experts // R).astype(np.int64)))
    return out


# --------------------------------------------------------------------------- combine


def _as_f32(y: np.ndarray) -> np.ndarray:
    y = np.asarray(y)
    if y.dtype == np.uint16:
        return bf16_to_f32(y)
    if y.dtype == np.float32:
        return y
    raise ValueError(f"y: expected bf16 bits (uint16) or float32 expert outputs, got {y.dtype}")


def combine_oracle(topk_idx, experts: int, placement: str, weights, y, hidden: int | None = None,
                   *, return_abs: bool = False):
    """out [R, T, hidden] float32: out[h, t] = sum over the token's experts e of
    w[h, t, slot of e] * y_d[row of (h, t, e)], with y a list over destination ranks of
    [n_d, hidden] expert outputs (bf16 bits as uint16, or float32) aligned with the rows of
    :func:`dispatch_oracle`.  With `return_abs`, also sum |w * y| (the scale of the rounding
    error any other summation order may make)."""
    topk = check_topk(topk_idx, experts)
    R, T, k = topk.shape
    w = check_weights(weights, topk.shape) if weights is not None else np.ones(topk.shape, np.float32)
    if len(y) != R:
        raise ValueError(f"y: expected expert outputs for {R} ranks, got {len(y)}")
    order = recv_order(topk, experts, placement)
    if hidden is None:
        hidden = next((np.asarray(v).shape[1] for v in y if np.asarray(v).ndim == 2), 0)
    out = np.zeros((R * T, hidden), np.float32)
    mag = np.zeros((R * T, hidden), np.float32) if return_abs else None
    for d, (src, j) in enumerate(order):
        yd = _as_f32(y[d])
        if yd.shape != (src.shape[0], hidden):
            raise ValueError(f"y: rank {d} should have [{src.shape[0]}, {hidden}] expert outputs, "
                             f"got {list(yd.shape)}")
        h, t = src[:, 0], src[:, 1]
        _accumulate(out, mag, h * T + t, w[h, t, j][:, None] * yd)  # fp32 products
    out = out.reshape(R, T, hidden)
    if return_abs:
        return out, mag.reshape(R, T, hidden)
    return out


def _accumulate(out: np.ndarray, mag: np.ndarray | None, gid: np.ndarray, contrib: np.ndarray) -> None:
    """out[gid] += contrib (and mag[gid] += |contrib|), fp32, the rows of one token summed in row
    order."""
    order = np.argsort(gid, kind="stable")
    g = gid[order]
    if g.size:
        first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        out[g[first]] += np.add.reduceat(contrib[order], first, axis=0)
        if mag is not None:
            mag[g[first]] += np.add.reduceat(np.abs(contrib[order]), first, axis=0)


def token_combine_oracle(topk_idx, experts: int, placement: str, y, hidden: int | None = None,
                         *, return_abs: bool = False):
    """The adjoint of :func:`token_dispatch_oracle`: out [R, T, hidden] float32, out[h, t] = sum
    over the token's destination ranks d of y_d[row of (h, t)] (y: per rank [n_d, hidden], bf16
    bits as uint16 or float32, aligned with the token-major rows), unweighted.  With
    `return_abs`, also sum |y| (the scale of any other summation order's rounding)."""
    topk = check_topk(topk_idx, experts)
    R, T, k = topk.shape
    if len(y) != R:
        raise ValueError(f"y: expected expert outputs for {R} ranks, got {len(y)}")
    if hidden is None:
        hidden = next((np.asarray(v).shape[1] for v in y if np.asarray(v).ndim == 2), 0)
    out = np.zeros((R * T, hidden), np.float32)
    mag = np.zeros((R * T, hidden), np.float32) if return_abs else None
    for d, src in enumerate(token_recv_order(topk, experts, placement)):
        yd = _as_f32(y[d])
        if yd.shape != (src.shape[0], hidden):
            raise ValueError(f"y: rank {d} should have [{src.shape[0]}, {hidden}] rows, got {list(yd.shape)}")
        _accumulate(out, mag, src[:, 0] * T + src[:, 1], yd)
    out = out.reshape(R, T, hidden)
    if return_abs:
        return out, mag.reshape(R, T, hidden)
    return out


# --------------------------------------------------------------------------- comparison

# Combine tolerance.  Every executor forms the same fp32 products w * y (y is bf16, exact in
# fp32) but sums them in its own order (through partial sums at relay ranks, possibly fused
# multiply-adds), so the fp32 results differ by reordering error only: at most about
# (k - 1) * 2^-24 * sum |w y| per channel.  Compared after rounding both to bf16 (the dtype
# combine returns), that is normally 0 ulp and at most 1 ulp when the two fp32 values straddle
# a bf16 rounding boundary; 2 ulp leaves a margin for a boundary case on top of a fused
# multiply-add.  Relative error 1e-2 (about 2.5 bf16 ulp) accepts the same thing stated
# relatively.  Under cancellation (a sum much smaller than its terms) neither holds for a
# correct sum, so the absolute reordering bound 2 * k * 2^-24 * sum |w y| (twice the worst
# case) is accepted as well.  A wrong, missing or double-counted contribution changes the sum
# by a whole |w y| term and fails all three.
MAX_ULP = 2
MAX_REL = 1e-2


@dataclass
class CombineCheck:
    ok: bool
    max_ulp: int
    max_rel: float
    first_bad: tuple[int, int, int] | None  # (home rank, token, channel)
    got: float = 0.0
    want: float = 0.0
    beyond_ulp: int = 0  # values more than MAX_ULP bf16 ulp apart (accepted by another criterion if ok)


def compare_combine(got: np.ndarray, want: np.ndarray, mag: np.ndarray, topk: int,
                    partial_rounding: float = 0.0) -> CombineCheck:
    """got, want, mag: float32 [R, T, hidden] (mag from combine_oracle(return_abs=True)).

    partial_rounding: the unit roundoff of a narrower dtype the executor rounds partial sums to on
    the way (the direct CUDA combine sends one bf16 partial per (token, GPU): 2^-8).  The partials
    of a token add up to at most sum |w y| in magnitude, so their rounding moves the result by at
    most partial_rounding x sum |w y|; that is added to the reordering bound.  0: no such rounding."""
    got = np.asarray(got, np.float32)
    gb, wb = f32_to_bf16(got), f32_to_bf16(want)
    ulp = bf16_ulp_diff(gb, wb)
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    scale = np.abs(want.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(scale > 0, diff / scale, np.where(diff > 0, np.inf, 0.0))
    bound = (2.0 * max(topk, 1) * 2.0 ** -24 + partial_rounding) * mag.astype(np.float64)
    ok = (ulp <= MAX_ULP) | (rel <= MAX_REL) | (diff <= bound)
    ok &= np.isfinite(got) | ~np.isfinite(want)
    bad = np.argwhere(~ok)
    first = tuple(int(v) for v in bad[0]) if bad.size else None
    return CombineCheck(ok=first is None, max_ulp=int(ulp.max()) if ulp.size else 0,
                        max_rel=float(np.nanmax(np.where(np.isfinite(rel), rel, 0.0))) if rel.size else 0.0,
                        first_bad=first,
                        got=float(got[first]) if first else 0.0, want=float(want[first]) if first else 0.0,
                        beyond_ulp=int(np.count_nonzero(ulp > MAX_ULP)))
