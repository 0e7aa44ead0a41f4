"""ep_bench's arguments and main: one process per GPU (rank r on cuda:LOCAL_RANK), every bundle
on one routing; epcc and DeepEP in a child process per rank and bundle (child.py), the torch+NCCL
baselines here; rank 0 prints the table last and writes OUT/ep_bench.json.

--rdma-chunks TxD[,TxD...]: a bundle compiled with --rdma proxy runs once per RDMA chunking (T
tokens per chunk, D in flight) through `Buffer(..., rdma_chunk_tokens=T, rdma_depth=D)`, which
re-chunks its plan (plan/rdma.py with_overrides: the layout, tables, rings and FIFOs follow, the
kernels do not change), reported as BUNDLE@TxD beside `epcc simulate` of the re-chunked plan,
simulated here; the baselines run once per bundle.

More ranks than GPUs (4 ranks on a 2-GPU machine): rank r runs on GPU r mod #GPUs, the groups are
gloo (NCCL wants a GPU per rank), only epcc runs, and the driver time-slices the kernels of one
GPU's ranks: a correctness run of the plan's kernels and proxy path (every result checked), whose
times are not the plan's and are compared with nothing.

--dry-run: no CUDA, no NCCL: gloo on CPU tensors (all_to_all_single emulated with all_gather),
wall-clock timing; epcc runs through `Buffer(backend="cpu")` (the plan's roles JIT-compiled for
the CPU) with every check, where ranks x tokens is at most --emulate-max-tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from epcc.plan import bundle as bundle_io
from epcc.plan.rdma import ENV_CHUNK_TOKENS, ENV_DEPTH, MAX_DEPTH, positive_setting
from epcc.runtime.engines.cuda_table.launcher import build_library
from epcc.runtime.testing import inputs

from . import NO_MULTICAST, OVERRIDDEN, deepep
from .baselines import BASELINES, bench_baselines
from .child import per_method, run_child
from .data import bench_routing, load_bundle, make_data, traffic
from .predict import load_prediction, predict, rdma_chunking_of, rechunk
from .report import format_predictions, format_table, jsonable, method_record, proxy_cost, status
from .timing import GLOO_TIMEOUT, PG_TIMEOUT, Comm, Timer

METHODS = ("epcc",) + BASELINES + ("deepep",)


def parse(argv=None):
    ap = argparse.ArgumentParser(description="EP dispatch/combine benchmark: epcc's CUDA bundles through "
                                             "epcc.runtime.Buffer against torch+NCCL baselines and DeepEP")
    ap.add_argument("--bundles", nargs="+", required=True, help="bundle directories (epcc compile --target cuda -o)")
    ap.add_argument("--out", required=True, help="where rank 0 writes ep_bench.json")
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all; deepep where deep_ep is "
                         f"importable)")
    ap.add_argument("--tokens", type=int, help="tokens per rank (default: each bundle's plan)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-timeout", type=float, default=10.0, help="epcc: bound of every in-kernel wait, s")
    ap.add_argument("--child-timeout", type=float, default=150.0,
                    help="epcc, deepep: bound of a bundle's whole run in its child processes, s")
    ap.add_argument("--rebuild", action="store_true", help="run nvcc even where the build cache has the library")
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush before each timed iteration")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any bundle or method failed (a check, a timeout, a build): for tests")
    ap.add_argument("--dry-run", action="store_true", help="CPU + gloo, no CUDA: exercise everything but the kernels")
    ap.add_argument("--rdma-transport", choices=("emulated", "nvshmem"),
                    default=os.environ.get("EPCC_RDMA_TRANSPORT", "emulated"),
                    help="epcc, bundles compiled with --rdma proxy: the transport of their RDMA steps (emulated: "
                         "the copy engine paced to the plan's link; nvshmem: put with signal at what NVSHMEM "
                         "reaches); default $EPCC_RDMA_TRANSPORT or emulated")
    ap.add_argument("--rdma-chunks", default=None, metavar="TxD[,TxD...]",
                    help="epcc, bundles compiled with --rdma proxy: run each once per RDMA chunking, T tokens per "
                         "chunk x D chunks in flight per channel (e.g. 32x16,64x8; T or D alone keeps the plan's "
                         "other one: 64x, x8), re-chunking the plan at run time (Buffer's rdma_chunk_tokens and "
                         "rdma_depth: the layout, tables, rings and the prediction follow; the kernels do not "
                         "change); default: $EPCC_RDMA_CHUNK_TOKENS x $EPCC_RDMA_DEPTH where set, else the plan's")
    ap.add_argument("--deepep-sms", default="24", metavar="N[,N...]",
                    help="deepep: the SM counts to run it at (even; deep_ep.Buffer.set_num_sms), one set of rows each")
    ap.add_argument("--epcc-sms", default="", metavar="N[,N...]",
                    help="epcc, bundles with direct kernels: run them once per SM count (dispatch and combine "
                         "blocks; rows epcc@N, epcc_cached@N); default: each bundle's own configuration")
    ap.add_argument("--epcc-graph", action="store_true",
                    help="epcc, bundles with the low-latency mode (sync=False: direct kernels, tables from the GPU): "
                         "also time dispatch and combine as CUDA graph replays, each captured once per input set "
                         "(rows epcc_graph, epcc_graph@N): the host's launch work taken out")
    ap.add_argument("--emulate-max-tokens", "--dry-max-tokens", dest="emulate_max_tokens", type=int, default=1024,
                    help="dry run: run epcc on the CPU only when ranks x tokens is at most this")
    args = ap.parse_args(argv)
    default = args.methods is None
    args.methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    if default and not deepep.available():
        args.methods.remove("deepep")
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    try:
        args.rdma_chunks = rdma_chunkings(args.rdma_chunks, os.environ)
        args.deepep_sms = deepep.parse_sms(args.deepep_sms)
        args.epcc_sms = parse_epcc_sms(args.epcc_sms)
    except ValueError as e:  # bad input: the setting and its value, exit status 1
        print(f"ep_bench: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    return args


def parse_epcc_sms(text: str) -> list[int]:
    """--epcc-sms: positive SM counts, [] when empty; ValueError naming a bad one."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--epcc-sms: {item!r} is not a positive number of SMs")
        out.append(int(item))
    return out


