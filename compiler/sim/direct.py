"""The direct kernels in the cost model: one pool of SMs per rank and program.

The CUDA target lowers a one-hop plan inside one CUDA IPC domain to "direct" kernels
(plan/direct.py decides, kernel-formation records `Plan.direct`; backends/cuda/direct.py writes
them): per program one persistent kernel on N SMs whose warps have no fixed
role.  In dispatch every warp sends tokens (a token's row stored once into each peer GPU it hits,
at its first expert row there, and into every expert row of its own GPU), then replicates the rows
received from peers into their other expert rows.  In combine every warp reduces the expert rows
of each (token, GPU) record into one weighted partial stored on the token's home GPU, then sums
the partials of home tokens into the output.  So all steps of a program share one pool of N SMs
on each rank, and what bounds them is what those SMs store, load and reduce, not a role's share
of SMs (sim/sm_terms.py models the table-driven kernels' roles).

with_direct_pool(plan, kernels), from the topology's `sm` line (per SM: `copy` bytes stored,
`read` bytes loaded, `reduce` bytes of rows loaded and added in fp32; `launch` per kernel launch):

* `sm:<program>:<rank>`, capacity N x copy: every flow charges the pools of the ranks whose SMs
  work on it, in copy-equivalent bytes (a byte stored costs 1, loaded copy / read, reduced
  copy / reduce).  With e = the expected expert rows of a token on a GPU it hits
  (rows_per_token) and h = the expected GPUs a token hits (ranks_per_token), one token of a flow
  costs, in SM-seconds:

  - dispatch to a peer: the sender loads the row (once for the h GPUs it goes to: 1/h of a
    load) and stores it once; the receiver loads it and stores its other e - 1 rows:
    sender 1/copy + 1/(h read), receiver 1/read + (e - 1)/copy;
  - dispatch to its own GPU (the permute): the sender stores all e rows: e/copy + 1/(h read);
  - combine from the expert GPU to the home GPU: the expert GPU reduces the e rows and stores one
    partial, e/reduce + 1/copy; the home GPU reduces the partial and, once per token (1/h of it
    per partial), stores the output row, 1/reduce + 1/(h copy).  A local record (the reverse
    of the permute) charges both to its one pool.

  A flow counting rows (`PlanStep.rows`: the permute and its reverse) carries 1/e token per byte,
  one counting tokens (the sends, deduplicated) 1.  Without `read` loads cost nothing; without
  `reduce`, `copy` stands in.
* `hbm:<rank>` (where the plan has a local link): the rows written into the rank's memory, by
  its own SMs or a peer's (dispatch: e per token; combine: the partial, and 1/h of the output row
  per partial).  Loads are not charged: the measured dispatch stops at ~1.9 TB/s of row writes
  however many SMs write, while a combine loads more than that (bench/README).
* Links carry a flow's bytes as the plan has them.
* The kernels do not chunk (no credits, nothing to wait for between chunks): a flow pays its
  latency once; chunk size and count are dropped.
* A program's first steps become ready after one `launch` (a later launch queues behind the
  running kernel: folding the two metadata kernels into the dispatch kernel, three launches to
  one, changed no measured time on 2 x H200, 2026-11-23) and, for a dispatch, its metadata passes
  (one pass counts a chunk of tokens; above one chunk a second pass finishes the chunks' ranks)
  as meta_s charges them: the `sm` line's `meta` for the first pass, META_FINISH_S for a second,
  and META_PEER_S per peer rank.  The pass that publishes (meta_publish in
  backends/cuda/include/epcc/direct/meta.cuh) stores its counts, channel ranges and shape into
  every peer's meta area; after one barrier, thread d releases peer d's flag (the peers' flags in
  parallel, since 2026-11-27; before, one thread raised them one after another, each release a
  system fence, ~2 us per peer); every dispatch block then waits for all R senders' flags.  A
  cached dispatch (no metadata passes) does none of it.
* The last wave is not hidden (`drain`): a warp's second-phase work on a record (replicating it;
  summing its partial) waits for its first phase (the send; the reduction on the expert's GPU),
  which the fluid pools overlap perfectly.  At the end of a program one wave of first-phase work
  per SM, min(warps, records per SM) records at the SM's rates, still has its second phase
  ahead; each flow between two GPUs ends that much after its last byte (Flow.tail_s).  It is
  what the fluid model misses at 128-1024 tokens (the token and SM sweeps of 2026-11-23), little at
  4096.

Expected rows and GPUs per token are those of uniform routing, as in sim/sm_terms.py.

A token-major plan (the workload's `layout token`) runs the token-major kernels, in the same pool,
with the same launches and metadata: one row per (token, GPU), no replication; its flows' bytes,
SM work, memory writes, link rate and drain are sim/token_major.py's.
"""

from __future__ import annotations

import dataclasses

from ..costmodel.uniform import ranks_per_token, rows_per_token
from ..plan import DirectKernels, Flow, Plan, PlanStep
from . import token_major as tok

