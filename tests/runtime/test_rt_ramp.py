"""Ramped chunks (PlanStep.ramp_head / ramp_tail, plan.chunk_sizes): the cut of a copy is a
partition of its tokens whose ends shrink by halvings, and a layout cut that way still equals the
oracle, in the chunk order of the waits alone and on the CPU backend's threads."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epcc.plan import chunk_sizes, ramp_sizes
from epcc.runtime.layout import compute_layout

from rt_helpers import REPO, check_against_oracle, check_invariants, compile_plan, make_inputs, set_chunk_tokens


@settings(max_examples=400, deadline=None)
@given(tokens=st.integers(0, 5000), tpc=st.integers(1, 300), head=st.integers(0, 8), tail=st.integers(0, 8))
def test_chunk_sizes_partition_the_tokens(tokens, tpc, head, tail):
    sizes = chunk_sizes(tokens, tpc, head, tail)
    assert sum(sizes) == tokens and all(1 <= s <= tpc for s in sizes)
    uniform = chunk_sizes(tokens, tpc)
    assert uniform == [min(tpc, tokens - a) for a in range(0, tokens, tpc)]  # chunk c: tokens c*tpc onwards
    front, back = ramp_sizes(tpc, head), ramp_sizes(tpc, tail)[::-1]
    if sum(front) + sum(back) + tpc <= tokens:
        assert sizes[:len(front)] == front and sizes[len(sizes) - len(back):] == back
        assert front == sorted(front) and back == sorted(back, reverse=True)  # the head grows, the tail shrinks
        middle = sizes[len(front):len(sizes) - len(back)]
        assert middle and all(m == tpc for m in middle[:-1]) and 1 <= middle[-1] <= tpc  # whole chunks between
    else:
        assert sizes == uniform  # too short for both ends and a whole chunk: not ramped


def test_ramp_sizes_halve_towards_the_end():
    assert ramp_sizes(64, 3) == [8] * 8 + [16] * 4 + [32] * 2
    assert ramp_sizes(64, 0) == []
    assert ramp_sizes(2, 3) == [1, 1]  # no chunk below one token
    head = chunk_sizes(4082, 64, 3, 0)
    assert head[:15] == [8] * 8 + [16] * 4 + [32] * 2 + [64] and head[-1] == 4082 % 64
    tail = chunk_sizes(4082, 64, 0, 3)
    assert tail[-15:] == [4082 % 64] + [32] * 2 + [16] * 4 + [8] * 8 and tail[0] == 64
    assert len(chunk_sizes(4082, 64, 3, 3)) == 64 + 2 * 11  # each end: 14 chunks for 3 whole ones


def _ramp_every_step(plan, tokens_per_chunk: int, halvings: int) -> None:
    set_chunk_tokens(plan, tokens_per_chunk)
    for s in plan.steps:
        if s.verb != "exchange":
            s.ramp_head = s.ramp_tail = halvings


@pytest.mark.parametrize("name", ["h200x2_2vnode.sched", "h200x4_2vnode.sched", "ubbv2_ep16.sched",
                                  "dgx_h800_2node.sched"])
def test_ramped_layouts_equal_the_oracle_in_any_order_the_waits_allow(name):
    plan = compile_plan(REPO / "schedules" / name, tokens=96)
    _ramp_every_step(plan, 8, 2)
    for seed, routing in enumerate(("uniform", "zipf:1.2")):
        topk, w, x = make_inputs(plan, routing, seed=seed)
        lay = compute_layout(plan, topk, w)
        check_invariants(plan, lay)
        ramped = 0
        for c in lay.copies:
            slots = c.src_slots if c.program == "dispatch" else c.dst_slots
            first = np.r_[True, slots[1:] != slots[:-1]]  # a token's rows are consecutive
            per_chunk = [int(first[a:b].sum()) for a, b in zip(c.chunk_starts[:-1], c.chunk_starts[1:])]
            assert per_chunk == chunk_sizes(int(first.sum()), 8, 2, 2)
            ramped += per_chunk != chunk_sizes(int(first.sum()), 8)
        assert ramped, "no copy long enough to ramp"
        check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)


def test_ramped_layout_on_the_cpu_backend():
    plan = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched", tokens=80)
    _ramp_every_step(plan, 8, 3)
    topk, w, x = make_inputs(plan, "uniform")
    check_against_oracle(plan, topk, w, x, backend="cpu")
