"""Per-SM rates of the topology's `sm` line as each kind of work uses them.

A role of the persistent kernel moves at most N x the per-SM rate of its kind of work: `copy` in
dispatch; in combine `reduce` for weighted steps (a token's expert rows gathered and added) and
`add` for unweighted ones (one partial per token scatter-added).  An RDMA step on the GPU proxy
path stages each chunk on one SM of the sender and applies it on one SM of the receiver, within a
credit window of `depth` chunks (window_rate).  How the simulator charges these terms:
sim/sm_terms.py; how chunk-pipeline and kernel-formation size chunks and pack/unpack roles with
them: passes/chunk_pipeline.py, passes/kernel_formation.py.
"""

from __future__ import annotations

from ..plan import Plan, PlanStep
from .uniform import rows_per_token

THREAD_ENGINES = ("sm", "spc", "tma")
PROXY_MIN_SMS = 4  # blocks of a pack or unpack role at least (and in a plan that does not give them)
FP32_ADD_PER_FLOW_BYTE = 2.0  # a combine flow counts bf16 partials (2 B per channel); its adds are fp32 (4 B)
GATHER_ROWS = 4  # expert rows of one token a combine warp adds in registers before one red.add (the CUDA kernels' kRun)
# fp32 red.add bytes per second that one GPU's memory absorbs, whichever SMs issue them (its own
# combine roles' local adds and its peers' adds over NVLink alike): fitted 2026-11-26 on 4 x H100
# (ep_bench role timelines, results/2026-11-26_4xH100_b.md): h200x4_ubb2x2_50's three weighted
# gather roles (72 SMs) added 426 MB of fp32 in 1.02-1.10 ms, h200x4_2vnode_50's keep, keep_far
# and the peer's intra and fwd 425 MB in 1.00 ms: 400 GB/s, where 72 SMs at the per-SM rate
# alone would add 3x faster.  Not binding at 2 ranks (8 + 8 SMs: 190 GB/s).  Refitted 2026-11-27 on the
# 4 x H200 and 4 x H100 role timelines of the day (ep_bench, results/raw/2026-11-27_4xH*_ep_bench_multihop*.json):
# h200x4_2vnode_50's keep, keep_far and the peer's intra and fwd end at 0.99-1.00 ms, 425 MB (425-430 GB/s);
# h200x4_ubb2x2_50's three gathers and the twin's near_twin and far_twin 640 MB by 1.31 ms (490 GB/s).
RED_BPS = 450e9
# What a peer link carries when the GPU at its far end does nothing while the rows land (the token-major
# dispatch, sim/token_major.py), against what the shipped schedules declare as the link's rate.  NVLink4
# (NV18, 450 GB/s per GPU per direction), two measurements of one link:
# * every SM of a GPU storing 16-byte vectors into its peers, nothing read there: 341 GB/s per GPU
#   (bench/sm_probe.cu, 4 x H200, 2026-11-22, results/2026-11-22_4xH200.md "What limits them");
# * the direct kernels' traffic where the receiving GPU loads the rows as they land (the expert-major
#   combine: 2 GPUs, ~58 MB each way in 0.216-0.223 ms from 48 SMs on, ~270 GB/s; 4 GPUs 268 / 249 GB/s
#   per GPU) and NCCL's all_to_all: what the schedules declare, `efficiency 62 %` = 279 GB/s
#   (schedules/h200x4.sched, end of file).
# The gain is their ratio, applied to the link's declared rate (the plan keeps no raw bandwidth); on
# other links it is an extrapolation.  Checked, not fitted: the token-major dispatch kernels moved 330 GB/s
# (2 x H100, 58.5 MB per rank in 0.176-0.179 ms) and 333-338 GB/s (4 x H100, 159.9 MB in 0.473-0.481 ms)
# of remote rows per rank on 24 SMs, 2026-11-27 (results/raw/2026-11-27_*_ep_bench_token.json timelines).
PEER_STORES_BPS, DECLARED_NVLINK_BPS = 341e9, 279e9
STORE_ONLY_GAIN = PEER_STORES_BPS / DECLARED_NVLINK_BPS


