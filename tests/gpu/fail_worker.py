"""One rank of tests/gpu/test_gpu_failures.py: `Buffer(backend="cuda")` on a bundle (the direct
kernels of a one-hop bundle, the table-driven kernels of a multi-hop one, with the GPU proxy path
for a bundle compiled with `--rdma proxy`), where rank 1 fails on purpose in its second dispatch
(normal mode) and every rank records what it raised, and when, as JSON.  Started by the test with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one process per
GPU:

    python tests/gpu/fail_worker.py BUNDLE CASE OUT_DIR TIMEOUT_S LATE_S

CASE (what rank 1 does in dispatch #2; CASES below):

* refuse-host: its top-k has the wrong shape (refused before anything moves);
* refuse-device: its top-k names one expert twice in row 3 (the direct kernels and the metadata
  kernels skip it and every rank hears it after the read-back; host-built tables refuse it first);
* stall / killed: it comes to the call LATE_S late (after its peer gave up on it) / its process
  is killed before the call;
* stall-mid / killed-mid: it passes the call's first round, then stalls (LATE_S) / is killed
  where it would start its GPU work (`launch_hook`), so its peer's kernels wait for it and give up;
* proxy-fails / proxy-stalls (GPU proxy path): its dispatch proxy stops at once / takes nothing
  (`proxy_hook`) while the kernels need it;
* skip-ll (a bundle whose metadata exchange is the process group's collective): dispatch #2 is
  a low-latency one (sync=False, then Buffer.synchronize()) and rank 1 skips it, so no host round
  meets it and its peer waits in the group's all-gather; rank 1 comes back LATE_S later with a
  normal-mode dispatch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from epcc.runtime.buffer import Buffer, GroupError
from epcc.runtime.engines.gpu_proxy.engine import GpuRdma

CASES = ("refuse-host", "refuse-device", "stall", "killed", "stall-mid", "killed-mid", "proxy-fails", "proxy-stalls",
         "skip-ll")
#: Cases where rank 1's process is gone when the others finish.
KILLED = ("killed", "killed-mid")


def _call(buf: Buffer, fn) -> dict:
    t0 = time.monotonic()
    try:
        value = fn()
        torch.cuda.synchronize()
        return {"ok": True, "elapsed": round(time.monotonic() - t0, 3), "value": value}
    except GroupError as e:
        return {"ok": False, "elapsed": round(time.monotonic() - t0, 3), "type": type(e).__name__,
                "message": str(e), "rank": e.rank, "rebuild": e.rebuild, "state": buf.state}


def _seen(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "value"}


def launch_point(buf: Buffer) -> tuple[object, str]:
    """(object, method) of the engine's last host step before its GPU work in a normal-mode
    dispatch, after the call's first round: the agreement's last look for a peer's failure (the
    direct engine, the table engine with tables written on the GPU), the launch of the
    table-driven kernels (host-built tables)."""
    eng = buf.engine
    if getattr(eng, "meta", None) is not None or not hasattr(eng, "ctx"):
        return eng.agree, "heed"
    return eng.ctx, "launch_dispatch"


def launch_hook(buf: Buffer, action) -> None:
    """Run `action` once, at the next dispatch's launch point (launch_point)."""
    obj, name = launch_point(buf)
    orig, own = getattr(obj, name), name in vars(obj)

    def hooked(*args, **kw):
        if own:
            setattr(obj, name, orig)
        else:  # the class's method again
            delattr(obj, name)
        action()
        return orig(*args, **kw)

    setattr(obj, name, hooked)


def proxy_hook(kind: str) -> None:
    """The next dispatch program's proxy: `fails` (started, then aborted: its loop ends at its first
    idle pass with status 2) or `stalls` (a thread that takes no FIFO entry until it is stopped)."""
    orig = GpuRdma.start

    def start(self: GpuRdma) -> None:
        if self.program != "dispatch":
            return orig(self)
        GpuRdma.start = orig
        if kind == "fails":
            orig(self)
            self.abort[0] = 1
            return None

        def idle() -> None:
            while not (self.stop[0] or self.abort[0]):
                time.sleep(0.01)

        self.thread = threading.Thread(target=idle, name="epcc-test-stalled-proxy", daemon=True)
        self.thread.start()
        return None

    GpuRdma.start = start


def exchange_abort(buf: Buffer, wait_s: float) -> dict | None:
    """How long the abort of the collective exchange's group took on this rank (it runs in the
    background: the report does not wait for it), waited for up to `wait_s`: {"s": seconds or
    None if still running, "error": what it raised}; None where the Buffer has no such exchange
    or did not abort it."""
    x = getattr(getattr(buf.engine, "meta", None), "exchange", None)
    if x is None or x.group is not None:
        return None
    x.join(wait_s)
    return {"s": None if x.abort_s is None else round(x.abort_s, 3), "error": x.abort_error}


def main(bundle: str, case: str, out_dir: str, timeout_s: float, late_s: float) -> None:
    if case not in CASES:
        raise SystemExit(f"fail_worker: case must be one of {', '.join(CASES)}, not {case!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    res: dict = {}
    try:
        dist.init_process_group("nccl", device_id=dev)
        buf = Buffer(dist.group.WORLD, bundle, backend="cuda", timeout_s=timeout_s)
        res["engine"] = type(buf.engine).__name__
        wl = buf.plan.workload
        T, K, E, H = wl.tokens, wl.topk, wl.experts, wl.hidden
        g = np.random.default_rng(rank)
        idx = torch.from_numpy(np.stack([g.choice(E, size=K, replace=False) for _ in range(T)])).to(dev)
        w = torch.rand((T, K), device=dev)
        x = torch.randn((T, H), device=dev).to(torch.bfloat16)

        def round_trip(i=idx):
            rx, _, _, _, h, _ = buf.dispatch(x, i, w)
            return buf.combine(rx.clone(), h)

        assert _call(buf, round_trip)["ok"]  # a good call first: the failure is not a start-up one
        if case == "refuse-device":
            bad = idx.clone()
            if rank == 1:
                bad[3, 1] = bad[3, 0]
            res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, bad, w)))
            res["again"] = _call(buf, round_trip)["ok"]
        elif case == "refuse-host":
            bad = idx[:, : K - 1].contiguous() if rank == 1 else idx
            res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, bad, w)))
            res["again"] = _call(buf, round_trip)["ok"]
        elif case == "skip-ll":
            def low_latency():
                buf.dispatch(x, idx, w, sync=False)
                buf.synchronize()  # where a low-latency caller learns what became of its launches

            if rank == 1:  # skips the low-latency dispatch: its next call is a normal one, late
                time.sleep(late_s)
                res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
            else:
                res["failed"] = _seen(_call(buf, low_latency))
        else:
            if rank == 1:
                if case == "stall":
                    time.sleep(late_s)
                elif case == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                elif case == "stall-mid":
                    launch_hook(buf, lambda: time.sleep(late_s))
                elif case == "killed-mid":
                    launch_hook(buf, lambda: os.kill(os.getpid(), signal.SIGKILL))
                else:
                    proxy_hook(case.split("-")[1])
            res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
        res["after"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
        res["exchange_abort"] = exchange_abort(buf, 2 * timeout_s + late_s)
        res["status"] = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        res["status"] = traceback.format_exc()
    out = Path(out_dir)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    if rank == 0:  # it hosts the store: the others' verdicts need it until they are done
        deadline = time.monotonic() + 120
        others = [r for r in range(1, world) if not (case in KILLED and r == 1)]
        while time.monotonic() < deadline and not all((out / f"rank{r}.json").exists() for r in others):
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a rank whose kernel trapped has lost its CUDA context


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
