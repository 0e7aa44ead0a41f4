"""One rank of test_lifetime.py's processes (runtime.testing.ranks.run_ranks starts them as torchrun
would), on the CPU with a gloo group:

    exit_worker.py refused BUNDLE [TRANSPORT]   (EPCC_CUDA_IPC_DOMAIN='box{rank}')
    exit_worker.py left-open BUNDLE

`refused`: what tests/gpu/ep_worker.py and proxy_worker.py do when every rank is its own CUDA IPC
domain and `Buffer(backend="cuda")` is refused while it is made: the error printed, the verdict
all-reduced, the group destroyed, exit status 1.  Only torch.cuda.is_available and
current_device are stubbed: the table and direct engines refuse such a bundle before they call
CUDA (runtime/engines/ipc_domain.py), so the path up to the refusal and after it is the GPU run's.
The automatic garbage collector is off, so that references alone, not the collector's timing,
decide what outlives the failure: after `destroy_process_group()` neither the refused Buffer
nor the process group may be alive (otherwise they are destroyed during the interpreter's
teardown: lifetime.py); the worker says so, or exits 3.

`left-open`: a cpu Buffer dispatches once and is never closed; the interpreter's exit releases
it (lifetime.py's atexit hook unlinks its shared memory; otherwise the resource tracker reports
leaked segments).  Prints the peer memory's session name.
"""

from __future__ import annotations

import gc
import sys
import traceback
import weakref

import torch
import torch.distributed as dist

from epcc.runtime.buffer import Buffer

LEFT_NOTHING = "nothing of the refused Buffer outlived the group"


class WatchedBuffer(Buffer):
    """A Buffer whose instances are noted (weakly) before they are made."""

    made: list = []

    def __init__(self, *args, **kwargs):
        WatchedBuffer.made.append(weakref.ref(self))
        super().__init__(*args, **kwargs)


def refused(bundle: str, transport: str | None) -> int:
    torch.cuda.is_available = lambda: True  # the refusal comes before any CUDA call
    torch.cuda.current_device = lambda: 0
    gc.disable()
    dist.init_process_group("gloo")
    group = weakref.ref(dist.group.WORLD)
    failed = 0
    try:
        WatchedBuffer(dist.group.WORLD, bundle, backend="cuda", timeout_s=10.0,
                      config={"rdma_transport": transport} if transport else None)
    except Exception:  # as ep_worker.py: print it, fail the run
        traceback.print_exc()
        failed = 1
    flag = torch.tensor([failed])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if not failed:
        print("the Buffer was made, not refused", flush=True)
        return 2
    left = [what for what, ref in (("the process group", group), ("the Buffer", WatchedBuffer.made[0]))
            if ref() is not None]
    if left:
        print(f"left behind after destroy_process_group(): {', '.join(left)}", flush=True)
        return 3
    print(LEFT_NOTHING, flush=True)
    return 1


def left_open(bundle: str) -> int:
    dist.init_process_group("gloo")
    buf = Buffer(dist.group.WORLD, bundle, backend="cpu", timeout_s=10.0)
    wl = buf.plan.workload
    g = torch.Generator().manual_seed(buf.rank)
    idx = torch.stack([torch.randperm(wl.experts, generator=g)[: wl.topk] for _ in range(wl.tokens)])
    x = torch.randn((wl.tokens, wl.hidden), generator=g).to(torch.bfloat16)
    buf.dispatch(x, idx, torch.ones((wl.tokens, wl.topk)))
    print(f"session {buf.engine.memory.session}", flush=True)
    dist.barrier()  # every rank dispatched before any leaves
    dist.destroy_process_group()
    return 0  # buf stays open


if __name__ == "__main__":
    mode, path, *rest = sys.argv[1:]
    sys.exit(refused(path, rest[0] if rest else None) if mode == "refused" else left_open(path))
