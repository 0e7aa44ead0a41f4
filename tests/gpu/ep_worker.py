"""GPU check of `Buffer(backend="cuda")` against the NumPy oracle; one process per GPU:

    torchrun --nproc-per-node 4 tests/gpu/ep_worker.py .gpu/bundles/h200x4 .gpu/bundles/h200x4_fp8 ...

For every bundle (its rank count must equal the world size) and routing (uniform, zipf:1.2,
all-to-one, no-remote, empty), twice with different seeds (repeated calls on one Buffer):
normal mode (sync=True: rows bit-exact, recv_topk_idx, weights and per-expert counts equal the
oracle's), combine (bf16; oracle tolerance plus the bf16 rounding of the per-GPU partials), the
low-latency mode (sync=False, whole receive buffer), a cached-handle dispatch (the handle's
routing reused), expert alignment 64, a CUDA graph of dispatch + combine captured once and
replayed on new inputs, and bad input (a repeated expert, wrong shapes) raising errors that name
the argument.  A decode-sized bundle (one metadata chunk, whose dispatch kernel counts the
metadata itself) runs again with 4-warp blocks, which launch the metadata kernel first.  Prints
one line per check on rank 0 and exits 1 if any rank failed.

A bundle of the GPU proxy path (`--rdma proxy`) runs the same checks, its low-latency results read
after `Buffer.synchronize()` as docs/rdma.md asks; $EPCC_GPU_RDMA_TRANSPORT picks its transport
(default emulated; nvshmem).

$EPCC_GPU_BACKEND picks the Buffer's backend (default cuda): `supa` runs SUPA bundles (`epcc compile
--target supa`) through the SUPA-on-CUDA shim, which EPCC_SUPA_SHIM=1 must select (test_gpu.py sets
both); their table-driven kernels get the same checks.

More ranks than GPUs (e.g. the EP4 bundles on a 2-GPU machine: `torchrun --nproc-per-node 4` with
two GPUs visible): rank r runs on GPU r mod #GPUs and the ranks of one GPU share it, their
kernels time-sliced by the driver (one context at a time), so a rank's bounded waits on a peer of
its own GPU last until the next time slice.  The results are checked exactly as with a GPU per
rank (they do not depend on timing); nothing here is a performance measurement.  NCCL refuses two
ranks on one GPU, so the process group is gloo then (only objects and flags cross it).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from epcc.runtime.testing import compare_torch, inputs, oracle
from epcc.runtime.testing.ranks import join_group
from epcc.plan.direct import META_CHUNK
from epcc.runtime.buffer import Buffer
from epcc.runtime.engines.cuda_table.placed import build_placed, placed_differences
from epcc.runtime.engines.cuda_table.tables import parse_tables
from epcc.runtime.engines.gpu_proxy.channels import item_sequences, role_items
from epcc.runtime.layout import compute_layout

ROUTINGS = tuple(os.environ.get("EPCC_GPU_ROUTINGS", "uniform,zipf:1.2,all-to-one,no-remote,empty").split(","))
ITERS = int(os.environ.get("EPCC_GPU_ITERS", "2"))
BACKEND = os.environ.get("EPCC_GPU_BACKEND", "cuda")  # cuda, or supa (SUPA bundles through the shim)
RDMA_TRANSPORT = os.environ.get("EPCC_GPU_RDMA_TRANSPORT", "")  # the GPU proxy path's transport (default: emulated)
PARTIAL_ROUNDING = 2.0 ** -8  # combine sends one bf16 partial per (token, GPU): unit roundoff of bf16


def routing_topk(spec: str, R: int, T: int, K: int, E: int, placement: str, seed: int) -> np.ndarray:
    if spec == "masked":  # uniform, a quarter of the slots -1 (empty), and every 7th token no expert at all
        out = inputs.make_topk("uniform", R, T, K, E, placement, seed=seed).topk_idx.copy()
        out[np.random.default_rng(seed).random(out.shape) < 0.25] = -1
        out[:, ::7] = -1
        return out
    if spec == "all-to-one":  # every token of every rank picks experts of rank 0 only
        epr = E // R
        rng = np.random.default_rng(seed)
        local = np.argsort(rng.random((R, T, epr)), axis=2)[:, :, : min(K, epr)]
        experts = local if placement == "blocked" else local * R
        out = np.full((R, T, K), -1, np.int64)
        out[:, :, : experts.shape[2]] = experts
        return out
    return inputs.make_topk(spec, R, T, K, E, placement, seed=seed).topk_idx


class HostCase(NamedTuple):
    """A Case's host side: the routing (tokens past a rank's count padded with -1), its weights,
    and what rank `me` receives in the oracle's order."""

    idx: np.ndarray  # int64 [R, T, K]
    w: np.ndarray  # float32 [R, T, K]
    src: np.ndarray  # int64 [n, 3] (home, token, expert) received by `me`
    rows_w: np.ndarray  # float32 [n]: their weights
    local: np.ndarray  # int64 [E]: local index of each expert on its rank
    counts: tuple[int, ...]  # rows per local expert on `me`


