"""The metadata kernels of the table-driven CUDA target (include/epcc/table/meta.cuh) on the CPU:
compiled for the host (tests/backends/meta/meta_host.cpp: each block's phases run thread after
thread), they must write, byte for byte, the placed blobs the host builds from runtime/layout's
layout (runtime/engines/cuda_table/placed.py) -- for every rank of every plan they cover, with
uneven token counts, a rank with none, empty (-1) slots and a bad routing row; and so must their
NumPy version (runtime/testing/device_tables.py).  The GPU runs the same code (tests/gpu)."""

from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import test_cuda_codegen
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cuda_codegen import ALL, CASES, codegen, small_case, source_of

from epcc import pipeline

from epcc.backends.cuda import meta_program
from epcc.backends.cuda.abi import dtype
from epcc.backends.cuda.placement import max_chunks, placement, template
from epcc.backends.target import CUDA, SUPA
from epcc.plan.model import chunk_sizes
from epcc.plan.rdma import rdma_steps
from epcc.plan.segments import segment_program
from epcc.runtime.engines.cuda_table.placed import build_placed, placed_differences
from epcc.runtime.engines.cuda_table.tables import build_tables, copy_rows, parse_tables
from epcc.runtime.engines.gpu_proxy import channels
from epcc.runtime.layout import compute_layout
from epcc.runtime.testing.device_tables import Routing, device_tables

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "backends" / "cuda" / "include"
HEADER = INCLUDE / "epcc" / "table" / "meta.cuh"
# Every shipped plan, with tokens and chunk sizes small enough for the CPU (every rank of the
# 32-rank plans runs): the emulator's cases and the rest.  ubbv2_ep32 and its port-10 variant have
# 98 token sets of one home rank (two 64-bit words of memberships).
COVERED = [*CASES, ("h200x2_2vnode", 40, 3), ("h200x2_2vnode_mixed", 40, 3), ("h200x2_2vnode_relay", 40, 3),
           ("h200x4_ubb2x2", 24, 2), ("ubbv2_card", 24, 3), ("ubbv2_ep32_port10", 4, 1)]
# plans with RDMA steps compiled with --rdma proxy (the GPU proxy path): one and two RDMA steps per
# program, 2 and 4 ranks, a forward after the RDMA step (2vnode on 4 GPUs) and a reorder before it (ubb2x2)
PROXY = [("h200x2_2vnode", 40, 3), ("h200x4_2vnode", 32, 3), ("h200x2_2vnode_relay", 40, 3),
         ("h200x4_ubb2x2", 24, 2), ("xv2", 24, 2)]
# Every shipped plan's RDMA roles move one channel each; here one pack role feeds two (every GPU
# sends straight to both GPUs of the other vnode), so the chunks of a role are numbered per channel.
XV2 = """schedule xv2 "2 vnodes x 2 GPUs: every GPU sends over RDMA to both GPUs of the other vnode"
topology xv2 {
  levels vnode 2, gpu 2
  rank gpu
  relation nvl = other gpu
  relation xv = other vnode or other vnode, other gpu
  sm copy 44 GB/s, reduce 23 GB/s, add 12 GB/s
  link nvlink p2p {
    connects nvl
    bandwidth 450 GB/s
    latency 3 us
    engine sm
  }
  link rdma rdma {
    connects xv
    bandwidth 50 GB/s
    latency 5 us
    engine nic  post 10 us
  }
  link hbm local {
    bandwidth 3000 GB/s
    latency 1 us
  }
}
workload {
  tokens 64 per rank
  hidden 256
  dtype bf16
  topk 4
  experts 16 blocked
  weights travel
}
dispatch {
  step meta "counts": exchange counts with all
  step far "both GPUs of the other vnode over RDMA":
      send tokens for xv from input to xv.output over rdma chunk 8 tokens depth 4
  step intra "the vnode peer over NVLink":
      send tokens for nvl from input to nvl.output over nvlink sms 4 parallel with far chunk 8 tokens depth 4
  step keep "own tokens": permute input into output over hbm sms 4 chunk 8 tokens depth 4
}
combine reverse of dispatch
"""


