"""route-analysis: which tokens every step carries, over which link, and how many bytes.

Runs the stream analysis (analysis/flow.py) under the routing distribution of the options
(`uniform`, exact; `zipf:S` or a `.npy` routing, sampled) and turns it into the Plan's steps:
one Flow per (executing rank, source, destination) with its expected bytes and the resources
it occupies (link ports, local memory).  Each step op is annotated with `epcc.volume`: the
expected bytes of the busiest rank, of the average rank, and of the busiest single flow.
"""

from __future__ import annotations

from ..analysis.flow import FlowAnalysis
from ..analysis.routing import routing_model
from ..ir import query
from ..plan import Flow, Plan, PlanStep, WorkloadPlan
from ..sema import model
from . import Pass, PassContext, register


def link_resources(link: model.LinkInfo, space: model.RankSpace, src: int, dst: int, rank: int) -> tuple[str, ...]:
    """The resources a transfer over `link` occupies: a dedicated directed pair, or shared ports."""
    if link.kind == "local":
        return (f"hbm:{rank}",)
    if link.shared_per:
        a = ".".join(map(str, space.scope_key(src, link.shared_per)))
        b = ".".join(map(str, space.scope_key(dst, link.shared_per)))
        return (f"link:{link.name}:{a}:out", f"link:{link.name}:{b}:in")
    return (f"link:{link.name}:{src}>{dst}",)


def flow_selection(st: model.Step, r: int, src: int, dst: int) -> tuple[int, ...] | None:
    """The rank set a flow selects by, evaluated (None: all tokens of the source buffers)."""
    if st.verb == "permute":
        return (dst,)
    sel = st.selection
    if sel is None or sel.mode == "all":
        return None
    far = dst if st.verb == "send" else (src if st.verb == "pull" else None)
    return tuple(sorted(sel.ranks.evaluate(r, far)))


def build_plan(sched: model.Schedule, flow: FlowAnalysis) -> Plan:
    topo = sched.topology
    space = topo.space
    wl = sched.workload
    plan = Plan(sched.name, topo.num_ranks, flow.routing.describe(), wl.bytes_per_token,
                workload=WorkloadPlan(wl.tokens, wl.hidden, wl.dtype, wl.topk, wl.experts, wl.placement,
                                      wl.weights_travel, wl.layout),
                rank_names=[space.describe(r) for r in range(topo.num_ranks)], sm_rates=dict(topo.sm_rates),
                sm_launch_s=topo.sm_launch, sm_meta_s=topo.sm_meta,
                atomics={l.name: l.atomics for l in topo.links.values() if l.atomics},
                post_s={l.name: l.post for l in topo.links.values() if l.post}, vendor=topo.vendor, arch=topo.arch)
    max_latency = max((l.latency for l in topo.links.values()), default=0.0)
    for st in sched.dispatch.steps:
        vol = flow.volumes[st.name]
        link = st.link
        ps = PlanStep(st.name, "dispatch", st.verb, link.name if link else None, link.kind if link else None,
                      st.deps, title=st.title, line=st.span.line, order=st.order, sms=st.sms, depth=st.depth or 1,
                      src_buffers=tuple(s.buffer.name for s in st.sources),
                      dst_buffer=st.dest.buffer.name if st.dest is not None else None,
                      rows=st.verb == "permute" or st.dedup == "none")
        for r in range(topo.num_ranks):
            if st.verb == "exchange":
                per_peer = vol.bytes[r] / max(len(vol.per_flow[r]), 1)
                for src, dst, _ in vol.per_flow[r]:
                    res = link_resources(link, space, src, dst, r) if link else ()
                    plan.resources.update((x, link.effective_bandwidth) for x in res)
                    ps.flows.append(Flow(r, src, dst, per_peer, res, link.latency if link else max_latency))
                continue
            for src, dst, copies in vol.per_flow[r]:
                nbytes = copies * wl.bytes_per_token
                res = link_resources(link, space, src, dst, r) if link else ()
                plan.resources.update((x, link.effective_bandwidth) for x in res)
                ps.flows.append(Flow(r, src, dst, nbytes, res, link.latency if link else 0.0,
                                     select=flow_selection(st, r, src, dst)))
        plan.steps.append(ps)
    return plan


@register
class RouteAnalysis(Pass):
    name = "route-analysis"
    description = "follow every token stream through the steps; expected bytes per flow and link"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        routing = routing_model(ctx.options.routing, sched.workload, sched.topology.space)
        flow = FlowAnalysis(sched, routing)
        plan = build_plan(sched, flow)
        ctx.results["flow"] = flow
        ctx.results["plan"] = plan
        query.annotate(module, "routing", routing.describe())
        steps = query.step_ops(query.program_module(module, "dispatch"))
        for st in sched.dispatch.steps:
            v = flow.volumes[st.name]
            biggest = max((c for pf in v.per_flow for (_, _, c) in pf), default=0.0) * sched.workload.bytes_per_token
            query.annotate(steps[st.name], "volume", {
                "max_rank_bytes": float(round(v.max_bytes)),
                "mean_rank_bytes": float(round(v.mean_bytes)),
                "max_flow_bytes": float(round(biggest)),
            })
