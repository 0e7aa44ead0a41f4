"""`epcc tune BUNDLE`: sweep the direct kernels' launch configuration on the GPUs, keep the fastest.

    torchrun --nproc-per-node 4 -m epcc.runtime.tune build/h200x4 [--sms 8,16,24,32] [--warps 8,16]
    epcc tune build/h200x4 --nproc 4 ...        (the same, started through torchrun)

What is swept (plan/direct.py, DirectConfig): the SMs of dispatch, either all of them
sending and then replicating (the default) or some only replicating (senders : replicators 3:1,
2:1, 7:5, 1:1), and the warps per dispatch block; then the SMs of combine (all reducing records
and then summing partials, or some only summing, same ratios).  One Buffer (one peer region) serves every
trial: the configuration is a launch argument, not a compile-time constant, so no rebuild.  Every
trial first checks that its dispatch rows and combine output are bit-identical to the first
trial's (the result does not depend on the launch configuration: record order and the order of
the fp32 sums are fixed), then times `--iters` calls with CUDA events (max over ranks, median).
Rank 0 shows a progress bar and writes the best configuration to BUNDLE/cuda/tuned.json, which
`Buffer(..., backend="cuda")` reads; the full table goes beside it (tune_results.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

for _k, _v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ[_k] = _v  # NVLink multicast stays off on shared hosts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from epcc.plan.direct import MAX_WARPS, DirectError  # noqa: E402
from epcc.runtime.testing import inputs  # noqa: E402
from epcc.runtime.buffer import Buffer  # noqa: E402

SPLITS = ((1, 0), (3, 1), (2, 1), (7, 5), (1, 1))  # (senders, dedicated replicators); (1, 0): none


def _ints(text: str, flag: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise SystemExit(f"epcc tune: {flag} {text}: expected comma-separated whole numbers, e.g. 8,16,24") from None
    if not v or min(v) < 2:
        raise SystemExit(f"epcc tune: {flag} {text}: every value must be at least 2")
    return v


def split(sms: int, ratio: tuple[int, int]) -> tuple[int, int]:
    if ratio[1] == 0:
        return sms, 0
    a = min(sms - 1, max(1, round(sms * ratio[0] / (ratio[0] + ratio[1]))))
    return a, sms - a


def bar(i: int, n: int, text: str) -> None:
    w = 30
    k = int(w * i / max(n, 1))
    sys.stdout.write(f"\r[{'#' * k}{'.' * (w - k)}] {i}/{n} {text[:70]:70s}")
    sys.stdout.flush()
    if i == n:
        sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="epcc tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--sms", default="8,16,24,32,48", help="total SMs per kernel to try (default 8,16,24,32,48)")
    ap.add_argument("--warps", default=f"8,{MAX_WARPS}", help=f"warps per dispatch block (default 8,{MAX_WARPS})")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tokens", type=int, help="tokens per rank (default: the bundle's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-write", action="store_true", help="print the best configuration, do not write tuned.json")
    args = ap.parse_args(argv)
    sms_list, warp_list = _ints(args.sms, "--sms"), _ints(args.warps, "--warps")
    if max(warp_list) > MAX_WARPS:
        raise SystemExit(f"epcc tune: --warps {args.warps}: at most {MAX_WARPS} warps per block")
    if args.iters < 1:
        raise SystemExit(f"epcc tune: --iters {args.iters}: at least 1 timed call (the median of none is no time)")

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, R = dist.get_rank(), dist.get_world_size()
    buf = Buffer(dist.group.WORLD, args.bundle, backend="cuda", timeout_s=20.0)
    eng = buf.engine
    wl = buf.plan.workload
    T = args.tokens or wl.tokens
    idx_all = inputs.make_topk("uniform", R, T, wl.topk, wl.experts, wl.placement, seed=args.seed).topk_idx
    w_all = inputs.make_weights(idx_all, seed=args.seed + 1)
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed * 31 + rank)
    if wl.dtype == "fp8":
        x = (torch.randint(0, 0x7E, (T, wl.hidden), generator=g, device=dev, dtype=torch.uint8).view(torch.float8_e4m3fn),
             torch.rand((T, wl.hidden // 128), generator=g, device=dev) / 448.0)
    else:
        x = torch.randn((T, wl.hidden), generator=g, device=dev).to(torch.bfloat16)
    idx = torch.from_numpy(idx_all[rank]).to(dev)
    w = torch.from_numpy(w_all[rank]).to(dev)
    cap = eng.c["capacity"]
    y = torch.randn((cap, wl.hidden), generator=g, device=dev).to(torch.bfloat16)
    base = eng.config

    trials = []
    for sms in sms_list:
        for ratio in SPLITS:
            s, r = split(sms, ratio)
            for wp in warp_list:
                cfg = replace(base, send_blocks=s, recv_blocks=r, warps=wp)
                try:
                    cfg.check()
                except DirectError:
                    continue  # a configuration the kernels refuse (split() and --warps keep to their bounds)
                if ("dispatch", cfg) not in trials:
                    trials.append(("dispatch", cfg))
    for sms in sms_list:
        for ratio in SPLITS:
            s, r = split(sms, ratio)
            cfg = replace(base, combine_send_blocks=s, combine_reduce_blocks=r)
            if ("combine", cfg) not in trials:
                trials.append(("combine", cfg))

    ref = None
    results = []

    tick = torch.zeros(1, device=dev)

    def timed(fn) -> float:
        """GPU time of fn(), as bench/ep_bench.py takes it: the GPUs lined up by an all_reduce
        behind a ~2 ms device sleep, during which the host enqueues fn's kernels (its launch cost
        is not in the time: a training step hides it by running ahead)."""
        torch.cuda.synchronize()
        dist.barrier()
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(4_000_000)
        dist.all_reduce(tick)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for i, (prog, cfg) in enumerate(trials):
        eng.config = cfg
        rx, _, _, _, h, _ = buf.dispatch(x, idx, w, sync=False)
        out = buf.combine(y, h)
        torch.cuda.synchronize()
        rows = (rx[0] if wl.dtype == "fp8" else rx)[: 4096].view(torch.uint8).clone()
        if ref is None:
            ref = (rows, out.clone())
            ok = True
        else:
            ok = torch.equal(rows, ref[0]) and torch.equal(out.view(torch.int16), ref[1].view(torch.int16))
        flag = torch.tensor([0 if ok else 1], device=dev)
        dist.all_reduce(flag)
        if flag.item():
            if rank == 0:
                print(f"\nepcc tune: {asdict(cfg)} gives a different result than the first configuration: "
                      f"not a tuning question, a bug; stopping", file=sys.stderr)
            dist.destroy_process_group()
            return 1
        ts = []
        for it in range(args.warmup + args.iters):
            if prog == "dispatch":
                t = timed(lambda: buf.dispatch(x, idx, w, sync=False))
            else:
                hh = buf.dispatch(x, idx, w, sync=False)[4]
                t = timed(lambda: buf.combine(y, hh))
            if it >= args.warmup:
                ts.append(t)
        med = statistics.median(ts)
        results.append({"program": prog, "config": asdict(cfg), "median_ms": med, "min_ms": min(ts)})
        if rank == 0:
            sms = cfg.dispatch_sms if prog == "dispatch" else cfg.combine_sms
            bar(i + 1, len(trials), f"{prog} {sms} SMs "
                f"({cfg.send_blocks if prog == 'dispatch' else cfg.combine_send_blocks}+"
                f"{cfg.recv_blocks if prog == 'dispatch' else cfg.combine_reduce_blocks}"
                f"{', ' + str(cfg.warps) + ' warps' if prog == 'dispatch' else ''}): {med:.3f} ms")

    best_d = min((r for r in results if r["program"] == "dispatch"), key=lambda r: r["median_ms"])
    best_c = min((r for r in results if r["program"] == "combine"), key=lambda r: r["median_ms"])
    best = dict(asdict(base))
    for k in ("send_blocks", "recv_blocks", "warps"):
        best[k] = best_d["config"][k]
    for k in ("combine_send_blocks", "combine_reduce_blocks"):
        best[k] = best_c["config"][k]
    if rank == 0:
        print(f"best dispatch: {best_d['median_ms']:.3f} ms with {best['send_blocks']}+{best['recv_blocks']} SMs, "
              f"{best['warps']} warps per block; best combine: {best_c['median_ms']:.3f} ms with "
              f"{best['combine_send_blocks']}+{best['combine_reduce_blocks']} SMs "
              f"({R} ranks x {T} tokens, {torch.cuda.get_device_name(dev)})")
        if not args.no_write:
            cuda = Path(args.bundle) / "cuda"
            (cuda / "tuned.json").write_text(json.dumps({"config": best, "tokens": T, "ranks": R,
                                                         "device": torch.cuda.get_device_name(dev),
                                                         "dispatch_ms": best_d["median_ms"],
                                                         "combine_ms": best_c["median_ms"]}, indent=1) + "\n")
            (cuda / "tune_results.json").write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {cuda / 'tuned.json'}")
    buf.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
