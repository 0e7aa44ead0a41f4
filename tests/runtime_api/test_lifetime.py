"""What a Buffer holds is released by the call that fails to make it, nothing of it outlives the
failure, and the interpreter's exit releases what is still open (runtime/engines/lifetime.py).

* the launcher layers of the table and direct engines as host fakes (the ctypes calls the engine
  makes, on plain integers): a construction that fails after acquiring a context, buffers and
  peer mappings releases them all, last acquired first, and a release that fails is noted on
  the error without stopping the others;
* the GPU proxy path's engine: a construction that fails releases what it allocated; a close on
  this rank alone aborts the proxy and leaves NVSHMEM's collective memory;
* the atexit hook: proxy threads stop before the memory they use is freed, a failed Buffer's
  memory stays, one engine that fails to release does not keep the others;
* no reference cycle keeps a failed call's frames (and so the Buffer, its engine and the group);
* processes (exit_worker.py, as torchrun would start them, gloo): a Buffer refused while it is
  made, on every rank, as every rank being its own CUDA IPC domain refuses the GPU bundles: each
  rank prints why and exits 1, not by a signal, and neither the Buffer nor the group outlives
  `destroy_process_group()`; a cpu Buffer left open is released at exit.
"""

from __future__ import annotations

import gc
import re
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from epcc import pipeline  # noqa: E402
from epcc.backends.cuda import codegen  # noqa: E402
from epcc.cli import main as epcc_main  # noqa: E402
from epcc.plan.schema import Int, OneOf, SchemaError, Str  # noqa: E402
from epcc.runtime.engines import agree as ag  # noqa: E402
from epcc.runtime.engines import lifetime  # noqa: E402
from epcc.runtime.engines.base import EngineError, GroupError  # noqa: E402
from epcc.runtime.engines.cuda_direct import engine as direct  # noqa: E402
from epcc.runtime.engines.cuda_direct.library import DirectRuntimeError  # noqa: E402
from epcc.runtime.engines.cuda_table import engine as table  # noqa: E402
from epcc.runtime.engines.cuda_table.exchange import ExchangeTimeout  # noqa: E402
from epcc.runtime.engines.cuda_table.launcher import CudaError  # noqa: E402
from epcc.runtime.engines.gpu_proxy import engine as gpu_engine  # noqa: E402
from epcc.runtime.testing.ranks import run_ranks  # noqa: E402

from exit_worker import LEFT_NOTHING  # noqa: E402
from test_buffer import ONE_HOP  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "exit_worker.py"


@pytest.fixture()
def no_collector():
    """The automatic garbage collector off: only references decide what is alive."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# -------------------------------------------------------------------- the pieces
def test_held_releases_last_acquired_first_and_past_a_release_that_fails():
    done = []

    def free(p):
        if p == 2:
            raise RuntimeError("cudaFree: an illegal memory access")
        done.append(p)

    h = lifetime.Held()
    for p in (1, 2, 3):
        h.push(f"buffer {p}", free, p)
    assert h.release() == ["buffer 2: cudaFree: an illegal memory access"]
    assert done == [3, 1] and len(h) == 0 and h.release() == []


def _last_frame(error: BaseException):
    tb = error.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame


def test_forget_frames_clears_the_failed_call_but_not_the_caller():
    def callers_own():
        token = "the caller's"  # noqa: F841 - a local of the caller's error
        raise KeyError("the caller's")

    def call():
        mine = "the call's"  # noqa: F841 - a local the cleared frame drops
        raise ValueError("in the call")

    try:
        callers_own()
    except KeyError as outer:
        try:
            call()
        except ValueError as e:
            assert e.__context__ is outer and "mine" in _last_frame(e).f_locals
            lifetime.forget_frames(e, outer)
            assert _last_frame(e).f_locals == {}
            assert _last_frame(outer).f_locals == {"token": "the caller's"}  # the caller's error: untouched
            lifetime.forget_frames(e)  # without its bound, the chain down to the caller's error
            assert _last_frame(outer).f_locals == {}


def test_a_failed_agreement_keeps_its_failure_without_a_traceback():
    a = ag.Agreement(dist.HashStore(), 0, 1, 0.5)
    with pytest.raises(GroupError) as raised:
        with a.call("dispatch"):
            raise RuntimeError("out of peer memory")
    assert a.state == "failed" and a.failure is not raised.value
    assert a.failure.__traceback__ is None and str(a.failure) == str(raised.value)
    with pytest.raises(GroupError, match="this Buffer failed in dispatch #1 on rank 0: out of peer memory"):
        a.check()


def test_a_union_that_fits_its_second_type_keeps_no_frame(no_collector):
    """OneOf tries Int, then Str: the first try's error must not stay in a cycle with the check's
    frame, which would keep every caller's frame (a Buffer being made) until the collector runs."""
    spec = OneOf((Int(0, 10), Str()), "a number or a string")

    def caller(sentinel):  # a frame holding the sentinel, as Buffer.__init__ holds the Buffer
        spec.check("2 x SMs", "grid")

    s = type("Sentinel", (), {})()
    ref = weakref.ref(s)
    caller(s)
    del s
    assert ref() is None
    with pytest.raises(SchemaError, match="grid: expected a number or a string"):
        spec.check(1.5, "grid")


