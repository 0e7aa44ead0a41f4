"""derive-combine: build `combine reverse of dispatch` as the adjoint of the dispatch program.

Combine must send every expert output back to its token's home, weighted and summed.  The
adjoint of dispatch does exactly that, reusing dispatch's routes (and, at run time, its layout:
the "handle" DeepEP's combine takes from its dispatch):

* the data steps of dispatch in reverse order (metadata exchanges have no reverse: combine reuses
  dispatch's counts and layout);
* a dispatch transfer that moved copies from buffer A on rank a to buffer B on rank b becomes a
  combine step that returns, from B on b to A on a, the partial sums of exactly those copies (the
  sums of what each delivered downstream), ACCUMULATING into A's partial on a.  One op per
  (dispatch step, source buffer), named after the step (`step.source` when the step reads several
  buffers: the partials go back to different buffers).  The executing rank and relation stay, the
  direction flips: a dispatch `send` (push) becomes a pull, a `pull` becomes a push, a `copy`
  stays a copy;
* a dispatch write into `output` (a permute, or a send/pull/copy into output) becomes a weighted
  reduce of the receiver's expert outputs into the partial of the buffer the token came through:
  an `epcc.reduce` for a local write, and for a remote one an `epcc.transfer` that reads `output`
  with the reduce fused into the return (`epcc.weighted = true`): the weights of a
  (token, expert) row are applied exactly once, there;
* dispatch `input` becomes combine `result`, `output` stays `output` (the expert outputs), and
  every dispatch staging buffer gets a partial-sum buffer of the same name.

Dependencies are dispatch's, reversed: a combine op waits for the ops reversing the dispatch
steps that depended on its dispatch step (they consumed what it produced; their partials must be
in before it returns its own): of a consumer that read x's destination buffer, the op returning
into that buffer; of a consumer ordered after x by `after`, all its ops.  Order hints flip
(`first` <-> `last`); `parallel` hints map to the reversing ops.  Ops that accumulate into the
same partial buffer (e.g. the reverses of `keep_far` and `fwd` into `rdma_recv`) are not ordered
against each other: they add into the same token's slot, so lowering must make the accumulation
atomic or serialise them.

IR: the empty `module @combine {epcc.derived_from = "dispatch"}` is filled with epcc.buffer ops
and one op per combine step, located at the dispatch step it reverses, with `epcc.reverse_of`
(the dispatch step) and `epcc.reverse_source` (the buffer its partials return into).  A reverse
transfer or copy selects mode "all": the dialect's "for" / "of" select by destination / home
rank, and neither says "the copies dispatch step X moved"; "all" is every slot of the slice of
the buffer that X's layout assigned to X, which `epcc.reverse_of` names.

Volumes: a returned partial moves only if the copy it returns delivered something: for a copy
with conds c whose downstream deliveries have conds s_1..s_j, P(∪_i "D hits all of s_i"), from
the routing in use (exact for uniform routing; sampled routings answer the same queries).
Deliveries are {d}-conditioned refinements of c, so the union is usually c ∧ hit({d_1..d_j}), one
p_hit_all; other shapes use inclusion-exclusion (see combine_flow.p_union).  The reverse of a
write into output moves what dispatch moved there: one partial per token copy (dedup rank), or
one row per (token, expert) for a permute / dedup none (the rows the weighted reduce reads).
Bytes are `workload.combine_bytes_per_token` (BF16 partial sums).

The derived combine is then verified with verify-delivery's engine: every copy's partial is
complete when it is returned, every delivery's weights are applied once, and every home's
`result` gets each destination rank's outputs exactly once for every destination set.

For a written-out combine this pass only adds the Plan's combine steps (volumes from the
written combine's stream analysis) so the simulator can time it.
"""

from __future__ import annotations

from collections import defaultdict

from mlir import ir

from ..analysis.combine_flow import (AdjointCombine, CombineOp, Contribution, Problem, WrittenCombine, derive_ops,
                                     partial_names)
