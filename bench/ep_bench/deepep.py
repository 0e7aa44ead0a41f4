"""DeepEP's intranode `deep_ep.Buffer` (deepseek-ai/DeepEP, the V1 API) as a baseline, where
`import deep_ep` works; on the same routing, data, timing and byte conventions as every method,
in a child process per rank (child.py), once per bundle and SM count.

Rows, each named VARIANT@SMS (--deepep-sms: `deep_ep.Buffer.set_num_sms`, then DeepEP's own
dispatch and combine `Config` for that count and the rank count):

* deepep: `get_dispatch_layout` + `dispatch` with the routing given afresh (as a MoE layer calls
  it): token-major output, one row per (token, rank holding one of its experts).  Combine: one
  partial per received token (its local experts' outputs weighted and summed at the expert rank,
  outside the timing), summed at home by DeepEP's combine.
* deepep_cached: `dispatch(x, handle=h)` of one earlier dispatch (DeepEP's cached mode: no
  layout, no top-k); combine as above.
* deepep_permute: deepep plus the expert-major permute a grouped GEMM needs (argsort of the rows'
  local experts, index_select, as Megatron's DeepEP dispatcher does).  Combine: the inverse
  (w x y summed per received token, index_add_ in fp32) plus DeepEP's combine; the expert outputs
  come in the permuted order, as epcc's come in its expert-major order.

Checks: every received row is x[home, token] of the (home, token) DeepEP's handle names for it
(rank_prefix_matrix, recv_src_idx), the received tokens are exactly those the routing sends to
this rank, a permuted row count per local expert equals the oracle's; combine within the oracle's
tolerance, with the bf16 rounding of the per-(token, rank) partials admitted.

deep_ep is built on the GPU machine (docs/benchmarking.md); without it the rows are skipped.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch
import torch.distributed as dist

from epcc.runtime.bf16 import BF16_ROUNDOFF

from .data import (CheckFailed, RankData, as_rows, as_x, bench_routing, check_combine, check_rows, dedup_src,
                   expert_outputs, load_bundle, make_data)
from .timing import Comm, Timer, run_iterations, stop_rows

VARIANTS = ("deepep", "deepep_cached", "deepep_permute")
CONFIG_RANKS = (2, 4, 8)  # rank counts DeepEP's intranode configs cover (one host, NVLink)


def available() -> bool:
    """Whether `import deep_ep` can find the package (its import may still fail: the row says why)."""
    return importlib.util.find_spec("deep_ep") is not None


def row_names(sms: list[int]) -> list[str]:
    return [f"{v}@{n}" for n in sms for v in VARIANTS]


def parse_sms(text: str) -> list[int]:
    """--deepep-sms: even SM counts (DeepEP runs a channel on two SMs); ValueError naming a bad one."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if not item.isdigit() or int(item) < 2 or int(item) % 2:
            raise ValueError(f"--deepep-sms: {item!r} is not an even number of SMs >= 2")
        if int(item) not in out:
            out.append(int(item))
    if not out:
        raise ValueError("--deepep-sms: no SM count given")
    return out


def skip_reason(dry_run: bool, shared: bool, placement: str, ranks: int) -> str | None:
    """Why DeepEP cannot run this bundle here, or None."""
    if dry_run:
        return "dry run: DeepEP needs GPUs"
    if shared:
        return "ranks share GPUs: DeepEP needs a GPU per rank"
    if not available():
        return "deep_ep is not importable (build it on the GPU machine: docs/benchmarking.md)"
    if placement != "blocked":
        return f"DeepEP places experts blocked by rank; this plan's placement is {placement}"
    if ranks not in CONFIG_RANKS:
        return f"DeepEP's intranode configs cover {', '.join(map(str, CONFIG_RANKS))} ranks, not {ranks}"
    return None


# --------------------------------------------------------------------------- the parts without deep_ep


def recv_sources(rank_prefix: torch.Tensor, recv_src_idx: torch.Tensor, rank: int) -> torch.Tensor:
    """(home, token) [n, 2] of DeepEP's received rows: rows [prefix[i-1][rank], prefix[i][rank])
    came from rank i, recv_src_idx is each row's token there."""
    ends = rank_prefix[:, rank].to(torch.int64)
    n = recv_src_idx.shape[0]
    homes = torch.searchsorted(ends, torch.arange(n, device=ends.device), right=True)
    return torch.stack([homes, recv_src_idx.to(torch.int64)], dim=1)