# -------------------------------------------------------------------- engines over fake launchers
class _Launcher:
    """The table engine's launcher library on host integers: what is live, and every call that
    acquires or releases, in order; `fail_open` makes that CUDA IPC open fail (1-based)."""

    def __init__(self, fail_open: int | None = None, fail_free: int | None = None):
        self.live: set = set()
        self.events: list = []
        self.fail_open, self.fail_free, self.opens, self.next = fail_open, fail_free, 0, 0x10000
        self.has_caller_rows, self.lib = {}, None

    def _get(self, what):
        self.live.add(what)
        self.events.append(("get", what))
        return what

    def _put(self, what):
        self.live.remove(what)
        self.events.append(("put", what))

    def create(self, device, rank, flags, timeout_s):
        return _Context(self, self._get("context"))

    def malloc(self, device, nbytes):
        self.next += 0x1000
        return self._get(self.next)

    def free(self, ptr):
        if ptr == self.fail_free:
            raise CudaError(1, "cudaFree: an illegal memory access was encountered")
        self._put(ptr)

    def ipc_handle(self, ptr):
        return int(ptr).to_bytes(8, "little").ljust(64, b"\0")

    def ipc_open(self, device, handle):
        self.opens += 1
        if self.opens == self.fail_open:
            raise CudaError(1, "cudaIpcOpenMemHandle: invalid device context")
        return self._get(0x900000 + self.opens)

    def ipc_close(self, ptr):
        self._put(ptr)


class _Context:
    def __init__(self, lib, handle):
        self.lib, self.handle, self.flag_area = lib, handle, 0xF000

    def set_flag_areas(self, areas):
        pass

    def set_buffers(self, program, ptrs, stream=0):
        pass

    def close(self):
        self.lib._put(self.handle)


class _TwoRanks:
    """The agreement of rank 0 of two, whose peer answers every round with what rank 0 says (its
    buffers' handles its own)."""

    state = "ready"

    @contextmanager
    def call(self, name, numbered=True):
        yield name

    def gather(self, phase, obj):
        if phase == "the buffers' handles":
            peer = {k: [b"peer" + h[4:] for h in v] if isinstance(v, list) else b"peer" + v[4:] for k, v in obj.items()}
            return [obj, peer]
        return [obj, obj]

    def barrier(self, phase, **_):
        pass


def _plan(name: str):
    return pipeline.run(str(REPO / "schedules" / f"{name}.sched")).passes.get("plan")


def _h200x2(out_dir: Path) -> Path:
    """The one-hop schedule on 2 GPUs, derived from schedules/h200x4.sched (as tests/gpu/bundles.py does)."""
    text = (REPO / "schedules" / "h200x4.sched").read_text(encoding="utf-8")
    assert "levels node 1, gpu 4" in text and 'schedule h200x4 "' in text
    path = out_dir / "h200x2.sched"
    path.write_text(text.replace("levels node 1, gpu 4", "levels node 1, gpu 2").replace('schedule h200x4 "',
                                                                                       'schedule h200x2 "'),
                    encoding="utf-8")
    return path


