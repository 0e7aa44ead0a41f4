"""The simulator on tiny hand-made plans with closed-form answers (the model: compiler/sim/__init__.py)."""

from __future__ import annotations

import pytest

from epcc.plan import Flow, Plan, PlanStep
from epcc.sim import SimOptions, SimulationError, simulate
from epcc.sim.engine import _Engine

GB = 1e9


def step(name, flows, deps=(), **kw) -> PlanStep:
    kind = kw.pop("link_kind", "p2p")
    return PlanStep(name, kw.pop("program", "dispatch"), kw.pop("verb", "send"), kw.pop("link", "l"), kind,
                    tuple(deps), flows=list(flows), **kw)


def flow(nbytes, *res, rank=0, src=0, dst=1, lat=0.0) -> Flow:
    return Flow(rank, src, dst, float(nbytes), tuple(res), lat)


def plan(steps, resources) -> Plan:
    return Plan("t", 4, "test", 1, steps=list(steps), resources=dict(resources))


def ends(res, program="dispatch"):
    return {s.name: s.end_s for s in res.programs[program].steps}


# --------------------------------------------------------------------------- sharing


def test_two_flows_on_one_port_get_half_the_rate_each():
    p = plan([step("a", [flow(1 * GB, "port")]), step("b", [flow(1 * GB, "port")])], {"port": 10 * GB})
    e = ends(simulate(p))
    assert e["a"] == pytest.approx(0.2) and e["b"] == pytest.approx(0.2)  # 5 GB/s each


def test_a_finished_flow_leaves_its_share_to_the_other():
    p = plan([step("a", [flow(1 * GB, "port")]), step("b", [flow(2 * GB, "port")])], {"port": 10 * GB})
    e = ends(simulate(p))
    assert e["a"] == pytest.approx(0.2)  # 1 GB at 5 GB/s
    assert e["b"] == pytest.approx(0.3)  # 1 GB at 5 GB/s, then 1 GB at 10 GB/s


def test_max_min_fairness_across_two_resources():
    # The classic 3-flow example: flow x crosses A and B, y only A, z only B; A = 10, B = 4 GB/s.
    # B is the bottleneck: x and z get 2 GB/s each; y gets what x leaves on A, 10 - 2 = 8 GB/s.
    # Bytes chosen so that exactly these rates make all three end at t = 1 s.
    p = plan([step("x", [flow(2 * GB, "A", "B")]), step("y", [flow(8 * GB, "A")]), step("z", [flow(2 * GB, "B")])],
             {"A": 10 * GB, "B": 4 * GB})
    r = simulate(p)
    e = ends(r)
    assert e == pytest.approx({"x": 1.0, "y": 1.0, "z": 1.0})
    res = r.programs["dispatch"].resources
    assert res["A"].work_s == pytest.approx(1.0) and res["B"].work_s == pytest.approx(1.0)


def test_max_min_symmetric_line():
    # Two links of 1 GB/s in a line; one flow over both, one on each: 0.5 GB/s each.
    p = plan([step("long", [flow(0.5 * GB, "L1", "L2")]), step("s1", [flow(0.5 * GB, "L1")]),
              step("s2", [flow(1.0 * GB, "L2")])], {"L1": 1 * GB, "L2": 1 * GB})
    e = ends(simulate(p))
    assert e["long"] == pytest.approx(1.0) and e["s1"] == pytest.approx(1.0)
    assert e["s2"] == pytest.approx(1.5)  # 0.5 GB in the first second, then alone at 1 GB/s


# --------------------------------------------------------------------------- dependencies


def test_dependency_chain_and_serial_sum():
    p = plan([step("a", [flow(1 * GB, "r1")]), step("b", [flow(2 * GB, "r2")], deps=("a",)),
              step("c", [flow(1 * GB, "r3")], deps=("b",)), step("d", [flow(0.5 * GB, "r4")])],
             {"r1": 1 * GB, "r2": 1 * GB, "r3": 1 * GB, "r4": 1 * GB})
    r = simulate(p)
    prog = r.programs["dispatch"]
    assert ends(r) == pytest.approx({"a": 1.0, "b": 3.0, "c": 4.0, "d": 0.5})
    assert prog.step("b").ready_s == pytest.approx(1.0)
    assert prog.makespan_s == pytest.approx(4.0)
    assert prog.serial_s == pytest.approx(1 + 2 + 1 + 0.5)
    assert prog.critical_path == ["a", "b", "c"]


