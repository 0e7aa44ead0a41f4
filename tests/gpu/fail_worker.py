"""One rank of tests/gpu/test_gpu_failures.py: `Buffer(backend="cuda")` on a bundle's direct
kernels, where rank 1 fails on purpose in its second dispatch (normal mode) and every rank records
what it raised, and when, as JSON.  Started by the test with torchrun's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), one process per GPU:

    python tests/gpu/fail_worker.py BUNDLE CASE OUT_DIR TIMEOUT_S

CASE: refuse-device (rank 1's top-k names one expert twice in a row: the kernels skip it and
every rank hears it after the read-back), refuse-host (rank 1's top-k has the wrong shape: it
launches nothing, its peer's kernels give up after the timeout), stall (rank 1 comes to the call
after its peer gave up on it), killed (rank 1's process is killed before the call).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from epcc.runtime.buffer import Buffer, GroupError
from epcc.runtime.engines import agree


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


def main(bundle: str, case: str, out_dir: str, timeout_s: float) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    res: dict = {}
    try:
        dist.init_process_group("nccl", device_id=dev)
        buf = Buffer(dist.group.WORLD, bundle, backend="cuda", timeout_s=timeout_s)
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
        elif case == "stall":
            if rank == 1:
                time.sleep(timeout_s + agree.GRACE_S + 3)
            res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
        elif case == "killed":
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            res["failed"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
        res["after"] = _seen(_call(buf, lambda: buf.dispatch(x, idx, w)))
        res["status"] = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        res["status"] = traceback.format_exc()
    out = Path(out_dir)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    if rank == 0:  # it hosts the store: the others' verdicts need it until they are done
        deadline = time.monotonic() + 120
        others = [r for r in range(1, world) if (case, r) != ("killed", 1)]
        while time.monotonic() < deadline and not all((out / f"rank{r}.json").exists() for r in others):
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # no teardown: a rank whose kernel trapped has lost its CUDA context


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
