"""SM throughput in the cost model, when the topology declares it (`sm copy 44 GB/s, reduce 23 GB/s, add 12 GB/s`).

Links alone do not bound a step that SMs drive: a role of N SMs moves at most N x the per-SM
rate of its kind of work, whatever the link could carry.  Three terms, added to a copy of the
plan before simulating (each one more resource on the flows concerned, so the fair-share engine
treats them like links):

* `sm:<program>.<step>:<rank>`, capacity N x rate: every flow a rank executes for a step that
  runs as a role of the persistent kernel (kernel-formation's roles give N).  The kind of work is
  `copy` in dispatch; in combine `reduce` for weighted steps (a token's expert rows gathered and
  added into its fp32 partial) and `add` for unweighted ones (one partial per token added with
  atomics into another; `reduce` when the topology gives no `add` rate).  A send or pull into
  or out of `output` whose flows count one copy per token (not `PlanStep.rows`) still writes
  (dispatch) or reads (combine) every expert row of the token in the role kernels: capacity
  N x rate / rows per token, in the flows' bytes.
* `atomics:<link>:<src>><dst>`, capacity = the link's `atomics` rate / 2: every flow of a combine
  step that adds into another GPU over a link declaring one (fp32 red.add saturates per GPU pair
  below what stores reach; a flow counts bf16 partials, its adds are fp32, twice the bytes).  Not
  for an RDMA step on the GPU proxy path (the receiver applies a landed chunk with local adds).
* `window:<program>.<step>:<src>><dst>`, capacity depth x chunk / round trip: every flow of an
  RDMA step with a chunk size.  The GPU proxy path (docs/rdma.md) stages a chunk on one SM of the
  sender (`copy`; half that for fp32 partials, which the SM reads at twice the bytes they take
  on the wire as bf16), writes it, and the receiver applies it on one SM (the step's kind of
  work) before its credit goes back; with `depth` chunks in flight per channel the channel
  moves at most depth x chunk per

      chunk / link + chunk / stage + chunk / apply + 2 x latency + post

  (the data's latency and the credit's; `post`, the link's host time per chunk on the proxy,
  0 where the topology declares none), and, the proxy posting one chunk after another, at most
  chunk / post.  The term is added only where it binds (below the link).  On the GPU machine's
  emulated transport `post` is ~10 us: 2 x H200, h200x2_2vnode at 400 GB/s, 16-token chunks
  take ~10 us each whatever the depth, and the proxy finds 11-15 chunks waiting per FIFO pass
  (ep_bench's proxy line, docs/rdma.md; 2026-11-23).

* `post:<program>.<step>:<rank>`, capacity chunk / post: every flow of an RDMA step that a rank's
  proxy posts (its sends) where the link declares `post`.  One proxy thread posts for every
  channel of the rank, so a rank writing to several peers shares the chunk / post of the window
  term among them (in the shipped plans a rank has one RDMA peer per step: no difference).
* `pack:<program>.<step>:<rank>` and `unpack:<program>.<step>:<rank>`, capacity N x the stage or
  apply rate: every flow of an RDMA step on the GPU proxy path, on its sender and its receiver.
  The sender's chunks are packed by the step's pack role, N = `RolePlan.pack_sms` blocks, each
  chunk on one of them, and applied by the receiver's unpack role (`unpack_sms`): whatever the
  window, a rank moves no more than its blocks do (kernel-formation sizes them for the link;
  4 each in a plan from before it did, which held a combine's unpack at 50 GB/s to ~43 GB/s).

A chunk is the work of one SM (a role hands out chunks, not bytes, to its blocks).  A role's
chunks in flight have moved bytes but are not complete: `PlanStep.completion_lag` = k x chunk /
bytes (at most 1) holds a pipelined consumer back by that fraction more, k the chunks in flight.
A role whose input is all there when it starts runs in waves, one chunk per SM: k = N.  A role
that consumes a producer's chunks as they come runs no faster than its slowest pipelined
ancestor alone (its `floor`: the longest time alone, last-chunk tails left out, along its
pipelined dependencies), and by Little's law holds rate x (chunk / per-SM rate) bytes in
flight: k = rate / per-SM rate, at least 1 and at most N (a role behind a 50 GB/s NIC copying at
44 GB/s per SM has one chunk in flight, not one per SM).  Such a role (a pipelined dependency)
also gets the producer's last chunk when the producer ends, and that
chunk is one SM's work: the fluid model spreads it over all N SMs, so the role's flows get a tail
of chunk / rate x (1 - 1/N).  (A role that is not pipelined behind a producer ends its last wave
with the fluid model's last byte: no tail.)  An RDMA channel's chunks are serial on one link: its first chunk
is staged and posted before the wire moves a byte, a lead of chunk / stage + post (Flow.lead_s),
its last chunk is applied after the wire, a tail of chunk / apply, and its lag is the bytes the
link moves while one chunk is applied (the others are staged while the wire carries earlier
ones).  Modelled as a tail without `post` instead (the same total), the dispatch's keep_far at
400 GB/s was simulated to start at 0.05 ms; it started at 0.14-0.17 on 2 x H200 (2026-11-23).  A ramped role (PlanStep.ramp_head / ramp_tail, chunk-pipeline) counts
its first chunk, 1 / 2^ramp_head of one, in its lag, and spreads the producer's last chunk over
min(N, 2^ramp_tail) SMs in its tail.  Chunks are counted in the flows'
bytes: a chunk of a step whose flows count rows and that reads or writes `output` (a permute, its
reverse) holds a chunk's tokens with all their expert rows, chunk bytes x the expected rows per
token (uniform routing: topk / ranks / P(a token hits the rank)); a send's chunk its tokens once.

`epcc simulate --rdma emulate` (SimOptions.rdma_proxy False) leaves the RDMA terms out: the
table kernels' default lowering runs an RDMA step as paced SM roles writing the peer directly,
with no staging, no credits and no proxy.  Their blocks replay one serial link of the plan's rate
whose chunks land a latency after their last byte (device.cu.j2 PacedLink), so such a flow pays
one latency, as a tail, not one per window of chunks.

Without an `sm` line in the topology the plan is simulated as it is: links only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from ..costmodel.rates import (FP32_ADD_PER_FLOW_BYTE, PROXY_MIN_SMS, RED_BPS, proxy_blocks, proxy_rates,
                               red_bytes_per_flow_byte, sm_rates, step_sms, window_rate, work_of)
from ..costmodel.uniform import rows_per_token
from ..plan import Plan, PlanStep
from .base import SimOptions
from .engine import step_alone


def with_sm_terms(plan: Plan, rdma_proxy: bool = True) -> Plan:
    """A copy of `plan` whose flows also occupy their SM and (rdma_proxy) RDMA-window resources
    (the plan itself when the topology gives neither SM rates nor link atomics)."""
    rates = sm_rates(plan)
    if not rates and not plan.atomics:
        return plan
    resources = dict(plan.resources)
    sms = step_sms(plan)
    sides = proxy_blocks(plan)
    expand = rows_per_token(plan)
    steps: list[PlanStep] = []
    for s in plan.steps:
        work = work_of(s, rates)
        n = sms.get((s.program, s.name), 0)
        step_chunk = _role_chunk(s, expand)
        per_byte = sm_bytes_per_flow_byte(s, expand)
        atomics = _atomics(plan, s, rdma_proxy)
        post_s = plan.post_s.get(s.link or "", 0.0)
        channels = Counter(f.src for f in s.flows if f.resources and f.bytes > 0)  # per sending rank
        lag = 0.0
        flows = []
        for f in s.flows:
            extra: list[str] = []
            tail = lead = 0.0
            latency = f.latency_s
            chunk = min(step_chunk, f.bytes)  # no chunk size: no chunk terms (lag, tail)
            if n and work in rates and f.resources and f.bytes > 0:
                name = f"sm:{s.program}.{s.name}:{f.rank}"
                resources[name] = n * rates[work] / per_byte
                extra.append(name)
                lag = max(lag, min(1.0, n * first_chunk(s, chunk) / f.bytes))
                if s.pipelined_deps:  # the producer's last chunk, on as many SMs as the ramped tail gives it
                    tail += chunk * per_byte / rates[work] * max(0.0, 1.0 / min(n, 2 ** s.ramp_tail) - 1.0 / n)
            if atomics and f.resources and f.bytes > 0 and f.src != f.dst:
                name = f"atomics:{s.link}:{f.src}>{f.dst}"
                resources[name] = atomics / FP32_ADD_PER_FLOW_BYTE
                extra.append(name)
            if not rdma_proxy and s.link_kind == "rdma" and s.chunk_bytes and f.resources and f.bytes > 0:
                latency, tail = 0.0, tail + f.latency_s  # the paced roles' one link: one latency, pipelined
            if (rdma_proxy and s.link_kind == "rdma" and s.chunk_bytes and f.resources and f.bytes > 0
                    and "copy" in rates and work in rates):
                link_bps = min(resources[r] for r in f.resources)
                stage_bps, apply_bps = proxy_rates(rates, s)
                cap = window_rate(s.chunk_bytes, s.depth, link_bps, f.latency_s, stage_bps, apply_bps, post_s)
                if cap < link_bps:
                    name = f"window:{s.program}.{s.name}:{f.src}>{f.dst}"
                    resources[name] = cap
                    extra.append(name)
                if post_s > 0 and channels[f.src] > 1:
                    name = f"post:{s.program}.{s.name}:{f.src}"
                    resources[name] = s.chunk_bytes / post_s
                    extra.append(name)
                pack, unpack = sides.get((s.program, s.name), (PROXY_MIN_SMS, PROXY_MIN_SMS))
                for side, rank, blocks, bps in (("pack", f.src, pack, stage_bps), ("unpack", f.dst, unpack, apply_bps)):
                    name = f"{side}:{s.program}.{s.name}:{rank}"
                    resources[name] = blocks * bps
                    extra.append(name)
                # The first chunk is staged and posted before the wire moves a byte (the flow's
                # lead); the last one is applied after it (its tail).  Staging the others overlaps
                # the wire, and a consumer trails the wire by the chunk being applied (its lag).
                lead = chunk / stage_bps + post_s
                tail = chunk / apply_bps
                lag = max(lag, min(1.0, chunk / apply_bps * min(cap, link_bps) / f.bytes))
            weights: tuple[float, ...] = ()
            if n and s.program == "combine" and work in rates and f.resources and f.bytes > 0:
                # the fp32 adds land in the receiving GPU's memory, which absorbs RED_BPS of them
                name = f"red:{f.dst}"
                resources[name] = RED_BPS
                base = f.weights or tuple(1.0 for _ in dict.fromkeys(f.resources))
                listed = f.resources if f.weights else tuple(dict.fromkeys(f.resources))
                f = dataclasses.replace(f, resources=listed, weights=base)
                extra.append(name)
                weights = base + tuple(1.0 for _ in extra[:-1]) + (red_bytes_per_flow_byte(s, expand),)
            flows.append(dataclasses.replace(f, resources=f.resources + tuple(extra), tail_s=f.tail_s + tail,
                                             lead_s=f.lead_s + lead, weights=weights or f.weights, latency_s=latency)
                         if extra or tail or lead else f)
        steps.append(dataclasses.replace(s, flows=flows, completion_lag=lag))
    return _little_lags(plan, steps, resources, rates, sms, expand)


def first_chunk(s: PlanStep, chunk: float) -> float:
    """The first chunk of a role whose chunks are `chunk`: 1 / 2^ramp_head of it where the step
    ramps its head (plan.chunk_sizes)."""
    return chunk / 2 ** s.ramp_head


def _touches_output(s: PlanStep) -> bool:
    return "output" in s.src_buffers or s.dst_buffer == "output"


def _role_chunk(s: PlanStep, expand: float) -> float:
    """One chunk of a role in its flows' bytes (0 without a chunk size): a chunk of a step whose
    flows count rows (`PlanStep.rows`) and that reads or writes `output` holds its tokens with
    all their expert rows (module docstring); a step whose flows count tokens counts a chunk's
    tokens once."""
    return (s.chunk_bytes or 0.0) * (expand if s.rows and _touches_output(s) else 1.0)


def sm_bytes_per_flow_byte(s: PlanStep, expand: float) -> float:
    """Bytes an SM moves per byte of the step's flows: a send or pull into or out of `output`
    whose flows count one copy per token still writes (dispatch) or reads (combine) every expert
    row of it in the role kernels, `expand` rows; everything else moves what the flows count."""
    return expand if _touches_output(s) and not s.rows else 1.0


def _atomics(plan: Plan, s: PlanStep, rdma_proxy: bool) -> float:
    """The `atomics` rate (fp32 bytes/s per GPU pair) that bounds a combine step adding into
    another GPU's memory over its link; 0 where none is declared, and for an RDMA step that the
    GPU proxy path runs (the receiver applies a landed chunk with its own, local, adds)."""
    if s.program != "combine" or s.link is None or (rdma_proxy and s.link_kind == "rdma"):
        return 0.0
    return plan.atomics.get(s.link, 0.0)


def _little_lags(plan: Plan, steps: list[PlanStep], resources: dict[str, float], rates: dict[str, float],
                 sms: dict, expand: float) -> Plan:
    """The plan with `steps`, a pipelined role's wave lag (N chunks in flight) lowered to the
    chunks its floor rate keeps in flight (module docstring)."""
    by_name = {(s.program, s.name): s for s in steps}
    floors: dict[tuple[str, str], float] = {}

    def floor(key: tuple[str, str]) -> float:
        if key not in floors:
            s = by_name[key]
            up = [floor((s.program, d)) for d in s.pipelined_deps if (s.program, d) in by_name]
            moving = dataclasses.replace(s, flows=[dataclasses.replace(f, tail_s=0.0, lead_s=0.0) for f in s.flows])
            floors[key] = max([step_alone(moving, resources, SimOptions())] + up)
        return floors[key]

    out: list[PlanStep] = []
    for s in steps:
        n = sms.get((s.program, s.name), 0)
        work = work_of(s, rates)
        if not (s.pipelined_deps and n and work in rates and s.chunk_bytes and s.completion_lag > 0):
            out.append(s)
            continue
        chunk = _role_chunk(s, expand)
        per_byte = sm_bytes_per_flow_byte(s, expand)
        lag = 0.0
        t = floor((s.program, s.name))
        for f in s.flows:
            if f.resources and f.bytes > 0 and t > 0:
                k = min(float(n), max(1.0, f.bytes * per_byte / t / rates[work]))
                lag = max(lag, min(1.0, k * first_chunk(s, min(chunk, f.bytes)) / f.bytes))
        out.append(dataclasses.replace(s, completion_lag=min(s.completion_lag, lag)))
    return dataclasses.replace(plan, steps=out, resources=resources)


__all__ = ["first_chunk", "sm_bytes_per_flow_byte", "with_sm_terms"]
