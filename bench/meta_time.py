"""The metadata of a table-driven bundle whose tables the GPU writes, timed alone: the routing
exchange over peer memory and the metadata kernels that write a rank's tables of both programs
(runtime/engines/cuda_table/meta.py), per dispatch, as a fresh routing pays them.

    torchrun --standalone --nproc-per-node 2 bench/meta_time.py .gpu/bundles/h200x2_2vnode_50 [--iters 200]

Each iteration: a barrier, CUDA events around `meta.run` on the current stream, the time the
maximum over ranks (the exchange waits for the slowest rank's routing); prints the median, the
10th and 90th percentiles, and the tokens per rank.  Uniform routing, the bundle's tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's epcc where none is installed

from epcc.runtime.buffer import Buffer  # noqa: E402
from epcc.runtime.testing.inputs import make_topk, make_weights  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = Buffer(dist.group.WORLD, args.bundle, backend="cuda")
    meta = getattr(buf.engine, "meta", None)
    if meta is None:
        print(f"{args.bundle}: its tables come from the host, not the metadata kernels", file=sys.stderr)
        return 1
    wl = buf.plan.workload
    T = wl.tokens
    idx = make_topk("uniform", world, T, wl.topk, wl.experts, wl.placement, seed=1).topk_idx
    w = make_weights(idx, seed=2)
    topk = torch.from_numpy(idx[rank]).to(dev)
    weights = torch.from_numpy(w[rank]).to(dev)
    stream = torch.cuda.current_stream(dev).cuda_stream
    times = []
    for i in range(args.warmup + args.iters):
        dist.barrier()
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        meta.run(T, topk, weights, stream)
        b.record()
        b.synchronize()
        if i >= args.warmup:
            times.append(a.elapsed_time(b) * 1e3)
    t = torch.tensor(times, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    us = sorted(t.tolist())
    if rank == 0:
        q = statistics.quantiles(us, n=10)
        print(f"{Path(args.bundle).name}: {world} ranks x {T} tokens: metadata (exchange + tables) "
              f"median {statistics.median(us):.1f} us (p10 {q[0]:.1f}, p90 {q[-1]:.1f}), max over ranks, "
              f"{len(us)} iterations, {torch.cuda.get_device_name(dev)}")
    dist.barrier()
    buf.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
