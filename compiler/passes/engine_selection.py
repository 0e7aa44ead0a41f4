"""engine-selection: which copy engine runs each step, where its link offers several.

A link may declare the copy engines that can drive it and the rate each reaches over it,
`engines spc 27.9 GB/s, dma 15 GB/s` (seed 000 on BR166: BLink send/recv moves 27.9 GB/s when the
compute clusters (SPC) copy and ~15 GB/s on the DMA engine; the fused all-gather 128.6 against
88 GB/s).  For every step over such a link, dispatch and combine alike, the cost model times the
step alone on each engine: its flows bounded by the link's ports (bandwidth x lanes x
efficiency), by the engine's rate per rank pair, and, for a thread engine (sm, spc, tma) of a step
that names its `sms`, by those SMs x the topology's per-SM rate of the step's work (`sm` line).
The fastest engine wins; where they tie (within 1e-9), the link's `engine` (the first of
`engines` unless it names one).  A step's `engine` option overrides the cost model (the
reverse of a dispatch step that names one runs on it too), and its reason says both times.

What is chosen is what runs and what is charged: `PlanStep.engine` (kernel-formation makes a
DMA step a role of the `<program>_dma` queue, a thread-engine step a role of the persistent
kernel; chunk-pipeline ramps only thread-engine roles) and `PlanStep.engine_why`; where the
chosen engine's rate is below the link's, each flow also occupies
`engine:<link>.<engine>:<src>><dst>` at that rate, so overlap-schedule and `epcc simulate` see
the same bound the choice was made with.  A step over a link of one engine gets that engine and
no reason.

Not modelled: that a DMA copy leaves the compute clusters to the experts (the seed's "传算并行",
communication beside computation), and the DMA engine's cost per descriptor (the seed finds DMA
at token granularity, thousands of calls, infeasible).  Name `engine dma` where either matters.

IR: the step op's `engine` becomes the chosen one; `epcc.engine_choice = {engine, why}` on steps
over a link with `engines`.
"""

from __future__ import annotations

from dataclasses import replace

from ..costmodel.rates import THREAD_ENGINES, work_of
from ..ir import query
from ..plan import Plan, PlanStep
from ..sema import model
from . import Pass, PassContext, register
from .overlap_schedule import busy_time

TIE = 1e-9  # relative: times this close are a tie, the link's own engine wins


def engine_resource(link: str, engine: str, src: int, dst: int) -> str:
    return f"engine:{link}.{engine}:{src}>{dst}"


def file_step(sched: model.Schedule, ps: PlanStep) -> model.Step | None:
    """The step of the file that a plan step runs: its own, or for a derived combine step the
    dispatch step it returns."""
    prog = sched.dispatch if ps.program == "dispatch" or ps.reverse_of else sched.combine
    name = ps.reverse_of or ps.name
    if prog is None:
        return None
    try:
        return prog.step(name)
    except KeyError:
        return None


def engine_time(plan: Plan, ps: PlanStep, link: model.LinkInfo, engine: str) -> float:
    """Seconds the step's busiest resource takes alone when `engine` copies its rows."""
    capacity = dict(plan.resources)
    rate = link.engine_rates.get(engine)
    rates = plan.sm_rates
    work = work_of(ps, rates)
    per_sm = rates.get(work) if engine in THREAD_ENGINES and ps.sms else None
    flows = []
    for f in ps.flows:
        extra = []
        if rate is not None:
            name = engine_resource(link.name, engine, f.src, f.dst)
            capacity[name] = rate
            extra.append(name)
        if per_sm:
            name = f"sms:{f.rank}"
            capacity[name] = ps.sms * per_sm
            extra.append(name)
        flows.append(replace(f, resources=f.resources + tuple(extra)))
    return busy_time(replace(ps, flows=flows), capacity)


def _time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.3f} us"


def _rate_text(plan: Plan, ps: PlanStep, link: model.LinkInfo, engine: str) -> str:
    """`spc 27.9 GB/s (link 20 GB/s binds)`: the engine's rate and what else bounds it."""
    rate = link.engine_rates[engine]
    wire = link.effective_bandwidth
    bound = f" (link {wire / 1e9:g} GB/s binds)" if wire < rate else ""
    per_sm = plan.sm_rates.get(work_of(ps, plan.sm_rates))
    if engine in THREAD_ENGINES and ps.sms and per_sm:
        bound += f" (at most {ps.sms} x {per_sm / 1e9:g} GB/s per rank)"
    return f"{engine} {rate / 1e9:g} GB/s{bound}"


def choose(plan: Plan, ps: PlanStep, link: model.LinkInfo, named: str | None, named_line: int) -> tuple[str, str]:
    """(engine, why) of a step over a link with `engines` (module docstring)."""
    times = {e: engine_time(plan, ps, link, e) for e in link.engine_rates}
    listing = "; ".join(f"{_rate_text(plan, ps, link, e)}: {_time(t)}" for e, t in times.items())
    if named is not None:
        return named, f"engine {named} (step option, line {named_line}); cost model: {listing}"
    best = min(times.values())
    fastest = [e for e, t in times.items() if t <= best * (1 + TIE)]
    engine = link.engine if link.engine in fastest else fastest[0]
    verdict = f"fastest: {engine}" if len(fastest) == 1 else f"tie: {engine}, the link's engine"
    return engine, f"{listing}; {verdict}"


def bind(plan: Plan, ps: PlanStep, link: model.LinkInfo) -> None:
    """The chosen engine's rate on each flow where it is below the link's (module docstring)."""
    rate = link.engine_rates.get(ps.engine or "")
    if rate is None or rate >= link.effective_bandwidth:
        return
    flows = []
    for f in ps.flows:
        if not f.resources:
            flows.append(f)
            continue
        name = engine_resource(link.name, ps.engine, f.src, f.dst)
        plan.resources[name] = rate
        flows.append(replace(f, resources=f.resources + (name,)))
    ps.flows = flows


@register
class EngineSelection(Pass):
    name = "engine-selection"
    description = "the copy engine of every step: the fastest of its link's engines, or the one it names"

    def run(self, module, ctx: PassContext) -> None:
        sched = ctx.schedule
        plan: Plan = ctx.get("plan")
        links = sched.topology.links
        for ps in plan.steps:
            if ps.verb == "exchange":
                continue
            link = links.get(ps.link or "")
            if link is None:
                ps.engine = model.DEFAULT_ENGINE["local"]
                continue
            if not link.engine_rates:
                ps.engine = link.engine
                continue
            st = file_step(sched, ps)
            named = st.engine if st is not None else None
            line = st.opt_spans["engine"].line if named is not None else 0
            ps.engine, ps.engine_why = choose(plan, ps, link, named, line)
            bind(plan, ps, link)
        self._annotate(module, plan)

    @staticmethod
    def _annotate(module, plan: Plan) -> None:
        for program in ("dispatch", "combine"):
            prog = query.program_module(module, program)
            if prog is None:
                continue
            ops = query.step_ops(prog)
            for ps in plan.program_steps(program):
                op = ops.get(ps.name)
                if op is None or ps.engine is None or "engine" not in op.attributes:
                    continue
                op.attributes["engine"] = query.to_attr(ps.engine)
                if ps.engine_why:
                    query.annotate(op, "engine_choice", {"engine": ps.engine, "why": ps.engine_why})
