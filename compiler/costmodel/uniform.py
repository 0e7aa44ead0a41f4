"""Uniform top-k routing in expectation: how many ranks and expert rows a token reaches."""

from __future__ import annotations

from math import comb

from ..plan import Plan


def hit_probability(experts: int, topk: int, n_experts: int) -> float:
    """P(a token's top-k hits at least one of n given experts) under uniform top-k routing:
    exactly 1 - C(E - n, k) / C(E, k)."""
    n = max(0, min(n_experts, experts))
    return 1.0 - comb(experts - n, topk) / comb(experts, topk)


def rows_per_token(plan: Plan) -> float:
    """Expected expert rows of one token on a rank it hits (uniform routing; 1 without a workload)."""
    wl = plan.workload
    if wl is None or plan.num_ranks <= 0 or wl.experts <= 0:
        return 1.0
    per = wl.experts // plan.num_ranks
    return max(1.0, wl.topk * per / wl.experts / max(1e-12, hit_probability(wl.experts, wl.topk, per)))


def ranks_per_token(plan: Plan) -> float:
    """Expected GPUs one token's top-k hits (uniform routing; 1 without a workload)."""
    wl = plan.workload
    if wl is None or plan.num_ranks <= 0 or wl.experts <= 0:
        return 1.0
    return max(1.0, plan.num_ranks * hit_probability(wl.experts, wl.topk, wl.experts // plan.num_ranks))