@pytest.fixture()
def fake_gpu(monkeypatch):
    """torch.cuda and the group as rank 0 of two sees them, without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)


def _table_engine(monkeypatch, tmp_path, lib: _Launcher, made: list):
    plan = _plan("h200x2_2vnode")
    m = codegen.generate(plan, "schedules/h200x2_2vnode.sched", codegen.CudaOptions()).manifest
    m["metadata"] = {"lowering": "host"}  # the tables from the host: no metadata kernels to fake
    monkeypatch.setattr(table.CudaTableEngine, "_manifest", lambda self, bundle: m)
    monkeypatch.setattr(table.CudaTableEngine, "_build_library", lambda self, src, manifest: tmp_path / "lib.so")
    monkeypatch.setattr(table.CudaTableEngine, "_stream", lambda self: made.append(weakref.ref(self)) or 0)
    monkeypatch.setattr(table, "Library", lambda path, prefix: lib)
    bundle = type("B", (), {"plan": plan, "path": tmp_path, "cuda_dir": tmp_path})()
    return table.CudaTableEngine(None, bundle, timeout_s=1.0, agree=_TwoRanks())


def _acquired(lib: _Launcher) -> list:
    return [w for kind, w in lib.events if kind == "get"]


def _released(lib: _Launcher) -> list:
    return [w for kind, w in lib.events if kind == "put"]


def test_a_table_engine_that_fails_while_made_releases_everything_last_first(monkeypatch, tmp_path, fake_gpu,
                                                                            no_collector):
    lib, made = _Launcher(fail_open=3), []  # rank 1's flag area and first buffer mapped, then a failure
    with pytest.raises(CudaError, match="cudaIpcOpenMemHandle") as raised:
        _table_engine(monkeypatch, tmp_path, lib, made)
    got = _acquired(lib)
    assert got[0] == "context" and [p for p in got[1:] if p > 0x900000] == [0x900001, 0x900002]
    assert _released(lib) == got[::-1] and lib.live == set()
    assert not getattr(raised.value, "__notes__", None)
    assert made and made[0]() is not None  # its constructor's frame, in the error's traceback
    del raised
    assert made[0]() is None  # and nothing else: no cycle kept it
    assert table.CudaTableEngine not in {type(e) for e in lifetime.live()}


def test_a_release_that_fails_is_noted_and_the_others_still_run(monkeypatch, tmp_path, fake_gpu):
    lib = _Launcher(fail_open=2, fail_free=0x11000)  # the first buffer's free fails
    with pytest.raises(CudaError, match="cudaIpcOpenMemHandle") as raised:
        _table_engine(monkeypatch, tmp_path, lib, [])
    assert raised.value.__notes__ == ["releasing what was acquired before the failure: a dispatch buffer: cudaFree: "
                                      "an illegal memory access was encountered"]
    assert lib.live == {0x11000} and _released(lib)[-1] == "context"


class _DirectLibrary:
    """The direct kernels' library on host integers (as _Launcher): the error record fails."""

    region_bytes = 4096
    state_offsets: dict = {}

    def __init__(self, lib: _Launcher):
        self.lib = lib

    def init(self, warps):
        pass

    def prepare(self):
        pass

    def malloc(self, nbytes):
        return self.lib.malloc(0, nbytes)

    def free(self, ptr):
        self.lib.free(ptr)

    def ipc_handle(self, ptr):
        return self.lib.ipc_handle(ptr)

    def ipc_open(self, handle):
        return self.lib.ipc_open(0, handle)

    def ipc_close(self, ptr):
        self.lib.ipc_close(ptr)

    def error_record(self):
        raise DirectRuntimeError("cudaHostAlloc: out of memory")


