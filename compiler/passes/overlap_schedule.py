"""overlap-schedule: order steps on shared links and engines so independent phases overlap.

Every step gets an estimated time from the cost model (the busiest resource it uses: bytes over
capacity, plus per-chunk latency spread over the pipeline depth).  Steps are then ranked by
their *upward rank*: their own time plus the longest chain of work that waits for them (the
classic list-scheduling priority, HEFT's rank_u).  On a shared resource the step with the longer
remaining chain goes first, so the long pole (seed 000 §3.1: the NIC) starts as early as it can
and short independent phases (§3.2: 2.a beside 2.b) fill in beside it.

User hints win: `first` puts a step before every other step it shares a resource with, `last`
after them (seed 000 §1.2: "send d0_5 last" lets the 4-GPU group's transfers overlap the big
one).  Priorities are small integers, lower = earlier.

IR: `epcc.order = {priority, est_start_us, est_time_us, rank_u_us, engine}` on each step op.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ..ir import query
from ..plan import Plan, PlanStep
from . import Pass, PassContext, register


def step_times(ctx: PassContext, program: str) -> dict[str, float]:
    """Estimated seconds of every step of `program` alone (empty before this pass ran)."""
    return ctx.results.get("overlap", {}).get(program, ({}, {}, {}))[0]


def busy_time(ps: PlanStep, capacity: dict[str, float]) -> float:
    """Seconds the step's busiest resource takes for the step's bytes alone."""
    load: dict[str, float] = defaultdict(float)
    for f in ps.flows:
        for r in f.resources:
            load[r] += f.bytes
    return max((b / capacity[r] for r, b in load.items() if capacity.get(r)), default=0.0)


def step_time(ps: PlanStep, capacity: dict[str, float]) -> float:
    """Seconds a step takes alone: its busiest resource, plus chunk latency not hidden by depth."""
    lat = max((f.latency_s for f in ps.flows), default=0.0)
    return busy_time(ps, capacity) + lat * math.ceil(ps.whole_chunks / max(ps.depth, 1))


def upward_ranks(steps: list[PlanStep], times: dict[str, float]) -> dict[str, float]:
    succ: dict[str, list[str]] = defaultdict(list)
    for s in steps:
        for d in s.deps:
            succ[d].append(s.name)
    memo: dict[str, float] = {}

    def rank(n: str) -> float:
        if n not in memo:
            memo[n] = times[n] + max((rank(m) for m in succ[n]), default=0.0)
        return memo[n]

    return {s.name: rank(s.name) for s in steps}


def earliest_starts(steps: list[PlanStep], times: dict[str, float]) -> dict[str, float]:
    """Start times ignoring contention; a pipelined dependency lets a step start one chunk after
    its producer starts."""
    start: dict[str, float] = {}
    by = {s.name: s for s in steps}
    for s in steps:  # program order is a topological order
        t = 0.0
        for d in s.deps:
            p = by[d]
            if d in s.pipelined_deps:
                t = max(t, start[d] + times[d] / p.whole_chunks)
            else:
                t = max(t, start[d] + times[d])
        start[s.name] = t
    return start


@register
class OverlapSchedule(Pass):
    name = "overlap-schedule"
    description = "priorities by critical path (rank_u) with first/last hints; engine per step"

    def run(self, module, ctx: PassContext) -> None:
        plan: Plan = ctx.get("plan")
        links = ctx.schedule.topology.links
        summary = {}
        for program in ("dispatch", "combine"):
            steps = plan.program_steps(program)
            if not steps:
                continue
            times = {s.name: step_time(s, plan.resources) for s in steps}
            ranks = upward_ranks(steps, times)
            starts = earliest_starts(steps, times)
            hint = {"first": 0, None: 1, "last": 2}
            order = sorted(steps, key=lambda s: (hint[s.order], -ranks[s.name], starts[s.name], steps.index(s)))
            for i, s in enumerate(order):
                s.priority = i
            summary[program] = (times, ranks, starts)
            prog = query.program_module(module, program)
            if prog is None:
                continue
            ops = query.step_ops(prog)
            for s in steps:
                if s.name not in ops:
                    continue
                engine = s.effective_engine(links.get(s.link), "host" if s.verb == "exchange" else "sm")
                query.annotate(ops[s.name], "order", {
                    "priority": s.priority,
                    "est_start_us": round(starts[s.name] * 1e6, 3),
                    "est_time_us": round(times[s.name] * 1e6, 3),
                    "rank_u_us": round(ranks[s.name] * 1e6, 3),
                    "engine": engine,
                })
        ctx.results["overlap"] = summary
