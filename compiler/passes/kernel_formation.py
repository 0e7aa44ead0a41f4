"""kernel-formation: group steps into fused kernels with SM roles, proxy loops and DMA queues.

Per program, the steps become:

* `<program>_meta`: a small kernel for the metadata exchanges (the layout must be complete
  before data moves: DeepEP's notify_dispatch);
* `<program>_kernel`: ONE persistent kernel for every step driven by GPU threads (engines sm,
  spc, tma), each step a *role* on its own range of SMs, so the phases of the schedule run
  concurrently inside one launch (Hybrid-EP's warp-specialised blocks, DeepEP's channels);
* `<program>_proxy`: the host proxy loop that posts the RDMA writes of steps on a NIC;
* `<program>_dma`: copy-engine / DMA work (engines ce, dma).

SMs.  A step that names `sms N` gets N.  The others share what is left of the kernel's budget
(`DEFAULT_SMS`, or more if the named ones need it) in proportion to their estimated time
(overlap-schedule), at least one SM each.  Roles are laid out on consecutive SM ranges.
Metadata kernels get `META_SMS`.

An RDMA step (a proxy role) takes no SMs of the plan's ranges, but on the GPU proxy path (`epcc
compile --rdma proxy`) the sender packs its chunks on SMs and the receiver applies them on SMs:
`RolePlan.pack_sms` and `unpack_sms` size those two roles for the link, enough that the busiest
rank's link rate does not wait on them (link rate / the per-SM rate of the side's work, the
topology's `sm` line: packing at `copy`, half that for fp32 partials, applying at the step's kind
of work; compiler/costmodel/rates.py proxy_rates), at least `PROXY_MIN_SMS` and at most
`PROXY_MAX_SMS`.  Without `sm` rates both are `PROXY_MIN_SMS`.  A combine chunk is applied with
fp32 atomic adds (~12 GB/s per SM), so a 50 GB/s link needs 5 unpack SMs where 4 held it at
~43 GB/s (2 x H200, 2026-11-23; docs/rdma.md).

IR: one `builtin.module @<name> attributes {epcc.kind = "kernel" | "proxy" | "dma"}` per group,
holding an `epcc.role` per step, at the location of the step.

The plan also records the CUDA target's choice for the whole plan (plan/direct.py): `Plan.direct`,
the direct one-hop kernels and their shape where the plan has it, else the reason in
`Plan.direct_not_used`; the CUDA code generator and `epcc simulate` read it, neither re-derives it.
And the launches across a card's dies (plan/launch.py): `Plan.launch`, the rank pairs one
duplicate-mode launch covers where the ranks are the two dies of a card and the plan is symmetric
across them, else why not (IR: `epcc.launch = {duplicate, why}` on the top module).

Engines: a step's engine is engine-selection's choice (`PlanStep.engine`); a role over a link
that offers several engines carries the reason (`epcc.engine_why`: both engines' rates and times).
"""

from __future__ import annotations

import math
from collections import defaultdict

from mlir import ir

from ..ir import ops, query
from ..costmodel.rates import PROXY_MIN_SMS, proxy_rates, sm_rates
from ..plan import WARPS_PER_SM, KernelPlan, Plan, PlanStep, RolePlan
from ..plan.direct import direct_kernels
from ..plan.launch import duplicate_launch
from ..sema import model
from ..vendors import VENDORS
from . import Pass, PassContext, register
from .overlap_schedule import busy_time, step_times

DEFAULT_SMS = 24
META_SMS = 2  # counting and exchanging counts is latency-bound: a couple of SMs

PROXY_MAX_SMS = 16  # blocks of a GPU proxy path's pack or unpack role at most (at least: rates.PROXY_MIN_SMS)


def card_dies(topo: model.Topology) -> tuple[list[int] | None, str]:
    """(each rank's other die on its card, or None, and then why not): the ranks are the dies of
    two-die cards when the architecture has two dies per card and the innermost level, the rank's,
    counts 2 (stride 1: the other die of rank r is r ^ 1)."""
    arch = VENDORS[topo.vendor].arch(topo.arch)
    if arch is None or arch.dies_per_card != 2:
        return None, f"{topo.vendor} {topo.arch}: one die per card, nothing to duplicate"
    lv = topo.space.rank_level
    if lv.count != 2:
        return None, (f"the ranks are {lv.name}s, {lv.count} per instance of the level above, not the 2 dies of a "
                      f"{topo.arch} card: each rank's own launch spans its card's dies")
    return [r ^ 1 for r in range(topo.num_ranks)], ""


def role_of(ps: PlanStep, verb_of_dispatch: str | None) -> str:
    verb = ps.verb if ps.reverse_of is None else verb_of_dispatch or ps.verb
    if ps.verb == "exchange":
        return "metadata"
    if ps.link_kind == "rdma":
        return "rdma_poster"
    if ps.reverse_of is not None:
        return "reducer" if ps.verb in ("reduce",) else "sender"
    return {"send": "sender", "pull": "puller", "copy": "copier", "permute": "permuter",
            "reduce": "reducer"}.get(verb, "forwarder")


def split_sms(steps: list[PlanStep], times: dict[str, float], budget: int | None) -> dict[str, int]:
    named = {s.name: s.sms for s in steps if s.sms}
    free = [s for s in steps if not s.sms]
    total = budget if budget is not None else max(DEFAULT_SMS, sum(named.values()) + len(free))
    rest = max(total - sum(named.values()), len(free))
    out = dict(named)
    if free:
        weight = {s.name: max(times.get(s.name, 0.0), 1e-9) for s in free}
        wsum = sum(weight.values())
        shares = {n: max(1, int(rest * w / wsum)) for n, w in weight.items()}
        # Hand out what rounding left, to the longest steps first.
        left = rest - sum(shares.values())
        for n in sorted(weight, key=lambda n: -weight[n]):
            if left <= 0:
                break
            shares[n] += 1
            left -= 1
        out.update(shares)
    return out


