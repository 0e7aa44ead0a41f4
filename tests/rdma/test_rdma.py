"""backends/rdma: the proxy loop's primitives, its emitted source, the transports, and real
multi-process runs of epcc run --transport libfabric-tcp (docs/rdma.md)."""

from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epcc import pipeline
from epcc.backends.rdma import abi
from epcc.backends.rdma import emit as rdma_emit
from epcc.backends.rdma.sources import NATIVE_DIR
from epcc.plan import Plan
from epcc.plan import rdma as rdma_plan
from epcc.plan.rdma import rdma_steps
from epcc.runtime.build_cache import CFLAGS, BuildError, c_compiler
from epcc.runtime.engines import agree
from epcc.runtime.engines import cpu_procs as procs
from epcc.runtime.engines import transport
from epcc.runtime.engines.cpu.threads import timeout_message
from epcc.runtime.engines.gpu_proxy import channels
from epcc.runtime.engines.gpu_proxy.build import build_gpu, nvshmem_home
from epcc.runtime.engines.base import GroupError
from epcc.runtime.engines.gpu_proxy.channels import ENTRY_WORDS, RETIRED_WORD
from epcc.runtime.engines.gpu_proxy.engine import GpuRdma
from epcc.runtime.engines.gpu_proxy.watch import ProxyFailed, ProxyWatch, wait_watched
from epcc.runtime.engines.rdma_host import build_transport

ROOT = Path(__file__).resolve().parents[2]
EPCC = [sys.executable, "-m", "epcc.cli"]
GOLDEN = Path(__file__).parent / "golden"


def _plan(sched: str) -> Plan:
    c = pipeline.run(str(ROOT / "schedules" / sched), pipeline.STAGES[-1].name, None)
    return c.passes.get("plan")


