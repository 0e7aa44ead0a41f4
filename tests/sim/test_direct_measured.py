"""`epcc simulate` against the measured direct kernels (issue 5: "epcc simulate predicts these runs
within 15 %").

MEASURED is the one table of measurements: nvidia-h200-x2 (2 H200s), the direct kernels of session
13 (bench/README.md), median of 40 timed iterations, uniform top-8 of 256, hidden 7168, every block
sending then replicating (dispatch) and reducing then summing (combine).  The simulator runs
schedules/h200x4.sched on 2 GPUs, as tests/gpu/bundles.py derives it for the h200x2 bundles, with
the direct kernels on the table's SMs.  When the kernels change, update MEASURED and re-fit the
`sm` line of schedules/h200x4.sched (one line; its end-of-file comment says what was fit to
what); the tests say which points are off.

NOT_CLAIMED lists the points the model does not claim, with the reason: for those the test checks
that the model is still as far off as the reason says, so that a change that brings them within
the tolerance is noticed and the point claimed.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from epcc.passes import PassOptions
from epcc.sim import SimOptions, build_plan, simulate

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15

MEASURED: dict[tuple[str, int, int], tuple[float, float | None]] = {
    # (dtype, tokens per rank, SMs): (dispatch ms, combine ms; None: not measured).  fp8 combines
    # are the bf16 combine (the combine moves bf16 partials).  Session 13 (bench/README.md):
    # `epcc tune` on h200x2 (--sms 16,24,32,48,64,96 --warps 16 --iters 10, the N+0 rows) and
    # ep_bench at 24 SMs (fp8, 128 tokens).
    ("bf16", 4096, 16): (0.557, 0.450),
    ("bf16", 4096, 24): (0.392, 0.309),
    ("bf16", 4096, 32): (0.309, 0.245),
    ("bf16", 4096, 48): (0.281, 0.223),
    ("bf16", 4096, 64): (0.273, 0.220),
    ("bf16", 4096, 96): (0.264, 0.216),
    ("fp8", 4096, 24): (0.226, None),
    ("bf16", 128, 24): (0.033, 0.026),
}

_DECODE = ("128 tokens per rank are fewer than the warps (24 SMs x 16): every warp sends, replicates or "
           "reduces one token, one after the other, at what one warp's loads in flight allow; the fluid "
           "model spreads the rows over all SMs and sees only the fixed costs and the rates")

NOT_CLAIMED: dict[tuple[str, str, int, int], str] = {
    ("dispatch", "bf16", 128, 24): _DECODE,
    ("combine", "bf16", 128, 24): _DECODE,
}

POINTS = [(prog, *key) for key, ms in MEASURED.items() for prog, m in zip(("dispatch", "combine"), ms)
          if m is not None]
CLAIMED = [p for p in POINTS if p not in NOT_CLAIMED]


@lru_cache(maxsize=None)
def predicted(path: str, dtype: str, tokens: int, sms: int) -> dict[str, float]:
    """Milliseconds per program, as `epcc simulate FILE --tokens T --dtype D --sms N` gives them."""
    from epcc.backends.cuda.direct_model import direct_kernels

    plan = build_plan(path, PassOptions(tokens=tokens, dtype=dtype)).plan
    kernels, why = direct_kernels(plan, sms)
    assert kernels is not None, why
    res = simulate(plan, SimOptions(direct=kernels))
    return {p: r.makespan_s * 1e3 for p, r in res.programs.items()}


def measured(prog: str, dtype: str, tokens: int, sms: int) -> float:
    return MEASURED[(dtype, tokens, sms)][0 if prog == "dispatch" else 1]


def test_the_table_is_what_the_simulator_runs(ep2):
    assert len(CLAIMED) + len(NOT_CLAIMED) == len(POINTS)
    assert set(NOT_CLAIMED) <= set(POINTS)
    plan = build_plan(ep2).plan
    assert plan.num_ranks == 2 and plan.workload.topk == 8 and plan.workload.experts == 256
    assert plan.workload.hidden == 7168


@pytest.mark.parametrize("prog, dtype, tokens, sms", CLAIMED)
def test_simulate_predicts_the_measured_kernels_within_15_percent(ep2, prog, dtype, tokens, sms):
    want = measured(prog, dtype, tokens, sms)
    got = predicted(ep2, dtype, tokens, sms)[prog]
    assert abs(got / want - 1) <= TOLERANCE, f"{prog} {dtype} {tokens} tokens {sms} SMs: simulated {got:.3f} ms, " \
                                             f"measured {want:.3f} ms ({(got / want - 1) * 100:+.1f} %)"


@pytest.mark.parametrize("prog, dtype, tokens, sms", sorted(NOT_CLAIMED))
def test_the_points_not_claimed_are_off_for_the_reason_given(ep2, prog, dtype, tokens, sms):
    # Every reason is a cost the model leaves out: it predicts them too fast, by more than the
    # tolerance.  Within it, claim the point (drop it from NOT_CLAIMED).
    want = measured(prog, dtype, tokens, sms)
    got = predicted(ep2, dtype, tokens, sms)[prog]
    assert got < want * (1 - TOLERANCE), f"{prog} {dtype} {tokens} tokens {sms} SMs: simulated {got:.3f} ms, " \
                                         f"measured {want:.3f}: within {TOLERANCE:.0%} now, claim it"


def test_four_gpus_from_the_same_rates_are_bound_by_nvlink(ep2):
    # Not measured with these kernels yet.  On 4 GPUs a token hits ~3.6 GPUs: a dispatch sends
    # ~160 MB of deduplicated rows to the peers of each GPU, over NVLink at 450 GB/s x 62 % (what
    # the 2-GPU combine and NCCL reach): ~0.57 ms, above what its 24 SMs need.
    from epcc.backends.cuda.direct_model import direct_kernels

    plan = build_plan(str(REPO / "schedules" / "h200x4.sched")).plan
    kernels, _ = direct_kernels(plan)
    res = simulate(plan, SimOptions(direct=kernels))
    d = res.programs["dispatch"]
    remote = sum(f.bytes for f in plan.step("push").flows if f.src == 0)
    assert 155e6 < remote < 165e6
    nvlink = 450e9 * 0.62
    assert d.bottleneck.link_class == "nvlink"
    assert d.link_classes["nvlink"].work_s == pytest.approx(remote / nvlink, rel=0.02)
    assert d.link_classes["sm"].work_s < d.link_classes["nvlink"].work_s
    # the same 470 MB of rows per rank as on 2 GPUs: at 64 SMs the 2-GPU dispatch is held by HBM
    # writes, the 4-GPU one still by NVLink
    assert predicted(str(REPO / "schedules" / "h200x4.sched"), "bf16", 4096, 64)["dispatch"] > \
        predicted(ep2, "bf16", 4096, 64)["dispatch"]