from ..analysis.flow import FlowAnalysis
from ..ir import ops as irops
from ..ir import query
from ..ir.emit import span_loc, verify
from ..plan import Flow, Plan, PlanStep
from ..sema import model
from . import Pass, PassContext, register
from .route_analysis import flow_selection, link_resources
from .verify_delivery import ExactlyOnce, TooComplex, dest_text, join_and, report, times_text

FLIP_ORDER = {"first": "last", "last": "first", None: None}


def reverse_route_text(c: Contribution) -> str:
    """`rank 17 -final-> 17 -fwd-> 16 -rdma-> 0`: a delivery's path run backwards."""
    out = f"rank {c.dest}"
    for step, a, _b in reversed(c.path):
        out += f" -{step}-> {a}"
    return out


# --------------------------------------------------------------------------- verification


def verify_adjoint(adj: AdjointCombine, engine: ExactlyOnce, sched: model.Schedule) -> list[Problem]:
    problems = list(adj.problems)
    space = sched.topology.space
    n = adj.n
    for key in adj.delivery_keys:
        k = adj.weights_applied.get(key, 0)
        if k != 1:
            h, path = key
            st = sched.dispatch.step(path[-1][0])
            problems.append(Problem(("weights", st.span), st.span,
                                    f"the derived combine applies the routing weights of the copy "
                                    f"{' '.join([f'rank {h}'] + [f'-{s}-> {b}' for s, _, b in path])} "
                                    f"{times_text(k) if k > 1 else 'never' if k == 0 else 'once'}"))
    head = sched.combine_reverse_span
    for h in range(n):
        by_d: dict[int, list[Contribution]] = defaultdict(list)
        for c in adj.result[h]:
            by_d[c.dest].append(c)
        for d in range(n):
            cs = by_d.get(d, [])
            try:
                fail = engine.check(d, [c.conds for c in cs])
            except TooComplex:
                continue  # verify-delivery already warned about this pair
            if fail is None:
                continue
            who = f"a token of {space.describe(h)} routed to ranks {dest_text(fail.dest_set)}"
            if fail.fired:
                routes = [reverse_route_text(cs[i]) for i in fail.fired]
                problems.append(Problem(("cdup", head), head,
                                        f"the derived combine sums rank {d}'s expert outputs for {who} "
                                        f"{times_text(len(routes))}: {join_and(routes)}"))
            else:
                problems.append(Problem(("cdrop", head), head,
                                        f"the derived combine never brings rank {d}'s expert outputs home for {who}"))
    return problems


# --------------------------------------------------------------------------- IR


