"""GPU check of the GPU proxy path (bundles compiled with `--rdma proxy`) through
`Buffer(backend="cuda")` with the tables written on the GPU; one process per rank:

    torchrun --nproc-per-node 2 tests/gpu/proxy_worker.py emulated .gpu/bundles/h200x2_2vnode_50_proxy ...

The first argument is the proxy's transport (emulated or nvshmem), then the bundles.  Per bundle:

* its metadata is the GPU's (the manifest says "device"), the proxy path is set up once: the same
  proxy engines serve every call and no layout is ever computed on the host;
* fresh routing on every call, the way a MoE layer calls it (uniform, Zipf, masked slots with
  tokens of no expert, all to one rank, none across the RDMA link, none at all), each in normal
  mode (sync=True) and in low-latency mode (sync=False: no host sync in the calls; the worker
  waits with synchronize() before it reads, as docs/rdma.md asks), dispatch and combine
  checked against the oracle (ep_worker.Case: rows bit-exact, counts, weights, combine within the
  bf16 rounding of the partials);
* ranks with different token counts (T / T-1 / 0 / T/2+1 rotated over the ranks, and T-1-7r),
  both modes, fresh routing each;
* a CUDA graph of dispatch (low latency) + combine captured once and replayed on fresh routings,
  with even and with uneven token counts;
* the chunks went through the proxy: every program's transport posted writes during a uniform
  round, and no proxy reports a failure;
* the CUDA IPC mappings (runtime/engines/ipc_domain.py): no rank maps a peer of another domain
  (EPCC_CUDA_IPC_DOMAIN, e.g. `box{rank}`: every rank a box of its own), and the line reports how
  many mappings all ranks opened (test_gpu.py expects none for a proxy bundle whose every rank is
  its own box).

Kernel waits give up after EPCC_GPU_KERNEL_TIMEOUT seconds (default 30: ranks time-sliced on a
shared GPU are slow, a correct round still takes milliseconds): a chunk nobody posts fails with the
kernel's report, it is not waited out.  Prints one line per check on rank 0 and exits 1 if any
rank failed (ep_worker.py's verdicts and summary).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ep_worker import Case, Checks, graph_checks, main
from epcc.runtime.buffer import Buffer

KERNEL_TIMEOUT_S = float(os.environ.get("EPCC_GPU_KERNEL_TIMEOUT", "30"))
ROUTINGS = ("uniform", "zipf:1.2", "masked", "all-to-one", "no-remote", "empty")
ITERS = int(os.environ.get("EPCC_GPU_ITERS", "2"))


def token_patterns(tmax: int, ranks: int) -> list[tuple[str, list[int]]]:
    """Per round the tokens of each rank: a pattern rotated over the ranks (every rotation), and
    DeepEP's T - 1 - 7r."""
    base = (tmax, tmax - 1, 0, tmax // 2 + 1)
    out = [("/".join(str(base[(r + k) % len(base)]) for r in range(ranks)),
            [base[(r + k) % len(base)] for r in range(ranks)]) for k in range(len(base))]
    return out + [("T-1-7r", [max(0, tmax - 1 - 7 * r) for r in range(ranks)])]


def setup_errors(buf: Buffer) -> list[str]:
    """What says the Buffer does not run the proxy path from the GPU's tables."""
    eng = buf.engine
    errs = []
    if eng.manifest.get("metadata", {}).get("lowering") != "device" or not eng.on_device:
        errs.append(f"metadata is not the GPU's: {eng.manifest.get('metadata')}")
    if not eng.proxy or not eng.rdma:
        errs.append("the bundle does not run the GPU proxy path (compile it with --rdma proxy)")
    return errs


def ipc_check(buf: Buffer, checks: Checks) -> tuple[str, list[str]]:
    """The CUDA IPC mappings the Buffer opened (runtime/engines/ipc_domain.py): the line to report
    (mappings summed over every rank, and how many domains the ranks are in) and what is wrong on
    this rank (a peer of another domain mapped, or a mapping with no peer to map)."""
    eng = buf.engine
    mine = eng.domains[eng.rank]
    errs = [f"maps rank {r}, of CUDA IPC domain '{eng.domains[r]}', from '{mine}'"
            for r in sorted(eng.ipc_peers) if eng.domains[r] != mine]
    if not eng.ipc_peers and eng.opened:
        errs.append(f"{len(eng.opened)} CUDA IPC mapping(s) opened with no peer to map")
    total = torch.tensor([len(eng.opened)], device=checks.dev)
    dist.all_reduce(total)
    return f"CUDA IPC: {int(total.item())} mappings opened on all ranks, {len(set(eng.domains))} domain(s)", errs


def proxy_state_errors(buf: Buffer, engines: list, posted: dict | None = None) -> list[str]:
    """The proxy engines set up at construction still serve (none made anew), no layout was
    computed on the host, no proxy failed; with `posted` (writes per program before the round),
    every program's transport posted more since."""
    eng = buf.engine
    errs = []
    if [id(e) for e in eng.rdma] != [id(e) for e in engines]:
        errs.append("the proxy path was set up anew (it must be set up once, for every routing)")
    if eng.layout is not None:
        errs.append("a layout was computed on the host")
    errs += [f"proxy {e.program}: {e.failure()}" for e in eng.rdma if e.failure()]
    if posted is not None:
        dist.barrier()  # every rank's kernels landed what this rank's proxy sent: it has posted all of it
        now = {p: st["writes_posted"] for p, st in eng.rdma_stats().items()}
        errs += [f"{p}: the proxy posted no chunk ({now[p]} writes, {posted[p]} before)"
                 for p in now if now[p] <= posted[p]]
    return errs


def round_trip(buf: Buffer, case: Case, sync: bool) -> list[str]:
    """Dispatch and combine `case` in one mode, checked against the oracle.  In low-latency mode
    the host waits with `synchronize()` (watched, an event polled) before it reads anything: a
    host thread blocked in a CUDA call while the path's kernels run stalls the proxy threads' CUDA
    calls (docs/rdma.md), which the normal mode's own waits avoid."""
    x, idx, w = case.gpu_inputs()
    rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
    if not sync:
        buf.synchronize()
    errs = case.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx if sync else None)
    out = buf.combine(case.y_for(rx, h.rows), h)
    buf.synchronize()
    return errs + case.check_combine(out)