def check_token_rows(rows: torch.Tensor, sources: torch.Tensor, data: RankData, want: np.ndarray, what: str) -> None:
    """The received token rows against x at their (home, token), and the tokens against `want`
    ((home, token) [m, 2] this rank must receive, each once)."""
    got = sources.cpu().numpy()
    order = np.lexsort((got[:, 1], got[:, 0]))
    if got.shape != want.shape or not np.array_equal(got[order], want):
        raise CheckFailed(f"{what}: received {got.shape[0]} tokens, not the {want.shape[0]} the routing sends here")
    check_rows(rows, data.x_all[sources[:, 0], sources[:, 1]], what)


def expert_major(recv_topk_idx: torch.Tensor, experts_per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The permute a grouped GEMM needs, as Megatron does it: the (row, slot) pairs of the received
    tokens' local experts (recv_topk_idx: local expert or -1), stable-sorted by local expert.
    Returns the source row and the slot of each expert-major row."""
    n, k = recv_topk_idx.shape
    key = torch.where(recv_topk_idx >= 0, recv_topk_idx, experts_per_rank).flatten()
    order = torch.argsort(key, stable=True)
    order = order[:int((key < experts_per_rank).sum())]
    return order // k, order % k


def unpermute(y: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """Expert outputs y (expert-major, bf16) back to one partial per received token: sum of w x y
    in fp32, as bf16 (what DeepEP's combine sums at home)."""
    out = torch.zeros((n, y.shape[1]), dtype=torch.float32, device=y.device)
    out.index_add_(0, rows, y.float() * weights[:, None])
    return out.to(torch.bfloat16)


def permuted_sources(sources: torch.Tensor, recv_topk_idx: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                     rank: int, experts_per_rank: int) -> torch.Tensor:
    """(home, token, global expert) [m, 3] of the expert-major rows (blocked placement)."""
    local = recv_topk_idx[rows, slots].to(torch.int64)
    return torch.cat([sources[rows], (rank * experts_per_rank + local)[:, None]], dim=1)


def partial_sets(data: RankData, sources: torch.Tensor, recv_topk_idx: torch.Tensor, recv_w: torch.Tensor,
                 rank: int, experts_per_rank: int) -> list[torch.Tensor]:
    """The per-token partials of both output sets (set 1 = -0.5 x set 0's expert outputs, as every
    method's), for a dispatch's received tokens."""
    rows, slots = expert_major(recv_topk_idx, experts_per_rank)
    y = expert_outputs(data.F_all, permuted_sources(sources, recv_topk_idx, rows, slots, rank, experts_per_rank),
                       data.scale)
    w = recv_w[rows, slots]
    n = recv_topk_idx.shape[0]
    return [unpermute(y, rows, w, n), unpermute((y.float() * -0.5).to(torch.bfloat16), rows, w, n)]


# --------------------------------------------------------------------------- the run (child process)


def run(cfg: dict, comm: Comm, timer: Timer) -> dict:
    """This rank's DeepEP rows of one bundle: {"methods": {row: result}} ("failed" as epcc.run)."""
    import deep_ep  # reason: an optional baseline, built on the GPU machine; absent, its rows are skipped

    plan, _ = load_bundle(cfg["bundle"])
    wl, R, T, me = plan.workload, plan.num_ranks, cfg["tokens"], comm.rank
    idx, w = bench_routing(plan, T, cfg["seed"])
    data = make_data(comm, plan, T, idx, w, cfg["seed"], token_major=False)
    epr = wl.experts // R
    want_tokens = dedup_src(idx, wl.experts, wl.placement, me)
    want_counts = np.bincount(data.src[:, 2].cpu().numpy() % epr, minlength=epr)  # make_data's oracle order
    xs = [as_x(r, wl.hidden, wl.dtype) for r in data.x_sets]
    sms = cfg["deepep_sms"]
    configs = {}
    for n in sms:
        deep_ep.Buffer.set_num_sms(n)
        configs[n] = (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R))
    nvl_bytes = max(c.get_nvl_buffer_size_hint(wl.hidden * 2, R) for pair in configs.values() for c in pair)
    out: dict = {"methods": {}}
    row, buf = "deepep", None
    try:
        buf = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, explicitly_destroy=True)
        for n in sms:
            rows = DeepEpRows(cfg, comm, timer, buf, configs[n], data, xs, want_tokens, want_counts, epr, wl)
            for variant in VARIANTS:
                row = f"{variant}@{n}"
                try:
                    out["methods"][row] = {**getattr(rows, variant)(), "sms": {"dispatch": n, "combine": n}}
                except CheckFailed as e:
                    out["methods"][row] = {"error": f"WRONG: {e}"}
        comm.barrier()
        buf.destroy()
    except Exception as e:  # noqa: BLE001 - DeepEP's kernels trap on a timeout, or a peer failed: stop
        stop_rows(out, comm, row, e, f"{type(e).__name__}: {e}")
    return out


