"""runtime/layout/capacity.py: the rows a buffer can hold bound every routing's layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from epcc.runtime.engines.cuda_table.tables import combine_rows
from epcc.runtime.layout import compute_layout
from epcc.runtime.layout.capacity import capacity_rows, staging_paths
from epcc.runtime.testing import inputs
from epcc.sim.build import build_plan

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = sorted(p.name for p in (REPO / "schedules").glob("*.sched"))


def _rows(layout, program: str, buffer: str, rank: int) -> int:
    if program == "dispatch":
        return layout.rank_tokens(rank) if buffer == "input" else layout.buffer_rows(buffer, rank)
    return combine_rows(layout, buffer, rank)


@pytest.mark.parametrize("name", SCHEDULES)
def test_capacity_bounds_every_routing_and_names_every_buffer(name):
    plan = build_plan(str(REPO / "schedules" / name)).plan
    wl, R, T = plan.workload, plan.num_ranks, 6
    cap = capacity_rows(plan, T)
    rng = np.random.default_rng(len(name))
    specs = ["uniform", "one-hot", "empty", "no-remote"]
    for i, spec in enumerate(specs):
        idx = inputs.make_topk(spec, R, T, wl.topk, wl.experts, wl.placement, seed=i).topk_idx
        tokens = rng.integers(0, T + 1, R)
        layout = compute_layout(plan, idx, None, tokens)
        for (b, r) in layout.entries:
            assert ("dispatch", b, r) in cap
            assert _rows(layout, "dispatch", b, r) <= cap[("dispatch", b, r)], (spec, b, r)
        for (b, r) in layout.combine_entries:
            assert _rows(layout, "combine", b, r) <= cap[("combine", b, r)], (spec, b, r)


def test_every_path_of_a_relay_is_counted():
    """h200x4_2vnode: a rank's rdma_recv holds its rail peer's tokens (one path); a token that hits
    every rank fills every path, so the bound is reached."""
    plan = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched")).plan
    paths = staging_paths(plan)
    assert {r: paths[("rdma_recv", r)] for r in range(4)} == {0: 1, 1: 1, 2: 1, 3: 1}
    wl, T = plan.workload, 3
    idx = np.array([[[0, 64, 128, 192, -1, -1, -1, -1]] * T] * 4)  # experts on all four ranks
    layout = compute_layout(plan, idx)
    cap = capacity_rows(plan, T)
    assert all(layout.buffer_rows("rdma_recv", r) == cap[("dispatch", "rdma_recv", r)] == T for r in range(4))
