"""The token-major oracle (DeepEP V1 intranode layout) against a brute-force definition written
loop by loop, its combine as the adjoint of its dispatch, and how `epcc run`'s check words a
token-major layout that differs from it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import check, oracle

from rt_helpers import REPO, compile_plan, make_inputs

# 2 ranks, 2 tokens each, top-2 of 4 experts (as test_rt_oracle.py).  Rank 1's second token has an empty slot.
TOPK = np.array([[[0, 3], [1, 2]],
                 [[2, 0], [3, -1]]])
W = np.array([[[0.25, 0.75], [0.5, 0.5]],
              [[0.125, 0.875], [1.0, 0.0]]], dtype=np.float32)


def test_token_major_dispatch_by_hand():
    x = np.arange(2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 3)
    got = oracle.token_dispatch_oracle(TOPK, 4, "blocked", x, W)
    # rank 0 holds experts 0, 1: tokens (0,0) via 0, (0,1) via 1, (1,0) via 0; never (1,1)
    assert got[0].src.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert got[0].topk_idx.tolist() == [[0, -1], [1, -1], [-1, 0]]
    assert got[0].topk_weights.tolist() == [[0.25, 0.0], [0.5, 0.0], [0.0, 0.875]]
    assert got[0].counts.tolist() == [2, 1]
    assert got[0].rows.tolist() == [x[0, 0].tolist(), x[0, 1].tolist(), x[1, 0].tolist()]
    # rank 1 holds 2, 3: all four tokens ((0,1) via 2, (1,1) via 3)
    assert got[1].src.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert got[1].topk_idx.tolist() == [[-1, 1], [-1, 0], [0, -1], [1, -1]]
    assert got[1].counts.tolist() == [2, 2]


def test_token_major_combine_by_hand():
    disp = oracle.token_dispatch_oracle(TOPK, 4, "blocked", np.zeros((2, 2, 1), np.uint8), W)
    y = [np.array([[10 * d + i, 1.0] for i in range(len(r.src))], np.float32) for d, r in enumerate(disp)]
    out = oracle.token_combine_oracle(TOPK, 4, "blocked", y)
    # token (h, t) sums its row on every rank it reached, unweighted
    assert out[0, 0].tolist() == [0 + 10, 2.0]
    assert out[0, 1].tolist() == [1 + 11, 2.0]
    assert out[1, 0].tolist() == [2 + 12, 2.0]
    assert out[1, 1].tolist() == [13, 1.0]


def brute_force(topk, E, placement, x, w):
    """The definition, token by token: rank d receives (h, t) once if any of its experts is on d."""
    R, T, k = topk.shape
    epr = E // R
    rank_of = (lambda e: e // epr) if placement == "blocked" else (lambda e: e % R)
    local_of = (lambda e: e % epr) if placement == "blocked" else (lambda e: e // R)
    out = []
    for d in range(R):
        src, rows, idx, wts, counts = [], [], [], [], [0] * epr
        for h in range(R):
            for t in range(T):
                mine = [j for j in range(k) if topk[h, t, j] >= 0 and rank_of(int(topk[h, t, j])) == d]
                if not mine:
                    continue
                src.append([h, t])
                rows.append(x[h, t].tolist())
                idx.append([local_of(int(topk[h, t, j])) if j in mine else -1 for j in range(k)])
                wts.append([float(w[h, t, j]) if j in mine else 0.0 for j in range(k)])
                for j in mine:
                    counts[local_of(int(topk[h, t, j]))] += 1
        out.append((src, rows, idx, wts, counts))
    return out


@st.composite
def routings(draw):
    R = draw(st.integers(1, 5))
    epr = draw(st.integers(1, 3))
    E = R * epr
    k = draw(st.integers(1, min(4, E)))
    T = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.permutation(E)[:k] for _ in range(R * T)]).reshape(R, T, k) if T else \
        np.zeros((R, 0, k), np.int64)
    topk = np.where(rng.random(topk.shape) < draw(st.sampled_from([0.0, 0.3])), -1, topk).astype(np.int64)
    w = rng.random(topk.shape).astype(np.float32)
    x = rng.integers(0, 256, size=(R, T, 3), dtype=np.uint8)
    return topk, E, draw(st.sampled_from(["blocked", "strided"])), x, w, seed


@settings(max_examples=150, deadline=None)
@given(routings())
def test_token_major_dispatch_equals_the_brute_force_definition(case):
    topk, E, placement, x, w, _ = case
    got = oracle.token_dispatch_oracle(topk, E, placement, x, w)
    for d, (src, rows, idx, wts, counts) in enumerate(brute_force(topk, E, placement, x, w)):
        assert got[d].src.tolist() == src
        assert got[d].rows.tolist() == rows
        assert got[d].topk_idx.tolist() == idx
        assert got[d].topk_weights.tolist() == wts
        assert got[d].counts.tolist() == counts


@settings(max_examples=150, deadline=None)
@given(routings())
def test_token_major_against_expert_major(case):
    """The same tokens reach the same ranks as in the expert-major layout, once each, with the same
    rows per local expert."""
    topk, E, placement, x, w, _ = case
    tok = oracle.token_dispatch_oracle(topk, E, placement, x, w)
    exp = oracle.dispatch_oracle(topk, E, placement, x, w)
    for t, e in zip(tok, exp):
        assert t.src.tolist() == np.unique(e.src[:, :2], axis=0).tolist()
        assert t.counts.tolist() == e.counts.tolist()
        assert int((t.topk_idx >= 0).sum()) == e.src.shape[0]


@settings(max_examples=150, deadline=None)
@given(routings())
def test_token_major_combine_is_the_adjoint_of_dispatch(case):
    """<dispatch(x), y> == <x, combine(y)> for real x and y (float64 sums of exact fp32 values),
    and combine equals the brute-force sum of a token's rows."""
    topk, E, placement, _, w, seed = case
    R, T, _ = topk.shape
    rng = np.random.default_rng(seed + 1)
    xs = rng.integers(-8, 8, size=(R, T, 2)).astype(np.float32)
    order = oracle.token_recv_order(topk, E, placement)
    y = [rng.integers(-8, 8, size=(len(src), 2)).astype(np.float32) for src in order]
    out = oracle.token_combine_oracle(topk, E, placement, y, 2)
    lhs = sum(float((xs[src[:, 0], src[:, 1]] * yd).sum()) for src, yd in zip(order, y))
    assert lhs == float((xs * out).sum())
    want = np.zeros((R, T, 2), np.float64)
    for src, yd in zip(order, y):
        for (h, t), row in zip(src.tolist(), yd):
            want[h, t] += row
    assert np.array_equal(out, want)


