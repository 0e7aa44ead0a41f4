"""The GPU proxy path's RDMA chunking against measurements (the targets: "chunk size and queue
depth come from the cost model"; "measured times within 15 % of the simulator").

SWEEP is one table of measurements: 2 x H200, 2026-11-23 (before the ramps),
h200x2_2vnode at 13, 50 and 400 GB/s (the emulated transport), the shipped bundle of each rate
re-chunked at run time (`bench/ep_bench.py --rdma-chunks`, both programs at the same chunking),
medians of 20 timed iterations, every run checked against the oracle.  SHIPPED: the bundles as
compiled, each program at the chunking chunk-pipeline chose, medians of 40 in one process with
the same plans at `ramp 0` (docs/rdma.md).  With the pack and unpack roles sized for the link
(kernel-formation's pack_sms / unpack_sms; before: 4 blocks each) the combine's unpack
got 5 blocks at 50 GB/s and 16 at 400, and the combines moved from 1.702 to 1.540 ms (50 GB/s)
and from 1.673 to 1.388 (400).  Commands in docs/rdma.md.

Two claims: chunk-pipeline's choice for each rate and program measures within `NEAR_BEST` of the
fastest chunking measured, and the simulator predicts the shipped bundles within 15 %.  The
sweep also shows why the model has `post` (the emulated proxy's host time per chunk, ~10 us):
32-token chunks at 400 GB/s take ~11 us each (1.37 ms for a dispatch the link moves in 0.15 ms),
16-token ones did ~10 us in an earlier sweep (same day and machine).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from epcc.plan.rdma import rdma_bytes_per_token
from epcc.sim import SimOptions, simulate
from epcc.sim.build import build_plan

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15
NEAR_BEST = 0.05

SWEEP: dict[tuple[int, str, int, int], float] = {
    # (link GB/s, program, tokens per chunk, depth): median ms
    (400, "dispatch", 32, 16): 1.373, (400, "combine", 32, 16): 1.955,
    (400, "dispatch", 64, 4): 1.369, (400, "combine", 64, 4): 2.505,
    (400, "dispatch", 64, 8): 1.131, (400, "combine", 64, 8): 1.493,
    (400, "dispatch", 64, 16): 0.897, (400, "combine", 64, 16): 1.413,
    (400, "dispatch", 128, 4): 1.077, (400, "combine", 128, 4): 2.235,
    (400, "dispatch", 128, 8): 0.895, (400, "combine", 128, 8): 1.472,
    (400, "dispatch", 256, 4): 1.019, (400, "combine", 256, 4): 2.210,
    (50, "dispatch", 32, 16): 1.559, (50, "combine", 32, 16): 1.561,
    (50, "dispatch", 64, 4): 1.603, (50, "combine", 64, 4): 2.727,
    (50, "dispatch", 64, 8): 1.315, (50, "combine", 64, 8): 1.613,
    (50, "dispatch", 64, 16): 1.315, (50, "combine", 64, 16): 1.537,
    (50, "dispatch", 128, 4): 1.430, (50, "combine", 128, 4): 2.516,
    (50, "dispatch", 128, 8): 1.362, (50, "combine", 128, 8): 1.644,
    (50, "dispatch", 256, 4): 1.554, (50, "combine", 256, 4): 2.512,
    (13, "dispatch", 32, 16): 4.629, (13, "combine", 32, 16): 4.815,
    (13, "dispatch", 64, 4): 4.645, (13, "combine", 64, 4): 4.859,
    (13, "dispatch", 64, 8): 4.647, (13, "combine", 64, 8): 4.859,
    (13, "dispatch", 64, 16): 4.647, (13, "combine", 64, 16): 4.858,
    (13, "dispatch", 128, 4): 4.694, (13, "combine", 128, 4): 4.977,
    (13, "dispatch", 128, 8): 4.696, (13, "combine", 128, 8): 4.977,
    (13, "dispatch", 256, 4): 4.775, (13, "combine", 256, 4): 5.183,
}
SHIPPED: dict[tuple[int, str], float] = {
    # the bundles as compiled (tests/gpu/bundles.py), median of 40, after the ramps: the dispatch's
    # keep_far ramps its tail (chunk-pipeline, RAMP_TAIL_DEFAULT), the combine is as in SWEEP
    (50, "dispatch"): 1.308, (50, "combine"): 1.543,
    (13, "dispatch"): 4.603, (13, "combine"): 4.863,
    (400, "dispatch"): 0.891, (400, "combine"): 1.416,
}
# The same run, the dispatch with whole chunks (`ramp 0`): 1.315 (50 GB/s), 0.926 (400), 4.650 (13).
# Another run, medians of 20: ramped 1.300 / 0.927 / 4.603, whole 1.329 / 0.889 / 4.647.
# Before the pack and unpack roles were sized for the link (4 blocks each), same process: 50 GB/s 1.315 / 1.702, 400 GB/s
# 0.860 / 1.673, 13 GB/s 4.649 / 4.857.


KEEP_FAR_NOW = "over hbm sms 16\n      chunk 64 tokens depth 8 ramp 3"
KEEP_FAR_THEN = "over hbm sms 8\n      chunk 64 tokens depth 8"


@lru_cache(maxsize=None)
def _plan(gbps: int, tmp: Path):
    text = (REPO / "schedules" / "h200x2_2vnode.sched").read_text(encoding="utf-8")
    # the plan as these runs had it: keep_far on 8 SMs, its head whole (the schedule before it moved
    # to 16 SMs, ramp 3: results/2026-11-27_2xH100_multihop.md)
    assert text.count(KEEP_FAR_NOW) == 1
    text = text.replace(KEEP_FAR_NOW, KEEP_FAR_THEN)
    if gbps != 50:
        assert text.count("bandwidth 50 GB/s") == 1
        text = text.replace("bandwidth 50 GB/s", f"bandwidth {gbps} GB/s")
    path = tmp / f"h200x2_2vnode_{gbps}.sched"
    path.write_text(text, encoding="utf-8")
    return build_plan(str(path)).plan


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("proxy_measured")


def _chosen(plan, program: str) -> tuple[int, int]:
    s = plan.step("rdma", program)
    bpt = rdma_bytes_per_token(plan, program)
    return round(s.chunk_bytes / bpt), s.depth


@pytest.mark.parametrize("gbps", [13, 50, 400])
@pytest.mark.parametrize("program", ["dispatch", "combine"])
def test_the_chosen_chunking_measures_near_the_best(tmp, gbps, program):
    chosen = _chosen(_plan(gbps, tmp), program)
    swept = {(t, d): ms for (g, p, t, d), ms in SWEEP.items() if g == gbps and p == program}
    got = SHIPPED[(gbps, program)]  # the chosen chunking, as compiled (test_the_choices_are_what_the_shipped_bundles_ran)
    best = min(swept.values())
    assert got <= best * (1 + NEAR_BEST), (
        f"{gbps} GB/s {program}: chunk-pipeline chose {chosen[0]} tokens x {chosen[1]} ({got} ms measured), "
        f"the fastest measured is {min(swept, key=swept.get)} at {best} ms")


def test_the_choices_are_what_the_shipped_bundles_ran(tmp):
    # The SHIPPED rows were measured with these; a change of choice needs a new measurement.
    assert {(g, p): _chosen(_plan(g, tmp), p) for g in (13, 50, 400) for p in ("dispatch", "combine")} == {
        (13, "dispatch"): (64, 4), (13, "combine"): (64, 8),
        (50, "dispatch"): (64, 8), (50, "combine"): (64, 16),
        (400, "dispatch"): (128, 8), (400, "combine"): (64, 16),
    }


@pytest.mark.parametrize("gbps", [13, 50, 400])
def test_the_shipped_bundles_within_tolerance(tmp, gbps):
    res = simulate(_plan(gbps, tmp), SimOptions(rdma_proxy=True))
    for program in ("dispatch", "combine"):
        sim = res.programs[program].makespan_s * 1e3
        got = SHIPPED[(gbps, program)]
        assert abs(got / sim - 1) <= TOLERANCE, f"{gbps} GB/s {program}: measured {got} ms, simulated {sim:.3f} ms"


def test_small_chunks_are_held_by_the_post():
    """The sweep's small chunks: ~11 us each on the emulated proxy at 400 GB/s whatever the depth,
    what `post 10 us` in schedules/h200x2_2vnode.sched says (4082 tokens: 128 chunks of 32)."""
    per_chunk_us = SWEEP[(400, "dispatch", 32, 16)] * 1e3 / -(-4082 // 32)
    assert 9.0 <= per_chunk_us <= 14.0


def test_the_unpack_is_sized_for_the_link(tmp):
    """A combine chunk is applied with fp32 atomic adds at ~12 GB/s per SM (`sm ... add`), so the
    combine's unpack role gets ceil(link / 12 GB/s) blocks: 5 at 50 GB/s (4 held it at ~43 GB/s),
    the 16 most at 400; the pack (copy, 44 GB/s; fp32 partials read at half that) 4 below 88
    GB/s.  What the sweep above was measured with."""
    sms = {(g, k.program): (r.pack_sms, r.unpack_sms)
           for g in (13, 50, 400) for k in _plan(g, tmp).kernels if k.kind == "proxy"
           for r in k.roles}
    assert sms == {(13, "dispatch"): (4, 4), (13, "combine"): (4, 4),
                   (50, "dispatch"): (4, 4), (50, "combine"): (4, 5),
                   (400, "dispatch"): (10, 10), (400, "combine"): (16, 16)}
