"""The metadata kernels of the table-driven CUDA target (include/epcc/table/meta.cuh) on the CPU:
compiled for the host (tests/backends/meta/meta_host.cpp: each block's phases run thread after
thread), they must write, byte for byte, the placed blobs the host builds from runtime/layout's
layout (runtime/engines/cuda_table/placed.py) -- for every rank of every plan they cover, with
uneven token counts, a rank with none, empty (-1) slots and a bad routing row; and so must their
NumPy version (runtime/testing/device_tables.py).  The GPU runs the same code (tests/gpu)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_cuda_codegen import CASES, codegen, small_case, source_of

from epcc.backends.cuda import meta_program
from epcc.backends.cuda.abi import dtype
from epcc.backends.cuda.placement import max_chunks, placement, template
from epcc.plan.model import chunk_sizes
from epcc.plan.segments import segment_program
from epcc.runtime.engines.cuda_table.placed import build_placed, placed_differences
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing.device_tables import Routing, device_tables

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "backends" / "cuda" / "include"
HEADER = INCLUDE / "epcc" / "table" / "meta.cuh"
COVERED = [c for c in CASES if c[0] != "ubbv2_ep32"]  # ubbv2_ep32: more paths than one 64-bit word of sets


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("meta") / "libmeta_host.so"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", f"-I{INCLUDE}",
                        "-o", str(out), str(Path(__file__).parent / "meta" / "meta_host.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(out))
    lib.epcc_meta_run.argtypes = [ctypes.c_void_p] * 12
    lib.epcc_meta_scratch_words.argtypes = [ctypes.c_void_p]
    lib.epcc_meta_scratch_words.restype = ctypes.c_longlong
    return lib


def _routing(name: str, tokens: int, chunk: int, seed: int):
    """A plan with small rows, a routing with uneven token counts (the last rank none), empty slots."""
    plan, _, idx, w, _ = small_case(name, tokens, chunk, seed=seed)
    R = plan.num_ranks
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, tokens + 1, R)
    counts[0], counts[-1] = tokens, 0
    idx = idx.copy()
    for r, n in enumerate(counts):
        idx[r, n:] = -1
    idx[rng.random(idx.shape) < 0.05] = -1
    return plan, idx, w.astype(np.float32), counts


def _run(lib, plan, m, prog, rank, tokens, idx, w, counts, blobs=None):
    """The host-compiled kernels' blobs and received rows of `rank` (into `blobs` where given,
    after restoring their static fields as the GPU does: the template up to the row arrays)."""
    R = plan.num_ranks
    pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
    arr = np.ascontiguousarray(meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens).array)
    scratch = np.zeros(lib.epcc_meta_scratch_words(arr.ctypes.data), dtype=np.int64)
    if blobs is None:
        blobs = {p: template(m, pls[p], R).copy() for p in pls}
    else:
        for p in pls:
            n = pls[p].offsets["rows"]
            blobs[p][:n] = template(m, pls[p], R)[:n]
    t32, w32 = np.ascontiguousarray(idx, dtype=np.int32), np.ascontiguousarray(w, dtype=np.float32)
    c32, bad = np.ascontiguousarray(counts, dtype=np.int32), np.zeros(1, np.int32)
    epr = plan.workload.experts // R
    cap = R * tokens * min(plan.workload.topk, epr)
    rw, ri = np.zeros(cap, np.float32), np.zeros(cap, np.int64)
    rc, ro = np.zeros(epr, np.int32), np.zeros(epr + 1, np.int32)
    ptrs = [a.ctypes.data for a in (arr, scratch, c32, t32, w32, blobs["dispatch"], blobs["combine"], bad, rw, ri, rc,
                                    ro)]
    assert lib.epcc_meta_run(*ptrs) == 0
    return pls, blobs, int(bad[0]), rw, ri, rc, ro


@pytest.mark.parametrize("name,tokens,chunk", COVERED)
@pytest.mark.parametrize("seed", [1, 2])
def test_host_compiled_kernels_write_the_host_layouts_blobs(host_kernels, name, tokens, chunk, seed):
    plan, idx, w, counts = _routing(name, tokens, chunk, seed)
    layout = compute_layout(plan, idx, w, counts)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    for rank in range(plan.num_ranks):
        pls, blobs, bad, rw, ri, rc, ro = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts)
        for p, pl in pls.items():
            want = build_placed(m, layout, pl).blob
            diff = np.flatnonzero(want != blobs[p])
            assert not diff.size, f"{name} rank {rank} {p}: {diff.size} bytes differ, from byte {diff[0]} " \
                                  f"(sections at {pl.offsets})"
        assert bad >= tokens  # none
        n = int(layout.recv_counts[rank].sum())
        assert rc.tolist() == layout.recv_counts[rank].tolist()
        assert ro.tolist() == [0, *np.cumsum(layout.recv_counts[rank]).tolist()]
        assert np.array_equal(ri[:n], layout.entries[("output", rank)][:, 2])
        assert np.array_equal(rw[:n], layout.output_weights[rank])


def test_a_bad_routing_row_is_marked_and_ignored(host_kernels):
    """A repeated expert or one out of range: the first bad token of this rank is reported, the
    entry dropped (as -1), and the tables are those of the routing without it."""
    name, tokens, chunk = "h200x4_2vnode", 16, 3
    plan, idx, w, counts = _routing(name, tokens, chunk, 3)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    bad_idx = idx.copy()
    bad_idx[0, 5, 1] = bad_idx[0, 5, 0] = 7  # rank 0 (all its tokens), token 5: expert 7 twice
    bad_idx[0, 9, 3] = 999  # out of range
    clean = bad_idx.copy()
    clean[0, 5, 1] = -1
    clean[0, 9, 3] = -1
    layout = compute_layout(plan, clean, w, counts)
    pls, blobs, bad, *_ = _run(host_kernels, plan, m, prog, 0, tokens, bad_idx, w, counts)
    assert bad == 5
    for p, pl in pls.items():
        assert np.array_equal(build_placed(m, layout, pl).blob, blobs[p]), p
    assert _run(host_kernels, plan, m, prog, 1, tokens, bad_idx, w, counts)[2] >= tokens  # another rank's row


@pytest.mark.parametrize("name,tokens,chunk", COVERED[:3])
def test_a_dispatch_over_the_last_ones_rows_reads_only_its_own(host_kernels, name, tokens, chunk):
    """The GPU restores only a blob's static fields per dispatch: a routing after a busier one
    leaves rows past its counts, which the kernels never read; what they read equals the host's,
    and a wrong byte there is found."""
    plan, idx, w, counts = _routing(name, tokens, chunk, 5)
    _, busy_idx, busy_w, _ = _routing(name, tokens, chunk, 6)
    busy_idx[busy_idx < 0] = idx.max()  # every slot of every token taken (repeats are dropped)
    busy = np.full_like(counts, tokens)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    layout = compute_layout(plan, idx, w, counts)
    stale = checked = 0
    for rank in range(plan.num_ranks):
        _, blobs, *_ = _run(host_kernels, plan, m, prog, rank, tokens, busy_idx, busy_w, busy)
        pls, blobs, *_ = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts, blobs=blobs)
        for p, pl in pls.items():
            want = build_placed(m, layout, pl).blob
            assert not placed_differences(want, blobs[p], pl).size, (rank, p)
            stale += int(np.count_nonzero(want != blobs[p]))
            cd = dtype("CopyDesc")
            for pc in pl.copies:
                at = pl.offsets["copies"] + pc.index * cd.itemsize
                n = int(want[at: at + cd.itemsize].view(cd)[0]["n_rows"])
                if 0 < n < pc.rows_cap:
                    bad = blobs[p].copy()
                    bad[pc.dst_rows + 8 * n - 8] ^= 1  # the last row read
                    bad[pc.dst_rows + 8 * n] ^= 1  # the first one past: not read
                    assert placed_differences(want, bad, pl).tolist() == [pc.dst_rows + 8 * n - 8]
                    checked += 1
    assert stale and checked  # the case has rows left over, and rows to spoil


@pytest.mark.parametrize("name,tokens,chunk", COVERED[:3])
def test_numpy_version_writes_the_same_blobs(name, tokens, chunk):
    plan, idx, w, counts = _routing(name, tokens, chunk, 4)
    layout = compute_layout(plan, idx, w, counts)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    for rank in range(plan.num_ranks):
        pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
        got = device_tables(m, plan, prog, pls, Routing(idx, w, counts))
        for p, pl in pls.items():
            assert np.array_equal(build_placed(m, layout, pl).blob, got[p].blob), (rank, p)


def test_the_headers_field_indices_are_the_programs():
    """meta.cuh's enums name meta_program.py's record fields, in order."""
    text = HEADER.read_text(encoding="utf-8")
    for prefix, enum, fields in [("H", "Header", meta_program.HEADER), ("S", "Set", meta_program.SET),
                                 ("G", "Group", meta_program.GROUP), ("C", "Copy", meta_program.COPY),
                                 ("P", "Part", meta_program.PART), ("K", "Contrib", meta_program.CONTRIB),
                                 ("T", "TCopy", meta_program.TCOPY), ("R", "Role", meta_program.ROLE),
                                 ("D", "Drain", meta_program.DRAIN), ("Z", "Zero", meta_program.ZERO),
                                 ("W", "Work", meta_program.WORK)]:
        body = re.search(r"enum " + enum + r" \{(.*?)\};", text, re.S).group(1)
        names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
        assert names == [f"{prefix}_{f}" for f in fields] + [f"{prefix}_COUNT"], enum
    assert f"kBlock = {meta_program.TOKEN_BLOCK}" in text and f"kMaxSets = {meta_program.MAX_SETS}" in text


def test_max_chunks_is_the_most_any_shorter_copy_has():
    for tpc in (1, 3, 8, 64):
        for head in (0, 1, 3):
            for tail in (0, 2, 3):
                for n in range(0, 400, 13):
                    most = max(len(chunk_sizes(k, tpc, head, tail)) for k in range(n + 1))
                    assert max_chunks(n, tpc, head, tail) == most, (n, tpc, head, tail)


def test_which_bundles_get_their_tables_from_the_gpu():
    """One-box multi-hop plans: the metadata kernels (no host layout step in the manifest); the
    GPU proxy path and plans beyond one box: the host, saying why."""
    for name, want in [("h200x4_2vnode", "device"), ("h200x4_ubb2x2", "device"), ("h200x2_2vnode_relay", "device"),
                       ("ubbv2_ep16", "host")]:
        plan = codegen_plan(name)
        m = codegen.generate(plan, source_of(name)).manifest
        assert m["metadata"]["lowering"] == want, (name, m["metadata"])
        kinds = {n["kind"] for n in m["not_lowered"]}
        assert ("metadata" in kinds) == (want == "host"), name
        if want == "device":
            assert "epcc_table_meta.cu" in m["build"]["sources"] and "epcc/table/meta.cuh" in m["build"]["headers"]
    plan = codegen_plan("h200x4_2vnode")
    m = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy")).manifest
    assert m["metadata"] == {"lowering": "host", "why": "the GPU proxy path's channels are set up from host-built "
                                                         "tables"}


def codegen_plan(name: str):
    from test_cuda_codegen import plan_of
    return plan_of(name)