@pytest.fixture(scope="module", autouse=True)
def xv2_plan(tmp_path_factory):
    """The plan of XV2, where small_case finds it (test_cuda_codegen.plan_of's cache)."""
    path = tmp_path_factory.mktemp("xv2") / "xv2.sched"
    path.write_text(XV2, encoding="utf-8")
    test_cuda_codegen._PLANS["xv2"] = pipeline.run(str(path)).passes.get("plan")
    yield
    test_cuda_codegen._PLANS.pop("xv2", None)


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """The kernels compiled for the host at a capacity (meta_program.Capacity: the shared memory
    sizes a bundle's driver defines; None: the header's defaults), one build per capacity."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("meta")
    built: dict[tuple, ctypes.CDLL] = {}

    def lib_for(cap: meta_program.Capacity | None = None) -> ctypes.CDLL:
        key = tuple(sorted(cap.macros().items())) if cap is not None else ()
        if key not in built:
            out = root / f"libmeta_host_{len(built)}.so"
            r = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
                                f"-I{INCLUDE}", *(f"-D{k}={v}" for k, v in key), "-o", str(out),
                                str(Path(__file__).parent / "meta" / "meta_host.cpp")], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            lib = ctypes.CDLL(str(out))
            lib.epcc_meta_run.argtypes = [ctypes.c_void_p] * 14
            lib.epcc_meta_set_grid.argtypes = [ctypes.c_int]
            lib.epcc_meta_scratch_words.argtypes = [ctypes.c_void_p]
            lib.epcc_meta_scratch_words.restype = ctypes.c_longlong
            lib.epcc_meta_shared_bytes.restype = ctypes.c_longlong
            built[key] = lib
        return built[key]

    return lib_for


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


_MANIFESTS: dict[tuple, dict] = {}


def _manifest(plan, name: str, tokens: int, chunk: int) -> dict:
    """The default bundle's manifest of small_case(name, tokens, chunk)'s plan (cached: the
    32-rank plans take a while)."""
    key = (name, tokens, chunk)
    if key not in _MANIFESTS:
        _MANIFESTS[key] = codegen.generate(plan, source_of(name)).manifest
    return _MANIFESTS[key]


def _check_every_rank(kernels, name, plan, m, tokens, idx, w, counts, key=None, grid=0) -> None:
    """Every rank's blobs and received rows from the host-compiled kernels, byte for byte the host
    layout's (runtime/layout, the oracle) for this routing (`grid`: as _run's)."""
    layout = compute_layout(plan, idx, w, counts)
    prog = segment_program(plan)
    for rank in range(plan.num_ranks):
        pls, blobs, bad, rw, ri, rc, ro = _run(kernels, plan, m, prog, rank, tokens, idx, w, counts,
                                               key=None if key is None else (*key, rank), grid=grid)
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


_PROGRAMS: dict[tuple, tuple] = {}


def _run_capacity(plan, m, prog, rank: int, tokens: int) -> meta_program.Capacity:
    """The capacity `rank`'s program needs (the build _run uses for it)."""
    pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
    return meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens).capacity()


def _run(kernels, plan, m, prog, rank, tokens, idx, w, counts, seqs=None, blobs=None, key=None, grid=0):
    """The host-compiled kernels' blobs and received rows of `rank`, built at the capacity its
    program needs, as the bundle's driver is (into `blobs` where given,
    after restoring their static fields as the GPU does: the template up to the row arrays);
    `seqs` (a dict): each program's RDMA items' sequence numbers on their channels go there too
    (the GPU proxy path's); `key`: names the bundle and rank, whose placements and program (the
    same for every routing) are then kept for the next call; `grid`: the phases' blocks in the
    order of the cooperative kernel of that many blocks (0: of the four launches)."""
    R = plan.num_ranks
    if key is None or key not in _PROGRAMS:
        pls = {p: placement(m, prog, p, rank, tokens) for p in ("dispatch", "combine")}
        mp = meta_program.encode(m, plan.workload.placement, prog, pls, rank, tokens)
        if key is not None:
            _PROGRAMS[key] = pls, mp
    else:
        pls, mp = _PROGRAMS[key]
    lib = kernels(mp.capacity())
    arr = np.ascontiguousarray(mp.array)
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
    if seqs is not None:
        seqs.update({p: np.full(max(pls[p].num_items, 1), 0xFFFFFFFF, np.uint32) for p in pls})
    ptrs += [seqs[p].ctypes.data if seqs is not None else None for p in ("dispatch", "combine")]
    lib.epcc_meta_set_grid(grid)
    try:
        assert lib.epcc_meta_run(*ptrs) == 0
    finally:
        lib.epcc_meta_set_grid(0)
    return pls, blobs, int(bad[0]), rw, ri, rc, ro


def test_every_shipped_plan_is_covered():
    assert sorted({c[0] for c in COVERED}) == ALL


@pytest.mark.parametrize("name,tokens,chunk", COVERED)
@pytest.mark.parametrize("seed,grid", [(1, 0), (2, 5)])
def test_host_compiled_kernels_write_the_host_layouts_blobs(host_kernels, name, tokens, chunk, seed, grid):
    """Seed 1 as the four launches run the phases, seed 2 as the cooperative kernel of 5 blocks does."""
    plan, idx, w, counts = _routing(name, tokens, chunk, seed)
    _check_every_rank(host_kernels, name, plan, _manifest(plan, name, tokens, chunk), tokens, idx, w, counts,
                      key=(name, tokens, chunk), grid=grid)


