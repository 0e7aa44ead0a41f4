"""The process per rank that runs epcc (or DeepEP) on one bundle.

Each has its own CUDA context and its own NCCL and gloo groups over a fresh TCP store: a kernel
that gives up waiting traps and loses the CUDA context, and the child takes that loss with it,
while the baselines and the next bundles go on.  Its answer (one dict per rank) comes back
through a pipe within --child-timeout; a child that does not answer is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

from . import NO_MULTICAST, deepep, epcc
from .timing import PG_TIMEOUT, Comm, Timer

RUNNERS = {"epcc": epcc.run, "deepep": deepep.run}  # cfg["method"] -> run(cfg, comm, timer) -> {"methods": ...}


def child_main(cfg: dict, conn) -> None:
    """One rank's run, in its own process.  Sends one dict back through `conn`; exits hard after a
    failure (a trapped kernel leaves a dead CUDA context that must not be torn down politely)."""
    res: dict = {"rank": cfg["rank"]}
    failed = False
    try:
        res.update(_run(cfg))
        failed = bool(res.get("failed"))
    except Exception as e:  # noqa: BLE001 - the setup failed (groups, bundle): this rank's answer says why
        failed = True
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    try:
        conn.send(res)
        conn.close()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if failed:
            os._exit(1)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _run(cfg: dict) -> dict:
    os.environ.update(NO_MULTICAST)
    dry, rank, world = cfg["dry_run"], cfg["rank"], cfg["world"]
    # Our own store, served by rank 0's child (an init_method URL would, under torchrun's
    # TORCHELASTIC_USE_AGENT_STORE, expect the agent to serve it, and wait forever).
    store = dist.TCPStore(cfg["addr"], cfg["port"], world, is_master=rank == 0, timeout=PG_TIMEOUT)
    if dry:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
        cpu_group = dist.group.WORLD
    else:
        dev = torch.device("cuda", cfg["local_rank"])
        torch.cuda.set_device(dev)
        if cfg["shared"]:  # ranks share GPUs: no NCCL (one GPU per rank); the bundle's own paths need none
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT)
            cpu_group = dist.group.WORLD
        else:
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=PG_TIMEOUT,
                                    device_id=dev)
            cpu_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    comm = Comm(dry, dev, cpu_group, cfg["shared"])
    return RUNNERS[cfg["method"]](cfg, comm, Timer(comm, cfg["flush"]))


def free_port() -> int:
    s = socket.socket()
    s.bind(("", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def run_child(comm: Comm, args, cfg: dict) -> dict:
    """Start this rank's child for `cfg` (method, bundle, ...; the run's settings are added from
    `args`), wait for its answer (bounded by --child-timeout)."""
    port = comm.all_gather_object(free_port() if comm.rank == 0 else None)[0]
    cfg = {**cfg, "rank": comm.rank, "world": comm.world,
           "local_rank": comm.dev.index if comm.dev.type == "cuda" else 0,
           "addr": os.environ.get("MASTER_ADDR", "127.0.0.1"), "port": port, "seed": args.seed,
           "warmup": args.warmup, "iters": args.iters, "kernel_timeout": args.kernel_timeout,
           "dry_run": args.dry_run, "shared": comm.shared, "flush": not args.no_flush,
           "emulate_max_tokens": args.emulate_max_tokens, "rdma_transport": args.rdma_transport,
           "deepep_sms": args.deepep_sms, "graph": args.epcc_graph}
    ctx = mp.get_context("spawn")
    rd, wr = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child_main, args=(cfg, wr), daemon=True)
    p.start()
    wr.close()
    res, deadline = None, time.monotonic() + args.child_timeout
    while time.monotonic() < deadline:
        if rd.poll(0.5):
            try:
                res = rd.recv()
            except EOFError:
                res = None
            break
        if not p.is_alive():
            if rd.poll(0.5):
                res = rd.recv()
            break
    if res is None:
        if p.is_alive():
            p.kill()  # our own child, by its handle
            res = {"error": f"no answer from the {cfg['method']} process within {args.child_timeout:.0f} s (killed)"}
        else:
            res = {"error": f"the {cfg['method']} process exited with code {p.exitcode} without an answer"}
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)
    rd.close()
    if "traceback" in res:
        sys.stderr.write(f"[rank {comm.rank}] {cfg['method']}: {res['error']}\n{res['traceback']}")
    return res


def per_method(gathered: list[dict], default: str) -> dict[str, list[dict]]:
    """Every rank's answer (run_child) as {method: [per-rank result]}: the rows any rank ran, in
    the order it ran them; a rank without a row gives its error (or `default`'s row its own)."""
    names: list[str] = []
    for res in gathered:
        names += [m for m in res.get("methods", {}) if m not in names]
    out = {}
    for m in names or [default]:
        out[m] = [res.get("methods", {}).get(m) or {"error": res.get("error") or "no result from this rank"}
                  for res in gathered]
    return out
