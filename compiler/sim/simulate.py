"""simulate(plan) -> SimResult: per program, step timings, resource and link-class busy times,
bottleneck, makespan with overlap and the serial sum (the model: sim/__init__.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..plan import Plan, PlanStep
from .direct import describe, with_direct_pool
from .base import DeviceMetadata, ResourceStat, SimOptions, StepTiming
from .blocks import block_roles, schedule_roles
from .engine import _Engine, program_steps, step_alone
from .calls import call_terms
from .meta import GAP_S, metadata_terms
from .sm_terms import with_sm_terms

PROGRAM_ORDER = ("dispatch", "combine")


@dataclass
class LinkClassStat:
    name: str  # the link's name in the schedule (blink, nic, hbm, ...)
    kind: str | None  # p2p | d2d | rdma | local
    busiest: str  # the resource instance with the most work
    work_s: float  # that instance's bytes / capacity: the class's busy time
    active_s: float  # the longest wall time any instance carried traffic
    bytes: float  # all instances
    instances: int


@dataclass
class Bottleneck:
    link_class: str
    kind: str | None
    resource: str
    work_s: float
    makespan_s: float

    @property
    def utilisation(self) -> float:
        return self.work_s / self.makespan_s if self.makespan_s > 0 else 0.0

    def describe(self) -> str:
        return (f"{self.link_class} ({self.kind or '-'}; busiest instance {self.resource}): busy "
                f"{self.work_s * 1e3:.3f} ms of {self.makespan_s * 1e3:.3f} ms = {self.utilisation * 100:.0f} %")


@dataclass
class ProgramResult:
    program: str
    steps: list[StepTiming]
    makespan_s: float
    serial_s: float
    resources: dict[str, ResourceStat]
    link_classes: dict[str, LinkClassStat]
    bottleneck: Bottleneck | None
    critical_path: list[str]
    events: int
    launch_s: float = 0.0  # kernel launch and metadata passes before the first step (the direct kernels; in makespan and serial)
    # the table-driven kernels' metadata on the GPU, seconds per part (sim/meta.py), in launch_s
    metadata: dict[str, float] = field(default_factory=dict)
    # the Buffer call's copies around the kernels, seconds per part (sim/calls.py), in launch_s
    calls: dict[str, float] = field(default_factory=dict)

    def step(self, name: str) -> StepTiming:
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"{self.program}.{name}")


@dataclass
class SimResult:
    schedule: str
    routing: str
    num_ranks: int
    programs: dict[str, ProgramResult] = field(default_factory=dict)
    options: SimOptions = field(default_factory=SimOptions)
    # The SM model applied (sim/direct.py describe): model = direct | roles | links, and a text
    sm_model: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        """Dispatch and combine back to back (expert compute between them is not modelled)."""
        return sum(p.makespan_s for p in self.programs.values())

    @property
    def serial_s(self) -> float:
        return sum(p.serial_s for p in self.programs.values())

    @property
    def steps(self) -> list[StepTiming]:
        return [s for p in self.programs.values() for s in p.steps]

    def step(self, name: str, program: str = "dispatch") -> StepTiming:
        return self.programs[program].step(name)

    @property
    def bottleneck(self) -> Bottleneck | None:
        """Over the programs together: the link class with the most busy time in all of them."""
        if not self.programs:
            return None
        if len(self.programs) == 1:
            return next(iter(self.programs.values())).bottleneck
        work: dict[tuple[str, str | None], dict[str, float]] = {}
        for p in self.programs.values():
            for r in p.resources.values():
                d = work.setdefault((r.link_class, r.link_kind), {})
                d[r.name] = d.get(r.name, 0.0) + r.work_s
        best = None
        for (cls, kind), per in work.items():
            res, w = max(per.items(), key=lambda kv: (kv[1], kv[0]))
            if best is None or (w, cls) > (best.work_s, best.link_class):
                best = Bottleneck(cls, kind, res, w, self.total_s)
        return best

    def link_busy_s(self) -> dict[str, float]:
        """Per link class, over all programs: the busiest instance's bytes / capacity."""
        per: dict[str, dict[str, float]] = {}
        for p in self.programs.values():
            for r in p.resources.values():
                d = per.setdefault(r.link_class, {})
                d[r.name] = d.get(r.name, 0.0) + r.work_s
        return {cls: max(d.values()) for cls, d in per.items()}


