"""CUDA IPC domains: which ranks can map each other's GPU memory, and what a bundle's kernels
need mapped (no device here: the decisions only, so that they are tested on a CPU).

A CUDA IPC domain is a set of processes that can open each other's `cudaIpcMemHandle`s: one host
(one IPC namespace).  Each rank names its own (`local_domain`) and the engines all-gather the names
when a Buffer is made:

* default: the host, `socket.gethostname()` and, where readable, the kernel's boot id
  (/proc/sys/kernel/random/boot_id: two machines cloned with one hostname still differ);
* `EPCC_CUDA_IPC_DOMAIN` (ENV) overrides it, for containers on one host that do not share an IPC
  namespace (give each container its own name) or to run "several boxes" on one machine: the
  placeholders `{rank}` (the rank in the Buffer's group), `{local_rank}` (torchrun's LOCAL_RANK)
  and `{host}` (the default name) are expanded per process, so `EPCC_CUDA_IPC_DOMAIN='box{rank}'`
  puts every rank of one torchrun in a domain of its own, and `EPCC_CUDA_IPC_DOMAIN='{host}/c0'`
  marks one container of a host.

`ipc_peers` decides what a rank of a table-driven bundle maps (plan/peers.py: the ranks its
kernels reach over peer memory) and refuses, naming the ranks, the step and the fix, a bundle
whose kernels would need a mapping across domains; `one_domain` is the direct kernels' rule (every
rank maps every other).  When every rank is in one domain, every peer is mapped, as always.
"""

from __future__ import annotations

import os
import socket
import string

from ...plan.model import Plan
from ...plan.peers import peer_sets, step_peers
from .base import EngineError

ENV = "EPCC_CUDA_IPC_DOMAIN"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
PLACEHOLDERS = ("rank", "local_rank", "host")


def host_domain() -> str:
    """This host's name, with its boot id where the kernel gives it."""
    name = socket.gethostname()
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{name}/{boot}" if boot else name