@pytest.mark.parametrize("tc, n, expect", [
    (0.5, 4, 1.0 + 0.5 / 4),   # consumer faster: Tp + Tc/n
    (2.0, 4, 1.0 / 4 + 2.0),   # consumer slower: Tp/n + Tc
    (1.0, 8, 1.0 + 1.0 / 8),   # equal: both forms agree
    (0.5, 1, 1.0 + 0.5),       # one chunk: no overlap at all
])
def test_pipelined_consumer_trails_producer_by_one_chunk(tc, n, expect):
    # Producer lands 1 GB on rank 1 at 1 GB/s (Tp = 1 s); the consumer forwards from rank 1 over
    # its own link.  Closed form of the two-stage pipeline: max(Tp + Tc/n, Tp/n + Tc).
    prod = step("p", [flow(1 * GB, "a", rank=0, src=0, dst=1)])
    cons = step("c", [flow(tc * GB, "b", rank=1, src=1, dst=2)], deps=("p",), pipelined_deps=("p",), num_chunks=n)
    r = simulate(plan([prod, cons], {"a": 1 * GB, "b": 1 * GB}))
    c = r.programs["dispatch"].step("c")
    assert c.end_s == pytest.approx(expect, rel=1e-9)
    assert c.end_s == pytest.approx(max(1.0 + tc / n, 1.0 / n + tc), rel=1e-9)
    assert c.start_s == pytest.approx(1.0 / n if n > 1 else 1.0, rel=1e-9)  # first chunk after Tp/n
    # Without pipelining it is a barrier: Tp + Tc.
    r2 = simulate(plan([prod, cons], {"a": 1 * GB, "b": 1 * GB}), SimOptions(pipelining=False))
    assert r2.programs["dispatch"].step("c").end_s == pytest.approx(1.0 + tc)


def test_pipelined_consumer_only_waits_for_what_lands_on_its_rank():
    # The producer sends 1 GB to rank 1 and 3 GB to rank 2 over separate links; the consumer that
    # reads rank 1 follows the 1-second flow, not the 3-second one.
    prod = step("p", [flow(1 * GB, "a", src=0, dst=1), flow(3 * GB, "a2", src=0, dst=2)])
    cons = step("c", [flow(0.5 * GB, "b", rank=1, src=1, dst=3)], deps=("p",), pipelined_deps=("p",), num_chunks=4)
    r = simulate(plan([prod, cons], {"a": 1 * GB, "a2": 1 * GB, "b": 1 * GB}))
    assert r.programs["dispatch"].step("c").end_s == pytest.approx(1.125)
    assert r.programs["dispatch"].step("p").end_s == pytest.approx(3.0)


def test_pipelined_chain_of_three():
    # p (1 s) -> c1 (0.5 s, 4 chunks) -> c2 (0.5 s, 4 chunks), all on separate links: each stage
    # adds one of its chunks: 1 + 0.125 + 0.125.
    p = step("p", [flow(1 * GB, "a", src=0, dst=1)])
    c1 = step("c1", [flow(0.5 * GB, "b", rank=1, src=1, dst=2)], deps=("p",), pipelined_deps=("p",), num_chunks=4)
    c2 = step("c2", [flow(0.5 * GB, "c", rank=2, src=2, dst=3)], deps=("c1",), pipelined_deps=("c1",), num_chunks=4)
    r = simulate(plan([p, c1, c2], {"a": 1 * GB, "b": 1 * GB, "c": 1 * GB}))
    assert r.programs["dispatch"].step("c2").end_s == pytest.approx(1.25)
    # c1 runs at its cap F_p - 1/4 = t - 1/4: it crosses k/4 at t = (k + 1)/4.
    assert r.programs["dispatch"].step("c1").chunk_times_s == pytest.approx([0.5, 0.75, 1.0])


def test_pipelined_consumer_sharing_a_resource_with_its_producer():
    # Both on one 1 GB/s port; producer 1 GB, consumer 0.5 GB with 2 chunks.  The consumer at its
    # cap runs at half the producer's rate: x = 0.5 (1 - x) -> x = 1/3, producer 2/3 GB/s.
    # Phase 1 (t < 0.5 s): producer alone until F = 1/2 (cap leaves 0).  Phase 2: producer at
    # 2/3 GB/s finishes the last 0.5 GB in 0.75 s (t = 1.25), consumer tracks its cap up to 0.25 GB.
    # Phase 3: the consumer's last chunk alone, 0.25 GB at 1 GB/s: t = 1.5.
    p = step("p", [flow(1 * GB, "port", src=0, dst=1)])
    c = step("c", [flow(0.5 * GB, "port", rank=1, src=1, dst=2)], deps=("p",), pipelined_deps=("p",), num_chunks=2)
    r = simulate(plan([p, c], {"port": 1 * GB}))
    e = ends(r)
    assert e["p"] == pytest.approx(1.25, rel=1e-6)
    assert e["c"] == pytest.approx(1.5, rel=1e-6)