def rdma_chunkings(text: str | None, env) -> list[tuple[int | None, int | None]]:
    """--rdma-chunks (or $EPCC_RDMA_CHUNK_TOKENS / $EPCC_RDMA_DEPTH) as [(tokens, depth)], None
    where the plan's value stays; [] when neither is given (the plan's chunking only).  A bad
    value is a ValueError naming it."""
    if text is None:
        c, d = env.get(ENV_CHUNK_TOKENS, ""), env.get(ENV_DEPTH, "")
        if not c and not d:
            return []
        return [(positive_setting(ENV_CHUNK_TOKENS, c), positive_setting(ENV_DEPTH, d, MAX_DEPTH))]
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item.count("x") != 1:
            raise ValueError(f"--rdma-chunks: {item!r} is not TOKENSxDEPTH (e.g. 64x8, 64x or x8)")
        c, d = item.split("x")
        one = (positive_setting(f"--rdma-chunks {item}: tokens", c),
               positive_setting(f"--rdma-chunks {item}: depth", d, MAX_DEPTH))
        if one == (None, None):
            raise ValueError(f"--rdma-chunks: {item!r} gives neither tokens nor depth")
        if one not in out:
            out.append(one)
    return out


def chunking_label(c: tuple[int | None, int | None]) -> str:
    return f"{c[0] or ''}x{c[1] or ''}"


def build_libs(bundles: list[str], rebuild: bool) -> list[tuple[str | None, str | None]]:
    """Rank 0: the launcher library of every table-driven bundle into the build cache (nvcc in
    parallel; again only when the sources change, or with `rebuild`), so that the engines of the
    epcc processes find it there.  [(path, error)]; a direct bundle's Buffer builds its own."""

    def one(b: str):
        try:
            man = bundle_io.cuda_manifest(b)
            if "direct" in man:
                return None, None
            not_lowered = [n["step"] for n in man.get("not_lowered", []) if n.get("kind") == "rdma"]
            if not_lowered:
                return None, f"steps {sorted(set(not_lowered))} need a host RDMA proxy (not in this version)"
            return str(build_library(Path(b) / "cuda", fresh=rebuild)), None
        except Exception as e:  # noqa: BLE001
            return None, f"build: {type(e).__name__}: {str(e)[-1500:]}"

    with ThreadPoolExecutor(max_workers=max(1, len(bundles))) as ex:
        return list(ex.map(one, bundles))