@pytest.fixture(scope="module")
def prim(tmp_path_factory):
    """epcc_proxy_prim.c alone, as a shared library."""
    out = tmp_path_factory.mktemp("prim") / "libprim.so"
    subprocess.run([c_compiler(), "-std=c11", "-O2", "-fPIC", "-shared", "-Wall", "-Werror", f"-I{NATIVE_DIR}",
                    str(NATIVE_DIR / "epcc_proxy_prim.c"), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    vp, u64 = ctypes.c_void_p, ctypes.c_uint64
    lib.epcc_rdma_fifo_init.argtypes = [vp, u64]
    lib.epcc_rdma_fifo_can_push.argtypes = [vp]
    lib.epcc_rdma_fifo_push.argtypes, lib.epcc_rdma_fifo_push.restype = [vp, u64, u64, u64, u64], u64
    lib.epcc_rdma_fifo_peek.argtypes, lib.epcc_rdma_fifo_peek.restype = [vp], vp
    lib.epcc_rdma_fifo_take.argtypes, lib.epcc_rdma_fifo_take.restype = [vp], u64
    lib.epcc_rdma_fifo_complete.argtypes = [vp, u64]
    lib.epcc_rdma_tracker_init.argtypes = [vp, u64, u64]
    lib.epcc_rdma_tracker_land.argtypes = [vp, u64]
    lib.epcc_rdma_tracker_pop.argtypes, lib.epcc_rdma_tracker_pop.restype = [vp], ctypes.c_int64
    lib.epcc_rdma_wait_ge.argtypes = [vp, u64, u64, vp, ctypes.POINTER(u64)]
    lib.epcc_rdma_format_timeout.argtypes = [ctypes.c_char_p, ctypes.c_size_t, u64, ctypes.c_char_p,
                                             ctypes.c_char_p, ctypes.c_char_p, u64, u64]
    return lib


class Entry(ctypes.Structure):
    _fields_ = [("word", ctypes.c_uint64), ("kind", ctypes.c_uint64), ("chan", ctypes.c_uint64),
                ("chan_seq", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class Fifo(ctypes.Structure):
    _fields_ = [("tail", ctypes.c_uint64), ("head", ctypes.c_uint64), ("retired", ctypes.c_uint64),
                ("flushed", ctypes.c_uint64), ("depth", ctypes.c_uint64), ("entries", ctypes.c_void_p),
                ("done", ctypes.c_void_p)]


class Tracker(ctypes.Structure):
    _fields_ = [("next", ctypes.c_uint64), ("depth", ctypes.c_uint64), ("total", ctypes.c_uint64),
                ("landed", ctypes.c_void_p)]


@settings(max_examples=150, deadline=None)
@given(depth=st.integers(1, 8), chunks=st.lists(st.integers(1, 12), min_size=1, max_size=3), data=st.data())
def test_fifo_credits_and_in_order_apply_never_lose_or_duplicate(prim, depth, chunks, data):
    """One sender role over len(chunks) channels, FIFO depth = landing depth = `depth`; writes
    complete and land in an order hypothesis picks among those in flight.  Every chunk is applied
    exactly once, in order per channel; the FIFO never exceeds its credits, the sender never
    posts outside the receiver's window; the run always finishes."""
    f = Fifo()
    assert prim.epcc_rdma_fifo_init(ctypes.byref(f), depth) == 0
    trackers = [Tracker() for _ in chunks]
    for t, n in zip(trackers, chunks):
        assert prim.epcc_rdma_tracker_init(ctypes.byref(t), depth, n) == 0
    # The producer's order: chunk-major over the channels (as a role runs its copies).
    order = [(c, r) for r in range(max(chunks)) for c, n in enumerate(chunks) if r < n]
    pushed, in_flight, landed_unapplied, applied = 0, [], [], [[] for _ in chunks]
    consumed = [0] * len(chunks)  # the credit each receiver returned
    for _ in range(10 * len(order) * depth + 100):
        moves = []
        if pushed < len(order) and prim.epcc_rdma_fifo_can_push(ctypes.byref(f)):
            moves.append("push")
        e = prim.epcc_rdma_fifo_peek(ctypes.byref(f))
        if e:
            ent = Entry.from_address(e)
            if ent.chan_seq < consumed[ent.chan] + depth:
                moves.append("post")
        if in_flight:
            moves.append("complete")
        if landed_unapplied:
            moves.append("apply")
        if not moves:
            break
        m = data.draw(st.sampled_from(moves))
        if m == "push":
            c, r = order[pushed]
            prim.epcc_rdma_fifo_push(ctypes.byref(f), 1, c, r, 0)
            pushed += 1
            assert f.tail - f.retired <= depth
        elif m == "post":
            ent = Entry.from_address(e)
            idx = prim.epcc_rdma_fifo_take(ctypes.byref(f))
            in_flight.append((idx, ent.chan, ent.chan_seq))
        elif m == "complete":  # any write in flight completes (locally) and lands (remotely)
            idx, c, seq = in_flight.pop(data.draw(st.integers(0, len(in_flight) - 1)))
            assert prim.epcc_rdma_fifo_complete(ctypes.byref(f), idx) == 0
            assert prim.epcc_rdma_fifo_complete(ctypes.byref(f), idx) == -1  # never twice
            assert prim.epcc_rdma_tracker_land(ctypes.byref(trackers[c]), seq) == 0
            assert prim.epcc_rdma_tracker_land(ctypes.byref(trackers[c]), seq) == -1  # a duplicate is refused
            landed_unapplied.append(c)
        else:
            c = landed_unapplied.pop(data.draw(st.integers(0, len(landed_unapplied) - 1)))
            while (q := prim.epcc_rdma_tracker_pop(ctypes.byref(trackers[c]))) >= 0:
                applied[c].append(q)
            consumed[c] = trackers[c].next  # credit returned
    assert pushed == len(order), "the producer starved: credits never came back"
    for c, n in enumerate(chunks):
        assert applied[c] == list(range(n)), f"channel {c}: applied {applied[c]}"
    assert f.retired == f.head == f.tail == len(order)


def test_tracker_refuses_chunks_outside_the_window(prim):
    t = Tracker()
    prim.epcc_rdma_tracker_init(ctypes.byref(t), 2, 5)
    assert prim.epcc_rdma_tracker_land(ctypes.byref(t), 2) == -2  # beyond next + depth
    assert prim.epcc_rdma_tracker_land(ctypes.byref(t), 5) == -2  # past the end
    assert prim.epcc_rdma_tracker_land(ctypes.byref(t), 1) == 0
    assert prim.epcc_rdma_tracker_pop(ctypes.byref(t)) == -1  # chunk 0 has not landed: nothing applies
    assert prim.epcc_rdma_tracker_land(ctypes.byref(t), 0) == 0
    assert [prim.epcc_rdma_tracker_pop(ctypes.byref(t)) for _ in range(3)] == [0, 1, -1]


def test_bounded_wait_times_out_with_the_sync_message(prim):
    flag, observed = ctypes.c_uint64(3), ctypes.c_uint64()
    st_ = prim.epcc_rdma_wait_ge(ctypes.byref(flag), 4, 50_000_000, None, ctypes.byref(observed))
    assert st_ == 1 and observed.value == 3
    buf = ctypes.create_string_buffer(512)
    prim.epcc_rdma_format_timeout(buf, 512, 1_500_000_000, b"rank 2 (vnode 1, gpu 0)", b"rdma",
                                  b"dispatch.rdma[0->2].credit", 3, 4)
    want = timeout_message(1_500_000_000, "rank 2 (vnode 1, gpu 0)", "rdma", "dispatch.rdma[0->2].credit", 3, 4)
    assert buf.value.decode() == want
    assert want == ("epcc: wait timed out after 1.500 s: rank 2 (vnode 1, gpu 0) step 'rdma' flag "
                    "'dispatch.rdma[0->2].credit' (value 3, waiting for >= 4)")
    abort = ctypes.c_uint64(1)
    assert prim.epcc_rdma_wait_ge(ctypes.byref(flag), 4, 10**10, ctypes.byref(abort), ctypes.byref(observed)) == 2


def test_emitted_proxy_source_golden(tmp_path):
    plan = _plan("h200x4_2vnode.sched")
    text = rdma_emit.proxy_source(plan)
    golden = GOLDEN / "h200x4_2vnode_proxy.c"
    if os.environ.get("EPCC_REGEN_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), "emitted proxy source changed; EPCC_REGEN_GOLDEN=1 rewrites the golden"
    sched = (ROOT / "schedules" / "h200x4_2vnode.sched").read_text(encoding="utf-8")
    line = sched[:sched.index('  step rdma "')].count("\n") + 1  # the step's line in the DSL, carried to the C
    assert f"DSL line {line}:" in text and "epcc_rdma_apply_dispatch__rdma" in text and "epcc_rdma_apply_combine__rdma" in text
    paths = rdma_emit.emit(plan, tmp_path)
    assert paths[0].name == "h200x4_2vnode_proxy.c" and (tmp_path / "epcc_transport.h").is_file()
    assert rdma_emit.emit(_plan("h200x4.sched"), tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


def test_overrides_change_the_rdma_steps_only():
    plan = _plan("h200x4_2vnode.sched")
    p2 = rdma_plan.with_overrides(plan, env={"EPCC_RDMA_CHUNK_TOKENS": "16", "EPCC_RDMA_DEPTH": "2"})
    assert p2.step("rdma").chunk_bytes == 16 * plan.bytes_per_token and p2.step("rdma").depth == 2
    assert p2.step("intra").chunk_bytes == plan.step("intra").chunk_bytes
    # the chunk count follows the chunk (the simulator reads it), as chunk-pipeline sets it
    biggest = max(f.bytes for f in plan.step("rdma").flows)
    assert p2.step("rdma").num_chunks == math.ceil(biggest / (16 * plan.bytes_per_token)) > plan.step("rdma").num_chunks
    one = rdma_plan.with_overrides(plan, chunk_tokens=1 << 20, depth=8, env={})
    assert (one.step("rdma").num_chunks, one.step("rdma").depth) == (1, 1)  # no deeper than its chunks
    with pytest.raises(rdma_plan.RdmaConfigError, match="EPCC_RDMA_DEPTH=0"):
        rdma_plan.with_overrides(plan, env={"EPCC_RDMA_DEPTH": "0"})
    with pytest.raises(rdma_plan.RdmaConfigError, match="EPCC_RDMA_CHUNK_TOKENS='x'"):
        rdma_plan.with_overrides(plan, env={"EPCC_RDMA_CHUNK_TOKENS": "x"})


def test_ibverbs_transport_compiles_links_and_says_no_device():
    if not Path("/usr/include/infiniband/verbs.h").is_file():
        pytest.skip("rdma-core headers (libibverbs-dev) are not installed")
    lib = transport.load(build_transport("ibverbs"))
    try:
        tp = transport.Transport(lib, "ibverbs", "", 0, 1)
    except transport.TransportError as e:
        assert str(e).startswith("ibverbs: no RDMA device found") or "ibverbs:" in str(e)
    else:  # a machine with a NIC
        assert tp.description.startswith("ibverbs ")
        tp.close()
    with pytest.raises(BuildError, match="transport 'nope'"):
        build_transport("nope")


@pytest.mark.parametrize("name,macro", [("transport_emulated.cu", "EPCC_TP_HAVE_EMULATED"),
                                        ("transport_nvshmem.cu", "EPCC_TP_HAVE_NVSHMEM")])
def test_cuda_transports_compile(tmp_path, name, macro):
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not on PATH")
    inc = []
    if name == "transport_nvshmem.cu":
        try:
            inc = [f"-I{nvshmem_home()[0]}"]
        except BuildError:
            pass  # guarded: without nvshmem.h it compiles to nothing
    r = subprocess.run([nvcc, "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Werror", f"-D{macro}", f"-I{NATIVE_DIR}",
                        *inc, "-c", str(NATIVE_DIR / name), "-o", str(tmp_path / "t.o")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    syms = subprocess.run(["nm", str(tmp_path / "t.o")], capture_output=True, text=True).stdout
    has = "epcc_tp_ops_" in syms
    if name == "transport_nvshmem.cu":
        found = subprocess.run([nvcc, "-E", "-x", "cu", *inc, "-"], input="#include <nvshmem.h>\n",
                               capture_output=True, text=True).returncode == 0
        assert has == found
    else:
        assert has


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """The emulated transport alone (epcc_transport.c + transport_emulated.cu), built with nvcc and
    loaded; its spec is parsed before any CUDA call, so bad specs are checked without a GPU."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc is not on PATH")
    out = tmp_path_factory.mktemp("emulated") / "libemu.so"
    subprocess.run([nvcc, "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-Wall,-Werror", "-DEPCC_TP_HAVE_EMULATED",
                    f"-I{NATIVE_DIR}", "-x", "cu", str(NATIVE_DIR / "epcc_transport.c"), "-x", "cu",
                    str(NATIVE_DIR / "transport_emulated.cu"), "-o", str(out), "-lcudart"], check=True)
    try:
        return transport.load(out)
    except OSError as e:
        pytest.skip(f"cannot load the CUDA runtime here: {e}")


FORM = ("BANDWIDTH_GBPS[/BANDWIDTH_GBPS...],LATENCY_US[/LATENCY_US...][,DEVICE[,signal]], e.g. '50,5' or "
        "'50/25,5,0,signal'")


@pytest.mark.parametrize("spec,msg", [
    ("", f"emulated: spec '' must be {FORM}"),
    ("50", f"emulated: spec '50' must be {FORM}"),
    ("50/x,5", "emulated: spec '50/x,5': bandwidth 'x' of link 1 is not a number > 0"),
    ("50/0,5", "emulated: spec '50/0,5': bandwidth '0' of link 1 is not a number > 0"),
    ("50//25,5", "emulated: spec '50//25,5': bandwidth '' of link 1 is not a number > 0"),
    ("nan,5", "emulated: spec 'nan,5': bandwidth 'nan' of link 0 is not a number > 0"),
    ("inf,5", "emulated: spec 'inf,5': bandwidth 'inf' of link 0 is not a number > 0"),
    ("50/25,5/-1", "emulated: spec '50/25,5/-1': latency '-1' of link 1 is not a number >= 0"),
    ("50/25/13,5/5", "emulated: spec '50/25/13,5/5': 3 bandwidths but 2 latencies: give one latency per link, or "
                     "one for all"),
    ("1/2/3/4/5/6/7/8/9,5", "emulated: spec '1/2/3/4/5/6/7/8/9,5': more than 8 links"),
    ("50,5,gpu0,signal", "emulated: spec '50,5,gpu0,signal': device 'gpu0' is not a GPU index (a whole number >= 0, "
                         "or empty for the current GPU)"),
    ("50,5,-1", "emulated: spec '50,5,-1': device '-1' is not a GPU index (a whole number >= 0, or empty for the "
                "current GPU)"),
    ("50,5,0,fast", "emulated: spec '50,5,0,fast': 'fast' after the device is not 'signal'"),
    ("50,5,0,signal,x", f"emulated: spec '50,5,0,signal,x' has more than 4 fields: it must be {FORM}"),
])
def test_emulated_spec_errors_name_the_spec_and_the_field(emulated, spec, msg):
    with pytest.raises(transport.TransportError) as e:
        transport.Transport(emulated, "emulated", spec, 0, 2)
    assert str(e.value) == msg


@pytest.mark.parametrize("spec,links,desc", [
    ("50,5", 1, "paced to 50 GB/s, 5 us)"),
    ("13,5,signal", 1, "paced to 13 GB/s, 5 us)"),
    ("50/25,5,0,signal", 2, "2 links paced to 50 GB/s 5 us, 25 GB/s 5 us)"),
    ("50/25/12.5,5/2/0,,signal", 3, "3 links paced to 50 GB/s 5 us, 25 GB/s 2 us, 12.5 GB/s 0 us)"),
])
def test_emulated_spec_gives_one_link_per_bandwidth(emulated, spec, links, desc):
    """A good spec passes the parser: here (no GPU) the open fails only at the device; on a GPU
    machine the transport has one link per bandwidth and says how each is paced."""
    try:
        tp = transport.Transport(emulated, "emulated", spec, 0, 1)
    except transport.TransportError as e:
        assert str(e) == "emulated: no CUDA device"
        return
    try:
        assert tp.links == links and tp.description.endswith(desc), tp.description
    finally:
        tp.close()


# ------------------------------------------------------------------ real multi-process runs

def _libfabric_tcp() -> str | None:
    try:
        procs.check_transport("libfabric-tcp")
    except procs.TransportUnavailable as e:
        return str(e)
    return None


needs_tcp = pytest.mark.skipif(shutil.which("fi_info") is None and not Path("/usr/include/rdma/fabric.h").is_file(),
                               reason="libfabric (libfabric-dev) is not installed")


def _run(*args, timeout=600):
    # Above what `epcc run` allows itself (per program: 3 x the 30 s wait bound + 120 s, then 5 s
    # to stop the ranks), so a run that cannot finish is reported by epcc, naming the ranks, and
    # not cut short here: 32 processes on 2 shared cores take about 15 s on an idle machine.
    return subprocess.run([*EPCC, "run", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@needs_tcp
@pytest.mark.parametrize("sched,extra", [
    ("h200x4_2vnode.sched", ["--tokens", "128", "--hidden", "512"]),
    # the main job's schedule, 32 processes: one run, with the skewed routing (uniform routing at
    # EP32 is the inproc tests' and the main job's)
    ("ubbv2_ep32.sched", ["--tokens", "32", "--hidden", "256", "--routing", "zipf:1.2", "--seed", "3"]),
])
def test_libfabric_tcp_run_matches_the_oracle(sched, extra):
    why = _libfabric_tcp()
    if why:
        pytest.fail(why)  # libfabric is installed: the tcp provider must work
    r = _run(f"schedules/{sched}", "--backend", "cpu", "--transport", "libfabric-tcp", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dispatch OK (bit-exact); combine OK" in r.stdout
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("transport: "))
    assert line.startswith("transport: libfabric tcp")
    # Chunks really went over the fabric, in both programs.
    for program in ("dispatch", "combine"):
        n = int(line.split(f"{program} ")[1].split(" chunks")[0])
        assert n > 0, line
        # what the proxy thread paid: host time per post (> 0), chunks found waiting per FIFO pass (>= 1)
        cost = line.split(f"{program} ")[1].split(" MB (")[1].split(")")[0]
        us, waiting = cost.split(" us mean host time per post call, ")
        assert float(us) > 0 and float(waiting.split(" chunks waiting")[0]) >= 1.0, line


@needs_tcp
@pytest.mark.parametrize("routing", ["no-remote", "empty"])
def test_libfabric_tcp_runs_routings_that_leave_rdma_pairs_empty(routing):
    # no-remote: no token crosses the RDMA link, every RDMA copy is empty; empty: only some
    # are.  An empty copy has no chunk, so no channel: a rank must not build a role for it.
    r = _run("schedules/h200x4_2vnode.sched", "--transport", "libfabric-tcp", "--tokens", "8", "--hidden", "128",
             "--routing", routing, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dispatch OK (bit-exact); combine OK" in r.stdout


@needs_tcp
def test_libfabric_tcp_credits_with_small_chunks_and_depth():
    env = {**os.environ, "EPCC_RDMA_CHUNK_TOKENS": "3", "EPCC_RDMA_DEPTH": "2"}
    r = subprocess.run([*EPCC, "run", "schedules/h200x4_2vnode.sched", "--transport", "libfabric-tcp", "--tokens", "64",
                        "--hidden", "128"], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("transport: "))
    chunks = int(line.split("dispatch ")[1].split(" chunks")[0])
    writes = int(line.split("chunks / ")[1].split(" writes")[0])
    assert chunks > 8 and writes > chunks, line  # credit writes came back: the window of 2 was reused


def test_unknown_transport_and_missing_provider_are_one_line_errors():
    r = _run("schedules/h200x4_2vnode.sched", "--transport", "carrier-pigeon", "--tokens", "8")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("epcc: error: --transport carrier-pigeon: unknown transport (choose from inproc, "
                                "libfabric-tcp)")
    r = subprocess.run([*EPCC, "run", "schedules/h200x4_2vnode.sched", "--transport", "libfabric-tcp", "--tokens", "8"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "FI_PROVIDER": "udp"})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "--transport libfabric-tcp: not available here" in r.stderr


@needs_tcp
def test_write_signal_is_refused_by_transports_without_it():
    """The GPU proxy path posts write + signal; libfabric has none in this version and says so."""
    lib = transport.load(build_transport("libfabric"))
    tp = transport.Transport(lib, "libfabric", "tcp", 0, 1)
    try:
        assert lib.epcc_tp_post_write_signal(tp.ptr, 0, 0, None, 0, None, 0, 0, 0, 0, 0, 0, 0) != 0
        assert tp.error() == ("epcc transport: 'libfabric' has no write + remote signal (the GPU proxy path needs it: "
                              "use 'emulated' or 'nvshmem')")
        # one endpoint, one link: a post on another is refused before the transport sees it
        assert tp.links == 1
        assert lib.epcc_tp_post_write_signal(tp.ptr, 0, 1, None, 0, None, 0, 0, 0, 0, 0, 0, 0) != 0
        assert tp.error() == "epcc transport: write on link 1, but 'libfabric' has 1 link"
    finally:
        tp.close()


def test_gpu_proxy_build_names_the_transports_it_has(tmp_path):
    with pytest.raises(BuildError) as e:
        build_gpu(tmp_path, "libfabric")
    assert str(e.value) == "transport 'libfabric' is not one of the GPU path's: emulated, nvshmem"
    with pytest.raises(BuildError) as e:
        build_gpu(tmp_path, "emulated")
    assert str(e.value) == f"{tmp_path}: expected one emitted '*_proxy.c', found []"


def test_partials_are_packed_to_bf16_rounding_to_nearest_even():
    """The CPU path carries combine partials as bf16 (like the GPU path): the proxy's packer must
    round as torch does (nearest, ties to even), keep NaN a NaN and infinities infinite."""
    torch = pytest.importorskip("torch")
    lib = transport.load(build_transport("libfabric"))
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * np.float32(1e3),
                        np.array([0.0, -0.0, np.inf, -np.inf, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 3.4e38, 1e-40],
                                 dtype=np.float32)])
    out = np.zeros(x.size, dtype=np.uint16)
    lib.epcc_rdma_pack_f32_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    lib.epcc_rdma_pack_f32_bf16(out.ctypes.data, x.ctypes.data, x.size)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(out, want)
    nan = np.array([np.nan, -np.nan], dtype=np.float32)
    got = np.zeros(2, dtype=np.uint16)
    lib.epcc_rdma_pack_f32_bf16(got.ctypes.data, nan.ctypes.data, 2)
    assert all((g & 0x7f80) == 0x7f80 and (g & 0x7f) for g in got)


# ------------------------------------------------------------ the GPU proxy loop, on the CPU

@pytest.fixture(scope="module")
def gpu_loop(tmp_path_factory):
    """The emitted loop of h200x2_2vnode_relay (two RDMA steps per program) with the test-only
    loopback transport (tests/rdma/loopback_transport.c): epcc_rdma_proxy_gpu over host memory."""
    d = tmp_path_factory.mktemp("gpu_loop")
    plan = _plan("h200x2_2vnode_relay.sched")
    src = d / rdma_emit.proxy_file_name(plan)
    src.write_text(rdma_emit.proxy_source(plan), encoding="utf-8")
    out = d / "libloop.so"
    subprocess.run([c_compiler(), *CFLAGS, "-shared", f"-I{NATIVE_DIR}", "-o", str(out), str(src),
                    str(NATIVE_DIR / "epcc_transport.c"), str(NATIVE_DIR / "epcc_proxy_prim.c"),
                    str(Path(__file__).parent / "loopback_transport.c")], check=True)
    lib = ctypes.CDLL(str(out))
    lib.epcc_test_loopback_open.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.epcc_test_loopback_open.restype = ctypes.c_void_p
    lib.epcc_test_loopback_link_stats.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.epcc_test_loopback_link_stats.restype = ctypes.c_uint64
    for f in ("epcc_rdma_engine_init", "epcc_rdma_proxy_gpu"):
        getattr(lib, f).argtypes, getattr(lib, f).restype = [ctypes.c_void_p], ctypes.c_int
    lib.epcc_rdma_engine_fini.argtypes, lib.epcc_rdma_engine_fini.restype = [ctypes.c_void_p], None
    lib.epcc_rdma_engine_posted.argtypes, lib.epcc_rdma_engine_posted.restype = [ctypes.c_void_p], ctypes.c_uint64
    lib.epcc_tp_close.argtypes = [ctypes.c_void_p]
    return lib, plan


class _GpuSide:
    """One rank of the GPU path with two pack roles (dispatch `there` and `relay`, to rank 1), the
    FIFO region laid out by channels.fifo_layout, and Python standing in for the kernels.  The
    loopback transport has `n_links` links; send channel i posts on links[i], the receive
    channel's credits go back on recv_link."""

    SLOT = 64

    def __init__(self, lib, plan, depths=(3, 2), chan_depths=(2, 3), n_links=1, links=(0, 0), recv_link=0):
        self.np, self.lib, self.keep = np, lib, []
        steps = [s for s in rdma_steps(plan) if s.program == "dispatch"]
        assert [s.step for s in steps] == ["there", "relay"]
        self.lay = channels.fifo_layout(depths)
        self.fifo = np.zeros(self.lay.words, dtype=np.uint64)
        self.lay.fill(self.fifo, self.fifo.ctypes.data)
        self.depths, self.chan_depths = depths, chan_depths
        self.send_bufs = [np.zeros(d * self.SLOT, dtype=np.uint8) for d in depths]
        self.landing = [np.zeros(d * self.SLOT, dtype=np.uint8) for d in chan_depths]
        self.signals = [np.zeros(d, dtype=np.uint64) for d in chan_depths]
        self.tp = lib.epcc_test_loopback_open(0, 2, n_links)
        assert self.tp
        # one receive channel (rank 1 -> 0, step there): its consumed word comes back as credit
        self.consumed, self.credit_src, self.credit_dst = (np.zeros(1, dtype=np.uint64) for _ in range(3))
        t = lambda table, rows: transport.u64_table(self.keep, table, rows).ctypes.data  # noqa: E731
        roles = [dict(step=s.index, depth=d, slot_bytes=self.SLOT, src_row_bytes=self.SLOT,
                      send_buf=b.ctypes.data, mr=0) for s, d, b in zip(steps, depths, self.send_bufs)]
        chans = [dict(peer=1, remote_addr=land.ctypes.data, slot_bytes=self.SLOT, depth=cd, imm_chan=i,
                      credit_name=transport.c_string(self.keep, f"chan{i}.credit"), signal_addr=sig.ctypes.data, link=ln)
                 for i, (land, sig, cd, ln) in enumerate(zip(self.landing, self.signals, chan_depths, links))]
        recv = [dict(peer=1, step=steps[0].index, n_chunks=4, depth=2, slot_bytes=self.SLOT,
                     credit_raddr=self.credit_dst.ctypes.data, credit_src=self.credit_src.ctypes.data,
                     name=transport.c_string(self.keep, "recv0"), consumed=self.consumed.ctypes.data, link=recv_link)]
        self.err = ctypes.create_string_buffer(transport.ERRLEN)
        self.stop, self.abort = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
        self.engine = transport.u64_table(self.keep, abi.ENGINE, [dict(
            tp=self.tp, rank_desc=transport.c_string(self.keep, "rank 0 (test)"), timeout_ns=10 ** 10,
            abort=self.abort.ctypes.data, stop=self.stop.ctypes.data, n_roles=2, roles=t(abi.SEND_ROLE, roles),
            n_send_chans=2, send_chans=t(abi.SEND_CHAN, chans), n_recv_chans=1, recv_chans=t(abi.RECV_CHAN, recv),
            err=ctypes.addressof(self.err), errlen=transport.ERRLEN, gpu_fifos=self.fifo.ctypes.data)])
        assert lib.epcc_rdma_engine_init(self.engine.ctypes.data) == 0
        self.claims = [0, 0]
        self.status = None

    def start(self):
        def run():
            self.status = self.lib.epcc_rdma_proxy_gpu(self.engine.ctypes.data)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def word(self, role, w):
        return int(self.fifo[self.lay.struct_word(role) + w])

    def wait(self, cond, what):
        end = time.monotonic() + 20
        while not cond():
            assert self.status in (None, 0), self.err.value.decode()
            assert time.monotonic() < end, what
            time.sleep(0.0005)

    def push(self, role, chan, seq, payload, kind=1):
        """What run_pack does: claim an index, wait for its send slot, fill it, publish the entry."""
        idx = self.claims[role]
        self.claims[role] += 1
        depth = self.depths[role]
        if idx >= depth:
            self.wait(lambda: self.word(role, RETIRED_WORD) >= idx - depth + 1, f"role {role} slot {idx}")
        self.send_bufs[role][(idx % depth) * self.SLOT:][:len(payload)] = payload
        e = self.lay.entries_word(role) + ENTRY_WORDS * (idx % depth)
        self.fifo[e + 1:e + 6] = [kind, chan, seq, len(payload), (1 << 32) | (seq + 1)]
        self.fifo[e] = (idx << 1) | 1  # the valid word last

    def close(self, keep_transport=False):
        self.stop[0] = 1
        self.thread.join(20)
        self.lib.epcc_rdma_engine_fini(self.engine.ctypes.data)
        if not keep_transport:
            self.lib.epcc_tp_close(self.tp)


def test_gpu_proxy_loop_serves_two_fifos(gpu_loop):
    """Two pack roles, each with its own FIFO in the region rdma_gpu lays out: the loop finds both
    (epcc_rdma_engine_init checks each FIFO's depth against its role), posts every chunk of each
    to its own channel's landing slot and signal word, retires each FIFO's entries in order over
    out-of-order completions, and returns the consumed count as credit."""
    lib, plan = gpu_loop
    g, _, _ = _serve_two_fifos(lib, plan)
    lib.epcc_tp_close(g.tp)


def test_gpu_proxy_loop_posts_each_channel_on_its_link(gpu_loop):
    """Steps over links of different speeds (h200x2_2vnode_mixed): channel 0 on link 0, channel 1
    on link 1, the receive channel's credits on link 1.  The transport sees every chunk of a
    channel, and nothing else, on that channel's link."""
    lib, plan = gpu_loop
    g, n, payloads = _serve_two_fifos(lib, plan, n_links=2, links=(0, 1), recv_link=1)
    stats = {(link, what): int(lib.epcc_test_loopback_link_stats(g.tp, link, what)) for link in (0, 1, 2)
             for what in (0, 1)}
    lib.epcc_tp_close(g.tp)
    sent = [sum(len(payloads[(r, s)]) for s in range(n[r])) for r in (0, 1)]
    assert (stats[(0, 0)], stats[(0, 1)]) == (n[0], sent[0])
    assert (stats[(1, 0)], stats[(1, 1)]) == (n[1] + 1, sent[1] + 8)  # and the one credit write, 8 bytes
    assert (stats[(2, 0)], stats[(2, 1)]) == (0, 0)


def test_gpu_proxy_loop_names_the_link_a_transport_does_not_have(gpu_loop):
    """A channel on link 2 of a two-link transport: the post is refused, and the loop stops with the
    step, what it did and the transport's message."""
    lib, plan = gpu_loop
    g = _GpuSide(lib, plan, n_links=2, links=(0, 2))
    g.start()
    try:
        g.push(0, 0, 0, np.ones(8, dtype=np.uint8))  # link 0: fine
        g.wait(lambda: g.word(0, 2) == 1, "role 0 retired")
        g.push(1, 1, 0, np.ones(8, dtype=np.uint8))
        g.thread.join(20)
    finally:
        g.close()
    assert g.status == 3
    assert g.err.value.decode() == ("epcc: rank 0 (test) step 'relay': posting a chunk: epcc transport: write on "
                                    "link 2, but 'loopback' has 2 links")


def _serve_two_fifos(lib, plan, **links):
    """Push chunks through both pack roles of a _GpuSide, check what landed and the credit; returns
    (the side, stopped, its transport still open for the caller to read and close; chunks per
    role; payloads by (role, seq))."""
    g = _GpuSide(lib, plan, **links)
    g.start()
    try:
        rng = np.random.default_rng(7)
        n = (7, 5)  # chunks per role: role 0 -> channel 0 (there), role 1 -> channel 1 (relay)
        payloads = {(r, s): rng.integers(0, 256, size=int(rng.integers(1, g.SLOT + 1)), dtype=np.uint8)
                    for r in (0, 1) for s in range(n[r])}

        def check(chan, seq):  # the receiver: wait for the signal, then the payload is in place
            cd = g.chan_depths[chan]
            g.wait(lambda: int(g.signals[chan][seq % cd]) == (1 << 32) | (seq + 1), f"chan {chan} chunk {seq}")
            p = payloads[(chan, seq)]
            assert bytes(g.landing[chan][(seq % cd) * g.SLOT:][:len(p)]) == p.tobytes(), (chan, seq)

        for s in range(max(n)):
            for r in (0, 1):
                if s < n[r]:
                    if s >= g.chan_depths[r]:  # the landing slot is reused: its previous chunk was consumed
                        check(r, s - g.chan_depths[r])
                    g.push(r, r, s, payloads[(r, s)])
        for r in (0, 1):
            for s in range(max(0, n[r] - g.chan_depths[r]), n[r]):
                check(r, s)
            g.wait(lambda: g.word(r, 2) == n[r], f"role {r} retired")
            assert (g.word(r, 0), g.word(r, 1), g.word(r, 2)) == (0, n[r], n[r])  # tail is the kernels' claims
        assert lib.epcc_rdma_engine_posted(g.engine.ctypes.data) == sum(n)
        g.consumed[0] = (1 << 32) | 4
        g.wait(lambda: int(g.credit_dst[0]) == (1 << 32) | 4, "credit returned")
    finally:
        g.close(keep_transport=True)
    assert g.status == 0, g.err.value.decode()
    return g, n, payloads


def test_gpu_proxy_loop_names_the_step_of_the_fifo_a_bad_entry_is_in(gpu_loop):
    """A bad entry in the second FIFO is reported against the second role's step (`relay`)."""
    lib, plan = gpu_loop
    g = _GpuSide(lib, plan)
    g.start()
    try:
        g.push(1, 9, 0, np.ones(8, dtype=np.uint8))  # channel 9: there are 2
        g.thread.join(20)
    finally:
        g.close()
    assert g.status == 3
    assert g.err.value.decode() == ("epcc: rank 0 (test) step 'relay': FIFO entry 0 is not a chunk (kind 1, channel 9)")


def test_gpu_proxy_engine_refuses_fifos_of_another_layout(gpu_loop):
    """FIFOs laid out one behind the other (struct, entries, struct, ...) are not the array the
    engine reads: its depth check fails instead of the loop reading entries as FIFOs."""
    lib, plan = gpu_loop
    g = _GpuSide(lib, plan)  # a valid engine, to borrow its tables
    lib.epcc_rdma_engine_fini(g.engine.ctypes.data)
    F, E = channels.FIFO_WORDS, channels.ENTRY_WORDS
    g.fifo[:] = 0
    at = 0
    for d in g.depths:  # the old interleaved layout
        g.fifo[at + channels.DEPTH_WORD] = d
        g.fifo[at + channels.ENTRIES_WORD] = g.fifo.ctypes.data + 8 * (at + F)
        at += F + E * d
    assert lib.epcc_rdma_engine_init(g.engine.ctypes.data) == -1
    lib.epcc_rdma_engine_fini(g.engine.ctypes.data)
    lib.epcc_tp_close(g.tp)


# ------------------------------------------------------------ the proxy path's watched wait, on the CPU

class _WatchedSide(_GpuSide):
    """A _GpuSide seen as the table engine's watch sees a GpuRdma: its own `stopped` and `waiting`."""

    program = "dispatch"
    thread = None
    failure, stopped, waiting = GpuRdma.failure, GpuRdma.stopped, GpuRdma.waiting

    def __init__(self, lib, plan):
        super().__init__(lib, plan)
        self._fifo_host, self._fifos = self.fifo, self.lay


def test_a_fifo_entry_waits_until_the_proxy_takes_it(gpu_loop):
    """FifoLayout.waiting reads what epcc_rdma_fifo_peek tests: an entry the kernels published at
    the FIFO's head; once the running loop took it, nothing waits."""
    lib, plan = gpu_loop
    g = _WatchedSide(lib, plan)
    try:
        assert g.waiting() == [] and g.stopped() is None
        g.push(1, 1, 0, np.ones(8, dtype=np.uint8))
        assert g.waiting() == [(1, 0)]  # not started: nobody takes it
        g.start()
        g.wait(lambda: g.word(1, 1) == 1, "taken")
        assert g.waiting() == [] and g.stopped() is None
    finally:
        g.close()
    assert g.stopped() == "its thread ended (status 0)"


def test_the_watch_names_a_stalled_proxy_after_the_stall_bound(gpu_loop):
    lib, plan = gpu_loop
    g = _WatchedSide(lib, plan)  # never started: alive in the sense that it has not failed
    try:
        g.push(0, 0, 0, np.ones(8, dtype=np.uint8))
        w = ProxyWatch([g], 2.5)
        w.check(10.0)
        w.check(12.4)
        with pytest.raises(ProxyFailed) as e:
            w.check(12.5)
        assert str(e.value) == ("the GPU proxy of the dispatch program has not taken entry 0 of FIFO 0 in 2.5 s "
                                "(stalled)")
    finally:
        lib.epcc_rdma_engine_fini(g.engine.ctypes.data)
        lib.epcc_tp_close(g.tp)


def test_the_watch_lets_a_proxy_that_makes_progress_go_on(gpu_loop):
    """An entry at the head for a while is no stall as long as the head moves: each new head
    starts its own clock."""
    lib, plan = gpu_loop
    g = _WatchedSide(lib, plan)
    w = ProxyWatch([g], 2.5)
    try:
        g.push(0, 0, 0, np.ones(8, dtype=np.uint8))
        w.check(0.0)
        g.start()
        g.wait(lambda: g.word(0, 1) == 1, "taken")
        g.push(0, 0, 1, np.ones(8, dtype=np.uint8))
        g.wait(lambda: g.word(0, 1) == 2, "taken")
        w.check(2.0)
        g.stop[0] = 1  # the loop ends: from then on the head stays, and a new entry waits
        g.thread.join(20)
        g.push(0, 0, 2, np.ones(8, dtype=np.uint8))
        g.thread = None  # (as if it had not been started: only the stall bound can name it)
        w.check(3.0)
        w.check(5.4)
        with pytest.raises(ProxyFailed, match="has not taken entry 2 of FIFO 0 in 2.5 s"):
            w.check(5.5)
    finally:
        g.stop[0] = 1
        lib.epcc_rdma_engine_fini(g.engine.ctypes.data)
        lib.epcc_tp_close(g.tp)


def test_the_watch_names_a_proxy_that_stopped(gpu_loop):
    """The loop ended on its own (here: the abort word, what a failed rank sets): the watch says
    so at its next look, with the loop's status."""
    lib, plan = gpu_loop
    g = _WatchedSide(lib, plan)
    g.start()
    try:
        g.abort[0] = 1
        g.thread.join(20)
        with pytest.raises(ProxyFailed) as e:
            ProxyWatch([g], 2.5).check(0.0)
    finally:
        g.close()
    assert str(e.value) == "the GPU proxy of the dispatch program stopped: epcc rdma: the GPU proxy failed (status 2)"


def _watched_ranks(sides, timeout_s: float):
    """Two ranks as threads over one store, each waiting for a launch that never completes
    (its kernels wait for the other rank) with its own side's proxy watched: (the GroupError,
    seconds) per rank."""
    dist = pytest.importorskip("torch.distributed")  # the runtime extra: its HashStore stands in for the group's store
    store = dist.HashStore()
    out: list = [None, None]

    def one(r: int) -> None:
        a = agree.Agreement(store, r, 2, timeout_s)
        t0 = time.monotonic()
        try:
            with a.call("dispatch"):
                wait_watched(lambda: time.monotonic() - t0 > 4 * timeout_s, ProxyWatch(sides[r], timeout_s / 2), a,
                             on_fail=lambda: [s.abort.__setitem__(0, 1) for s in sides[r]])
            out[r] = ("returned", time.monotonic() - t0)
        except GroupError as e:
            out[r] = (e, time.monotonic() - t0)

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _same_on_both(out, message: str) -> list[float]:
    for r in (0, 1):
        e, _ = out[r]
        assert isinstance(e, GroupError), (r, e)
        assert (type(e).__name__, str(e), e.rank, e.rebuild) == ("GroupTimeout", message, 1, True), (r, str(e))
    return [out[r][1] for r in (0, 1)]


def test_a_proxy_that_fails_on_one_rank_fails_every_rank_at_once(gpu_loop):
    """Rank 1's proxy stops (here: aborted) while both ranks wait for their kernels: rank 1 posts
    it at its next look, rank 0 gives up at its next look at the alarm, both with rank 1's
    reason; long before the kernels' timeout."""
    lib, plan = gpu_loop
    sides = [_WatchedSide(lib, plan), _WatchedSide(lib, plan)]
    for s in sides:
        s.start()
    sides[1].abort[0] = 1
    try:
        out = _watched_ranks([[sides[0]], [sides[1]]], timeout_s=2.0)
    finally:
        for s in sides:
            s.close()
    times = _same_on_both(out, "dispatch #1 failed on rank 1: the GPU proxy of the dispatch program stopped: "
                               "epcc rdma: the GPU proxy failed (status 2)")
    assert max(times) < 1.0, times  # at once (a look every few ms), not at a timeout
    assert sides[0].status == 2  # the failed rank's peer stopped its own proxy too (on_fail)


def test_a_proxy_that_stalls_on_one_rank_is_named_by_every_rank(gpu_loop):
    """Rank 1's proxy takes nothing (never started) while its kernels published an entry: after
    half the timeout both ranks raise the stall, naming rank 1, before any kernel would time out."""
    lib, plan = gpu_loop
    sides = [_WatchedSide(lib, plan), _WatchedSide(lib, plan)]
    sides[0].start()
    sides[1].push(0, 0, 0, np.ones(8, dtype=np.uint8))
    try:
        out = _watched_ranks([[sides[0]], [sides[1]]], timeout_s=2.0)
    finally:
        sides[0].close()
        lib.epcc_rdma_engine_fini(sides[1].engine.ctypes.data)
        lib.epcc_tp_close(sides[1].tp)
    times = _same_on_both(out, "dispatch #1 failed on rank 1: the GPU proxy of the dispatch program has not taken "
                               "entry 0 of FIFO 0 in 1 s (stalled)")
    assert all(1.0 <= t < 2.0 for t in times), times