def work_of(step: PlanStep, rates: dict | None = None) -> str:
    """The kind of SM work of a step: `copy` in dispatch; in combine `reduce` for a weighted step
    (a token's expert rows gathered and added) and `add` for an unweighted one (one partial per
    token scatter-added), `reduce` where the topology gives no `add` rate."""
    if step.program != "combine":
        return "copy"
    if step.weighted or (rates is not None and "add" not in rates):
        return "reduce"
    return "add"


def step_sms(plan: Plan) -> dict[tuple[str, str], int]:
    """(program, step) -> the SMs of its role in the program's persistent kernel."""
    out: dict[tuple[str, str], int] = {}
    for k in plan.kernels:
        if k.kind != "kernel":
            continue
        for r in k.roles:
            if r.engine in THREAD_ENGINES and r.sm_end > r.sm_begin:
                out[(k.program, r.step)] = out.get((k.program, r.step), 0) + (r.sm_end - r.sm_begin)
    return out


def proxy_blocks(plan: Plan) -> dict[tuple[str, str], tuple[int, int]]:
    """(program, step) -> (pack, unpack) blocks of each RDMA step on the GPU proxy path."""
    return {(k.program, r.step): (r.pack_sms or PROXY_MIN_SMS, r.unpack_sms or PROXY_MIN_SMS)
            for k in plan.kernels if k.kind == "proxy" for r in k.roles}


def window_rate(chunk: float, depth: int, link_bps: float, latency_s: float, stage_bps: float,
                apply_bps: float, post_s: float = 0.0) -> float:
    """Bytes/s one credit-windowed RDMA channel can sustain: `depth` chunks per round trip of

        chunk / link + chunk / stage + chunk / apply + 2 x latency + post

    (the data's latency and the credit's; `post`, the proxy's host time per chunk), and, the
    proxy posting one chunk after another, at most chunk / post."""
    trip = chunk / link_bps + chunk / stage_bps + chunk / apply_bps + 2 * latency_s + post_s
    rate = max(1, depth) * chunk / trip
    return min(rate, chunk / post_s) if post_s > 0 else rate


def proxy_rates(rates: dict[str, float], step: PlanStep) -> tuple[float, float]:
    """(stage, apply) bytes/s of one SM for a chunk of an RDMA step on the GPU proxy path, in the
    wire's bytes: the sender stages at `copy` (half that for fp32 partials, read at twice the bytes
    they take on the wire as bf16), the receiver applies at the step's kind of work."""
    work = work_of(step, rates)
    return rates["copy"] / (2.0 if work == "add" else 1.0), rates[work]


def red_bytes_per_flow_byte(step: PlanStep, e: float) -> float:
    """fp32 bytes a combine step's adds write per byte of its flows: a flow of partials (one per
    token) adds each as fp32, twice its bf16 bytes; a weighted gather whose flows count expert
    rows (`PlanStep.rows`) adds once per run of up to GATHER_ROWS rows of a token (e rows
    expected), 2 x runs / e."""
    if step.rows and step.weighted:
        return FP32_ADD_PER_FLOW_BYTE * max(1.0, e / GATHER_ROWS) / max(e, 1.0)
    return FP32_ADD_PER_FLOW_BYTE


def sm_rates(plan: Plan) -> dict[str, float]:
    """The topology's per-SM rates, `reduce` bounded by its atomics.  `add` is the rate of one
    red.add of fp32 per bf16 row read (bench/sm_probe.cu `red`: 11.7 GB/s of rows per SM).  A
    weighted combine role gathers a token's expert rows (up to GATHER_ROWS at a time), adds them
    in registers and issues one red.add per element for all of them, so it reads at most
    add x min(rows, GATHER_ROWS) bytes per second, rows = the expected rows per token (the
    probe's `gred`: 22 GB/s per SM at 2 rows, 40 at 4).  `reduce` as declared holds where that is
    higher, as in the shipped schedules (4 ranks, top-8 of 256: 2.2 rows, 12 x 2.2 = 26 GB/s
    against 23); a plan whose tokens have one row per rank is bound at `add`.  Without a
    workload (no rows per token) `reduce` holds."""
    rates = dict(plan.sm_rates)
    if "reduce" in rates and "add" in rates and plan.workload is not None:
        rows = min(rows_per_token(plan), float(GATHER_ROWS))
        rates["reduce"] = min(rates["reduce"], rates["add"] * rows)
    return rates
