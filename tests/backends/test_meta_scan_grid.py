"""meta_scan's grid: the blocks the runtime launches (meta_program.py grids()["scan"], the
manifest's metadata "blocks") are the header's scan_blocks, which the host build of the kernels
runs (tests/backends/meta/meta_host.cpp); and the tables do not depend on how many blocks share
the sums: a grid of one block, or of more blocks than there are series, writes what that grid writes."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from test_meta_kernels import _manifest, _routing, _run, host_kernels  # noqa: F401  (host_kernels: a fixture)

from epcc.backends.cuda import meta_program
from epcc.backends.cuda.placement import placement
from epcc.plan.segments import segment_program

CASES = [("h200x2_2vnode", 40, 3), ("h200x4_ubb2x2", 24, 2), ("ubbv2_ep32_port10", 4, 1)]


@pytest.mark.parametrize("name,tokens,chunk", CASES)
def test_the_runtimes_scan_grid_is_the_headers(host_kernels, name, tokens, chunk):  # noqa: F811
    plan, _, _, _ = _routing(name, tokens, chunk, 1)
    m = _manifest(plan, name, tokens, chunk)
    prog = segment_program(plan)
    most = 0
    for rank in (0, plan.num_ranks - 1):
        pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
        mp = meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens)
        lib = host_kernels(mp.capacity())
        lib.epcc_meta_scan_blocks.argtypes, lib.epcc_meta_scan_blocks.restype = [ctypes.c_void_p], ctypes.c_longlong
        arr = np.ascontiguousarray(mp.array)
        got = lib.epcc_meta_scan_blocks(arr.ctypes.data)
        assert mp.grids()["scan"] == got > 1
        h = {f: int(mp.array[i]) for i, f in enumerate(meta_program.HEADER)}
        assert got == -(-(2 * h["num_sets"] + h["num_ranks"] * h["experts"]) // meta_program.SCAN_SERIES)
        most = max(most, got)
    assert m["metadata"]["blocks"]["meta_scan"] >= most


@pytest.mark.parametrize("name,tokens,chunk", CASES)
@pytest.mark.parametrize("blocks", [1, 2, 500])
def test_any_scan_grid_writes_the_same_tables(host_kernels, name, tokens, chunk, blocks):  # noqa: F811
    plan, idx, w, counts = _routing(name, tokens, chunk, 3)
    m = _manifest(plan, name, tokens, chunk)
    prog = segment_program(plan)
    rank = plan.num_ranks - 1
    pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
    lib = host_kernels(meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens).capacity())
    want = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts)
    lib.epcc_meta_set_scan_grid(blocks)
    try:
        got = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts)
    finally:
        lib.epcc_meta_set_scan_grid(0)
    for p in want[1]:
        assert np.array_equal(want[1][p], got[1][p]), p
    assert want[2] == got[2]
    for a, b in zip(want[3:], got[3:]):
        assert np.array_equal(a, b)
