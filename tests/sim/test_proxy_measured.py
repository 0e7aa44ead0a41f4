"""The GPU proxy path's RDMA chunking against measurements (issue 6: "chunk size and queue depth
come from the cost model"; "measured times within 15 % of the simulator").

SWEEP is one table of measurements: nvidia-h200-x2 (2 H200s), session 17, h200x2_2vnode at 13,
50 and 400 GB/s (the emulated transport), one bundle per rate re-chunked at run time
(`bench/ep_bench.py --rdma-chunks`, both programs at the same chunking), medians of 20 timed
iterations (40 for the rows marked shipped: the bundles as compiled, each program at the
chunking chunk-pipeline chose), every run checked against the oracle.  Commands in docs/rdma.md.

Two claims: chunk-pipeline's choice for each rate and program measures within `NEAR_BEST` of the
fastest chunking measured, and the simulator predicts the shipped bundles within 15 %.  The
sweep also shows why the model has `post` (the emulated proxy's host time per chunk, ~10 us):
16- and 32-token chunks take ~10-13 us each whatever the depth (400 GB/s: 2.61 and 1.75 ms for
a dispatch the link moves in 0.15 ms).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest

from epcc.backends.rdma.lower import rdma_bytes_per_token
from epcc.sim import SimOptions, build_plan, simulate

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15
NEAR_BEST = 0.05

SWEEP: dict[tuple[int, str, int, int], float] = {
    # (link GB/s, program, tokens per chunk, depth): median ms
    (400, "dispatch", 16, 16): 2.605, (400, "combine", 16, 16): 2.761,
    (400, "dispatch", 32, 16): 1.753, (400, "combine", 32, 16): 2.102,
    (400, "dispatch", 64, 8): 1.157, (400, "combine", 64, 8): 1.713,
    (400, "dispatch", 64, 16): 0.844, (400, "combine", 64, 16): 1.703,
    (400, "dispatch", 128, 8): 0.893, (400, "combine", 128, 8): 1.672,
    (400, "dispatch", 256, 4): 1.009, (400, "combine", 256, 4): 2.224,
    (50, "dispatch", 16, 32): 2.278, (50, "combine", 16, 32): 2.474,
    (50, "dispatch", 32, 16): 1.497, (50, "combine", 32, 16): 1.821,
    (50, "dispatch", 32, 32): 1.726, (50, "combine", 32, 32): 2.012,
    (50, "dispatch", 64, 8): 1.335, (50, "combine", 64, 8): 1.742,
    (50, "dispatch", 128, 8): 1.364, (50, "combine", 128, 8): 1.749,
    (50, "dispatch", 128, 4): 1.445, (50, "combine", 128, 4): 2.533,
    (50, "dispatch", 256, 4): 1.490, (50, "combine", 256, 4): 2.507,
    (13, "dispatch", 64, 8): 4.647, (13, "combine", 64, 8): 4.859,
    (13, "dispatch", 128, 4): 4.696, (13, "combine", 128, 4): 4.977,
}
SHIPPED: dict[tuple[int, str], float] = {
    # the bundles as compiled (tests/gpu/bundles.py), median of 40
    (50, "dispatch"): 1.324, (50, "combine"): 1.699,
    (13, "dispatch"): 4.647, (13, "combine"): 4.857,
    (400, "dispatch"): 0.878, (400, "combine"): 1.666,
}


@lru_cache(maxsize=None)
def _plan(gbps: int, tmp: Path):
    text = (REPO / "schedules" / "h200x2_2vnode.sched").read_text(encoding="utf-8")
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
    """The sweep's small chunks: ~10 us each on the emulated proxy whatever the depth, what
    `post 10 us` in schedules/h200x2_2vnode.sched says (4082 tokens: 256 and 128 chunks)."""
    for tokens, depth in ((16, 16), (32, 16)):
        per_chunk_us = SWEEP[(400, "dispatch", tokens, depth)] * 1e3 / -(-4082 // tokens)
        assert 9.0 <= per_chunk_us <= 14.0
