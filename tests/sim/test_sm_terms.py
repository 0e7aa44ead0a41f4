"""SM throughput in the simulator (compiler/sim/sm_terms.py): closed-form answers on tiny plans,
and the `sm` line of a shipped schedule carried from the source to the IR and the plan."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest

from epcc.costmodel.rates import sm_rates, window_rate
from epcc.costmodel.uniform import rows_per_token
from epcc.plan import Flow, KernelPlan, Plan, PlanStep, RolePlan
from epcc.plan import WorkloadPlan
from epcc.sim import simulate
from epcc.sim import SimOptions
from epcc.sim.build import build_plan
from epcc.sim.sm_terms import with_sm_terms

GB = 1e9
MB = 1e6
REPO = Path(__file__).resolve().parents[2]


def sm_plan(rates, sms=8, nbytes=2.0 * GB, chunk=None, program="dispatch") -> Plan:
    """One local permute of `nbytes` per rank on 2 ranks, run by a role of `sms` SMs."""
    flows = [Flow(r, r, r, nbytes, (f"hbm:{r}",)) for r in range(2)]
    st = PlanStep("keep", program, "permute", "hbm", "local", (), flows=flows, chunk_bytes=chunk, num_chunks=1)
    k = KernelPlan(f"{program}_kernel", "kernel", program, sms, roles=[RolePlan("keep", "permuter", 0, sms, 8, "sm")])
    return Plan("t", 2, "test", 1, steps=[st], resources={"hbm:0": 3000 * GB, "hbm:1": 3000 * GB}, kernels=[k],
                sm_rates=dict(rates))


def test_without_sm_rates_the_plan_is_simulated_as_it_is():
    p = sm_plan({})
    assert with_sm_terms(p) is p
    assert simulate(p).step("keep").end_s == pytest.approx(2.0 * GB / (3000 * GB))


def test_a_role_moves_at_most_its_sms_times_the_rate():
    p = sm_plan({"copy": 25 * GB}, sms=8, chunk=100 * MB)
    t = simulate(p).step("keep")
    assert t.end_s == pytest.approx(2.0 / 200)  # 8 SMs x 25 GB/s = 200 GB/s for 2 GB
    res = simulate(p).programs["dispatch"]
    assert res.bottleneck.link_class == "sm" and res.bottleneck.resource in ("sm:dispatch.keep:0", "sm:dispatch.keep:1")


def test_combine_roles_use_the_reduce_rate():
    p = sm_plan({"copy": 25 * GB, "reduce": 10 * GB}, sms=4, nbytes=1.0 * GB, program="combine")
    assert simulate(p).programs["combine"].step("keep").end_s == pytest.approx(1.0 / 40)


def test_unweighted_combine_roles_use_the_add_rate_where_there_is_one():
    # one partial per token scatter-added (atomics): `add`; without an `add` rate, `reduce`
    p = sm_plan({"copy": 25 * GB, "reduce": 20 * GB, "add": 10 * GB}, sms=4, nbytes=1.0 * GB, program="combine")
    assert simulate(p).programs["combine"].step("keep").end_s == pytest.approx(1.0 / 40)
    weighted = dataclasses.replace(p, steps=[dataclasses.replace(p.steps[0], weighted=True)])
    assert simulate(weighted).programs["combine"].step("keep").end_s == pytest.approx(1.0 / 80)


def test_a_combine_channel_stages_fp32_partials_at_half_the_copy_rate():
    # partials are read as fp32 and sent as bf16: staging a 2 MB chunk of wire reads 4 MB
    rates = {"copy": 25 * GB, "reduce": 25 * GB, "add": 25 * GB}
    p = rdma_plan(rates, depth=4)
    p = dataclasses.replace(p, steps=[dataclasses.replace(s, program="combine") for s in p.steps])
    w = window_rate(2 * MB, 4, 50 * GB, 5e-6, 12.5 * GB, 25 * GB)
    aug = with_sm_terms(p)
    assert aug.resources["window:combine.rdma:0>1"] == pytest.approx(w)
    f = aug.steps[0].flows[0]
    assert f.lead_s == pytest.approx(2 * MB / (12.5 * GB))  # the first chunk staged before the wire (no post here)
    assert f.tail_s == pytest.approx(2 * MB / (25 * GB))  # the last one applied after it


def test_an_rdma_channel_moves_its_first_byte_once_its_first_chunk_is_staged_and_posted():
    # 2 MB chunks staged at 25 GB/s (80 us) and posted (post 10 us) before the wire starts; the
    # last one applied at 25 GB/s (80 us) after it; 64 MB at 50 GB/s take 1.28 ms on the wire,
    # and 32 chunks 16 deep expose 2 latencies of 5 us
    p = dataclasses.replace(rdma_plan({"copy": 25 * GB}, depth=16), post_s={"rdma": 10e-6})
    step = simulate(p).programs["dispatch"].step("rdma")
    assert step.start_s == pytest.approx(90e-6)
    assert step.end_s == pytest.approx(90e-6 + 64 * MB / (50 * GB) + 80e-6 + 2 * 5e-6)


def test_a_role_faster_than_its_link_is_held_by_the_link():
    p = sm_plan({"copy": 1000 * GB}, sms=8)
    assert simulate(p).step("keep").end_s == pytest.approx(2.0 * GB / (3000 * GB))


def rdma_plan(rates, depth=4, chunk=2 * MB, link=50 * GB, lat=5e-6, nbytes=64 * MB) -> Plan:
    flows = [Flow(0, 0, 1, nbytes, ("link:rdma:0>1",), lat), Flow(1, 1, 0, nbytes, ("link:rdma:1>0",), lat)]
    st = PlanStep("rdma", "dispatch", "send", "rdma", "rdma", (), flows=flows, chunk_bytes=chunk,
                  num_chunks=int(nbytes // chunk), depth=depth)
    return Plan("t", 2, "test", 1, steps=[st], resources={"link:rdma:0>1": link, "link:rdma:1>0": link},
                sm_rates=dict(rates))


def test_window_rate_closed_form():
    # 2 MB chunks: 40 us on a 50 GB/s link, 80 us to stage and 80 us to apply at 25 GB/s, 10 us of latency
    assert window_rate(2 * MB, 4, 50 * GB, 5e-6, 25 * GB, 25 * GB) == pytest.approx(4 * 2 * MB / 210e-6)


def test_window_rate_with_the_proxys_post():
    # `post 10 us`: one more term of the round trip, and the proxy posts one chunk at a time
    assert window_rate(2 * MB, 4, 50 * GB, 5e-6, 25 * GB, 25 * GB, 10e-6) == pytest.approx(4 * 2 * MB / 220e-6)
    assert window_rate(0.25 * MB, 16, 50 * GB, 5e-6, 25 * GB, 25 * GB, 10e-6) == pytest.approx(0.25 * MB / 10e-6)


def test_a_small_chunk_is_held_by_the_proxys_post():
    # 0.5 MB chunks 16 deep: the window covers the link, but a proxy that spends 20 us per chunk
    # posts 25 GB/s; without `post` the link holds it
    p = rdma_plan({"copy": 25 * GB}, depth=16, chunk=0.5 * MB)
    assert not any(r.startswith("window:") for r in with_sm_terms(p).resources)
    slow = dataclasses.replace(p, post_s={"rdma": 20e-6})
    aug = with_sm_terms(slow)
    assert aug.resources["window:dispatch.rdma:0>1"] == pytest.approx(0.5 * MB / 20e-6)
    assert simulate(slow).step("rdma").end_s > 64 * MB / (25 * GB)
    assert Plan.from_json(slow.to_json()).post_s == {"rdma": 20e-6}


def test_an_rdma_step_moves_no_faster_than_its_pack_and_unpack_blocks():
    # a 16-deep window covers the 50 GB/s link, but one unpack block applying at 25 GB/s does not:
    # the GPU proxy path stages and applies each chunk on one of the role's blocks
    p = rdma_plan({"copy": 25 * GB}, depth=16)
    k = KernelPlan("dispatch_proxy", "proxy", "dispatch", 0,
                   roles=[RolePlan("rdma", "rdma_poster", 0, 0, 0, "nic", pack_sms=2, unpack_sms=1)])
    slow = dataclasses.replace(p, kernels=[k])
    aug = with_sm_terms(slow)
    assert aug.resources["pack:dispatch.rdma:0"] == pytest.approx(50 * GB)
    assert aug.resources["unpack:dispatch.rdma:1"] == pytest.approx(25 * GB)
    assert aug.steps[0].flows[0].resources == ("link:rdma:0>1", "pack:dispatch.rdma:0", "unpack:dispatch.rdma:1")
    lat = 5e-6 * (32 // 16)
    tail = 2 * 2 * MB / (25 * GB)
    res = simulate(slow)
    assert res.step("rdma").end_s == pytest.approx(64 * MB / (25 * GB) + lat + tail)
    assert res.programs["dispatch"].bottleneck.link_class == "rdma unpack"
    # without kernels (a hand-made plan) each side has PROXY_MIN_SMS = 4 blocks: 100 GB/s, the link binds
    assert simulate(p).step("rdma").end_s == pytest.approx(64 * MB / (50 * GB) + lat + tail)
    back = Plan.from_json(slow.to_json()).kernels[0].roles[0]
    assert (back.pack_sms, back.unpack_sms) == (2, 1)


def test_one_proxy_posts_for_all_of_a_ranks_channels():
    # rank 0 writes 32 MB to each of ranks 1 and 2 over links of their own; 1 MB chunks and
    # `post 40 us`: each channel alone could take 25 GB/s, but rank 0's one proxy thread posts
    # 25 GB/s in all
    flows = [Flow(0, 0, 1, 32 * MB, ("link:rdma:0>1",), 5e-6), Flow(0, 0, 2, 32 * MB, ("link:rdma:0>2",), 5e-6)]
    st = PlanStep("rdma", "dispatch", "send", "rdma", "rdma", (), flows=flows, chunk_bytes=1 * MB,
                  num_chunks=32, depth=16)
    p = Plan("t", 3, "test", 1, steps=[st], resources={"link:rdma:0>1": 50 * GB, "link:rdma:0>2": 50 * GB},
             sm_rates={"copy": 1000 * GB}, post_s={"rdma": 40e-6})
    aug = with_sm_terms(p)
    assert aug.resources["post:dispatch.rdma:0"] == pytest.approx(1 * MB / 40e-6)
    assert aug.resources["window:dispatch.rdma:0>1"] == pytest.approx(1 * MB / 40e-6)
    res = simulate(p)
    assert res.step("rdma").end_s >= 64 * MB / (25 * GB)
    assert res.programs["dispatch"].bottleneck.link_class == "rdma proxy"
    # one peer: the window's own chunk / post, no shared term
    one = dataclasses.replace(p, steps=[dataclasses.replace(st, flows=flows[:1])])
    assert not any(r.startswith("post:") for r in with_sm_terms(one).resources)


def test_an_rdma_channel_is_held_by_its_credit_window_when_that_binds():
    p = rdma_plan({"copy": 25 * GB}, depth=4)
    w = window_rate(2 * MB, 4, 50 * GB, 5e-6, 25 * GB, 25 * GB)  # 38 GB/s < 50
    t = simulate(p).step("rdma")
    lat = 5e-6 * (32 // 4)  # the plan's latency term: one per window of chunks
    tail = 2 * MB / (25 * GB) * 2  # the last chunk staged and applied
    assert t.end_s == pytest.approx(64 * MB / w + lat + tail)
    assert simulate(p).programs["dispatch"].bottleneck.link_class == "rdma window"


def test_a_deep_window_leaves_the_link_the_limit():
    p = rdma_plan({"copy": 25 * GB}, depth=16)  # 152 GB/s of window on a 50 GB/s link
    aug = with_sm_terms(p)
    assert all(not r.startswith("window:") for r in aug.resources)
    lat = 5e-6 * (32 // 16)
    assert simulate(p).step("rdma").end_s == pytest.approx(64 * MB / (50 * GB) + lat + 2 * 2 * MB / (25 * GB))


def test_paced_sm_roles_expose_one_latency():
    # --rdma emulate: the RDMA step's roles replay one serial link whose chunks land a latency
    # after their last byte, pipelined; no window, so 32 chunks 4 deep expose one latency, not 8
    p = rdma_plan({"copy": 25 * GB}, depth=4)
    f = with_sm_terms(p, rdma_proxy=False).steps[0].flows[0]
    assert (f.latency_s, f.tail_s, f.lead_s) == (0.0, pytest.approx(5e-6), 0.0)
    t = simulate(p, SimOptions(rdma_proxy=False)).step("rdma")
    assert t.end_s == pytest.approx(64 * MB / (50 * GB) + 5e-6)
    # without the `sm` line the plan is simulated as it is: a window's latency per 4 chunks
    bare = dataclasses.replace(p, sm_rates={})
    assert simulate(bare, SimOptions(rdma_proxy=False)).step("rdma").end_s == pytest.approx(64 * MB / (50 * GB) + 8 * 5e-6)


def test_the_sm_line_reaches_the_ir_and_the_plan_and_survives_plan_json():
    built = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched"))
    plan = built.plan
    assert plan.sm_rates == {"copy": 44 * GB, "reduce": 26 * GB, "add": 12 * GB}
    text = str(built.compilation.module)
    assert "epcc.sm_rates_Bps = {add = 1.200000e+10 : f64, copy = 4.400000e+10 : f64, reduce = 2.600000e+10 : f64}" in text
    back = Plan.from_json(plan.to_json())
    assert back.sm_rates == plan.sm_rates
    aug = with_sm_terms(plan)
    tails = [f.tail_s for s in aug.steps for f in s.flows if f.tail_s]
    assert tails and Plan.from_json(aug.to_json()).steps == [dataclasses.replace(s) for s in aug.steps]


def test_read_and_launch_reach_the_ir_and_the_plan(tmp_path):
    # `read` (row loads, the direct kernels') and `launch` (a time, per kernel launch)
    text = (REPO / "tests" / "sema" / "cases" / "sm_rate_zero.sched").read_text()
    src = tmp_path / "t.sched"
    src.write_text(text.replace("sm reduce 0 GB/s", "sm copy 60 GB/s, read 172 GB/s, launch 9 us"))
    built = build_plan(str(src))
    plan = built.plan
    assert plan.sm_rates == {"copy": 60 * GB, "read": 172 * GB} and plan.sm_launch_s == pytest.approx(9e-6)
    ir = str(built.compilation.module)
    assert "epcc.sm_launch_s = 9.000000e-06 : f64" in ir and "read = 1.720000e+11 : f64" in ir
    back = Plan.from_json(plan.to_json())
    assert back.sm_rates == plan.sm_rates and back.sm_launch_s == plan.sm_launch_s


def test_a_pipelined_consumer_waits_for_the_producers_first_wave_of_chunks():
    # producer: 8 SMs x 25 GB/s over 2 GB in 100 MB chunks: its first 8 chunks (0.8 GB, 40 %)
    # complete together at t = 4 ms; a consumer of 20 chunks trails it by 1/20 more.
    p = sm_plan({"copy": 25 * GB}, sms=8, chunk=100 * MB)
    prod = p.steps[0]
    cons = PlanStep("fwd", "dispatch", "send", "nv", "p2p", ("keep",), pipelined_deps=("keep",), num_chunks=20,
                    flows=[Flow(r, r, 1 - r, 0.1 * GB, (f"link:nv:{r}>{1 - r}",)) for r in range(2)])
    p = dataclasses.replace(p, steps=[prod, cons], resources={**p.resources, "link:nv:0>1": 1000 * GB,
                                                                  "link:nv:1>0": 1000 * GB})
    aug = with_sm_terms(p)
    assert aug.steps[0].completion_lag == pytest.approx(0.4) and aug.steps[1].completion_lag == 0.0
    r = simulate(p)
    # the consumer's cap leaves 0 when the producer has moved 0.4 + 1/20 of its bytes
    assert r.step("fwd").start_s == pytest.approx(0.45 * 2.0 / 200)
    assert r.step("keep").end_s == pytest.approx(2.0 / 200)


def test_rows_per_token_for_the_expanded_chunks_of_output():

    plan = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched")).plan
    # top-8 of 256 experts, 128 per rank: 4 expected hits, given at least one (P = 0.9965)
    assert rows_per_token(plan) == pytest.approx(4 / 0.99651, rel=1e-4)


def test_a_role_pipelined_behind_a_producer_ends_one_chunk_on_one_sm_after_it():
    # producer: an RDMA-class link of 10 GB/s per rank delivers 1 GB in 100 MB chunks (0.1 s);
    # consumer: 8 SMs x 25 GB/s (200 GB/s, never the limit) permute it as it lands.  The last
    # chunk arrives at 0.1 s and is one SM's work: 100 MB / 25 GB/s = 4 ms, where the fluid
    # model alone would spread it over 8 SMs (0.5 ms): tail = 4 ms x (1 - 1/8), and the role
    # ends one chunk on one SM (4 ms) after the producer.
    flows = [Flow(r, r, 1 - r, 1.0 * GB, (f"link:rdma:{r}>{1 - r}",)) for r in range(2)]
    prod = PlanStep("rdma", "dispatch", "send", "rdma", "rdma", (), flows=flows, chunk_bytes=100 * MB, num_chunks=10)
    cons_flows = [Flow(r, r, r, 1.0 * GB, (f"hbm:{r}",)) for r in range(2)]
    cons = PlanStep("keep_far", "dispatch", "permute", "hbm", "local", ("rdma",), pipelined_deps=("rdma",),
                    flows=cons_flows, chunk_bytes=100 * MB, num_chunks=10)
    k = KernelPlan("dispatch_kernel", "kernel", "dispatch", 8, roles=[RolePlan("keep_far", "permuter", 0, 8, 8, "sm")])
    res = {"hbm:0": 3000 * GB, "hbm:1": 3000 * GB, "link:rdma:0>1": 10 * GB, "link:rdma:1>0": 10 * GB}
    p = Plan("t", 2, "test", 1, steps=[prod, cons], resources=res, kernels=[k], sm_rates={"copy": 25 * GB})
    aug = with_sm_terms(p, rdma_proxy=False)
    assert all(f.tail_s == pytest.approx(0.004 * 7 / 8) for f in aug.steps[1].flows)
    assert all(f.tail_s == 0.0 for f in aug.steps[0].flows)  # not pipelined behind anything
    r = simulate(p)
    assert r.step("keep_far").end_s - r.step("rdma").end_s == pytest.approx(0.004, rel=0.05)


def _chain(link_gbps: float):
    """rdma (a link of `link_gbps` per rank, 1 GB) -> keep_far (8 SMs x 25 GB/s, pipelined, 100 MB
    chunks) -> fwd (pipelined behind keep_far)."""
    flows = [Flow(r, r, 1 - r, 1.0 * GB, (f"link:rdma:{r}>{1 - r}",)) for r in range(2)]
    prod = PlanStep("rdma", "dispatch", "send", "rdma", "rdma", (), flows=flows, chunk_bytes=100 * MB, num_chunks=10)
    mid = PlanStep("keep_far", "dispatch", "permute", "hbm", "local", ("rdma",), pipelined_deps=("rdma",),
                   flows=[Flow(r, r, r, 1.0 * GB, (f"hbm:{r}",)) for r in range(2)], chunk_bytes=100 * MB, num_chunks=10)
    last = PlanStep("fwd", "dispatch", "send", "nv", "p2p", ("keep_far",), pipelined_deps=("keep_far",), num_chunks=10,
                    flows=[Flow(r, r, 1 - r, 1.0 * GB, (f"link:nv:{r}>{1 - r}",)) for r in range(2)])
    k = KernelPlan("dispatch_kernel", "kernel", "dispatch", 8, roles=[RolePlan("keep_far", "permuter", 0, 8, 8, "sm")])
    res = {"hbm:0": 3000 * GB, "hbm:1": 3000 * GB, "link:rdma:0>1": link_gbps * GB, "link:rdma:1>0": link_gbps * GB,
           "link:nv:0>1": 1000 * GB, "link:nv:1>0": 1000 * GB}
    return Plan("t", 2, "test", 1, steps=[prod, mid, last], resources=res, kernels=[k], sm_rates={"copy": 25 * GB})


@pytest.mark.parametrize("link_gbps,in_flight", [(10, 1), (100, 4), (400, 8), (4000, 8)])
def test_a_role_behind_a_producer_has_the_chunks_in_flight_its_rate_keeps_busy(link_gbps, in_flight):
    # keep_far runs no faster than the link feeding it (1 GB in 1/link_gbps s): by Little's law it
    # holds rate / 25 GB/s chunks in flight (1 behind 10 GB/s, 4 behind 100), at most its 8 SMs
    # (the wave lag of a role whose input is all there), each 100 MB of its 1 GB
    aug = with_sm_terms(_chain(link_gbps), rdma_proxy=False)
    assert aug.steps[1].completion_lag == pytest.approx(in_flight * 0.1)


def test_fwd_behind_a_slow_link_starts_one_chunk_after_the_link_not_one_wave():
    r = simulate(_chain(10), SimOptions(rdma_proxy=False))
    # rdma moves 1 GB at 10 GB/s (0.1 s); keep_far trails it by one of its 10 chunks; fwd waits
    # until keep_far's first chunk is complete (lag 0.1) and one chunk of its own more: keep_far
    # at 0.2, the link at 0.3 of its bytes.  With a wave of 8 chunks in flight it would be 0.9 + 0.1.
    assert r.step("fwd").start_s == pytest.approx(0.03)


def test_reduce_is_bounded_by_its_atomics_where_a_token_has_few_rows():

    four = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched")).plan
    rows = rows_per_token(four)
    assert 2.2 < rows < 2.3  # top-8 of 256 over 4 ranks: 2 expected rows, given a hit
    assert sm_rates(four) == four.sm_rates  # 12 x 2.2 = 26.4 GB/s: the declared 26 holds
    # top-2 of 256 over 4 ranks: 1.14 rows per token, 12 x 1.14 = 13.7 GB/s: `add` binds
    sparse = copy.deepcopy(four)
    sparse.workload.topk = 2
    assert 1.1 < rows_per_token(sparse) < 1.2
    assert sm_rates(sparse)["reduce"] == pytest.approx(12 * GB * rows_per_token(sparse))
    assert sm_rates(sparse)["copy"] == 44 * GB and sm_rates(sparse)["add"] == 12 * GB


def peer_plan(*, atomics=None, rates=None, kind="p2p", program="combine", verb="pull", rows=False,
              touches_output=True, sms=0, chunk=None, nbytes=1.0 * GB, topk=8) -> Plan:
    """One step between 2 ranks over link `nv` (1000 GB/s each way): rank r moves `nbytes` from
    the other rank to itself, reading `output` (combine) or writing it (dispatch) if told to; top-k
    of 256 experts, so a token hits ~topk / 2 expert rows of a rank."""
    flows = [Flow(r, 1 - r, r, nbytes, (f"link:nv:{1 - r}>{r}",)) for r in range(2)]
    src, dst = (("output",), "result") if program == "combine" else (("input",), "output")
    if not touches_output:
        src, dst = ("staging",), "staging2"
    st = PlanStep("intra", program, verb, "nv", kind, (), flows=flows, chunk_bytes=chunk, weighted=program == "combine",
                  rows=rows, src_buffers=src, dst_buffer=dst)
    kernels = []
    if sms:
        kernels = [KernelPlan(f"{program}_kernel", "kernel", program, sms,
                              roles=[RolePlan("intra", "mover", 0, sms, 8, "sm")])]
    return Plan("t", 2, "test", 1, steps=[st], resources={"link:nv:1>0": 1000 * GB, "link:nv:0>1": 1000 * GB},
                kernels=kernels, sm_rates=dict(rates or {}), atomics={"nv": atomics} if atomics else {},
                workload=WorkloadPlan(4096, 7168, "bf16", topk, 256, "blocked", True))


def test_a_combine_adding_into_a_peer_is_held_by_the_links_atomics():
    # 1 GB of bf16 partials is 2 GB of fp32 adds: at 100 GB/s of atomics per GPU pair, 20 ms
    p = peer_plan(atomics=100 * GB)
    aug = with_sm_terms(p)
    assert aug.resources["atomics:nv:1>0"] == pytest.approx(50 * GB)
    assert simulate(p).programs["combine"].step("intra").end_s == pytest.approx(1.0 / 50)
    assert simulate(p).programs["combine"].bottleneck.link_class == "nv atomics"
    # not declared: the link alone (1 ms)
    assert simulate(peer_plan()).programs["combine"].step("intra").end_s == pytest.approx(1.0 / 1000)


def test_link_atomics_bound_only_combine_steps_and_not_the_proxy_paths_rdma():
    assert simulate(peer_plan(atomics=100 * GB, program="dispatch", verb="send")).step("intra").end_s == \
        pytest.approx(1.0 / 1000)  # dispatch stores, it does not add
    rdma = peer_plan(atomics=100 * GB, kind="rdma")
    # the proxy path's receiver applies a landed chunk with local adds; the emulated RDMA roles
    # add into the peer themselves
    assert simulate(rdma, SimOptions(rdma_proxy=True)).programs["combine"].step("intra").end_s == \
        pytest.approx(1.0 / 1000)
    assert simulate(rdma, SimOptions(rdma_proxy=False)).programs["combine"].step("intra").end_s == \
        pytest.approx(1.0 / 50)


def test_a_send_into_output_counting_tokens_costs_its_sms_every_expert_row():

    # top-8 of 256 over 2 ranks: ~4 rows per token a rank receives; a send counting one copy per
    # token writes all of them (the role kernels), so 8 SMs x 25 GB/s move 200 / 4 GB/s of its flow
    tokens = peer_plan(rates={"copy": 25 * GB}, program="dispatch", verb="send", sms=8)
    expand = rows_per_token(tokens)
    assert 4.0 < expand < 4.1
    assert simulate(tokens).step("intra").end_s == pytest.approx(1.0 / (200 / expand))
    rows = peer_plan(rates={"copy": 25 * GB}, program="dispatch", verb="send", sms=8, rows=True)  # dedup none
    assert simulate(rows).step("intra").end_s == pytest.approx(1.0 / 200)
    elsewhere = peer_plan(rates={"copy": 25 * GB}, program="dispatch", verb="send", sms=8, touches_output=False)
    assert simulate(elsewhere).step("intra").end_s == pytest.approx(1.0 / 200)


def test_a_chunk_counts_expert_rows_only_where_the_flows_do():
    # 10 MB chunks (the plan's tokens x bytes per token), 8 SMs in a wave, 1 GB: a wave is 8 chunks,
    # 80 MB of a flow counting tokens, 8 x 10 MB x ~4 rows of a flow counting rows

    kw = dict(rates={"copy": 25 * GB}, program="dispatch", verb="send", sms=8, chunk=10 * MB)
    assert with_sm_terms(peer_plan(**kw)).steps[0].completion_lag == pytest.approx(0.08)
    rows = peer_plan(rows=True, **kw)
    assert with_sm_terms(rows).steps[0].completion_lag == pytest.approx(0.08 * rows_per_token(rows))


def test_link_post_reaches_the_ir_and_the_plan():
    built = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched"))
    assert built.plan.post_s == {"rdma": pytest.approx(10e-6)}
    assert "epcc.post_s = {rdma = 9.9999999999999991E-6 : f64}" in str(built.compilation.module)


def test_link_atomics_reach_the_ir_and_the_plan_and_survive_plan_json():
    built = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched"))
    plan = built.plan
    assert plan.atomics == {"nvlink": 215 * GB}
    assert "epcc.atomics_Bps = {nvlink = 2.150000e+11 : f64}" in str(built.compilation.module)
    back = Plan.from_json(plan.to_json())
    assert back.atomics == plan.atomics
    rows = {(s.program, s.name): s.rows for s in plan.steps}
    assert rows == {(s.program, s.name): s.rows for s in back.steps}
    # permutes and their reverses count rows; sends and their reverses one copy per token
    assert rows[("dispatch", "keep")] and rows[("combine", "keep_far")]
    assert not rows[("dispatch", "intra")] and not rows[("combine", "fwd")] and not rows[("combine", "rdma")]
