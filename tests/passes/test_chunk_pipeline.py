"""chunk-pipeline's choice of an RDMA step's chunk and depth from the credit-window model
(compiler/passes/chunk_pipeline.py; the measured side: tests/sim/test_proxy_measured.py)."""

from __future__ import annotations

from pathlib import Path

from epcc import pipeline
from epcc.passes import chunk_pipeline as cp
from epcc.plan.rdma import rdma_bytes_per_token
from epcc.sim import SimOptions, simulate
from epcc.sim.build import build_plan

REPO = Path(__file__).resolve().parents[2]
SCHED = (REPO / "schedules" / "h200x2_2vnode.sched").read_text(encoding="utf-8")
RDMA_LINE = "send tokens for rail.vnode from input to rail.rdma_recv over rdma\n"


def _chunking(tmp_path: Path, text: str, program: str = "dispatch") -> tuple[int, int]:
    path = tmp_path / "h200x2_2vnode.sched"
    path.write_text(text, encoding="utf-8")
    plan = build_plan(str(path)).plan
    s = plan.step("rdma", program)
    bpt = rdma_bytes_per_token(plan, program)
    return round(s.chunk_bytes / bpt), s.depth


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_the_post_makes_a_fast_link_take_bigger_chunks(tmp_path):
    fast = _edit(SCHED, "bandwidth 50 GB/s", "bandwidth 400 GB/s")
    assert _chunking(tmp_path, fast) == (128, 8)
    assert _chunking(tmp_path, _edit(fast, "    post 10 us", "    # no post")) == (64, 16)


def test_a_depth_from_the_file_is_kept_and_the_chunk_fits_it(tmp_path):
    # 4 in flight cover no round trip at 50 GB/s (counted at 2/3): the widest window, 256 tokens
    assert _chunking(tmp_path, _edit(SCHED, RDMA_LINE, RDMA_LINE[:-1] + " depth 4\n")) == (256, 4)
    # 32 tokens: the post caps the channel at 0.46 MB / 10 us = 46 GB/s, which 8 in flight reach
    assert _chunking(tmp_path, _edit(SCHED, RDMA_LINE, RDMA_LINE[:-1] + " chunk 32 tokens\n")) == (32, 8)
    assert _chunking(tmp_path, _edit(SCHED, RDMA_LINE, RDMA_LINE[:-1] + " chunk 256 tokens depth 2\n")) == (256, 2)


