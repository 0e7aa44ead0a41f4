"""The metadata kernels' grids: the blocks of each phase the runtime launches (meta_program.py
grids(), the manifest's metadata "blocks") are the header's phase_blocks, which the host build of the
kernels runs (tests/backends/meta/meta_host.cpp); and the tables do not depend on how the phases'
blocks are spread over a grid: the cooperative kernel's order (block b runs phase blocks b, b + G,
... of every phase, its first count block's sets read ahead) writes, for a grid of one block, a few,
or more blocks than any phase has, what the four launches write."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_meta_kernels import HEADER, _manifest, _routing, _run, host_kernels  # noqa: F401  (host_kernels: a fixture)

from epcc.backends.cuda import meta_program
from epcc.backends.cuda.placement import placement
from epcc.plan.segments import segment_program

CASES = [("h200x2_2vnode", 40, 3), ("h200x4_ubb2x2", 24, 2), ("ubbv2_ep32_port10", 4, 1)]


def test_the_headers_phase_constants_are_the_programs():
    text = HEADER.read_text(encoding="utf-8")
    assert "kSeries = kBlock / kLanes" in text and "kBlock = 128" in text and "kLanes = 32" in text
    assert meta_program.SCAN_SERIES == 128 // 32
    assert f"kOffsetBlocks = {meta_program.OFFSET_BLOCKS};" in text


@pytest.mark.parametrize("name,tokens,chunk", CASES)
def test_the_runtimes_grids_are_the_headers(host_kernels, name, tokens, chunk):  # noqa: F811
    plan, _, _, _ = _routing(name, tokens, chunk, 1)
    m = _manifest(plan, name, tokens, chunk)
    prog = segment_program(plan)
    most = {k: 0 for k in m["metadata"]["blocks"]}
    for rank in (0, plan.num_ranks - 1):
        pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
        mp = meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens)
        lib = host_kernels(mp.capacity())
        lib.epcc_meta_phase_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.epcc_meta_phase_blocks.restype = ctypes.c_longlong
        arr = np.ascontiguousarray(mp.array)
        got = [lib.epcc_meta_phase_blocks(arr.ctypes.data, phase) for phase in range(4)]
        g = mp.grids()
        assert got == [g["count"], g["scan"], g["rows"] + g["count"], g["items"]]
        h = {f: int(mp.array[i]) for i, f in enumerate(meta_program.HEADER)}
        series = 2 * h["num_sets"] + h["num_ranks"] * h["experts"]
        assert g["scan"] == meta_program.OFFSET_BLOCKS + -(-series // meta_program.SCAN_SERIES) > 4
        for k, n in zip(("meta_count", "meta_scan", "meta_rows", "meta_items"), got):
            most[k] = max(most[k], n)
    assert all(m["metadata"]["blocks"][k] >= n for k, n in most.items()), (m["metadata"]["blocks"], most)


@pytest.mark.parametrize("name,tokens,chunk", CASES)
def test_the_runtimes_busy_blocks_are_the_ones_the_kernel_gives_work(host_kernels, name, tokens, chunk):  # noqa: F811
    """MetaProgram.busy_blocks (the timeline's per-phase blocks) names exactly the blocks of each grid
    whose first phase block (meta.cuh phase_first) exists: the scan's from after the count blocks."""
    plan, _, _, _ = _routing(name, tokens, chunk, 1)
    m = _manifest(plan, name, tokens, chunk)
    prog = segment_program(plan)
    rank = plan.num_ranks - 1
    pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
    mp = meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens)
    lib = host_kernels(mp.capacity())
    lib.epcc_meta_phase_first.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    lib.epcc_meta_phase_first.restype = ctypes.c_longlong
    arr = np.ascontiguousarray(mp.array)
    blocks = mp.phase_blocks()
    for grid in (1, 7, blocks["count"], blocks["count"] + 1, blocks["count"] + blocks["scan"] + 3, 500):
        busy = mp.busy_blocks(grid)
        for phase, name_ in enumerate(("count", "scan", "rows", "items")):
            first, n = busy[name_]
            want = {(first + i) % grid for i in range(min(n, grid))}
            got = {b for b in range(grid) if lib.epcc_meta_phase_first(arr.ctypes.data, phase, b, grid) < blocks[name_]}
            assert got == want, (grid, name_)


@pytest.mark.parametrize("name,tokens,chunk", CASES)
@pytest.mark.parametrize("blocks", [1, 2, 7, 500])
def test_any_grid_writes_the_same_tables(host_kernels, name, tokens, chunk, blocks):  # noqa: F811
    plan, idx, w, counts = _routing(name, tokens, chunk, 3)
    m = _manifest(plan, name, tokens, chunk)
    prog = segment_program(plan)
    rank = plan.num_ranks - 1
    want = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts)
    got = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts, grid=blocks)
    for p in want[1]:
        assert np.array_equal(want[1][p], got[1][p]), p
    assert want[2] == got[2]
    for a, b in zip(want[3:], got[3:]):
        assert np.array_equal(a, b)