def local_domain(rank: int, environ=None) -> str:
    """This process's CUDA IPC domain: ENV expanded (module docstring), or the host's.
    EngineError names the variable where it is malformed."""
    env = os.environ if environ is None else environ
    text = env.get(ENV, "")
    if not text.strip():
        return host_domain()
    values = {"rank": str(rank), "host": None, "local_rank": env.get("LOCAL_RANK")}
    out = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise EngineError(f"{ENV}={text!r}: {e} (write {{{{ and }}}} for literal braces)") from None
    for literal, field, spec, conv in parsed:
        out.append(literal)
        if field is None:
            continue
        if field not in PLACEHOLDERS:
            raise EngineError(f"{ENV}={text!r}: unknown placeholder {{{field}}} (one of "
                              f"{', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
        if spec or conv:
            raise EngineError(f"{ENV}={text!r}: a placeholder takes no conversion or format (write {{{field}}})")
        if field == "host":
            values["host"] = values["host"] or host_domain()
        if values[field] is None:
            raise EngineError(f"{ENV}={text!r}: {{local_rank}} needs LOCAL_RANK in the environment (torchrun "
                              f"sets it)")
        out.append(values[field])
    return "".join(out)


def _apart(domains: list[str], ranks=None) -> tuple[int, int] | None:
    """Two ranks (of `ranks`, default all) in different domains, the first found, or None."""
    ranks = list(range(len(domains))) if ranks is None else sorted(ranks)
    for r in ranks[1:]:
        if domains[r] != domains[ranks[0]]:
            return ranks[0], r
    return None


def _where(a: int, b: int, domains: list[str]) -> str:
    return f"rank {a} (CUDA IPC domain '{domains[a]}') and rank {b} ('{domains[b]}')"


def one_domain(domains: list[str], what: str) -> None:
    """EngineError unless every rank is in one domain (`what`: whose rule it is, for the message)."""
    pair = _apart(domains)
    if pair:
        raise EngineError(f"{what} map every peer's memory over CUDA IPC, so every rank must be in one CUDA IPC "
                          f"domain, but {_where(*pair, domains)} are not: run on one host (or one IPC namespace), or "
                          f"compile a plan that is not one-hop (the table-driven kernels run across domains: "
                          f"docs/cuda.md); {ENV} names a process's domain")


def proxied_steps(manifest: dict) -> set[tuple[str, str]]:
    """The (program, step) pairs the bundle's kernels hand to the GPU proxy path (`--rdma proxy`)."""
    return {(k["program"], r["step"]) for k in manifest["kernels"] if k.get("kind") == "main"
            for r in k["roles"] if r.get("lowered") in ("rdma-pack", "rdma-unpack")}


def off_peer_memory(manifest: dict) -> set[tuple[str, str]]:
    """The (program, step) pairs whose rows the bundle's kernels do not move over peer memory:
    the GPU proxy path's, and RDMA steps the kernels leave to a proxy outside them (the manifest's
    `not_lowered`, kind rdma)."""
    return proxied_steps(manifest) | {(n["program"], n["step"]) for n in manifest.get("not_lowered", ())
                                      if n.get("kind") == "rdma"}


def ipc_peers(plan: Plan, manifest: dict, transport: str, domains: list[str], rank: int) -> frozenset[int]:
    """The ranks (not `rank` itself) whose buffers and flag area rank `rank` of a table-driven
    bundle maps over CUDA IPC, given every rank's domain and the proxy path's transport: every
    other rank when all are in one domain (as always); else the ranks its kernels reach over peer
    memory (plan/peers.py), after checking that none of what the bundle needs mapped crosses a
    domain (EngineError naming two ranks, the step and its .sched line, and the fix)."""
    R = plan.num_ranks
    if len(domains) != R:
        raise EngineError(f"{len(domains)} ranks in the group, the bundle's plan has {R}")
    if _apart(domains) is None:
        return frozenset(r for r in range(R) if r != rank)
    source = manifest.get("source") or plan.schedule
    meta = manifest.get("metadata", {})
    if meta.get("lowering") == "device" and meta.get("exchange", "ipc") != "collective":
        a, b = _apart(domains)
        raise EngineError(f"the bundle's metadata kernels exchange the routing over CUDA IPC (metadata exchange "
                          f"'ipc': every rank writes into every peer's gather area), but {_where(a, b, domains)} "
                          f"are in different CUDA IPC domains: recompile {source} with `--metadata-exchange "
                          f"collective` (the process group's all-gather carries the routing)")
    proxied = proxied_steps(manifest)
    apart = off_peer_memory(manifest)
    if proxied and transport == "emulated":
        far = {(s.program, s.name): s for s in plan.steps if (s.program, s.name) in proxied}
        for (p, name), s in far.items():
            for f in s.flows:
                if domains[f.src] != domains[f.dst]:
                    raise EngineError(f"{p} step '{name}' ({source}:{s.line}) goes from rank {f.src} to rank {f.dst} "
                                      f"over the GPU proxy path, whose 'emulated' transport copies peer to peer over "
                                      f"CUDA IPC, but {_where(f.src, f.dst, domains)} are in different CUDA IPC "
                                      f"domains: use the transport nvshmem (Buffer config rdma_transport='nvshmem')")
        a, b = _apart(domains)
        raise EngineError(f"the GPU proxy path's 'emulated' transport maps every rank's landing slots over CUDA IPC, "
                          f"but {_where(a, b, domains)} are in different CUDA IPC domains: use the transport "
                          f"nvshmem (Buffer config rdma_transport='nvshmem')")
    steps = {(s.program, s.name): s for s in plan.steps}
    for (a, b), key in sorted(step_peers(plan, apart).items()):
        if domains[a] != domains[b]:
            s = steps[key]
            rdma = s.link_kind == "rdma"
            fix = ("compile it with `--rdma proxy` (the GPU proxy path carries RDMA steps: run it with the nvshmem "
                   "transport)" if rdma else
                   "run the ranks that step connects in one domain, or carry the step over an RDMA link compiled "
                   "with `--rdma proxy`")
            raise EngineError(f"{key[0]} step '{key[1]}' ({source}:{s.line}) moves rows between {_where(a, b, domains)} "
                              f"over peer memory, but they are in different CUDA IPC domains: {fix}")
    return peer_sets(plan, apart)[rank]


__all__ = ["ENV", "host_domain", "ipc_peers", "local_domain", "off_peer_memory", "one_domain", "proxied_steps"]