def setup(args) -> tuple[Comm, int, bool]:
    """The process groups and this rank's device: (comm, #GPUs, whether ranks share GPUs)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if args.dry_run:
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
        return Comm(True, torch.device("cpu"), dist.group.WORLD), 0, False
    gpus = torch.cuda.device_count()
    # more ranks on this host than GPUs: rank r on GPU r mod #GPUs, kernels time-sliced (on
    # several hosts, torchrun's LOCAL_WORLD_SIZE is this host's ranks, not WORLD_SIZE)
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) > gpus
    dev = torch.device("cuda", local % gpus)
    torch.cuda.set_device(dev)
    if shared:
        dist.init_process_group("gloo", timeout=GLOO_TIMEOUT)
        return Comm(False, dev, dist.group.WORLD, True), gpus, True
    dist.init_process_group("nccl", timeout=PG_TIMEOUT, device_id=dev)
    return Comm(False, dev, dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)), gpus, False


def main(argv=None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    comm, gpus, shared = setup(args)
    rank, world, dev = comm.rank, comm.world, comm.dev
    timer = Timer(comm, not args.no_flush)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if OVERRIDDEN:
        say(f"note: forced {NO_MULTICAST} (the environment had {OVERRIDDEN})")
    say(f"ep_bench: {world} ranks, {'dry run (CPU, gloo)' if args.dry_run else torch.cuda.get_device_name(dev)}, "
        f"torch {torch.__version__}, methods {args.methods}")
    if shared:
        dropped = [m for m in args.methods if m != "epcc"]
        args.methods = [m for m in args.methods if m == "epcc"]
        say(f"note: {world} ranks on {gpus} GPU(s): rank r on GPU r mod {gpus}, the kernels of one GPU's ranks "
            f"time-sliced by the driver: a correctness run (every result checked), its times are not the "
            f"plan's" + (f"; {', '.join(dropped)} not run (NCCL wants a GPU per rank)" if dropped else ""))

    libs: list = [(None, None)] * len(args.bundles)
    if "epcc" in args.methods and not args.dry_run:
        t = time.perf_counter()
        libs = comm.all_gather_object(build_libs(args.bundles, args.rebuild) if rank == 0 else None)[0]
        say(f"libraries ready in {time.perf_counter() - t:.1f} s: "
            + "; ".join(f"{Path(b).name}: {e or l or 'built by its Buffer'}" for b, (l, e) in zip(args.bundles, libs)))

    report = {"args": vars(args), "world": world, "env": {k: os.environ.get(k) for k in NO_MULTICAST},
              "device": None if args.dry_run else torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "shared_gpus": f"{world} ranks on {gpus} GPUs, time-sliced" if shared else None,
              "timing": "CUDA events per rank; iteration time = max over ranks; median and min over timed "
                        "iterations; GB/s = mean bytes per rank / median time" if not args.dry_run else
                        "dry run: wall clock on CPU (meaningless as performance)",
              "bundles": []}
    for bi, bundle, chunking, loaded, first_of_bundle in runs_of(args, say):
        name = Path(bundle).name + (f"@{chunking_label(chunking)}" if chunking else "")
        entry: dict = {"name": name, "path": str(bundle), "methods": {}}
        report["bundles"].append(entry)
        if isinstance(loaded, str):
            entry["error"] = loaded
            say(f"{name}: {entry['error']}")
            continue
        plan = rechunk(loaded[0], chunking) if chunking else loaded[0]  # checked by --rdma-chunks' parsing
        if chunking:
            entry["rdma_chunking"] = rdma_chunking_of(plan)
        wl, R = plan.workload, plan.num_ranks
        T = args.tokens or wl.tokens
        sim = predict(plan, T=T, manifest=loaded[1]) if chunking else load_prediction(bundle)
        if sim:
            entry["simulate"] = sim
        entry["workload"] = {"ranks": R, "tokens": T, "hidden": wl.hidden, "dtype": wl.dtype, "topk": wl.topk,
                             "experts": wl.experts, "placement": wl.placement, "schedule": plan.schedule}
        if R != world:
            entry["error"] = f"the plan has {R} ranks, this run {world} processes"
            say(f"{name}: {entry['error']}")
            continue
        rb = inputs.row_bytes(wl.hidden, wl.dtype)
        idx, w = bench_routing(plan, T, args.seed)
        tr = traffic(idx, wl.experts, wl.placement, wl.hidden, rb, wl.dtype)
        entry["traffic_bytes"] = tr
        entry["row_bytes"] = rb
        progress = lambda what: say(f"[{time.perf_counter() - t_start:6.1f} s] {name}: {what}")  # noqa: E731
        progress(f"{R} ranks x {T} tokens, hidden {wl.hidden} {wl.dtype}, top-{wl.topk} of {wl.experts}")

        def add(rows: dict[str, list[dict]]) -> None:
            for m, per_rank in rows.items():
                progress(f"{m} {status(per_rank)}")
                for line in per_rank[0].get("rdma") or []:  # the GPU proxy path: which transport, what rings
                    say(f"    rdma {line}")
                for p, st in (per_rank[0].get("rdma_stats") or {}).items():  # and what its proxy thread cost
                    say(f"    rdma {p} proxy: {proxy_cost(st)}")
                entry["methods"][m] = method_record(per_rank, tr, rb, wl.topk, m)

        if "epcc" in args.methods:
            lib_error = libs[bi][1]
            direct = "direct" in loaded[1]
            for sms in (args.epcc_sms if direct and args.epcc_sms else [None]):
                res = {"error": lib_error} if lib_error else run_child(
                    comm, args, {"method": "epcc", "bundle": bundle, "tokens": T, "rdma_chunking": chunking,
                                 "sms": sms})
                add(per_method(comm.all_gather_object(res), "epcc" + (f"@{sms}" if sms else "")))
        base = [m for m in args.methods if m in BASELINES] if first_of_bundle else []  # once per bundle
        if base:
            data = make_data(comm, plan, T, idx, w, args.seed, token_major=False)  # the baselines' own layout
            res = bench_baselines(comm, timer, args, plan, T, idx, data, base)
            add({m: comm.all_gather_object(res[m]) for m in base})
            if not args.dry_run:
                torch.cuda.empty_cache()
        if "deepep" in args.methods and first_of_bundle:
            why = deepep.skip_reason(args.dry_run, shared, wl.placement, R)
            res = {"methods": {"deepep": {"skipped": why}}} if why else run_child(
                comm, args, {"method": "deepep", "bundle": bundle, "tokens": T})
            add(per_method(comm.all_gather_object(res), "deepep"))

    if rank == 0:
        write_report(args, report, t_start)
    comm.barrier()
    failed = [f"{b['name']}: {b['error']}" for b in report["bundles"] if "error" in b]
    failed += [f"{b['name']} {m}: {r['error']}" for b in report["bundles"] for m, r in b.get("methods", {}).items()
               if "error" in r]
    code = 1 if args.strict and failed else 0
    if code:
        say(f"--strict: {len(failed)} failed: " + "; ".join(failed))
    if args.dry_run:
        dist.destroy_process_group()
        return code
    sys.stdout.flush()
    os._exit(code)  # skip NCCL teardown: nothing left to do, and it can hang after a peer's failure


def runs_of(args, say):
    """(bundle index, bundle, RDMA chunking or None, its load (plan, manifest) or why not, whether
    it is the bundle's first run) per run: a proxy bundle once per --rdma-chunks chunking."""
    for bi, bundle in enumerate(args.bundles):
        try:
            loaded: object = load_bundle(bundle)
        except Exception as e:  # noqa: BLE001
            loaded = f"cannot load: {type(e).__name__}: {e}"
        proxy = not isinstance(loaded, str) and loaded[1].get("options", {}).get("rdma") == "proxy"
        if args.rdma_chunks and not proxy and not isinstance(loaded, str):
            say(f"note: {Path(bundle).name} was not compiled with --rdma proxy: it runs once, at its own chunking")
        for i, c in enumerate(args.rdma_chunks if proxy and args.rdma_chunks else [None]):
            yield bi, bundle, c, loaded, i == 0


def write_report(args, report: dict, t_start: float) -> None:
    """Rank 0: OUT/ep_bench.json, then the table and the lines against `epcc simulate`."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report["wall_s"] = time.perf_counter() - t_start
    (out / "ep_bench.json").write_text(json.dumps(jsonable(report), indent=1), encoding="utf-8")
    print(f"\nwrote {out / 'ep_bench.json'} ({report['wall_s']:.0f} s)")
    print("GB/s per GPU: dedup = remote bytes, a token once per other rank holding one of its experts "
          "(the minimum any method moves); wire = remote bytes the method actually moves; DeepEP = "
          "recv tokens incl. self x hidden x 2 (fp8 x (1+4/128)/2)")
    if report.get("shared_gpus"):
        print(f"{report['shared_gpus']}: the times below are a correctness run's, not the plan's")
    print(format_table(report))
    for line in format_predictions(report):
        print(line)
