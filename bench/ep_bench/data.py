"""The workload every method runs on, and the checks of what a method returned.

One uniform top-k routing (runtime/testing/inputs.py, fixed seed) is the same on every rank; each
rank draws its own token rows with its own seeded torch generator (never zeros).  Expert outputs
are `bf16(F[home, token] x s[expert])` with an exact per-expert factor, so every rank can compute
the rows it holds and the fp32 reference of its own tokens' combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from epcc.plan import Plan
from epcc.plan import bundle as bundle_io
from epcc.runtime.testing import compare_torch, inputs, oracle

CHECK_CHUNK = 1024  # tokens per combine_check call (bounds NumPy's float64 temporaries)


class CheckFailed(RuntimeError):
    """This method's output differs from the oracle: no numbers are reported."""


def load_bundle(path: str | Path) -> tuple[Plan, dict]:
    """The bundle's plan and its CUDA manifest ({} where it has none)."""
    return bundle_io.load(path).plan, bundle_io.cuda_manifest(path, required=False)


def bench_routing(plan: Plan, tokens: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform top-k [R, T, k] and softmax weights [R, T, k], the same on every rank."""
    wl = plan.workload
    idx = inputs.make_topk("uniform", plan.num_ranks, tokens, wl.topk, wl.experts, wl.placement,
                              seed=seed).topk_idx
    return idx, inputs.make_weights(idx, seed=seed + 1)


def _generator(dev: torch.device, seed: int, rank: int, stream: int) -> torch.Generator:
    g = torch.Generator(device=dev)
    g.manual_seed((seed * 1_000_003 + rank * 7_919 + stream * 104_729) % (2 ** 63))
    return g


def gen_rows(tokens: int, hidden: int, dtype: str, seed: int, rank: int, stream: int,
             dev: torch.device) -> torch.Tensor:
    """This rank's token rows, uint8 [T, row_bytes]: bf16 N(0,1) values (zero replaced), or fp8
    e4m3 bytes (no NaN encoding) followed by one fp32 scale per 128 channels (runtime/testing/inputs.py's
    wire format)."""
    g = _generator(dev, seed, rank, stream)
    if dtype == "bf16":
        v = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
        v = torch.where(v == 0, torch.full_like(v, 0.5), v)
        return v.view(torch.uint8).reshape(tokens, 2 * hidden)
    q = torch.randint(0, 254, (tokens, hidden), generator=g, device=dev, dtype=torch.int32)
    q = torch.where(q >= 0x7F, q + 1, q).to(torch.uint8)  # skip 0x7f (NaN); 0xff never drawn
    groups = hidden // inputs.FP8_GROUP
    sc = (torch.rand(tokens, groups, generator=g, device=dev) * 1.5 + 0.5) / 448.0
    return torch.cat([q, sc.contiguous().view(torch.uint8).reshape(tokens, 4 * groups)], dim=1).contiguous()


def gen_features(x_rows: torch.Tensor, hidden: int, dtype: str, seed: int, rank: int,
                 dev: torch.device) -> torch.Tensor:
    """bf16 [T, hidden] per-token features the expert outputs are made from (bf16: the token itself)."""
    if dtype == "bf16":
        return x_rows.view(torch.bfloat16).reshape(x_rows.shape[0], hidden)
    return gen_rows(x_rows.shape[0], hidden, "bf16", seed, rank, 9, dev).view(torch.bfloat16).reshape(-1, hidden)


def expert_scale(experts: int, dev: torch.device) -> torch.Tensor:
    """The per-expert factor of the synthetic expert outputs (exact in fp32)."""
    return (0.5 + (torch.arange(experts, dtype=torch.float32) % 64) / 64.0).to(dev)


def expert_outputs(F_all: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [n, hidden] expert outputs for rows src [n, 3] (home, token, expert):
    bf16(F[home, token] * scale[expert]), a function of the row any rank can evaluate."""
    h, t, e = src[:, 0], src[:, 1], src[:, 2]
    return (F_all[h, t].float() * scale[e][:, None]).to(torch.bfloat16)


def combine_reference(F_mine: torch.Tensor, idx_mine: torch.Tensor, w_mine: torch.Tensor,
                      scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """oracle.combine_oracle for this rank's tokens alone: out[t] = sum_j w[t, j] * y(t, e_j) in
    fp32, with the same expert outputs as expert_outputs(); and sum |w y| (the tolerance scale)."""
    T, k = idx_mine.shape
    ref = torch.zeros(T, F_mine.shape[1], dtype=torch.float32, device=F_mine.device)
    mag = torch.zeros_like(ref)
    Ff = F_mine.float()
    for j in range(k):
        e = idx_mine[:, j]
        valid = (e >= 0).float()[:, None]
        y = (Ff * scale[e.clamp_min(0)][:, None]).to(torch.bfloat16).float()
        c = w_mine[:, j, None] * y * valid
        ref += c
        mag += c.abs()
    return ref, mag


def check_rows(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{what}: {list(got.shape)} rows, expected {list(want.shape)}")
    bad = torch.nonzero(~(got == want).all(dim=1)).flatten()
    if bad.numel():
        raise CheckFailed(f"{what}: {bad.numel()} of {want.shape[0]} rows differ (first {bad[:5].tolist()})")


def combine_check(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, topk: int,
                  rounding: float = 0.0) -> oracle.CombineCheck:
    """oracle.compare_combine of [n, hidden] tensors where they are: on a GPU compare_torch's (the
    same CombineCheck field for field, without copying the fp32 results to the host: NumPy on the
    host took seconds per 4096 x 7168 check, against about 1 ms of kernels); on the CPU NumPy's own
    on views of the tensors (a dry run's: there compare_torch is the slower, 6.6 s against 1.6 s
    for 4096 x 7168 on one Xeon core, 2026-11-27)."""
    if got.device.type != "cpu":
        return compare_torch.compare_combine(got, want, mag, topk, partial_rounding=rounding)
    return oracle.compare_combine(got.float().numpy(), want.numpy(), mag.numpy(), topk, partial_rounding=rounding)


def check_combine(got_bf16: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, topk: int, what: str,
                  rounding: float = 0.0) -> dict:
    """combine_check, token chunk by token chunk; CheckFailed if any value is off.
    rounding: the unit roundoff of partials the method rounds on the way (compare_combine's
    partial_rounding): bf16 partials across RDMA-class links in the table-driven kernels
    (tables.partial_rounding); 0 otherwise."""
    if tuple(got_bf16.shape) != tuple(ref.shape):
        raise CheckFailed(f"{what}: shape {list(got_bf16.shape)}, expected {list(ref.shape)}")
    worst_ulp, worst_rel = 0, 0.0
    for lo in range(0, ref.shape[0], CHECK_CHUNK):
        hi = min(ref.shape[0], lo + CHECK_CHUNK)
        chk = combine_check(got_bf16[lo:hi], ref[lo:hi], mag[lo:hi], topk, rounding)
        worst_ulp, worst_rel = max(worst_ulp, chk.max_ulp), max(worst_rel, chk.max_rel)
        if not chk.ok:
            t, c = chk.first_bad
            raise CheckFailed(f"{what}: token {lo + t} channel {c}: got {chk.got:g}, want {chk.want:g} "
                              f"(max {chk.max_ulp} ulp)")
    return {"max_ulp": int(worst_ulp), "max_rel": float(worst_rel)}


def recv_src(idx: np.ndarray, experts: int, placement: str, rank: int) -> np.ndarray:
    """(home, token, expert) [n, 3] of the rows `rank` receives, in the oracle's order (local
    expert, home, token): the expert-major output of dispatch."""
    return oracle.rank_recv_order(idx, experts, placement, rank)[0]


def dedup_src(idx: np.ndarray, experts: int, placement: str, rank: int) -> np.ndarray:
    """(home, token) [n, 2] of the tokens `rank` receives once each (per-rank dedup), source-major."""
    rank_of, _ = oracle.expert_rank(experts, idx.shape[0], placement)
    hit = ((rank_of[np.maximum(idx, 0)] == rank) & (idx >= 0)).any(axis=2)  # [R, T]
    h, t = np.nonzero(hit)
    return np.stack([h, t], axis=1).astype(np.int64).reshape(-1, 2)


def traffic(idx: np.ndarray, experts: int, placement: str, hidden: int, row_bytes: int, dtype: str) -> dict:
    """Bytes per rank (lists indexed by rank) under the conventions of docs/benchmarking.md.

    dispatch (received by the expert rank d), combine (received by the home rank h):
      remote_dedup: a token crosses once to each OTHER rank holding one of its experts
                    (dispatch: row_bytes per token; combine: one bf16 row of hidden per (token, rank));
      remote_rows:  one row per (token, expert on another rank) (expert-major fused permute);
      deepep:       DeepEP's test: every received token incl. self x hidden x 2 (dispatch FP8 scaled
                    by (1 + 4/128) / 2; combine reuses dispatch's bf16 count)."""
    R = idx.shape[0]
    rank_of, _ = oracle.expert_rank(experts, R, placement)
    dest = np.where(idx >= 0, rank_of[np.maximum(idx, 0)], -1)  # [R, T, k]
    tok = np.stack([(dest == d).any(axis=2).sum(axis=1) for d in range(R)], axis=1)  # [home, dest]
    rows = np.stack([(dest == d).sum(axis=(1, 2)) for d in range(R)], axis=1)  # [home, dest]
    off = ~np.eye(R, dtype=bool)
    fp8 = (1 + 4 / 128) / 2 if dtype == "fp8" else 1.0
    bf16_row = 2 * hidden
    return {
        "dispatch": {
            "remote_dedup": [int((tok[:, d] * off[:, d]).sum() * row_bytes) for d in range(R)],
            "remote_rows": [int((rows[:, d] * off[:, d]).sum() * row_bytes) for d in range(R)],
            "deepep": [float(tok[:, d].sum() * bf16_row * fp8) for d in range(R)],
            "recv_tokens_dedup": [int(tok[:, d].sum()) for d in range(R)],
            "recv_rows": [int(rows[:, d].sum()) for d in range(R)],
        },
        "combine": {
            "remote_dedup": [int((tok[h] * off[h]).sum() * bf16_row) for h in range(R)],
            "remote_rows": [int((rows[h] * off[h]).sum() * bf16_row) for h in range(R)],
            "deepep": [float(tok[:, d].sum() * bf16_row) for d in range(R)],
        },
    }


@dataclass
class RankData:
    """One rank's inputs and expected outputs on its device (two input sets, alternated)."""

    x_sets: list  # this rank's token rows, uint8 [T, row_bytes], sets 0 and 1
    F_mine: torch.Tensor  # bf16 [T, hidden]: the features its tokens' expert outputs are made from
    x_all: torch.Tensor  # [R, T, row_bytes]: every rank's set 0 (the rows a dispatch must deliver)
    F_all: torch.Tensor  # [R, T, hidden]
    scale: torch.Tensor  # [experts]: the expert outputs' factor
    topk: torch.Tensor  # int64 [T, k]: this rank's routing
    weights: torch.Tensor  # fp32 [T, k]
    src: torch.Tensor  # (home, token, expert) [n, 3] of the rows this rank receives, in the oracle's order
    y_sets: list  # bf16 [n, hidden]: the expert outputs of those rows, sets 0 and 1
    ref: torch.Tensor  # fp32 [T, hidden]: the combine of this rank's tokens (set 0)
    mag: torch.Tensor  # sum |w y| per value: the tolerance's scale
    want_rows: torch.Tensor  # [n, row_bytes]: x_all at src, what dispatch must deliver (set 0)
    want_idx: torch.Tensor | None = None  # token-major: int64 [n, k] recv_topk_idx (local ids, -1 elsewhere)


def make_data(comm, plan: Plan, T: int, idx: np.ndarray, w: np.ndarray, seed: int,
              token_major: bool | None = None) -> RankData:
    """Every method's inputs and references on this rank (collective: all-gathers the rows); the
    expected outputs token-major where `token_major` (None: as the plan's layout, epcc's bundle),
    else expert-major (what the baselines and DeepEP's rows are checked against)."""
    wl, me, dev = plan.workload, comm.rank, comm.dev
    x_sets = [gen_rows(T, wl.hidden, wl.dtype, seed, me, s, dev) for s in (0, 1)]
    F_mine = gen_features(x_sets[0], wl.hidden, wl.dtype, seed, me, dev)
    x_all = comm.all_gather(x_sets[0])
    F_all = comm.all_gather(F_mine)
    scale = expert_scale(wl.experts, dev)
    topk = torch.from_numpy(idx[me]).to(dev)
    wt = torch.from_numpy(w[me]).to(dev)
    if token_major if token_major is not None else getattr(wl, "layout", "expert") == "token":
        return token_data(plan, idx, me, x_sets, F_mine, x_all, F_all, scale, topk, wt)
    src = torch.from_numpy(recv_src(idx, wl.experts, wl.placement, me)).to(dev)
    y0 = expert_outputs(F_all, src, scale)
    ref, mag = combine_reference(F_mine, topk, wt, scale)
    return RankData(x_sets=x_sets, F_mine=F_mine, x_all=x_all, F_all=F_all, scale=scale, topk=topk, weights=wt,
                    src=src, y_sets=[y0, (y0.float() * -0.5).to(torch.bfloat16)], ref=ref, mag=mag,
                    want_rows=x_all[src[:, 0], src[:, 1]])


def token_data(plan: Plan, idx: np.ndarray, me: int, x_sets, F_mine, x_all, F_all, scale, topk, wt) -> RankData:
    """make_data for a token-major bundle (the workload's `layout token`, DeepEP's output): the rows
    this rank receives are (home, token) once each, source-major (dedup_src); their recv_topk_idx
    the local expert of each slot on this rank, -1 elsewhere.  The expert output of a row on rank d
    is bf16(F[home, token] x scale[d]) and combine sums a token's rows unweighted, so the
    reference is the sum over the ranks d holding a row of the token, fp32 in rank order."""
    wl = plan.workload
    R, dev = plan.num_ranks, F_mine.device
    rank_of, local_of = oracle.expert_rank(wl.experts, R, wl.placement)
    src2 = dedup_src(idx, wl.experts, wl.placement, me)
    e = idx[src2[:, 0], src2[:, 1]] if len(src2) else np.zeros((0, wl.topk), np.int64)
    on = (e >= 0) & (rank_of[np.maximum(e, 0)] == me)
    want_idx = torch.from_numpy(np.where(on, local_of[np.maximum(e, 0)], -1).astype(np.int64)).to(dev)
    src = torch.from_numpy(np.concatenate([src2, np.full((len(src2), 1), me, np.int64)], axis=1)).to(dev)
    y0 = (F_all[src[:, 0], src[:, 1]].float() * scale[me]).to(torch.bfloat16)
    dest = (topk >= 0)[:, :, None] & (torch.from_numpy(rank_of).to(dev)[topk.clamp_min(0)][:, :, None]
                                       == torch.arange(R, device=dev)[None, None, :])
    held = dest.any(dim=1)  # [T, R]: rank d holds a row of the token
    ref = torch.zeros(F_mine.shape, dtype=torch.float32, device=dev)
    mag = torch.zeros_like(ref)
    for d in range(R):
        y = (F_mine.float() * scale[d]).to(torch.bfloat16).float() * held[:, d, None].float()
        ref += y
        mag += y.abs()
    return RankData(x_sets=x_sets, F_mine=F_mine, x_all=x_all, F_all=F_all, scale=scale, topk=topk, weights=wt,
                    src=src, y_sets=[y0, (y0.float() * -0.5).to(torch.bfloat16)], ref=ref, mag=mag,
                    want_rows=x_all[src[:, 0], src[:, 1]], want_idx=want_idx)


def as_x(rows: torch.Tensor, hidden: int, dtype: str):
    """Wire rows (uint8 [T, row_bytes]) as a Buffer takes x: bf16 [T, hidden], or (fp8 [T, hidden],
    fp32 scales [T, hidden / 128])."""
    if dtype == "fp8":
        return (rows[:, :hidden].contiguous().view(torch.float8_e4m3fn),
                rows[:, hidden:].contiguous().view(torch.float32))
    return rows.view(torch.bfloat16).reshape(rows.shape[0], hidden)


def as_rows(x, n: int | None = None) -> torch.Tensor:
    """as_x's inverse (a received x as wire rows), its first n rows (all where None)."""
    if isinstance(x, tuple):
        x8, sc = x[0][:n], x[1][:n]
        return torch.cat([x8.contiguous().view(torch.uint8), sc.contiguous().view(torch.uint8)], 1)
    return x[:n].contiguous().view(torch.uint8)
