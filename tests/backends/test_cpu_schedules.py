"""Every schedule in schedules/, scaled down (32 tokens per rank), compiled to its final plan, laid
out by runtime/layout and run on the cpu engine: dispatch must equal runtime/testing/oracle.py bit
for bit, combine must agree with it in fp32 (oracle.compare_combine's tolerance)."""

from __future__ import annotations

import functools
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from epcc import pipeline
from epcc.passes import PassOptions
from epcc.plan import Plan
from epcc.runtime.engines.cpu import threads
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs, oracle

SCHEDULES = sorted((Path(__file__).resolve().parents[2] / "schedules").glob("*.sched"))
TOKENS = 32


@functools.lru_cache(maxsize=None)
def _compiled(path: str, hidden: int | None):
    c = pipeline.run(path, pipeline.STAGES[-1].name, options=PassOptions(tokens=TOKENS, hidden=hidden))
    return c.passes.get("plan").to_json()


def plan_of(path: Path, hidden: int | None = None, tokens_per_chunk: int | None = None):
    plan = Plan.from_json(_compiled(str(path), hidden))  # a fresh copy: tests may edit it
    if tokens_per_chunk is not None:
        for s in plan.steps:
            if s.verb != "exchange":
                per_token = plan.bytes_per_token if s.program == "dispatch" else 2 * plan.workload.hidden
                s.chunk_bytes = float(tokens_per_chunk * per_token)
    return plan


def run_and_check(plan, routing_spec: str = "uniform", seed: int = 0):
    wl, R = plan.workload, plan.num_ranks
    routing = inputs.make_topk(routing_spec, R, TOKENS, wl.topk, wl.experts, wl.placement, seed)
    weights = inputs.make_weights(routing.topk_idx, seed)
    x = inputs.make_x_rows(R, TOKENS, wl.hidden, wl.dtype, seed)
    layout = compute_layout(plan, routing.topk_idx, weights)
    got = threads.run_dispatch(plan, layout, [x[r] for r in range(R)])
    want = oracle.dispatch_oracle(routing.topk_idx, wl.experts, wl.placement, x, weights)
    assert len(got) == R
    for r in range(R):
        assert got[r].dtype == np.uint8 and got[r].shape == want[r].rows.shape, r
        assert np.array_equal(got[r], want[r].rows), f"dispatch differs on {plan.rank_names[r]}"
    y = inputs.make_expert_outputs([w.rows.shape[0] for w in want], wl.hidden, seed)
    res = threads.run_combine(plan, layout, y)
    ref, mag = oracle.combine_oracle(routing.topk_idx, wl.experts, wl.placement, weights, y, wl.hidden,
                                     return_abs=True)
    assert len(res) == R and all(r.shape == (TOKENS, wl.hidden) and r.dtype == np.float32 for r in res)
    chk = oracle.compare_combine(np.stack(res), ref, mag, wl.topk)
    assert chk.ok, f"combine differs at {chk.first_bad}: got {chk.got}, expected {chk.want}"
    return layout


@pytest.mark.parametrize("path", SCHEDULES, ids=[p.stem for p in SCHEDULES])
def test_schedule_matches_oracle(path):
    """The workload's own hidden size (7168): the real row sizes."""
    plan = plan_of(path)
    assert plan.workload.hidden == 7168
    layout = run_and_check(plan)
    # Every role of the plan that has copies ran as a driver of its own.
    roles = {(k.program, r.step) for k in plan.kernels for r in k.roles}
    assert {(c.program, c.step) for c in layout.copies} <= roles


@pytest.mark.parametrize("path", SCHEDULES, ids=[p.stem for p in SCHEDULES])
def test_schedule_fine_chunks_skewed_routing(path):
    """Chunks of 2 tokens (so consumers wait on producers chunk by chunk, hundreds of waits)
    and a skewed routing, at hidden 256."""
    plan = plan_of(path, hidden=256, tokens_per_chunk=2)
    layout = run_and_check(plan, "zipf:1.2", seed=3)
    assert max(len(c.chunk_starts) - 1 for c in layout.copies) > 1


def test_ranks_as_separate_executors():
    """As runtime/buffer.py does (one process per rank): every rank calls execute() for its own
    roles only, concurrently, over shared memory."""
    path = next(p for p in SCHEDULES if p.stem == "h200x4_2vnode")
    plan = plan_of(path, hidden=256, tokens_per_chunk=4)
    wl, R = plan.workload, plan.num_ranks
    routing = inputs.make_topk("uniform", R, TOKENS, wl.topk, wl.experts, wl.placement, 1)
    weights = inputs.make_weights(routing.topk_idx, 1)
    x = inputs.make_x_rows(R, TOKENS, wl.hidden, wl.dtype, 1)
    layout = compute_layout(plan, routing.topk_idx, weights)
    mem = threads.HostMemory(layout, "dispatch")
    for r in range(R):
        mem.set_buffer("input", r, x[r])
    errors = []

    def rank_main(r):
        try:
            threads.execute(plan, layout, "dispatch", mem, ranks=[r], timeout_s=10.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(R)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    want = oracle.dispatch_oracle(routing.topk_idx, wl.experts, wl.placement, x, weights)
    for r in range(R):
        assert np.array_equal(mem.buffer("dispatch", "output", r), want[r].rows)


def test_missing_producer_is_reported_where_it_is_waited_for():
    """Drop every copy of ubbv2_ep16's fwd1 from the layout: the run stops after the timeout and
    names a wait on a fwd1 counter (the root of the stuck chain), not a wait on a stuck consumer."""
    path = next(p for p in SCHEDULES if p.stem == "ubbv2_ep16")
    plan = plan_of(path, hidden=256)
    wl, R = plan.workload, plan.num_ranks
    routing = inputs.make_topk("uniform", R, TOKENS, wl.topk, wl.experts, wl.placement, 0)
    layout = compute_layout(plan, routing.topk_idx, inputs.make_weights(routing.topk_idx, 0))
    layout.copies = [c for c in layout.copies if not (c.program == "dispatch" and c.step == "fwd1")]
    x = inputs.make_x_rows(R, TOKENS, wl.hidden, wl.dtype, 0)
    with pytest.raises(threads.CpuBackendTimeout) as ei:
        threads.run_dispatch(plan, layout, [x[r] for r in range(R)], timeout_s=0.3)
    msg = str(ei.value)
    assert re.fullmatch(r"epcc: wait timed out after 0\.300 s: rank \d+ \(node 0, card \d, die \d\) step '\w+' "
                        r"flag 'dispatch\.fwd1\[flow \d+\]\.ready' \(value 0, waiting for >= 1\)", msg), msg
    assert ei.value.step in ("fwd3", "d2d_far", "final")
    assert msg.split(": ")[2].startswith(plan.rank_names[ei.value.rank])
