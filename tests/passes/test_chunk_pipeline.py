"""chunk-pipeline's choice of an RDMA step's chunk and depth from the credit-window model
(compiler/passes/chunk_pipeline.py; the measured side: tests/sim/test_proxy_measured.py)."""

from __future__ import annotations

from pathlib import Path

from epcc.backends.rdma.lower import rdma_bytes_per_token
from epcc.passes import chunk_pipeline as cp
from epcc.sim import build_plan

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
    text = _edit(SCHED, "  sm copy 44 GB/s, reduce 23 GB/s, add 12 GB/s\n", "")
    tokens, depth = _chunking(tmp_path, text)
    # LATENCY_FACTOR x latency x bandwidth = 16 x 5 us x 50 GB/s = 4 MB, in whole tokens
    assert (tokens, depth) == (-(-16 * 5e-6 * 50e9 // 14400), cp.DEFAULT_DEPTH) == (278, 3)


def test_the_ir_says_which_chunks_the_cost_model_chose():
    from epcc import pipeline

    c = pipeline.run(str(REPO / "schedules" / "h200x2_2vnode.sched"), "chunk-pipeline")
    text = str(c.module)
    assert text.count('chosen_by = "cost model: ') == 2  # dispatch.rdma and combine.rdma, not the SM steps
    assert "ms alone over 'rdma' (50 GB/s, post 10 us)" in text