# --------------------------------------------------------------------------- latency


def test_latency_is_paid_per_chunk_without_depth():
    s = step("a", [flow(1 * GB, "r", lat=1e-3)], chunk_bytes=0.1 * GB, num_chunks=10, depth=1)
    r = simulate(plan([s], {"r": 1 * GB}))
    assert r.programs["dispatch"].step("a").end_s == pytest.approx(1.0 + 10 * 1e-3)


@pytest.mark.parametrize("depth, windows", [(1, 10), (2, 5), (4, 3), (10, 1), (16, 1)])
def test_latency_overlaps_with_depth(depth, windows):
    s = step("a", [flow(1 * GB, "r", lat=1e-3)], chunk_bytes=0.1 * GB, num_chunks=10, depth=depth)
    r = simulate(plan([s], {"r": 1 * GB}))
    assert r.programs["dispatch"].step("a").end_s == pytest.approx(1.0 + windows * 1e-3)


def test_latency_chunks_count_per_flow_from_chunk_bytes():
    # chunk_bytes set: a flow of 0.25 GB has 3 chunks of 0.1 GB, whatever the step's num_chunks.
    s = step("a", [flow(0.25 * GB, "r", lat=1e-3)], chunk_bytes=0.1 * GB, num_chunks=10, depth=1)
    r = simulate(plan([s], {"r": 1 * GB}))
    assert r.programs["dispatch"].step("a").end_s == pytest.approx(0.25 + 3e-3)
    r2 = simulate(plan([s], {"r": 1 * GB}), SimOptions(latency=False))
    assert r2.programs["dispatch"].step("a").end_s == pytest.approx(0.25)


def test_step_without_resources_takes_its_latency():
    meta = step("meta", [flow(1000, rank=0, lat=5e-6), flow(1000, rank=1, lat=5e-6)], verb="exchange",
                link=None, link_kind=None)
    nxt = step("b", [flow(1 * GB, "r")], deps=("meta",))
    r = simulate(plan([meta, nxt], {"r": 1 * GB}))
    prog = r.programs["dispatch"]
    assert prog.step("meta").end_s == pytest.approx(5e-6)
    assert prog.step("meta").achieved_bps is None
    assert prog.step("b").end_s == pytest.approx(5e-6 + 1.0)
    assert prog.serial_s == pytest.approx(5e-6 + 1.0)


def test_zero_byte_flows_are_free():
    s = step("a", [flow(0.0, "r", lat=1e-3)])
    r = simulate(plan([s, step("b", [flow(1 * GB, "r")], deps=("a",))], {"r": 1 * GB}))
    assert ends(r) == pytest.approx({"a": 0.0, "b": 1.0})


# --------------------------------------------------------------------------- order hints, priority


def test_order_last_waits_for_the_other_steps_on_its_resource():
    a = step("a", [flow(1 * GB, "port")])
    last = step("l", [flow(1 * GB, "port")], order="last")
    other = step("o", [flow(1 * GB, "own")], order="last")  # alone on its resource: unaffected
    r = simulate(plan([last, a, other], {"port": 1 * GB, "own": 1 * GB}))
    prog = r.programs["dispatch"]
    assert prog.step("a").end_s == pytest.approx(1.0)
    assert prog.step("l").start_s == pytest.approx(1.0)
    assert prog.step("l").end_s == pytest.approx(2.0)
    assert prog.step("o").end_s == pytest.approx(1.0)
    # Without the hint the two share the port and end together.
    r2 = simulate(plan([last, a, other], {"port": 1 * GB, "own": 1 * GB}), SimOptions(order_hints=False))
    assert r2.programs["dispatch"].step("a").end_s == pytest.approx(2.0)


