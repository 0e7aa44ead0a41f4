"""Shared helpers of the runtime tests: compile plans (cached), run a layout through the NumPy
reference executor and compare with the oracle, check the chunk/flag/wait invariants."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np

from epcc import pipeline
from epcc.passes import PassOptions
from epcc.runtime.engines.cpu import threads
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing import inputs, oracle, reference

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = sorted(p.name for p in (REPO / "schedules").glob("*.sched"))
ROUTINGS = ("uniform", "zipf:1.2", "one-hot", "empty", "no-remote")


@functools.lru_cache(maxsize=None)
def _compiled(path: str, tokens: int, hidden: int):
    c = pipeline.run(path, options=PassOptions(tokens=tokens, hidden=hidden))
    return c.passes.get("plan")


def compile_plan(path, tokens: int = 64, hidden: int = 256):
    """The plan of a .sched file (a fresh copy: tests may edit it)."""
    return copy.deepcopy(_compiled(str(path), tokens, hidden))


@functools.lru_cache(maxsize=None)
def _compiled_text(text: str, tokens: int, hidden: int, tmpdir: str):
    p = Path(tmpdir) / f"s{abs(hash(text))}.sched"
    p.write_text(text, encoding="utf-8")
    return _compiled(str(p), tokens, hidden)


def compile_text(text: str, tmpdir, tokens: int = 64, hidden: int = 256):
    return copy.deepcopy(_compiled_text(text, tokens, hidden, str(tmpdir)))


def set_chunk_tokens(plan, tokens_per_chunk: int) -> None:
    """Force small chunks on every data step (exercises multi-chunk waits)."""
    wl = plan.workload
    for s in plan.steps:
        if s.verb == "exchange":
            continue
        bpt = plan.bytes_per_token if s.program == "dispatch" else 2 * wl.hidden
        s.chunk_bytes = float(tokens_per_chunk * bpt)


def make_inputs(plan, routing: str = "uniform", seed: int = 0, tokens: int | None = None, topk_idx=None):
    wl = plan.workload
    R = plan.num_ranks
    T = tokens if tokens is not None else wl.tokens
    if topk_idx is None:
        topk_idx = inputs.make_topk(routing, R, T, wl.topk, wl.experts, wl.placement, seed).topk_idx
    T = topk_idx.shape[1]
    w = inputs.make_weights(topk_idx, seed)
    x = inputs.make_x_rows(R, T, wl.hidden, wl.dtype, seed)
    return topk_idx, w, x


def check_against_oracle(plan, topk_idx, w, x, seed: int = 0, chunked: bool = False, layout=None,
                         backend: str = "reference"):
    """layout -> executor == oracle (dispatch bit-exact, combine within tolerance).  `backend`:
    the NumPy reference executor, or "cpu" (the JIT-compiled LLVM backend, threads per role)."""
    wl = plan.workload
    R = plan.num_ranks
    lay = layout if layout is not None else compute_layout(plan, topk_idx, w)
    token_major = wl.layout == "token"
    assert lay.token_major == token_major
    want = (oracle.token_dispatch_oracle if token_major else oracle.dispatch_oracle)(topk_idx, wl.experts,
                                                                                      wl.placement, x, w)
    for d in range(R):
        assert np.array_equal(lay.entries[("output", d)], want[d].src), f"rank {d}: output entries"
        assert np.array_equal(lay.recv_counts[d], want[d].counts), f"rank {d}: counts"
        if token_major:
            assert np.array_equal(lay.recv_topk_idx[d], want[d].topk_idx), f"rank {d}: top-k experts"
            assert np.array_equal(lay.recv_topk_weights[d].view(np.uint32), want[d].topk_weights.view(np.uint32))
        else:
            assert np.array_equal(lay.output_weights[d].view(np.uint32), want[d].weights.view(np.uint32))
    y = inputs.make_expert_outputs([v.rows.shape[0] for v in want], wl.hidden, seed)
    if backend == "cpu":
        got = threads.run_dispatch(plan, lay, list(x))
        res = threads.run_combine(plan, lay, y)
    elif chunked:
        got, res = reference.run_chunked(plan, lay, list(x), y, seed=seed)
    else:
        got = reference.run_dispatch(plan, lay, list(x))
    for d in range(R):
        assert np.array_equal(got[d], want[d].rows), f"rank {d}: output rows"
    if not chunked and backend == "reference":
        res = reference.run_combine(plan, lay, y)
    if token_major:
        ref, mag = oracle.token_combine_oracle(topk_idx, wl.experts, wl.placement, y, wl.hidden, return_abs=True)
    else:
        ref, mag = oracle.combine_oracle(topk_idx, wl.experts, wl.placement, w, y, wl.hidden, return_abs=True)
    chk = oracle.compare_combine(np.stack(res), ref, mag, wl.topk)
    assert chk.ok, f"combine differs at {chk.first_bad}: {chk.got} vs {chk.want}"
    return lay


def check_invariants(plan, lay) -> None:
    """Chunks, flags and waits are well formed; every wait is needed (minimal) and points at an
    earlier step's copy of the same program."""
    assert len(lay.flags) == len(lay.copies)
    seen_programs = []
    for i, c in enumerate(lay.copies):
        if not seen_programs or seen_programs[-1] != c.program:
            seen_programs.append(c.program)
        f = lay.flags[c.flag_id]
        assert c.flag_id == i == f.flag_id
        assert (f.rank, f.program, f.step, f.flow_index) == (c.dst, c.program, c.step, c.flow_index)
        cs = c.chunk_starts
        n = c.src_slots.size
        assert cs[0] == 0 and cs[-1] == n and (np.diff(cs) > 0).all() if n else cs.tolist() == [0]
        assert f.chunks == cs.size - 1 == len(c.waits)
        assert c.dst_slots.size == n == len(c.src_buffers) == c.src_buffer_ids.size
        if c.weights is not None:
            assert c.program == "combine" and c.weights.dtype == np.float32 and c.weights.size == n
        names = np.asarray(c.src_buffers, dtype=object)
        for ch, ws in enumerate(c.waits):
            assert [p for p, _ in ws] == sorted({p for p, _ in ws})
            lo, hi = c.chunk_starts[ch], c.chunk_starts[ch + 1]
            for p, v in ws:
                prod = lay.copies[p]
                assert prod.program == c.program and prod.step_index < c.step_index
                assert 1 <= v <= lay.flags[p].chunks
                assert prod.dst == c.src
                # minimal: producer chunk v-1 writes a slot this chunk reads
                plo, phi = prod.chunk_starts[v - 1], prod.chunk_starts[v]
                reads = c.src_slots[lo:hi][names[lo:hi] == prod.dst_buffer]
                assert np.intersect1d(reads, prod.dst_slots[plo:phi]).size, \
                    f"{c.step}[{c.flow_index}] chunk {ch} waits for {prod.step} chunk {v - 1}"
    assert seen_programs in (["dispatch", "combine"], ["dispatch"], [])
