"""The GPU proxy path's tables (rdma="proxy"): what the sender's pack role pushes on a channel is,
chunk for chunk and in the same order, what the receiver's unpack role waits for.  The runs on
GPUs are in tests/gpu (and bench/ep_bench.py); these check the numbering both sides derive."""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from epcc.backends.cuda import abi, codegen
from epcc.plan.rdma import rdma_steps
from epcc.runtime.build_cache import BuildError
from epcc.runtime.engines.cuda_table import tables
from epcc.runtime.engines.gpu_proxy import channels
from epcc.runtime.engines.gpu_proxy import engine as gpu_engine
from epcc.runtime.engines.gpu_proxy.build import build_gpu, nvshmem_home

from test_cuda_codegen import small_case, source_of


@pytest.mark.parametrize("name,tokens,chunk", [("h200x4_2vnode", 24, 3), ("h200x4_ubb2x2", 24, 2),
                                               ("dgx_h800_2node", 8, 2)])
def test_both_sides_number_every_channel_alike(name, tokens, chunk):
    plan, layout, *_ = small_case(name, tokens, chunk)
    m = codegen.generate(plan, source_of(name), codegen.CudaOptions(rdma="proxy")).manifest
    for program in abi.PROGRAMS:
        kernel = next(k for k in m["kernels"] if k["program"] == program and k["kind"] == "main")
        sides = {r["lowered"] for r in kernel["roles"]}
        assert {"rdma-pack", "rdma-unpack"} <= sides, f"{program}: no GPU proxy roles"
        sent, landed = {}, {}
        for rank in range(plan.num_ranks):
            parsed = tables.parse_tables(tables.build_tables(m, layout, program, rank).blob)
            seq, pack, unpack = channels.item_sequences(m, parsed, program)
            for side, roles, out in (("rdma-pack", pack, sent), ("rdma-unpack", unpack, landed)):
                for ri in roles:
                    for item, it, c, key in channels.role_items(parsed, ri, kernel["roles"][ri]["step"]):
                        # the pack role runs on the sender, the unpack role on the receiver
                        assert rank == (key[1] if side == "rdma-pack" else key[2])
                        if side == "rdma-pack":
                            assert int(c["flag_id"]) == abi.NO_FLAG  # the receiver bumps the counter
                        else:
                            assert int(it["wait_count"]) == 0  # it waits for the landing signal instead
                        out.setdefault(key, []).append(
                            (int(seq[item]), int(c["flow_index"]), int(it["chunk"]),
                             int(it["row_end"]) - int(it["row_begin"])))
        assert sent and sent.keys() == landed.keys()
        for key in sent:
            assert [s for s, *_ in sent[key]] == list(range(len(sent[key]))), key
            assert sent[key] == landed[key], f"{program} channel {key}: the two sides disagree"
        # every RDMA copy of the layout travels exactly once
        steps = {r["step"] for r in kernel["roles"] if r["lowered"] == "rdma-pack"}
        want = sum(len(c.chunk_starts) - 1 for c in layout.copies if c.program == program and c.step in steps)
        assert sum(len(v) for v in sent.values()) == want


def test_wire_rows_are_bf16_in_combine():
    plan, *_ = small_case("h200x4_2vnode", 8, 2)
    m = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy")).manifest
    assert channels.wire_pitch(m, "dispatch") == m["workload"]["row_bytes"]
    assert channels.wire_pitch(m, "combine") == 2 * m["workload"]["hidden"]
    ops = {r["lowered"]: r["op"] for k in m["kernels"] if k["program"] == "combine" for r in k.get("roles", [])}
    assert ops["rdma-pack"] == "pack_f32_bf16" and ops["rdma-unpack"] == "accum_bf16_wire"
    assert tables.partial_rounding(m) == tables.BF16_WIRE
    assert np.dtype(channels.RDMA_CHAN).itemsize == 64


def _nvcc():
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not on PATH")
    return nvcc