def test_without_sm_rates_the_latency_rule_holds(tmp_path):
    text = _edit(SCHED, "  sm copy 44 GB/s, reduce 26 GB/s, add 12 GB/s\n", "")
    tokens, depth = _chunking(tmp_path, text)
    # LATENCY_FACTOR x latency x bandwidth = 16 x 5 us x 50 GB/s = 4 MB, in whole tokens
    assert (tokens, depth) == (-(-16 * 5e-6 * 50e9 // 14400), cp.DEFAULT_DEPTH) == (278, 3)


def test_the_ir_says_which_chunks_the_cost_model_chose():
    c = pipeline.run(str(REPO / "schedules" / "h200x2_2vnode.sched"), "chunk-pipeline")
    text = str(c.module)
    assert text.count('chosen_by = "cost model: ') == 2  # dispatch.rdma and combine.rdma, not the SM steps
    assert "ms alone over 'rdma' (50 GB/s, post 10 us)" in text


# ---- ramps: an SM role's first chunks finer where others follow it, its last where it follows

KEEP_FAR = "permute rdma_recv into output over hbm sms 8\n      chunk 64 tokens depth 8\n"
# the shipped schedule's keep_far (16 SMs, `ramp 3`), and the same schedule with keep_far as above:
# 8 SMs and the default ramps, which the tests below edit
KEEP_FAR_SHIPPED = "permute rdma_recv into output over hbm sms 16\n      chunk 64 tokens depth 8 ramp 3\n"
DEFAULT_RAMPS = _edit(SCHED, KEEP_FAR_SHIPPED, KEEP_FAR)


def _ramps(tmp_path: Path, text: str, name: str = "h200x2_2vnode.sched") -> dict[tuple[str, str], tuple[int, int]]:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    plan = build_plan(str(path)).plan
    return {(s.program, s.name): (s.ramp_head, s.ramp_tail) for s in plan.steps if s.verb != "exchange"}


def test_a_followed_role_ramps_its_head_and_a_following_one_its_tail(tmp_path):
    assert _ramps(tmp_path, DEFAULT_RAMPS) == {
        ("dispatch", "rdma"): (0, 0),          # RDMA chunks stay whole (the credit window counts chunks)
        ("dispatch", "keep"): (0, 0),          # neither followed nor following
        ("dispatch", "keep_far"): (0, 3),      # follows the RDMA: its last chunks spread over its SMs
        ("combine", "keep_far"): (0, 0),       # the combine's RDMA follows it, but heads stay whole by default
        ("combine", "keep"): (0, 0),
        ("combine", "rdma"): (0, 0),
    }
    three = _ramps(tmp_path, _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR[:-1] + " ramp 3\n"))
    assert three[("combine", "keep_far")] == (3, 0)  # asked for: its first chunks hand over sooner


def test_the_file_sets_or_turns_off_the_ramp(tmp_path):
    off = _ramps(tmp_path, _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR[:-1] + " ramp 0\n"))
    assert off[("dispatch", "keep_far")] == off[("combine", "keep_far")] == (0, 0)  # the combine's reverse too
    five = _ramps(tmp_path, _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR[:-1] + " ramp 5\n"))
    assert five[("dispatch", "keep_far")] == (0, 5)  # 2-token chunks: below RAMP_MIN_BYTES, but asked for
    # the default stops above RAMP_MIN_BYTES: 8 tokens x 14.4 KB halve once to 57.6 KB < 64 KiB
    small = _ramps(tmp_path, _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR.replace("chunk 64", "chunk 8")))
    assert small[("dispatch", "keep_far")] == (0, 0)
    assert _ramps(tmp_path, _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR.replace("chunk 64", "chunk 16")))[
        ("dispatch", "keep_far")] == (0, 1)


def test_copy_engine_steps_are_not_ramped(tmp_path):
    ramps = _ramps(tmp_path, (REPO / "schedules" / "ubbv2_ep16.sched").read_text(encoding="utf-8"), "ubbv2_ep16.sched")
    assert ramps[("dispatch", "d2d_near")] == ramps[("dispatch", "d2d_far")] == (0, 0)  # engine dma
    assert ramps[("dispatch", "fwd1")] == (0, 3)  # an SPC step between two others: its tail (heads whole by default)


def test_the_ramp_is_in_the_ir_and_the_simulation(tmp_path):
    # the shipped schedule asks for both ends: the dispatch's keep_far's tail, its combine reverse's head
    text = str(pipeline.run(str(REPO / "schedules" / "h200x2_2vnode.sched"), "chunk-pipeline").module)
    assert text.count("ramp = array<i64: 0, 3>") == 1 and text.count("ramp = array<i64: 3, 0>") == 1
    ms = {}
    for label, t in (("ramped", DEFAULT_RAMPS),
                     ("whole", _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR[:-1] + " ramp 0\n")),
                     ("both", _edit(DEFAULT_RAMPS, KEEP_FAR, KEEP_FAR[:-1] + " ramp 3\n"))):
        path = tmp_path / f"{label}.sched"
        path.write_text(t, encoding="utf-8")
        res = simulate(build_plan(str(path)).plan, SimOptions(rdma_proxy=True))
        ms[label] = {p: res.programs[p].makespan_s * 1e3 for p in ("dispatch", "combine")}
    # the dispatch's keep_far no longer finishes the RDMA's last chunk on one SM (-74 us simulated;
    # measured 7-47 us on 2 x H200, 2026-11-23, docs/rdma.md); with `ramp 3` the combine's RDMA starts after a
    # chunk of 8 tokens instead of 64 (simulated -0.13 ms; measured: it started 77 us sooner and
    # ended no sooner)
    assert ms["ramped"]["dispatch"] < ms["whole"]["dispatch"] - 0.05
    assert ms["ramped"]["combine"] == ms["whole"]["combine"]
    assert ms["both"]["combine"] < ms["whole"]["combine"] - 0.1
