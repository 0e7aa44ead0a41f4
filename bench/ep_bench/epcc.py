"""epcc, through its public API only: `Buffer(group, bundle, backend="cuda", timeout_s=...,
config=...)` (`backend="cpu"` in a dry run), in a child process per rank (child.py).

Rows of the report:

* epcc: dispatch with the routing given afresh every iteration, as a MoE layer calls it, then
  combine of the expert outputs.  With --epcc-sms N the direct kernels run on N SMs each
  (rows epcc@N, epcc_cached@N).  Token-major bundles (`layout token`) are checked against the
  token-major oracle (data.token_data).  Bundles with the direct lowering (one-hop plans):
  `dispatch(x, idx, w, sync=False)` (metadata on the GPU, no host sync: what a training step or a
  CUDA graph runs), and likewise table-driven bundles whose tables the GPU writes (the manifest's
  metadata "device", GPU proxy path included).  Other table-driven bundles: `dispatch(x, idx, w)`,
  in which the engine all-gathers the routing, computes the layout on the host, uploads its tables
  and runs the kernels: the time includes that host work.
* epcc_graph (--epcc-graph; bundles with the low-latency mode): the fresh row's dispatch and its
  combine, each captured once per input set as a CUDA graph and replayed (the routing's metadata
  recomputed by every replay): the GPU's time without the host's launch work.
* epcc_cached (direct bundles): `dispatch(x, handle=h, sync=False)` of one earlier dispatch, whose
  metadata the GPU still holds: the dispatch launches no metadata kernel (DeepEP's cached mode).
* epcc_cached (table-driven bundles): `dispatch(x, handle=h)`, the layout and tables of one earlier
  dispatch reused: the kernels alone (with the engine's copies of x into its input buffer and of
  recv_x out of its output buffer), which is what `epcc simulate` predicts.  The role timeline
  (median of TIMELINE_ROUNDS stamped rounds) and the proxy path's counters are taken after it.

`host_ms` of a table-driven bundle: the host functions the engine runs per fresh routing
(compute_layout, build_tables of each program), timed here on the run's routing.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from epcc.runtime.buffer import Buffer
from epcc.runtime.engines.base import EngineError, KernelTimeout
from epcc.runtime.engines.cuda_table.launcher import median_timeline
from epcc.runtime.engines.cuda_table.tables import build_tables, partial_rounding
from epcc.runtime.layout import compute_layout

from .data import (CheckFailed, RankData, as_rows, as_x, bench_routing, check_combine, check_rows, load_bundle,
                   make_data, traffic)
from .predict import rechunk
from .timing import Comm, PeerFailed, Timer, run_iterations, stop_rows

TIMELINE_ROUNDS = 5  # stamped rounds after the timed ones; the role timeline is their median
NO_CACHED_ON_CPU = "dry run: the cpu backend has no cached-handle dispatch (the cuda backend's table-driven engine has)"


def run(cfg: dict, comm: Comm, timer: Timer) -> dict:
    """This rank's epcc rows of one bundle: {"methods": {row: result}}, and "failed" where a
    kernel, the engine or a peer failed (the rows not yet run are left out; the CUDA context may
    be gone, so the process must exit without tearing it down)."""
    plan, manifest = load_bundle(cfg["bundle"])
    chunking = cfg.get("rdma_chunking")
    if chunking:
        plan = rechunk(plan, chunking)  # what the Buffer below runs, for the host timing and the byte counts
    rank, T, dry = comm.rank, cfg["tokens"], cfg["dry_run"]
    table = "direct" not in manifest  # the table-driven kernels (a dry run runs either kind on the CPU)
    direct = not table and not dry
    idx, w = bench_routing(plan, T, cfg["seed"])
    host = host_layout_ms(plan, manifest, idx, w, rank) if table else None
    out: dict = {"methods": {}}
    if dry and plan.num_ranks * T > cfg["emulate_max_tokens"]:
        out["methods"]["epcc"] = {"host_ms": host, "skipped": (
            f"dry run: {plan.num_ranks * T} tokens > {cfg['emulate_max_tokens']}: not run on the CPU"
            + (f" (layout + tables built, {host['layout_tables']:.1f} ms)" if host else ""))}
        return out
    data = make_data(comm, plan, T, idx, w, cfg["seed"])
    buf, row = None, "epcc"
    sms = cfg.get("sms") if direct else None  # --epcc-sms: the direct kernels on that many SMs
    at = f"@{sms}" if sms else ""
    try:
        config = {"send_blocks": sms, "recv_blocks": 0, "combine_send_blocks": sms, "combine_reduce_blocks": 0} \
            if sms else None
        buf = Buffer(dist.group.WORLD, cfg["bundle"], backend="cpu" if dry else "cuda",
                     timeout_s=cfg["kernel_timeout"],
                     config=config if dry or direct else {"rdma_transport": cfg["rdma_transport"]},
                     rdma_chunk_tokens=chunking[0] if chunking else None, rdma_depth=chunking[1] if chunking else None)
        rows = EpccRows(cfg, comm, timer, buf, plan, manifest, data, idx, direct)
        todo = [("epcc" + at, rows.fresh)] + ([("epcc_cached" + at, rows.cached)] if not dry else [])
        if cfg.get("graph") and rows.lowlat and not dry:
            todo.append(("epcc_graph" + at, rows.graph))
        for row, fn in todo:
            try:
                out["methods"][row] = fn()
            except CheckFailed as e:  # agreed by every rank (run_iterations): the next row still runs
                out["methods"][row] = {"error": f"WRONG: {e}"}
        if host is not None:
            out["methods"]["epcc"]["host_ms"] = host
        if dry and table:
            out["methods"]["epcc_cached"] = {"skipped": NO_CACHED_ON_CPU}
        comm.barrier()
        buf.close()
    except Exception as e:  # noqa: BLE001 - a kernel, the engine, the setup or a peer: stop
        stop_rows(out, comm, row, e, failure_detail(buf, e))
    return out


class EpccRows:
    """The timed rows of one bundle on one Buffer."""

    def __init__(self, cfg: dict, comm: Comm, timer: Timer, buf: Buffer, plan, manifest: dict, data: RankData,
                 idx: np.ndarray, direct: bool):
        self.cfg, self.comm, self.timer, self.buf, self.plan, self.manifest, self.d = \
            cfg, comm, timer, buf, plan, manifest, data
        wl = plan.workload
        self.direct = direct  # the direct kernels (else the table-driven ones, or the cpu backend)
        # the low-latency mode (no host sync in dispatch): the direct kernels, and the table-driven
        # ones whose tables the GPU writes (the bundle's metadata "device")
        self.lowlat = direct or bool(getattr(buf.engine, "on_device", False))
        self.idx_all = idx
        self.xs = [as_x(r, wl.hidden, wl.dtype) for r in data.x_sets]
        self.n = data.src.shape[0]  # the rows this rank receives
        self.rounding = 0.0 if self.direct else partial_rounding(manifest)
        self.ys = data.y_sets
        self.last = None  # the handle of the last dispatch
        if self.lowlat:  # sync=False combines the whole receive buffer: the expert outputs padded to it
            cap = self._capacity()
            self.ys = [torch.cat([y, torch.zeros((cap - self.n, wl.hidden), dtype=y.dtype, device=y.device)])
                       for y in data.y_sets]
        if self.direct:
            eng = buf.engine
            self.common = {"lowering": "direct", "config": dict(vars(eng.config)),
                           "sms": {"dispatch": eng.config.dispatch_sms, "combine": eng.config.combine_sms},
                           "wire_bytes": {op: t["remote_dedup"] for op, t in  # one row per (token, GPU)
                                          traffic(idx, wl.experts, wl.placement, wl.hidden, data.x_sets[0].shape[1],
                                                  wl.dtype).items()}}
        else:
            self.common = {"sms": kernel_sms(manifest)}
            reads = getattr(buf.engine, "caller_rows", None)  # the table engine: the programs that read the
            if isinstance(reads, dict):                        # caller's rows in place (bench/sim_check.py)
                self.common["caller_rows"] = sorted(p for p, ok in reads.items() if ok)
                # and whether the combine's partials are cleared beside the dispatch kernel
                self.common["zero_beside"] = getattr(buf.engine, "zero_stream", None) is not None
                # and whether the combine kernel writes the bf16 tokens itself (no finish kernel)
                self.common["convert_in_kernel"] = bool(getattr(buf.engine, "convert_in_kernel", False))
        self.comm.barrier()

    def _capacity(self) -> int:
        """Rows of the direct engine's receive buffer (what a sync=False dispatch returns), from one
        untimed dispatch."""
        rx = self._fresh(0)[0]
        self.buf.synchronize()
        return (rx[0] if isinstance(rx, tuple) else rx).shape[0]

    def _iterate(self, dispatch, combine=None) -> dict:
        """Warm-up, check, timed iterations of `dispatch(set)` and of `combine(set, handle)` (default:
        the Buffer's combine of the set's expert outputs with the dispatch's handle)."""
        d, timer, buf = self.d, self.timer, self.buf
        combine = combine or (lambda s, h: buf.combine(self.ys[s], h))

        def step(s, phase):
            td, res = timer.time(lambda: dispatch(s), after=buf.synchronize)
            self.last = res[4]
            got = (as_rows(res[0], self.n), res[1]) if phase == "check" else None
            tc, comb = timer.time(lambda: combine(s, self.last), after=buf.synchronize)
            return td, tc, (got, comb if phase == "check" else None)

        def check(outs):
            (rows, experts), comb = outs
            check_rows(rows, d.want_rows, "epcc dispatch")
            if d.want_idx is not None:  # token-major: every row's top-k (local ids, -1 elsewhere)
                if experts is None or not torch.equal(experts[: self.n].to(d.want_idx.device), d.want_idx):
                    raise CheckFailed("epcc dispatch: recv_topk_idx differs from the oracle's local experts of its rows")
            elif experts is not None and not torch.equal(experts.to(d.src.device), d.src[:, 2]):
                raise CheckFailed("epcc dispatch: recv_topk_idx differs from the oracle's experts of its rows")
            return check_combine(comb, d.ref, d.mag, self.plan.workload.topk, "epcc combine", self.rounding)

        res = run_iterations(timer, self.cfg["warmup"], self.cfg["iters"], step, check)
        return {**self.common, **res, **self._layout_facts()}

    def _layout_facts(self) -> dict:
        """What the layout the engine ran tells (table-driven and cpu: the handle carries it): the
        bytes it moved across, the largest chunk of each RDMA step this rank sends."""
        layout = getattr(self.last, "layout", None)
        if layout is None and not self.direct and self.lowlat:  # the GPU laid it out: the host's, for the bytes
            layout = compute_layout(self.plan, self.idx_all, None)
        if layout is None:
            return {}
        rank = self.comm.rank
        return {"wire_bytes": epcc_wire_bytes(layout), "rdma_chunk_rows": {
            f"{s.program}.{s.name}": max((int(np.diff(c.chunk_starts).max(initial=0)) for c in layout.copies
                                          if (c.program, c.step) == (s.program, s.name) and c.rank == rank), default=0)
            for s in self.plan.steps if s.link_kind == "rdma"}}

    def _fresh(self, s: int):
        d = self.d
        if self.lowlat:
            return self.buf.dispatch(self.xs[s], d.topk, d.weights, sync=False)
        return self.buf.dispatch(self.xs[s], d.topk, d.weights)

    def fresh(self) -> dict:
        out = self._iterate(self._fresh)
        if self.direct:  # one more (untimed) round with the kernels' per-block / per-warp stamps: when each role ran
            eng = self.buf.engine
            eng.enable_timeline()
            self.comm.barrier()
            self._round(self._fresh, 0)
            out["timeline"] = eng.read_timeline()
            eng.enable_timeline(False)
        return out

    def cached(self) -> dict:
        d = self.d
        sync = not self.lowlat  # the same mode as the fresh row (the combine's rows are shaped by it)
        first = self.buf.dispatch(self.xs[0], d.topk, d.weights, sync=sync)[4]  # the layout and tables, once

        def dispatch(s: int):
            return self.buf.dispatch(self.xs[s], handle=first, sync=sync)

        out = self._iterate(dispatch)
        if self.direct:  # the direct kernels: no metadata kernel for the last metadata's handle
            return out
        # TIMELINE_ROUNDS more (untimed) rounds with the kernels' per-block stamps: when each role
        # ran, the median over the rounds
        eng = self.buf.engine
        eng.enable_timeline()
        rounds = []
        for i in range(TIMELINE_ROUNDS):
            self.comm.barrier()
            self._round(dispatch, i % 2)
            rounds.append(eng.read_timeline())
        out["timeline"] = {p: median_timeline([r[p] for r in rounds]) for p in rounds[0]}
        out["rdma"] = eng.rdma_summary()  # the GPU proxy path: which transport, what rings
        out["rdma_stats"] = eng.rdma_stats()  # and what its proxy thread cost
        return out

    def graph(self) -> dict:
        """Dispatch (low latency, the routing given as for the fresh row) and combine, each captured
        once per input set as a CUDA graph and replayed: the GPU's time without the host's launch
        work (what a CUDA-graph-captured MoE layer pays).  The captured outputs are the replays'."""
        buf, graphs = self.buf, {}
        for s in (0, 1):
            self._fresh(s)  # warm-up outside the capture (first launches, lazily built state)
            buf.synchronize()
            gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(gd):
                res = self._fresh(s)
            with torch.cuda.graph(gc):
                out = buf.combine(self.ys[s], res[4])
            graphs[s] = (gd, gc, res, out)
        buf.synchronize()

        def dispatch(s: int):
            graphs[s][0].replay()
            return graphs[s][2]

        def combine(s: int, _handle):
            graphs[s][1].replay()
            return graphs[s][3]

        return self._iterate(dispatch, combine)

    def _round(self, dispatch, s: int) -> None:
        """One untimed dispatch and combine (a stamped round)."""
        h = dispatch(s)[4]
        self.buf.combine(self.ys[s], h)
        self.buf.synchronize()


def failure_detail(buf: Buffer | None, e: Exception) -> str:
    """The report of what failed: an engine's error carries its kernel's or proxy's report; a CUDA
    error from torch (the context is gone) is followed by the engine's own error record."""
    if isinstance(e, (EngineError, KernelTimeout, PeerFailed)):
        return str(e)
    if buf is not None:
        try:
            buf.synchronize()
        except Exception as report:  # noqa: BLE001 - the engine's reading of the failure, where it has one
            if isinstance(report, (EngineError, KernelTimeout)):
                return str(report)
    return f"{type(e).__name__}: {e}"


def host_layout_ms(plan, manifest: dict, idx: np.ndarray, w: np.ndarray, rank: int) -> dict:
    """Milliseconds of the host work a table-driven engine does per fresh routing on this rank:
    the layout of every rank's routing, this rank's tables of each program."""
    t0 = time.perf_counter()
    layout = compute_layout(plan, idx, w)
    t1 = time.perf_counter()
    for p in kernel_sms(manifest):
        build_tables(manifest, layout, p, rank)
    t2 = time.perf_counter()
    return {"layout": (t1 - t0) * 1e3, "tables": (t2 - t1) * 1e3, "layout_tables": (t2 - t0) * 1e3}


def kernel_sms(manifest: dict) -> dict:
    """SMs of each program's persistent kernel: the sum of its roles' block ranges (one block per
    SM; = the cooperative grid).  Combine's short bf16 conversion kernel (grid 2 x SMs) is extra."""
    out = {}
    for k in manifest.get("kernels", []):
        if k.get("kind") == "main":
            roles = k.get("roles") or []
            out[k["program"]] = sum(r["blocks"][1] - r["blocks"][0] for r in roles) if roles else k["grid"]
    return out


def epcc_wire_bytes(layout) -> dict:
    """Bytes each rank receives from other ranks as the tables move them: dispatch row_bytes per
    (token, expert) row copied across; combine's weighted adds land as fp32 (4 x hidden per row)
    when the expert rank pushes them, bf16 rows (2 x hidden) when the home rank pulls."""
    R = layout.num_ranks
    out = {"dispatch": [0] * R, "combine": [0] * R}
    for c in layout.copies:
        if c.src == c.dst:
            continue
        n = len(c.dst_slots)
        if c.program == "dispatch":
            out["dispatch"][c.dst] += n * layout.row_bytes
        else:
            out["combine"][c.dst] += n * layout.hidden * (4 if c.rank != c.dst else 2)
    return out