@pytest.mark.parametrize("name", ["h200x2_2vnode", "h200x2_2vnode_relay"])
def test_copies_of_more_chunks_than_a_block_has_threads(host_kernels, name):
    """An items block's thread reads its first chunk's place before the wait for the copy's rows, and
    every further chunk's (a copy of more than kBlock chunks: ubbv2_ep16 and ubbv2_ep32 at 4096 tokens)
    after it: one-token chunks of 300 tokens give copies of up to 300, both ways."""
    tokens, chunk = 300, 1
    plan, layout, _, _, _ = small_case(name, tokens, chunk)
    assert max(len(c.chunk_starts) - 1 for c in layout.copies) > meta_program.TOKEN_BLOCK
    plan, idx, w, counts = _routing(name, tokens, chunk, 3)
    for grid in (0, 7):
        _check_every_rank(host_kernels, name, plan, _manifest(plan, name, tokens, chunk), tokens, idx, w, counts,
                          key=(name, tokens, chunk), grid=grid)


def _hidden_routing(plan, tokens: int, rng, zero: int, masked: float, hot: int):
    """A routing no test fixes: per rank a token count (rank `zero` none), per token top-k distinct
    experts drawn from `hot` experts favoured 8 : 1 over the rest (0: all alike), a share
    `masked` of slots -1, weights at random."""
    wl, R = plan.workload, plan.num_ranks
    favour = np.ones(wl.experts)
    favour[rng.permutation(wl.experts)[:hot]] = 8.0
    keys = rng.random((R, tokens, wl.experts)) ** (1.0 / favour)  # weighted sampling without replacement
    idx = np.argsort(-keys, axis=2)[:, :, :wl.topk].astype(np.int64)
    counts = rng.integers(0, tokens + 1, R)
    counts[zero] = 0
    for r, n in enumerate(counts):
        idx[r, n:] = -1
    idx[rng.random(idx.shape) < masked] = -1
    w = rng.random(idx.shape).astype(np.float32)
    return idx, w, counts


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(COVERED), seed=st.integers(0, 2**32 - 1), zero=st.integers(0, 63),
       masked=st.sampled_from([0.0, 0.1, 0.6]), hot=st.sampled_from([0, 3, 40]), grid=st.sampled_from([0, 1, 3, 64]))
def test_hidden_routings_every_plan(host_kernels, case, seed, zero, masked, hot, grid):
    """Property: for any shipped plan and any routing -- uneven token counts, a rank with none,
    masked slots, skewed or uniform experts -- every rank's device tables are the host layout's,
    whether the four launches or the cooperative kernel (of `grid` blocks) run the phases."""
    name, tokens, chunk = case
    plan = small_case(name, tokens, chunk, seed=1)[0]
    idx, w, counts = _hidden_routing(plan, tokens, np.random.default_rng(seed), zero % plan.num_ranks, masked, hot)
    _check_every_rank(host_kernels, name, plan, _manifest(plan, name, tokens, chunk), tokens, idx, w, counts,
                      key=(name, tokens, chunk), grid=grid)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=st.integers(1, 64), epr=st.integers(1, 40), strided=st.booleans(), seed=st.integers(0, 2**32 - 1),
       empty=st.sampled_from([0.0, 0.5, 1.0]))
def test_expert_offsets_for_any_ranks_and_experts(host_kernels, ranks, epr, strided, seed, empty):
    """Property: the scan's expert offsets (expert_offsets: kBlock / R threads a rank, a run of local
    experts each, a log-step scan over the runs) are the prefix sums they stand for, for any number
    of ranks (dividing the block's threads or not), experts per rank (fewer or more than a rank's
    threads), placement and rank, experts with no rows included: each home's rows of an expert from
    the lower home ranks, each expert's first row on its rank (the rows of its lower local
    experts), this rank's received rows per local expert and where each starts."""
    E = ranks * epr
    if E > 1024:  # the default build's capacity
        epr = 1024 // ranks
        E = ranks * epr
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 60, (ranks, E)).astype(np.int64)
    rows[rng.random(rows.shape) < empty] = 0
    rank = int(rng.integers(0, ranks))
    lib = host_kernels()
    lib.epcc_meta_expert_offsets.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 5
    home = np.zeros((ranks, E), np.int64)
    first = np.zeros(E, np.int64)
    recv_count = np.zeros(epr, np.int32)
    recv_offset = np.zeros(epr + 1, np.int32)
    assert lib.epcc_meta_expert_offsets(ranks, E, int(strided), rank, rows.ctypes.data, home.ctypes.data,
                                        first.ctypes.data, recv_count.ctypes.data, recv_offset.ctypes.data) == 0
    assert np.array_equal(home, np.cumsum(rows, axis=0) - rows)
    total = rows.sum(axis=0)
    want = np.zeros(E, np.int64)
    for d in range(ranks):
        experts = [(l * ranks + d) if strided else (d * epr + l) for l in range(epr)]
        want[experts] = np.cumsum(total[experts]) - total[experts]
        if d == rank:
            assert recv_count.tolist() == total[experts].tolist()
            assert recv_offset.tolist() == [*want[experts].tolist(), int(total[experts].sum())]
    assert np.array_equal(first, want)