def test_a_token_major_layout_that_differs_is_worded():
    """check.token_dispatch_difference names the rank and the token (epcc run's message)."""
    plan = compile_plan(REPO / "schedules" / "h200x4.sched", tokens=8, hidden=128)
    plan.workload.layout = "token"
    topk, w, x = make_inputs(plan, seed=3)
    lay = compute_layout(plan, topk, w)
    want = oracle.token_dispatch_oracle(topk, plan.workload.experts, plan.workload.placement, x, w)
    names = [f"rank {r}" for r in range(4)]
    rows = [v.rows for v in want]
    assert check.token_dispatch_difference(lay, rows, want, names) is None
    lay.entries[("output", 1)] = lay.entries[("output", 1)][1:]
    h, t = want[1].src[0].tolist()
    assert check.token_dispatch_difference(lay, rows, want, names) == f"rank 1 never receives token {t} of rank {h}"
    lay = compute_layout(plan, topk, w)
    lay.recv_topk_idx[2][0] = -1
    h, t = want[2].src[0].tolist()
    assert check.token_dispatch_difference(lay, rows, want, names) == \
        f"rank 2: output row 0 (token {t} of rank {h}) has the wrong top-k experts"
    lay = compute_layout(plan, topk, w)
    bad = [r.copy() for r in rows]
    bad[0][1, 0] ^= 1
    h, t = want[0].src[1].tolist()
    assert check.token_dispatch_difference(lay, bad, want, names) == \
        f"rank 0: output row 1 (token {t} of rank {h}) has the wrong payload"