def test_gpu_proxy_library_builds_from_the_bundle(tmp_path, monkeypatch):
    """The GPU path's proxy library (emitted loop + emulated transport) from a bundle's cuda/rdma/,
    as the runtime builds it on the GPU machine: it exports the GPU loop."""
    _nvcc()
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))
    plan, *_ = small_case("h200x4_2vnode", 8, 2)
    codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy")).write(tmp_path / "cuda")
    lib = build_gpu(tmp_path / "cuda" / "rdma")
    try:
        loaded = ctypes.CDLL(str(lib))
    except OSError as e:  # no CUDA runtime library to load here: the build is what is checked
        pytest.skip(f"cannot load the CUDA runtime here: {e}")
    assert hasattr(loaded, "epcc_rdma_proxy_gpu") and hasattr(loaded, "epcc_tp_post_write_signal")


def test_gpu_proxy_library_builds_with_nvshmem(tmp_path, monkeypatch):
    """The nvshmem transport compiled against NVSHMEM's headers and linked (-z defs: every symbol
    resolved) against its host library, the pip wheel the test extra installs: the library
    exports the transport and the bootstrap the runtime calls."""
    _nvcc()
    try:
        nvshmem_home()
    except BuildError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))
    plan, *_ = small_case("h200x4_2vnode", 8, 2)
    codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy")).write(tmp_path / "cuda")
    lib = build_gpu(tmp_path / "cuda" / "rdma", "nvshmem")
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    for name in ("epcc_rdma_proxy_gpu", "epcc_tp_ops_nvshmem", "epcc_nvshmem_uid", "epcc_nvshmem_init",
                 "epcc_nvshmem_malloc", "epcc_nvshmem_free"):
        assert f" {name}\n" in syms, name
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    assert "libnvshmem_host.so" in needed and "libnvshmem_device" not in needed


def test_nvshmem_not_found_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BuildError) as e:
        nvshmem_home()
    assert str(e.value) == (f"NVSHMEM not found ({tmp_path}): pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME "
                            f"to a directory with include/nvshmem.h and lib/libnvshmem_host.so")


def test_gpu_proxy_refuses_an_unknown_transport():
    plan, *_ = small_case("h200x4_2vnode", 8, 2)
    with pytest.raises(channels.RdmaGpuError) as e:
        gpu_engine.GpuRdma(proxy_lib="-", cuda_lib=None, ctx=None, plan=plan, manifest={}, source=None,
                         program="dispatch", rank=0, device=0, exchange=None, transport="ibverbs")
    assert str(e.value) == "transport 'ibverbs': the GPU proxy path runs emulated or nvshmem"


def test_gpu_proxy_kernels_compile(tmp_path):
    """The pack and unpack roles (dispatch copy, combine bf16 wire) compile for sm_90a."""
    nvcc = _nvcc()
    plan, *_ = small_case("h200x4_2vnode", 8, 2)
    b = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy"))
    b.write(tmp_path)
    for k in b.kernels:
        text = b.files[k.file]
        assert "epcc::run_pack<" in text and "epcc::run_unpack<" in text
        r = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-c", "-o",
                            str(tmp_path / (k.file + ".o")), str(tmp_path / k.file)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_a_failed_compile_names_the_file_the_command_and_the_output(tmp_path):
    _nvcc()
    (tmp_path / "broken_proxy.c").write_text("this is not C\n", encoding="utf-8")
    with pytest.raises(BuildError) as e:
        build_gpu(tmp_path)
    first, _, rest = str(e.value).partition("\n")
    assert first.startswith("compiling broken_proxy.c failed (") and first.endswith(f"{tmp_path / 'broken_proxy.c'}):")
    assert "broken_proxy.c" in rest and "error" in rest