def test_a_direct_engine_that_fails_while_made_releases_everything_last_first(monkeypatch, tmp_path, fake_gpu):
    src = _h200x2(tmp_path)
    plan = pipeline.run(str(src)).passes.get("plan")
    m = codegen.generate(plan, str(src), codegen.CudaOptions()).manifest
    lib = _Launcher()
    monkeypatch.setattr(direct, "cuda_manifest", lambda path: m)
    monkeypatch.setattr(direct, "build", lambda cuda_dir, manifest: tmp_path / "lib.so")
    monkeypatch.setattr(direct, "DirectLibrary", lambda path, manifest: _DirectLibrary(lib))
    bundle = type("B", (), {"plan": plan, "path": tmp_path, "cuda_dir": tmp_path})()
    with pytest.raises(DirectRuntimeError, match="cudaHostAlloc"):
        direct.CudaDirectEngine(None, bundle, timeout_s=1.0, agree=_TwoRanks())
    assert _acquired(lib) == [0x11000, 0x900001] and _released(lib) == [0x900001, 0x11000] and lib.live == set()


# -------------------------------------------------------------------- the GPU proxy path's engine
def test_a_proxy_engine_that_fails_while_made_releases_what_it_allocated(monkeypatch):
    lib = _Launcher()
    closed = []

    def setup(self, *args):
        self.device_ptrs += [lib.malloc(0, 64), lib.malloc(0, 64)]
        self.sym_ptrs.append(0x5000)
        self.tp = type("Tp", (), {"close": lambda tp: closed.append(set(lib.live))})()
        raise gpu_engine.RdmaGpuError("rank 0: registering memory: invalid argument")

    monkeypatch.setattr(gpu_engine.GpuRdma, "_setup", setup)
    with pytest.raises(gpu_engine.RdmaGpuError, match="registering memory"):
        gpu_engine.GpuRdma(proxy_lib="-", cuda_lib=lib, ctx=None, plan=None, manifest={}, source=None,
                           program="dispatch", rank=0, device=0, exchange=None)
    assert closed == [{0x11000, 0x12000}]  # the transport closed before the memory it registered is freed
    assert _released(lib) == [0x12000, 0x11000] and lib.live == set()


def _proxy(lib: _Launcher, events: list, timeout_s: float = 5.0) -> gpu_engine.GpuRdma:
    """A GpuRdma holding two device buffers and NVSHMEM memory, its thread a loop that ends at its
    stop word (noting which words were up)."""
    g = gpu_engine.GpuRdma.__new__(gpu_engine.GpuRdma)
    g.rank, g.program, g.timeout_s, g.cuda = 0, "dispatch", timeout_s, lib
    g.stop, g.abort = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    g.device_ptrs, g.sym_ptrs, g.engine, g.tp, g.keep = [lib.malloc(0, 8), lib.malloc(0, 8)], [0x5000], None, None, []
    g.lib = type("L", (), {"epcc_nvshmem_free": lambda self, p: events.append(("nvshmem_free", p))})()

    def loop():
        while not g.stop[0]:
            time.sleep(0.001)
        events.append(("stopped", int(g.abort[0]), set(lib.live)))

    g.thread = threading.Thread(target=loop, daemon=True)
    g.thread.start()
    return g


def test_a_proxy_closed_on_this_rank_alone_is_aborted_and_keeps_its_collective_memory():
    lib, events = _Launcher(), []
    g = _proxy(lib, events)
    g.close(collective=False)
    assert events == [("stopped", 1, {0x11000, 0x12000})] and lib.live == set() and g.sym_ptrs == [0x5000]
    lib, events = _Launcher(), []
    g = _proxy(lib, events)
    g.close()
    assert events == [("stopped", 0, {0x11000, 0x12000}), ("nvshmem_free", 0x5000)] and g.sym_ptrs == []


# -------------------------------------------------------------------- the interpreter's exit
def _open_table_engine(lib: _Launcher, events: list, state: str) -> table.CudaTableEngine:
    """A table engine as made (a context, two buffers, one proxy engine), its Buffer `state`."""
    eng = table.CudaTableEngine.__new__(table.CudaTableEngine)
    eng.rank, eng.agree, eng.held = 0, type("A", (), {"state": state})(), lifetime.Held()
    eng.held.push("the launcher's context", lib._put, lib._get(f"context {state}"))
    for _ in range(2):
        p = lib.malloc(0, 8)
        eng.held.push("a buffer", lib.free, p)
    eng.rdma = [_proxy(lib, events)]
    eng.opened, eng.own, eng.ctx = [], {}, object()
    return eng


@pytest.fixture()
def exit_registry(monkeypatch):
    """lifetime's engines still open, empty for the test."""
    monkeypatch.setattr(lifetime, "_live", {})


