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
import test_cuda_codegen
from test_cuda_codegen import CASES, codegen, small_case, source_of

from epcc import pipeline

from epcc.backends.cuda import meta_program
from epcc.backends.cuda.abi import dtype
from epcc.backends.cuda.placement import max_chunks, placement, template
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
COVERED = [c for c in CASES if c[0] != "ubbv2_ep32"]  # ubbv2_ep32: more paths than one 64-bit word of sets
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
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("meta") / "libmeta_host.so"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", f"-I{INCLUDE}",
                        "-o", str(out), str(Path(__file__).parent / "meta" / "meta_host.cpp")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lib = ctypes.CDLL(str(out))
    lib.epcc_meta_run.argtypes = [ctypes.c_void_p] * 14
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


def _run(lib, plan, m, prog, rank, tokens, idx, w, counts, seqs=None, blobs=None):
    """The host-compiled kernels' blobs and received rows of `rank` (into `blobs` where given,
    after restoring their static fields as the GPU does: the template up to the row arrays);
    `seqs` (a dict): each program's RDMA items' sequence numbers on their channels go there too
    (the GPU proxy path's)."""
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
    if seqs is not None:
        seqs.update({p: np.full(max(pls[p].num_items, 1), 0xFFFFFFFF, np.uint32) for p in pls})
    ptrs += [seqs[p].ctypes.data if seqs is not None else None for p in ("dispatch", "combine")]
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
    """One-box multi-hop plans, with or without the GPU proxy path: the metadata kernels (no host
    layout step in the manifest); plans beyond one box: the host, saying why."""
    for name, want in [("h200x4_2vnode", "device"), ("h200x4_ubb2x2", "device"), ("h200x2_2vnode_relay", "device"),
                       ("ubbv2_ep16", "host")]:
        plan = codegen_plan(name)
        m = codegen.generate(plan, source_of(name)).manifest
        assert m["metadata"]["lowering"] == want, (name, m["metadata"])
        kinds = {n["kind"] for n in m["not_lowered"]}
        assert ("metadata" in kinds) == (want == "host"), name
        if want == "device":
            assert "epcc_table_meta.cu" in m["build"]["sources"] and "epcc/table/meta.cuh" in m["build"]["headers"]
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
    # beyond one box the routing cannot be gathered over CUDA IPC (docs/cuda.md: across nodes)
    m = _proxy_manifest(codegen_plan("dgx_h800_2node"), "dgx_h800_2node")
    assert m["metadata"] == {"lowering": "host", "why": "the plan's 16 ranks span more than one CUDA IPC "
                                                         "domain (at most 8), and the metadata kernels gather the "
                                                         "routing over CUDA IPC peer memory"}
    # whatever the RDMA option: SM roles standing in for the NIC do not make one box of two either
    plan = codegen_plan("ubbv2_ep16")
    m = codegen.generate(plan, source_of("ubbv2_ep16"), codegen.CudaOptions(rdma="emulate")).manifest
    assert m["metadata"]["lowering"] == "host" and "16 ranks span more than one CUDA IPC" in m["metadata"]["why"]


def codegen_plan(name: str):
    from test_cuda_codegen import plan_of
    return plan_of(name)