# A fresh dispatch's metadata beyond the `sm` line's `meta` (the first pass), seconds (the module
# docstring), fit to the fresh-minus-cached dispatch of the ep_bench reports run after the flags went
# parallel (rows epcc and epcc_cached, the same kernel but for the metadata; 24 SMs, 2026-11-27,
# results/raw/*_decode.json).  128 tokens, one pass inside the dispatch kernel: 6.0 / 6.3 us on
# 2 x H100 (token- / expert-major), 6.9 / 6.8 on 4 x H100: `meta` 5.8 us + 0.35 x (R - 1) in least
# squares, ~flat in the peers (a stamped probe, 2 x H100, token-major, 24 blocks: block 0 counts in
# 3.3 us, publishing ends 2.1 us later; 5.5 us before).  Before the change the gap rose 2 us per peer
# (9.6 us on 2 x H100, 13.5-14.4 on 4 x H100).
META_PEER_S = 0.35e-6
# The second pass of a dispatch above one chunk of tokens (meta_count_kernel over the chunks, then
# meta_finish_kernel: CUPTI 6.0 and 11.7 us on 2 x H200, 2026-11-23, bench/kernel_times.py), beyond
# the first pass's `meta`: the 4096-token gaps of the same runs, 19.6 / 22.1 us on 2 x H100 (token- /
# expert-major), less 5.8 + 0.35: 14.7 us.  The 4096-token runs before the change measured 22-25 us
# on 2 x H100 and 28-30 on 4 x H100 (2026-11-27: the flags then ~2.5 us per peer).
META_FINISH_S = 14.7e-6


def sm_seconds(program: str, src: int, dst: int, e: float, h: float,
               rates: dict[str, float]) -> list[tuple[int, float]]:
    """(rank, SM-seconds) per byte of token (dispatch) or partial (combine) that a flow of
    `program` from `src` to `dst` costs each rank's pool (the module docstring): the first phase's
    rank first; a rank may appear twice."""
    copy = rates["copy"]
    if program == "combine":
        red = rates.get("reduce", copy)
        return [(src, e / red + 1.0 / copy), (dst, 1.0 / red + 1.0 / (h * copy))]
    load = 1.0 / rates["read"] if "read" in rates else 0.0
    if src != dst:
        return [(src, 1.0 / copy + load / h), (dst, load + (e - 1.0) / copy)]
    return [(src, e / copy + load / h)]


def drain_s(plan: Plan, program: str, kernels: DirectKernels, e: float, h: float) -> float:
    """The last wave of `program`'s first-phase work on one SM (the module docstring): min(warps,
    records per SM) records, each one row sent (dispatch: stored once, loaded 1/h of a time) or
    reduced from its e rows and stored (combine), at the `sm` line's rates; 0 without them."""
    wl, rates, n = plan.workload, plan.sm_rates, kernels.sms.get(program, 0)
    if wl is None or not n or "copy" not in rates:
        return 0.0
    row = wl.hidden * 2 if program == "combine" else plan.bytes_per_token  # combine: bf16 partials
    (_, first), _ = sm_seconds(program, 0, 1, e, h, rates)  # a record to another GPU, its first phase
    per_record = row * first
    records = wl.tokens * h / n
    return min(float(kernels.warps.get(program, 16)), records) * per_record


def with_direct_pool(plan: Plan, kernels: DirectKernels) -> tuple[Plan, dict[str, float]]:
    """(a copy of `plan` whose flows charge their ranks' SM pools and HBM as the direct kernels
    do, the seconds of kernel launches before each program's first step)."""
    rates = dict(plan.sm_rates)
    e, h = rows_per_token(plan), ranks_per_token(plan)
    token = tok.is_token_major(plan)
    resources = dict(plan.resources)
    steps: list[PlanStep] = []
    drains = {p: program_drain_s(plan, p, kernels) for p in {s.program for s in plan.steps}}
    for s in plan.steps:
        n = kernels.sms.get(s.program, 0)
        # tokens (partials) per byte of the flow; a token-major flow counts rows of its own (one per token)
        per_byte = 1.0 if token else 1.0 / e if s.rows else 1.0
        link = tok.link_weight(s.program) if token else 1.0
        flows: list[Flow] = []
        for f in s.flows:
            if not f.resources or f.bytes <= 0:
                flows.append(f)
                continue
            if token:
                f = dataclasses.replace(f, bytes=tok.row_bytes(plan, s, f.bytes, e))
            charge: dict[str, float] = {r: link if r.startswith("link:") else 1.0
                                        for r in dict.fromkeys(f.resources) if not r.startswith("hbm:")}
            if n and "copy" in rates:
                secs = tok.sm_seconds(s.program, f.src, f.dst, h, rates) if token else \
                    sm_seconds(s.program, f.src, f.dst, e, h, rates)
                for rank, sec in secs:
                    pool = f"sm:{s.program}:{rank}"
                    resources[pool] = n * rates["copy"]
                    charge[pool] = charge.get(pool, 0.0) + per_byte * sec * rates["copy"]
            hbm = f"hbm:{f.dst}"
            if hbm in plan.resources:
                charge[hbm] = tok.hbm_bytes(s.program, f.src == f.dst, h) if token else \
                    per_byte * (1.0 + 1.0 / h if s.program == "combine" else e)
            flows.append(dataclasses.replace(f, resources=tuple(charge), weights=tuple(charge.values()),
                                             tail_s=f.tail_s + (drains[s.program] if f.src != f.dst else 0.0)))
        steps.append(dataclasses.replace(s, flows=flows, chunk_bytes=None, num_chunks=1, depth=1,
                                         completion_lag=0.0))
    starts = {p: min(1, kernels.launches.get(p, 0)) * plan.sm_launch_s + meta_s(plan, kernels.meta_passes.get(p, 0))
              for p in {s.program for s in plan.steps}}
    return dataclasses.replace(plan, steps=steps, resources=resources), starts