def test_nvshmem_over_a_library_built_without_it_is_refused(tmp_path, monkeypatch):
    """GpuRdma(transport="nvshmem") with a proxy library built for the emulated transport says so
    before it allocates anything."""
    _nvcc()
    monkeypatch.setenv("EPCC_CACHE", str(tmp_path / "cache"))
    plan, layout, *_ = small_case("h200x4_2vnode", 8, 2)
    b = codegen.generate(plan, source_of("h200x4_2vnode"), codegen.CudaOptions(rdma="proxy"))
    b.write(tmp_path / "cuda")
    lib = build_gpu(tmp_path / "cuda" / "rdma")
    try:
        ctypes.CDLL(str(lib))
    except OSError as e:
        pytest.skip(f"cannot load the CUDA runtime here: {e}")
    blob = tables.build_tables(b.manifest, layout, "dispatch", 0).blob
    with pytest.raises(channels.RdmaGpuError) as e:
        gpu_engine.GpuRdma(proxy_lib=str(lib), cuda_lib=None, ctx=None, plan=plan, manifest=b.manifest,
                           source=channels.from_tables(b.manifest, blob, "dispatch"),
                           program="dispatch", rank=0, device=0, exchange=None, transport="nvshmem")
    assert str(e.value) == f"{lib}: built without NVSHMEM (build_gpu(..., 'nvshmem') links it)"


# ------------------------------------------------------------ several RDMA steps per program

def test_fifo_layout_is_the_array_the_engine_reads():
    """The engine reads `epcc_rdma_fifo [n_roles]` from one address (epcc_rdma_engine_init): the
    structs are contiguous in role order, each `entries` word points at its own area behind them."""
    lay = channels.fifo_layout([4, 2, 3])
    F, E = channels.FIFO_WORDS, channels.ENTRY_WORDS
    assert [lay.struct_word(i) for i in range(3)] == [0, F, 2 * F]
    assert [lay.entries_word(i) for i in range(3)] == [3 * F, 3 * F + 4 * E, 3 * F + 6 * E]
    assert lay.words == 3 * F + 9 * E
    base = 0x7F00_0000_1000
    host = np.zeros(lay.words, dtype=np.uint64)
    lay.fill(host, base)
    areas = []
    for i, depth in enumerate((4, 2, 3)):
        s = lay.struct_word(i)
        assert list(host[s:s + F]) == [0, 0, 0, 0, depth, base + 8 * lay.entries_word(i), 0, 0]
        assert lay.entries_ptr(base, i) == base + 8 * lay.entries_word(i)
        assert lay.retired_ptr(base, i) == base + 8 * (s + channels.RETIRED_WORD)
        areas.append((lay.entries_word(i), lay.entries_word(i) + E * depth))
    assert areas[0][0] >= 3 * F and areas[-1][1] == lay.words  # behind the structs, inside the region
    assert all(a[1] <= b[0] for a, b in zip(areas, areas[1:]))  # no two FIFOs share an entry
    with pytest.raises(channels.RdmaGpuError) as e:
        lay.fill(np.zeros(3, dtype=np.uint64), base)
    assert str(e.value) == f"the FIFO region holds 3 words, the layout needs {lay.words}"
    with pytest.raises(channels.RdmaGpuError) as e:
        channels.fifo_layout([2, 0])
    assert str(e.value) == "FIFO depths [2, 0]: every pack role needs a depth of at least 1"


def test_a_channel_fed_by_two_pack_roles_is_refused():
    # chunks are numbered per pack role and channel (item_sequences): two roles on one channel
    # would give two chunks the same number
    kernel = {"roles": [{"step": "there"}, {"step": "there"}]}
    pack = {0: {("there", 0, 1): [4096]}, 1: {("there", 0, 1): [4096]}}
    with pytest.raises(channels.RdmaGpuError) as e:
        channels.channel_plan("dispatch", kernel, pack, {}, {"there": SimpleNamespace(depth=4)}, 14336)
    assert str(e.value) == ("dispatch step 'there': channel 0->1 is fed by pack roles 0 and 1; one pack role per "
                            "channel in this version")


def _relay_side(program, rank, tokens=24, chunk=3):
    """h200x2_2vnode_relay (two RDMA steps per program): one rank's tables, roles and channel plan."""
    plan, layout, *_ = small_case("h200x2_2vnode_relay", tokens, chunk)
    m = codegen.generate(plan, source_of("h200x2_2vnode_relay"), codegen.CudaOptions(rdma="proxy")).manifest
    blob = tables.build_tables(m, layout, program, rank).blob
    parsed, src = tables.parse_tables(blob), channels.from_tables(m, blob, program)
    kernel = next(k for k in m["kernels"] if k["program"] == program and k["kind"] == "main")
    steps = {s.step: s for s in rdma_steps(plan) if s.program == program}
    cp = channels.channel_plan(program, kernel, src.pack, src.unpack, steps, channels.wire_pitch(m, program))
    return parsed, kernel, cp, src