class DeepEpRows:
    """The three variants at one SM count, on one deep_ep.Buffer."""

    def __init__(self, cfg, comm: Comm, timer: Timer, buf, configs, data: RankData, xs, want_tokens, want_counts,
                 epr: int, wl):
        self.cfg, self.comm, self.timer, self.buf, self.d, self.xs = cfg, comm, timer, buf, data, xs
        self.dcfg, self.ccfg = configs
        self.want_tokens, self.want_counts, self.epr, self.wl = want_tokens, want_counts, epr, wl

    def _dispatch(self, s: int):
        """Layout + dispatch with the routing: (recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event)."""
        b, d = self.buf, self.d
        per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(d.topk, self.wl.experts)
        return b.dispatch(self.xs[s], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=per_expert, topk_idx=d.topk, topk_weights=d.weights, config=self.dcfg)

    def _sources(self, handle) -> torch.Tensor:
        return recv_sources(handle[0], handle[3], self.comm.rank)

    def _combine_check(self, comb) -> dict:
        return check_combine(comb, self.d.ref, self.d.mag, self.wl.topk, "deepep combine", BF16_ROUNDOFF)

    def _token_major(self, dispatch) -> dict:
        """deepep and deepep_cached: token-major rows, per-token partials combined."""
        timer, b = self.timer, self.buf
        first = self._dispatch(0)  # the routing's received tokens: their partials (and the cached handle)
        sets = partial_sets(self.d, self._sources(first[4]), first[1], first[2], self.comm.rank, self.epr)

        def step(s, phase):
            td, res = timer.time(lambda: dispatch(s, first[4]))
            handle, part = (res[4] if res[4] is not None else first[4]), sets[s]
            if phase == "check" and res[1] is not None:  # the partials of this dispatch's own rows
                part = partial_sets(self.d, self._sources(handle), res[1], res[2], self.comm.rank, self.epr)[s]
            tc, comb = timer.time(lambda: b.combine(part, handle, config=self.ccfg)[0])
            return td, tc, ((as_rows(res[0]), handle), comb) if phase == "check" else None

        def check(outs):
            (rows, handle), comb = outs
            check_token_rows(rows, self._sources(handle), self.d, self.want_tokens, "deepep dispatch")
            return self._combine_check(comb)

        return run_iterations(timer, self.cfg["warmup"], self.cfg["iters"], step, check)

    def deepep(self) -> dict:
        return self._token_major(lambda s, _: self._dispatch(s))

    def deepep_cached(self) -> dict:
        return self._token_major(lambda s, h: self.buf.dispatch(self.xs[s], handle=h, config=self.dcfg))

    def deepep_permute(self) -> dict:
        timer, b, d, me = self.timer, self.buf, self.d, self.comm.rank

        def dispatch(s):
            rx, ridx, rw, _, handle, _ = self._dispatch(s)
            rows, slots = expert_major(ridx, self.epr)
            x = tuple(t.index_select(0, rows) for t in rx) if isinstance(rx, tuple) else rx.index_select(0, rows)
            return x, rows, slots, ridx, rw[rows, slots], handle

        def step(s, phase):
            td, res = timer.time(lambda: dispatch(s))
            x, rows, slots, ridx, w, handle = res
            src = permuted_sources(self._sources(handle), ridx, rows, slots, me, self.epr)  # outside the timing
            y = expert_outputs(d.F_all, src, d.scale)
            y = y if s == 0 else (y.float() * -0.5).to(torch.bfloat16)
            tc, comb = timer.time(lambda: b.combine(unpermute(y, rows, w, ridx.shape[0]), handle, config=self.ccfg)[0])
            return td, tc, ((as_rows(x), src), comb) if phase == "check" else None

        def check(outs):
            (got, src), comb = outs
            check_rows(got, d.x_all[src[:, 0], src[:, 1]], "deepep_permute dispatch")
            local = (src[:, 2] % self.epr).cpu()
            counts = np.bincount(local.numpy(), minlength=self.epr)
            if not np.array_equal(counts, self.want_counts) or not bool((local[1:] >= local[:-1]).all()):
                raise CheckFailed(f"deepep_permute dispatch: rows per local expert {counts.tolist()}, expected "
                                  f"{self.want_counts.tolist()}, expert-major")
            return self._combine_check(comb)

        return run_iterations(timer, self.cfg["warmup"], self.cfg["iters"], step, check)