def run_proxy(path: Path, dev, checks: Checks, transport: str) -> None:
    buf = Buffer(dist.group.WORLD, path, backend="cuda", timeout_s=KERNEL_TIMEOUT_S,
                 config={"rdma_transport": transport})
    try:
        _proxy_checks(buf, path, dev, checks, transport)
    except Exception:
        # every rank's proxies as they stand (the error names one rank's wait): which FIFO still
        # owed chunks (head past retired), what each transport posted and completed
        for e in getattr(buf.engine, "rdma", None) or []:
            print(f"rank {buf.rank} after dispatch #{buf.engine.dispatches}: {e.state()}", file=sys.stderr, flush=True)
        raise


def _proxy_checks(buf: Buffer, path: Path, dev, checks: Checks, transport: str) -> None:
    name = f"{path.name}/{transport}"

    def report(what: str, errs: list[str]) -> None:
        checks.report(buf, name, what, errs)

    report("tables from the GPU, proxy path set up once", setup_errors(buf))
    report(*ipc_check(buf, checks))
    engines = list(buf.engine.rdma)
    R, tmax = buf.num_ranks, buf.plan.workload.tokens
    for k, spec in enumerate(ROUTINGS):
        for it in range(ITERS):
            for sync in (True, False):
                case = Case(buf, spec, 1000 * it + 97 * k + (0 if sync else 500), dev)  # fresh routing each call
                posted = {p: st["writes_posted"] for p, st in buf.engine.rdma_stats().items()}
                errs = round_trip(buf, case, sync)
                errs += proxy_state_errors(buf, engines, posted if spec == "uniform" else None)
                report(f"{spec} #{it} {'sync' if sync else 'low-latency'}", errs)
    for k, (label, tokens) in enumerate(token_patterns(tmax, R)):
        for sync in (True, False):
            case = Case(buf, "uniform", 3000 + 10 * k + sync, dev, tokens=tokens)
            errs = round_trip(buf, case, sync)
            report(f"tokens {label} {'sync' if sync else 'low-latency'}", errs + proxy_state_errors(buf, engines))
    for label, tokens in (("T", None), *token_patterns(tmax, R)[:1]):
        graph_checks(buf, Case(buf, "uniform", 4000, dev, tokens=tokens),
                     [lambda i=i: Case(buf, ("zipf:1.2", "masked", "uniform")[i], 4100 + i, dev, tokens=tokens)
                      for i in range(3)], dev, report, f"cuda graph replay, tokens {label}")
    buf.synchronize()
    report("after the graphs", proxy_state_errors(buf, engines))
    dist.barrier()
    buf.close()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("emulated", "nvshmem"):
        print("usage: proxy_worker.py emulated|nvshmem BUNDLE...", file=sys.stderr)
        sys.exit(2)
    chosen = sys.argv[1]
    sys.exit(main(sys.argv[2:], run=lambda path, dev, checks: run_proxy(path, dev, checks, chosen)))