def test_order_last_waits_for_a_step_that_starts_later():
    # 'b' becomes ready at t = 0.5 (after 'x') and shares the port with the 'last' step: the
    # 'last' step waits for it, it does not grab the idle port first.
    x = step("x", [flow(0.5 * GB, "other")])
    b = step("b", [flow(1 * GB, "port")], deps=("x",))
    last = step("l", [flow(1 * GB, "port")], order="last")
    r = simulate(plan([x, b, last], {"port": 1 * GB, "other": 1 * GB}))
    assert ends(r) == pytest.approx({"x": 0.5, "b": 1.5, "l": 2.5})


def test_order_last_does_not_wait_for_its_own_descendants():
    last = step("l", [flow(1 * GB, "port")], order="last")
    after = step("d", [flow(1 * GB, "port")], deps=("l",))
    r = simulate(plan([last, after], {"port": 1 * GB}))
    assert ends(r) == pytest.approx({"l": 1.0, "d": 2.0})


def test_order_first_goes_before_the_others():
    a = step("a", [flow(1 * GB, "port")])
    f = step("f", [flow(1 * GB, "port")], order="first")
    r = simulate(plan([a, f], {"port": 1 * GB}))
    assert ends(r) == pytest.approx({"f": 1.0, "a": 2.0})


def test_priority_is_ignored_by_default_and_strict_when_asked():
    a = step("a", [flow(1 * GB, "port")], priority=1)
    b = step("b", [flow(1 * GB, "port")], priority=0)
    assert ends(simulate(plan([a, b], {"port": 1 * GB}))) == pytest.approx({"a": 2.0, "b": 2.0})
    e = ends(simulate(plan([a, b], {"port": 1 * GB}), SimOptions(priorities=True)))
    assert e == pytest.approx({"b": 1.0, "a": 2.0})


# --------------------------------------------------------------------------- outputs, errors


def test_bottleneck_is_the_busiest_link_class():
    s1 = step("n", [flow(2 * GB, "link:nic:0:out"), flow(1 * GB, "link:nic:1:out")], link="nic", link_kind="rdma")
    s2 = step("p", [flow(1 * GB, "link:bl:0>1")], link="bl", link_kind="p2p")
    s3 = step("h", [flow(1 * GB, "hbm:0")], link="hbm", link_kind="local", verb="permute")
    r = simulate(plan([s1, s2, s3], {"link:nic:0:out": 1 * GB, "link:nic:1:out": 1 * GB,
                                     "link:bl:0>1": 1 * GB, "hbm:0": 10 * GB}))
    prog = r.programs["dispatch"]
    assert set(prog.link_classes) == {"nic", "bl", "hbm"}
    assert prog.link_classes["nic"].work_s == pytest.approx(2.0)  # the busiest instance
    assert prog.link_classes["nic"].busiest == "link:nic:0:out"
    assert prog.link_classes["hbm"].kind == "local"
    b = prog.bottleneck
    assert (b.link_class, b.resource) == ("nic", "link:nic:0:out")
    assert b.utilisation == pytest.approx(1.0)


def test_dispatch_and_combine_are_reported_separately_and_together():
    d = step("d", [flow(1 * GB, "r")])
    c = step("c", [flow(2 * GB, "r")], program="combine")
    r = simulate(plan([d, c], {"r": 1 * GB}))
    assert r.programs["dispatch"].makespan_s == pytest.approx(1.0)
    assert r.programs["combine"].makespan_s == pytest.approx(2.0)  # from t = 0, not after dispatch
    assert r.total_s == pytest.approx(3.0) and r.serial_s == pytest.approx(3.0)


# --------------------------------------------------------------------------- weights


def wflow(nbytes, weights: dict, rank=0, src=0, dst=1) -> Flow:
    return Flow(rank, src, dst, float(nbytes), tuple(weights), 0.0, weights=tuple(weights.values()))


def test_a_weighted_flow_takes_weight_times_its_rate_of_the_resource():
    # weight 2 on a 10 GB/s resource: 5 GB/s, 1 GB in 0.2 s, and the resource carried 2 GB
    r = simulate(plan([step("a", [wflow(1 * GB, {"pool": 2.0})])], {"pool": 10 * GB}))
    assert ends(r) == pytest.approx({"a": 0.2})
    res = r.programs["dispatch"].resources["pool"]
    assert res.bytes == pytest.approx(2 * GB) and res.work_s == pytest.approx(0.2)