def test_the_kernels_divisions_without_a_divide_are_exact(host_kernels):
    """An expert's rank and local index are a multiply (Div16), token counts divide in 32 bits
    where they fit: every divisor up to 4096 against every 16-bit numerator, the larger divisors at
    their multiples, and the 64-bit fallback around 2^32 (meta_host.cpp says which)."""
    lib = host_kernels()
    lib.epcc_meta_check_division.argtypes = [ctypes.c_uint]
    lib.epcc_meta_check_division.restype = ctypes.c_longlong
    assert lib.epcc_meta_check_division(4096) == 0


def test_a_slot_word_carries_the_expert_the_weight_and_the_exchanges_tag(host_kernels):
    """What the exchange writes per top-k slot (meta.cuh slot_word): the expert's code in the low 16
    bits, the tag in the next 16, the weight's bits in the high 32 -- one 8-byte store.  An expert the
    kernels cannot hold (negative, 0x7ff0 and up, int64 values past int32) is the bad code, never an
    expert it aliases; a token past its rank's count is absent (weight 0); the tag is never the zeroed
    area's 0 (its high bit is set) and comes back after 32768 exchanges."""
    lib = host_kernels()
    lib.epcc_meta_slot_word.argtypes = [ctypes.c_longlong, ctypes.c_float, ctypes.c_int, ctypes.c_uint]
    lib.epcc_meta_slot_word.restype = ctypes.c_ulonglong
    lib.epcc_meta_slot_expert.argtypes = [ctypes.c_ulonglong]
    lib.epcc_meta_tag_of.argtypes = [ctypes.c_ulonglong]
    lib.epcc_meta_tag_of.restype = ctypes.c_uint
    bits = int(np.float32(0.25).view(np.uint32))
    assert lib.epcc_meta_slot_word(3, 0.25, 1, 7) == bits << 32 | 7 << 16 | 3
    assert lib.epcc_meta_slot_word(0x7FEF, 0.25, 1, 7) & 0xFFFF == 0x7FEF
    assert lib.epcc_meta_slot_word(-1, 0.25, 1, 9) == bits << 32 | 9 << 16 | 0xFFFF
    assert lib.epcc_meta_slot_word(5, 0.25, 0, 9) == 9 << 16 | 0xFFFE  # absent: no weight
    for e in (-2, -5, 0x7FF0, 0xFFFF, 2**32 + 3, -(2**40), 2**63 - 1):
        word = lib.epcc_meta_slot_word(e, 0.25, 1, 1)
        assert word & 0xFFFF == 0xFFFD and lib.epcc_meta_slot_expert(word) == -3, e  # bad: count drops it
    assert [lib.epcc_meta_slot_expert(lib.epcc_meta_slot_word(e, 1.0, p, 1)) for e, p in
            ((0, 1), (255, 1), (-1, 1), (4, 0))] == [0, 255, -1, -2]
    tags = [lib.epcc_meta_tag_of(e) for e in (0, 1, 0x7FFF, 0x8000, 0x8001, 2**40 + 5)]
    assert tags == [0x8000, 0x8001, 0xFFFF, 0x8000, 0x8001, 0x8005]


@pytest.mark.parametrize("grid", [0, 5])
def test_a_rank_whose_routing_never_came_is_named(host_kernels, grid):
    """A rank's slot words with the tag of the exchange before (its routing never came): count's wait
    gives up on that rank -- the error word {1, rank} the runtime turns into "the metadata exchange
    timed out: rank R received no routing from rank N" (on the GPU after the timeout; here at once,
    every word being in place before the kernels run) -- and a whole routing runs clean after."""
    name, tokens, chunk = "h200x4_2vnode", 16, 3
    plan, idx, w, counts = _routing(name, tokens, chunk, 3)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    lib = host_kernels(_run_capacity(plan, m, prog, 1, tokens))
    lib.epcc_meta_error_rank.restype = ctypes.c_int
    lib.epcc_meta_set_stale.argtypes = [ctypes.c_int]
    for stale in (2, 0):
        lib.epcc_meta_set_stale(stale)
        with pytest.raises(AssertionError):
            _run(host_kernels, plan, m, prog, 1, tokens, idx, w, counts, grid=grid)
        assert lib.epcc_meta_error_rank() == stale
    _run(host_kernels, plan, m, prog, 1, tokens, idx, w, counts, grid=grid)
    assert lib.epcc_meta_error_rank() == -1


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
                                 ("SI", "SetInfoField", meta_program.SET_INFO),
                                 ("G", "Group", meta_program.GROUP), ("C", "Copy", meta_program.COPY),
                                 ("P", "Part", meta_program.PART), ("K", "Contrib", meta_program.CONTRIB),
                                 ("T", "TCopy", meta_program.TCOPY), ("R", "Role", meta_program.ROLE),
                                 ("D", "Drain", meta_program.DRAIN), ("Z", "Zero", meta_program.ZERO),
                                 ("W", "Work", meta_program.WORK)]:
        body = re.search(r"enum " + enum + r" \{(.*?)\};", text, re.S).group(1)
        names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
        assert names == [f"{prefix}_{f}" for f in fields] + [f"{prefix}_COUNT"], enum
    assert f"kBlock = {meta_program.TOKEN_BLOCK}" in text and f"kMaxSets = {meta_program.SET_WORD} * kSetWords" in text


