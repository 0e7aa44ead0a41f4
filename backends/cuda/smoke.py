"""End-to-end check of a CUDA bundle on a GPU machine: one process per rank and GPU.

    epcc compile schedules/h200x4.sched --target cuda -o build/h200x4
    python -m epcc.backends.cuda.smoke build/h200x4 --tokens 256 --iters 3

Builds the library (nvcc, unless --lib names one), starts one process per rank (rank r on
CUDA device r: the plan's rank count must not exceed the GPUs), exchanges CUDA IPC handles of
the flag areas and buffers through multiprocessing, computes the layout of a random routing
(runtime/layout.py), uploads the tables, runs dispatch then combine `--iters` times (the entry
barriers and alternating counter banks across launches) and compares every rank's output rows
(exact) and combined tokens (bf16, runtime/oracle.py's tolerance) with the oracle.  Prints one
line per rank and iteration with the host-measured time of launch + synchronize.

`--emulate` runs the same harness without a GPU: the NumPy emulator of the kernels
(backends/cuda/emulate.py) executes the same table blobs.  Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

import numpy as np


def _workload(bundle: Path, tokens: int, seed: int):
    from epcc.plan import Plan
    from epcc.runtime import inputs, oracle
    from epcc.runtime.layout import compute_layout

    plan = Plan.from_json((bundle / "plan.json").read_text(encoding="utf-8"))
    wl, R = plan.workload, plan.num_ranks
    idx = inputs.make_routing("uniform", R, tokens, wl.topk, wl.experts, wl.placement, seed=seed).topk_idx
    w = inputs.make_weights(idx, seed=seed + 1)
    layout = compute_layout(plan, idx, w)
    x = inputs.make_x_rows(R, tokens, wl.hidden, wl.dtype, seed=seed + 2)
    want = oracle.dispatch_oracle(idx, wl.experts, wl.placement, x, w)
    y = inputs.make_expert_outputs([len(want[r].rows) for r in range(R)], wl.hidden, seed=seed + 3)
    ref, mag = oracle.combine_oracle(idx, wl.experts, wl.placement, w, y, wl.hidden, return_abs=True)
    return plan, layout, x, want, y, ref, mag


def _check(rank: int, got_rows, want_rows, got_comb, ref, mag, topk, rounding: float) -> list[str]:
    from epcc.runtime import oracle

    errs = []
    if got_rows.shape != want_rows.shape or not np.array_equal(got_rows, want_rows):
        bad = np.nonzero(~np.all(got_rows == want_rows, axis=1))[0] if got_rows.shape == want_rows.shape else []
        errs.append(f"dispatch: {len(bad)} of {len(want_rows)} output rows differ (first {list(bad[:5])})")
    chk = oracle.compare_combine(oracle.bf16_to_f32(got_comb)[None], ref[rank][None], mag[rank][None], topk,
                                 partial_rounding=rounding)
    if not chk.ok:
        errs.append(f"combine: {chk}")
    return errs


def _rank_main(rank: int, args, shared, barrier, results) -> None:
    try:
        _rank(rank, args, shared, barrier, results)
    except Exception as e:  # report, and release the peers from the barriers
        results.put((rank, -1, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}", 0.0))
        barrier.abort()


def _rank(rank: int, args, shared, barrier, results) -> None:
    from epcc.backends.cuda import Library, buffer_sizes, build_tables, load_manifest, partial_rounding

    bundle = Path(args.bundle)
    manifest = load_manifest(bundle / "cuda")
    plan, layout, x, want, y, ref, mag = _workload(bundle, args.tokens, args.seed)
    R, dev = plan.num_ranks, rank
    lib = Library(args.lib)
    cap = 1 + 2 * max(len(layout.flags), 1)
    ctx = lib.create(dev, rank, cap, args.timeout)
    shared[("flags", rank)] = lib.ipc_handle(ctx.flag_area)
    barrier.wait()
    opened = []

    def peer(key, r, own):
        if r == rank:
            return own
        p = lib.ipc_open(dev, shared[(key, r)])
        opened.append(p)
        return p

    ctx.set_flag_areas([peer("flags", r, ctx.flag_area) for r in range(R)])
    own: dict[tuple[str, int], int] = {}
    for program in ("dispatch", "combine"):
        if not lib.has_program(program):
            continue
        for b, nbytes in enumerate(buffer_sizes(manifest, layout, program, rank)):
            own[(program, b)] = lib.malloc(dev, nbytes)
            shared[((program, b), rank)] = lib.ipc_handle(own[(program, b)])
    barrier.wait()
    for program in ("dispatch", "combine"):
        if not lib.has_program(program):
            continue
        nb = len(manifest["buffers"][program])
        ptrs = [[peer((program, b), r, own[(program, b)]) for r in range(R)] for b in range(nb)]
        ctx.set_buffers(program, ptrs)
        ctx.upload_tables(program, build_tables(manifest, layout, program, rank))
    names = {p: [b["name"] for b in manifest["buffers"][p]] for p in ("dispatch", "combine")}
    out_ptr = lib.malloc(dev, layout.tokens * layout.hidden * 2)
    barrier.wait()  # every flag area and buffer exists before anyone launches
    for it in range(args.iters):
        lib.copy_to_device(own[("dispatch", names["dispatch"].index("input"))], x[rank])
        t0 = time.perf_counter()
        ctx.launch_dispatch()
        ctx.synchronize()
        t_d = time.perf_counter() - t0
        got = np.zeros_like(want[rank].rows)
        lib.copy_to_host(got, own[("dispatch", names["dispatch"].index("output"))])
        lib.copy_to_device(own[("combine", names["combine"].index("output"))], y[rank])
        t0 = time.perf_counter()
        ctx.launch_combine(out_ptr)
        ctx.synchronize()
        t_c = time.perf_counter() - t0
        comb = np.zeros((layout.tokens, layout.hidden), dtype=np.uint16)
        lib.copy_to_host(comb, out_ptr)
        errs = _check(rank, got, want[rank].rows, comb, ref, mag, plan.workload.topk, partial_rounding(manifest))
        results.put((rank, it, not errs, "; ".join(errs), (t_d, t_c)))
    barrier.wait()
    for p in opened:
        lib.ipc_close(p)
    ctx.close()


def _emulate(args) -> int:
    from epcc.backends.cuda import load_manifest, partial_rounding
    from epcc.backends.cuda.emulate import emulate
    from epcc.runtime import oracle

    bundle = Path(args.bundle)
    manifest = load_manifest(bundle / "cuda")
    plan, layout, x, want, y, ref, mag = _workload(bundle, args.tokens, args.seed)
    d = emulate(manifest, layout, "dispatch", list(x))
    c = emulate(manifest, layout, "combine", y)
    ok = True
    for r in range(plan.num_ranks):
        comb = oracle.f32_to_bf16(c[("result", r)])
        errs = _check(r, d[("output", r)], want[r].rows, comb, ref, mag, plan.workload.topk,
                      partial_rounding(manifest))
        print(f"rank {r}: {'ok' if not errs else 'FAIL ' + '; '.join(errs)} (emulated)")
        ok &= not errs
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epcc.backends.cuda.smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", help="bundle directory written by `epcc compile FILE --target cuda -o DIR`")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    ap.add_argument("--iters", type=int, default=3, help="dispatch + combine rounds (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=20.0, help="bound of every wait, seconds")
    ap.add_argument("--lib", help="a built launcher library (default: build it with nvcc)")
    ap.add_argument("--emulate", action="store_true", help="no GPU: run the NumPy emulator over the same tables")
    args = ap.parse_args(argv)
    if args.emulate:
        return _emulate(args)
    from epcc.backends.cuda import load_manifest

    proxied = [n["step"] for n in load_manifest(Path(args.bundle) / "cuda")["not_lowered"] if n["kind"] == "rdma"]
    if proxied:
        print(f"{args.bundle}: steps {', '.join(sorted(set(proxied)))} are left to a host RDMA proxy, which this "
              f"version does not have (compile with rdma='emulate' for a one-box run, or use --emulate)")
        return 2
    if not args.lib:
        from epcc.backends.cuda import build_library

        args.lib = str(build_library(Path(args.bundle) / "cuda"))
    from epcc.plan import Plan

    R = Plan.from_json((Path(args.bundle) / "plan.json").read_text(encoding="utf-8")).num_ranks
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr:
        shared, barrier, results = mgr.dict(), mgr.Barrier(R, timeout=max(120.0, 4 * args.timeout)), mgr.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, args, shared, barrier, results)) for r in range(R)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        ok = all(p.exitcode == 0 for p in procs)
        while not results.empty():
            rank, it, good, msg, t = results.get()
            ok &= good
            if it < 0:
                print(f"rank {rank}: ERROR {msg}")
            else:
                print(f"rank {rank} iter {it}: {'ok' if good else 'FAIL ' + msg} "
                      f"(dispatch {t[0] * 1e3:.3f} ms, combine {t[1] * 1e3:.3f} ms, host-timed)")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