def test_at_exit_the_proxies_stop_before_the_memory_they_use_is_freed(exit_registry):
    lib, events = _Launcher(), []
    ready = _open_table_engine(lib, events, "ready")  # 0x11000, 0x12000; its proxy's 0x13000, 0x14000
    failed = _open_table_engine(lib, events, "failed")  # 0x15000, 0x16000; its proxy's 0x17000, 0x18000
    everything = set(lib.live)
    lifetime.track(ready)
    lifetime.track(failed)
    lifetime.release_live()
    # the last made first; each proxy stopped (aborted: nobody waits for it) while all it may
    # touch was allocated; the failed Buffer's memory, its proxy's too, stays (a peer's kernel or
    # proxy may still write into it until the process ends)
    assert events == [("stopped", 1, everything), ("stopped", 1, everything)]
    assert _released(lib) == [0x14000, 0x13000, 0x12000, 0x11000, "context ready"]
    assert lib.live == {"context failed", 0x15000, 0x16000, 0x17000, 0x18000} and lifetime.live() == []


def test_closing_a_failed_buffer_says_what_it_could_not_release(exit_registry):
    """A failed Buffer's close meets no peer: its proxies are stopped and its memory kept; a proxy
    thread that does not stop is named in the close's error, with the rank."""
    lib, events = _Launcher(), []
    eng = _open_table_engine(lib, events, "failed")
    eng.exchange, kept = None, set(lib.live)

    class Stuck:
        program = "dispatch"

        def stop_thread(self, abort=False):
            raise RuntimeError("the GPU proxy thread did not stop within 5 s of its stop word")

    eng.rdma = [Stuck()]
    with pytest.raises(EngineError) as e:
        eng.close()
    assert str(e.value) == ("closing the Buffer on rank 0: dispatch's proxy: the GPU proxy thread did not stop "
                            "within 5 s of its stop word")
    assert lib.live == kept and eng.rdma == []  # the memory stays: a peer's kernel may still write into it


def test_at_exit_an_engine_that_fails_to_release_is_said_and_the_others_are_released(exit_registry, capsys):
    released = []

    class Engine:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def release_at_exit(self):
            released.append(self.name)
            if self.error:
                raise RuntimeError(self.error)

    for e in (Engine("first"), Engine("second", "cudaFree: an illegal memory access"), Engine("third")):
        lifetime.track(e)
    lifetime.release_live()
    assert released == ["third", "second", "first"]
    assert capsys.readouterr().err == "epcc: at exit, releasing a Buffer's Engine: cudaFree: an illegal memory access\n"


# -------------------------------------------------------------------- processes
def _compile(out: Path, src: Path, *options: str) -> Path:
    assert epcc_main(["compile", str(src), "-o", str(out), "--target", "cuda", *options]) == 0
    return out


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    d = tmp_path_factory.mktemp("bundles")
    two_vnodes = REPO / "schedules" / "h200x2_2vnode.sched"
    return {  # tests/gpu/test_gpu.py's cases: h200x2_2vnode_50_proxy_collective, _50_collective, h200x2
        "proxy-emulated": _compile(d / "proxy", two_vnodes, "--rdma", "proxy", "--metadata-exchange", "collective"),
        "peer-copies": _compile(d / "collective", two_vnodes, "--metadata-exchange", "collective"),
        "direct": _compile(d / "direct", _h200x2(d)),
    }


def _ranks(*args: str, **env: str):
    return run_ranks([sys.executable, str(WORKER), *args], 2, cwd=REPO, timeout_s=120,
                     env={"OMP_NUM_THREADS": "1", **env})


@pytest.mark.parametrize("case, refusal", [
    ("proxy-emulated", "'emulated' transport"),
    ("peer-copies", "over peer memory, but they are in different CUDA IPC domains"),
    ("direct", "the direct kernels (a one-hop plan) map every peer's memory"),
])
def test_a_buffer_refused_on_every_rank_exits_1_and_leaves_nothing(bundles, case, refusal):
    for r in _ranks("refused", str(bundles[case]), EPCC_CUDA_IPC_DOMAIN="box{rank}"):
        assert r.returncode == 1, f"rank {r.rank} {r.ended()}:\n{r.output[-6000:]}"
        assert "making the Buffer failed on ranks 0, 1: " in r.output and refusal in r.output, r.output[-6000:]
        assert LEFT_NOTHING in r.output, r.output[-6000:]


