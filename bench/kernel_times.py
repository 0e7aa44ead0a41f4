"""Per-kernel GPU time of the direct lowering (torch.profiler / CUPTI), one process per GPU:

    torchrun --nproc-per-node 4 bench/kernel_times.py BUNDLE [--iters 20] [--graph]

Separates what the event timings of bench/ep_bench.py lump together: the metadata kernel, the
dispatch kernel, the combine kernel, and the gaps between them (host launch overhead when the
GPU waits for Python).  With --graph, dispatch + combine are captured once in a CUDA graph
(low-latency mode) and the replay is timed, which takes the host out entirely.
Rank 0 prints the median duration of each kernel over the iterations.  --no-cupti runs the same
iterations without the profiler, for a run under Nsight Compute (bench/ncu_rank0.sh: the two
cannot share the GPU's counters).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from epcc.runtime.testing import inputs  # noqa: E402
from epcc.runtime.buffer import Buffer  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--no-cupti", action="store_true", help="no torch.profiler (a run under ncu)")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(dist.group.WORLD, args.bundle, backend="cuda")
    wl = buf.plan.workload
    T = wl.tokens
    idx_all = inputs.make_topk("uniform", R, T, wl.topk, wl.experts, wl.placement, seed=0).topk_idx
    w_all = inputs.make_weights(idx_all, seed=1)
    if wl.dtype == "fp8":
        x = (torch.randint(0, 0x7E, (T, wl.hidden), device=dev, dtype=torch.uint8).view(torch.float8_e4m3fn),
             torch.rand((T, wl.hidden // 128), device=dev) / 448.0)
    else:
        x = torch.randn((T, wl.hidden), device=dev).to(torch.bfloat16)
    idx = torch.from_numpy(idx_all[rank]).to(dev)
    w = torch.from_numpy(w_all[rank]).to(dev)
    y = torch.randn((buf.engine.c["capacity"], wl.hidden), device=dev).to(torch.bfloat16)

    def step():
        h = buf.dispatch(x, idx, w, sync=False)[4]
        buf.combine(y, h)

    for _ in range(3):
        step()
    if args.graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
    else:
        run = step
    torch.cuda.synchronize()
    dist.barrier()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) if not args.no_cupti else contextlib.nullcontext() as prof:
        for _ in range(args.iters):
            torch.cuda.synchronize()
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            walls.append(a.elapsed_time(b))
    per: dict[str, list[float]] = {}
    for ev in prof.events() if prof is not None else []:
        if ev.device_type.name == "CUDA" and any(k in ev.name for k in ("meta_count_kernel", "meta_finish_kernel", "dispatch_kernel", "combine_kernel")):
            name = next(k for k in ("meta_count_kernel", "meta_finish_kernel", "dispatch_kernel", "combine_kernel") if k in ev.name)
            per.setdefault(name, []).append(ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    rows = {k: statistics.median(v) for k, v in per.items()}
    allr = [None] * R
    dist.all_gather_object(allr, (rows, statistics.median(walls)))
    if rank == 0:
        cfg = buf.engine.config
        print(f"{args.bundle}: {R} ranks x {T} tokens {wl.dtype}, config {vars(cfg)}, "
              f"{'graph replay' if args.graph else 'eager'}")
        for k in ("meta_count_kernel", "meta_finish_kernel", "dispatch_kernel", "combine_kernel"):
            print(f"  {k:16s} " + "  ".join(f"r{r}: {a[0].get(k, float('nan')):8.1f} us" for r, a in enumerate(allr)))
        print("  events dispatch+combine: " + "  ".join(f"r{r}: {a[1] * 1e3:8.1f} us" for r, a in enumerate(allr)))
    buf.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
