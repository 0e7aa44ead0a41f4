"""derive-combine: `combine reverse of dispatch` as the adjoint of dispatch, verified and planned.

Every shipped schedule gets a derived combine that verifies (IR and exactly-once), whose steps
reverse dispatch's (direction, dependencies, resources), whose volumes match dispatch's where
they must, and whose weights are applied once per delivery.  A broken derivation (an op missing,
ops out of order, an op twice) is caught by the combine verification.  EP256 compiles in seconds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import pytest
from mlir import ir

from epcc import pipeline
from epcc.analysis.combine_flow import AdjointCombine, derive_ops
from epcc.analysis.exactly_once import ExactlyOnce
from epcc.dialect import new_context
from epcc.diagnostics import CompileError
from epcc.ir import ops as irops
from epcc.ir import query
from epcc.ir.emit import print_module
from epcc.passes.derive_combine import verify_adjoint
from epcc.passes.route_analysis import link_resources

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "schedules").glob("*.sched"))


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)


def compile_to(path, until: str = "derive-combine"):
    """The pipeline up to `until` (each pass's IR verified); returns (compilation, pass context)."""
    c = pipeline.run(str(path), until)
    return c, c.passes


def step_ops(module: ir.Module, kind: str) -> list[ir.Operation]:
    prog = query.program_module(module.operation, kind)
    return [op.operation for op in query.body(prog).operations if op.operation.name in irops.STEP_OPS]


def buffer_names(module: ir.Module, kind: str) -> list[str]:
    prog = query.program_module(module.operation, kind)
    return [op.operation.attributes["sym_name"].value for op in query.body(prog).operations
            if op.operation.name == irops.BUFFER]


def attr(op: ir.Operation, name: str):
    a = op.attributes[name]
    return a.value if hasattr(a, "value") else [x.value for x in a]


# ---------------------------------------------------------------------------- shipped schedules


@pytest.mark.parametrize("rel", SCHEDULES)
def test_shipped_schedule_gets_a_verified_combine(rel):
    c, ctx = compile_to(rel)
    sched = c.schedule
    adj = ctx.results["combine"]
    plan = ctx.results["plan"]
    assert adj.kind == "derived" and not adj.problems and adj.inexact == 0
    assert ctx.results["verification"]["combine_ok"]
    cops = adj.ops
    n = sched.topology.num_ranks
    comb = query.program_module(c.module.operation, "combine")
    assert comb.attributes[irops.DERIVED_FROM_ATTR].value == "dispatch"
    assert comb.attributes["epcc.verified"].value.startswith(f"exactly-once: {n} homes x {n} contributing ranks")
    # One op per (dispatch data step, source buffer), in reverse dispatch order.
    data = [s for s in sched.dispatch.steps if s.verb != "exchange"]
    assert [o.reverse_of for o in cops] == [s.name for s in reversed(data) for _ in s.sources]
    ir_ops = step_ops(c.module, "combine")
    assert [attr(o, "step") for o in ir_ops] == [o.name for o in cops]
    for o, cop in zip(ir_ops, cops):
        assert attr(o, "epcc.reverse_of") == cop.reverse_of
        assert attr(o, "epcc.reverse_source") == cop.source
        # located at the dispatch step it reverses
        loc = o.location
        while loc.is_a_name():
            loc = loc.child_loc
        assert loc.is_a_file() and loc.start_line == cop.step.span.line
        # one event operand per dependency
        assert sum(str(v.type) == irops.EVENT_TYPE for v in o.operands) == len(cop.deps)
    staging = [b for b, info in sched.dispatch.buffers.items() if info.role == "staging"]
    assert buffer_names(c.module, "combine") == ["output", "result"] + staging
    # The Plan: one combine step per op, reverse_of set, deps as derived.
    csteps = plan.program_steps("combine")
    assert [(s.name, s.reverse_of, s.deps) for s in csteps] == [(o.name, o.reverse_of, o.deps) for o in cops]
    # Dependencies point backwards only.
    seen: set[str] = set()
    for s in csteps:
        assert set(s.deps) <= seen
        seen.add(s.name)


@pytest.mark.parametrize("rel", SCHEDULES)
def test_derived_ir_round_trips(rel):
    c, _ = compile_to(rel)
    text = print_module(c.module)
    with new_context():
        again = ir.Module.parse(text)
        again.operation.verify()
        assert print_module(again) == text


@pytest.mark.parametrize("rel", SCHEDULES)
def test_weights_applied_once_per_delivery(rel):
    c, ctx = compile_to(rel)
    flow = ctx.results["flow"]
    adj = ctx.results["combine"]
    disp = c.schedule.dispatch
    weighted = defaultdict(int)  # (dispatch step, source buffer) -> weighted ops
    for o in adj.ops:
        if o.weighted:
            weighted[(o.reverse_of, o.source)] += 1
    deliveries = 0
    for d in range(flow.n):
        for s in flow.deliveries[d]:
            deliveries += 1
            step = s.path[-1][0]
            came_from = disp.step(s.path[-2][0]).dest.buffer.name if len(s.path) > 1 else "input"
            assert weighted[(step, came_from)] == 1, (s.home, s.path)
    # ... and the adjoint run applied each delivery's weights exactly once.
    assert len(adj.weights_applied) == deliveries
    assert set(adj.weights_applied.values()) == {1}
    # Weighted ops are exactly the reverses of the writes into output.
    ir_weighted = [attr(o, "step") for o in step_ops(c.module, "combine") if "epcc.weighted" in o.attributes]
    assert ir_weighted == [o.name for o in adj.ops if o.weighted]
    assert {o.reverse_of for o in adj.ops if o.weighted} == {
        s.name for s in disp.steps if s.dest is not None and s.dest.buffer.role == "sink"}


# ---------------------------------------------------------------------------- h200x4 in detail


def test_h200x4_combine_volume_equals_dispatch():
    c, ctx = compile_to("schedules/h200x4.sched")
    flow, adj, plan = ctx.results["flow"], ctx.results["combine"], ctx.results["plan"]
    wl = c.schedule.workload
    # One hop: every returned partial is one token copy (a row, for the permute's reduce).
    d_copies = sum(sum(v.copies) for v in flow.volumes.values() if v.step.verb != "exchange")
    c_copies = sum(sum(v.copies) for v in adj.volumes.values())
    assert c_copies == pytest.approx(d_copies, rel=1e-12)
    for name in ("push", "keep"):
        d = plan.step(name, "dispatch").total_bytes
        cb = plan.step(name, "combine").total_bytes
        assert cb == pytest.approx(d / wl.bytes_per_token * wl.combine_bytes_per_token, rel=1e-12)
    assert sum(s.total_bytes for s in plan.program_steps("combine")) == pytest.approx(
        d_copies * wl.combine_bytes_per_token, rel=1e-12)


def test_h200x4_reverse_transfer_shape():
    c, ctx = compile_to("schedules/h200x4.sched")
    plan = ctx.results["plan"]
    space = c.schedule.topology.space
    link = c.schedule.topology.links["nvlink"]
    keep, push = step_ops(c.module, "combine")
    assert (keep.name, push.name) == (irops.REDUCE, irops.TRANSFER)
    # dispatch `send ... to peer.output` (push) -> combine pull from peer.output, weights fused
    assert attr(push, "direction") == "pull" and attr(push, "relation") == "peer"
    assert attr(push, "src_relations") == ["peer"]
    assert push.attributes["epcc.weighted"].value is True
    sel = push.operands[2].owner
    assert sel.name == irops.SELECT and attr(sel, "mode") == "all"
    # flows: every dispatch flow reversed, same executing rank, resources named the same way
    dflows = {(f.rank, f.src, f.dst) for f in plan.step("push", "dispatch").flows}
    cflows = plan.step("push", "combine").flows
    assert {(f.rank, f.dst, f.src) for f in cflows} == dflows
    for f in cflows:
        assert f.resources == link_resources(link, space, f.src, f.dst, f.rank)
        assert f.resources == (f"link:nvlink:0.{f.src}:out", f"link:nvlink:0.{f.dst}:in")


def test_ubbv2_ep16_dependencies_are_reversed():
    c, ctx = compile_to("schedules/ubbv2_ep16.sched")
    plan = ctx.results["plan"]
    deps = {s.name: s.deps for s in plan.program_steps("combine")}
    assert list(deps) == ["final.sendbuf", "final.from_peer", "final.from_mate", "final.relay", "final.from_twin",
                          "d2d_far.from_mate", "d2d_far.relay", "d2d_near.sendbuf", "d2d_near.from_peer",
                          "fwd3", "fwd2", "fwd1", "reorder"]
    assert deps["final.sendbuf"] == ()
    assert deps["d2d_far.relay"] == ("final.from_twin",)
    assert deps["fwd3"] == ("d2d_far.relay", "final.relay")
    assert deps["fwd1"] == ("fwd3", "d2d_far.from_mate", "final.from_mate")
    assert deps["reorder"] == ("fwd1", "fwd2", "d2d_near.sendbuf", "final.sendbuf")
    # `fwd1 ... last` in dispatch returns first in combine
    assert plan.step("fwd1", "combine").order == "first"
    assert attr(step_ops(c.module, "combine")[-2], "order") == "first"


def test_ocs_returns_only_partials_that_delivered_something():
    """ocs_ep16 pulls mates' inputs whole ('all tokens'); combine returns only what was used."""
    c, ctx = compile_to("schedules/ocs_ep16.sched")
    flow, adj = ctx.results["flow"], ctx.results["combine"]
    routing = flow.routing
    wl = c.schedule.workload
    space = c.schedule.topology.space
    # pull_m1 on rank r moved all of mate1(r)'s tokens; they delivered to r (p31_self) and to
    # r's peers (p31_peer pulls 'tokens for me'): P(hit {r} + peers(r)).
    peer = c.schedule.topology.relations["peer"]
    r = 0
    want = wl.tokens * routing.p_hit_all((frozenset({r, *peer.of(r)}),))
    assert adj.volumes["pull_m1"].copies[r] == pytest.approx(want, rel=1e-12)
    assert flow.volumes["pull_m1"].copies[r] == pytest.approx(wl.tokens)
    assert space.num_ranks == 16


# ---------------------------------------------------------------------------- written-out combine

QUAD = """\
schedule quadc "4 GPUs, combine written out"

topology quad {
  levels node 1, gpu 4
  rank gpu
  relation peer = other gpu
  link nvlink p2p { connects peer  bandwidth 450 GB/s  latency 3 us }
  link hbm local { bandwidth 3000 GB/s }
}

workload { tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked }

dispatch {
  step push: send tokens for peer from input to peer.output over nvlink
  step keep: permute input into output
}

combine {
  buffer partial
  step red: reduce output into partial
  step back: send tokens of peer from partial to peer.result over nvlink
  step own: copy tokens of me from partial into result
}
"""


def test_written_combine_is_planned_not_rewritten(tmp_path):
    p = tmp_path / "quad.sched"
    p.write_text(QUAD, encoding="utf-8")
    c, ctx = compile_to(p)
    plan = ctx.results["plan"]
    cf = ctx.results["combine"]
    assert cf.kind == "written" and not cf.problems
    comb = query.program_module(c.module.operation, "combine")
    assert irops.DERIVED_FROM_ATTR not in comb.attributes
    assert [attr(o, "step") for o in step_ops(c.module, "combine")] == ["red", "back", "own"]
    assert not any("epcc.reverse_of" in o.attributes for o in step_ops(c.module, "combine"))
    steps = plan.program_steps("combine")
    assert [(s.name, s.verb, s.deps, s.reverse_of) for s in steps] == [
        ("red", "reduce", (), None), ("back", "send", ("red",), None), ("own", "copy", ("red",), None)]
    wl = c.schedule.workload
    routing = ctx.results["flow"].routing
    # back: rank 0 sends each peer p the partial of p's tokens it holds (contributor {0}):
    # one per token of p that hits rank 0.
    back = steps[1]
    f = next(f for f in back.flows if (f.rank, f.src, f.dst) == (0, 0, 1))
    assert f.bytes == pytest.approx(wl.tokens * routing.p_hit_all((frozenset({0}),)) * wl.combine_bytes_per_token)
    assert f.resources == link_resources(c.schedule.topology.links["nvlink"], c.schedule.topology.space, 0, 1, 0)


# ---------------------------------------------------------------------------- broken derivations


def _adjoint_problems(rel, mutate):
    c, ctx = compile_to(rel, "route-analysis")
    flow = ctx.results["flow"]
    wl = c.schedule.workload
    cops = mutate(derive_ops(c.schedule))
    eng = ExactlyOnce(flow.n, wl.topk, wl.experts_per_rank)
    return verify_adjoint(AdjointCombine(flow, cops), eng, c.schedule)


def test_missing_reverse_op_is_a_drop():
    probs = _adjoint_problems("schedules/h200x4_2vnode.sched", lambda ops: [o for o in ops if o.name != "fwd"])
    msgs = [p.message for p in probs]
    assert "the derived combine applies the routing weights of the copy rank 0 -rdma-> 2 -fwd-> 3 never" in msgs
    assert ("the derived combine never brings rank 3's expert outputs home for a token of rank 0 (vnode 0, gpu 0) "
            "routed to ranks {3}") in msgs


def test_reverse_ops_out_of_order():
    probs = _adjoint_problems("schedules/h200x4_2vnode.sched", lambda ops: [ops[-1]] + ops[:-1])
    first = probs[0]
    assert first.message == (
        "combine step 'rdma' returns the partial sums of the copy rank 0 -rdma-> 2 before the reverse of dispatch "
        "step 'fwd' has added what that copy delivered through it (rank 0 -rdma-> 2 -fwd-> 3)")
    text = (REPO / "schedules" / "h200x4_2vnode.sched").read_text(encoding="utf-8")
    assert first.span.line == text[:text.index('  step rdma "')].count("\n") + 1  # where the step is declared


def test_reverse_op_twice_double_counts():
    probs = _adjoint_problems("schedules/h200x4.sched", lambda ops: ops + [ops[0]])
    msgs = [p.message for p in probs]
    assert "combine steps 'keep' and 'keep' both return the partial sums of the copy rank 0 -keep-> 0" in msgs
    assert ("the derived combine sums rank 0's expert outputs for a token of rank 0 (node 0, gpu 0) routed to "
            "ranks {0} twice: rank 0 -keep-> 0 and rank 0 -keep-> 0") in msgs


def test_broken_dispatch_stops_before_derive(tmp_path):
    p = tmp_path / "relay.sched"
    p.write_text(QUAD.replace("step keep: permute input into output\n",
                              "step keep: permute input into output\n  step again: permute input into output\n"),
                 encoding="utf-8")
    with pytest.raises(CompileError) as e:
        compile_to(p)
    assert e.value.diagnostics[0].message.endswith("is delivered to rank 0 twice: rank 0 -keep-> 0 and "
                                                   "rank 0 -again-> 0")


# ---------------------------------------------------------------------------- scale


def ep256_text(nodes: int = 32, gpus: int = 8) -> str:
    """A DeepEP-like internode plan: RDMA once per node to the same-index GPU, NVLink forward."""
    return f"""\
schedule deepep_ep{nodes * gpus} "DeepEP-like internode dispatch, {nodes} nodes x {gpus} GPUs"

topology dgx{nodes} {{
  levels node {nodes}, gpu {gpus}
  rank gpu
  relation nvl = other gpu
  relation rail = other node
  link nvlink p2p {{ connects nvl  bandwidth 160 GB/s  shared per gpu  latency 3 us  engine sm }}
  link rdma rdma {{ connects rail  bandwidth 50 GB/s  latency 5 us  engine nic }}
  link hbm local {{ bandwidth 3000 GB/s  latency 1 us }}
}}

workload {{ tokens 4096 per rank  hidden 7168  dtype bf16  topk 8  experts 256 blocked  weights travel }}

dispatch {{
  buffer rdma_recv
  defaults chunk 128 tokens depth 4
  step meta: exchange counts with all
  step rdma: send tokens for rail.node from input to rail.rdma_recv over rdma sms 8
  step intra: send tokens for nvl from input to nvl.output over nvlink sms 8 parallel with rdma
  step keep: permute input into output over hbm
  step fwd: send tokens for nvl from rdma_recv to nvl.output over nvlink sms 8
  step keep_far: permute rdma_recv into output over hbm
}}

combine reverse of dispatch
"""


def test_ep256_scale(tmp_path):
    """EP256 (32 nodes x 8 GPUs) verifies and derives its combine; its compile time is measured
    by bench/compile_time.py, not asserted here."""
    p = tmp_path / "ep256.sched"
    p.write_text(ep256_text(), encoding="utf-8")
    c, ctx = compile_to(p)
    v = ctx.results["verification"]
    assert v["dispatch_ok"] and v["combine_ok"] and v["pairs"] == 256 * 256
    disp = query.program_module(c.module.operation, "dispatch")
    assert disp.attributes["epcc.verified"].value == \
        "exactly-once: 256 homes x 256 destinations, 65536 destination patterns checked"
    assert len(ctx.results["plan"].program_steps("combine")) == 5
