"""A run checked against the oracle, in words: what `epcc run` (and any harness that runs every
rank of a plan) says when a backend's dispatch or combine differs from oracle.py, and how much
memory such a run holds.

* run_bytes: about the most memory a checked run holds at once;
* dispatch_difference: the first difference between a backend's dispatched rows (with the
  layout's sources, counts and weights) and the oracle's, naming rank, token and expert;
* token_dispatch_difference: the same for the token-major layout (oracle.token_dispatch_oracle);
* combine_difference: the combine results against the oracle's sums, the error summary and the
  first value outside the tolerance (oracle.compare_combine).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import oracle


def run_bytes(R: int, tokens: int, hidden: int, dtype: str, topk: int) -> int:
    """About the most memory a checked run holds at once, in bytes: per token of every rank its
    payload row, its top-k dispatched rows (the backend's and the oracle's), their expert outputs
    (bf16), the combine results (fp32, the backend's and stacked) and the oracle's float64 sums,
    magnitudes and error terms."""
    row = hidden * 2 if dtype == "bf16" else hidden + (hidden // 128) * 4
    per_token = row + 2 * topk * row + 2 * topk * hidden + hidden * (2 * 4 + 5 * 8)
    return R * tokens * per_token


def token_text(names: list[str], h: int, t: int) -> str:
    return f"token {t} of {names[h] if 0 <= h < len(names) else f'rank {h}'}"


def _output_rows(got_rows, d: int, shape, rank: str) -> tuple[np.ndarray | None, str | None]:
    """The backend's output rows of rank d, or why they are not uint8 rows of `shape`."""
    rows = np.asarray(got_rows[d]) if d < len(got_rows) else None
    if rows is None or rows.dtype != np.uint8 or rows.shape != shape:
        what = "nothing" if rows is None else f"{rows.dtype} {list(rows.shape)}"
        return None, f"{rank}: the backend returned {what} for output, expected uint8 {list(shape)}"
    return rows, None


def dispatch_difference(layout, got_rows, want: list[oracle.RankRecv], names: list[str]) -> str | None:
    """The first difference between what the backend (`got_rows`, per rank) and the layout
    delivered and the oracle (`want`), in words; None where they agree bit for bit."""
    E = layout.experts
    for d, w in enumerate(want):
        rank = names[d]
        got_src = layout.entries.get(("output", d), np.zeros((0, 3), np.int64))
        if not np.array_equal(got_src, w.src):
            gk = got_src[:, 0] * (layout.tokens * E) + got_src[:, 1] * E + got_src[:, 2]
            wk = w.src[:, 0] * (layout.tokens * E) + w.src[:, 1] * E + w.src[:, 2]
            missing = np.flatnonzero(~np.isin(wk, gk))
            if missing.size:
                h, t, e = (int(v) for v in w.src[missing[0]])
                more = f" ({missing.size - 1} more rows missing)" if missing.size > 1 else ""
                return f"{rank} never receives {token_text(names, h, t)} for expert {e}{more}"
            extra = np.flatnonzero(~np.isin(gk, wk))
            if extra.size:
                h, t, e = (int(v) for v in got_src[extra[0]])
                return f"{rank} receives {token_text(names, h, t)} for expert {e}, which is not routed there"
            if gk.size != wk.size:
                u, cnt = np.unique(gk, return_counts=True)
                k = int(u[cnt > 1][0])
                h, t, e = k // (layout.tokens * E), (k // E) % layout.tokens, k % E
                return f"{rank} receives {token_text(names, h, t)} for expert {e} {int(cnt[cnt > 1][0])} times"
            i = int(np.flatnonzero(gk != wk)[0])
            h, t, e = (int(v) for v in got_src[i])
            h2, t2, e2 = (int(v) for v in w.src[i])
            return (f"{rank}: output row {i} holds {token_text(names, h, t)} for expert {e}; the documented order "
                    f"(local expert, home rank, token) puts {token_text(names, h2, t2)} for expert {e2} there")
        if not np.array_equal(layout.recv_counts[d], w.counts):
            return f"{rank}: rows per local expert {layout.recv_counts[d].tolist()}, expected {w.counts.tolist()}"
        rows, wrong = _output_rows(got_rows, d, w.rows.shape, rank)
        if wrong:
            return wrong
        bad = np.flatnonzero((rows != w.rows).any(axis=1))
        if bad.size:
            i = int(bad[0])
            h, t, e = (int(v) for v in w.src[i])
            byte = int(np.flatnonzero(rows[i] != w.rows[i])[0])
            more = f" ({bad.size - 1} more rows differ)" if bad.size > 1 else ""
            return (f"{rank}: output row {i} ({token_text(names, h, t)}, expert {e}) differs from the token's "
                    f"payload from byte {byte} on{more}")
        gw = layout.output_weights[d] if d < len(layout.output_weights) else None
        if gw is None or gw.shape != w.weights.shape or \
                not np.array_equal(gw.astype(np.float32).view(np.uint32), w.weights.view(np.uint32)):
            i = 0 if gw is None or gw.shape != w.weights.shape else \
                int(np.flatnonzero(gw.astype(np.float32).view(np.uint32) != w.weights.view(np.uint32))[0])
            h, t, e = (int(v) for v in w.src[i]) if w.src.shape[0] else (0, 0, 0)
            return f"{rank}: output row {i} ({token_text(names, h, t)}, expert {e}) carries the wrong routing weight"
    return None


def token_dispatch_difference(layout, got_rows, want: list[oracle.TokenRecv], names: list[str]) -> str | None:
    """dispatch_difference for the token-major layout: the backend's rows and the layout's
    (home, token), top-k and counts against oracle.token_dispatch_oracle; None where they agree
    bit for bit."""
    for d, w in enumerate(want):
        rank = names[d]
        got_src = layout.entries.get(("output", d), np.zeros((0, 2), np.int64))
        if not np.array_equal(got_src, w.src):
            gk, wk = got_src[:, 0] * layout.tokens + got_src[:, 1], w.src[:, 0] * layout.tokens + w.src[:, 1]
            missing, extra = np.flatnonzero(~np.isin(wk, gk)), np.flatnonzero(~np.isin(gk, wk))
            if missing.size:
                h, t = (int(v) for v in w.src[missing[0]])
                return f"{rank} never receives {token_text(names, h, t)}"
            if extra.size:
                h, t = (int(v) for v in got_src[extra[0]])
                return f"{rank} receives {token_text(names, h, t)}, which has no expert there"
            if gk.size != wk.size:
                u, cnt = np.unique(gk, return_counts=True)
                k = int(u[cnt > 1][0])
                return f"{rank} receives {token_text(names, k // layout.tokens, k % layout.tokens)} more than once"
            i = int(np.flatnonzero(gk != wk)[0])
            return (f"{rank}: output row {i} holds {token_text(names, *(int(v) for v in got_src[i]))}; the documented "
                    f"order (home rank, token) puts {token_text(names, *(int(v) for v in w.src[i]))} there")
        if not np.array_equal(layout.recv_counts[d], w.counts):
            return f"{rank}: tokens per local expert {layout.recv_counts[d].tolist()}, expected {w.counts.tolist()}"
        rows, wrong = _output_rows(got_rows, d, w.rows.shape, rank)
        if wrong:
            return wrong
        for what, got, exp in (("payload", rows, w.rows), ("top-k experts", layout.recv_topk_idx[d], w.topk_idx),
                               ("top-k weights", layout.recv_topk_weights[d].view(np.uint32),
                                w.topk_weights.view(np.uint32))):
            if got.shape != exp.shape:
                return f"{rank}: {what} of shape {list(got.shape)}, expected {list(exp.shape)}"
            bad = np.flatnonzero((got != exp).any(axis=1))
            if bad.size:
                more = f" ({bad.size - 1} more rows differ)" if bad.size > 1 else ""
                h, t = (int(v) for v in w.src[bad[0]])
                return f"{rank}: output row {int(bad[0])} ({token_text(names, h, t)}) has the wrong {what}{more}"
    return None


def combine_shapes_difference(res, R: int, shape: tuple[int, int]) -> str | None:
    """Why the backend's combine results (one array per rank) are not R arrays of `shape`; None if they are."""
    if len(res) != R or any(np.asarray(r).shape != shape for r in res):
        return (f"returned combine results of shapes {[list(np.asarray(r).shape) for r in res]}, expected {R} x "
                f"{list(shape)}")
    return None


@dataclass
class CombineDifference:
    ok: bool
    error: str  # the error summary: largest error against the sums' magnitude, in bf16 ulp
    difference: str | None  # the first value outside the tolerance, in words (None where ok)


def combine_difference(got_all: np.ndarray, ref: np.ndarray, mag: np.ndarray, topk_idx: np.ndarray, topk: int,
                       rounding: float, names: list[str]) -> CombineDifference:
    """The stacked combine results `got_all` [R, T, hidden] against the oracle's sums `ref` and
    magnitudes `mag` (oracle.combine_oracle(return_abs=True)); `rounding`: the unit roundoff of
    partials the backend rounds on the way (oracle.compare_combine)."""
    chk = oracle.compare_combine(got_all, ref, mag, topk, rounding)
    rel_mag = np.abs(got_all.astype(np.float64) - ref) / np.where(mag > 0, mag, 1.0)
    err = f"max |error| {float(rel_mag.max()) if rel_mag.size else 0.0:.1e} of sum|w*y|, "
    err += f"max {chk.max_ulp} bf16 ulp" if chk.max_ulp <= oracle.MAX_ULP else (
        f"{chk.beyond_ulp} of {ref.size} values beyond {oracle.MAX_ULP} bf16 ulp (sums that cancel: within the fp32 "
        f"reordering bound" + (", plus one bf16 rounding of the partials that crossed an RDMA link)" if rounding else ")"))
    if chk.ok:
        return CombineDifference(True, err, None)
    h, t, ch = chk.first_bad
    experts = [int(e) for e in topk_idx[h, t] if e >= 0]
    return CombineDifference(False, err, f"{token_text(names, h, t)} (experts {experts}), channel {ch}: got "
                                         f"{chk.got:.6g}, expected {chk.want:.6g}")