@pytest.mark.parametrize("program", abi.PROGRAMS)
@pytest.mark.parametrize("rank", [0, 1])
def test_two_rdma_steps_each_pack_role_points_at_its_own_fifo(program, rank):
    parsed, kernel, cp, src = _relay_side(program, rank)
    assert [r.step for r in cp.roles] == [kernel["roles"][r.index]["step"] for r in cp.roles]
    assert sorted(r.step for r in cp.roles) == ["relay", "there"]  # two pack roles, two FIFOs
    assert cp.fifos.depths == tuple(r.depth for r in cp.roles)
    assert len(cp.send) == len(cp.recv) == 2  # one channel per step, each way
    at = channels.Regions(send_bufs=(0x10000, 0x20000), claims=0x30000, credits=0x40000, fifos=0x50000,
                          landing=0x60000, signals=0x70000, consumed=0x80000)
    peer_depth = {k: 5 + ch.index for k, ch in cp.send.items()}
    desc = channels.descriptors(src.copies, src.num_copies, cp, at, peer_depth)
    seen = {}
    for i, role in enumerate(cp.roles):
        assert int(parsed["roles"][role.index]["item_count"]) > 0
        for _, it, _, key in channels.role_items(parsed, role.index, role.step):
            ch = cp.send[key]
            d = desc[int(it["copy"])]
            assert int(d["entries"]) == at.fifos + 8 * cp.fifos.entries_word(i)
            assert int(d["retired"]) == at.fifos + 8 * (channels.FIFO_WORDS * i + channels.RETIRED_WORD)
            assert (int(d["ring"]), int(d["counter"])) == (at.send_bufs[i], at.claims + 8 * i)
            assert (int(d["credit"]), int(d["chan"])) == (at.credits + 8 * ch.index, ch.index)
            assert (int(d["depth"]), int(d["slot_bytes"]), int(d["chan_depth"])) == (
                role.depth, role.slot_bytes, 5 + ch.index)
            seen.setdefault(i, set()).add(int(d["entries"]))
    assert len(seen) == 2 and seen[0] != seen[1] and all(len(v) == 1 for v in seen.values())
    landed = set()
    for ri, role in enumerate(kernel["roles"]):
        if role.get("lowered") != "rdma-unpack":
            continue
        for _, it, _, key in channels.role_items(parsed, ri, role["step"]):
            ch = cp.recv[key]
            d = desc[int(it["copy"])]
            assert (int(d["ring"]), int(d["signals"]), int(d["counter"])) == (
                at.landing + ch.offset, at.signals + ch.sig_offset, at.consumed + 8 * ch.index)
            assert int(d["entries"]) == int(d["retired"]) == 0
            landed.add(ch.key)
    assert landed == set(cp.recv)
    # the two landing rings and signal areas do not overlap
    rings = sorted((ch.offset, ch.offset + ch.depth * ch.slot_bytes) for ch in cp.recv.values())
    assert rings[0][1] <= rings[1][0] and rings[1][1] == cp.landing_bytes


# ------------------------------------------------------------ RDMA steps over links of different speeds

def _links(name, program):
    plan, *_ = small_case(name, 8, 2)
    return channels.step_links(s for s in rdma_steps(plan) if s.program == program)


