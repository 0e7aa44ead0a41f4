"""tests/gpu/fail_worker.py's injections on the CPU: where each engine's GPU work starts (the
launch hook), and the two broken proxies (the proxy hook), so that a GPU run of
test_gpu_failures.py fails for the engine's reason, not for the worker's; and what it records of
the collective exchange's abort."""

from __future__ import annotations

import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")  # the worker runs under torch on the GPU machine

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fail_worker as F  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epcc.runtime.engines.agree import Agreement  # noqa: E402
from epcc.runtime.engines.cuda_table.exchange import Exchange  # noqa: E402
from epcc.runtime.engines.cuda_table.launcher import Context  # noqa: E402
from epcc.runtime.engines.gpu_proxy.engine import GpuRdma  # noqa: E402


class _Calls:
    def __init__(self):
        self.log = []

    def run(self, *a):
        self.log.append(("run", a))

    def launch_dispatch(self, *a):
        self.log.append(("launch_dispatch", a))

    def dispatch(self, *a):
        self.log.append(("dispatch", a))

    def heed(self, *a):
        self.log.append(("heed", a))


def _buf(kind: str):
    gpu = _Calls()
    if kind == "table":  # tables written on the GPU: the last look for a peer's failure, then the metadata kernels
        eng = types.SimpleNamespace(meta=_Calls(), ctx=_Calls(), agree=gpu)
    elif kind == "proxy":  # host-built tables: the launch
        eng = types.SimpleNamespace(meta=None, ctx=gpu, agree=_Calls())
    else:
        eng = types.SimpleNamespace(lib=_Calls(), agree=gpu)
    return types.SimpleNamespace(engine=eng), gpu


@pytest.mark.parametrize("kind, method, real", [("table", "heed", Agreement), ("proxy", "launch_dispatch", Context),
                                                 ("direct", "heed", Agreement)])
def test_the_launch_hook_runs_once_where_the_gpu_work_starts(kind, method, real):
    assert callable(getattr(real, method))  # the engines' own entry points carry these names
    buf, gpu = _buf(kind)
    assert F.launch_point(buf) == (gpu, method)
    seen = []
    F.launch_hook(buf, lambda: seen.append(list(gpu.log)))
    getattr(gpu, method)(1, 2)
    getattr(gpu, method)(3)
    assert seen == [[]]  # once, before the engine's call
    assert gpu.log == [(method, (1, 2)), (method, (3,))]
    assert method not in vars(gpu)  # the class's method again


def _proxy(program: str) -> GpuRdma:
    p = object.__new__(GpuRdma)
    p.program, p.thread, p.status = program, None, None
    p.stop, p.abort = np.zeros(1, dtype=np.uint64), np.zeros(1, dtype=np.uint64)
    return p


def test_the_stalled_proxy_is_alive_and_takes_nothing_until_stopped(monkeypatch):
    started = []
    monkeypatch.setattr(GpuRdma, "start", lambda self: started.append(self.program))
    F.proxy_hook("stalls")
    combine, dispatch = _proxy("combine"), _proxy("dispatch")
    GpuRdma.start(combine)  # another program's proxy: the real one
    GpuRdma.start(dispatch)
    try:
        assert started == ["combine"]
        assert isinstance(dispatch.thread, threading.Thread) and dispatch.thread.is_alive()
        time.sleep(0.05)
        assert dispatch.stopped() is None  # alive, failing nothing: only the watch's stall bound names it
        GpuRdma.start(_proxy("dispatch"))  # once: the next dispatch proxy is real again
        assert started == ["combine", "dispatch"]
    finally:
        dispatch.abort[0] = 1
        dispatch.thread.join(5)
    assert dispatch.stopped() == "its thread ended (status None)"


def test_the_failing_proxy_is_started_then_aborted(monkeypatch):
    started = []
    monkeypatch.setattr(GpuRdma, "start", lambda self: started.append(int(self.abort[0])))
    F.proxy_hook("fails")
    p = _proxy("dispatch")
    GpuRdma.start(p)
    assert started == [0] and p.abort[0] == 1


def test_an_unknown_case_is_named():
    with pytest.raises(SystemExit,
                       match="fail_worker: case must be one of refuse-host, .*proxy-stalls, skip-ll, not 'nope'"):
        F.main("b", "nope", ".", 5.0, 10.0)


def test_the_exchange_abort_is_read_once_it_ended():
    """What the worker records of the collective exchange's abort (it runs in the background):
    nothing before it is aborted or without such an exchange, then how long it took."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = Exchange(dist.group.WORLD, 1.0, "b", torch.device("cpu"))
        buf = types.SimpleNamespace(engine=types.SimpleNamespace(meta=types.SimpleNamespace(exchange=x)))
        assert F.exchange_abort(buf, 5.0) is None  # not aborted
        assert F.exchange_abort(types.SimpleNamespace(engine=types.SimpleNamespace()), 5.0) is None
        x.abort()
        got = F.exchange_abort(buf, 5.0)
        assert got is not None and got["error"] is None and 0 <= got["s"] < 5.0, got
    finally:
        dist.destroy_process_group()