def link_class_of(resource: str, steps_using: list[PlanStep]) -> tuple[str, str | None]:
    """`link:<name>:...` -> name; `hbm:<rank>` -> the local link its steps name (hbm by default);
    `sm:...` (a role's or a direct kernel's pool of SMs) -> sm; `engine:<link>.<engine>:...` (a
    copy engine slower than its link) -> `<link> <engine>`; `pack:` / `unpack:` (the GPU proxy
    path's blocks of an RDMA step) -> rdma pack / rdma unpack; `post:` (a rank's proxy thread) ->
    rdma proxy."""
    kinds = [s.link_kind for s in steps_using if s.link_kind]
    kind = kinds[0] if kinds else None
    if resource.startswith("sm:"):  # a role's SMs (sim/sm_terms.py)
        return "sm", "sm"
    if resource.startswith("window:"):  # an RDMA channel's credit window
        links = sorted({s.link for s in steps_using if s.link})
        return f"{'/'.join(links) or 'rdma'} window", kind
    if resource.startswith(("pack:", "unpack:")):  # the GPU proxy path's pack or unpack blocks
        return f"rdma {resource.split(':')[0]}", "sm"
    if resource.startswith("post:"):  # a rank's proxy thread, posting one chunk after another
        return "rdma proxy", kind
    if resource.startswith("engine:"):  # the copy engine a step runs on, below the link's rate (engine-selection)
        link, engine = resource.split(":")[1].split(".", 1)
        return f"{link} {engine}", kind
    if resource.startswith("atomics:"):  # fp32 adds into a peer over a link (the link's `atomics`)
        return f"{resource.split(':')[1]} atomics", kind
    if resource.startswith("link:"):
        return resource.split(":")[1], kind
    # a rank's memory: the local link its local steps name (the direct kernels' sends write it too)
    local = sorted({s.link for s in steps_using if s.link and s.link_kind == "local"})
    if resource.startswith("hbm:") and local:
        return "/".join(local), "local"
    links = sorted({s.link for s in steps_using if s.link})
    return ("/".join(links) if links else resource.split(":")[0]), (kind or "local")


def simulate_program(plan: Plan, program: str, steps: list[PlanStep], opts: SimOptions,
                     other_names: set[str], launch_s: float = 0.0,
                     metadata: dict[str, float] | None = None, calls: dict[str, float] | None = None,
                     roles: dict[tuple[str, str], tuple[int, float]] | None = None) -> ProgramResult:
    """One program's simulation; with `roles` (sim/blocks.py block_roles) and opts.layout, its
    roles' blocks timed over each fluid run and the flows held until their blocks publish their
    last chunk, run again until the holds stay (at most once per step)."""
    timed = bool(roles) and opts.layout is not None and any((s.program, s.name) in roles for s in steps)
    eng = _Engine(steps, plan.resources, opts, other_names, start_s=launch_s, trace_flows=timed).run()
    holds: dict[tuple[int, int], float] = {}
    for _ in range(len(steps) if timed else 0):
        new, _ = schedule_roles(steps, eng, opts.layout.copies, roles, opts.dealing)
        if new.keys() == holds.keys() and all(abs(new[k] - holds[k]) <= 1e-12 for k in new):
            break
        holds = new
        eng = _Engine(steps, plan.resources, opts, other_names, start_s=launch_s, holds=holds, trace_flows=True).run()
    timings: list[StepTiming] = []
    for i, s in enumerate(steps):
        timings.append(StepTiming(
            s.name, s.program, s.verb, s.link, s.link_kind, tuple(s.deps), tuple(s.pipelined_deps),
            float(eng.ready_t[i]), float(eng.start_t[i]), float(eng.end_t[i]), s.total_bytes,
            s.max_rank_bytes(), max(1, int(s.num_chunks or 1)), eng.chunk_times(i),
            step_alone(s, plan.resources, opts),
            moves_bytes=any(f.resources and f.bytes > 0 for f in s.flows), engine=s.engine))
    makespan = max((t.end_s for t in timings), default=launch_s)
    serial = launch_s + sum(t.alone_s for t in timings)

    users: dict[str, list[PlanStep]] = {}
    for s in steps:
        for f in s.flows:
            for r in f.resources:
                lst = users.setdefault(r, [])
                if not lst or lst[-1] is not s:
                    lst.append(s)
    resources: dict[str, ResourceStat] = {}
    for j, name in enumerate(eng.res_names):
        cls, kind = link_class_of(name, users.get(name, []))
        resources[name] = ResourceStat(name, cls, kind, float(eng.cap[j]), float(eng.res_bytes[j]),
                                       float(eng.res_active[j]))
    classes: dict[str, LinkClassStat] = {}
    for r in sorted(resources.values(), key=lambda r: r.name):
        lc = classes.get(r.link_class)
        if lc is None:
            classes[r.link_class] = LinkClassStat(r.link_class, r.link_kind, r.name, r.work_s, r.active_s, r.bytes, 1)
            continue
        lc.instances += 1
        lc.bytes += r.bytes
        lc.active_s = max(lc.active_s, r.active_s)
        if r.work_s > lc.work_s * (1 + 1e-9):
            lc.busiest, lc.work_s = r.name, r.work_s
    bottleneck = None
    if classes:
        lc = max(classes.values(), key=lambda c: (c.work_s, c.active_s, c.name))
        bottleneck = Bottleneck(lc.name, lc.kind, lc.busiest, lc.work_s, makespan)

    # Critical path: from the last step to finish, back through the dependency that ended last.
    path: list[str] = []
    by_name = {t.name: t for t in timings}
    if timings:
        cur = max(timings, key=lambda t: (t.end_s, -timings.index(t)))
        while cur is not None:
            path.append(cur.name)
            cur.critical = True
            preds = [by_name[d] for d in cur.deps if d in by_name]
            cur = max(preds, key=lambda t: t.end_s) if preds else None
        path.reverse()
    return ProgramResult(program, timings, makespan, serial, resources, classes, bottleneck, path, eng.events,
                         launch_s, dict(metadata or {}), dict(calls or {}))