def test_max_chunks_is_the_most_any_shorter_copy_has():
    for tpc in (1, 3, 8, 64):
        for head in (0, 1, 3):
            for tail in (0, 2, 3):
                for n in range(0, 400, 13):
                    most = max(len(chunk_sizes(k, tpc, head, tail)) for k in range(n + 1))
                    assert max_chunks(n, tpc, head, tail) == most, (n, tpc, head, tail)


def _proxy_manifest(plan, name: str) -> dict:
    return codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma="proxy", proxy_device_tables=True)).manifest


def _rdma_items(m: dict, parsed: dict, program: str) -> list[int]:
    """The items of the pack and unpack roles of decoded tables."""
    kernel = next(k for k in m["kernels"] if k["program"] == program and k["kind"] == "main")
    return [item for ri, role in enumerate(kernel["roles"]) if role.get("lowered") in ("rdma-pack", "rdma-unpack")
            for item, *_ in channels.role_items(parsed, ri, role["step"])]


@pytest.mark.parametrize("name,tokens,chunk", PROXY)
@pytest.mark.parametrize("seed", [1, 2])
def test_gpu_proxy_bundles_get_the_host_layouts_blobs_and_chunk_numbers(host_kernels, name, tokens, chunk, seed):
    """A bundle of the GPU proxy path: the kernels write the host layout's blobs, and number every
    RDMA chunk on its channel (Args.seq, what the pack and unpack roles read) as the host does
    from the host layout's tables (channels.item_sequences)."""
    plan, idx, w, counts = _routing(name, tokens, chunk, seed)
    layout = compute_layout(plan, idx, w, counts)
    m = _proxy_manifest(plan, name)
    assert m["metadata"]["lowering"] == "device", m["metadata"]
    prog = segment_program(plan)
    numbered = two = 0
    for rank in range(plan.num_ranks):
        seqs: dict = {}
        pls, blobs, *_ = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts, seqs)
        for p, pl in pls.items():
            want = build_placed(m, layout, pl).blob
            assert np.array_equal(want, blobs[p]), (rank, p)
            parsed = parse_tables(want)
            want_seq, *_ = channels.item_sequences(m, parsed, p)
            items = _rdma_items(m, parsed, p)
            assert seqs[p][items].tolist() == want_seq[items].tolist(), (rank, p)
            numbered += len(items)
            for side in channels.item_sequences(m, parsed, p)[1:]:  # roles with chunks on two channels
                two += sum(1 for chans in side.values() if sum(1 for sizes in chans.values() if sizes) == 2)
    assert numbered > 0
    assert two > 0 or name != "xv2"


def _posts(m: dict, blob: np.ndarray, seq: np.ndarray, program: str, cp) -> tuple[dict, dict]:
    """What the GPU proxy path moves for decoded tables and their items' sequence numbers: per
    channel, what its pack role pushes (sequence number, bytes, its FIFO's role, the source row
    handles) and what its unpack role applies (sequence number, landing slot, destination rows,
    weights), in sequence order; every chunk checked against the slots of the channel plan `cp`."""
    parsed = parse_tables(blob)
    kernel = next(k for k in m["kernels"] if k["program"] == program and k["kind"] == "main")
    wire = channels.wire_pitch(m, program)
    sent, landed = {}, {}
    for ri, role in enumerate(kernel["roles"]):
        side = role.get("lowered")
        if side not in ("rdma-pack", "rdma-unpack"):
            continue
        for item, it, _, key in channels.role_items(parsed, ri, role["step"]):
            ids, slots, dst, wts = copy_rows(parsed, int(it["copy"]))
            rows = slice(int(it["row_begin"]), int(it["row_end"]))
            n = int(seq[item])
            if side == "rdma-pack":
                ch = cp.send[key]
                assert (rows.stop - rows.start) * wire <= min(ch.slot_bytes, cp.roles[[r.index for r in cp.roles]
                                                                                       .index(ri)].slot_bytes)
                sent.setdefault(key, []).append((n, (rows.stop - rows.start) * wire, role["step"],
                                                 ((ids[rows] << 40) | slots[rows]).tolist()))
            else:
                ch = cp.recv[key]
                assert (rows.stop - rows.start) * wire <= ch.slot_bytes
                landed.setdefault(key, []).append((n, n % ch.depth, dst[rows].tolist(),
                                                   None if wts is None else wts[rows].tolist()))
    return {k: sorted(v) for k, v in sent.items()}, {k: sorted(v) for k, v in landed.items()}


