"""kernel-formation's sizing of the GPU proxy path's pack and unpack roles (proxy_sms): enough
blocks that the link does not wait on them, between PROXY_MIN_SMS and PROXY_MAX_SMS, carried into
the IR and plan.json."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from epcc import pipeline
from epcc.passes.kernel_formation import PROXY_MAX_SMS, proxy_sms
from epcc.plan import Flow, Plan, PlanStep
from epcc.costmodel.rates import PROXY_MIN_SMS

GB = 1e9
REPO = Path(__file__).resolve().parents[2]


def rdma_plan(link_gbps: float, program: str = "dispatch", rates=None) -> Plan:
    flows = [Flow(0, 0, 1, 64e6, ("link:rdma:0>1",), 5e-6), Flow(1, 1, 0, 64e6, ("link:rdma:1>0",), 5e-6)]
    st = PlanStep("rdma", program, "send", "rdma", "rdma", (), flows=flows, chunk_bytes=1e6, num_chunks=64, depth=8)
    links = {"link:rdma:0>1": link_gbps * GB, "link:rdma:1>0": link_gbps * GB}
    return Plan("t", 2, "test", 1, steps=[st], resources=links,
                sm_rates=dict(rates if rates is not None else {"copy": 44 * GB, "reduce": 23 * GB, "add": 12 * GB}))


@pytest.mark.parametrize("gbps, dispatch, combine", [
    (13, (4, 4), (4, 4)),        # the floor
    (50, (4, 4), (4, 5)),        # combine: partials packed at 22 GB/s (fp32 read), applied at `add` 12 GB/s
    (100, (4, 4), (5, 9)),
    (400, (10, 10), (PROXY_MAX_SMS, PROXY_MAX_SMS)),   # 34 unpack blocks wanted: the ceiling
])
def test_blocks_follow_the_link_over_the_per_sm_rate(gbps, dispatch, combine):
    assert proxy_sms(rdma_plan(gbps), rdma_plan(gbps).steps[0]) == dispatch
    p = rdma_plan(gbps, "combine")
    assert proxy_sms(p, p.steps[0]) == combine


def test_without_sm_rates_each_side_gets_the_floor():
    p = rdma_plan(400, rates={})
    assert proxy_sms(p, p.steps[0]) == (PROXY_MIN_SMS, PROXY_MIN_SMS)


def test_a_rank_with_two_peers_needs_the_blocks_for_both():
    # rank 0 sends to ranks 1 and 2 over links of their own: 2 x 50 GB/s leave rank 0
    flows = [Flow(0, 0, 1, 64e6, ("link:rdma:0>1",), 5e-6), Flow(0, 0, 2, 64e6, ("link:rdma:0>2",), 5e-6)]
    st = PlanStep("rdma", "dispatch", "send", "rdma", "rdma", (), flows=flows, chunk_bytes=1e6, num_chunks=64, depth=8)
    p = Plan("t", 3, "test", 1, steps=[st], resources={"link:rdma:0>1": 50 * GB, "link:rdma:0>2": 50 * GB},
             sm_rates={"copy": 20 * GB})
    assert proxy_sms(p, st) == (5, 4)  # 100 GB/s packed by rank 0; each receiver applies 50


def test_the_sizes_reach_the_ir_and_survive_plan_json():
    c = pipeline.run(str(REPO / "schedules" / "h200x2_2vnode.sched"))
    plan = c.passes.get("plan")
    roles = {(k.program, r.step): r for k in plan.kernels if k.kind == "proxy" for r in k.roles}
    assert {key: (r.pack_sms, r.unpack_sms) for key, r in roles.items()} == {
        ("dispatch", "rdma"): (4, 4), ("combine", "rdma"): (4, 5)}
    sm_roles = [r for k in plan.kernels if k.kind == "kernel" for r in k.roles]
    assert all(r.pack_sms == r.unpack_sms == 0 for r in sm_roles)
    back = Plan.from_json(plan.to_json())
    assert [dataclasses.astuple(r) for k in back.kernels for r in k.roles] == \
        [dataclasses.astuple(r) for k in plan.kernels for r in k.roles]
    text = str(c.module)
    assert "epcc.pack_sms = 4 : i64, epcc.unpack_sms = 5 : i64" in text
