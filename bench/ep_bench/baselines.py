"""The torch+NCCL baselines, run in the benchmark's own processes on the same routing and data.

* torch_megatron: a Megatron-style all-to-all token dispatcher in torch + NCCL, timed whole:
  counts per destination (per-rank dedup) -> all_to_all of the counts + host sync ->
  index_select into the send buffer -> all_to_all_single (payload, and the tokens' top-k ids and
  weights) -> expert-major permute at the receiver.  Combine: rows regrouped by home rank ->
  all_to_all_single back (one bf16 row per (token, expert)) -> weighted sum at home (fp32).
* nccl_a2a: only the all_to_all_single of the pre-permuted per-rank-dedup payload (splits known,
  buffers built beforehand); "combine" is the reverse all_to_all_single of one bf16 row per
  (token, destination rank).
"""

from __future__ import annotations

import numpy as np
import torch

from epcc.plan import Plan
from epcc.runtime.testing import inputs, oracle

from .data import RankData, check_combine, check_rows, dedup_src
from .timing import Comm, Timer, guard, run_iterations

BASELINES = ("torch_megatron", "nccl_a2a")


class Megatron:
    """Baseline A: a Megatron-style all-to-all token dispatcher (per-rank dedup dispatch)."""

    def __init__(self, comm: Comm, R: int, experts: int, placement: str, hidden: int):
        self.comm, self.R, self.E, self.H = comm, R, experts, hidden
        dev = comm.dev
        rank_of, local_of = oracle.expert_rank(experts, R, placement)
        self.rank_of = torch.from_numpy(rank_of).to(dev)
        self.local_of = torch.from_numpy(local_of).to(dev)
        self.epr = experts // R
        self._static = None

    def _nonzero(self, m: torch.Tensor, n: int) -> torch.Tensor:
        """nonzero with a host-known count: no second host sync where nonzero_static runs."""
        if self._static is not False:
            try:
                out = torch.nonzero_static(m, size=n)
                self._static = True
                return out
            except (AttributeError, RuntimeError, NotImplementedError):
                self._static = False
        return torch.nonzero(m)

    def dispatch(self, x: torch.Tensor, topk: torch.Tensor, w: torch.Tensor):
        """x uint8 [T, row_bytes], topk int64 [T, k], w fp32 [T, k] -> expert-major rows (oracle
        order: local expert, home, token), their weights, rows per local expert (host), handle."""
        R, epr, me = self.R, self.epr, self.comm.rank
        dev = x.device
        T, k = topk.shape
        valid = topk >= 0
        dest = torch.where(valid, self.rank_of[topk.clamp_min(0)], R)  # R: empty slot
        local = self.local_of[topk.clamp_min(0)]
        in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :R]
        rows_per = torch.zeros((R + 1) * epr, dtype=torch.int64, device=dev)
        rows_per.scatter_add_(0, (dest * epr + local).flatten(), torch.ones(T * k, dtype=torch.int64, device=dev))
        counts = torch.cat([in_rank.sum(0, dtype=torch.int64)[:, None], rows_per[:R * epr].view(R, epr)], dim=1)
        recv_counts = torch.empty_like(counts)
        self.comm.a2a(recv_counts, counts)
        host = torch.cat([counts, recv_counts]).cpu()  # the host sync: splits and expert sizes
        send_tok_n = host[:R, 0].tolist()
        recv_tok_n = host[R:, 0].tolist()
        rows_back_n = host[:R, 1:].sum(1).tolist()  # rows of my tokens held by each rank
        rows_from_n = host[R:, 1:].sum(1).tolist()  # rows I hold per home rank
        tokens_per_expert = host[R:, 1:].sum(0).tolist()
        n_send, n_recv, n_rows = sum(send_tok_n), sum(recv_tok_n), sum(rows_from_n)
        # send buffer: token copies destination-major (token order inside)
        send_tok = self._nonzero(in_rank.t(), n_send)[:, 1]
        send_x = x.index_select(0, send_tok)
        meta = torch.cat([topk.index_select(0, send_tok).to(torch.int32),
                          w.index_select(0, send_tok).contiguous().view(torch.int32)], dim=1)
        recv_x = torch.empty(n_recv, x.shape[1], dtype=x.dtype, device=dev)
        recv_meta = torch.empty(n_recv, 2 * k, dtype=torch.int32, device=dev)
        self.comm.a2a(recv_x, send_x, recv_tok_n, send_tok_n)
        self.comm.a2a(recv_meta, meta, recv_tok_n, send_tok_n)
        # expert-major permute at the receiver: rows (token, local expert), stable by local expert
        r_idx = recv_meta[:, :k].long()
        r_w = recv_meta[:, k:].contiguous().view(torch.float32)
        mine = (r_idx >= 0) & (self.rank_of[r_idx.clamp_min(0)] == me)
        ij = self._nonzero(mine, n_rows)
        loc = self.local_of[r_idx[ij[:, 0], ij[:, 1]]]
        order = torch.sort(loc, stable=True).indices
        i_sorted, j_sorted = ij[order, 0], ij[order, 1]
        out_x = recv_x.index_select(0, i_sorted)
        out_w = r_w[i_sorted, j_sorted]
        # for combine: the rows regrouped by home rank (expert-major inside), and at home the
        # (token, slot) each returning row belongs to: by (holder rank, local expert, token)
        bounds = torch.cumsum(recv_counts[:, 0], 0)
        home_of_row = torch.searchsorted(bounds, i_sorted, right=True)
        back = torch.sort(home_of_row, stable=True).indices
        key = torch.where(valid, dest * (epr * T) + local * T + torch.arange(T, device=dev)[:, None],
                          torch.full_like(dest, R * epr * T)).flatten()
        perm = torch.sort(key).indices[:sum(rows_back_n)]
        handle = {"back": back, "rows_from_n": rows_from_n, "rows_back_n": rows_back_n,
                  "tok_back": perm // k, "w_back": w.flatten()[perm], "tokens": T}
        return out_x, out_w, tokens_per_expert, handle

    def combine(self, y: torch.Tensor, handle: dict) -> torch.Tensor:
        """y bf16 [rows, hidden] in dispatch's output order -> bf16 [T, hidden] at home."""
        send = y.index_select(0, handle["back"])
        recv = torch.empty(sum(handle["rows_back_n"]), y.shape[1], dtype=y.dtype, device=y.device)
        self.comm.a2a(recv, send, handle["rows_back_n"], handle["rows_from_n"])
        out = torch.zeros(handle["tokens"], y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, handle["tok_back"], recv.float() * handle["w_back"][:, None])
        return out.to(torch.bfloat16)


def bench_baselines(comm: Comm, timer: Timer, args, plan: Plan, T: int, idx: np.ndarray, data: RankData,
                    methods: list[str]) -> dict:
    wl, R, me, dev = plan.workload, plan.num_ranks, comm.rank, comm.dev
    H, rb = wl.hidden, inputs.row_bytes(wl.hidden, wl.dtype)
    d = data
    results: dict[str, dict] = {}

    if "torch_megatron" in methods:
        mg = Megatron(comm, R, wl.experts, wl.placement, H)

        def step_a(s, phase):
            td, (rows, _, _, handle) = timer.time(lambda: mg.dispatch(d.x_sets[s], d.topk, d.weights))
            tc, out = timer.time(lambda: mg.combine(d.y_sets[s], handle))
            return td, tc, (rows, out)

        def check_a(outs):
            check_rows(outs[0], d.want_rows, "torch_megatron dispatch")
            return check_combine(outs[1], d.ref, d.mag, wl.topk, "torch_megatron combine")

        results["torch_megatron"] = guard(comm, lambda: run_iterations(timer, args.warmup, args.iters,
                                                                          step_a, check_a))
        results["torch_megatron"]["sms"] = "torch + NCCL"

    if "nccl_a2a" in methods:
        def run_b():
            # pre-permuted per-rank-dedup payload and known splits, built outside the timing
            rank_of = torch.from_numpy(oracle.expert_rank(wl.experts, R, wl.placement)[0]).to(dev)
            dest = torch.where(d.topk >= 0, rank_of[d.topk.clamp_min(0)], R)
            in_rank = torch.zeros(T, R + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :R]
            send_tok_n = in_rank.sum(0).tolist()
            send_tok = torch.nonzero(in_rank.t())[:, 1]
            dsrc = torch.from_numpy(dedup_src(idx, wl.experts, wl.placement, me)).to(dev)
            recv_tok_n = torch.bincount(dsrc[:, 0], minlength=R).tolist()
            send_sets = [xs.index_select(0, send_tok) for xs in d.x_sets]
            back = d.F_all[dsrc[:, 0], dsrc[:, 1]]
            back_sets = [back, (back.float() * 2).to(torch.bfloat16)]
            recv_x = torch.empty(sum(recv_tok_n), rb, dtype=torch.uint8, device=dev)
            recv_b = torch.empty(sum(send_tok_n), H, dtype=torch.bfloat16, device=dev)
            want_x = d.x_all[dsrc[:, 0], dsrc[:, 1]]
            want_b = d.F_mine.index_select(0, send_tok)

            def step_b(s, phase):
                td, _ = timer.time(lambda: comm.a2a(recv_x, send_sets[s], recv_tok_n, send_tok_n))
                got_x = recv_x.clone() if phase == "check" else None
                tc, _ = timer.time(lambda: comm.a2a(recv_b, back_sets[s], send_tok_n, recv_tok_n))
                return td, tc, (got_x, recv_b.clone() if phase == "check" else None)

            def check_b(outs):
                check_rows(outs[0], want_x, "nccl_a2a dispatch")
                check_rows(outs[1].view(torch.int16), want_b.view(torch.int16), "nccl_a2a combine")
                return {"exact": True}

            return run_iterations(timer, args.warmup, args.iters, step_b, check_b)

        results["nccl_a2a"] = guard(comm, run_b)
        results["nccl_a2a"]["sms"] = "NCCL"
    return results
