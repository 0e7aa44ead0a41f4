"""The table-driven kernels' blocks: a role's chunks dealt to its blocks as the kernels deal them.

The fluid model (sm_terms.py) spreads a role's bytes over its N SMs.  The kernels do not: a role
is N blocks, and its work items, one per (copy, chunk), come in the tables' order
(`plan.model.item_order`: by progress through each copy, ties by copy; the copies of a rank's
role in flow order), and block b takes items b, b + N, b + 2N, ... in that order (device.cu.j2
`run_role`).  For each item the block waits until every producer counter the chunk needs has
its value (`Copy.waits`: the producers' chunks are written), copies the chunk's rows on its one
SM, waits until the copy's earlier chunks are published (counters count chunks in order) and
publishes it.  So a block that waits for a late chunk also holds the items dealt to it after
that one, however early their producers finished: h200x4_ubb2x2's dispatch `final` (one copy
reading sendbuf, from_far and from_twin in that order) ends ~0.3 ms after its last producer on
4 x H100, where its bytes spread over its 24 SMs would end 0.09 ms after it.

The model, per role of N blocks on a rank (program order, so a producer's chunks are timed before
its consumers'): the item starts once its block is free and its producers' chunks are published,
takes its share of its flow's bytes (the chunk's rows of the copy's) at one SM's rate of the
role's kind of work, and is published once the copy's earlier chunks are; its consumers see it
no sooner than the fluid model has moved its bytes too (links and shared resources bound the
role there; its blocks' own timeline runs at the per-SM rate).  Dealing
"round-robin" (what the kernels do): item k to block k mod N, the block waiting until its chunk
is published before it takes its next one -- where a step of the program reads what the role
writes; a role no step reads (only the drain waits for its total) publishes each chunk once it is
written, in any order (run_role's `ordered`), and its block goes on at once.  Dealing "free" (a
kernel change, to show what it would gain): each item, in the same order, to the block free first, which takes its next item
as soon as its chunk is copied (its publication still waits for the copy's earlier chunks: a
queue of work and a publication that does not hold the block; dealt to free blocks but waiting
to publish in order, h200x4_ubb2x2's final gains nothing).  A producer without blocks (an RDMA step on the
GPU proxy path, a DMA-engine role) publishes chunk v of n when the fluid model has moved
starts[v] / rows of its flow.  The role's flow on the rank is then held until its last chunk is
published (`_Engine` holds), and the program is simulated again with those holds until they
no longer move (a held role delays what waits for all of it).

The chunks and their producers come from a layout of the plan (runtime/layout, built by the
caller: the simulator reads plans only): which rows each copy's chunks hold, and which producer
counters each chunk waits for.  It is the layout of one routing drawn for the plan (`epcc
simulate` draws uniform routing as ep_bench does, seed 0); the bytes stay the plan's (a flow's
bytes over its copy's rows).
"""

from __future__ import annotations

import heapq
from typing import Any, Iterable, Protocol

import numpy as np

from ..costmodel.rates import sm_rates, step_sms, work_of
from ..costmodel.uniform import rows_per_token
from ..plan import PlanStep
from ..plan.model import item_order
from ..plan.peers import publishes_in_order
from .sm_terms import sm_bytes_per_flow_byte

DEALINGS = ("round-robin", "free")


class LayoutCopy(Protocol):
    """What the model reads of a layout's copy (runtime/layout/types.py Copy)."""

    program: str
    step: str
    rank: int
    flow_index: int
    flag_id: int
    chunk_starts: np.ndarray
    waits: list[list[tuple[int, int]]]


class RoleBlocks:
    """One role's schedule on one rank: per copy (flag id) each chunk's publication, the role's end."""

    def __init__(self) -> None:
        self.published: dict[int, list[float]] = {}
        self.end = 0.0


def block_roles(plan, rdma_proxy: bool) -> dict[tuple[str, str], tuple[int, float]]:
    """(program, step) -> (blocks, seconds per byte of its flows on one SM) for every role the
    per-block model times: a role of SMs with a rate for its kind of work, not an RDMA step on
    the GPU proxy path (its pack and unpack roles move chunks through the credit window)."""
    rates = sm_rates(plan)
    sms = step_sms(plan)
    expand = rows_per_token(plan) if rates else 1.0
    out = {}
    for s in plan.steps:
        n = sms.get((s.program, s.name), 0)
        work = work_of(s, rates)
        if not n or work not in rates or (rdma_proxy and s.link_kind == "rdma"):
            continue
        out[(s.program, s.name)] = (n, sm_bytes_per_flow_byte(s, expand) / rates[work])
    return out