def emit_combine(module: ir.Operation, sched: model.Schedule, cops: list[CombineOp], adj: AdjointCombine) -> None:
    comb = query.program_module(module, "combine")
    disp = sched.dispatch
    pname = partial_names(disp)
    head = sched.combine_reverse_span or disp.span
    ops_of: dict[str, list[str]] = defaultdict(list)
    for op in cops:
        ops_of[op.reverse_of].append(op.name)
    bpt = sched.workload.combine_bytes_per_token
    with ir.InsertionPoint(query.body(comb)):
        bufs: dict[str, ir.Value] = {}
        bufs["output"] = irops.buffer("output", "source", capacity_tokens=None, capacity_bytes=None,
                                      loc=span_loc(head, "output"))
        bufs["result"] = irops.buffer("result", "sink", capacity_tokens=None, capacity_bytes=None,
                                      loc=span_loc(head, "result"))
        for b in disp.buffers.values():
            if b.role == "staging":
                name = pname[b.name]
                bufs[name] = irops.buffer(name, "staging", capacity_tokens=b.capacity_tokens, capacity_bytes=None,
                                          loc=span_loc(b.span or head, name))
        events: dict[str, ir.Value] = {}
        for op in cops:
            st = op.step
            loc = span_loc(st.span, op.name)
            parallel = tuple(o for p in st.parallel for o in ops_of.get(p, ()))
            info = irops.StepInfo(op.name, st.title, chunk_tokens=st.chunk_tokens, chunk_bytes=st.chunk_bytes,
                                  depth=st.depth, sms=st.sms, order=FLIP_ORDER[st.order], after=(), parallel=parallel)
            deps = [events[d] for d in op.deps]
            link = st.link
            engine = link.engine if link is not None else model.DEFAULT_ENGINE["local"]
            src, dst = bufs[op.src_buffer], bufs[op.dst_buffer]
            if op.verb == "reduce":
                ev = irops.reduce(src, dst, deps, info, link=link.name if link else None, engine=engine, loc=loc)
            else:
                sel_span = st.selection.span if st.selection is not None else st.span
                sel = irops.select("all", None, loc=span_loc(sel_span, f"{op.name}.sel"))
                if op.verb == "copy":
                    ev = irops.copy([src], dst, sel, deps, info, link=link.name if link else None, engine=engine,
                                    dedup=st.dedup, loc=loc)
                else:
                    rel = st.relation.name
                    ev = irops.transfer([src], dst, sel, deps, info, direction="push" if op.verb == "send" else "pull",
                                        relation=rel, src_relations=[rel if op.verb == "pull" else None],
                                        link=link.name, link_kind=link.kind, engine=link.engine, dedup=st.dedup,
                                        loc=loc)
            o = ev.owner
            query.annotate(o, "reverse_of", st.name)
            query.annotate(o, "reverse_source", op.source)
            if op.weighted:
                query.annotate(o, "weighted", True)
            v = adj.volumes[op.name]
            biggest = max((c for pf in v.per_flow for (_, _, c) in pf), default=0.0) * bpt
            query.annotate(o, "volume", {
                "max_rank_bytes": float(round(max(v.bytes, default=0.0))),
                "mean_rank_bytes": float(round(sum(v.bytes) / len(v.bytes))) if v.bytes else 0.0,
                "max_flow_bytes": float(round(biggest)),
            })
            events[op.name] = ev


# --------------------------------------------------------------------------- Plan


def _flows(ps: PlanStep, plan: Plan, link: model.LinkInfo | None, space: model.RankSpace,
           per_flow: list[list[tuple[int, int, float]]], bpt: int, latency: float) -> None:
    for r, flows in enumerate(per_flow):
        for src, dst, copies in flows:
            res = link_resources(link, space, src, dst, r) if link else ()
            plan.resources.update((x, link.effective_bandwidth) for x in res)
            ps.flows.append(Flow(r, src, dst, copies * bpt, res, latency))


def derived_plan_steps(sched: model.Schedule, cops: list[CombineOp], adj: AdjointCombine, plan: Plan) -> None:
    space = sched.topology.space
    bpt = sched.workload.combine_bytes_per_token
    for op in cops:
        st = op.step
        link = st.link
        ps = PlanStep(op.name, "combine", op.verb, link.name if link else None, link.kind if link else None,
                      op.deps, title=st.title, line=st.span.line, order=FLIP_ORDER[st.order], sms=st.sms,
                      depth=st.depth or 1, reverse_of=st.name, reverse_source=op.source, weighted=bool(op.weighted),
                      src_buffers=(op.src_buffer,), dst_buffer=op.dst_buffer,
                      rows=st.verb == "permute" or st.dedup == "none")  # as the step it returns (flow.py)
        _flows(ps, plan, link, space, adj.volumes[op.name].per_flow, bpt, link.latency if link else 0.0)
        plan.steps.append(ps)


