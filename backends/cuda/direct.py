"""The direct lowering: one-hop plans inside one CUDA IPC domain as fused, warp-specialized kernels.

Which plans are direct (the one-hop shape: DeepEP's intranode h200x4.sched) and their launch
configuration are decided with the plan (epcc/plan/direct.py, recorded by kernel-formation in
`Plan.direct`).  For those plans this module replaces the general table-driven kernels
(codegen.py) with kernels written for the shape (templates/direct.cu.j2):

* the metadata step runs on the GPU (meta_count_kernel, and meta_finish_kernel when there is more than
  one chunk of META_CHUNK tokens; up to one chunk, decode, the dispatch kernel's block 0 does it,
  so a decode dispatch is one launch): per-expert ranks and counts, per-destination dedup
  indices, exchanged through peer memory with one release flag per peer: no host sync;
* dispatch sends each token once per destination GPU (deduplicated: 2.7 of 8 rows per token on
  the wire for top-8 of 256 over 4 GPUs), warp loads and 16-byte stores into the destination's
  expert-major output at the token's first row there (bench/sm_probe.cu measured bulk copies
  slower per SM); on the destination, every warp that has no channel left to send replicates it
  into its other rows as per-channel tails advance;
* combine reduces each (token, GPU) record into one weighted bf16 partial on the expert's GPU and
  stores it into the home GPU's staging area, where the home GPU sums the partials in fp32 (every
  warp, once no record is left to reduce); both read rows through a per-warp shared-memory ring
  of cp.async loads (COMBINE_RING vectors per lane), so an SM keeps 192 KB of rows in flight
  without spending registers on them.

Blocks have no fixed role: one SM writes ~46-50 GB/s whatever it writes (sm_probe), so a fixed
sender/receiver split (14+10 was the best of 24 SMs on 2 GPUs) leaves SMs idle while the other
side finishes; a warp goes from sending to replicating (from partials to sums) when its first
kind of work runs out.

Every code-generation decision (sizes, offsets, ring depths) is made here; the template lays out
text.  The runtime (runtime/engines/cuda_direct) needs only the generated source and the manifest
entry.
"""

from __future__ import annotations

from dataclasses import asdict

from epcc.plan import Plan
from epcc.plan.direct import (COMBINE_RING, COMBINE_THREADS, DISPATCH_THREADS, FP8_GROUP, MAX_CHANNELS, MAX_WARPS,
                              META_CHUNK, META_SHARED, META_THREADS, DirectError, default_config, program_steps)

ABI = 2
ALIGN_MAX = 128  # largest per-expert row alignment a caller may ask for (grouped-GEMM padding)
PUBLISH_EVERY = 4  # tokens a sender warp copies between two releases of its tails
COMBINE_BATCH = 4  # records an expert-side warp reduces between two releases of its queue's progress
MAX_SMEM = 227 * 1024  # dynamic shared memory one block may have (sm_90)
TIMELINE_BLOCKS = 256  # blocks per kernel with a slot in the role timeline
TIMELINE_WORDS = 1 + MAX_WARPS  # a block's start, then the end of each warp's role

WAITS = [
    ("META", "dispatch: metadata flag of rank a"),
    ("RECV_TAIL", "dispatch receiver: records of rank a, channel b"),
    ("COMBINE_TAIL", "combine: partials from rank a, channel b"),
]


