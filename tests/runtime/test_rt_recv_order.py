"""Property: the oracle's receive order (recv_order, and rank_recv_order for one rank) equals the
documented order computed the plain way, one (home, token, slot) at a time, on random routings
with empty (-1) slots, tokens with no expert, uneven token counts and both expert placements."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epcc.runtime.routing import expert_rank
from epcc.runtime.testing import oracle


def plain_recv_order(topk: np.ndarray, experts: int, placement: str) -> list[tuple[list, list]]:
    """Per destination rank: every (home, token, expert) with the expert there and its slot, sorted
    by (local expert, home, token)."""
    R, T, k = topk.shape
    rank_of, local_of = expert_rank(experts, R, placement)
    rows = [[] for _ in range(R)]
    for h in range(R):
        for t in range(T):
            for j in range(k):
                e = int(topk[h, t, j])
                if e >= 0:
                    rows[int(rank_of[e])].append((int(local_of[e]), h, t, e, j))
    return [([[h, t, e] for _, h, t, e, _ in sorted(r)], [j for *_, j in sorted(r)]) for r in rows]


@st.composite
def routings(draw):
    R = draw(st.integers(1, 5))
    epr = draw(st.integers(1, 6))
    E = R * epr
    T = draw(st.integers(0, 12))
    k = draw(st.integers(1, min(E, 6)))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    topk = np.argsort(rng.random((R, T, E)), axis=2)[:, :, :k]  # k distinct experts per token
    topk[rng.random(topk.shape) < draw(st.sampled_from([0.0, 0.3, 0.9]))] = -1  # empty slots
    if T:
        topk[:, rng.integers(0, T)] = -1  # a token of no expert on every rank
    for h in range(R):  # uneven token counts: a rank's tokens past its count route nowhere
        topk[h, draw(st.integers(0, T)):] = -1
    return topk, E, draw(st.sampled_from(["blocked", "strided"]))


@settings(max_examples=300, deadline=None)
@given(routings())
def test_recv_order_is_the_documented_order(case):
    topk, E, placement = case
    want = plain_recv_order(topk, E, placement)
    got = oracle.recv_order(topk, E, placement)
    assert len(got) == len(want)
    for d, ((src, j), (wsrc, wj)) in enumerate(zip(got, want)):
        assert src.dtype == np.int64 and j.dtype == np.int64 and src.shape == (len(wsrc), 3)
        assert src.tolist() == wsrc and j.tolist() == wj
        one = oracle.rank_recv_order(topk, E, placement, d)
        assert one[0].tolist() == wsrc and one[1].tolist() == wj


def test_rank_recv_order_names_a_rank_out_of_range():
    topk = np.zeros((2, 1, 1), np.int64)
    with pytest.raises(ValueError, match="rank: expected 0..1, got 2"):
        oracle.rank_recv_order(topk, 4, "blocked", 2)
