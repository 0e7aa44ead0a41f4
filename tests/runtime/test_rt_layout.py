"""compute_layout implements docs/runtime.md: for every shipped schedule and routing, the NumPy
reference executor of the layout equals the oracle; chunks, flags and waits are well formed,
sufficient (a random chunk order that respects only the waits gives the same result) and
minimal; written-out combines; input validation; broken schedules and plans are caught."""

from __future__ import annotations

import numpy as np
import pytest

from epcc.diagnostics import CompileError
from epcc.runtime.testing import reference
from epcc.runtime.layout import LayoutError, compute_layout

from rt_helpers import (REPO, ROUTINGS, SCHEDULES, check_against_oracle, check_invariants, compile_plan,
                        compile_text, make_inputs, set_chunk_tokens)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_every_routing(name):
    plan = compile_plan(REPO / "schedules" / name)
    for routing in ROUTINGS:
        topk, w, x = make_inputs(plan, routing)
        lay = check_against_oracle(plan, topk, w, x)
        if routing == "uniform":
            check_invariants(plan, lay)
    if name == "nvl8_hybrid.sched":
        assert plan.workload.dtype == "fp8" and lay.row_bytes == 256 + 2 * 4


def test_fp8_variant_of_a_relay_schedule(tmp_path):
    text = (REPO / "schedules" / "h200x4_2vnode.sched").read_text().replace("dtype bf16", "dtype fp8")
    plan = compile_text(text, tmp_path)
    assert plan.workload.dtype == "fp8"
    for routing in ("uniform", "one-hot"):
        topk, w, x = make_inputs(plan, routing)
        assert x.shape[2] == 256 + 8
        check_against_oracle(plan, topk, w, x)


@pytest.mark.parametrize("name", ["h200x4_2vnode.sched", "ocs_ep16.sched", "ubbv2_ep16.sched", "dgx_h800_2node.sched"])
def test_small_chunks_random_order_respecting_only_the_waits(name):
    plan = compile_plan(REPO / "schedules" / name, tokens=24)
    set_chunk_tokens(plan, 5)
    for seed, routing in enumerate(("uniform", "zipf:1.2")):
        topk, w, x = make_inputs(plan, routing, seed=seed)
        lay = compute_layout(plan, topk, w)
        check_invariants(plan, lay)
        assert max(f.chunks for f in lay.flags) > 1
        assert any(len(ws) > 1 for c in lay.copies for ws in c.waits)  # several producers per chunk somewhere
        check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)


def test_chunk_sizes_follow_the_plan():
    plan = compile_plan(REPO / "schedules" / "h200x4.sched", tokens=40)
    set_chunk_tokens(plan, 7)
    topk, w, x = make_inputs(plan)
    lay = compute_layout(plan, topk, w)
    for c in lay.copies:
        tok = np.r_[True, c.src_slots[1:] != c.src_slots[:-1]] if c.program == "dispatch" else \
            np.r_[True, c.dst_slots[1:] != c.dst_slots[:-1]]
        per_chunk = [int(tok[a:b].sum()) for a, b in zip(c.chunk_starts[:-1], c.chunk_starts[1:])]
        assert all(n == 7 for n in per_chunk[:-1]) and 1 <= per_chunk[-1] <= 7 if per_chunk else True
    # one chunk per copy when the chunk is larger than anything a flow moves
    plan = compile_plan(REPO / "schedules" / "h200x4.sched", tokens=40)
    lay = compute_layout(plan, topk, w)
    assert all(f.chunks <= 1 for f in lay.flags)


def test_a_missing_wait_is_caught_by_the_chunked_executor():
    plan = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched", tokens=24)
    set_chunk_tokens(plan, 4)
    topk, w, x = make_inputs(plan)
    lay = compute_layout(plan, topk, w)
    for program in ("dispatch", "combine"):
        victim = next(c for c in lay.program_copies(program) if any(c.waits))
        saved = victim.waits
        victim.waits = [[] for _ in saved]
        caught = 0
        for seed in range(8):
            try:
                check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)
            except reference.WaitError:
                caught += 1
        assert caught, program
        victim.waits = saved
    check_against_oracle(plan, topk, w, x, chunked=True, layout=lay)