@functools.lru_cache(maxsize=64)
def host_case(spec: str, seed: int, R: int, T: int, K: int, E: int, placement: str, me: int,
              tokens: tuple[int, ...]) -> HostCase:
    """The host side of Case(spec, seed) on rank `me`, kept for the next bundle or launch
    configuration of the same workload that asks for it (tens of ms each, mostly drawing the
    routing; a worker asks for the same ones bundle after bundle).  Callers copy the arrays."""
    idx = routing_topk(spec, R, T, K, E, placement, seed)
    if tokens != (T,) * R:
        idx = idx.copy()
        for r, n in enumerate(tokens):
            idx[r, n:] = -1
    w = inputs.make_weights(idx, seed=seed + 1)
    src, j = oracle.rank_recv_order(idx, E, placement, me)
    rows_w = w[src[:, 0], src[:, 1], j].astype(np.float32) if len(src) else np.zeros(0, np.float32)
    _, local_of = oracle.expert_rank(E, R, placement)
    counts = np.bincount(local_of[src[:, 2]], minlength=E // R)
    return HostCase(idx, w, src, rows_w, local_of, tuple(int(c) for c in counts))


class Case:
    """One routing and payload, identical on every rank (seeded).  The expected rows come from the
    oracle's documented order (oracle.recv_order) gathered on the GPU; the expert outputs are a
    function of the received row and its expert, y = bf16(value(row) * (1 + l / 16)) with l the
    local expert index, so the home rank can form the combine reference from its own tokens:
    ref[t] = sum_j w[t, j] * y(x[t], e_j) in fp32.  `tokens` (one count per rank, at most the
    bundle's): rank r dispatches its first tokens[r] tokens only; the oracle sees the others as
    tokens with no expert (absent tokens receive nothing, and change no other token's rows)."""

    def __init__(self, buf: Buffer, spec: str, seed: int, dev, tokens: list[int] | None = None):
        wl = buf.plan.workload
        self.R, self.T, self.K, self.E, self.H = buf.num_ranks, wl.tokens, wl.topk, wl.experts, wl.hidden
        self.dtype, self.placement, self.me, self.dev = wl.dtype, wl.placement, buf.rank, dev
        # tokens each rank dispatches (the bundle's tokens by default): rows past a rank's count
        # pad the routing with -1 (no expert), so the oracle gives them no rows
        self.tokens = list(tokens) if tokens is not None else [self.T] * self.R
        host = host_case(spec, seed, self.R, self.T, self.K, self.E, self.placement, self.me, tuple(self.tokens))
        self.idx, self.w, self.src, self.rows_w, self.local = (a.copy() for a in host[:5])
        self.counts = list(host.counts)
        g = torch.Generator(device=dev)
        g.manual_seed(seed + 2)
        R, T, H = self.R, self.T, self.H
        if self.dtype == "fp8":
            q = torch.randint(0, 254, (R, T, H), generator=g, device=dev, dtype=torch.int32)
            q = torch.where(q >= 0x7F, q + 1, q).to(torch.uint8)  # never the NaN encodings 0x7f / 0xff
            sc = (torch.rand((R, T, H // 128), generator=g, device=dev) * 1.5 + 0.5) / 448.0
            self.x_all = (q.view(torch.float8_e4m3fn), sc)
        else:
            self.x_all = torch.randn((R, T, H), generator=g, device=dev).to(torch.bfloat16)
        h = torch.from_numpy(self.src[:, 0]).to(dev)
        t = torch.from_numpy(self.src[:, 1]).to(dev)
        if self.dtype == "fp8":
            self.want_rows = (self.x_all[0][h, t], self.x_all[1][h, t])
        else:
            self.want_rows = self.x_all[h, t]

    def gpu_inputs(self):
        me, n = self.me, self.tokens[self.me]
        x = (self.x_all[0][me][:n].contiguous(), self.x_all[1][me][:n].contiguous()) if self.dtype == "fp8" \
            else self.x_all[me][:n].contiguous()
        return x, torch.from_numpy(self.idx[me][:n].copy()).to(self.dev), \
            torch.from_numpy(self.w[me][:n].copy()).to(self.dev)

    def values(self, x) -> torch.Tensor:
        """fp32 values of rows (bf16, or fp8 times its per-128-channel scales)."""
        if self.dtype == "fp8":
            q, sc = x
            return (q.float().view(q.shape[0], self.H // 128, 128) * sc[:, :, None]).view(q.shape[0], self.H)
        return x.float()

    def expert_outputs(self, recv_x, local_of_row: torch.Tensor) -> torch.Tensor:
        return (self.values(recv_x) * (1.0 + local_of_row.float()[:, None] / 16.0)).to(torch.bfloat16)

    def rows_errors(self, recv_x) -> list[str]:
        """The first len(src) received rows against the expected ones, bit for bit."""
        n = len(self.src)
        if self.dtype == "fp8":
            same = torch.equal(recv_x[0][:n].view(torch.uint8), self.want_rows[0].view(torch.uint8)) and \
                torch.equal(recv_x[1][:n], self.want_rows[1])
        else:
            same = torch.equal(recv_x[:n].view(torch.int16), self.want_rows.view(torch.int16))
        if same:
            return []
        a = (recv_x[0][:n].view(torch.uint8) if self.dtype == "fp8" else recv_x[:n].view(torch.int16))
        b = (self.want_rows[0].view(torch.uint8) if self.dtype == "fp8" else self.want_rows.view(torch.int16))
        bad = torch.nonzero((a != b).any(1)).flatten()[:4].tolist() if a.shape == b.shape else "shape"
        return [f"rows differ (first {bad}) of {n}"]

    def check_dispatch(self, recv_x, recv_w, counts, recv_idx=None) -> list[str]:
        n = len(self.src)
        errs = self.rows_errors(recv_x)
        if list(counts) != self.counts:
            errs.append(f"counts {list(counts)[:6]}... != {self.counts[:6]}...")
        gw = recv_w[:n].cpu().numpy()
        if not np.array_equal(gw, self.rows_w):
            errs.append(f"weights: {int(np.sum(gw != self.rows_w))} of {n} differ")
        if recv_idx is not None and not np.array_equal(recv_idx[:n].cpu().numpy(), self.src[:, 2]):
            errs.append("recv_topk_idx differs")
        return errs

    def y_for(self, recv_x, rows: int) -> torch.Tensor:
        """The expert outputs of the received rows (first len(src) rows; the rest zero)."""
        n = len(self.src)
        y = torch.zeros((rows, self.H), dtype=torch.bfloat16, device=self.dev)
        if n:
            rx = (recv_x[0][:n], recv_x[1][:n]) if self.dtype == "fp8" else recv_x[:n]
            loc = torch.from_numpy(self.local[self.src[:, 2]]).to(self.dev)
            y[:n] = self.expert_outputs(rx, loc)
        return y

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        me, n = self.me, self.tokens[self.me]
        x = (self.x_all[0][me][:n], self.x_all[1][me][:n]) if self.dtype == "fp8" else self.x_all[me][:n]
        v = self.values(x)  # [tokens, H]
        ref = torch.zeros_like(v)
        mag = torch.zeros_like(v)
        idx = torch.from_numpy(self.idx[me][:n].copy()).to(self.dev)
        w = torch.from_numpy(self.w[me][:n].copy()).to(self.dev)
        loc = torch.from_numpy(self.local).to(self.dev)
        for j in range(self.K):
            e = idx[:, j]
            ok = e >= 0
            y = (v * (1.0 + loc[e.clamp(min=0)].float()[:, None] / 16.0)).to(torch.bfloat16).float()
            term = torch.where(ok[:, None], w[:, j, None] * y, torch.zeros_like(y))
            ref += term
            mag += term.abs()
        return ref, mag

    def check_combine(self, out: torch.Tensor) -> list[str]:
        """oracle.compare_combine with the bf16 rounding of one partial per (token, GPU), on the
        device (compare_torch: the same verdict; NumPy on the host took seconds per check)."""
        if tuple(out.shape) != (self.tokens[self.me], self.H):
            return [f"combine: out has shape {list(out.shape)}, want [{self.tokens[self.me]}, {self.H}]"]
        if not out.numel():  # a rank that dispatched no tokens gets none back
            return []
        ref, mag = self.reference()
        chk = compare_torch.compare_combine(out[None], ref[None], mag[None], self.K, partial_rounding=PARTIAL_ROUNDING)
        if chk.ok:
            return []
        _, t, ch = chk.first_bad
        return [f"combine: token {t} channel {ch}: got {chk.got} want {chk.want} "
                f"(max {chk.max_ulp} ulp, {chk.beyond_ulp} values beyond {oracle.MAX_ULP} ulp)"]


class TokenCase(Case):
    """A token-major bundle's case (the workload's `layout token`, DeepEP's intranode output): the
    expected rows, per-row top-k ids and weights and per-expert counts are the oracle's
    (runtime/layout's compute_layout of the token-major plan, as the cpu backend returns them).
    The expert outputs of a row on rank d are y = bf16(value(row) * (1 + d / 16)), so the home rank
    forms the combine reference from its own tokens: ref[t] = sum over the ranks d holding a row of
    t of y(x[t], d), in rank order, fp32 (the kernels sum the rows in that order)."""

    def __init__(self, buf: Buffer, spec: str, seed: int, dev, tokens: list[int] | None = None):
        super().__init__(buf, spec, seed, dev, tokens)
        lay = compute_layout(buf.plan, self.idx, self.w, self.tokens)
        me = self.me
        self.src = lay.entries[("output", me)]  # [n, 2] (home, token) in (home, token) order
        self.want_idx = np.asarray(lay.recv_topk_idx[me], dtype=np.int64).reshape(-1, self.K)
        self.want_w = np.asarray(lay.recv_topk_weights[me], dtype=np.float32).reshape(-1, self.K)
        self.counts = [int(c) for c in lay.recv_counts[me]]
        h = torch.from_numpy(self.src[:, 0].copy()).to(dev)
        t = torch.from_numpy(self.src[:, 1].copy()).to(dev)
        self.want_rows = (self.x_all[0][h, t], self.x_all[1][h, t]) if self.dtype == "fp8" else self.x_all[h, t]
        rank_of, _ = oracle.expert_rank(self.E, self.R, self.placement)
        self.rank_of = rank_of

    def check_dispatch(self, recv_x, recv_w, counts, recv_idx=None, align: int = 1) -> list[str]:
        n = len(self.src)
        errs = self.rows_errors(recv_x)
        want_counts = [-(-c // align) * align for c in self.counts]
        if list(counts) != want_counts:
            errs.append(f"counts {list(counts)[:6]}... != {want_counts[:6]}...")
        gw = recv_w[:n].cpu().numpy()
        if gw.shape != self.want_w.shape or not np.array_equal(gw, self.want_w):
            errs.append(f"recv_topk_weights differ ({gw.shape} vs {self.want_w.shape})")
        if recv_idx is not None:
            gi = recv_idx[:n].cpu().numpy()
            if gi.shape != self.want_idx.shape or not np.array_equal(gi, self.want_idx):
                errs.append(f"recv_topk_idx differs ({gi.shape} vs {self.want_idx.shape})")
        return errs

    def y_for(self, recv_x, rows: int) -> torch.Tensor:
        n = len(self.src)
        y = torch.zeros((rows, self.H), dtype=torch.bfloat16, device=self.dev)
        if n:
            rx = (recv_x[0][:n], recv_x[1][:n]) if self.dtype == "fp8" else recv_x[:n]
            y[:n] = self.expert_outputs(rx, torch.full((n,), self.me, device=self.dev))
        return y

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        me, n = self.me, self.tokens[self.me]
        x = (self.x_all[0][me][:n], self.x_all[1][me][:n]) if self.dtype == "fp8" else self.x_all[me][:n]
        v = self.values(x)
        idx = self.idx[me][:n]
        ref = torch.zeros_like(v)
        mag = torch.zeros_like(v)
        for d in range(self.R):
            on = torch.from_numpy(((idx >= 0) & (self.rank_of[np.maximum(idx, 0)] == d)).any(1)).to(self.dev)
            y = (v * (1.0 + d / 16.0)).to(torch.bfloat16).float()
            term = torch.where(on[:, None], y, torch.zeros_like(y))
            ref += term
            mag += term.abs()
        return ref, mag


def run_token_bundle(path: Path, buf: Buffer, dev, checks: Checks) -> None:
    """A token-major bundle's checks against the oracle: every routing (masked -1 slots included)
    in normal and low-latency mode, uneven token counts (one rank none), cached handles (the last
    metadata's: no metadata kernel; an older one's: recomputed), expert alignment (counts rounded
    up), a CUDA graph of dispatch + combine replayed on new inputs, bad input."""
    name = path.name

    def report(what: str, errs: list[str]) -> None:
        checks.report(buf, name, what, errs)

    case = None
    for spec in (*ROUTINGS, "masked"):
        for it in range(ITERS):
            seed = 1000 * it + zlib.crc32(spec.encode()) % 997
            case = TokenCase(buf, spec, seed, dev)
            x, idx, w = case.gpu_inputs()
            for sync in (True, False):
                rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
                errs = case.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx)
                if not sync and int(counts[1][-1]) != len(case.src):
                    errs.append(f"source offsets end at {int(counts[1][-1])}, want {len(case.src)} rows")
                errs += case.check_combine(buf.combine(case.y_for(rx, h.rows), h))
                buf.synchronize()
                report(f"{spec} #{it} {'sync' if sync else 'low-latency'}", errs)
    for label, tokens in uneven_tokens(buf.num_ranks, buf.plan.workload.tokens):
        tc = TokenCase(buf, "masked", 31, dev, tokens)
        x, idx, w = tc.gpu_inputs()
        for sync in (True, False):
            rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
            errs = tc.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx)
            errs += tc.check_combine(buf.combine(tc.y_for(rx, h.rows), h))
            buf.synchronize()
            report(f"tokens {label} {'sync' if sync else 'low-latency'}", errs)
    # cached handles: the last metadata's (none computed), twice; then an older one's after a
    # dispatch with other routing (its metadata computed again from the handle's routing)
    c1, c2 = TokenCase(buf, "uniform", 7, dev), TokenCase(buf, "zipf:1.2", 8, dev)
    x1, idx1, w1 = c1.gpu_inputs()
    h1 = buf.dispatch(x1, idx1, w1)[4]
    for rep in range(2):
        for sync in (True, False):
            rx, ridx, rw, counts, h, _ = buf.dispatch(x1, handle=h1, sync=sync)
            errs = c1.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx)
            errs += c1.check_combine(buf.combine(c1.y_for(rx, h.rows), h))
            buf.synchronize()
            report(f"cached handle #{rep} {'sync' if sync else 'low-latency'} (no metadata)", errs)
    x2, idx2, w2 = c2.gpu_inputs()
    buf.dispatch(x2, idx2, w2)
    rx, ridx, rw, counts, h, _ = buf.dispatch(x1, handle=h1)
    errs = c1.check_dispatch(rx, rw, counts, ridx)
    errs += c1.check_combine(buf.combine(c1.y_for(rx, h.rows), h))
    report("older cached handle (metadata again)", errs)
    rx, ridx, rw, counts, h, _ = buf.dispatch(x1, idx1, w1, expert_alignment=64)
    errs = c1.check_dispatch(rx, rw, counts, ridx, align=64)
    errs += c1.check_combine(buf.combine(c1.y_for(rx, h.rows), h))
    report("expert_alignment=64 (counts rounded up)", errs)
    # CUDA graph: dispatch (low latency) + expert outputs + combine, captured once, replayed
    rx0, _, _, _, h0, _ = buf.dispatch(x1, idx1, w1, sync=False)
    buf.synchronize()
    g = torch.cuda.CUDAGraph()
    holder = torch.full((h0.rows,), buf.rank, device=dev)
    with torch.cuda.graph(g):
        rx, ridx, rw, (cnt, off), h, _ = buf.dispatch(x1, idx1, w1, sync=False)
        out = buf.combine(c1.expert_outputs(rx, holder), h)
    for rep, spec in enumerate(("zipf:1.2", "masked", "no-remote")):
        cr = TokenCase(buf, spec, 200 + rep, dev)
        nx, nidx, nw = cr.gpu_inputs()
        if cr.dtype == "fp8":
            x1[0].copy_(nx[0]); x1[1].copy_(nx[1])
        else:
            x1.copy_(nx)
        idx1.copy_(nidx); w1.copy_(nw)
        g.replay()
        buf.synchronize()
        errs = cr.check_dispatch(rx, rw, cnt.cpu().tolist(), ridx)
        errs += cr.check_combine(out)
        report(f"cuda graph replay {rep} ({spec})", errs)
    bad_input(buf, *c1.gpu_inputs(), report)
    buf.synchronize()
    dist.barrier()
    buf.close()


class Checks:
    """The verdicts: a check fails when it fails on any rank (agreed by an all_reduce), each one
    logged on rank 0, every rank's own errors printed; counts the checks run and failed."""

    def __init__(self, dev, log):
        self.dev, self.log = dev, log  # dev: where the verdict flags are all-reduced
        self.run = self.failed = 0

    def report(self, buf: Buffer, name: str, what: str, errs: list[str]) -> None:
        self.run += 1
        flag = torch.tensor([1 if errs else 0], device=self.dev)
        dist.all_reduce(flag)
        self.failed += int(flag.item() > 0)
        for e in errs:
            print(f"[rank {buf.rank}] {name} {what}: {e}", flush=True)
        self.log(f"{name:12s} R={buf.num_ranks} {what:40s} "
                 f"{'FAIL on ' + str(int(flag.item())) + ' rank(s)' if flag.item() else 'ok'}")


def uneven_tokens(R: int, T: int) -> list[tuple[str, list[int]]]:
    """Token counts per rank the checks dispatch besides the bundle's T on every rank: every rank a
    different count below T (DeepEP's tests use T - rank), and one rank with none."""
    return [("T-1-7r", [max(0, T - 1 - 7 * r) for r in range(R)]),
            ("rank 0 empty", [0] + [T] * (R - 1))]


def aligned_errors(buf: Buffer, case: Case, align: int, dev) -> list[str]:
    """`case` dispatched with expert_alignment=align (every local expert's rows start at a multiple
    of it on this rank, whatever the peers ask for) and combined: what differs from the oracle."""
    x, idx, w = case.gpu_inputs()
    rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, expert_alignment=align)
    errs = []
    starts = np.r_[0, np.cumsum(-(-np.asarray(case.counts) // align) * align)]
    rows_of = torch.cat([torch.arange(int(starts[l]), int(starts[l]) + c) for l, c in enumerate(case.counts)]).to(dev)
    packed = (rx[0][rows_of], rx[1][rows_of]) if case.dtype == "fp8" else rx[rows_of]
    errs += case.check_dispatch(packed, rw[rows_of], counts, ridx[rows_of])
    if h.rows != int(starts[-1]):
        errs.append(f"recv_x has {h.rows} rows, want {int(starts[-1])} (padded)")
    y = torch.zeros((h.rows, case.H), dtype=torch.bfloat16, device=dev)
    y[rows_of] = case.y_for(packed, len(case.src))
    errs += case.check_combine(buf.combine(y, h))
    return errs


def graph_checks(buf: Buffer, case: Case, replays: list, dev, report, label: str = "cuda graph replay") -> None:
    """Dispatch (low latency) + expert outputs + combine captured once as a CUDA graph on `case`'s
    inputs, then replayed on the inputs of each case `replays` makes (callables; the same token
    counts as `case`), each replay checked against the oracle and reported as `label` i."""
    xs, idxs, ws = case.gpu_inputs()
    rx0 = buf.dispatch(xs, idxs, ws, sync=False)[0]  # the whole receive buffer
    buf.synchronize()  # before the next kernel's first launch (the GPU proxy path: docs/rdma.md)
    cap = (rx0[0] if isinstance(rx0, tuple) else rx0).shape[0]
    row_local = torch.zeros(cap, dtype=torch.int64, device=dev)  # local expert of each received row
    rx, _, rw, (cnt, off), h, _ = buf.dispatch(xs, idxs, ws, sync=False)  # warm-up outside the graph
    buf.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rx, _, rw, (cnt, off), h, _ = buf.dispatch(xs, idxs, ws, sync=False)
        y = case.expert_outputs(rx, row_local)
        out = buf.combine(y, h)
    for rep, make in enumerate(replays):
        c2 = make()
        nx, nidx, nw = c2.gpu_inputs()
        if case.dtype == "fp8":
            xs[0].copy_(nx[0]); xs[1].copy_(nx[1])
        else:
            xs.copy_(nx)
        idxs.copy_(nidx); ws.copy_(nw)
        n = len(c2.src)
        row_local.zero_()
        row_local[:n] = torch.from_numpy(c2.local[c2.src[:, 2]]).to(dev)  # rows are expert-major: known order
        g.replay()
        buf.synchronize()
        errs = c2.check_dispatch(rx, rw, cnt.cpu().tolist())
        errs += c2.check_combine(out)
        report(f"{label} {rep}", errs)


def on_proxy_path(path: Path) -> bool:
    """Whether the bundle runs its RDMA steps through the GPU proxy path (its manifest's options.rdma)."""
    m = path / "cuda" / "manifest.json"
    return m.is_file() and json.loads(m.read_text(encoding="utf-8")).get("options", {}).get("rdma") == "proxy"


def run_bundle(path: Path, dev, checks: Checks, iters: int = ITERS) -> None:
    proxy = on_proxy_path(path)
    buf = Buffer(dist.group.WORLD, path, backend=BACKEND, timeout_s=20.0,
                 config={"rdma_transport": RDMA_TRANSPORT} if proxy and RDMA_TRANSPORT else {})

    def settle() -> None:
        """Before a low-latency call's results are read by a copy into pageable memory (.cpu()) on
        the default stream: on the GPU proxy path such a copy, waiting for the kernel, holds every
        other thread's CUDA submissions, the proxy's too (docs/rdma.md), so wait first."""
        if proxy:
            buf.synchronize()
    name = path.name
    if getattr(buf.engine, "token_major", False):
        run_token_bundle(path, buf, dev, checks)
        return
    # the direct kernels (a one-hop plan) also run the low-latency mode, CUDA graphs and other
    # launch configurations; the table-driven kernels take their layout from the host
    direct = hasattr(buf.engine, "c")
    # the table-driven kernels whose tables the GPU writes run every mode too
    lowlat = direct or getattr(buf.engine, "on_device", False)

    def report(what: str, errs: list[str]) -> None:
        checks.report(buf, name, what, errs)

    for spec in ROUTINGS:
        for it in range(iters):
            seed = 1000 * it + zlib.crc32(spec.encode()) % 997
            case = Case(buf, spec, seed, dev)
            x, idx, w = case.gpu_inputs()
            rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w)
            errs = case.check_dispatch(rx, rw, counts, ridx)
            out = buf.combine(case.y_for(rx, h.rows), h)
            errs += case.check_combine(out)
            buf.synchronize()
            report(f"{spec} #{it} sync", errs)
        if lowlat:  # low-latency mode (no host sync inside) on the last case's inputs
            rx, _, rw, (cnt, off), h, _ = buf.dispatch(x, idx, w, sync=False)
            settle()
            errs = case.check_dispatch(rx, rw, cnt.cpu().tolist())
            out = buf.combine(case.y_for(rx, h.rows), h)
            settle()
            errs += case.check_combine(out)
            report(f"{spec} low-latency", errs)

    # ranks dispatch different numbers of tokens (one none): every mode; must not need a timeout
    for label, tokens in uneven_tokens(buf.num_ranks, buf.plan.workload.tokens):
        case = Case(buf, "uniform", 31, dev, tokens)
        x, idx, w = case.gpu_inputs()
        for sync in ((True, False) if lowlat else (True,)):
            rx, ridx, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
            settle()
            errs = case.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist(), ridx if sync else None)
            out = buf.combine(case.y_for(rx, h.rows), h)
            settle()
            errs += case.check_combine(out)
            buf.synchronize()
            report(f"tokens {label} {'sync' if sync else 'low-latency'}", errs)

    # cached handle: dispatch again with the handle's routing (new payload)
    case = Case(buf, "uniform", 7, dev)
    x, idx, w = case.gpu_inputs()
    _, _, _, _, h, _ = buf.dispatch(x, idx, w)
    rx, ridx, rw, counts, h2, _ = buf.dispatch(x, handle=h)
    errs = case.check_dispatch(rx, rw, counts, ridx)
    errs += case.check_combine(buf.combine(case.y_for(rx, h2.rows), h2))
    report("cached-handle dispatch", errs)

    # expert alignment: every local expert's rows start at a multiple of 64
    report("expert_alignment=64", aligned_errors(buf, case, 64, dev))

    if lowlat and not direct:  # the GPU's tables, byte for byte the host's (uneven tokens, empty slots)
        report("device tables = host tables", device_tables_errors(buf, dev))
        graph_checks(buf, case, [lambda rep=rep: Case(buf, ("uniform", "zipf:1.2", "no-remote")[rep], 100 + rep, dev)
                                 for rep in range(3)], dev, report)
    if not direct:
        bad_input(buf, x, idx, w, report)
        buf.synchronize()
        dist.barrier()
        buf.close()
        return
    # CUDA graph: dispatch (low latency) + expert outputs + combine, captured once, replayed on new inputs
    graph_checks(buf, case, [lambda rep=rep: Case(buf, ("uniform", "zipf:1.2", "no-remote")[rep], 100 + rep, dev)
                             for rep in range(3)], dev, report)

    bad_input(buf, x, idx, w, report)
    decode = buf.engine.c["max_tokens"] <= META_CHUNK
    buf.synchronize()
    dist.barrier()
    buf.close()
    # dedicated replicator and home-reducer blocks beside the sending ones, on few SMs (many
    # channels per warp): the other way the kernels can be configured (epcc tune tries it)
    run_config(path, dev, checks, {"send_blocks": 3, "recv_blocks": 2, "combine_send_blocks": 3,
                                   "combine_reduce_blocks": 2}, "dedicated roles 3+2")
    if decode:  # dispatch blocks too narrow to count the metadata themselves: meta_count_kernel
        run_config(path, dev, checks, {"warps": 4}, "warps=4")


def device_tables_errors(buf: Buffer, dev) -> list[str]:
    """After a dispatch whose tables the GPU wrote, its blobs against the host's (runtime/layout
    laid out on the host, placed as the kernels place them), and for the GPU proxy path each RDMA
    chunk's number on its channel against the host's numbering of those tables."""
    eng = buf.engine
    T = buf.plan.workload.tokens
    tokens = [max(0, T - 5 * r) for r in range(buf.num_ranks)]
    case = Case(buf, "uniform", 57, dev, tokens)
    x, idx, w = case.gpu_inputs()
    buf.dispatch(x, idx, w)
    buf.synchronize()
    layout = compute_layout(buf.plan, case.idx, case.w, tokens)
    errs = []
    for p, pl in eng.meta.placements.items():
        want = build_placed(eng.manifest, layout, pl).blob
        got = eng.meta.blobs[p].cpu().numpy()
        diff = placed_differences(want, got, pl)
        if diff.size:
            errs.append(f"{p}: {diff.size} bytes differ from the host's, first at {int(diff[0])} "
                        f"(sections {pl.offsets})")
        if p in eng.meta.seq:  # the GPU proxy path: chunk numbers on their channels
            parsed = parse_tables(want)
            want_seq, *_ = item_sequences(eng.manifest, parsed, p)
            kernel = next(k for k in eng.manifest["kernels"] if k["program"] == p and k["kind"] == "main")
            items = [i for ri, r in enumerate(kernel["roles"]) if r.get("lowered") in ("rdma-pack", "rdma-unpack")
                     for i, *_ in role_items(parsed, ri, r["step"])]
            got_seq = eng.meta.seq[p].cpu().numpy().view(np.uint32)
            if not items or got_seq[items].tolist() != want_seq[items].tolist():
                errs.append(f"{p}: the RDMA chunks' numbers on their channels differ from the host's "
                            f"({len(items)} RDMA items)")
    return errs


def bad_input(buf: Buffer, x, idx, w, report) -> None:
    """Bad input: errors name the argument, nothing is launched."""
    errs = []
    bad_idx = idx.clone()
    bad_idx[3, 1] = bad_idx[3, 0]
    try:
        buf.dispatch(x, bad_idx, w)
        errs.append("a repeated expert was not reported")
    except ValueError as e:
        if "topk_idx row 3" not in str(e):
            errs.append(f"repeated expert: unexpected message {e}")
    for args, needle in [((x, idx[:, :2], w), "topk_idx must have shape"),
                         ((x, idx, w.double()), "topk_weights must be torch.float32")]:
        try:
            buf.dispatch(*args)
            errs.append(f"no error for {needle}")
        except (ValueError, TypeError) as e:
            if needle not in str(e):
                errs.append(f"unexpected message: {e}")
    report("bad input raises", errs)


def run_config(path: Path, dev, checks: Checks, config: dict, label: str) -> None:
    """The bundle again under another launch configuration; it must give what the oracle gives
    (uniform, Zipf and empty routings, sync and low-latency).  With `warps=4` a decode-sized bundle
    (one metadata chunk) has dispatch blocks too narrow to count the metadata themselves, so the
    dispatch launches meta_count_kernel first, the path every larger batch takes."""
    buf = Buffer(dist.group.WORLD, path, backend=BACKEND, timeout_s=20.0, config=config)
    for spec in ("uniform", "zipf:1.2", "empty"):
        case = Case(buf, spec, 11, dev)
        x, idx, w = case.gpu_inputs()
        for sync in (True, False):
            rx, _, rw, counts, h, _ = buf.dispatch(x, idx, w, sync=sync)
            errs = case.check_dispatch(rx, rw, counts if sync else counts[0].cpu().tolist())
            errs += case.check_combine(buf.combine(case.y_for(rx, h.rows), h))
            checks.report(buf, path.name, f"{label} {spec} {'sync' if sync else 'low-latency'}", errs)
    buf.synchronize()
    dist.barrier()
    buf.close()


def main(argv: list[str], run=run_bundle) -> int:
    """Every bundle of `argv` through `run(path, device, checks)` on this rank; 0 when every check
    passed on every rank."""
    joined = join_group()  # ranks that share this host's GPUs (time-sliced) over gloo
    if joined is None:
        print("ep_worker: no CUDA device visible (the GPU checks need GPUs; run it under torchrun there)",
              file=sys.stderr)
        return 1
    dev, shared = joined
    gpus = torch.cuda.device_count()
    rank = dist.get_rank()
    flag_dev = torch.device("cpu") if shared else dev

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    if shared:
        log(f"{dist.get_world_size()} ranks on {gpus} GPU(s): rank r on GPU r mod {gpus}, kernels of one GPU's "
            "ranks time-sliced (a correctness run, not a timing)")
    checks = Checks(flag_dev, log)
    crashed = 0
    for p in argv:
        try:
            run(Path(p), dev, checks)
        except Exception:
            traceback.print_exc()
            crashed = 1
            break
    flag = torch.tensor([checks.failed + crashed], device=flag_dev)
    dist.all_reduce(flag)
    where = f"{gpus} x {torch.cuda.get_device_name(dev)}, shared" if shared else torch.cuda.get_device_name(dev)
    log(f"GPU checks: {'ALL OK' if flag.item() == 0 else str(int(flag.item())) + ' failure(s)'} "
        f"({checks.run} checks, {dist.get_world_size()} ranks, {where})")
    dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
