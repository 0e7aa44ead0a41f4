"""The direct kernels' SM pool in the simulator (compiler/sim/direct.py): its charges against an
independent count of the rows a rank's SMs store, load and reduce, and the launches.  The rates
are the tests' own (RATES, LAUNCH, META), not the shipped schedule's fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from epcc.costmodel.uniform import hit_probability, ranks_per_token, rows_per_token
from epcc.plan import DirectKernels
from epcc.sim import SimOptions, simulate
from epcc.sim.build import build_plan
from epcc.sim.direct import META_FINISH_S, META_PEER_S, drain_s, meta_s, with_direct_pool

REPO = Path(__file__).resolve().parents[2]
H200X4 = REPO / "schedules" / "h200x4.sched"
RATES = {"copy": 50e9, "read": 200e9, "reduce": 80e9}
LAUNCH = 5e-6
META = 4e-6


def kernels(sms=24, dispatch_launches=3, passes=2) -> DirectKernels:
    return DirectKernels({"dispatch": sms, "combine": sms}, {"dispatch": dispatch_launches, "combine": 1},
                         {"dispatch": passes})


def with_rates(plan, rates=RATES, launch=LAUNCH, meta=META):
    return dataclasses.replace(plan, sm_rates=dict(rates), sm_launch_s=launch, sm_meta_s=meta)


def charges(plan, resource: str, program: str) -> float:
    """What the flows of `program` charge `resource` (bytes x weight)."""
    total = 0.0
    for s in plan.steps:
        if s.program != program:
            continue
        for f in s.flows:
            w = dict(zip(f.resources, f.weights or (1.0,) * len(f.resources)))
            total += f.bytes * w.get(resource, 0.0)
    return total


def counted(plan) -> dict:
    """Per rank, counted from the workload alone (uniform routing): rows stored and loaded by its
    SMs in dispatch, rows reduced and stored in combine, rows written into its memory."""
    wl = plan.workload
    R, T, K = plan.num_ranks, wl.tokens, wl.topk
    hits = T * hit_probability(wl.experts, K, wl.experts // R)  # a rank's tokens hitting one GPU
    return {
        # its output's T x K rows (its own local rows, its first row at each peer, the replicas of
        # the peers' rows on it); its input once, and each token received from a peer once
        "dispatch_stored": T * K, "dispatch_loaded": T + (R - 1) * hits,
        # every row of its output reduced and one partial per record stored; the partials of its
        # tokens (one per GPU each hits) reduced and one output row per token stored
        "combine_reduced": T * K + R * hits, "combine_stored": R * hits + T,
        "dispatch_hbm": T * K, "combine_hbm": R * hits + T,
    }


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_pool_charges_what_the_ranks_sms_store_load_and_reduce(ranks, ep2):
    plan = with_rates(build_plan(str(ep2 if ranks == 2 else H200X4)).plan)
    assert plan.num_ranks == ranks
    aug, _ = with_direct_pool(plan, kernels())
    r = RATES
    n = counted(plan)
    row, crow = plan.bytes_per_token, plan.workload.hidden * 2  # flows' bytes per dispatched / combined row
    for rank in range(ranks):
        # copy-equivalent bytes: a stored byte 1, a loaded one copy / read, a reduced one copy / reduce
        want = row * (n["dispatch_stored"] + n["dispatch_loaded"] * r["copy"] / r["read"])
        assert charges(aug, f"sm:dispatch:{rank}", "dispatch") == pytest.approx(want, rel=1e-6)
        want = crow * (n["combine_stored"] + n["combine_reduced"] * r["copy"] / r["reduce"])
        assert charges(aug, f"sm:combine:{rank}", "combine") == pytest.approx(want, rel=1e-6)
        assert charges(aug, f"hbm:{rank}", "dispatch") == pytest.approx(row * n["dispatch_hbm"], rel=1e-6)
        assert charges(aug, f"hbm:{rank}", "combine") == pytest.approx(crow * n["combine_hbm"], rel=1e-6)
    assert aug.resources["sm:dispatch:0"] == 24 * r["copy"] and aug.resources["sm:combine:1"] == 24 * r["copy"]
    # the links carry the flows' bytes as the plan has them
    push = next(f for f in aug.step("push").flows if f.src != f.dst)
    assert all(w == 1.0 for res, w in zip(push.resources, push.weights) if res.startswith("link:"))


def test_without_read_loads_cost_nothing_and_without_reduce_copy_stands_in(ep2):
    plan = build_plan(str(ep2)).plan
    n = counted(plan)
    aug, _ = with_direct_pool(with_rates(plan, {"copy": 50e9}), kernels())
    assert charges(aug, "sm:dispatch:0", "dispatch") == pytest.approx(plan.bytes_per_token * n["dispatch_stored"])
    crow = plan.workload.hidden * 2
    assert charges(aug, "sm:combine:0", "combine") == \
        pytest.approx(crow * (n["combine_stored"] + n["combine_reduced"]))


def test_a_program_bound_by_its_pool_takes_its_work_over_its_sms(ep2):
    plan = with_rates(build_plan(str(ep2)).plan)
    plan = dataclasses.replace(plan, resources={k: 1e18 for k in plan.resources})  # links and HBM never bind
    k = kernels(32)
    res = simulate(plan, SimOptions(direct=k))
    aug, _ = with_direct_pool(plan, k)
    work = charges(aug, "sm:dispatch:0", "dispatch") / (32 * RATES["copy"])
    d = res.programs["dispatch"]
    assert d.resources["sm:dispatch:0"].work_s == pytest.approx(work)
    # one exposed launch of 3, two metadata passes (`meta`, then the finishing pass) and the one peer's
    # publishing, the 3 us metadata
    # exchange, the pool busy throughout, then the last flow's latency (keep, over the 1 us local
    # link: the biggest flow ends last at equal rates; the sends, drain and all, end before it)
    assert d.makespan_s == pytest.approx(LAUNCH + META + META_FINISH_S + META_PEER_S + 3e-6 + work + 1e-6, rel=1e-6)
    assert d.step("push").end_s < d.step("keep").end_s
    assert d.bottleneck.link_class == "sm"


def test_the_drain_is_one_wave_of_first_phase_records_per_sm(ep2):
    plan = with_rates(build_plan(str(ep2)).plan)
    wl = plan.workload
    e, h = rows_per_token(plan), ranks_per_token(plan)
    row, crow = plan.bytes_per_token, wl.hidden * 2
    send = row * (1 / RATES["copy"] + 1 / (h * RATES["read"]))  # a record sent: one row stored, 1/h loaded
    reduce = crow * (e / RATES["reduce"] + 1 / RATES["copy"])  # a record reduced from e rows, partial stored
    for sms, waves in ((24, 16), (4096, wl.tokens * h / 4096)):  # 16 warps per SM, or fewer records than that
        k = kernels(sms)
        assert drain_s(plan, "dispatch", k, e, h) == pytest.approx(waves * send)
        assert drain_s(plan, "combine", k, e, h) == pytest.approx(waves * reduce)
    k = dataclasses.replace(kernels(24), warps={"dispatch": 4})
    assert drain_s(plan, "dispatch", k, e, h) == pytest.approx(4 * send)
    assert drain_s(with_rates(plan, {}), "dispatch", kernels(), e, h) == 0.0
    # the flows between two GPUs end that much after their bytes; a rank's own flows do not
    aug, _ = with_direct_pool(plan, kernels(24))
    for s in aug.steps:
        for f in s.flows:
            if f.bytes > 0 and any(r.startswith("sm:") for r in f.resources):
                want = drain_s(plan, s.program, kernels(24), e, h) if f.src != f.dst else 0.0
                assert f.tail_s == pytest.approx(want), (s.name, f.src, f.dst)


@pytest.mark.parametrize("launches, passes", [(3, 2), (1, 1), (1, 2), (0, 0)])
def test_one_launch_and_the_metadata_passes_hold_back_a_programs_first_steps(launches, passes):
    # later launches queue behind the running kernel: only the first is charged
    plan = with_rates(build_plan(str(H200X4)).plan)
    res = simulate(plan, SimOptions(direct=kernels(dispatch_launches=launches, passes=passes)))
    d, c = res.programs["dispatch"], res.programs["combine"]
    before = min(1, launches) * LAUNCH + (META + (passes - 1) * META_FINISH_S + 3 * META_PEER_S if passes else 0.0)
    # (4 ranks: 3 peers)
    assert d.step("meta").ready_s == pytest.approx(before) and d.launch_s == pytest.approx(before)
    assert min(s.ready_s for s in c.steps) == pytest.approx(LAUNCH) and c.launch_s == pytest.approx(LAUNCH)
    assert d.serial_s == pytest.approx(before + sum(s.alone_s for s in d.steps))
    assert d.makespan_s == pytest.approx(max(s.end_s for s in d.steps))


def test_the_metadata_publishes_to_every_peer_rank(ep2):
    # `meta` for a pass, META_FINISH_S for a second, then META_PEER_S per peer: 1 of 2 ranks, 3 of 4;
    # nothing without a pass (a
    # cached dispatch) or without the `sm` line's `meta` (a topology that does not charge metadata)
    two, four = (with_rates(build_plan(str(path)).plan) for path in (ep2, H200X4))
    assert meta_s(two, 1) == pytest.approx(META + META_PEER_S)
    assert meta_s(four, 1) == pytest.approx(META + 3 * META_PEER_S)
    assert meta_s(four, 2) - meta_s(two, 2) == pytest.approx(2 * META_PEER_S)
    assert meta_s(four, 2) - meta_s(four, 1) == pytest.approx(META_FINISH_S)
    assert meta_s(four, 0) == 0.0 and meta_s(with_rates(four, meta=0.0), 2) == 0.0


def test_the_direct_kernels_do_not_chunk():
    # no credits and nothing to wait for between chunks: a flow pays its link's latency once
    plan = with_rates(build_plan(str(H200X4)).plan)
    assert plan.step("push").num_chunks > 1
    aug, _ = with_direct_pool(plan, kernels())
    assert all(s.num_chunks == 1 and s.chunk_bytes is None for s in aug.steps)
    res = simulate(plan, SimOptions(direct=kernels()))
    assert all(s.num_chunks == 1 for p in res.programs.values() for s in p.steps)


def test_the_pool_and_hbm_are_reported_as_their_classes():
    plan = with_rates(build_plan(str(H200X4)).plan)
    d = simulate(plan, SimOptions(direct=kernels())).programs["dispatch"]
    assert {"sm", "hbm", "nvlink"} <= set(d.link_classes)  # hbm: the local link, though sends write it too
    assert d.link_classes["sm"].instances == 4 and d.link_classes["hbm"].kind == "local"


def test_without_a_copy_rate_there_is_no_pool():
    plan = with_rates(build_plan(str(H200X4)).plan, rates={})
    res = simulate(plan, SimOptions(direct=kernels()))
    assert not any(r.startswith("sm:") for p in res.programs.values() for r in p.resources)
    assert res.sm_model["model"] == "direct" and "no SM pool" in res.sm_model["text"]


def test_the_model_applied_is_described():
    plan = build_plan(str(H200X4)).plan
    direct = simulate(with_rates(plan), SimOptions(direct=kernels())).sm_model
    assert direct["model"] == "direct" and direct["sms"] == {"dispatch": 24, "combine": 24}
    e, h = rows_per_token(plan), ranks_per_token(plan)
    dd, dc = (drain_s(with_rates(plan), p, kernels(), e, h) * 1e6 for p in ("dispatch", "combine"))
    assert direct["text"] == (
        "direct kernels: one pool of SMs per rank and program, shared by its steps (dispatch 24 SMs, 3 launches, "
        f"2 metadata passes, drain {dd:.1f} us; combine 24 SMs, 1 launch, drain {dc:.1f} us; sm copy 50 GB/s, "
        "read 200 GB/s, reduce 80 GB/s; launch 5 us, meta 4 us (a second pass 14.7 us) + 0.35 us per peer rank)")
    assert direct["meta_passes"] == {"dispatch": 2} and direct["meta_us"] == pytest.approx(4.0)
    assert direct["drain_us"] == pytest.approx({"dispatch": dd, "combine": dc})
    assert simulate(with_rates(plan)).sm_model["model"] == "roles"
    assert simulate(with_rates(plan, rates={}, launch=0.0)).sm_model["model"] == "links"


def test_direct_kernels_are_checked():
    with pytest.raises(ValueError, match="sms"):
        DirectKernels({"dispatch": 0}, {})
    with pytest.raises(ValueError, match="launches"):
        DirectKernels({"dispatch": 24}, {"dispatch": -1})
    with pytest.raises(ValueError, match=r"DirectKernels.meta_passes\['dispatch'\] must be an integer >= 0, got -1"):
        DirectKernels({"dispatch": 24}, {}, {"dispatch": -1})
    with pytest.raises(ValueError, match=r"DirectKernels.warps\['combine'\] must be an integer >= 1, got 0"):
        DirectKernels({"dispatch": 24}, {}, {}, {"combine": 0})