@pytest.mark.parametrize("name,tokens,chunk", PROXY)
def test_the_proxy_moves_from_device_tables_what_the_host_layout_says(host_kernels, name, tokens, chunk):
    """The GPU proxy path set up once from the placement (channels.from_placement: every channel
    any routing can use, slots for its largest chunk) and fed per dispatch by the metadata
    kernels' tables and chunk numbers moves, chunk for chunk, what the path set up from the host
    layout's tables moves (channels.from_tables, the oracle): the same chunks on the same
    channels with the same numbers, rows and weights, each fitting its slots; the host's channels
    are among the placement's."""
    plan, idx, w, counts = _routing(name, tokens, chunk, 5)
    layout = compute_layout(plan, idx, w, counts)
    m = _proxy_manifest(plan, name)
    prog = segment_program(plan)
    moved = 0
    for rank in range(plan.num_ranks):
        seqs: dict = {}
        pls, blobs, *_ = _run(host_kernels, plan, m, prog, rank, tokens, idx, w, counts, seqs)
        for p, pl in pls.items():
            kernel = next(k for k in m["kernels"] if k["program"] == p and k["kind"] == "main")
            steps = {s.step: s for s in rdma_steps(plan) if s.program == p}
            wire = channels.wire_pitch(m, p)
            dev = channels.from_placement(m, pl)
            assert dev.seq is None and dev.num_copies == len(pl.copies)
            dev_cp = channels.channel_plan(p, kernel, dev.pack, dev.unpack, steps, wire)
            host_blob = build_tables(m, layout, p, rank).blob
            host = channels.from_tables(m, host_blob, p)
            host_cp = channels.channel_plan(p, kernel, host.pack, host.unpack, steps, wire)
            assert host_cp.send.keys() <= dev_cp.send.keys() and host_cp.recv.keys() <= dev_cp.recv.keys()
            assert [r.index for r in dev_cp.roles] == [r.index for r in host_cp.roles]  # one FIFO per pack role
            got = _posts(m, blobs[p], seqs[p], p, dev_cp)
            want = _posts(m, host_blob, host.seq, p, host_cp)
            assert got == want, (rank, p)
            moved += sum(len(v) for v in got[0].values())
            # the descriptors every pack or unpack copy of the device tables reads
            at = channels.Regions(send_bufs=tuple(0x1000 * (i + 1) for i in range(len(dev_cp.roles))),
                                  claims=0x100000, credits=0x200000, fifos=0x300000, landing=0x400000,
                                  signals=0x500000, consumed=0x600000)
            desc = channels.descriptors(dev.copies, dev.num_copies, dev_cp, at, {k: 4 for k in dev_cp.send})
            parsed = parse_tables(blobs[p])
            for item in _rdma_items(m, parsed, p):
                assert int(desc[int(parsed["items"][item]["copy"])]["depth"]) > 0
    assert moved > 0