def program_drain_s(plan: Plan, program: str, kernels: DirectKernels) -> float:
    """The drain of `program`'s last wave: the token-major kernels' (sim/token_major.py) or the
    expert-major ones' (drain_s)."""
    h = ranks_per_token(plan)
    if tok.is_token_major(plan):
        return tok.drain_s(plan, program, kernels, h)
    return drain_s(plan, program, kernels, rows_per_token(plan), h)


def meta_s(plan: Plan, passes: int) -> float:
    """Seconds of a program's metadata before its rows move: the `sm` line's `meta` for the first
    pass, META_FINISH_S for each later one, and, where there is a pass, META_PEER_S per peer rank
    (the module docstring); none without the `meta` time (a topology that does not charge the
    metadata)."""
    if not passes or not plan.sm_meta_s:
        return 0.0
    return plan.sm_meta_s + (passes - 1) * META_FINISH_S + max(0, plan.num_ranks - 1) * META_PEER_S


def describe(plan: Plan, kernels: DirectKernels | None) -> dict:
    """The SM model `simulate` applies to `plan`, for the report: model = direct (one pool per rank
    and program), roles (kernel-formation's SM ranges, sim/sm_terms.py) or links (no SM rates)."""
    rates = {k: v / 1e9 for k, v in plan.sm_rates.items()}
    rate_text = ", ".join(f"{k} {v:g} GB/s" for k, v in rates.items())
    if kernels is not None:
        progs = [p for p in ("dispatch", "combine") if p in kernels.sms] + \
            sorted(p for p in kernels.sms if p not in ("dispatch", "combine"))
        token = tok.is_token_major(plan)
        drains = {p: program_drain_s(plan, p, kernels) for p in progs}

        def costs(p: str) -> str:  # a program's launches, metadata passes and drain, in words
            n, m = kernels.launches.get(p, 0), kernels.meta_passes.get(p, 0)
            text = f"{n} launch{'es' if n != 1 else ''}"
            if m:
                text += f", {m} metadata pass{'es' if m != 1 else ''}"
            return text + (f", drain {drains[p] * 1e6:.1f} us" if drains[p] else "")

        per_program = {p: costs(p) for p in progs}
        per = "; ".join(f"{p} {kernels.sms[p]} SMs, {per_program[p]}" for p in progs)
        kind = "token-major direct kernels" if token else "direct kernels"
        if "copy" in plan.sm_rates:
            times = f"launch {plan.sm_launch_s * 1e6:g} us" + \
                (f", meta {plan.sm_meta_s * 1e6:g} us (a second pass {META_FINISH_S * 1e6:g} us) + {META_PEER_S * 1e6:g} us "
                 f"per peer rank" if plan.sm_meta_s else "")
            text = (f"{kind}: one pool of SMs per rank and program, shared by its steps ({per}; "
                    f"sm {rate_text}; {times})")
        else:
            text = f"{kind} ({per}), no SM pool: the topology gives no `sm` copy rate"
        if token:
            text += (f"; one row per token and GPU ({tok.token_row_bytes(plan, 'dispatch')} B in dispatch), no "
                     f"replication, the dispatch's peer links at {tok.STORE_ONLY_GAIN:.2f} x their rate "
                     f"(sim/token_major.py)")
        return {"model": "direct", "layout": "token" if token else "expert", "text": text, "sms": dict(kernels.sms),
                "launches": dict(kernels.launches),
                "meta_passes": dict(kernels.meta_passes), "drain_us": {p: d * 1e6 for p, d in drains.items()},
                "per_program": per_program,
                "rates_gbps": rates, "launch_us": plan.sm_launch_s * 1e6, "meta_us": plan.sm_meta_s * 1e6}
    if plan.sm_rates or plan.atomics:
        text = "SM roles of the table-driven kernels (kernel-formation's SM ranges)" + \
            (f"; sm {rate_text}" if rate_text else "; link atomics only")
        return {"model": "roles", "text": text, "rates_gbps": rates}
    return {"model": "links", "text": "links only: the topology gives no `sm` rates", "rates_gbps": rates}


__all__ = ["META_FINISH_S", "META_PEER_S", "describe", "drain_s", "meta_s", "program_drain_s", "sm_seconds", "with_direct_pool"]