def link_rates(ps: PlanStep, capacity: dict[str, float]) -> tuple[float, float]:
    """(sent, received) bytes/s of the busiest rank while `ps` runs alone at its links' rate: the
    rank's bytes over the time of the step's busiest resource."""
    sent: dict[int, float] = defaultdict(float)
    received: dict[int, float] = defaultdict(float)
    for f in ps.flows:
        sent[f.src] += f.bytes
        received[f.dst] += f.bytes
    busy = busy_time(ps, capacity)
    if busy <= 0:
        return 0.0, 0.0
    return max(sent.values(), default=0.0) / busy, max(received.values(), default=0.0) / busy


def proxy_sms(plan: Plan, ps: PlanStep) -> tuple[int, int]:
    """(pack, unpack) SMs of an RDMA step on the GPU proxy path (module docstring)."""
    rates = sm_rates(plan)
    if "copy" not in rates:
        return PROXY_MIN_SMS, PROXY_MIN_SMS
    stage_bps, apply_bps = proxy_rates(rates, ps)
    sent, received = link_rates(ps, plan.resources)

    def fit(rate: float, per_sm: float) -> int:
        return max(PROXY_MIN_SMS, min(PROXY_MAX_SMS, math.ceil(rate / per_sm - 1e-9)))

    return fit(sent, stage_bps), fit(received, apply_bps)


@register
class KernelFormation(Pass):
    name = "kernel-formation"
    description = "fuse thread-driven steps into one persistent kernel per program; proxy loops; SM roles"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        links = sched.topology.links
        kernels: list[KernelPlan] = []
        for program in ("dispatch", "combine"):
            steps = plan.program_steps(program)
            if not steps:
                continue
            times = step_times(ctx, program)
            groups: dict[str, list[PlanStep]] = {"meta": [], "kernel": [], "proxy": [], "dma": []}
            for s in steps:
                engine = s.effective_engine(links.get(s.link))
                if s.verb == "exchange":
                    groups["meta"].append(s)
                elif s.link_kind == "rdma" or engine in ("nic", "proxy"):
                    groups["proxy"].append(s)
                elif engine in ("ce", "dma"):
                    groups["dma"].append(s)
                else:
                    groups["kernel"].append(s)
            for g, members in groups.items():
                if not members:
                    continue
                kind = {"meta": "kernel", "kernel": "kernel", "proxy": "proxy", "dma": "dma"}[g]
                kp = KernelPlan(f"{program}_{g}", kind, program, 0)
                if g == "meta":
                    sms = {s.name: s.sms or META_SMS for s in members}
                elif kind == "kernel":
                    sms = split_sms(members, times, None)
                else:
                    sms = {}
                at = 0
                for s in members:
                    engine = s.effective_engine(links.get(s.link))
                    ds_verb = sched.dispatch.step(s.reverse_of).verb if s.reverse_of else None
                    n_sm = sms.get(s.name, 0)
                    pack, unpack = proxy_sms(plan, s) if kind == "proxy" else (0, 0)
                    kp.roles.append(RolePlan(s.name, role_of(s, ds_verb), at, at + n_sm,
                                             WARPS_PER_SM if n_sm else 0, engine, pack, unpack))
                    at += n_sm
                kp.sms = at
                kernels.append(kp)
        plan.kernels = kernels
        plan.direct, plan.direct_not_used = direct_kernels(plan)
        plan.launch = duplicate_launch(plan, *card_dies(sched.topology))
        query.annotate(module, "launch", {"duplicate": [list(p) for p in plan.launch.duplicate],
                                          "why": plan.launch.why})
        self._emit(module, ctx, kernels)

    def _emit(self, module, ctx: PassContext, kernels: list[KernelPlan]) -> None:
        # each program's step ops once (a lookup per role walked the program per step: quadratic)
        steps = {p: query.step_ops(m) for p in ("dispatch", "combine")
                 if (m := query.program_module(module, p)) is not None}

        def step_loc(program: str, step: str):
            op = steps.get(program, {}).get(step)
            return op.location if op is not None else None

        engine_why = {(s.program, s.name): s.engine_why for s in ctx.get("plan").steps if s.engine_why}
        with ir.InsertionPoint(query.body(module)):
            for kp in kernels:
                loc = step_loc(kp.program, kp.roles[0].step) or module.location
                km = ops.code_module(kp.name, kp.kind, loc=loc)
                query.annotate(km.operation, "sms", kp.sms)
                query.annotate(km.operation, "program", kp.program)
                with ir.InsertionPoint(km.body):
                    for r in kp.roles:
                        op = ops.role(step=r.step, role=r.role, sm_begin=r.sm_begin, sm_end=r.sm_end, warps=r.warps,
                                      engine=r.engine, loc=step_loc(kp.program, r.step) or loc)
                        why = engine_why.get((kp.program, r.step))
                        if why:  # engine-selection's reason: the link's engines, their rates and times
                            query.annotate(op, "engine_why", why)
                        if r.pack_sms or r.unpack_sms:
                            query.annotate(op, "pack_sms", r.pack_sms)
                            query.annotate(op, "unpack_sms", r.unpack_sms)
        ctx.results["kernels"] = kernels