def written_plan_steps(sched: model.Schedule, cf: WrittenCombine, plan: Plan) -> None:
    space = sched.topology.space
    max_latency = max((l.latency for l in sched.topology.links.values()), default=0.0)
    bpt = sched.workload.combine_bytes_per_token
    for st in sched.combine.steps:
        link = st.link
        v = cf.volumes[st.name]
        ps = PlanStep(st.name, "combine", st.verb, link.name if link else None, link.kind if link else None,
                      st.deps, title=st.title, line=st.span.line, order=st.order, sms=st.sms, depth=st.depth or 1,
                      src_buffers=tuple(s.buffer.name for s in st.sources),
                      dst_buffer=st.dest.buffer.name if st.dest is not None else None,
                      # A written combine applies the routing weights where it reduces expert outputs.
                      weighted=st.verb == "reduce" and any(s.buffer.name == "output" for s in st.sources),
                      # unweighted pieces read from output are rows (combine_flow.py)
                      rows=any(s.buffer.name == "output" for s in st.sources))
        if st.verb == "exchange":
            for r in range(space.num_ranks):
                per_peer = v.bytes[r] / max(len(v.per_flow[r]), 1)
                for src, dst, _ in v.per_flow[r]:
                    res = link_resources(link, space, src, dst, r) if link else ()
                    plan.resources.update((x, link.effective_bandwidth) for x in res)
                    ps.flows.append(Flow(r, src, dst, per_peer, res, link.latency if link else max_latency))
        else:
            _flows(ps, plan, link, space, v.per_flow, bpt, link.latency if link else 0.0)
            for f in ps.flows:
                if st.verb == "reduce":
                    # `reduce B into result` takes the executing rank's own tokens (sema); into a
                    # partial buffer, every home's.
                    f.select = (f.rank,) if st.dest.buffer.role == "sink" else None
                else:  # `tokens of S`: partials of tokens whose home rank is in S
                    f.select = flow_selection(st, f.rank, f.src, f.dst)
        plan.steps.append(ps)


# --------------------------------------------------------------------------- the pass


@register
class DeriveCombine(Pass):
    name = "derive-combine"
    description = "build `combine reverse of dispatch` as the adjoint of dispatch, verified; plan the combine steps"

    def run(self, module, ctx: PassContext) -> None:
        with module.context:
            self._run(module, ctx)

    def _run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        flow: FlowAnalysis = ctx.get("flow")
        plan: Plan = ctx.get("plan")
        if any(s.program == "combine" for s in plan.steps):
            raise RuntimeError("derive-combine ran twice on one plan")
        if sched.combine is not None:
            cf = ctx.results.get("combine_flow")
            if cf is None:
                cf = WrittenCombine(sched, flow.routing)
            ctx.results["combine"] = cf
            written_plan_steps(sched, cf, plan)
            return
        wl = sched.workload
        n = sched.topology.num_ranks
        engine = ctx.results.get("exactly_once")
        if engine is None:
            engine = ExactlyOnce(n, wl.topk, wl.experts_per_rank)
        cops = derive_ops(sched)
        adj = AdjointCombine(flow, cops)
        ctx.results["combine"] = adj
        before = engine.patterns
        problems = verify_adjoint(adj, engine, sched)
        if problems:
            report(ctx.diags, problems, "copy or (token home, destination) pair")
            return
        emit_combine(module, sched, cops, adj)
        comb = query.program_module(module, "combine")
        query.annotate(comb, "verified", f"exactly-once: {n} homes x {n} contributing ranks, "
                                         f"{engine.patterns - before} destination patterns checked, weights "
                                         f"applied once per delivery")
        verify(module, what=f"the combine derived for schedule '{sched.name}'")
        derived_plan_steps(sched, cops, adj, plan)
        summary = ctx.results.setdefault("verification", {})
        if isinstance(summary, dict):
            summary.update(combine="derived", combine_ok=True, combine_ops=len(cops),
                           combine_inexact_volumes=adj.inexact)
        if adj.inexact:
            plan.notes.append(f"derive-combine: {adj.inexact} returned-partial volumes use the union bound "
                              f"(more than 10 distinct downstream conditions)")