def test_weighted_flows_share_a_resource_at_equal_rates():
    # weights 1 and 3 on 10 GB/s: both at 2.5 GB/s (1 x 2.5 + 3 x 2.5 = 10) until a's 1 GB is
    # done at 0.4 s; b has moved 1 of its 2 GB and takes the rest at 10 / 3 GB/s: 0.3 s more
    p = plan([step("a", [wflow(1 * GB, {"pool": 1.0})]), step("b", [wflow(2 * GB, {"pool": 3.0})])],
             {"pool": 10 * GB})
    assert ends(simulate(p)) == pytest.approx({"a": 0.4, "b": 0.7})


def test_a_weighted_flow_is_held_by_its_tightest_weighted_resource():
    # x carries its bytes on A (12 GB/s) and four times them on B (20 GB/s): 5 GB/s, held by B;
    # y, on A alone, takes the 7 GB/s of A that x leaves
    p = plan([step("x", [wflow(1 * GB, {"A": 1.0, "B": 4.0})]), step("y", [flow(1 * GB, "A")])],
             {"A": 12 * GB, "B": 20 * GB})
    r = simulate(p)
    assert ends(r) == pytest.approx({"x": 0.2, "y": 1 / 7})
    assert r.programs["dispatch"].resources["B"].bytes == pytest.approx(4 * GB)
    assert r.programs["dispatch"].resources["A"].bytes == pytest.approx(2 * GB)


@pytest.mark.parametrize("weights, msg", [
    ({"pool": 0.0}, "weights must be positive and finite"),
    ({"pool": -1.0}, "weights must be positive and finite"),
    ({"pool": float("inf")}, "weights must be positive and finite"),
])
def test_bad_weights_are_an_error(weights, msg):
    with pytest.raises(SimulationError, match=msg):
        simulate(plan([step("a", [wflow(1 * GB, weights)])], {"pool": 10 * GB}))


def test_weights_must_match_the_resources():
    f = Flow(0, 0, 1, 1.0 * GB, ("A", "B"), weights=(1.0,))
    with pytest.raises(SimulationError, match="1 weights for 2 resources"):
        simulate(plan([step("a", [f])], {"A": 1 * GB, "B": 1 * GB}))
    twice = Flow(0, 0, 1, 1.0 * GB, ("A", "A"), weights=(1.0, 2.0))
    with pytest.raises(SimulationError, match="lists a resource twice"):
        simulate(plan([step("a", [twice])], {"A": 1 * GB}))


def test_weights_survive_plan_json():
    p = plan([step("a", [wflow(1 * GB, {"pool": 2.5, "A": 1.0})])], {"pool": 10 * GB, "A": 10 * GB})
    back = Plan.from_json(p.to_json())
    assert back.steps[0].flows[0].weights == (2.5, 1.0)
    assert ends(simulate(back)) == pytest.approx(ends(simulate(p)))


def test_a_program_may_start_later():
    # its first steps become ready at start_s (the direct kernels' launches, sim/direct.py)
    p = plan([step("a", [flow(1 * GB, "r")]), step("b", [flow(1 * GB, "r")], deps=("a",))], {"r": 10 * GB})
    e = _Engine(p.steps, p.resources, SimOptions(), start_s=0.5).run()
    assert list(e.ready_t) == pytest.approx([0.5, 0.6]) and list(e.end_t) == pytest.approx([0.6, 0.7])


def test_unknown_dependency_is_an_error():
    with pytest.raises(SimulationError, match="unknown step 'nope'"):
        simulate(plan([step("a", [flow(1, "r")], deps=("nope",))], {"r": 1.0}))


def test_missing_resource_capacity_is_an_error():
    with pytest.raises(SimulationError, match="no capacity"):
        simulate(plan([step("a", [flow(1, "r")])], {}))


def test_cycle_is_an_error():
    with pytest.raises(SimulationError, match="cycle"):
        simulate(plan([step("a", [flow(1, "r")], deps=("b",)), step("b", [flow(1, "r")], deps=("a",))], {"r": 1.0}))


def test_deterministic():
    p = plan([step("a", [flow(1.3 * GB, "A", "B")]), step("b", [flow(0.7 * GB, "A")]),
              step("c", [flow(2.1 * GB, "B")], deps=("b",), pipelined_deps=("b",), num_chunks=3)],
             {"A": 3 * GB, "B": 2 * GB})
    r1, r2 = simulate(p), simulate(p)
    assert [(s.start_s, s.end_s) for s in r1.steps] == [(s.start_s, s.end_s) for s in r2.steps]
