"""Buffer sizing: rings for pipelined readers, whole buffers otherwise, located errors when a
declared capacity is too small, and the formula behind every size."""

from __future__ import annotations

import pytest

from epcc import pipeline
from epcc.diagnostics import CompileError, SourceMap, format_all

BASE = """\
topology t {{
  levels node 1, gpu 4
  rank gpu
  relation peer = other gpu
  relation next = gpu -> (gpu + 1) % 4
  relation prev = gpu -> (gpu + 3) % 4
  link nv p2p {{ connects peer  bandwidth 100 GB/s  latency 2 us }}
  link hbm local {{ bandwidth 1000 GB/s }}
}}
workload {{ tokens 1024 per rank  hidden 1024  dtype bf16  topk 2  experts 8 blocked }}
dispatch {{
  buffer stage{capacity}
  step fwd: send tokens for next + next.next from input to next.stage over nv chunk 64 tokens depth 4
  step relay: send tokens for next from stage to next.output over nv chunk 64 tokens{after}
  step own: permute input, stage into output
  step direct: send tokens for prev from input to prev.output over nv
}}
combine reverse of dispatch
"""


def compile_text(tmp_path, capacity: str = "", after: str = ""):
    p = tmp_path / "b.sched"
    p.write_text(BASE.format(capacity=capacity, after=after), encoding="utf-8")
    sources = SourceMap()
    try:
        return pipeline.run(str(p), "buffer-allocation", sources), None, p
    except CompileError as e:
        return None, format_all(e.diagnostics, sources), p


def test_pipelined_reader_gets_a_ring(tmp_path):
    c, err, _ = compile_text(tmp_path)
    assert err is None, err
    stage = next(b for b in c.passes.get("plan").buffers if b.name == "stage")
    # One writer rank (my 'next' predecessor) x depth 4 x 64 tokens x 2048 B.
    assert stage.bytes_per_rank == 4 * 64 * 2048
    assert stage.formula.startswith("ring, readers follow writers chunk by chunk: 1 x depth 4 x 131.1 KB chunks (fwd) = 524.3 KB")
    assert stage.worst_case_bytes == 1024 * 2048


def test_capacity_below_one_chunk_per_writer_is_an_error(tmp_path):
    _c, err, p = compile_text(tmp_path, capacity=" capacity 32 tokens")
    assert err is not None
    assert err.splitlines()[0] == (
        f"{p}:12:3: error: buffer 'stage' (capacity 32 tokens) cannot hold one chunk from each of the 1 rank(s) "
        f"that write it: that needs 1 x 64 tokens (0.13 MB) = 0.13 MB")
    assert f"{p}:13:3: note: step 'fwd' writes it in chunks of 64 tokens (0.13 MB)" in err


def test_capacity_shrinks_the_pipeline_depth(tmp_path):
    c, err, _ = compile_text(tmp_path, capacity=" capacity 128 tokens")
    assert err is None, err
    fwd = c.passes.get("plan").step("fwd")
    assert fwd.depth == 2  # 128 tokens hold two 64-token chunks, not the 4 asked for
    stage = next(b for b in c.passes.get("plan").buffers if b.name == "stage")
    assert stage.bytes_per_rank == 128 * 2048 and "declared capacity" in stage.formula


def test_non_pipelined_reader_needs_the_whole_buffer(tmp_path):
    # 'after fwd' makes relay wait for all of fwd: the buffer must hold everything fwd can send.
    c, err, _ = compile_text(tmp_path, after=" after fwd")
    assert err is None, err
    stage = next(b for b in c.passes.get("plan").buffers if b.name == "stage")
    assert stage.formula.startswith("whole: 1 token streams x 1024 tokens x 2048 B = 2.1 MB")
    assert stage.bytes_per_rank == 1024 * 2048


def test_undersized_whole_buffer_is_an_error(tmp_path):
    _c, err, p = compile_text(tmp_path, capacity=" capacity 512 tokens", after=" after fwd")
    assert err is not None
    lines = err.splitlines()
    assert lines[0] == f"{p}:12:3: error: buffer 'stage' holds 1.0 MB but needs 2.1 MB"
    assert "note: whole: 1 token streams x 1024 tokens x 2048 B = 2.1 MB" in err
    assert f"{p}:14:3: note: its readers do not follow its writers chunk by chunk; e.g. step 'relay'" in err


@pytest.mark.parametrize("sched", ["schedules/ubbv2_ep32.sched", "schedules/ocs_ep16.sched"])
def test_every_buffer_has_a_size_and_a_formula(sched):
    c = pipeline.run(sched, "buffer-allocation")
    plan = c.passes.get("plan")
    names = {b.name for b in plan.buffers}
    assert names == set(c.schedule.dispatch.buffers)
    for b in plan.buffers:
        assert b.bytes_per_rank > 0 and b.formula