def test_layout_structure_h200x4_2vnode():
    plan = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched", tokens=32)
    topk, w, x = make_inputs(plan)
    lay = compute_layout(plan, topk, w)
    R, T = 4, 32
    for h in range(R):
        assert lay.entries[("input", h)].tolist() == [[h, t] for t in range(T)]
        # rdma_recv on rank h holds the tokens of its rail peer (h + 2) % 4 that hit h's vnode
        e = lay.entries[("rdma_recv", h)]
        src = (h + 2) % 4
        hits = (topk[src] // 64 // 2 == h // 2).any(-1)
        assert e.tolist() == [[src, t] for t in np.flatnonzero(hits)]
        out = lay.entries[("output", h)]
        assert out.shape[1] == 3 and (out[:, 2] // 64 == h).all()
        key = (out[:, 2] % 64) * R * T + out[:, 0] * T + out[:, 1]
        assert (np.diff(key) > 0).all()  # expert-major, then home, then token; no duplicates
        assert lay.recv_counts[h].sum() == out.shape[0]
        assert lay.combine_entries[("result", h)] is lay.entries[("input", h)]
    assert lay.partial_of == {"result": "input", "output": "output", "rdma_recv": "rdma_recv"}
    dispatch = lay.program_copies("dispatch")
    assert [(c.step, c.step_index) for c in dispatch[:4]] == [("rdma", 1)] * 4
    combine = lay.program_copies("combine")
    assert {c.step for c in combine if c.weights is not None} == {"keep_far", "fwd", "keep", "intra"}
    # the reverse of rdma waits for everything fwd and keep_far accumulate into rdma_recv
    rev = [c for c in combine if c.step == "rdma"]
    for c in rev:
        producers = {lay.copies[p].step for ws in c.waits for p, _ in ws}
        assert producers <= {"fwd", "keep_far"} and (producers or c.src_slots.size == 0)
        assert c.src_buffers == ["rdma_recv"] * c.src_slots.size and c.dst_buffer == "result"


def test_dead_copies_return_nothing():
    """ocs_ep16 pulls ALL of a mate's tokens; the reverse returns only those that delivered."""
    plan = compile_plan(REPO / "schedules" / "ocs_ep16.sched", tokens=32)
    topk, w, x = make_inputs(plan, "one-hot")
    lay = compute_layout(plan, topk, w)
    pulled = sum(c.src_slots.size for c in lay.program_copies("dispatch") if c.step == "pull_m1")
    returned = sum(c.src_slots.size for c in lay.program_copies("combine") if c.step == "pull_m1")
    assert pulled == 16 * 32 and 0 < returned < pulled


def test_empty_slots_and_no_tokens():
    plan = compile_plan(REPO / "schedules" / "ubbv2_ep16.sched")
    topk, w, x = make_inputs(plan)
    topk = topk.copy()
    rng = np.random.default_rng(5)
    topk[rng.random(topk.shape) < 0.3] = -1
    topk[0, :5] = -1  # tokens routed nowhere
    topk, w, x = make_inputs(plan, topk_idx=topk)
    check_invariants(plan, check_against_oracle(plan, topk, w, x))
    empty = np.zeros((16, 0, plan.workload.topk), np.int64)
    lay = compute_layout(plan, empty, np.zeros(empty.shape, np.float32))
    assert lay.tokens == 0 and lay.recv_counts.sum() == 0 and all(f.chunks == 0 for f in lay.flags)
    assert all(c.waits == [] for c in lay.copies)


def test_no_weights_means_weight_one():
    plan = compile_plan(REPO / "schedules" / "h200x4.sched")
    topk, _, x = make_inputs(plan)
    lay = compute_layout(plan, topk)
    assert all((c.weights == 1).all() for c in lay.copies if c.weights is not None)
    check_against_oracle(plan, topk, np.ones(topk.shape, np.float32), x, layout=lay)


def test_input_validation_names_the_argument():
    plan = compile_plan(REPO / "schedules" / "h200x4.sched")
    topk, w, _ = make_inputs(plan)
    cases = [
        (topk.astype(np.float32), w, "topk_idx: expected integer"),
        (topk[0], w, "topk_idx: expected shape"),
        (topk[:2], w[:2], "topk_idx: has 2 ranks, the plan has 4"),
        (topk[..., :4], w[..., :4], "topk_idx: has 4 slots per token, the workload's topk is 8"),
        (np.where(topk == topk[0, 0, 0], 256, topk), w, "topk_idx: expert indices must lie in -1..255"),
        (np.concatenate([topk[..., :1], topk[..., :7]], axis=2), w, "topk_idx: token 0 of rank 0 lists the same"),
        (topk, w[..., :3], "weights: expected shape"),
        (topk, w.astype(np.int32), "weights: expected floating-point"),
        (topk, np.where(w > 0.5, np.nan, w).astype(np.float32), "weights: routing weights must be finite"),
    ]
    for t, ww, msg in cases:
        with pytest.raises(ValueError) as e:
            compute_layout(plan, t, ww)
        assert str(e.value).startswith(msg), str(e.value)


def test_malformed_plans_are_layout_errors():
    plan = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched")
    topk, w, _ = make_inputs(plan)
    bad = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched")
    next(s for s in bad.steps if s.program == "combine" and s.name == "fwd").reverse_of = "nope"
    with pytest.raises(LayoutError, match="reverses dispatch step 'nope'"):
        compute_layout(bad, topk, w)
    bad = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched")
    bad.step("rdma").flows[0].dst = 9
    with pytest.raises(LayoutError, match="outside 0..3"):
        compute_layout(bad, topk, w)
    bad = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched")
    bad.step("fwd", "combine").flows[0].src = 3  # reverses no dispatch flow: returns nothing
    lay = compute_layout(bad, topk, w)
    assert lay.program_copies("combine")[4].src_slots.size == 0
    with pytest.raises(AssertionError, match="combine differs"):
        check_against_oracle(bad, topk, w, make_inputs(bad)[2], layout=lay)


def test_a_dropped_forward_is_a_compile_error(tmp_path):
    text = (REPO / "schedules" / "h200x4_2vnode.sched").read_text()
    start = text.index('  step fwd "forward')
    end = text.index("  step keep_far")
    p = tmp_path / "broken.sched"
    p.write_text(text[:start] + text[end:], encoding="utf-8")
    with pytest.raises(CompileError) as e:
        compile_plan(p)
    assert "never reaches rank 3" in str(e.value)


def test_a_dropped_flow_in_the_plan_differs_from_the_oracle():
    plan = compile_plan(REPO / "schedules" / "h200x4_2vnode.sched")
    step = plan.step("fwd")
    step.flows = [f for f in step.flows if (f.src, f.dst) != (2, 3)]
    topk, w, x = make_inputs(plan)
    with pytest.raises(AssertionError, match="rank 3: output entries"):
        check_against_oracle(plan, topk, w, x)


# --------------------------------------------------------------------------- written-out combine

QUAD = """\
schedule quadc "4 GPUs, combine written out"
topology quad {
  levels node 1, gpu 4
  rank gpu
  relation peer = other gpu
  link nvlink p2p { connects peer  bandwidth 450 GB/s  latency 3 us }
  link hbm local { bandwidth 3000 GB/s }
}
workload { tokens 64 per rank  hidden 256  dtype bf16  topk 3  experts 8 PLACEMENT }
dispatch {
  step push: send tokens for peer from input to peer.output over nvlink chunk 5 tokens
  step keep: permute input into output chunk 5 tokens
}
"""

COMBINES = {
    "reduce-then-send": """
combine {
  buffer partial
  step red "weighted sum of my experts' outputs per token": reduce output into partial chunk 4 tokens
  step back "partial sums home": send tokens of peer from partial to peer.result over nvlink chunk 3 tokens
  step own: copy tokens of me from partial into result chunk 6 tokens
}
""",
    "pull-partials": """
combine {
  buffer partial
  step red: reduce output into partial chunk 4 tokens
  step own: reduce partial into result chunk 5 tokens
  step fetch: pull tokens of me from peer.partial into result over nvlink chunk 3 tokens
}
""",
}


@pytest.mark.parametrize("placement", ["blocked", "strided"])
@pytest.mark.parametrize("variant", sorted(COMBINES))
def test_written_combine(tmp_path, variant, placement):
    plan = compile_text(QUAD.replace("PLACEMENT", placement) + COMBINES[variant], tmp_path)
    comb = plan.program_steps("combine")
    assert all(s.reverse_of is None and s.src_buffers and s.dst_buffer for s in comb)
    for seed, routing in enumerate(ROUTINGS):
        topk, w, x = make_inputs(plan, routing, seed=seed)
        lay = check_against_oracle(plan, topk, w, x, seed=seed)
        check_invariants(plan, lay)
        check_against_oracle(plan, topk, w, x, seed=seed, chunked=True, layout=lay)
    assert {k[0] for k in lay.combine_entries} == {"partial", "result"}
    red = [c for c in lay.program_copies("combine") if c.step == "red"]
    assert all(c.weights is not None for c in red)
    assert all(c.weights is None for c in lay.program_copies("combine") if c.step != "red")