def ring_stages(nmax: int, ring: int = COMBINE_RING) -> list[int]:
    """S(N) for N = 1..nmax rows: the ring slots of a reduction of N rows, each slot N vectors per
    lane; S - 1 steps in flight, S x N <= ring, at least 2 (one being summed, one coming)."""
    if ring < 2 * nmax:
        raise DirectError(f"a combine ring of {ring} vectors per lane cannot double-buffer {nmax} rows")
    return [ring // n for n in range(1, nmax + 1)]


def row_parts(plan: Plan) -> tuple[int, int]:
    """(payload bytes, scale bytes) of one dispatched row."""
    wl = plan.workload
    if wl.dtype == "fp8":
        return wl.hidden, wl.hidden // FP8_GROUP * 4
    return 2 * wl.hidden, 0


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


def constants(plan: Plan) -> dict:
    """Everything the template needs, offsets of the peer region included."""
    wl = plan.workload
    R, E, K, H, T = plan.num_ranks, wl.experts, wl.topk, wl.hidden, wl.tokens
    epr = E // R
    kl = min(K, epr)
    ri = _round(2 + kl, 4)
    xb, sb = row_parts(plan)
    cap = R * T * kl + epr * (ALIGN_MAX - 1)
    offs: list[tuple[str, int]] = []
    cur = 0

    def put(name: str, nbytes: int, align: int = 4096) -> None:
        nonlocal cur
        cur = _round(cur, align)
        offs.append((name, cur))
        cur += nbytes

    meta_flags = 0
    meta_counts = _round(R * 8, 256)
    meta_channels = meta_counts + _round(R * E * 4, 256)
    meta_stride = _round(meta_channels + R * MAX_CHANNELS * 2 * 4, 4096)
    put("OFF_STATE", 256 + 8 * (epr + 1))
    put("OFF_META", 2 * meta_stride)
    put("OFF_DTAIL", R * MAX_CHANNELS * 8)
    put("OFF_CTAIL", R * MAX_CHANNELS * 8)
    put("OFF_RANK_TJ", T * K * 4)
    put("OFF_DEDUP", T * R * 4)
    put("OFF_MYCHAN", (MAX_CHANNELS + 1) * R * 4)
    put("OFF_CHUNKS", -(-T // META_CHUNK) * (E + R + 1) * 4)
    put("OFF_RECORDS", R * T * ri * 4)
    put("OFF_RECV_W", cap * 4)
    put("OFF_RECV_X", cap * xb)
    put("OFF_RECV_S", cap * sb)
    put("OFF_CSTAGE", R * T * H * 2)
    end = _round(cur, 4096)
    offsets = offs + [("META_STRIDE", meta_stride), ("META_FLAGS", meta_flags), ("META_COUNTS", meta_counts),
                      ("META_CHANNELS", meta_channels), ("OFF_END", end)]
    return {
        "abi": ABI, "num_ranks": R, "experts": E, "experts_per_rank": epr, "topk": K, "max_local": kl,
        "hidden": H, "max_tokens": T, "max_channels": MAX_CHANNELS, "record_ints": ri, "x_bytes": xb,
        "scale_bytes": sb, "publish_every": PUBLISH_EVERY, "max_warps": MAX_WARPS,
        "dispatch_threads": DISPATCH_THREADS, "combine_threads": COMBINE_THREADS, "capacity": cap,
        "placement": wl.placement, "dtype": wl.dtype, "align_max": ALIGN_MAX,
        "meta_chunk": META_CHUNK, "meta_threads": META_THREADS, "meta_shared": META_SHARED,
        "combine_batch": COMBINE_BATCH,
        "timeline_blocks": TIMELINE_BLOCKS, "timeline_words": TIMELINE_WORDS,
        "combine_ring": COMBINE_RING, "max_smem": MAX_SMEM, "expert_stages": ring_stages(kl), "home_stages": ring_stages(R),
        "offsets": offsets, "region_bytes": end,
        "waits": [{"key": k, "text": t} for k, t in WAITS],
    }


def describe_steps(plan: Plan) -> list[dict]:
    out = []
    for s in plan.steps:
        if s.verb == "exchange":
            low = (f"meta_count_kernel (+ meta_finish_kernel above one chunk; up to {META_CHUNK} tokens dispatch_kernel's "
                   "block 0): counts and ranks on the GPU, exchanged through peer memory")
        elif s.program == "dispatch" and s.verb == "send":
            low = "dispatch_kernel: warps send (one row store per destination GPU), then replicate received rows"
        elif s.program == "dispatch":
            low = "dispatch_kernel senders with this rank as destination (local permute)"
        elif s.link_kind == "p2p":
            low = "combine_kernel: weighted partial per (token, GPU) into the home GPU's staging (first)"
        else:
            low = "combine_kernel: home-side sum of the partials (own partial included; every warp, after its partials)"
        out.append({"program": s.program, "name": s.name, "line": s.line, "title": s.title, "lowered": low})
    return out


def generate(plan: Plan, source: str, env, version: str) -> tuple[str, dict]:
    """(the .cu text, the manifest's `direct` entry); DirectError when the plan is not direct
    (kernel-formation recorded why not in `Plan.direct_not_used`)."""
    if plan.direct is None:
        raise DirectError(plan.direct_not_used or "the plan does not record its direct kernels (recompile it)")
    c = constants(plan)
    disp, comb = program_steps(plan, "dispatch"), program_steps(plan, "combine")
    meta = next((s for s in disp if s.verb == "exchange"), None)
    push = next(s for s in disp if s.verb == "send")
    keep = next((s for s in disp if s.verb == "permute"), None)
    cpush = next((s for s in comb if s.link_kind == "p2p"), comb[0] if comb else push)
    ckeep = next((s for s in comb if s is not cpush), None)
    steps = describe_steps(plan)
    text = env.get_template("direct.cu.j2").render(
        schedule=plan.schedule, source=source, version=version, c=c, steps=steps,
        meta_step=meta or push, push_step=push, keep_step=keep, combine_push=cpush, combine_keep=ckeep)
    cfg = default_config(plan)
    file = f"{plan.schedule}_direct.cu"
    entry = {
        "abi": ABI,
        "source": file,
        "library": f"lib{plan.schedule}_direct.so",
        "constants": {**{k: v for k, v in c.items() if k not in ("offsets", "waits")},
                      "offsets_named": dict(c["offsets"])},
        "waits": [t for _, t in WAITS],
        "config": asdict(cfg),
        "steps": steps,
    }
    return text, entry