def test_the_placements_slots_hold_the_largest_chunk_any_routing_makes():
    """The slots the placement sizes (PlacedCopy.chunk_rows_cap) hold the largest chunk of a
    routing that sends every token of every rank over every RDMA channel (all experts of the
    receivers), at the bundle's tokens: the bound is reached, not exceeded."""
    for name in ("h200x2_2vnode", "h200x4_2vnode"):
        plan, idx, w, counts = _routing(name, 16, 4, 1)
        R, wl = plan.num_ranks, plan.workload
        full = np.full_like(idx, -1)
        for r in range(R):  # every token: one expert on every rank
            for d in range(min(R, wl.topk)):
                full[r, :, d] = d * (wl.experts // R)
        layout = compute_layout(plan, full, w, np.full(R, 16))
        m = _proxy_manifest(plan, name)
        prog = segment_program(plan)
        for rank in range(R):
            for p in ("dispatch", "combine"):
                pl = placement(m, prog, p, rank, 16)
                parsed = parse_tables(build_tables(m, layout, p, rank).blob)
                _, pack, unpack = channels.item_sequences(m, parsed, p)
                bound = channels.placed_sequences(m, pl)
                for ri, chans in (*pack.items(), *unpack.items()):
                    side = bound[0] if ri in pack else bound[1]
                    for key, sizes in chans.items():
                        assert max(sizes) == max(side[ri][key]), (name, rank, p, key)


def test_which_bundles_get_their_tables_from_the_gpu():
    """Multi-hop plans, with or without the GPU proxy path, one box or several: the metadata
    kernels (no host layout step in the manifest); the routing's exchange over CUDA IPC inside one
    box, by the process group's all-gather across boxes."""
    for name, how in [("h200x4_2vnode", "ipc"), ("h200x4_ubb2x2", "ipc"), ("h200x2_2vnode_relay", "ipc"),
                      ("ubbv2_ep16", "collective")]:
        plan = codegen_plan(name)
        m = codegen.generate(plan, source_of(name)).manifest
        assert m["metadata"]["lowering"] == "device", (name, m["metadata"])
        assert m["metadata"]["exchange"] == how and m["options"]["metadata_exchange"] == how, name
        assert "metadata" not in {n["kind"] for n in m["not_lowered"]}, name
        assert "epcc_table_meta.cu" in m["build"]["sources"] and "epcc/table/meta.cuh" in m["build"]["headers"]
        # no flag after the routing, either way: the count blocks poll its slot words' tags
        assert m["metadata"]["kernels"] == ["meta_fused", "gather_copy", "meta_count", "meta_scan", "meta_rows",
                                            "meta_items", "zero_partials"], name
    for name in ("h200x2_2vnode", "h200x4_2vnode"):
        m = _proxy_manifest(codegen_plan(name), name)
        assert m["metadata"]["lowering"] == "device", (name, m["metadata"])
        assert "metadata" not in {n["kind"] for n in m["not_lowered"]}, name
    # the proxy path's tables come from the GPU by default; `--proxy-tables host` keeps host-built ones
    m = codegen.generate(codegen_plan("h200x2_2vnode"), source_of("h200x2_2vnode"),
                         codegen.CudaOptions(rdma="proxy")).manifest
    assert m["metadata"]["lowering"] == "device", m["metadata"]
    m = codegen.generate(codegen_plan("h200x2_2vnode"), source_of("h200x2_2vnode"),
                         codegen.CudaOptions(rdma="proxy", proxy_device_tables=False)).manifest
    assert m["metadata"]["lowering"] == "host" and "--proxy-tables host" in m["metadata"]["why"]
    # beyond one box: the same kernels, the routing all-gathered by the process group; the bytes
    # each rank receives per dispatch: every other rank's count and T x K (int32 expert, fp32 weight)
    m = _proxy_manifest(codegen_plan("dgx_h800_2node"), "dgx_h800_2node")
    wl = codegen_plan("dgx_h800_2node").workload
    assert {k: m["metadata"][k] for k in ("lowering", "exchange", "exchange_bytes_per_rank")} == {
        "lowering": "device", "exchange": "collective", "exchange_bytes_per_rank": 15 * wl.tokens * wl.topk * 8}
    assert m["metadata"]["exchange_how"].endswith("before the table kernels: its 16 ranks span more than one CUDA "
                                                  "IPC domain (at most 8)")
    assert m["metadata"]["capacity"]["sets"] == 20 and m["metadata"]["capacity"]["shared_bytes"] == 13832
    # whatever the RDMA option: an external proxy carries no routing, and needs none
    for rdma in ("emulate", "external"):
        m = codegen.generate(codegen_plan("ubbv2_ep16"), source_of("ubbv2_ep16"), codegen.CudaOptions(rdma=rdma)).manifest
        assert (m["metadata"]["lowering"], m["metadata"]["exchange"]) == ("device", "collective"), rdma
    # the default beyond one box (an external proxy): 98 sets of one home, two set words
    for name in ("ubbv2_ep32", "ubbv2_ep32_port10"):
        m = codegen.generate(codegen_plan(name), source_of(name)).manifest
        assert m["options"]["rdma"] == "external", name
        assert (m["metadata"]["lowering"], m["metadata"]["exchange"]) == ("device", "collective"), name
        assert (m["metadata"]["capacity"]["sets"], m["metadata"]["capacity"]["set_words"]) == (98, 2), name
    # a one-box plan may ask for the collective (the path the GPU tests run on 2 GPUs); ipc beyond a box is refused
    m = codegen.generate(codegen_plan("h200x2_2vnode"), source_of("h200x2_2vnode"),
                         codegen.CudaOptions(metadata_exchange="collective")).manifest
    assert (m["metadata"]["exchange"], m["metadata"]["exchange_bytes_per_rank"]) == ("collective", 4096 * 8 * 8)
    assert m["metadata"]["exchange_how"].endswith("asked for (`--metadata-exchange collective`)")
    with pytest.raises(codegen.CudaCodegenError, match=r"metadata exchange 'ipc' maps every rank's gather area over "
                                                       r"CUDA IPC, but the plan's 16 ranks span more than one CUDA "
                                                       r"IPC domain \(at most 8\): use 'collective' or 'auto'"):
        codegen.generate(codegen_plan("ubbv2_ep16"), source_of("ubbv2_ep16"), codegen.CudaOptions(metadata_exchange="ipc"))
    with pytest.raises(codegen.CudaCodegenError, match="metadata exchange must be one of auto, ipc, collective, not 'nccl'"):
        codegen.generate(codegen_plan("h200x2_2vnode"), source_of("h200x2_2vnode"),
                         codegen.CudaOptions(metadata_exchange="nccl"))


@pytest.mark.parametrize("rdma", ["auto", "proxy"])
@pytest.mark.parametrize("name", ALL)
def test_every_shipped_plan_gets_its_metadata_on_the_gpu(name, rdma):
    """`epcc compile --target cuda` (default options, and `--rdma proxy`) of every shipped schedule:
    the table-driven kernels' tables written by the metadata kernels, also in a bundle whose
    direct kernels the Buffer runs (they compute their own metadata on the GPU); no bundle has
    the host compute the layout."""
    m = codegen.generate(codegen_plan(name), source_of(name), codegen.CudaOptions(rdma=rdma)).manifest
    if m["lowering"] == "direct":
        assert m["direct"]["library"], name
    assert "metadata" not in {n["kind"] for n in m["not_lowered"]}, name
    assert m["metadata"]["lowering"] == "device", (name, m["metadata"].get("why"))
    assert m["metadata"]["exchange"] == ("ipc" if m["num_ranks"] <= 8 else "collective"), name


def codegen_plan(name: str):
    from test_cuda_codegen import plan_of
    return plan_of(name)


def test_the_shared_memory_is_sized_per_plan_and_counted_as_the_compiler_counts(host_kernels):
    """meta_program.shared_bytes is sizeof(Shared) at every capacity (the host compiler's); a
    program with more sets, OUT sets, experts or top-k than the build holds is refused, not run;
    ubbv2_ep32 needs two set words and fits both targets' shared memory."""
    caps = [None, meta_program.Capacity(2, 32, 256, 8), meta_program.Capacity(3, 5, 16, 4),
            meta_program.Capacity(1, 1, 1, 1)]
    for cap in caps:
        want = meta_program.shared_bytes(cap or meta_program.Capacity(1, 64, 1024, 16))
        assert host_kernels(cap).epcc_meta_shared_bytes() == want, cap
    name, tokens, chunk = "ubbv2_ep32", 4, 1
    plan, idx, w, counts = _routing(name, tokens, chunk, 1)
    m = codegen.generate(plan, source_of(name)).manifest
    prog = segment_program(plan)
    pls = {p: placement(m, prog, p, 0, tokens) for p in ("dispatch", "combine")}
    mp = meta_program.encode(m, plan.workload.placement, prog, pls, 0, tokens)
    need = mp.capacity()
    assert need.set_words == 2 and need.sets > 64
    for limit in (CUDA.shared_bytes_per_block, SUPA.shared_bytes_per_block):
        assert meta_program.shared_bytes(need) <= limit
    one_word = meta_program.Capacity(1, need.out_sets, need.experts, need.topk)
    arr = np.ascontiguousarray(mp.array)
    assert host_kernels(one_word).epcc_meta_run(arr.ctypes.data, *[None] * 13) == 1  # refused before any write


def test_a_plan_beyond_the_targets_shared_memory_gets_host_tables_saying_why():
    """The capacity a bundle's kernels are built for is in its manifest and its driver; where it
    exceeds the target's shared memory per block the manifest says "host" with the numbers."""
    plan = codegen_plan("h200x4_ubb2x2")
    m = codegen.generate(plan, source_of("h200x4_ubb2x2")).manifest
    cap = m["metadata"]["capacity"]
    assert m["metadata"]["lowering"] == "device"
    assert cap["set_words"] == 1 and cap["sets"] == 14 and cap["shared_bytes"] <= CUDA.shared_bytes_per_block
    small = dataclasses.replace(SUPA, shared_bytes_per_block=cap["shared_bytes"] - 8)
    m = codegen.generate(plan, source_of("h200x4_ubb2x2"), codegen.CudaOptions(rdma="emulate"), target=small).manifest
    assert m["metadata"]["lowering"] == "host"
    assert m["metadata"]["why"] == (f"the metadata kernels need {cap['shared_bytes']} bytes of shared memory per block "
                                    f"for rank 0's 14 token sets (1 x 64-bit words), 4 output sets of one home rank, "
                                    f"256 experts and top-8; the SUPA target allows {cap['shared_bytes'] - 8}")
    src = codegen.generate(plan, source_of("h200x4_ubb2x2")).files["epcc_table_meta.cu"]
    for k, v in meta_program.Capacity(**{f: cap[f] for f in codegen.CAPACITY_FIELDS}).macros().items():
        assert f"#define {k} {v}\n" in src
    assert f"sizeof(epcc::meta::PhaseShared) <= {CUDA.shared_bytes_per_block}" in src