@pytest.mark.parametrize("program", abi.PROGRAMS)
def test_steps_over_two_link_classes_get_a_link_each(program):
    """h200x2_2vnode_mixed: `there` over rdma (50 GB/s), `relay` over rdma_slow (25 GB/s): two
    links of the transport, each step on its own, and the emulated spec paces each."""
    links, step_link = _links("h200x2_2vnode_mixed", program)
    by_name = {link.name: link for link in links}
    assert sorted(by_name) == ["rdma", "rdma_slow"]
    assert (by_name["rdma"].bandwidth, by_name["rdma_slow"].bandwidth) == (50e9, 25e9)
    assert by_name["rdma"].latency_s == by_name["rdma_slow"].latency_s == pytest.approx(5e-6)
    assert links[step_link["there"]].name == "rdma" and links[step_link["relay"]].name == "rdma_slow"
    assert sorted(step_link.values()) == [0, 1]
    bw = "/".join(f"{link.bandwidth / 1e9:g}" for link in links)
    assert channels.emulated_spec(program, links, 1) == f"{bw},5/5,1,signal"  # 50/25 or 25/50: step order
    assert channels.transport_links(program, "emulated", "-", 2, links, step_link) == step_link
    # NVSHMEM is not paced: one link, every step on it
    assert channels.transport_links(program, "nvshmem", "signal", 1, links, step_link) == {"there": 0, "relay": 0}


@pytest.mark.parametrize("name", ["h200x2_2vnode_relay", "h200x2_2vnode"])
def test_one_link_class_gets_the_spec_it_always_had(name):
    links, step_link = _links(name, "dispatch")
    assert [link.name for link in links] == ["rdma"] and set(step_link.values()) == {0}
    assert channels.emulated_spec("dispatch", links, 0) == "50,5,0,signal"


def test_a_paced_transport_with_too_few_links_is_refused():
    links, step_link = _links("h200x2_2vnode_mixed", "dispatch")
    with pytest.raises(channels.RdmaGpuError) as e:
        channels.transport_links("dispatch", "emulated", "50,5,0,signal", 1, links, step_link)
    texts = ", ".join(link.text for link in links)
    assert "'rdma' 50 GB/s 5 us" in texts and "'rdma_slow' 25 GB/s 5 us" in texts
    assert str(e.value) == (f"dispatch: transport 'emulated' (50,5,0,signal) has 1 link, but the RDMA steps run over "
                            f"2 link classes ({texts}): give one BANDWIDTH_GBPS,LATENCY_US per link, '/'-separated "
                            f"(e.g. '50/25,5/5')")


def test_a_link_without_bandwidth_asks_for_the_spec():
    with pytest.raises(channels.RdmaGpuError) as e:
        channels.emulated_spec("combine", [channels.Link("rdma", 50e9, 5e-6), channels.Link("nic2", 0.0, 5e-6)], 0)
    assert str(e.value) == "combine: the RDMA link 'nic2' has no bandwidth in the plan; give the transport spec"


def _proxy_with_thread(target, timeout_s: float) -> gpu_engine.GpuRdma:
    """A GpuRdma with nothing allocated and `target` as its proxy thread (close's part alone)."""
    g = gpu_engine.GpuRdma.__new__(gpu_engine.GpuRdma)
    g.stop, g.rank, g.program, g.timeout_s = [0], 1, "dispatch", timeout_s
    g.device_ptrs, g.sym_ptrs, g.engine, g.tp = [], [], None, None
    g.state = lambda: "dispatch proxy: status None"
    g.thread = threading.Thread(target=target, args=(g,), daemon=True)
    g.thread.start()
    return g


def test_close_stops_a_proxy_that_heeds_its_stop_word():
    def loop(g):
        while not g.stop[0]:
            time.sleep(0.001)
    g = _proxy_with_thread(loop, timeout_s=5.0)
    g.close()
    assert g.thread is None


def test_close_reports_a_proxy_thread_that_does_not_stop_instead_of_waiting_for_ever(monkeypatch):
    monkeypatch.setattr(gpu_engine, "STOP_GRACE_S", 0.05)
    release = threading.Event()
    g = _proxy_with_thread(lambda g: release.wait(), timeout_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(channels.RdmaGpuError) as e:
        g.close()
    assert time.monotonic() - t0 < 2.0
    assert str(e.value) == ("rank 1: dispatch: the GPU proxy thread did not stop within 0.1 s of its stop word "
                            "(dispatch proxy: status None); its memory stays allocated")
    assert g.thread is not None and g.thread.is_alive()  # left as it was: nothing it may touch is freed
    release.set()
    g.thread.join(5)