def test_a_cpu_buffer_left_open_is_released_at_exit(tmp_path):
    """Before the atexit hook, its segments were left to the resource tracker, which reports them."""
    src = tmp_path / "s.sched"
    src.write_text(ONE_HOP.format(r=2, t=8, h=256, dtype="bf16", k=4, e=8), encoding="utf-8")
    assert epcc_main(["compile", str(src), "-o", str(tmp_path / "b")]) == 0
    results = _ranks("left-open", str(tmp_path / "b"))
    sessions = set()
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} {r.ended()}:\n{r.output[-6000:]}"
        assert "leaked shared_memory" not in r.output, r.output[-6000:]
        sessions |= set(re.findall(r"^session (\w+)$", r.output, re.M))
    assert len(sessions) == 1
    assert not list(Path("/dev/shm").glob(f"epcc-{sessions.pop()}-*"))



class _Exchange:
    """The collective exchange as release_locally sees it: its abort and the join of its thread."""

    def __init__(self, events: list):
        self.events = events

    def abort(self):
        self.events.append("abort")

    def join(self, timeout_s=None):
        self.events.append("join")
        return True


@pytest.mark.parametrize("state", ["ready", "failed"])
def test_the_exchange_made_before_a_failed_metadata_is_aborted_and_joined_before_anything_goes(state):
    """The engine holds the exchange from its making on: a construction that fails after it, in the
    metadata (no DeviceMeta to reach it through), and a failed Buffer at exit (its memory kept) still
    abort the exchange's group and join the abort's thread, after the proxies stop and before any
    memory is released."""
    lib, events = _Launcher(), []
    eng = _open_table_engine(lib, events, state)
    eng.meta, eng.exchange, eng.timeout_s = None, _Exchange(events), 1.0
    everything = set(lib.live)
    eng.release_at_exit()
    assert events == [("stopped", 1, everything), "abort", "join"]
    assert (lib.live == set()) == (state == "ready")


def test_an_exchange_timeout_in_a_dispatch_is_posted_as_it_is_and_aborts_the_exchange(monkeypatch):
    """The exchange's own timeout (gloo's all-gather ending at the bound inside the metadata's run)
    goes to the group as it is, with what a rank that never answers did not do (`lost_why`), and
    this rank's exchange group is aborted, as every other launch failure of the engine is."""
    posted, events = [], []

    class Agree:
        def heed(self):
            pass

        def fail(self, report):
            posted.append(report)
            raise RuntimeError("failed")

    class Meta:
        def run(self, *args):
            raise ExchangeTimeout("b", 0, "did not complete (5.0 s)")

        def failure(self):
            return None

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: 0)
    eng = table.CudaTableEngine.__new__(table.CudaTableEngine)
    eng.agree, eng.meta, eng.rdma, eng.exchange, eng.device = Agree(), Meta(), [], _Exchange(events), None
    monkeypatch.setattr(eng, "_stream", lambda: 0)
    with pytest.raises(RuntimeError, match="^failed$"):
        eng._dispatch_device(None, 0, None, None, True, 1)
    assert len(posted) == 1 and isinstance(posted[0], ExchangeTimeout)
    assert posted[0].lost_why.startswith("it did not come to the metadata exchange of bundle 'b'")
    assert events == ["abort"]


def test_closing_a_failed_table_engine_stops_its_proxies_and_keeps_its_memory(exit_registry):
    """As at exit and as the direct engine does: a failed Buffer's peers may still write into its
    buffers, so its close stops the proxies and aborts the exchange on this rank and frees nothing."""
    lib, events = _Launcher(), []
    eng = _open_table_engine(lib, events, "failed")
    eng.meta, eng.exchange, eng.timeout_s = None, _Exchange(events), 1.0
    everything = set(lib.live)
    lifetime.track(eng)
    eng.close()
    assert events == [("stopped", 1, everything), "abort", "join"]
    assert lib.live == everything and lifetime.live() == []