def schedule_roles(steps: list[PlanStep], eng, copies: Iterable[LayoutCopy], roles: dict[tuple[str, str], tuple[int, float]],
                   dealing: str) -> tuple[dict[tuple[int, int], float], dict[tuple[str, int], RoleBlocks]]:
    """The blocks of every role of one program's `steps` (module docstring) after the fluid run
    `eng` (an _Engine run with trace_flows): the holds for the next run, (step index, flow index)
    -> when the flow's last chunk is published, and each (step, rank)'s schedule."""
    if dealing not in DEALINGS:
        raise ValueError(f"dealing: expected one of {', '.join(DEALINGS)}, got {dealing!r}")
    index = {s.name: i for i, s in enumerate(steps)}
    program = steps[0].program if steps else None
    mine = [c for c in copies if c.program == program and c.step in index]
    by_flag = {c.flag_id: c for c in mine if c.flag_id >= 0}
    per_role: dict[tuple[str, int], list[Any]] = {}
    for c in mine:
        per_role.setdefault((c.step, c.rank), []).append(c)
    done: dict[int, list[float]] = {}  # flag -> each chunk's publication, for roles already timed
    holds: dict[tuple[int, int], float] = {}
    out: dict[tuple[str, int], RoleBlocks] = {}

    def fluid(c: LayoutCopy, v: int) -> float:
        """When the fluid model has moved chunks 0..v-1 of copy c."""
        f = eng.flow_at.get((index[c.step], c.flow_index))
        if f is None:  # the plan's flow moves nothing: the step's end
            return float(eng.end_t[index[c.step]])
        rows = int(c.chunk_starts[-1])
        return eng.flow_crossing(f, int(c.chunk_starts[v]) / rows if rows else 1.0)

    def published(flag: int, value: int) -> float:
        if value <= 0:
            return eng.start_s
        if flag in done:
            return done[flag][value - 1]
        return fluid(by_flag[flag], value) if flag in by_flag else eng.start_s

    for si, s in enumerate(steps):  # program order: producers first
        role = roles.get((s.program, s.name))
        if role is None:
            continue
        blocks, s_per_byte = role
        start = float(eng.ready_t[si])
        ordered = publishes_in_order(steps, s.name)  # as the kernels publish (codegen's RoleSpec.ordered)
        for rank in sorted(r for name, r in per_role if name == s.name):
            cs = sorted(per_role[(s.name, rank)], key=lambda c: c.flow_index)
            rb = RoleBlocks()
            rb.end = start
            own = [[0.0] * (c.chunk_starts.size - 1) for c in cs]  # each chunk published, by the blocks alone
            pub = [[0.0] * (c.chunk_starts.size - 1) for c in cs]
            free = [(start, b) for b in range(blocks)]
            for k, (ci, ch) in enumerate(item_order([c.chunk_starts.size - 1 for c in cs])):
                c = cs[ci]
                ready = max([start] + [published(flag, value) for flag, value in c.waits[ch]])
                rows = int(c.chunk_starts[-1])
                flow = s.flows[c.flow_index]
                secs = flow.bytes * (int(c.chunk_starts[ch + 1]) - int(c.chunk_starts[ch])) / rows * s_per_byte
                if dealing == "round-robin":
                    at, b = free[k % blocks]
                else:
                    at, b = heapq.heappop(free)
                t = max(at, ready) + secs
                # counters count chunks in order where a step reads them
                own[ci][ch] = max(t, own[ci][ch - 1]) if ch > 0 and ordered else t
                # what the consumers see: no sooner than the fluid model moved the chunk's bytes
                pub[ci][ch] = max(own[ci][ch], fluid(c, ch + 1))
                rb.end = max(rb.end, pub[ci][ch])
                if dealing == "round-robin":  # the kernel's block waits to publish in order
                    free[k % blocks] = (own[ci][ch], b)
                else:  # a free block takes the next item; the chunk is published once its predecessors are
                    heapq.heappush(free, (t, b))
            for c, times in zip(cs, pub):
                rb.published[c.flag_id] = times
                if c.flag_id >= 0:  # the counter reaches v when v of the chunks are published (any order)
                    done[c.flag_id] = sorted(times)
                if times:
                    holds[(si, c.flow_index)] = max(times)
            out[(s.name, rank)] = rb
    return holds, out


__all__ = ["DEALINGS", "LayoutCopy", "RoleBlocks", "block_roles", "schedule_roles"]
