"""The metadata of a table-driven bundle whose tables the GPU writes, timed alone: the routing
exchange (over peer memory, or the group's all-gather) and the metadata kernels that write a
rank's tables of both programs (runtime/engines/cuda_table/meta.py), per dispatch, as a fresh
routing pays them.

    torchrun --standalone --nproc-per-node 2 bench/meta_time.py .gpu/bundles/h200x2_2vnode_50 [--iters 200]
        [--grid 0,default] [--profile] [--timeline [N]] [--raw DIR]

Each iteration: a barrier, CUDA events around `meta.run` on the current stream, the time the
maximum over ranks (the exchange waits for the slowest rank's routing); prints the median, the
10th and 90th percentiles, and the tokens per rank, and the host's own time to enqueue the
launches (where it exceeds the GPU's, the events time the host).  Uniform routing, the
bundle's tokens.  `--grid`: the grids of the cooperative kernel meta_fused to time one after the
other in the same processes (`default`: the runtime's, its largest phase's blocks at most what the
device holds; 0: the steps as launches of their own, as on a target without cooperative launch).
With more ranks than GPUs (torchrun's 2 ranks on a machine of 1 GPU) the ranks share the GPUs over
gloo, their kernels time-sliced: the medians then hold the GPU's time slices, and only the
timeline's own times (the kernels' work after the peers' routing landed) compare across builds.
`--profile` then records 20 more iterations of each under torch.profiler and prints rank 0's
kernels and copies with their mean device time, to find what bounds the metadata.

`--timeline [N]` (N: 50 where not given), after the above: N more dispatches at the runtime's grid
with meta_fused's per-block %globaltimer stamps on (DeviceMeta.timeline; untimed), and per rank a
table of where its time went.  Each row a stage of the kernel (meta.py STAGES: entry, sent -- the
block's share of the scratch cleared, of the templates copied and of the routing stored into every
rank's area --, prepared -- its first count block's sets read --, peers -- that count block's
tokens' slot words landed --, each phase's work done (count's: its arrival at the barrier after it,
what the scan reads stored), each grid barrier passed), in us after the
launch's first block entered: the median over the dispatches of the stage's median over the
blocks ("median", over the blocks with work in the phase for a phase's row, their number in
"blocks"; "-" where none had any) and of its max over the blocks ("max");
beside it the step that led to it (start, send, prepare, wait, count, barrier 1, scan, ...): the
median of how much later the grid's last block passed the stage than the last passed the one
before (the launch's critical path), the total, the last stamp after the first entry, and the own
time, the total less the wait (the ranks enter apart: the wait is the peers' lateness).  With
the collective exchange (the routing gathered before the launch) send is 0 and wait a look at
slot words already there.  Over CUDA IPC the wait holds the routing's flight as well as the peers'
lateness: compare the totals of the rank that came last (its peers' routing was there), not the
own times, across builds.  `--raw DIR`
also writes each rank's stamps of those dispatches, DIR/timeline_rank{r}.npy ([N][blocks][stage]
ns, STAGES' order), to follow single blocks (which scan block is the phase's last, say).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's epcc where none is installed

from epcc.runtime.buffer import Buffer  # noqa: E402
from epcc.runtime.engines.cuda_table.meta import timeline_medians, timeline_summary  # noqa: E402
from epcc.runtime.testing.inputs import make_topk, make_weights  # noqa: E402
from epcc.runtime.testing.ranks import join_group  # noqa: E402


def timeline_lines(summary: dict, rank: int) -> list[str]:
    """The table --timeline prints for one rank (`summary`: meta.py timeline_medians)."""

    def us(v: float | None) -> str:
        return f"{v:8.1f}" if v is not None else f"{'-':>8}"

    lines = [f"rank {rank}: meta_fused timeline, {summary['blocks']} blocks, medians over {summary['launches']} "
             f"dispatches (us after the first block's entry)",
             f"  {'stage':<10} {'blocks':>6} {'median':>8} {'max':>8}   {'step':<10} {'us':>8}"]
    for stage, (step, took) in zip(summary["stages"], summary["steps"]):
        lines.append(f"  {stage['stage']:<10} {stage['blocks']:>6} {us(stage['median_us'])} {us(stage['max_us'])}   "
                     f"{step:<10} {us(took)}")
    lines.append(f"  {'total':<10} {'':>6} {'':>8} {'':>8}   {'':<10} {us(summary['total_us'])}")
    lines.append(f"  {'own':<10} {'':>6} {'':>8} {'':>8}   {'':<10} {us(summary['own_us'])}"
                 f"   (the total less the wait for the blocks' arrivals and the peers' routing)")
    return lines


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"a number of dispatches, at least 1, not {text}")
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="per-kernel device times of rank 0 (torch.profiler)")
    ap.add_argument("--grid", default="default",
                    help="meta_fused's grids to time, comma-separated: blocks, `default` (the runtime's), 0 (the "
                         "steps as launches of their own)")
    ap.add_argument("--timeline", type=positive, nargs="?", const=50, default=0, metavar="N",
                    help="then N (50) dispatches with meta_fused's per-block timeline, a table per rank of where its "
                         "time goes")
    ap.add_argument("--raw", type=Path, metavar="DIR",
                    help="with --timeline: each rank's stamps into DIR/timeline_rank{r}.npy, [N][blocks][stage] ns")
    args = ap.parse_args(argv)
    if args.raw and not args.timeline:
        ap.error("--raw: the stamps are --timeline's")
    try:
        grids = [None if g.strip() == "default" else int(g) for g in args.grid.split(",")]
    except ValueError:
        ap.error(f"--grid: blocks, `default` or 0, comma-separated, not {args.grid!r}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    joined = join_group()  # more ranks than GPUs: they share them, time-sliced, over gloo
    if joined is None:
        print("meta_time: no CUDA device visible (run it under torchrun on the GPU machine)", file=sys.stderr)
        return 1
    dev, shared = joined
    rank, world = dist.get_rank(), dist.get_world_size()
    if shared and rank == 0:
        print(f"{world} ranks on {torch.cuda.device_count()} GPU(s), time-sliced: a rank's wait holds the GPU's "
              "time slices; its own time (the timeline's `own`, the rank that came last) is what compares across "
              "builds", flush=True)
    buf = Buffer(dist.group.WORLD, args.bundle, backend="cuda")
    meta = getattr(buf.engine, "meta", None)
    if meta is None:
        print(f"{args.bundle}: its tables come from the host, not the metadata kernels", file=sys.stderr)
        return 1
    if args.timeline and meta.fused_grid == 0:
        print("--timeline: the timeline is meta_fused's, and this device runs the metadata's steps as launches of "
              "their own (no cooperative launch)", file=sys.stderr)
        return 1
    wl = buf.plan.workload
    T = wl.tokens
    idx = make_topk("uniform", world, T, wl.topk, wl.experts, wl.placement, seed=1).topk_idx
    w = make_weights(idx, seed=2)
    topk = torch.from_numpy(idx[rank]).to(dev)
    weights = torch.from_numpy(w[rank]).to(dev)
    stream = torch.cuda.current_stream(dev)
    times: list[float] = []
    host: list[float] = []

    def once(i: int) -> None:
        dist.barrier()
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h0 = time.perf_counter()
        meta.run(T, topk, weights, stream)
        h1 = time.perf_counter()
        b.record()
        b.synchronize()
        if i >= args.warmup:
            times.append(a.elapsed_time(b) * 1e3)
            host.append((h1 - h0) * 1e6)

    default = meta.fused_grid
    for grid in grids:
        g = default if grid is None else grid
        if not 0 <= g <= default:
            print(f"--grid {g}: meta_fused's grid is 0 to {default} blocks here", file=sys.stderr)
            return 2
        torch.cuda.synchronize(dev)
        meta.set_grid(g)
        times.clear()
        host.clear()
        for i in range(args.warmup + args.iters):
            once(i)
        t = torch.tensor(times, device=torch.device("cpu") if shared else dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        us = sorted(t.tolist())
        how = f"meta_fused, {g} blocks" if g else "a launch per step"
        if rank == 0:
            q = statistics.quantiles(us, n=10)
            print(f"{Path(args.bundle).name}: {world} ranks x {T} tokens, {how}: metadata (exchange + tables) "
                  f"median {statistics.median(us):.1f} us (p10 {q[0]:.1f}, p90 {q[-1]:.1f}), max over ranks, "
                  f"{len(us)} iterations, {torch.cuda.get_device_name(dev)}; host enqueue median "
                  f"{statistics.median(host):.1f} us", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile  # reason: only with --profile

            n = 20
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(n):
                    once(args.warmup + i)
            if rank == 0:
                rows = [(e.key, e.self_device_time_total / n, e.count // n) for e in prof.key_averages()
                        if e.self_device_time_total > 0 and str(e.device_type).endswith("CUDA")]
                rows.sort(key=lambda r: -r[1])
                print(f"per dispatch, {how}, rank 0, mean over {n} (device us, launches):")
                for key, us_, cnt in rows[:16]:
                    print(f"  {us_:8.1f}  x{cnt:<3d} {key[:100]}", flush=True)
    if args.timeline:
        torch.cuda.synchronize(dev)
        meta.set_grid(default)
        meta.timeline(True)
        rounds, raw = [], []
        for _ in range(args.timeline):
            dist.barrier()
            torch.cuda.synchronize(dev)
            meta.run(T, topk, weights, stream)
            stream.synchronize()
            raw.append(meta.read_timeline())
            rounds.append(timeline_summary(raw[-1], meta.busy_blocks()))
        meta.timeline(False)
        if args.raw:
            args.raw.mkdir(parents=True, exist_ok=True)
            np.save(args.raw / f"timeline_rank{rank}.npy", np.stack(raw))
        every = [None] * world
        dist.all_gather_object(every, timeline_medians(rounds))
        if rank == 0:
            for r, summary in enumerate(every):
                print("\n".join(timeline_lines(summary, r)), flush=True)
    dist.barrier()
    buf.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
