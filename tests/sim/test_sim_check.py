"""`epcc simulate` against the ep_bench reports shipped in results/raw/ (bench/sim_check.py, on the
CPU): every current record within 10 %, the known misses named; and the two terms fitted on them,
the GPU's fp32 red.add rate (costmodel/rates.py RED_BPS) and the Buffer call's copies
(sim/calls.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from epcc.cli.simulate import sim_options
from epcc.costmodel.rates import FP32_ADD_PER_FLOW_BYTE, GATHER_ROWS, RED_BPS, red_bytes_per_flow_byte
from epcc.plan import Flow, Plan, PlanStep
from epcc.runtime.engines.cuda_table.launcher import ROLE_SIDES, role_step
from epcc.runtime.layout import compute_layout
from epcc.sim import SimOptions, simulate
from epcc.sim.blocks import block_roles, schedule_roles
from epcc.sim.build import build_plan
from epcc.sim.calls import COPY_EFFICIENCY, call_bytes, call_terms, local_rate, reads_caller_rows, staged_tokens
from epcc.sim.meta import GAP_S
from epcc.sim.sm_terms import with_sm_terms

REPO = Path(__file__).resolve().parents[2]
RAW = sorted((REPO / "results" / "raw").glob("*.json"))

FP8_24 = ("direct kernels, fp8, 24 SMs, 4 x H100 (2026-11-27): the kernel's end 0.341 ms against the model's NVLink-bound "
          "0.305 (82.4 MB per rank at 279 GB/s; the SM pool's work 0.197 ms); on 64 SMs the same kernel ends at 0.307 "
          "(-1 %).  Not a cost per row, which fp8's rows (7 KB and 224 B of scales, the bf16 row's count) would feel "
          "twice: bf16's kernel slows as much from 64 to 24 SMs (0.557 -> 0.612 ms, +10 %; fp8 +11 %), and a per-row "
          "term that made up fp8's 35 us (SM work x 1.7) would put the 2 x H200 fp8 dispatch at 24 SMs (0.226 ms, "
          "test_direct_measured; SM work 0.184) near 0.34.  Both kernels run ~10 % longer on 24 SMs than the fluid "
          "max of SMs (2/3 of the link's time) and NVLink gives; bf16's record stays within 10 % only because the "
          "model's link is 5 % slow for it (64 SMs: 0.583 against 0.557)")

TOK_T128_2 = ("token-major combine at 128 tokens, 2 x H100 (2026-11-27): 0.0234 ms against the model's 0.0209; the fresh "
              "row's combine of the same run 0.0232 (-10 %): the model's rates are fit on 2 x H200, where the expert-major "
              "128-token combine is predicted exactly (0.026), and the H100 runs of that twin are slower by as much "
              "(h200x2_t128, 2026-11-26: 0.028 against 0.025, -9 %; h200x4_t128 2026-11-27: -7 / -8 %)")

H100_128_2 = ("128 tokens on 2 x H100 (2026-11-27 decode run, 24 SMs): the rates are fit on 2 x H200, where the "
              "expert-major 128-token dispatch and combine are predicted within 7 % (test_direct_measured), and the 2 x "
              "H100 kernels run slower: the cached dispatch 28.5 us against 25.1 (the fresh one 34.8 against 31.3, the "
              "metadata gap 6.3 us as modelled), the combine 28 us against 25 (-9 % on 2026-11-26 too); the 4 x H100 "
              "twin of the same day is within 3 % (h200x4_t128: cached dispatch 37.0 / 37.1 us)")

COMBINE_96_2 = ("expert-major combine at 96 SMs, 2 x H100 (2026-11-27): 0.281 / 0.279 ms (bf16 / fp8) against the "
                "model's NVLink bound 0.232 (58 MB of partials per rank at 450 GB/s x 62 % = 279 GB/s: not 450; at 24 "
                "SMs the model is within 6 %).  The link is not what it misses: the token-major combine of the same "
                "run moves the same bytes (one bf16 row per token and GPU) in 0.220 ms from 48 to 96 SMs, 4 % under "
                "the model, and a link at the SM store rate of bench/sm_probe.cu (366 GB/s per GPU at 96-132 "
                "blocks, 342 at 24) would put it at ~0.17.  The expert-major combine loads e ~ 4 expert rows per "
                "partial (470 MB per rank): 1.7 TB/s of HBM3 loads on H100 (3.35 TB/s), where the same kernel on "
                "2 x H200 (4.8 TB/s) ends at 0.216 ms (test_direct_measured): the model charges no loads to HBM "
                "and has one HBM for both GPUs")

KNEE_2 = ("token-major, 2 x H100 (2026-11-27 SM sweep), 12 and 16 SMs: the fluid model takes the larger of the "
          "SMs' time and NVLink's (the knee at ~14 SMs); measured, the SMs slow as the link fills: the combine's SM-ms "
          "(time x SMs) 3.3 at 8 SMs, 3.9 at 12, 4.4 at 16, 5.9 at 24, so 12 and 16 SMs run 13-18 % over the "
          "max (0.322 / 0.278 ms against 0.280 / 0.229), the dispatch at 12 SMs 12 %; 4-8 and 24-96 SMs within 9 %")

VNODE_COMBINE_H200 = ("h200x4_2vnode_50 combine on 4 x H200 after the paced roles (2026-11-27): 1.927 / 1.931 ms against "
                      "2.141 (+11 %).  The kernel is within 8 % (its end 1.499 against 1.616): its rdma role ends at "
                      "the link's pace from 0.320 ms measured, from 0.441 in the model, which starts it behind fwd's "
                      "first wave of chunks (12 of 29: 41 % of its bytes, 0.41 ms); keep, keep_far, intra and fwd end "
                      "within 10 % (0.83-1.00 against 0.92-1.01).  The rest is the Buffer's copy of the expert "
                      "outputs beside the kernel: 0.428 ms on H200 against the model's 0.525, whose copy rate is one "
                      "for H100 and H200 (sim/calls.py COPY_EFFICIENCY, 2.6 TB/s: H100 2.4, H200 3.2); the 4 x H100 "
                      "run of the same day is within 4 % (2.053: its call less its kernel 0.551 ms)")

VNODE_PROXY_COMBINE_H200 = ("h200x4_2vnode_50_proxy combine, cached row, on 4 x H200 (2026-11-28): 2.019 ms against "
                            "2.241 (+11 %; iterations 1.990-2.126); its fresh row 2.054 (+9 %), and "
                            "h200x4_2vnode_50_proxy_dev, the same combine kernel with the GPU's tables, 1.970 / 1.971 "
                            "against 2.146 (+9 %).  VNODE_COMBINE_H200's two causes: the kernel ends at 1.641 against "
                            "1.784 (+9 %; _proxy_dev's 1.639), its rdma step (the proxy's pack and unpack roles) at "
                            "the link's pace from 0.29-0.31 ms measured (the pack's start; the unpack's 0.42-0.45) to "
                            "1.62-1.64 (1.32-1.34 ms per rank), from 0.441 in the model to 1.784 (1.343 ms); keep, "
                            "keep_far, intra and fwd end within 9 % (0.869-1.113 against 0.919-1.011).  The call "
                            "beyond the kernel: 0.378 ms measured (the fresh row 0.413) against the model's 0.457, "
                            "which charges the Buffer's copy of the expert outputs (0.360 ms at COPY_EFFICIENCY, one "
                            "rate for H100 and H200) and, with host-built tables, the partials cleared in the combine "
                            "call (0.090 ms; with the rows' counts and two more launches the model charges 0.095 more "
                            "than for _proxy_dev, whose partials are cleared beside the dispatch and whose call holds "
                            "0.332 beyond its kernel against the model's 0.362); measured, the host-table call holds "
                            "0.046 ms more than _proxy_dev's (the fresh rows 0.082)")

UBB2X2_TWINS = ("h200x4_ubb2x2_50 combine (4 x H200 and 4 x H100, 2026-11-27; 4 x H200, 2026-11-28): +11 to +24 % "
                "(4 x H200 after the paced roles: 2.574 / 2.517 ms against 3.118, the kernel's end 2.301 against "
                "2.829; 4 x H100: 2.709 / 2.738).  What the model misses is the twins' adds: near_twin and far_twin "
                "end at 1.145 / 1.312 ms on 4 x H200 (1.233 / 1.331 on 4 x H100) against 1.914, because the model "
                "starts them at 0.895 ms, behind final.from_twin's first wave of chunks (24 blocks of its ~29 chunks: "
                "82 % of its bytes), where the GPU starts them at 0.409 / 0.587 ms (4 x H200) with final.from_twin "
                "ending at 0.948; the three gathers end within 12 % (0.64-0.95 against 0.72-1.00), and nic and "
                "reorder follow the twins at the link's pace (nic 1.17 ms measured, 1.18 simulated).  The GPU proxy "
                "twins (_proxy_dev, _proxy: the same combine but its nic step) miss by as much for the same roles.  "
                "4 x H200 again on 2026-11-28 (one multihop run, EP4): 2.362 / 2.382 ms against 2.829 "
                "(+20 / +19 %), the kernel's end 2.277 against 2.829 (+24 %); _proxy_dev 2.562 / 2.548 against 2.995 "
                "(+17 / +18 %, its kernel 2.519 against 2.995); _proxy 2.792 / 2.764 against 3.216 (+15 / +16 %, its "
                "kernel 2.499 against 2.995).  The same roles in all three: near_twin and far_twin start at "
                "0.39-0.46 / 0.55-0.68 ms across the ranks (0.895 in the model) and end by 1.160-1.176 / 1.269-1.296 "
                "(1.914); final.from_twin ends by 0.935-0.961 (1.004), final.sendbuf and final.from_far by "
                "0.578-0.716 (0.715); h200x4_ubb2x2_50's nic runs 1.16-1.18 ms per rank from 1.04-1.07 ms (1.175 "
                "simulated, from 1.530)")

TOK_48_H200 = ("token-major combine at 48 SMs, 4 x H200 (2026-11-27, and 2026-11-28 below): 0.528 ms (bf16 and fp8) "
               "against the model's 0.592 (+12 %): NVLink-bound in the model at 24 and 48 SMs alike (160 MB of "
               "partials per rank at the declared 279 GB/s: 0.571 ms of link).  Measured, the link is not one rate: "
               "the kernel ends at 0.564 on 24 SMs (4 x H200 and 4 x H100 alike: 283 GB/s, within 4 % of the model) "
               "and 0.521 on 48 (305 GB/s): the SMs slow as the link fills (the 2 x H100 sweep's KNEE_2), and a link "
               "at 305 GB/s would put the expert-major combines, which the same 279 fits (test_direct_measured), 8 % "
               "low.  Again on 2026-11-28 (4 x H200, EP4): 0.527 / 0.526 ms (bf16, fresh / cached) and "
               "0.526 / 0.525 (fp8) against 0.592 (+12 / +13 %); the kernel ends at 0.521 (bf16) and 0.519 (fp8) on "
               "48 SMs against the model's 0.583, and at 0.564 on 24 SMs (the call 0.567 there, +4 %)")

H100_PROXY_DEV_4 = ("h200x4_2vnode_50_proxy_dev fresh dispatch on 4 x H100 after the paced roles (2026-11-27): 1.629 ms "
                    "(median; min 1.506, iterations 1.506-1.848) against 1.433 (-12 %); the cached row of the same run "
                    "1.561 (-8 %, iterations 1.500-1.627).  The kernel, whose rates are fit on H200, runs slower on "
                    "H100 (as h200x2_2vnode_50's did on 2 x H100 before the paced roles: its end 1.407 ms, 1.344 on "
                    "2 x H200, 2026-11-27): it ends at 1.458 ms against 1.307 (-10 %), where on 4 x H200 the same bundle's "
                    "kernel ends at 1.389 (-6 %, 2026-11-27 before-report, the proxy path unchanged since); the fresh "
                    "row's spread (0.34 ms) is what takes it past 10 %")

# (report, bundle, row, program) -> why the model misses it by more than 10 % (the test fails once it does not)
KNOWN_MISSES = {
    ("2026-11-26_4xH100_ep_bench_b.json", "h200x4_fp8", "epcc", "dispatch"):
        "direct kernels, fp8, 24 SMs, 4 x H100: NVLink-bound in the model (82.4 MB per rank at 279 GB/s); the kernel "
        "moved it at 244 GB/s (timeline end 0.338 ms), where the bf16 kernel of the same run moved 160 MB at 263 and "
        "NCCL's all_to_all 279 (fp8) and 293 GB/s (bf16): ~35-50 us beyond the link, which the 2026-11-27 run puts "
        "on the 24 SMs (on 64 SMs the same kernel ends within 1 % of the model; FP8_24 says why it is not per row)",
    ("2026-11-27_4xH100_ep_bench.json", "h200x4_fp8", "epcc@24", "dispatch"): FP8_24,
    ("2026-11-27_4xH100_ep_bench.json", "h200x4_fp8", "epcc_cached@24", "dispatch"): FP8_24,
    ("2026-11-27_2xH100_ep_bench_token.json", "h200x2_tok_t128", "epcc_cached", "combine"): TOK_T128_2,
    **{("2026-11-27_2xH100_ep_bench_decode.json", "h200x2_tok_t128", row, "combine"): TOK_T128_2
       for row in ("epcc@24", "epcc_cached@24")},
    **{("2026-11-27_2xH100_ep_bench_decode.json", "h200x2_t128", row, p): H100_128_2
       for row, p in (("epcc@24", "dispatch"), ("epcc_cached@24", "dispatch"), ("epcc@24", "combine"))},
    **{("2026-11-27_2xH100_ep_bench_targets.json", b, row, "combine"): COMBINE_96_2
       for b in ("h200x2", "h200x2_fp8") for row in ("epcc@96", "epcc_cached@96")},
    **{("2026-11-27_2xH100_ep_bench_tok_sms.json", b, f"{row}@{n}", p): KNEE_2
       for b in ("h200x2_tok", "h200x2_tok_fp8") for row in ("epcc", "epcc_cached") for n, p in
       ((12, "dispatch"), (12, "combine"), (16, "combine"))},
    **{("2026-11-27_4xH200_ep_bench_multihop.json", "h200x4_2vnode_50", row, "combine"): VNODE_COMBINE_H200
       for row in ("epcc", "epcc_cached")},
    **{(report, b, row, "combine"): UBB2X2_TWINS for report, b in
       (("2026-11-27_4xH200_ep_bench_multihop.json", "h200x4_ubb2x2_50"),
        ("2026-11-28_4xH200_ep_bench_multihop.json", "h200x4_ubb2x2_50"),
        ("2026-11-28_4xH200_ep_bench_multihop.json", "h200x4_ubb2x2_50_proxy_dev"),
        ("2026-11-28_4xH200_ep_bench_multihop.json", "h200x4_ubb2x2_50_proxy"),
        ("2026-11-27_4xH100_ep_bench_multihop_paced.json", "h200x4_ubb2x2_50"),
        ("2026-11-27_4xH100_ep_bench_multihop_paced.json", "h200x4_ubb2x2_50_proxy_dev"),
        ("2026-11-27_4xH200_ep_bench_multihop_before.json", "h200x4_ubb2x2_50_proxy_dev"),
        ("2026-11-27_4xH200_ep_bench_multihop_before.json", "h200x4_ubb2x2_50_proxy"),
        ("2026-11-27_4xH100_ep_bench_multihop_combine_before.json", "h200x4_ubb2x2_50"),
        ("2026-11-27_4xH100_ep_bench_multihop_in_kernel.json", "h200x4_ubb2x2_50"))
       for row in ("epcc", "epcc_cached")},
    **{(report, b, f"{row}@48", "combine"): TOK_48_H200
       for report in ("2026-11-27_4xH200_ep_bench_token.json", "2026-11-28_4xH200_ep_bench_token.json")
       for b in ("h200x4_tok", "h200x4_tok_fp8") for row in ("epcc", "epcc_cached")},
    ("2026-11-28_4xH200_ep_bench_multihop.json", "h200x4_2vnode_50_proxy", "epcc_cached", "combine"):
        VNODE_PROXY_COMBINE_H200,
    ("2026-11-27_4xH100_ep_bench_multihop_paced.json", "h200x4_2vnode_50_proxy_dev", "epcc", "dispatch"):
        H100_PROXY_DEV_4,
}


@pytest.fixture(scope="module")
def sim_check(bench_script):
    return bench_script("sim_check")


@pytest.fixture(scope="module")
def records(sim_check):
    assert RAW, "results/raw/ holds no ep_bench report"
    return sim_check.collect(RAW)


def test_every_current_record_within_ten_percent(records):
    current = [r for r in records if not r.superseded]
    assert len(current) >= 30
    bad = [f"{r.report} {r.bundle} {r.row} {r.program}: measured {r.measured_ms:.3f} ms, predicted "
           f"{r.predicted_ms:.3f} ({r.error * 100:+.0f} %{', the kernel' if r.kernel_only else ''})" for r in current
           if abs(r.error) > 0.10 and (r.report, r.bundle, r.row, r.program) not in KNOWN_MISSES]
    assert not bad, "\n".join(bad)


def test_known_misses_still_miss(records):
    """A known miss the model now predicts leaves KNOWN_MISSES (and the docs' table) out of date."""
    seen = {(r.report, r.bundle, r.row, r.program): r for r in records}
    for key, why in KNOWN_MISSES.items():
        assert key in seen, f"{key}: not in the reports"
        assert not seen[key].superseded, f"{key} times code since changed ({seen[key].superseded}): not a miss to keep"
        assert abs(seen[key].error) > 0.10, f"{key} is now within 10 % ({seen[key].error * 100:+.0f} %): {why}"


def test_multi_hop_combines_within_ten_percent(records):
    """The records the calls and red terms were fitted for: every multi-hop combine of the current code
    (h200x4_ubb2x2_50's were all timed while the Buffer still copied the expert outputs in, which its
    plan's combine now reads in place: SUPERSEDED; h200x2_2vnode's current ones are the 2 x H100 run
    with keep_far on 16 SMs, 2026-11-27)."""
    got = {(r.bundle, r.row) for r in records if not r.superseded and r.program == "combine" and "vnode" in r.bundle
           or not r.superseded and r.program == "combine" and "ubb" in r.bundle}
    assert {("h200x4_2vnode_50", "epcc"), ("h200x2_2vnode_50", "epcc"), ("h200x2_2vnode_13", "epcc")} <= got
    for r in records:
        if (r.bundle, r.row) in got and r.program == "combine" and not r.superseded \
                and (r.report, r.bundle, r.row, r.program) not in KNOWN_MISSES:
            assert abs(r.error) <= 0.10, (r.report, r.bundle, r.error)


def test_kernels_match_the_role_timelines_where_the_call_misses_before(records):
    """The combines' kernels against the timeline's end, after the paced roles (2026-11-27): h200x2_2vnode_50's
    within 7 % on 2 x H100 with keep_far on 16 SMs and ramped (-5.5 %: the model's rdma role ends 1.20 ms into
    the kernel where the GPU's ended 1.27; -6.0 % with the combine kernel writing the bf16 tokens, whose
    per-row work the model does not charge: the rdma role ended at 1.278 ms against 1.272 in the same call;
    before that change, on 8 SMs, within 4 % on 2 x H200);
    h200x4_2vnode_50's within 10 % on 4 x H100 and 4 x H200 (+8 %: the model starts its rdma role 0.12 ms
    late, behind fwd's first wave of chunks, VNODE_COMBINE_H200)."""
    seen = set()
    for r in records:
        if r.bundle in ("h200x4_2vnode_50", "h200x2_2vnode_50") and r.program == "combine" and r.kernel_ms \
                and not r.superseded:
            seen.add(r.bundle)
            bound = 0.07 if r.bundle == "h200x2_2vnode_50" else 0.10
            assert abs(r.kernel_error) < bound, (r.report, r.bundle, r.kernel_error)
    assert seen == {"h200x4_2vnode_50", "h200x2_2vnode_50"}


class _MeasuredProducers:
    """A fluid run's stand-in for sim/blocks.py schedule_roles (what it reads: flow_at,
    flow_crossing, ready_t, end_t, start_s) from the measured role timelines `roles` (rank -> step
    -> (start, end), s): every flow of a step moves at an even pace from its rank's role start to
    its end (a step without a role, the metadata exchange, at 0); the role `timed` starts at its
    earliest measured start and has no bound but its blocks (its own timeline is what the blocks
    must reproduce)."""

    def __init__(self, steps, roles, timed: str):
        self.start_s = 0.0
        self.flow_at, self.span = {}, []
        self.ready_t = [min(r[timed][0] for r in roles.values()) if s.name == timed else 0.0 for s in steps]
        self.end_t = [0.0] * len(steps)
        for si, s in enumerate(steps):
            for fi, f in enumerate(s.flows):
                self.flow_at[(si, fi)] = len(self.span)
                self.span.append((0.0, 0.0) if s.name == timed else roles[f.rank].get(s.name, (0.0, 0.0)))

    def flow_crossing(self, f: int, frac: float) -> float:
        start, end = self.span[f]
        return start + (end - start) * frac


def test_ubb2x2_final_ends_as_its_items_do(gpu_bundles, tmp_path):
    """The miss of h200x4_ubb2x2_50's dispatch the per-block model removed (-18 % with the fluid
    model alone), from the data: with the producers' role timelines of 4 x H100 (2026-11-26, the
    cached row's stamped rounds), the final permute's chunks dealt as the kernels deal them
    (sim/blocks.py, round-robin) end within 5 % of the measured role end on every rank, dealt to
    whichever block is free 0.2 ms sooner; in the whole simulation, the role ends 0.3 ms after
    far_twin (measured: 0.35) where the fluid model alone ends it within 0.15 ms."""
    report = json.loads((REPO / "results" / "raw" / "2026-11-26_4xH100_ep_bench_b.json").read_text(encoding="utf-8"))
    bundle = next(b for b in report["bundles"] if b["name"] == "h200x4_ubb2x2_50")
    roles = {r: {role["step"]: (role["start_ms"] * 1e-3, role["end_ms"] * 1e-3)
                 for role in pr["timeline"]["dispatch"]["roles"]}
             for r, pr in enumerate(bundle["methods"]["epcc_cached"]["per_rank"])}
    plan = build_plan(str(gpu_bundles.rdma_source(tmp_path, "h200x4_ubb2x2_50"))).plan
    wl = plan.workload
    rng = np.random.default_rng(0)  # uniform top-k
    topk = np.argsort(rng.random((plan.num_ranks, wl.tokens, wl.experts)), axis=2)[:, :, :wl.topk]
    layout = compute_layout(plan, topk)
    steps = plan.program_steps("dispatch")
    final = {k: v for k, v in block_roles(plan, rdma_proxy=False).items() if k == ("dispatch", "final")}
    assert final[("dispatch", "final")][0] == 24
    replay = _MeasuredProducers(steps, roles, "final")
    _, dealt = schedule_roles(steps, replay, layout.copies, final, "round-robin")
    _, free = schedule_roles(steps, replay, layout.copies, final, "free")
    for rank in range(plan.num_ranks):
        measured = roles[rank]["final"][1]
        assert abs(dealt[("final", rank)].end / measured - 1) < 0.05, (rank, dealt[("final", rank)].end, measured)
        assert free[("final", rank)].end < measured - 0.2e-3
        assert measured - roles[rank]["far_twin"][1] > 0.3e-3
    for opts, lo, hi in ((SimOptions(rdma_proxy=False, calls=True), 0.0, 0.15),
                         (SimOptions(rdma_proxy=False, calls=True, layout=layout), 0.3, 0.45)):
        res = simulate(plan, opts)
        tail = res.step("final", "dispatch").end_s - res.step("far_twin", "dispatch").end_s
        assert lo < tail * 1e3 < hi, (opts.layout is not None, tail)


def test_fresh_minus_cached_dispatch_is_the_metadata_with_its_peers(records):
    """The direct kernels' metadata (sim/direct.py meta_s): a fresh dispatch less its cached twin (the same
    kernel but for the metadata) is `meta` for the first pass, META_FINISH_S for a second and META_PEER_S
    per peer rank.  The runs after the peers' flags went parallel (the 2026-11-27 decode reports, the
    4 x H200 ones of 2026-11-27 and 2026-11-28): at 128 tokens (one pass, inside the dispatch kernel)
    every pair within 1 us of the model, 6.0-6.3 us on 2 x H100, 6.8-6.9 on 4 x H100 and 6.3-7.0 on
    4 x H200, ~flat in the peers (0.35 us per peer); at 4096 (two passes) within 2 us (19.6 / 22.1
    against 21.2 on 2 x H100, 20.6-22.6 against 21.55 on 4 x H200).  The 4096-token runs before it
    (128-token ones: SUPERSEDED) stay above the model (22-25 us on 2 x H100, 28-30 on 4 x H100: the
    flags then one after another)."""
    cur = {(r.report, r.bundle, r.row): r for r in records if r.program == "dispatch" and not r.superseded}
    gaps: dict[tuple[int, int], list[float]] = {}
    for (report, bundle, row), fresh in cur.items():
        cached = cur.get((report, bundle, row.replace("epcc", "epcc_cached", 1)))
        if cached is None or row.startswith("epcc_cached") or "vnode" in bundle or "ubb" in bundle:
            continue
        ranks = 2 if "h200x2" in bundle else 4
        measured = (fresh.measured_ms - cached.measured_ms) * 1e3
        model = (fresh.predicted_ms - cached.predicted_ms) * 1e3
        # run after meta_publish raised the flags in parallel: the decode reports and the 4 x H200 ones
        after = (report.endswith("_decode.json")
                 or report.startswith(("2026-11-27_4xH200_", "2026-11-28_4xH200_")))
        if fresh.tokens == 128:
            assert after, (report, bundle, row)  # the earlier fresh 128-token rows are SUPERSEDED
            assert abs(model - measured) < 1.0, (report, bundle, row, model, measured)
            gaps.setdefault((fresh.tokens, ranks), []).append(measured)
        elif after:
            assert abs(model - measured) < 2.0, (report, bundle, row, model, measured)
        else:
            assert model < measured, (report, bundle, row, model, measured)
    assert set(gaps) == {(128, 2), (128, 4)}
    mean = {k: sum(v) / len(v) for k, v in gaps.items()}
    assert 0.0 <= (mean[128, 4] - mean[128, 2]) / 2 <= 0.5, mean  # ~flat: 0.35 us per peer, measured and modelled


def _beyond_the_kernel(records, run: str):
    """The dispatches of the 2-rank vnode bundles in `run`.json (after a change) and `run`_before.json
    (the same device call, before it): per (bundle, row) the two records, the call beyond its
    kernel's end after and before (us), and the model's after."""
    def dispatches(report: str) -> dict:
        return {(r.bundle, r.row): r for r in records if r.report == report and r.program == "dispatch"}

    after, before = dispatches(f"{run}.json"), dispatches(f"{run}_before.json")
    assert set(after) == set(before) == {(b, row) for b in ("h200x2_2vnode_50", "h200x2_2vnode_13")
                                         for row in ("epcc", "epcc_cached")}
    for key, a in after.items():
        b = before[key]
        yield (key, a, b, (a.measured_ms - a.kernel_ms) * 1e3, (b.measured_ms - b.kernel_ms) * 1e3,
               (a.predicted_ms - a.sim_kernel_ms) * 1e3)


def test_one_launch_metadata_is_what_the_call_holds_beyond_its_kernel(records):
    """2 x H100, 2026-11-27, one device call: h200x2_2vnode_50 and _13 before and after the metadata ran
    as one cooperative launch (meta_fused).  The dispatch's call less its kernel's end (the metadata and
    the copy of x) is 120-123 us after for both bundles (the routing goes over NVLink whatever link
    the plan declares), 8-14 us less than before; the kernels' ends did not move (1.407 / 4.747-4.749
    ms).  The model's (sim/meta.py refitted to that call's bench/meta_time.py, and sim/calls.py) is
    within 2 us at 50 GB/s; at 13 GB/s it charges the routing's bytes to the plan's RDMA-class link,
    15 us more than NVLink takes.  Both runs' dispatches are SUPERSEDED: their paced SM roles kept a
    share of the link per block (PER_BLOCK_PACING)."""
    for key, a, b, got, was, model in _beyond_the_kernel(records, "2026-11-27_2xH100_ep_bench_multihop_metafused"):
        assert 119 < got < 123 and 8 < was - got < 15 and abs(a.kernel_ms - b.kernel_ms) < 0.003, (key, got, was)
        # both runs' dispatches were timed before the paced SM roles replayed one serial link, which
        # supersedes them whatever the metadata did (sim_check PER_BLOCK_PACING)
        assert a.superseded and b.superseded, key
        if key[0] == "h200x2_2vnode_50":
            assert abs(model - got) < 2, (key, model, got)
        else:
            assert 12 < model - got < 16, (key, model, got)


def test_metadata_kernels_shorter_chains_are_what_the_call_lost(records):
    """2 x H100, 2026-11-27, one device call: h200x2_2vnode_50 and _13 before and after the metadata
    kernels' shorter dependent chains (an expert's rank by a multiply, the masks by warp ballot, the
    grid barrier without SC fences: meta_fused's phases 51.9 -> 41.3 us on rank 0).  The dispatch's
    call beyond its kernel's end went 84-86 -> 70 us, the kernels' ends did not move; the model
    (sim/meta.py, fitted before the change) is within 3 us of the new call at 50 GB/s, and at 13 GB/s
    charges the routing's bytes to the plan's RDMA-class link, 18 us more than NVLink takes."""
    for key, a, b, got, was, model in _beyond_the_kernel(records, "2026-11-27_2xH100_ep_bench_metadata_votes"):
        assert 68 < got < 72 and 12 < was - got < 18 and abs(a.kernel_ms - b.kernel_ms) < 0.003, (key, got, was)
        assert not a.superseded and not b.superseded, key
        if key[0] == "h200x2_2vnode_50":
            assert 0 < model - got < 4, (key, model, got)
        else:
            assert 16 < model - got < 20, (key, model, got)


def test_superseded_records_are_in_the_reports(sim_check, records):
    """Every SUPERSEDED key names a report here, and a one-record key a record of it."""
    names = {p.name for p in RAW}
    seen = {(r.report, r.bundle, r.row, r.program) for r in records}
    for key in sim_check.SUPERSEDED:
        assert key[0] in names, key
        assert len(key) == 2 or key in seen, key


def test_cli_exit_status(sim_check, tmp_path, capsys):
    assert sim_check.main([str(RAW[0])]) == 0
    assert "current records" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    assert sim_check.main([str(bad)]) == 1
    assert "not an ep_bench report" in capsys.readouterr().err


def test_a_proxy_steps_two_roles_end_its_step(records):
    """A proxy-path bundle's RDMA-class step runs as two roles, its timeline naming them "rdma (pack)"
    and "rdma (unpack)" (launcher.role_timeline): the step's measured end is the later of the two, so
    `--steps` compares it with the simulated step (it was never compared while the names did not match)."""
    report, bundle = "2026-11-28_2xH200_ep_bench_multihop.json", "h200x2_2vnode_50_proxy_dev"
    got = {(r.report, r.bundle, r.row, r.program): r for r in records}
    measured, simulated = got[(report, bundle, "epcc", "dispatch")].steps["rdma"]
    b = next(b for b in json.loads((REPO / "results" / "raw" / report).read_text())["bundles"] if b["name"] == bundle)
    ends = {role["step"]: [] for role in b["methods"]["epcc_cached"]["per_rank"][0]["timeline"]["dispatch"]["roles"]}
    for r in b["methods"]["epcc_cached"]["per_rank"]:
        for role in r["timeline"]["dispatch"]["roles"]:
            ends[role["step"]].append(role["end_ms"])
    assert measured == max(ends["rdma (pack)"] + ends["rdma (unpack)"])
    assert simulated > 0
    assert not any("(" in step for rec in records for step in rec.steps)


def test_role_step_names_the_plan_step():
    assert role_step("rdma (pack)") == role_step("rdma (unpack)") == role_step("rdma") == "rdma"
    assert role_step("final.from_twin") == "final.from_twin"
    assert set(ROLE_SIDES) == {"rdma-pack", "rdma-unpack"}


# ----------------------------------------------------------------------------- the red.add term

def test_red_bytes_per_flow_byte():
    gather = PlanStep(name="g", program="combine", verb="reduce", link="hbm", link_kind="local", deps=(), rows=True,
                      weighted=True)
    partial = dataclasses.replace(gather, rows=False, weighted=False)
    assert red_bytes_per_flow_byte(partial, 2.2) == FP32_ADD_PER_FLOW_BYTE
    # one red per token of 2 rows: 4H fp32 bytes per 2 x 2H of rows
    assert red_bytes_per_flow_byte(gather, 2.0) == pytest.approx(1.0)
    # 8 rows: two runs of GATHER_ROWS, 2 x 4H per 8 x 2H
    assert red_bytes_per_flow_byte(gather, 2.0 * GATHER_ROWS) == pytest.approx(0.5)


def test_red_resource_bounds_the_weighted_gathers_of_ubb2x2():
    plan = build_plan(str(REPO / "schedules" / "h200x4_ubb2x2.sched")).plan
    roles = with_sm_terms(plan)
    assert roles.resources["red:0"] == RED_BPS
    finals = [s for s in roles.steps if s.program == "combine" and s.name.startswith("final.")]
    assert len(finals) == 3
    for s in finals:
        for f in s.flows:
            if f.bytes > 0:
                assert "red:0" in f.resources or f"red:{f.dst}" in f.resources
                assert len(f.weights) == len(f.resources)
    res = simulate(plan)
    # 72 SMs of weighted gathers: 425 MB of fp32 adds at RED_BPS, not at 72 x 23 GB/s of rows
    fp32 = sum(f.bytes * red_bytes_per_flow_byte(s, 8 / 4 / (1 - 0.0935)) for s in finals for f in s.flows
               if f.dst == 0 and f.bytes > 0)
    end = max(res.step(s.name, "combine").end_s for s in finals)
    # (the twins' adds, which follow final.from_twin chunk by chunk, share the rate at the end)
    assert fp32 / RED_BPS <= end <= 1.1 * fp32 / RED_BPS


def test_no_red_term_without_sm_rates():
    plan = build_plan(str(REPO / "schedules" / "h200x4_ubb2x2.sched")).plan
    bare = dataclasses.replace(plan, sm_rates={}, atomics={})
    assert not any(r.startswith("red:") for r in with_sm_terms(bare).resources)


# ----------------------------------------------------------------------------- the call's copies

def test_call_bytes_of_h200x4_2vnode():
    plan = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched")).plan
    T, H, K = 4096, 7168, 8
    b = call_bytes(plan)
    assert b["dispatch"]["input"] == 2 * T * plan.bytes_per_token
    assert b["combine"]["rows"] == 2 * T * K * 2 * H
    assert b["combine"]["convert"] == 6 * T * H
    # the rdma_recv staging buffer holds the tokens the rail peer sent: 4096 x 0.9965
    assert staged_tokens(plan) == pytest.approx(4096 * 0.9965, rel=0.01)
    assert b["combine"]["zero"] == pytest.approx(4 * H * (T + staged_tokens(plan)))
    rate = COPY_EFFICIENCY * local_rate(plan)
    assert local_rate(plan) == 3000e9
    t = call_terms(plan, GAP_S)
    assert t["combine"]["rows"] == pytest.approx(b["combine"]["rows"] / rate)
    assert t["combine"]["gaps"] == 3 * GAP_S and t["dispatch"]["gaps"] == GAP_S


def test_calls_add_to_the_program_time_only_when_asked():
    plan = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched")).plan
    off = simulate(plan, SimOptions(rdma_proxy=False))
    on = simulate(plan, SimOptions(rdma_proxy=False, calls=True))
    parts = call_terms(plan, GAP_S)
    for p in ("dispatch", "combine"):
        assert on.programs[p].makespan_s == pytest.approx(off.programs[p].makespan_s + sum(parts[p].values()))
        assert on.programs[p].calls == pytest.approx(parts[p])
        assert not off.programs[p].calls


def test_no_calls_without_a_local_link():
    flows = [Flow(rank=0, src=0, dst=1, bytes=1e6, resources=("link:x:0>1",))]
    step = PlanStep(name="s", program="dispatch", verb="send", link="x", link_kind="p2p", deps=(), flows=flows)
    plan = Plan(schedule="t", num_ranks=2, routing="uniform", bytes_per_token=14400, steps=[step],
                resources={"link:x:0>1": 1e9})
    assert local_rate(plan) == 0.0
    assert call_terms(plan, GAP_S) == {}


def test_a_kernel_reading_the_callers_rows_copies_none():
    """Where a program's kernel reads the caller's rows in place (manifest dispatch_input /
    combine_input caller_rows), the call does not copy them: the dispatch no `input`; the combine
    copies the partials' clearing and the conversion only: no `rows`, one launch fewer.  `epcc
    simulate` takes it from the manifest the backend writes for the plan."""
    plan = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched")).plan
    copied, read = call_bytes(plan), call_bytes(plan, caller_rows=frozenset({"combine"}))
    assert read["dispatch"] == copied["dispatch"] and set(copied["dispatch"]) == {"input"}
    assert read["combine"] == {k: v for k, v in copied["combine"].items() if k != "rows"}
    t = call_terms(plan, GAP_S, caller_rows=frozenset({"combine"}))
    assert t["combine"]["gaps"] == 2 * GAP_S and t["dispatch"] == call_terms(plan, GAP_S)["dispatch"]
    both = call_terms(plan, GAP_S, caller_rows=frozenset({"dispatch", "combine"}))
    assert both["dispatch"] == {"gaps": 0.0} and both["combine"] == t["combine"]  # no copy, no launch of one
    assert call_bytes(plan, frozenset({"dispatch"}))["dispatch"] == {}
    assert reads_caller_rows({"combine_input": {"buffer": "output", "caller_rows": True, "why": "x"}}) == {"combine"}
    assert reads_caller_rows({"dispatch_input": {"buffer": "input", "caller_rows": True, "why": "x"}}) == {"dispatch"}
    assert not reads_caller_rows({}) and not reads_caller_rows(None)  # a bundle of an older epcc: copied
    # the shipped plans: h200x2_2vnode's copies read only their own rank's rows; h200x4_2vnode's combine
    # forwarding reads a peer's, its dispatch its own (backends/cuda/codegen.py caller_input)
    assert sim_options(plan, None, "emulate").caller_rows == {"dispatch", "combine"}
    four = build_plan(str(REPO / "schedules" / "h200x4_2vnode.sched")).plan
    assert sim_options(four, None, "emulate").caller_rows == {"dispatch"}


def test_partials_cleared_beside_the_dispatch_leave_the_combine(sim_check):
    """With tables the GPU writes, the Buffer clears the combine's partials beside the dispatch
    kernel: the combine's calls have no `zero` and one launch fewer, the dispatch's none more
    (hidden under its kernel); `--clear-partials in-combine` (and host-built tables) keep them in the
    combine; sim_check reads the report's `zero_beside` (absent: the reports before, in-combine)."""
    plan = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched")).plan
    both = frozenset({"dispatch", "combine"})
    kept, beside = call_terms(plan, GAP_S, both), call_terms(plan, GAP_S, both, zero_beside=True)
    assert beside["dispatch"] == kept["dispatch"]
    assert beside["combine"] == {"convert": kept["combine"]["convert"], "gaps": kept["combine"]["gaps"] - GAP_S}
    assert "zero" in kept["combine"] and "zero" not in call_bytes(plan, both, True)["combine"]
    assert sim_options(plan, None, "emulate").zero_beside
    assert not sim_options(plan, None, "emulate", zero_beside=False).zero_beside
    assert not sim_options(plan, None, "proxy", "host").zero_beside  # host tables: the launcher clears them
    row = ("epcc", {"per_rank": [{"zero_beside": True}]})
    assert sim_check.zero_beside([row]) and not sim_check.zero_beside([("epcc", {"per_rank": [{}]})])


def test_the_copy_the_model_dropped_is_the_time_the_combine_lost(records):
    """2 x H200, 2026-11-27, one device call: h200x2_2vnode_50 and _13 before the combine read the
    caller's rows (the 2026-11-26 run's twin is SUPERSEDED; the run before the change in the same call
    measured the same: 0.416 / 0.422 ms) and after.  The combine's call less its kernel's end: 0.42 ms
    before, 0.12-0.13 after; the model's copies without the rows 0.16 ms, and the rows it dropped 0.36
    ms where the call lost 0.29-0.30: the model's one copy rate (2.6 TB/s) is H100's and slow for H200
    (3.2 TB/s: 0.29 ms)."""
    after = {r.bundle: r for r in records if r.report == "2026-11-27_2xH200_ep_bench_multihop_zcopy.json"
             and r.program == "combine" and r.row == "epcc_cached"}
    before = {r.bundle: r for r in records if r.report == "2026-11-26_2xH200_ep_bench_multihop.json"
              and r.program == "combine" and r.row == "epcc_cached"}
    assert set(after) == set(before) == {"h200x2_2vnode_50", "h200x2_2vnode_13"}
    plan = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched")).plan
    rows = call_terms(plan, GAP_S)["combine"]["rows"] * 1e3
    for b in after:
        # the zcopy run's combine is superseded for its kernel (its paced role, keep_far's 8 SMs) only:
        # the copy it times is the one the model charges where the Buffer copies
        assert before[b].superseded and (not after[b].superseded or "paced SM roles" in after[b].superseded)
        outside_after = after[b].measured_ms - after[b].kernel_ms
        outside_before = before[b].measured_ms - before[b].kernel_ms
        model = after[b].predicted_ms - after[b].sim_kernel_ms
        assert 0.10 < outside_after < 0.14 and 0.41 < outside_before < 0.43, (b, outside_after, outside_before)
        assert abs(model - outside_after) < 0.05, (b, model, outside_after)
        assert 0.75 < (outside_before - outside_after) / rows < 0.85, (b, outside_before - outside_after, rows)


def test_bundle_source_gives_each_bundle_the_options_it_was_compiled_with(sim_check, tmp_path):
    """The proxy bundles are simulated with the tables they run on (tests/gpu/bundles.py: `_proxy`
    with host-built tables, `_proxy_dev` with tables from the GPU), the token-major ones token-major."""
    src, opts = sim_check.bundle_source("h200x2_2vnode_50_proxy", tmp_path)
    assert opts == ["--rdma", "proxy", "--proxy-tables", "host"] and src.exists()
    assert sim_check.bundle_source("h200x2_2vnode_50_proxy_dev", tmp_path)[1] == ["--rdma", "proxy",
                                                                                  "--proxy-tables", "device"]
    assert sim_check.bundle_source("h200x2_2vnode_50", tmp_path)[1] == ["--rdma", "emulate"]
    assert sim_check.bundle_source("h200x2_fp8", tmp_path)[1] == ["--dtype", "fp8", "--rdma", "proxy"]
    assert sim_check.bundle_source("h200x2_tok_fp8", tmp_path)[1] == ["--layout", "token", "--dtype", "fp8", "--rdma",
                                                                       "proxy"]
    for name in ("h200x2_2vnode_13_proxy_dev", "h200x2_fp8_proxy", "nope"):  # bundles.py builds none of them
        with pytest.raises(sim_check.CheckError, match="not one tests/gpu/bundles.py builds"):
            sim_check.bundle_source(name, tmp_path)


def test_sms_rows_are_simulated_on_their_sms_and_cached_rows_without_metadata(records, sim_check, tmp_path):
    """ep_bench --epcc-sms N rows (epcc@N, epcc_cached@N): the direct kernels on N SMs
    (`epcc simulate --sms N`), the cached-handle dispatch without its metadata (`--cached`)."""
    report = "2026-11-27_4xH100_ep_bench.json"
    got = {(r.row, r.program): r for r in records if r.report == report and r.bundle == "h200x4_t128"}
    assert set(got) == {(f"{row}@{n}", p) for row in ("epcc", "epcc_cached") for n in (24, 64)
                        for p in ("dispatch", "combine")}
    for n in (24, 64):
        fresh, cached = (sim_check.simulate_bundle("h200x4_t128", 128, tmp_path, n, c)["programs"] for c in (False, True))
        assert got[f"epcc@{n}", "dispatch"].predicted_ms == pytest.approx(fresh["dispatch"]["total_ms"])
        assert got[f"epcc_cached@{n}", "dispatch"].predicted_ms == pytest.approx(cached["dispatch"]["total_ms"])
        assert got[f"epcc_cached@{n}", "combine"].predicted_ms == pytest.approx(fresh["combine"]["total_ms"])
    assert got["epcc@64", "combine"].predicted_ms < got["epcc@24", "combine"].predicted_ms
    # each row's kernel: the timeline its own SM count stamped
    assert got["epcc@24", "dispatch"].kernel_ms != got["epcc@64", "dispatch"].kernel_ms


def test_host_table_dispatches_are_compared_by_their_kernel(records):
    """The _proxy bundles (host-built tables): their dispatch records' error is the kernel's (the
    timed call holds host work: KERNEL_ONLY), their combines' the call's, with the Buffer's copies
    (h200x4_ubb2x2's without the expert outputs, which its combine reads in place)."""
    proxy = [r for r in records if r.bundle.endswith("_proxy") and r.report == "2026-11-27_4xH100_ep_bench_multihop.json"]
    assert len(proxy) == 8
    for r in proxy:
        if r.program == "dispatch":
            assert r.kernel_only and r.error == r.kernel_error and abs(r.error) < 0.10
        else:
            assert r.kernel_only is None and r.error == pytest.approx(r.predicted_ms / r.measured_ms - 1)
            copies = r.predicted_ms - r.sim_kernel_ms  # the combine's copies beside the kernel
            lo, hi = (0.5, 0.6) if r.bundle == "h200x4_2vnode_50_proxy" else (0.25, 0.35)  # with the rows, without
            assert lo < copies < hi, (r.bundle, copies)
    assert not any(r.kernel_only for r in records if not r.bundle.endswith("_proxy"))


def test_token_major_records_are_simulated_token_major(records, sim_check, tmp_path):
    """The token-major bundles' rows (2 x H100 and 4 x H100, 2026-11-27) are compared with `epcc simulate
    --layout token`: every bundle's four records, the cached dispatch without metadata, and each
    dispatch below its expert-major twin's prediction (one row per token and GPU, no replication)."""
    tok = [r for r in records if r.report in ("2026-11-27_2xH100_ep_bench_token.json", "2026-11-27_4xH100_ep_bench_token.json")]
    assert {(r.bundle, r.row, r.program) for r in tok} == {
        (f"h200x{g}_tok{suffix}", row, p) for g in (2, 4) for suffix in ("", "_fp8", "_t128")
        for row in ("epcc", "epcc_cached") for p in ("dispatch", "combine")}
    for r in tok:
        sim = sim_check.simulate_bundle(r.bundle, r.tokens, tmp_path, None, r.row == "epcc_cached")
        assert sim["model"]["sm"]["layout"] == "token"
        assert r.predicted_ms == pytest.approx(sim["programs"][r.program]["total_ms"])
        if r.program == "dispatch":
            twin = sim_check.simulate_bundle(r.bundle.replace("_tok", ""), r.tokens, tmp_path)
            assert twin["model"]["sm"]["layout"] == "expert"
            assert r.predicted_ms < twin["programs"]["dispatch"]["total_ms"]


# The token-major bundles' SM sweep on 2 x H100 (2026-11-27, the first run of results/2026-11-27_2xH100_token_major.md;
# its rows are not in the raw report): SMs -> (fresh dispatch, cached dispatch, combine), ms, 4096 tokens, bf16.
TOKEN_SWEEP_2XH100 = {24: (0.210, 0.186, 0.248), 48: (0.204, 0.181, 0.220), 96: (0.202, 0.178, 0.221)}


@pytest.mark.parametrize("sms", sorted(TOKEN_SWEEP_2XH100))
def test_token_major_sm_sweep_within_ten_percent(sim_check, tmp_path, sms):
    """`epcc simulate --layout token --sms N` against the measured sweep: the dispatch bound by the
    link at the store rate whatever the SMs (0.186 -> 0.178 cached), the combine within 10 % too."""
    fresh, cached = (sim_check.simulate_bundle("h200x2_tok", 4096, tmp_path, sms, c)["programs"] for c in (False, True))
    for got, want in zip((fresh["dispatch"], cached["dispatch"], fresh["combine"]), TOKEN_SWEEP_2XH100[sms]):
        assert abs(got["total_ms"] / want - 1) <= 0.10, (sms, got["total_ms"], want)


def test_tuned_rows_run_their_own_configuration_or_are_skipped_for_it(sim_check, tmp_path):
    """The 4 x H200 run under `epcc tune`'s pick (2026-11-27, the bundles' cuda/tuned.json): its rows record
    the launch configuration per rank.  h200x4_t128's (96 SMs dispatch, 64 combine, every block sending and
    reducing first) is what `--sms 96` / `--sms 64` simulate, each program on its own count; h200x4's and
    h200x4_fp8's have blocks that only replicate (27 of 64) or only sum partials (11 of 32), which the model
    does not have: skipped, with that reason, not compared with the default 24-SM simulation."""
    report = REPO / "results" / "raw" / "2026-11-27_4xH200_ep_bench_tuned.json"
    skipped: list = []
    got = {(r.bundle, r.row, r.program): r for r in sim_check.collect([report], skipped)}
    assert set(got) == {("h200x4_t128", row, p) for row in ("epcc", "epcc_cached") for p in ("dispatch", "combine")}
    for n, p in ((96, "dispatch"), (64, "combine")):
        want = sim_check.simulate_bundle("h200x4_t128", 128, tmp_path, n, p == "dispatch")["programs"][p]["total_ms"]
        assert got["h200x4_t128", "epcc_cached", p].predicted_ms == pytest.approx(want)
        assert abs(got["h200x4_t128", "epcc_cached", p].error) <= 0.10
    assert {(k.bundle, k.row, k.program) for k in skipped} == {
        (b, row, p) for b in ("h200x4", "h200x4_fp8") for row in ("epcc", "epcc_cached") for p in ("dispatch", "combine")}
    for k in skipped:
        assert k.reason == ("its dispatch ran 37 + 27 SMs, 27 of them blocks that only replicate (recv_blocks): epcc "
                            "simulate --sms N runs every block sending first, and the direct kernels' model has no "
                            "dedicated blocks" if k.program == "dispatch" else
                            "its combine ran 21 + 11 SMs, 11 of them blocks that only sum partials "
                            "(combine_reduce_blocks): epcc simulate --sms N runs every block reducing first, and the "
                            "direct kernels' model has no dedicated blocks"), k.reason
    # the configuration alone decides: every block first, 16 warps, is simulated; anything else is not
    cfg = {"send_blocks": 37, "recv_blocks": 0, "warps": 16, "combine_send_blocks": 21, "combine_reduce_blocks": 0}
    assert (sim_check.configured_sms(cfg, "dispatch"), sim_check.configured_sms(cfg, "combine")) == (37, 21)
    assert sim_check.configured_sms({**cfg, "warps": 8}, "dispatch") == (
        "its dispatch ran 8 warps per block: epcc simulate --sms N runs 16, and the direct kernels' model has no "
        "warp count")
    assert sim_check.configured_sms(None, "dispatch") is None


def test_old_reports_are_simulated_as_they_ran(sim_check):
    """A report that records which programs read the caller's rows in place, where the partials
    were cleared and whether the combine kernel wrote the bf16 tokens (ep_bench's caller_rows,
    zero_beside, convert_in_kernel) is simulated so; one before those fields as the Buffer ran then:
    the dispatch copying x, the partials cleared in the combine, a finish kernel after it."""
    new = [("epcc", {"per_rank": [{"caller_rows": ["dispatch"], "zero_beside": True, "convert_in_kernel": True}]})]
    old = [("epcc", {"per_rank": [{}]})]
    assert sim_check.copied_inputs(new) == {"combine"} and sim_check.zero_beside(new)
    assert sim_check.convert_in_kernel(new)
    assert sim_check.copied_inputs(old) == {"dispatch"} and not sim_check.zero_beside(old)
    assert not sim_check.convert_in_kernel(old)
    before = [("epcc", {"per_rank": [{"caller_rows": ["dispatch"], "zero_beside": True, "convert_in_kernel": False}]})]
    assert not sim_check.convert_in_kernel(before)


def test_the_conversion_in_the_kernel_leaves_the_combine_call(sim_check, records):
    """Where the combine kernel writes the bf16 tokens (manifest combine_output in-kernel), the
    combine's call has no `convert`; the 4 x H100 reports of 2026-11-27 time the same bundles before
    and after in one call, and sim_check simulates each as it ran: the same kernel, the conversion
    after it only before."""
    plan = build_plan(str(REPO / "schedules" / "h200x2_2vnode.sched")).plan
    both = frozenset({"dispatch", "combine"})
    assert "convert" in call_bytes(plan, both, True)["combine"]
    assert call_bytes(plan, both, True, convert_in_kernel=True)["combine"] == {}
    # the partials cleared in the combine call: the rows' contributions counted there (one launch)
    assert list(call_bytes(plan, both, False, convert_in_kernel=True)["combine"]) == ["zero", "count"]
    assert sim_options(plan, None, "emulate").convert_in_kernel
    assert not sim_options(plan, None, "emulate", combine_output="finish-kernel").convert_in_kernel
    got = {r.report: r for r in records if r.bundle == "h200x2_2vnode_50" and r.row == "epcc"
           and r.program == "combine" and "combine_" in r.report}
    before = got["2026-11-27_2xH100_ep_bench_combine_before.json"]
    after = got["2026-11-27_2xH100_ep_bench_combine_in_kernel.json"]
    conversion = 6.0 * 4096 * 7168 / (COPY_EFFICIENCY * 3000e9) * 1e3 + GAP_S * 1e3  # ms, and its launch
    assert before.predicted_ms - after.predicted_ms == pytest.approx(conversion, rel=0.02)
    assert before.measured_ms - after.measured_ms > 0.05  # 1.351 -> 1.285 ms


def test_a_record_that_predates_two_changes_gives_both(sim_check):
    """The reasons are gathered, not overwritten in the order the table was written: the 2 x H100
    dispatch timed before meta_fused, before the paced roles and before keep_far's 16 SMs gives all three."""
    why = sim_check.superseded("2026-11-27_2xH100_ep_bench_multihop.json", "h200x2_2vnode_50", "epcc", "dispatch")
    assert why == f"{sim_check.SIX_LAUNCHES}; {sim_check.PER_BLOCK_PACING}; {sim_check.KEEP_FAR_8_SMS}"
    assert sim_check.superseded("2026-11-27_4xH200_ep_bench.json", "h200x4", "epcc", "dispatch") is None