def with_sm_model(plan: Plan, opts: SimOptions) -> tuple[Plan, dict[str, float], dict[str, dict[str, float]]]:
    """The plan with the SM model of `opts` applied (the direct kernels' pools, or the table-driven
    kernels' roles), the launch time before each program's first step, and per program the parts
    of the table-driven kernels' metadata on the GPU in it (sim/meta.py; with opts.metadata)."""
    if opts.direct is not None:
        return (*with_direct_pool(plan, opts.direct), {})
    roles = with_sm_terms(plan, rdma_proxy=opts.rdma_proxy)
    if opts.metadata is None:
        return roles, {}, {}
    terms = metadata_terms(plan, opts.metadata)
    return without_metadata_steps(roles, opts.metadata), {"dispatch": sum(terms.values())}, {"dispatch": terms}


def without_metadata_steps(plan: Plan, meta: DeviceMetadata) -> Plan:
    """The plan with the steps whose work the metadata kernels do (meta.steps) costing nothing:
    their flows move no bytes and wait no latency (the kernels' time is the dispatch's launch)."""
    done = set(meta.steps)
    steps = [dataclasses.replace(s, flows=[dataclasses.replace(f, bytes=0.0, latency_s=0.0) for f in s.flows])
             if (s.program, s.name) in done else s for s in plan.steps]
    return dataclasses.replace(plan, steps=steps)


def simulate(plan: Plan, opts: SimOptions | None = None) -> SimResult:
    """Simulate every program of the plan (dispatch, then combine if present), each from t = 0
    (its first steps ready after its kernel launches, where the SM model counts them)."""
    opts = opts or SimOptions()
    model = describe(plan, opts.direct)
    if opts.direct is None and opts.metadata is not None:
        m = opts.metadata
        model = {**model, "text": model["text"] + "; metadata kernels on the GPU before the dispatch (sim/meta.py)",
                 "metadata": {"blocks": {"meta_count": m.count_blocks, "meta_scan": m.scan_blocks,
                                         "meta_rows": m.rows_blocks, "meta_items": m.items_blocks},
                              "exchange": m.exchange,
                              "fused": m.fused, "steps": [f"{p}.{s}" for p, s in m.steps]}}
    calls = (call_terms(plan, GAP_S, opts.caller_rows, opts.zero_beside, opts.convert_in_kernel)
             if opts.calls and opts.direct is None else {})
    roles = block_roles(plan, opts.rdma_proxy) if opts.direct is None and opts.layout is not None else {}
    if roles:
        model = {**model, "text": model["text"] + f"; each role's chunks dealt {opts.dealing} to its blocks "
                                                  f"(sim/blocks.py)", "dealing": opts.dealing}
    plan, launches, metadata = with_sm_model(plan, opts)
    for p, parts in calls.items():  # the copies run in stream order with the kernels: before or after, time added
        launches[p] = launches.get(p, 0.0) + sum(parts.values())
    res = SimResult(plan.schedule, plan.routing, plan.num_ranks, options=opts, sm_model=model)
    progs = program_steps(plan)
    order = [p for p in PROGRAM_ORDER if p in progs] + sorted(p for p in progs if p not in PROGRAM_ORDER)
    for p in order:
        others = {s.name for q, ss in progs.items() if q != p for s in ss}
        res.programs[p] = simulate_program(plan, p, progs[p], opts, others, launches.get(p, 0.0), metadata.get(p),
                                           calls.get(p), roles)
    return res


def simulate_subset(plan: Plan, names: list[str] | tuple[str, ...], program: str = "dispatch",
                    opts: SimOptions | None = None) -> ProgramResult:
    """A group of steps with the machine to themselves (e.g. one phase of a seed's estimate):
    dependencies on steps outside the group count as done; those inside are kept (pipelined or
    not, as the plan says)."""
    opts = opts or SimOptions()
    wanted = set(names)
    steps = [s for s in plan.steps if s.program == program and s.name in wanted]
    missing = wanted - {s.name for s in steps}
    if missing:
        raise KeyError(f"no step(s) {', '.join(sorted(missing))} in {program}")
    sub = [dataclasses.replace(s, deps=tuple(d for d in s.deps if d in wanted),
                               pipelined_deps=tuple(d for d in s.pipelined_deps if d in wanted)) for s in steps]
    others = {s.name for s in plan.steps if s.program == program and s.name not in wanted}
    p, _, _ = with_sm_model(dataclasses.replace(plan, steps=sub), opts)  # no launches: the group alone
    sub = p.steps
    return simulate_program(p, program, sub, opts, others)
